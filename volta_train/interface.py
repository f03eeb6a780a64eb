"""The public attention API, with flash-attn 2's names, argument order and tensor layouts.

Code written for ``flash_attn`` runs unchanged::

    from volta_train import flash_attn_func
    out = flash_attn_func(q, k, v, dropout_p=0.1, causal=True)   # q/k/v: [batch, seqlen, heads, head_dim]

Differences from flash-attn, all explicit:

* ``return_attn_probs=True`` returns ``(out, softmax_lse, S_dmask)`` as flash-attn does: the
  log-sum-exp (fp32, [batch, heads, seqlen_q]; [heads, total_q] for varlen) and, with
  ``dropout_p > 0``, flash-attn's S_dmask (unnormalised probabilities, dropped entries negated,
  padded to multiples of 128), computed in PyTorch for either backend with seqlen_q x seqlen_k
  memory: a testing aid (:mod:`volta_train.attn_probs`); an empty tensor with ``dropout_p == 0``.
* ``accum`` ("fp32" or "fp16") picks the forward's tensor-core accumulation and
  ``bwd_accum`` ("auto", "fp32" or "fp16") the backward's: "auto" takes FP16-ACC only where it
  meets flash-attn's accuracy standard and is the faster mode, today nowhere (docs/accuracy.md);
  accum="fp16" is for inference (with gradients it warns once: docs/accuracy.md). Both are
  keyword-only and ignored by the reference backend, which always accumulates in fp32
  (fp64 for fp64 inputs).
* A paged KV cache (``block_table``): flash_attn_with_kvcache's decoding kernel reads K/V through
  the table; so does flash_attn_varlen_func's without gradients or dropout, which otherwise
  gathers the pages into packed k/v first (differentiable).
* Under ``torch.autocast``, q/k/v are cast to autocast's dtype first (flash-attn
  raises on fp32 inputs instead).
* ``sinks`` (keyword-only, flash_attn_func and flash_attn_varlen_func): one fp32 logit per
  query head that joins every row's softmax denominator with no value (gpt-oss's attention
  sinks), differentiable; flash-attn 2 has no such argument. Either backend computes the
  attention and the sinks are folded into its output (:mod:`volta_train.sinks`).

The positional order is flash-attn's since 2.6 (``softcap`` before ``alibi_slopes``).
Any head_dim from 1 to 512 is accepted, and v may have a head_dim of its own (q and k
share one): the kernels run up to 256, zero-padding q, k and v to the next head_dim they
are built for; larger ones run on the reference backend (docs/flash_attn_api.md says
which features run where). Each
function validates its arguments into one :class:`~volta_train.options.AttentionOptions`
and hands it to the dispatcher (:mod:`volta_train.dispatch`).
"""

from __future__ import annotations

import logging

import torch

from . import attn_probs, dispatch, kvcache, validation
from .kernels import forward_head_dim

Window = tuple[int, int]
logger = logging.getLogger("volta_train")
_logged_detach: list[bool] = []


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


def _require_tensors(**tensors) -> None:
    for name, t in tensors.items():
        validation.require_tensor(name, t)


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Window = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    accum: str = "fp32",
    bwd_accum: str = "auto",
    sinks: torch.Tensor | None = None,
):
    """Scaled dot-product attention on [batch, seqlen, heads, head_dim] tensors.

    k and v may have fewer heads than q (GQA/MQA; q heads a multiple of k heads).
    Causal masking with seqlen_q != seqlen_k is aligned to the bottom-right
    corner; query rows that see no key output zeros. ``window_size=(left, right)``
    limits query i to keys in [i + sk - sq - left, i + sk - sq + right] (-1 =
    unbounded); ``softcap > 0`` turns each scaled score x into
    ``softcap * tanh(x / softcap)``; ``alibi_slopes`` (fp32, [heads] or [batch, heads])
    then adds ``-slope * |i + sk - sq - j|``. Dropout is applied during training only if
    you pass ``dropout_p > 0``: its Philox seed and offset come from PyTorch's
    generator, so ``torch.manual_seed`` reproduces it. Empty inputs (batch, seqlen or
    heads 0) give empty outputs; seqlen_k 0 gives zeros. v may have its own head_dim
    (the output has it). ``sinks`` (fp32 [heads]) adds ``exp(sinks[h])`` to every
    softmax denominator of head h. ``return_attn_probs=True`` returns
    ``(out, softmax_lse, S_dmask)`` (:mod:`volta_train.attn_probs`).
    """
    _require_tensors(q=q, k=k, v=v)
    q, k, v = _autocast_inputs(q, k, v)
    validation.check_dense(q, k, v)
    options = validation.attention_options(
        q, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, deterministic=deterministic, accum=accum, bwd_accum=bwd_accum,
        batch=q.shape[0], nheads=q.shape[2],
    )
    validation.check_sinks(sinks, q, q.shape[2])
    out, lse = dispatch.attention(q, k, v, None, None, q.shape[1], k.shape[1], alibi_slopes, options, sinks)
    if not return_attn_probs:
        return out
    return out, lse, attn_probs.s_dmask(q, k, options, alibi_slopes)


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
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
    *,
    accum: str = "fp32",
    bwd_accum: str = "auto",
    sinks: torch.Tensor | None = None,
):
    """Attention over sequences packed without padding: q [total_q, heads, head_dim], k/v [total_k, ...].

    ``cu_seqlens_q``/``cu_seqlens_k`` are int32 cumulative lengths (batch + 1
    entries, starting at 0, ending at the token count). Sequence ``b`` is
    ``q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]``; no token attends across sequences.
    ``max_seqlen_q``/``max_seqlen_k``: ints (Python, NumPy or 0-d tensors) >= every
    length. The other arguments mean what they mean in :func:`flash_attn_func`; the
    dropout mask of sequence ``b`` is the dense mask of batch entry ``b``.

    Paged k/v (flash-attn 2.8): with ``block_table`` (int32 [batch, max_num_blocks_per_seq]) k/v are page pools
    [num_blocks, page_block_size, kv_heads, head_dim] and sequence b's keys are the logical positions
    [0, cu_seqlens_k[b + 1] - cu_seqlens_k[b]) of its pages (as in flash_attn_with_kvcache; cu_seqlens_k is read on
    the host to check them). Without gradients (no input requires grad, or grad mode off) and dropout, the decoding
    kernel reads K/V through the table (the reference backend each sequence's pages); otherwise, or where that kernel
    does not take the call, the pages are gathered into packed k/v (a copy, differentiable) and the call runs as a
    packed one. Which path ran, and why, is logged once (``dispatch.paged_varlen_choice``).
    """
    _require_tensors(q=q, k=k, v=v)
    if block_table is not None:
        lengths = validation.check_paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table)
    q, k, v = _autocast_inputs(q, k, v)  # (page pools too: as the gathered k/v would be)
    paged = None
    if block_table is not None:
        paged = (k, v)
        # check_varlen reads only the packed k/v's shape, dtype and device (the gather's copy would be contiguous):
        # a stand-in of that shape, one row of memory
        k, v = (t.new_empty(t.shape[-1]).expand(sum(lengths), *t.shape[2:]) for t in paged)
    max_seqlen_q, max_seqlen_k = validation.check_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
    )
    options = validation.attention_options(
        q, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, deterministic=deterministic, accum=accum, bwd_accum=bwd_accum,
        batch=cu_seqlens_q.numel() - 1, nheads=q.shape[1],
    )
    validation.check_sinks(sinks, q, q.shape[1])
    if paged is not None:
        k_pages, v_pages = paged
        needs_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, k_pages, v_pages, sinks))
        choice = dispatch.paged_varlen_choice(q, k_pages, v_pages, options, alibi_slopes is not None, needs_grad)
        if choice.backend == "gather":
            k, v = kvcache.gather_paged_varlen(k_pages, v_pages, block_table, lengths)
        else:
            compiling = torch.compiler.is_compiling()  # the custom op where torch.compile traces, else its body
            op = dispatch.attention_paged_varlen if compiling else dispatch.attention_paged_varlen_eager
            out, lse = op(q, k_pages, v_pages, cu_seqlens_q, cu_seqlens_k, block_table, max_seqlen_q,
                          max(lengths), alibi_slopes, sinks, *options.pack(), choice.backend)
            if not return_attn_probs:
                return out
            return out, lse, attn_probs.s_dmask_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                       options, alibi_slopes)
    out, lse = dispatch.attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes,
                                  options, sinks)
    if not return_attn_probs:
        return out
    return out, lse, attn_probs.s_dmask_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options,
                                               alibi_slopes)


def kernel_head_dim(head_dim: int, value_head_dim: int | None = None) -> int | None:
    """The head_dim the Volta kernels run a call of this q/k ``head_dim`` (and v ``value_head_dim``) at, q, k and v
    zero-padded to it; None when beyond the kernels (the reference backend runs it, logged once). ValueError when the
    API refuses the head_dim. For integrations that report at setup time what a model's calls will run on."""

    for name, dim in (("head_dim", head_dim), ("value_head_dim", value_head_dim)):
        if dim is not None and not validation.MIN_HEAD_DIM <= dim <= validation.MAX_HEAD_DIM:
            raise ValueError(f"{name} is {dim}; accepted: {validation.MIN_HEAD_DIM} to {validation.MAX_HEAD_DIM}")
    return forward_head_dim(max(head_dim, value_head_dim or 0))


def _unbind_packed(name: str, packed, axis: int, count: int, layout: str) -> tuple[torch.Tensor, ...]:
    """Strided views (no copies) of a packed tensor along ``axis``, which must hold ``count`` entries."""
    validation.require_tensor(name, packed)
    if packed.dim() != len(layout.split(",")) or packed.shape[axis] != count:
        raise ValueError(f"{name} must be [{layout}], got shape {tuple(packed.shape)}")
    return packed.unbind(axis)


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Window = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    accum: str = "fp32",
    bwd_accum: str = "auto",
):
    """qkv: [batch, seqlen, 3, heads, head_dim]; q, k and v are strided views of it (no copies)."""
    q, k, v = _unbind_packed("qkv", qkv, 2, 3, "batch, seqlen, 3, heads, head_dim")
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs, accum=accum, bwd_accum=bwd_accum,
    )


def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Window = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    accum: str = "fp32",
    bwd_accum: str = "auto",
):
    """q: [batch, seqlen_q, heads, head_dim]; kv: [batch, seqlen_k, 2, kv_heads, head_dim]."""
    k, v = _unbind_packed("kv", kv, 2, 2, "batch, seqlen_k, 2, kv_heads, head_dim")
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs, accum=accum, bwd_accum=bwd_accum,
    )


def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Window = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    accum: str = "fp32",
    bwd_accum: str = "auto",
):
    """qkv: [total, 3, heads, head_dim], packed as in :func:`flash_attn_varlen_func`; one cu_seqlens for q and k."""
    q, k, v = _unbind_packed("qkv", qkv, 1, 3, "total, 3, heads, head_dim")
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale, causal, window_size,
        softcap, alibi_slopes, deterministic, return_attn_probs, accum=accum, bwd_accum=bwd_accum,
    )


def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Window = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    accum: str = "fp32",
    bwd_accum: str = "auto",
):
    """q: [total_q, heads, head_dim]; kv: [total_k, 2, kv_heads, head_dim] (see :func:`flash_attn_varlen_func`)."""
    k, v = _unbind_packed("kv", kv, 1, 2, "total_k, 2, kv_heads, head_dim")
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
        window_size, softcap, alibi_slopes, deterministic, return_attn_probs, accum=accum, bwd_accum=bwd_accum,
    )


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Window = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
):
    """Attention of q against a KV cache, appending new keys/values to it in place (incremental decoding).

    q: [batch, seqlen_q, heads, head_dim]; k_cache/v_cache: [batch_cache, seqlen_cache, kv_heads, head_dim].
    Batch entry b reads cache row ``cache_batch_idx[b]`` (default b), whose first ``cache_seqlens[b]``
    positions (an int, or an integer [batch] tensor; None = the whole cache) hold its past keys. If ``k``/``v``
    ([batch, seqlen_new, kv_heads, head_dim]) are given they are written into the cache at positions
    ``cache_seqlens[b] ..`` (in place; ``cache_seqlens`` itself is not advanced) and attended to. Keys before
    ``cache_leftpad[b]`` are ignored. Causal masks and windows are aligned to the bottom right: the last query
    sees the last key (seqlen_k = cache_seqlens + seqlen_new).

    ``rotary_cos``/``rotary_sin`` ([seqlen_ro, rotary_dim / 2]) rotate the first rotary_dim features of the new
    keys at positions ``cache_seqlens[b] + j``, and of q at ``cache_seqlens[b] + i`` when causal or windowed, at
    ``cache_seqlens[b]`` otherwise; ``rotary_interleaved`` pairs features (0, 1), (2, 3)... (True) or
    (i, i + rotary_dim / 2) (False, GPT-NeoX). ``num_splits`` is accepted and ignored.

    Paged KV cache (flash-attn 2.8's semantics): with ``block_table`` (int32 [batch, max_num_blocks_per_seq]) the
    caches are [num_blocks, page_block_size, kv_heads, head_dim] and logical position p of entry b is row
    ``p % page_block_size`` of page ``block_table[b, p // page_block_size]``, for reads and appends alike; an entry's
    logical cache holds ``max_num_blocks_per_seq * page_block_size`` positions. page_block_size: a multiple of 32
    (flash-attn: of 256). Not with ``cache_batch_idx`` or ``cache_leftpad`` (as in flash-attn).

    No backward, as in flash-attn: the output carries no gradient (logged once when an input requires one). Returns
    out, or (out, softmax_lse [batch, heads, seqlen_q]).
    """
    _require_tensors(q=q, k_cache=k_cache, v_cache=v_cache)
    extent = validation.check_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
        causal, window_size, block_table,
    )
    validation.as_int("num_splits", num_splits)
    options = validation.attention_options(
        q, dropout_p=0.0, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, batch=q.shape[0], nheads=q.shape[2],
    )
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v)):
        if not _logged_detach:
            _logged_detach.append(True)
            logger.warning(
                "volta_train flash_attn_with_kvcache: q/k/v require grad but the call has no backward (as in "
                "flash-attn): its output carries no gradient; train with flash_attn_func"
            )
        q, k, v = (t.detach() if t is not None else None for t in (q, k, v))
    # the custom op where torch.compile traces the call, else its body directly (dispatch: the op's own overhead)
    op = dispatch.attention_with_kvcache if torch.compiler.is_compiling() else dispatch.attention_with_kvcache_eager
    out, lse = op(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, extent.cache_seqlens, cache_batch_idx, cache_leftpad,
        alibi_slopes, *options.pack(), bool(rotary_interleaved), extent.key_end, extent.longest, block_table,
    )
    return (out, lse) if return_softmax_lse else out
