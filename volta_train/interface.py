"""The public attention API, with flash-attn 2's names, argument order and tensor layouts.

Code written for ``flash_attn`` runs unchanged::

    from volta_train import flash_attn_func
    out = flash_attn_func(q, k, v, dropout_p=0.1, causal=True)   # q/k/v: [batch, seqlen, heads, head_dim]

Differences from flash-attn, all explicit:

* ``return_attn_probs=True`` returns ``(out, softmax_lse, None)``: the log-sum-exp
  (fp32, [batch, heads, seqlen_q]; [heads, total_q] for varlen) but not the
  probability matrix, which would need seqlen_q x seqlen_k memory.
* ``accum`` ("fp32" or "fp16") picks the forward's tensor-core accumulation and
  ``bwd_accum`` the backward's; both are keyword-only and ignored by the
  reference backend, which always accumulates in fp32 (fp64 for fp64 inputs).
* ``softcap`` is keyword-only and must be 0.0 (not implemented).
* Under ``torch.autocast``, q/k/v are cast to autocast's dtype first (flash-attn
  raises on fp32 inputs instead).
"""

from __future__ import annotations

import math

import torch

from . import _dispatch, _validation

Window = tuple[int, int]


def _autocast_inputs(q, k, v):
    """q/k/v in autocast's dtype when autocast is on for their device, as SDPA would get them.

    Under ``torch.autocast`` q/k/v can arrive in mixed dtypes (Llama's rotary embedding returns fp32
    q/k next to an fp16 v); the Volta kernel takes fp16. The casts are differentiable, so gradients
    come back in each input's own dtype. Outside autocast nothing is cast.
    """
    device_type = q.device.type
    if not torch.is_autocast_enabled(device_type):
        return q, k, v
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t for t in (q, k, v))


def _prepare(q, dropout_p, softmax_scale, accum, bwd_accum):
    if accum not in _dispatch.ACCUM_CHOICES:
        raise ValueError(f"accum is {accum!r}; accepted: {', '.join(_dispatch.ACCUM_CHOICES)}")
    if bwd_accum not in _dispatch.ACCUM_CHOICES:
        raise ValueError(f"bwd_accum is {bwd_accum!r}; accepted: {', '.join(_dispatch.ACCUM_CHOICES)}")
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    seed, offset = (0, 0)
    if dropout_p > 0.0:
        seed, offset = _dispatch.draw_dropout_seed_offset(q.device)
    return scale, _dispatch.to_op_int(seed), _dispatch.to_op_int(offset)


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Window = (-1, -1),
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    softcap: float = 0.0,
    accum: str = "fp32",
    bwd_accum: str = "fp16",
):
    """Scaled dot-product attention on [batch, seqlen, heads, head_dim] tensors.

    k and v may have fewer heads than q (GQA/MQA; q heads a multiple of k heads).
    Causal masking with seqlen_q != seqlen_k is aligned to the bottom-right
    corner; query rows that see no key output zeros. ``window_size=(left, right)``
    limits query i to keys in [i + sk - sq - left, i + sk - sq + right] (-1 =
    unbounded); ``alibi_slopes`` (fp32, [heads] or [batch, heads]) adds
    ``-slope * |i + sk - sq - j|``. Dropout is applied during training only if
    you pass ``dropout_p > 0``: its Philox seed and offset come from PyTorch's
    generator, so ``torch.manual_seed`` reproduces it.
    """
    q, k, v = _autocast_inputs(q, k, v)
    _validation.check_dense(q, k, v)
    left, right = _validation.check_options(
        q, dropout_p, softmax_scale, window_size, alibi_slopes, softcap, q.shape[0], q.shape[2]
    )
    scale, seed, offset = _prepare(q, dropout_p, softmax_scale, accum, bwd_accum)
    out, lse = _dispatch.attention_forward(
        q, k, v, None, None, q.shape[1], k.shape[1], scale, bool(causal), left, right, alibi_slopes,
        float(dropout_p), seed, offset, accum, bwd_accum, bool(deterministic),
    )
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Window = (-1, -1),
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    softcap: float = 0.0,
    accum: str = "fp32",
    bwd_accum: str = "fp16",
):
    """Attention over sequences packed without padding: q [total_q, heads, head_dim], k/v [total_k, ...].

    ``cu_seqlens_q``/``cu_seqlens_k`` are int32 cumulative lengths (batch + 1
    entries, starting at 0, ending at the token count). Sequence ``b`` is
    ``q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]``; no token attends across sequences.
    The other arguments mean what they mean in :func:`flash_attn_func`; the
    dropout mask of sequence ``b`` is the dense mask of batch entry ``b``.
    """
    q, k, v = _autocast_inputs(q, k, v)
    _validation.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    batch = cu_seqlens_q.numel() - 1
    left, right = _validation.check_options(
        q, dropout_p, softmax_scale, window_size, alibi_slopes, softcap, batch, q.shape[1]
    )
    scale, seed, offset = _prepare(q, dropout_p, softmax_scale, accum, bwd_accum)
    out, lse = _dispatch.attention_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), scale, bool(causal), left, right,
        alibi_slopes, float(dropout_p), seed, offset, accum, bwd_accum, bool(deterministic),
    )
    return (out, lse, None) if return_attn_probs else out


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Window = (-1, -1),
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    **kwargs,
):
    """qkv: [batch, seqlen, 3, heads, head_dim]; q, k and v are strided views of it (no copies)."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 5 or qkv.shape[2] != 3:
        shape = tuple(qkv.shape) if isinstance(qkv, torch.Tensor) else type(qkv).__name__
        raise ValueError(f"qkv must be [batch, seqlen, 3, heads, head_dim], got {shape}")
    return flash_attn_func(
        qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size, alibi_slopes,
        deterministic, return_attn_probs, **kwargs,
    )


def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Window = (-1, -1),
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    **kwargs,
):
    """q: [batch, seqlen_q, heads, head_dim]; kv: [batch, seqlen_k, 2, kv_heads, head_dim]."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[2] != 2:
        shape = tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__
        raise ValueError(f"kv must be [batch, seqlen_k, 2, kv_heads, head_dim], got {shape}")
    return flash_attn_func(
        q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, alibi_slopes,
        deterministic, return_attn_probs, **kwargs,
    )
