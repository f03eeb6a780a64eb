"""Lean RMSNorm: an RMSNorm whose forward is the module's own, op for op, but which saves only the input (the
tensor the caller already keeps), the per-row reciprocal RMS and the weight, and whose backward works over chunks
of rows, so that no fp32 tensor of the full ``[tokens, width]`` size is saved or created.

transformers' RMSNorms compute in eager PyTorch ``h = x.to(float32) * rsqrt(h.pow(2).mean(-1) + eps)`` and then
one of the :data:`FORMS`: ``weight * h.to(x.dtype)`` (``LlamaRMSNorm`` and the many families that copy it),
``(h * (1.0 + weight.float())).to(x.dtype)`` (``GemmaRMSNorm``, Gemma2, Gemma3 and their copies) or
``(h * weight.float()).to(x.dtype)`` (``Gemma3nRMSNorm``, ``Olmo2RMSNorm``'s ``(weight * h).to(x.dtype)``).
Autograd saves the fp32 upcast of a 16-bit input and the normalised rows (fp32, or their 16-bit cast), then
creates several fp32 ``[tokens, width]`` temporaries at once in the backward. :class:`RMSNormFunction` runs the
same ops in the same order in its forward (the output is bit-identical) and recomputes the normalised rows per
chunk in its backward.

:func:`swap_rms_norms` replaces the ``forward`` of each module that looks like such a norm, after checking on a
probe that the function reproduces the module's own forward bit for bit in one of the forms (tried in order);
modules whose forward differs in all keep theirs, named in the log. The probe runs on a shallow copy of the module
holding a random weight of the module's shape and dtype, never on the module's own weight: it needs no gathered
ZeRO-3 parameter (no collective), works on a model built on the meta device (probed on the CPU) and leaves the
random generators alone. ``__call__`` is untouched, so module hooks (DeepSpeed's gathers, offload) keep firing.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import types
from dataclasses import dataclass
from typing import Callable

import torch

log = logging.getLogger(__name__)

MODES = ("auto", "on", "off")
# fp32 bytes of one [rows, width] temporary of the backward: rows per chunk = CHUNK_BYTES // (4 x width)
CHUNK_BYTES = 64 * 2**20
_EPS_NAMES = ("variance_epsilon", "eps")
_ATTR = "_volta_lean_norm"
_DIFFERS = "output differs from the module's forward"


# The forms the lean function computes, by name: what multiplies the normalised fp32 rows ``h`` (the row scale
# applied) and where the cast back to the input's dtype ``d`` happens.
FORMS = {
    "llama": "weight * h.to(d)",  # LlamaRMSNorm and its copies
    "offset": "(h * (1.0 + weight.float())).to(d)",  # GemmaRMSNorm and its copies
    # Gemma3nRMSNorm(with_scale=True); also Olmo2RMSNorm's (weight * h).to(d), the same product once promoted
    "fp32 weight": "(h * weight.float()).to(d)",
}


class RMSNormFunction(torch.autograd.Function):
    """The norm of ``form`` (a key of :data:`FORMS`) with h = x.float() * rsqrt(mean(x.float()^2, -1) + eps).
    apply(x, weight, eps, form)."""

    @staticmethod
    def forward(ctx, x, weight, eps, form):
        input_dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        rstd = torch.rsqrt(variance + eps)
        h = h * rstd
        ctx.save_for_backward(x, rstd, weight)
        ctx.form = form
        if form == "llama":
            return weight * h.to(input_dtype)
        return (h * _fp32_scale(weight, form)).to(input_dtype)

    @staticmethod
    def backward(ctx, grad):
        x, rstd, weight = ctx.saved_tensors
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        llama = ctx.form == "llama"
        scale = None if llama or not want_x else _fp32_scale(weight, ctx.form)
        width = x.shape[-1]
        x2, g2, r2 = x.reshape(-1, width), grad.reshape(-1, width), rstd.reshape(-1, 1)
        dx = torch.empty(x2.shape, dtype=x.dtype, device=x.device) if want_x else None
        dw = torch.zeros(width, dtype=torch.float32, device=x.device) if want_w else None
        step = rows_per_chunk(width)
        kind = x.device.type
        off = torch.autocast(kind, enabled=False) if torch.amp.is_autocast_available(kind) else contextlib.nullcontext()
        with off:
            for start in range(0, x2.shape[0], step):
                xs, gs, rs = x2[start:start + step], g2[start:start + step], r2[start:start + step]
                xhat = xs.to(torch.float32) * rs  # the forward's normalised rows, bit for bit
                if not llama:  # eager: the final cast's backward brings the gradient to fp32
                    gs = gs.to(torch.float32)
                if want_w:  # eager: the sum over the rows of grad * (what multiplies the weight); here in fp32
                    dw += (gs * (xhat.to(x.dtype) if llama else xhat)).sum(0, dtype=torch.float32)
                if want_x:
                    # llama: grad * weight, cast to the input's dtype (the cast's input), then to fp32
                    dxhat = (gs * weight).to(x.dtype).to(torch.float32) if llama else gs * scale
                    mean = (dxhat * xhat).mean(-1, keepdim=True)
                    dx[start:start + step] = dxhat.sub_(xhat.mul_(mean)).mul_(rs)
        return (dx.view(x.shape) if want_x else None), (dw.to(weight.dtype) if want_w else None), None, None


def _fp32_scale(weight: torch.Tensor, form: str) -> torch.Tensor:
    """What multiplies the fp32 normalised rows in the forms other than llama, as the modules compute it."""
    if form == "offset":
        return 1.0 + weight.float()
    if form == "fp32 weight":
        return weight.float()
    raise ValueError(f"form must be one of {', '.join(map(repr, FORMS))}, got {form!r}")


def rows_per_chunk(width: int) -> int:
    """Rows per chunk of the backward for a norm ``width`` wide: CHUNK_BYTES of fp32 per temporary."""
    return max(1, CHUNK_BYTES // (4 * max(1, width)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, form: str = "llama") -> torch.Tensor:
    """The output of the norm of ``form`` (LlamaRMSNorm's by default; a key of :data:`FORMS`) for ``x``, ``weight``
    and ``eps``, through :class:`RMSNormFunction`."""
    if form not in FORMS:
        raise ValueError(f"form must be one of {', '.join(map(repr, FORMS))}, got {form!r}")
    return RMSNormFunction.apply(x, weight, eps, form)


@dataclass
class _Swap:
    """What swap_rms_norms changed on one module: the instance's own forward before (None: the class's), the name
    of its epsilon attribute, the form its forward computes (a key of :data:`FORMS`)."""
    original: Callable | None
    eps_name: str
    form: str = "llama"


def _lean_forward(self, hidden_states):
    swap = getattr(self, _ATTR)
    return RMSNormFunction.apply(hidden_states, self.weight, getattr(self, swap.eps_name), swap.form)


def _eps_name(module: torch.nn.Module) -> str | None:
    for name in _EPS_NAMES:
        value = getattr(module, name, None)
        if isinstance(value, float):
            return name
    return None


def _unlike(module: torch.nn.Module) -> str:
    """'' if the module (a class name ending in RMSNorm) is shaped like the norms of :data:`FORMS`, else why not."""
    if _eps_name(module) is None:
        return "no float variance_epsilon or eps"
    params = dict(module.named_parameters(recurse=False))
    weight = params.get("weight")
    shape = getattr(weight, "ds_shape", None) or getattr(weight, "shape", ())
    if list(params) != ["weight"] or len(shape) != 1:
        return "its parameters are not one 1-D weight"
    return "it has sub-modules" if next(module.children(), None) is not None else ""


def is_candidate(module: torch.nn.Module) -> bool:
    """A module that looks like an RMSNorm of :data:`FORMS`: class name ending in RMSNorm, one 1-D parameter
    ``weight``, no sub-modules, a float ``variance_epsilon`` or ``eps``."""
    return type(module).__name__.endswith("RMSNorm") and not _unlike(module)


def _own_forward(module: torch.nn.Module) -> Callable | None:
    """The function the module's forward runs (its class's, or one bound on the instance), None if unknown."""
    forward = module.__dict__.get("forward")
    if forward is None:
        return type(module).forward
    if isinstance(forward, types.MethodType) and forward.__self__ is module:
        return forward.__func__
    return None


def _probe_inputs(width: int, generator: torch.Generator) -> torch.Tensor:
    """[2, 4, width] fp32 rows at several scales: random mantissas at 1, 1e3 and 1e-3, rows near eps, zeros and
    values close to one (ties in the casts)."""
    x = torch.randn(8, width, generator=generator, dtype=torch.float32, device="cpu")
    x[1] *= 1e3
    x[2] *= 1e-3
    x[3] *= 1e-4
    x[4] = 0.0
    x[5] = 1.0 + x[5] * 2.0**-9
    x[6] = x[6].round() / 8.0 + 2.0**-12
    return x.view(2, 4, width)


def probe(module: torch.nn.Module) -> tuple[str, str]:
    """(form, '') for the first form of :data:`FORMS` whose :class:`RMSNormFunction` gives the module's own forward
    output bit for bit, else ('', why not).

    On a shallow copy of the module holding a random weight of its shape (the module's own weight is not read), on
    its device (the CPU for the meta device), for the weight's dtype and fp32, inputs in fp32, bf16, fp16 and the
    weight's dtype, and in fp32 under the device's autocast."""
    forward = _own_forward(module)
    if forward is None:
        return "", "its forward is replaced by something else"
    eps_name = _eps_name(module)
    eps = getattr(module, eps_name)
    weight = module.weight
    width = int((getattr(weight, "ds_shape", None) or weight.shape)[0])
    device = torch.device("cpu") if weight.device.type == "meta" else weight.device
    stand_in = copy.copy(module)
    stand_in._parameters = dict(module._parameters)
    stand_in.__dict__.pop("forward", None)
    generator = torch.Generator(device="cpu").manual_seed(20240611)
    x32 = _probe_inputs(width, generator)
    w32 = 1.0 + 0.5 * torch.randn(width, generator=generator, dtype=torch.float32, device="cpu")
    dtypes = (torch.float32, torch.bfloat16, torch.float16, weight.dtype)
    cases = [(wd, xd, False) for wd in dict.fromkeys((weight.dtype, torch.float32)) for xd in dict.fromkeys(dtypes)]
    if torch.amp.is_autocast_available(device.type):
        cases.append((torch.float32, torch.float32, True))
    forms = list(FORMS)  # those that matched every case so far
    try:
        with torch.no_grad():
            for w_dtype, x_dtype, autocast in cases:
                w = torch.nn.Parameter(w32.to(device=device, dtype=w_dtype), requires_grad=False)
                x = x32.to(device=device, dtype=x_dtype)
                stand_in._parameters["weight"] = w
                fast = torch.float16 if device.type == "cuda" else torch.bfloat16
                with torch.autocast(device.type, dtype=fast, enabled=autocast):
                    want = forward(stand_in, x)
                    got = {form: RMSNormFunction.apply(x, w, eps, form) for form in forms}
                forms = [form for form in forms if isinstance(want, torch.Tensor) and want.dtype == got[form].dtype
                         and want.shape == got[form].shape and torch.equal(want, got[form])]
                if not forms:
                    return "", _DIFFERS
    except Exception as e:  # a forward this cannot run on a stand-in is not one this replaces
        return "", f"its forward fails on a probe ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return forms[0], ""


def swap_rms_norms(model: torch.nn.Module) -> int:
    """Replace the forward of every RMSNorm in ``model`` (see :func:`is_candidate`) whose output
    :class:`RMSNormFunction` reproduces bit for bit in one of its :data:`FORMS` (:func:`probe`) by that function;
    logs one line naming the classes swapped with their form and the classes named ``*RMSNorm`` left with why.
    Returns the number of modules swapped (those swapped before included). Call it before wrapping the model
    (DeepSpeed, DDP) or after: only instance attributes change."""
    swapped: dict[tuple[str, str], int] = {}
    left: dict[str, str] = {}
    verdicts: dict[tuple, tuple[str, str]] = {}
    for module in model.modules():
        name = type(module).__name__
        swap = getattr(module, _ATTR, None)
        if swap is not None:
            swapped[name, swap.form] = swapped.get((name, swap.form), 0) + 1
            continue
        if not name.endswith("RMSNorm"):
            continue
        unlike = _unlike(module)
        if unlike:
            left.setdefault(name, unlike)
            continue
        weight = module.weight
        # modules alike in all that the probe sees share its verdict
        key = (type(module), _own_forward(module), weight.dtype, weight.device,
               tuple(getattr(weight, "ds_shape", None) or weight.shape),
               tuple(sorted((k, v) for k, v in module.__dict__.items()
                            if not k.startswith("_") and isinstance(v, (int, float, bool, str, type(None))))))
        if key not in verdicts:
            verdicts[key] = probe(module)
        form, why = verdicts[key]
        if why:
            left.setdefault(name, why)
            continue
        original = module.__dict__.get("forward")
        setattr(module, _ATTR, _Swap(original, _eps_name(module), form))
        module.forward = types.MethodType(_lean_forward, module)
        swapped[name, form] = swapped.get((name, form), 0) + 1
    done = ", ".join(f"{count} {name} [{form}]" for (name, form), count in sorted(swapped.items())) or "none"
    kept = "; ".join(f"{name} ({why})" for name, why in sorted(left.items()))
    log.info("lean RMSNorm: swapped %s%s", done, f"; left as they are: {kept}" if kept else "")
    return sum(swapped.values())


def restore_rms_norms(model: torch.nn.Module) -> int:
    """Undo :func:`swap_rms_norms`; returns the number of modules restored."""
    count = 0
    for module in model.modules():
        swap = getattr(module, _ATTR, None)
        if swap is None:
            continue
        if swap.original is None:
            del module.forward
        else:
            module.forward = swap.original
        delattr(module, _ATTR)
        count += 1
    return count


def resolve(mode: str, tiled_mlp_on: bool) -> tuple[bool, str]:
    """(swap?, one-line reason) for the recipes' ``lean_norm`` option; auto follows the tiled MLP's decision."""
    if mode not in MODES:
        raise ValueError(f"lean_norm must be one of {', '.join(MODES)}, got {mode!r}")
    if mode != "auto":
        return mode == "on", f"lean RMSNorm {mode}"
    return tiled_mlp_on, f"lean RMSNorm auto -> {'on' if tiled_mlp_on else 'off'} (follows the tiled MLP)"


def configure(model: torch.nn.Module, mode: str, tiled_mlp_on: bool) -> int:
    """The recipes' ``lean_norm`` option: :func:`swap_rms_norms` (or :func:`restore_rms_norms`) as ``mode``
    resolves, ``tiled_mlp_on`` being whether the tiled MLP is on; returns the number of modules swapped."""
    on, why = resolve(mode, tiled_mlp_on)
    log.info("%s", why)
    if not on:
        restore_rms_norms(model)
        return 0
    return swap_rms_norms(model)
