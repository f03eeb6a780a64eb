"""The one dispatcher behind the public API.

Two PyTorch custom ops, ``volta_train::attention_forward`` and
``volta_train::attention_backward``, wrap whichever backend runs the call: the
Volta kernel (``volta_train.kernels``) where it is available and supports the
call, otherwise the reference backend (``volta_train.reference``). Being custom
ops with fake implementations and a registered autograd formula, they work
under autograd, ``torch.compile`` and CUDA graphs.

``VOLTA_TRAIN_BACKEND`` picks the policy: ``auto`` (default), ``kernel`` (raise
if the kernel cannot run the call) or ``reference``. Which backend ran, and why,
is logged once per distinct reason.

Beyond :func:`volta_train.kernels.unsupported_reason`, the dispatcher routes
flash-attn 2.8 features the kernel does not have yet to the reference backend:
see :data:`KERNEL_FEATURE_GAPS` and :func:`kernel_supports` (the kernel package
declares a feature by listing it in ``volta_train.kernels.support.KERNEL_FEATURES``).
A head_dim the kernel is not built for is zero-padded to the next one it is
(scale unchanged: the caller's), and the output and gradients sliced back;
aligned head_dims are passed through without a copy. Empty calls (no query,
key or head) are answered here, on no backend. On a V100 the backward of a
head_dim 129-256 call that PyTorch's memory-efficient backward computes alike
runs that (CUTLASS Sm70) kernel instead of the Volta one, estimated 2.3x faster
there (``volta_train.cutlass_backward``; ``VOLTA_TRAIN_D256_BACKWARD``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace

import torch

from . import cutlass_backward as efficient_backward
from . import reference as reference
from .options import AttentionOptions
from . import kernels

logger = logging.getLogger("volta_train")

BACKEND_ENV = "VOLTA_TRAIN_BACKEND"
BACKEND_CHOICES = ("auto", "kernel", "reference")
ACCUM_CHOICES = ("fp32", "fp16")
# "auto" (the default): FP16-ACC where the kernel's tile meets flash-attn's accuracy standard with it, else fp32
# (kernels.launch.resolve_bwd_accum; docs/accuracy.md)
BWD_ACCUM_CHOICES = ("auto", "fp32", "fp16")
_INT64_WRAP = 1 << 64
_logged_reasons: set[tuple[str, str]] = set()


# flash-attn 2.8 features the Volta kernel may lack, and the reason logged while it does. The kernel package
# declares one done by adding its name to volta_train.kernels.support.KERNEL_FEATURES (a frozenset of str);
# the dispatcher then passes such calls to kernels.forward/backward (softcap travels in params.softcap) or, for
# "kvcache", to kernels.forward_with_kvcache (see attention_with_kvcache below).
KERNEL_FEATURE_GAPS = {
    "softcap": "softcap > 0: the Volta kernel has no logit soft-capping yet",
    "kvcache": "flash_attn_with_kvcache: the Volta kernel has no KV-cache (decoding) path yet",
}


def kernel_supports(feature: str) -> bool:
    """True when the Volta kernel declares ``feature`` (a key of KERNEL_FEATURE_GAPS) in kernels.support."""
    if feature not in KERNEL_FEATURE_GAPS:
        raise ValueError(f"feature {feature!r}; known: {', '.join(KERNEL_FEATURE_GAPS)}")
    return feature in getattr(kernels.support, "KERNEL_FEATURES", frozenset())


def kernel_head_dim(head_dim: int) -> int | None:
    """The smallest head_dim the kernel is built for that holds ``head_dim`` (inputs are zero-padded to it)."""
    from .kernels.tiles import SUPPORTED_HEAD_DIMS

    fits = [d for d in SUPPORTED_HEAD_DIMS if d >= head_dim]
    return min(fits) if fits else None


def pad_head_dim(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """t zero-padded in its last axis to head_dim; t itself (no copy) when it already has it."""
    if t.shape[-1] == head_dim:
        return t
    return torch.nn.functional.pad(t, (0, head_dim - t.shape[-1]))


class BackendUnavailableError(RuntimeError):
    """VOLTA_TRAIN_BACKEND=kernel was asked for, but the kernel cannot run this call."""


@dataclass(frozen=True)
class Choice:
    backend: str  # "kernel", "reference", or (backward, head_dim 256 on sm_70) "cutlass-sm70": cutlass_backward
    reason: str


def backend_policy() -> str:
    policy = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if policy not in BACKEND_CHOICES:
        raise ValueError(f"{BACKEND_ENV}={policy!r}; accepted: {', '.join(BACKEND_CHOICES)}")
    return policy


def choose_backend(call: kernels.CallDescription, features: tuple[str, ...] = (), original_head_dim: int | None = None) -> Choice:
    """``features``: the KERNEL_FEATURE_GAPS keys this call needs; ``original_head_dim``: the caller's head_dim
    when ``call.head_dim`` is the padded one."""
    policy = backend_policy()
    if policy == "reference":
        return Choice("reference", f"{BACKEND_ENV}=reference")
    why_not = kernels.unsupported_reason(call)
    if why_not is None:
        why_not = next((KERNEL_FEATURE_GAPS[f] for f in features if not kernel_supports(f)), None)
    if why_not is None:
        padded = ""
        if original_head_dim is not None and original_head_dim != call.head_dim:
            padded = f"; head_dim {original_head_dim} zero-padded to {call.head_dim}"
        return Choice(
            "kernel", f"fp16 on {call.device_name} (sm_{call.arch}) is supported by the Volta kernel{padded}"
        )
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
    """The call as the kernel would run it: head_dim padded to a kernel head_dim where one holds it."""
    head_dim = kernel_head_dim(q.shape[-1]) or q.shape[-1]
    padded = head_dim != q.shape[-1]  # the padded copies are fresh, hence aligned
    aligned = q.is_cuda and (padded or kernels.support.tensors_aligned(q, k, v, *extra))
    return kernels.CallDescription(
        device=q.device,
        dtype=q.dtype,
        head_dim=head_dim,
        varlen=cu_seqlens_q is not None,
        causal=causal,
        window=window,
        alibi=alibi is not None,
        dropout=dropout_p > 0.0,
        accum=accum,
        aligned=aligned,
        positive_scale=softmax_scale > 0,
    )


def _params(softmax_scale, causal, window_left, window_right, dropout_p, seed, offset, softcap=0.0):
    return AttentionOptions(
        softmax_scale=softmax_scale,
        causal=causal,
        window_left=window_left,
        window_right=window_right,
        dropout_p=dropout_p,
        seed=seed % _INT64_WRAP,
        offset=offset % _INT64_WRAP,
        softcap=softcap,
    )


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The log-sum-exp's dtype: fp64 for fp64 inputs (reference backend), fp32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _is_empty(q: torch.Tensor, k: torch.Tensor) -> bool:
    """No query, no key or no head: nothing to compute (out is empty or zeros, lse +inf, gradients zero)."""
    return q.numel() == 0 or k.numel() == 0


def _empty_forward(q, v, varlen):
    out = q.new_zeros(q.shape[:-1] + (v.shape[-1],))
    shape = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
    return out, torch.full(shape, float("inf"), dtype=lse_dtype(q.dtype), device=q.device)


def _features(softcap: float) -> tuple[str, ...]:
    return ("softcap",) if softcap > 0.0 else ()


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
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out, lse); lse is [B, H, Nq] (dense) or [H, total_q] (varlen), fp32 (fp64 for fp64 inputs)."""
    if _is_empty(q, k):
        return _empty_forward(q, v, cu_seqlens_q is not None)
    window = (window_left, window_right)
    call = _describe_call(q, k, v, cu_seqlens_q, causal, window, alibi_slopes, dropout_p, accum, softmax_scale)
    choice = choose_backend(call, _features(softcap), q.shape[-1])
    _log_choice(choice, "forward", q.is_cuda)
    params = _params(softmax_scale, causal, window_left, window_right, dropout_p, seed, offset, softcap)
    if choice.backend == "kernel":
        d = q.shape[-1]
        qp, kp, vp = (pad_head_dim(t, call.head_dim) for t in (q, k, v))
        out, lse = kernels.forward(
            qp, kp, vp, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, params, alibi_slopes, accum
        )
        out = out[..., :d]
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
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=lse_dtype(q.dtype))
    else:
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=lse_dtype(q.dtype))
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
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if _is_empty(q, k):
        return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    window = (window_left, window_right)
    call = _describe_call(
        q, k, v, cu_seqlens_q, causal, window, alibi_slopes, dropout_p, bwd_accum, softmax_scale, (dout, out)
    )
    call = replace(call, backward=True, deterministic=deterministic)
    choice = choose_backend(call, _features(softcap), q.shape[-1])
    if choice.backend == "kernel" and efficient_backward.why_not(
        call.head_dim, call.arch, call.varlen, dropout_p, softcap, call.alibi, window, deterministic
    ) is None:
        choice = Choice("cutlass-sm70", f"head_dim {q.shape[-1]} (kernel head_dim 256) on sm_{call.arch}: PyTorch's "
                        "memory-efficient backward, estimated 2.3x the Volta one there (docs/performance.md)")
    _log_choice(choice, "backward", q.is_cuda)
    params = _params(softmax_scale, causal, window_left, window_right, dropout_p, seed, offset, softcap)
    if choice.backend in ("kernel", "cutlass-sm70"):
        d = q.shape[-1]
        # out's padded columns are exactly zero (v's are), so padding it again restores the kernel's output
        dp, qp, kp, vp, op = (pad_head_dim(t, call.head_dim) for t in (dout, q, k, v, out))
        if choice.backend == "cutlass-sm70":
            grads = efficient_backward.backward(dp, qp, kp, vp, op, lse, softmax_scale, causal)
        else:
            grads = kernels.backward(
                dp, qp, kp, vp, op, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, params,
                alibi_slopes, bwd_accum, deterministic,
            )
        grads = tuple(g[..., :d] for g in grads)
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
    "softcap",
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
            "dropout_p", "seed", "offset", "bwd_accum", "deterministic", "softcap",
        )
    }
    if named["accum"] == "fp16" and out.is_cuda:
        _warn_fp16_forward_with_gradients()
    ctx.mark_non_differentiable(lse)


_warned_fp16_forward = False


def _warn_fp16_forward_with_gradients() -> None:
    """accum="fp16" saves an output and log-sum-exp from fp16-accumulated scores; the backward recomputes the scores
    with fp32 accumulation, so its gradients carry the forward's rounding (measured bound in docs/accuracy.md)."""
    global _warned_fp16_forward
    if not _warned_fp16_forward:
        _warned_fp16_forward = True
        logger.warning(
            "volta_train: accum='fp16' with gradients: the backward recomputes fp32-accumulated scores against the "
            "fp16-accumulated forward's log-sum-exp, so gradients are up to ~5x further from float64 than PyTorch's "
            "fp16 attention (docs/accuracy.md); use accum='fp32' (the default) for training"
        )


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes = ctx.saved_tensors
    o = ctx.options
    dq, dk, dv = attention_backward(
        dout.contiguous() if dout.stride(-1) != 1 else dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
        o["max_seqlen_q"], o["max_seqlen_k"], o["softmax_scale"], o["causal"], o["window_left"], o["window_right"],
        alibi_slopes, o["dropout_p"], o["seed"], o["offset"], o["bwd_accum"], o["deterministic"], o["softcap"],
    )
    return (dq, dk, dv) + (None,) * (len(_FORWARD_ARGS) - 3)


torch.library.register_autograd("volta_train::attention_forward", _backward, setup_context=_setup_context)


def attention_with_kvcache_eager(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    rotary_cos: torch.Tensor | None,
    rotary_sin: torch.Tensor | None,
    cache_seqlens: torch.Tensor,
    cache_batch_idx: torch.Tensor | None,
    cache_leftpad: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    rotary_interleaved: bool,
    key_end: int = -1,
    longest: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """flash_attn_with_kvcache: appends k/v into the caches in place, returns (out, lse [B, H, Nq]). No backward.

    ``key_end`` / ``longest``: the cache extent when the validation read the lengths on the host
    (``validation.KvCacheExtent``), so that the kernel path need not read them again; -1: unknown (it then plans
    for the whole cache, with no host read).

    The kernel path, once kernels.support.KERNEL_FEATURES lists "kvcache", is
    ``kernels.forward_with_kvcache`` with this op's arguments (its params carry scale, masks and softcap).
    """
    if q.numel() == 0:
        return _empty_forward(q, v_cache, varlen=False)
    call = kernels.CallDescription(
        device=q.device, dtype=q.dtype, head_dim=kernel_head_dim(q.shape[-1]) or q.shape[-1], varlen=False,
        causal=causal, window=(window_left, window_right), alibi=alibi_slopes is not None, dropout=False,
        accum="fp32", aligned=q.is_cuda, positive_scale=softmax_scale > 0,
    )
    choice = choose_backend(call, ("kvcache",) + _features(softcap), q.shape[-1])
    _log_choice(choice, "with_kvcache", q.is_cuda)
    params = _params(softmax_scale, causal, window_left, window_right, 0.0, 0, 0, softcap)
    args = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad)
    if choice.backend == "kernel":
        out, lse = kernels.forward_with_kvcache(*args, params, alibi_slopes, rotary_interleaved, key_end=key_end,
                                                longest=longest)
    else:
        out, lse = reference.reference_kvcache_forward(*args, params, alibi_slopes, rotary_interleaved)
    return out.contiguous(), lse.contiguous()


# The custom op that torch.compile and torch.export trace (its body is the function above). Eager callers use the
# function itself (volta_train.interface.flash_attn_with_kvcache): the same work without the custom-op dispatch,
# measured at ~0.7 ms of a ~1 ms host-side call on the CPU (the ADInplaceOrView step alone re-reads the 19-argument
# schema once per argument: ~0.2 ms); the in-place appends bump the caches' version counters either way.
attention_with_kvcache = torch.library.custom_op(
    "volta_train::attention_with_kvcache", mutates_args=("k_cache", "v_cache")
)(attention_with_kvcache_eager)


@attention_with_kvcache.register_fake
def _attention_with_kvcache_fake(q, *args):
    return q.new_empty(q.shape), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=lse_dtype(q.dtype))


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
