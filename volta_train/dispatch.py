"""The one dispatcher behind the public API: which backend runs a call, as PyTorch custom ops.

``volta_train::attention_forward`` / ``attention_backward`` / ``attention_with_kvcache`` run the Volta kernels
(:mod:`volta_train.kernels`) where they support the call and the reference backend (:mod:`volta_train.reference`)
otherwise; being custom ops with fake implementations and a registered autograd formula, they work under autograd,
``torch.compile`` and CUDA graphs. The call's options travel as one :class:`~volta_train.options.AttentionOptions`,
packed for the ops' schema. On a V100 the backward of a call the kernels run at head_dim 256 goes to PyTorch's
memory-efficient (CUTLASS Sm70) backward where that computes the same (:mod:`volta_train.cutlass_backward`).

``VOLTA_TRAIN_BACKEND`` picks the policy: ``auto`` (default), ``kernel`` (raise if the kernels cannot run the call)
or ``reference``. Which backend ran, and why, is logged once per pass and distinct reason.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from . import cutlass_backward, kernels, reference
from . import sinks as attention_sinks
from .options import AttentionOptions, compute_dtype

logger = logging.getLogger("volta_train")

BACKEND_ENV = "VOLTA_TRAIN_BACKEND"
BACKEND_CHOICES = ("auto", "kernel", "reference")
_logged_reasons: set[tuple[str, str]] = set()


class BackendUnavailableError(RuntimeError):
    """VOLTA_TRAIN_BACKEND=kernel was asked for, but the kernels cannot run this call."""


@dataclass(frozen=True)
class Choice:
    backend: str  # "kernel", "reference" or "cutlass_backward"
    reason: str


def backend_policy() -> str:
    policy = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if policy not in BACKEND_CHOICES:
        raise ValueError(f"{BACKEND_ENV}={policy!r}; accepted: {', '.join(BACKEND_CHOICES)}")
    return policy


def choose_backend(call: kernels.CallDescription) -> Choice:
    """The backend of one call under the policy of ``VOLTA_TRAIN_BACKEND``, with the reason to log."""
    policy = backend_policy()
    if policy == "reference":
        return Choice("reference", f"{BACKEND_ENV}=reference")
    why_not = kernels.unsupported_reason(call)
    if why_not is None:
        if call.backward and cutlass_backward.why_not(call) is None:
            return Choice("cutlass_backward", f"head_dim {call.head_dim} on sm_{call.arch}: PyTorch's memory-efficient "
                          "backward, faster there than the Volta one (docs/performance.md)")
        dims = str(call.head_dim) + (f"/{call.value_head_dim} (q, k/v)" if call.value_head_dim else "")
        padded = call.kernel_head_dim != call.head_dim or call.value_head_dim is not None
        return Choice("kernel", f"fp16 on {call.device_name} (sm_{call.arch}) is supported by the Volta kernel"
                      + (f"; head_dim {dims} zero-padded to {call.kernel_head_dim}" if padded else ""))
    if policy == "kernel":
        raise BackendUnavailableError(f"{BACKEND_ENV}=kernel, but the Volta kernel cannot run this call: {why_not}")
    return Choice("reference", why_not)


def _log_choice(choice: Choice, pass_name: str, on_gpu: bool) -> None:
    key = (pass_name, choice.backend, choice.reason)  # the backward names its backend too, even for the same reason
    if key in _logged_reasons:
        return
    _logged_reasons.add(key)
    level = logging.WARNING if (on_gpu and choice.backend == "reference") else logging.INFO
    logger.log(level, "volta_train attention %s: %s backend (%s)", pass_name, choice.backend, choice.reason)


def _lse_shape(q: torch.Tensor, varlen: bool) -> tuple[int, ...]:
    return (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])


def _empty_forward(q: torch.Tensor, v: torch.Tensor, varlen: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """No query, key or head: out is empty or zeros, lse +inf."""
    out = q.new_zeros(q.shape[:-1] + (v.shape[-1],))
    return out, torch.full(_lse_shape(q, varlen), float("inf"), dtype=compute_dtype(q.dtype), device=q.device)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor | None,
              cu_seqlens_k: torch.Tensor | None, max_seqlen_q: int, max_seqlen_k: int,
              alibi_slopes: torch.Tensor | None, options: AttentionOptions,
              sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of one differentiable attention call; lse is [B, H, Nq] (dense) or [H, total_q] (varlen).

    The per-head tensors (alibi_slopes, sinks) travel as the custom op's tensor arguments; every other option is
    packed from ``options``."""
    floats, ints = options.pack()
    return attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, sinks,
                             floats, ints)


@torch.library.custom_op("volta_train::attention_forward", mutates_args=())
def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    options_f: list[float],
    options_i: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    options = AttentionOptions.unpack(options_f, options_i)
    varlen = cu_seqlens_q is not None
    if q.numel() == 0 or k.numel() == 0:
        return _empty_forward(q, v, varlen)
    call = kernels.describe(q, k, v, options, varlen=varlen, alibi=alibi_slopes is not None)
    choice = choose_backend(call)
    _log_choice(choice, "forward", q.is_cuda)
    shape = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if choice.backend == "kernel":
        out, lse = kernels.forward(q, k, v, *shape, options, alibi_slopes)
    elif varlen:
        out, lse = reference.reference_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, options, alibi_slopes)
    else:
        out, lse = reference.reference_forward(q, k, v, options, alibi_slopes)
    if sinks is not None:
        out, lse = attention_sinks.fold(out, lse, sinks, varlen)
    # Contiguous whatever the backend computed: the fake promises these strides, and torch.compile plans from it.
    return out.contiguous(), lse.contiguous()


@attention_forward.register_fake
def _attention_forward_fake(q, k, v, cu_seqlens_q, *args):
    out = q.new_empty(q.shape[:-1] + (v.shape[-1],))
    return out, q.new_empty(_lse_shape(q, cu_seqlens_q is not None), dtype=compute_dtype(q.dtype))


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
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    options_f: list[float],
    options_i: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dsinks); dsinks is empty without sinks (a custom op returns tensors, not None)."""
    options = AttentionOptions.unpack(options_f, options_i)
    varlen = cu_seqlens_q is not None
    dsinks = (attention_sinks.backward(dout, out, lse, sinks, varlen) if sinks is not None
              else q.new_zeros((0,), dtype=torch.float32))
    if q.numel() == 0 or k.numel() == 0:
        return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape), dsinks
    call = kernels.describe(q, k, v, options, varlen=varlen, alibi=alibi_slopes is not None, backward=True,
                            extra=(dout, out))
    choice = choose_backend(call)
    _log_choice(choice, "backward", q.is_cuda)
    shape = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if choice.backend == "cutlass_backward":
        grads = cutlass_backward.backward(dout, q, k, v, out, lse, options)
    elif choice.backend == "kernel":
        grads = kernels.backward(dout, q, k, v, out, lse, *shape, options, alibi_slopes)
    elif varlen:
        grads = reference.reference_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, options,
                                                    alibi_slopes)
    else:
        grads = reference.reference_backward(dout, q, k, v, out, lse, options, alibi_slopes)
    return (*(g.contiguous() for g in grads), dsinks)


@attention_backward.register_fake
def _attention_backward_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             alibi_slopes, sinks, *args):
    dsinks = sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty((0,), dtype=torch.float32)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, sinks, options_f, options_i = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks)
    ctx.shape = (max_seqlen_q, max_seqlen_k)
    ctx.options = (options_f, options_i)
    if out.is_cuda and AttentionOptions.unpack(options_f, options_i).accum == "fp16":
        _warn_fp16_forward_with_gradients()
    ctx.mark_non_differentiable(lse)


_warned_fp16_forward = False


def _warn_fp16_forward_with_gradients() -> None:
    """accum="fp16" saves an output and log-sum-exp from fp16-accumulated scores, which the backward's fp32 recompute
    does not match: its gradients carry the forward's rounding (docs/accuracy.md)."""
    global _warned_fp16_forward
    if not _warned_fp16_forward:
        _warned_fp16_forward = True
        logger.warning(
            "volta_train: accum='fp16' with gradients: the backward recomputes fp32-accumulated scores against the "
            "fp16-accumulated forward's log-sum-exp, so gradients are further from float64 than PyTorch's fp16 "
            "attention (docs/accuracy.md); use accum='fp32' (the default) for training"
        )


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = attention_backward(
        dout.contiguous() if dout.stride(-1) != 1 else dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
        *ctx.shape, alibi_slopes, sinks, *ctx.options,
    )
    return dq, dk, dv, None, None, None, None, None, dsinks if sinks is not None else None, None, None


torch.library.register_autograd("volta_train::attention_forward", _backward, setup_context=_setup_context)


def paged_varlen_choice(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, options: AttentionOptions,
                        alibi: bool, needs_grad: bool) -> Choice:
    """How flash_attn_varlen_func runs on a paged cache: "kernel" (the decoding kernel reads K/V through the block
    table), "reference" (the reference backend reads each sequence's pages), or "gather" (the pages are copied into
    packed k/v and the call runs as a packed one, on whichever backend that picks; its autograd and dropout included).

    The paged path is inference only: gradients or dropout take the gather path on every backend. Otherwise the kernel
    path where ``kernels.unsupported_reason`` of the paged call allows it; the reference path where the reference
    backend would run anyway (``VOLTA_TRAIN_BACKEND=reference``, or not a CUDA tensor under ``auto``); else gather (a
    GPU call the decoding kernel does not take, e.g. accum="fp16", still runs the varlen kernel)."""
    choice = _paged_varlen_choice(q, k_pages, v_pages, options, alibi, needs_grad)
    _log_choice(choice, "varlen with block_table", q.is_cuda)
    return choice


def _paged_varlen_choice(q, k_pages, v_pages, options: AttentionOptions, alibi: bool, needs_grad: bool) -> Choice:
    if needs_grad:
        return Choice("gather", "an input requires grad: the paged path has no backward; gradients flow through the "
                      "gathered k/v")
    refusal = options.paged_refusal()
    if refusal is not None:
        return Choice("gather", refusal)
    policy = backend_policy()
    if policy == "reference":
        return Choice("reference", f"{BACKEND_ENV}=reference: each sequence's pages read by the reference backend")
    call = kernels.describe(q, k_pages, v_pages, options, varlen=True, alibi=alibi, page_block_size=k_pages.shape[1])
    why_not = kernels.unsupported_reason(call)
    if why_not is None:
        return Choice("kernel", "the decoding kernel reads k/v through block_table, no gather")
    if policy == "auto" and not q.is_cuda:
        return Choice("reference", f"{why_not}; each sequence's pages read by the reference backend")
    return Choice("gather", f"{why_not}; the pages are gathered into packed k/v")


def attention_paged_varlen_eager(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    block_table: torch.Tensor,
    max_seqlen_q: int,
    longest: int,
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    options_f: list[float],
    options_i: list[int],
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """flash_attn_varlen_func on a paged cache, forward only: (out [total_q, H, Dv], lse [H, total_q]) on ``backend``
    ("kernel" or "reference", from :func:`paged_varlen_choice`). ``longest``: the most keys one sequence has."""
    options = AttentionOptions.unpack(options_f, options_i)
    if q.numel() == 0:
        return _empty_forward(q, v_pages, varlen=True)
    if backend == "kernel":
        out, lse = kernels.forward_paged_varlen(q, k_pages, v_pages, cu_seqlens_q, cu_seqlens_k, block_table,
                                                max_seqlen_q, longest, options, alibi_slopes)
    else:
        out, lse = reference.reference_paged_varlen_forward(q, k_pages, v_pages, cu_seqlens_q, cu_seqlens_k,
                                                            block_table, options, alibi_slopes)
    if sinks is not None:
        out, lse = attention_sinks.fold(out, lse, sinks, True)
    return out.contiguous(), lse.contiguous()


# The custom op torch.compile traces (the kernel path launches through ctypes, which fake tensors cannot); eager
# callers use the function itself, as for attention_with_kvcache.
attention_paged_varlen = torch.library.custom_op(
    "volta_train::attention_paged_varlen", mutates_args=()
)(attention_paged_varlen_eager)


@attention_paged_varlen.register_fake
def _attention_paged_varlen_fake(q, k_pages, v_pages, *args):
    return (q.new_empty(q.shape[:-1] + (v_pages.shape[-1],)),
            q.new_empty((q.shape[1], q.shape[0]), dtype=compute_dtype(q.dtype)))


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
    options_f: list[float],
    options_i: list[int],
    rotary_interleaved: bool,
    key_end: int = -1,
    longest: int = -1,
    block_table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """flash_attn_with_kvcache: appends k/v into the caches in place, returns (out, lse [B, H, Nq]). No backward.
    ``block_table``: a paged cache (int32 [B, max_pages]; the caches [num_pages, page_size, kv_heads, D]).

    ``key_end`` / ``longest``: the cache extent when the validation read the lengths on the host
    (``validation.KvCacheExtent``), so that the kernel path need not read them again; -1: unknown (the whole cache).
    """
    options = AttentionOptions.unpack(options_f, options_i)
    if q.numel() == 0:
        return _empty_forward(q, v_cache, varlen=False)
    call = kernels.describe(q, k_cache, v_cache, options, varlen=False, alibi=alibi_slopes is not None,
                            kvcache=True)
    choice = choose_backend(call)
    _log_choice(choice, "with_kvcache", q.is_cuda)
    args = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad)
    if choice.backend == "kernel":
        out, lse = kernels.forward_with_kvcache(*args, options, alibi_slopes, rotary_interleaved, key_end=key_end,
                                                longest=longest, block_table=block_table)
    else:
        out, lse = reference.reference_kvcache_forward(*args, options, alibi_slopes, rotary_interleaved, block_table)
    return out.contiguous(), lse.contiguous()


# The custom op that torch.compile and torch.export trace (its body is the function above). Eager callers use the
# function itself (volta_train.interface.flash_attn_with_kvcache): the same work without the custom op's dispatch
# cost, which is a large part of a decoding step's host time; the in-place appends bump the caches' versions either way.
attention_with_kvcache = torch.library.custom_op(
    "volta_train::attention_with_kvcache", mutates_args=("k_cache", "v_cache")
)(attention_with_kvcache_eager)


@attention_with_kvcache.register_fake
def _attention_with_kvcache_fake(q, *args):
    return q.new_empty(q.shape), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=compute_dtype(q.dtype))
