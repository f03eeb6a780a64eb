"""The one dispatcher behind the public API.

Two PyTorch custom ops, ``volta_train::attention_forward`` and
``volta_train::attention_backward``, wrap whichever backend runs the call: the
Volta kernel (``volta_train.kernels``) where it is available and supports the
call, otherwise the reference backend (``volta_train._reference``). Being custom
ops with fake implementations and a registered autograd formula, they work
under autograd, ``torch.compile`` and CUDA graphs.

``VOLTA_TRAIN_BACKEND`` picks the policy: ``auto`` (default), ``kernel`` (raise
if the kernel cannot run the call) or ``reference``. Which backend ran, and why,
is logged once per distinct reason.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from . import _reference as reference
from . import kernels

logger = logging.getLogger("volta_train")

BACKEND_ENV = "VOLTA_TRAIN_BACKEND"
BACKEND_CHOICES = ("auto", "kernel", "reference")
ACCUM_CHOICES = ("fp32", "fp16")
_INT64_WRAP = 1 << 64
_logged_reasons: set[tuple[str, str]] = set()


class BackendUnavailableError(RuntimeError):
    """VOLTA_TRAIN_BACKEND=kernel was asked for, but the kernel cannot run this call."""


@dataclass(frozen=True)
class Choice:
    backend: str  # "kernel" or "reference"
    reason: str


def backend_policy() -> str:
    policy = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if policy not in BACKEND_CHOICES:
        raise ValueError(f"{BACKEND_ENV}={policy!r}; accepted: {', '.join(BACKEND_CHOICES)}")
    return policy


def choose_backend(call: kernels.CallDescription) -> Choice:
    policy = backend_policy()
    if policy == "reference":
        return Choice("reference", f"{BACKEND_ENV}=reference")
    why_not = kernels.unsupported_reason(call)
    if why_not is None:
        return Choice("kernel", f"fp16 on {call.device_name} (sm_{call.arch}) is supported by the Volta kernel")
    if policy == "kernel":
        raise BackendUnavailableError(f"{BACKEND_ENV}=kernel, but the Volta kernel cannot run this call: {why_not}")
    return Choice("reference", why_not)


def _log_choice(choice: Choice, pass_name: str, on_gpu: bool) -> None:
    key = (choice.backend, choice.reason)
    if key in _logged_reasons:
        return
    _logged_reasons.add(key)
    level = logging.WARNING if (on_gpu and choice.backend == "reference") else logging.INFO
    logger.log(level, "volta_train attention %s: %s backend (%s)", pass_name, choice.backend, choice.reason)


def _describe_call(q, k, v, cu_seqlens_q, causal, window, alibi, dropout_p, accum, softmax_scale, extra=()):
    aligned = q.is_cuda and kernels.support.tensors_aligned(q, k, v, *extra)
    return kernels.CallDescription(
        device=q.device,
        dtype=q.dtype,
        head_dim=q.shape[-1],
        varlen=cu_seqlens_q is not None,
        causal=causal,
        window=window,
        alibi=alibi is not None,
        dropout=dropout_p > 0.0,
        accum=accum,
        aligned=aligned,
        positive_scale=softmax_scale > 0,
    )


def _params(softmax_scale, causal, window_left, window_right, dropout_p, seed, offset):
    return reference.AttentionParams(
        softmax_scale=softmax_scale,
        causal=causal,
        window_left=window_left,
        window_right=window_right,
        dropout_p=dropout_p,
        seed=seed % _INT64_WRAP,
        offset=offset % _INT64_WRAP,
    )


@torch.library.custom_op("volta_train::attention_forward", mutates_args=())
def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    alibi_slopes: torch.Tensor | None,
    dropout_p: float,
    seed: int,
    offset: int,
    accum: str,
    bwd_accum: str,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out, lse); lse is fp32 [B, H, Nq] (dense) or [H, total_q] (varlen)."""
    window = (window_left, window_right)
    call = _describe_call(q, k, v, cu_seqlens_q, causal, window, alibi_slopes, dropout_p, accum, softmax_scale)
    choice = choose_backend(call)
    _log_choice(choice, "forward", q.is_cuda)
    params = _params(softmax_scale, causal, window_left, window_right, dropout_p, seed, offset)
    if choice.backend == "kernel":
        out, lse = kernels.forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, params, alibi_slopes, accum
        )
    elif cu_seqlens_q is not None:
        out, lse = reference.reference_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, params, alibi_slopes)
    else:
        out, lse = reference.reference_forward(q, k, v, params, alibi_slopes)
    # Contiguous whatever the backend computed in: the fake below promises exactly these strides, and
    # torch.compile plans the views that follow from the fake.
    return out.contiguous(), lse.contiguous()


@attention_forward.register_fake
def _attention_forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *args):
    # Contiguous, as the real op returns them (new_empty does not copy q's strides).
    out = q.new_empty(q.shape[:-1] + (v.shape[-1],))
    if cu_seqlens_q is not None:
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    else:
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    return out, lse


@torch.library.custom_op("volta_train::attention_backward", mutates_args=())
def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    alibi_slopes: torch.Tensor | None,
    dropout_p: float,
    seed: int,
    offset: int,
    bwd_accum: str,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    window = (window_left, window_right)
    call = _describe_call(
        q, k, v, cu_seqlens_q, causal, window, alibi_slopes, dropout_p, bwd_accum, softmax_scale, (dout, out)
    )
    call = kernels.CallDescription(**{**call.__dict__, "backward": True, "deterministic": deterministic})
    choice = choose_backend(call)
    _log_choice(choice, "backward", q.is_cuda)
    params = _params(softmax_scale, causal, window_left, window_right, dropout_p, seed, offset)
    if choice.backend == "kernel":
        grads = kernels.backward(
            dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, params,
            alibi_slopes, bwd_accum, deterministic,
        )
    elif cu_seqlens_q is not None:
        grads = reference.reference_varlen_backward(
            dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, params, alibi_slopes
        )
    else:
        grads = reference.reference_backward(dout, q, k, v, out, lse, params, alibi_slopes)
    dq, dk, dv = grads
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@attention_backward.register_fake
def _attention_backward_fake(dout, q, k, v, *args):
    # Contiguous like the real op (empty_like would copy q's possibly permuted strides).
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_FORWARD_ARGS = (
    "q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal",
    "window_left", "window_right", "alibi_slopes", "dropout_p", "seed", "offset", "accum", "bwd_accum", "deterministic",
)


def _setup_context(ctx, inputs, output):
    named = dict(zip(_FORWARD_ARGS, inputs))
    out, lse = output
    ctx.save_for_backward(
        named["q"], named["k"], named["v"], out, lse, named["cu_seqlens_q"], named["cu_seqlens_k"],
        named["alibi_slopes"],
    )
    ctx.options = {
        name: named[name]
        for name in (
            "max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal", "window_left", "window_right",
            "dropout_p", "seed", "offset", "bwd_accum", "deterministic",
        )
    }
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes = ctx.saved_tensors
    o = ctx.options
    dq, dk, dv = attention_backward(
        dout.contiguous() if dout.stride(-1) != 1 else dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
        o["max_seqlen_q"], o["max_seqlen_k"], o["softmax_scale"], o["causal"], o["window_left"], o["window_right"],
        alibi_slopes, o["dropout_p"], o["seed"], o["offset"], o["bwd_accum"], o["deterministic"],
    )
    return (dq, dk, dv) + (None,) * (len(_FORWARD_ARGS) - 3)


torch.library.register_autograd("volta_train::attention_forward", _backward, setup_context=_setup_context)


def draw_dropout_seed_offset(device: torch.device) -> tuple[int, int]:
    """(seed, offset) for one dropout call, taken from PyTorch's generator of that device.

    CUDA: the device generator's seed and Philox offset, which is then advanced, as
    PyTorch's own fused kernels do, so torch.manual_seed reproduces a run. Other
    devices: a 63-bit seed drawn from the default CPU generator, offset 0.
    """
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            raise NotImplementedError(
                "dropout_p > 0 inside CUDA graph capture: the Philox offset would be frozen into the graph and every "
                "replay would reuse one dropout mask; capture with dropout_p=0.0"
            )
        index = device.index if device.index is not None else torch.cuda.current_device()
        generator = torch.cuda.default_generators[index]
        offset = generator.get_offset()
        generator.set_offset(offset + 4)
        return generator.initial_seed(), offset
    seed = int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64).item())
    return seed, 0


def to_op_int(value: int) -> int:
    """Reinterpret an unsigned 64-bit value as the signed int64 a custom op carries."""
    value %= _INT64_WRAP
    return value - _INT64_WRAP if value >= (1 << 63) else value
