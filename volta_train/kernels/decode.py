"""flash_attn_with_kvcache on the Volta kernel: the split-KV decoding path.

The append of the new keys/values into the caches and the rotary embedding run in PyTorch, shared with the reference
backend (:func:`volta_train.kvcache.append`). Attention runs the forward kernel built with ``SPLIT_KV``
(csrc/flash_fwd_kernel.cuh, parameters csrc/params.cuh ``SplitKvParams``) on a decoding tile (``tiles.decode_tile``):

* **GQA packing** (:func:`pack_gqa`): with one query per batch entry, no ALiBi and no left window, every query head
  of a KV group sees the same keys, so the group's heads become the rows (M) of one CTA: a zero-copy strided view of
  q ``[B, 1, H, D] -> [B, H / H_kv, H_kv, D]`` (and of out / lse), one KV head per kernel head, no mask.
* **Key split** (:func:`split_plan`): grid z cuts each CTA's key blocks into ``num_splits`` ranges so that short
  batches still fill the GPU; each split writes its normalised fp32 partial output and log-sum-exp, which the split
  combine kernel (csrc/split_kv_combine.cu, launched right after with the same parameters) turns into out / lse
  (:func:`combine_splits` is its specification in PyTorch). With one split the kernel writes out / lse itself.

:func:`forward_paged_varlen` runs flash_attn_varlen_func on a paged cache on the same kernel: packed queries
(``cu_seqlens_q``), each sequence's keys read through its block table, no gather of the pages.
"""

from __future__ import annotations

import math

import torch

from .. import kvcache
from ..options import AttentionOptions
from . import head_dim as head_dims
from . import tiles
from .launch import _arch, _kernel, fill_common
from .params import SplitKvKernelParams
from .support import tensors_aligned

# The split rule's constants (split_plan): CTAs to aim for per SM, key blocks a split keeps at least, most splits.
DECODE_CTAS_PER_SM = 4
MIN_BLOCKS_PER_SPLIT = 4
COMBINE_MAX_SPLITS = 64  # csrc/split_kv_combine.cu: two splits per lane of a warp
MAX_SPLITS = COMBINE_MAX_SPLITS  # the rule's cap is the combine's limit


def pack_gqa(seqlen_q: int, nheads: int, nheads_kv: int, alibi: bool, window_left: int) -> bool:
    """Whether the query heads of a KV group become the rows of one CTA (GQA packing).

    True when seqlen_q == 1, there are several query heads per KV head, no ALiBi (its bias is per query head) and no
    left window (window_left < 0): the single query of every head then sees exactly the keys [0, seqlen_k) of its
    batch entry (bottom-right aligned causal masks and right windows keep every key from the last query on), so the
    packed rows need no mask at all.
    """
    return seqlen_q == 1 and nheads > nheads_kv and not alibi and window_left < 0


def split_plan(ctas: int, key_blocks: int, sm_count: int, ctas_per_sm: int = DECODE_CTAS_PER_SM,
               min_blocks: int = MIN_BLOCKS_PER_SPLIT, max_splits: int = MAX_SPLITS) -> tuple[int, int]:
    """(num_splits, blocks_per_split) for a launch of ``ctas`` CTAs (batch x kernel heads x query blocks) over at most
    ``key_blocks`` key blocks each, on a GPU of ``sm_count`` SMs.

    The rule: aim for ``ctas_per_sm * sm_count`` CTAs in all. No split when ``ctas`` reaches that already (or there
    are no keys); otherwise ``ceil(target / ctas)`` splits, but no more than leave each split ``min_blocks`` key
    blocks (``key_blocks // min_blocks``), and at most ``max_splits``. The blocks are then dealt evenly:
    ``blocks_per_split = ceil(key_blocks / splits)``, and splits that would get none are dropped, so
    ``num_splits = ceil(key_blocks / blocks_per_split)``. A function of the shapes, the longest key range and the SM
    count only: the same call always splits the same way.
    """
    if key_blocks <= 0:
        return 1, max(key_blocks, 1)
    target = ctas_per_sm * sm_count
    splits = 1 if ctas >= target else min(-(-target // max(ctas, 1)), key_blocks // min_blocks, max_splits)
    splits = max(splits, 1)
    per_split = -(-key_blocks // splits)
    return -(-key_blocks // per_split), per_split


def combine_splits(o_partial: torch.Tensor, lse_partial: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The output and log-sum-exp of the whole key range from the splits' normalised partials: what the split combine
    kernel computes (csrc/split_kv_combine.cu), in PyTorch (its specification and the CPU tests' emulation).

    o_partial: fp32 [S, ..., D], lse_partial: fp32 [S, ...] (natural log, -inf where a split saw no key). lse =
    logsumexp over the splits, out = sum_s exp(lse_s - lse) O_s; a row no split saw a key of gets out 0 and lse +inf
    (the key-less row convention of every backend).
    """
    lse = torch.logsumexp(lse_partial, dim=0)
    seen = torch.isfinite(lse)
    weights = torch.exp(lse_partial - torch.where(seen, lse, torch.zeros_like(lse)))  # 0 for the -inf splits
    out = (weights.unsqueeze(-1) * o_partial).sum(0)
    return out, torch.where(seen, lse, torch.full_like(lse, math.inf))


def _for_kernel(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """t as the kernel reads it: itself when 16-byte aligned with its last dim head_dim, else a zero-padded or
    aligned contiguous copy."""
    if t.shape[-1] != head_dim:
        return head_dims.pad(t, head_dim)
    if tensors_aligned(t) and t.stride(-1) == 1:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _int32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(dtype=torch.int32).contiguous()


def forward_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                         cache_leftpad, options: AttentionOptions, alibi_slopes, rotary_interleaved: bool, *,
                         tile: tiles.FwdTile | None = None, num_splits: int | None = None,
                         out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                         partial_fill: float | None = None, key_end: int = -1, longest: int = -1,
                         block_table: torch.Tensor | None = None):
    """flash_attn_with_kvcache on the decoding kernel: returns out [B, Nq, H, D] (q's dtype) and lse [B, H, Nq] (fp32),
    and appends k/v into the caches in place, like ``reference.reference_kvcache_forward``.

    Paged cache (``block_table`` int32 [B, max_pages], caches [num_pages, page_size, kv_heads, D]): the appends go
    through the table (:func:`volta_train.kvcache.append`) and the kernel reads K/V through it (SplitKvParams
    ``block_table``; one lookup per key block, which the page size, a multiple of the tile's key block, keeps in one
    page): the pages are never gathered here. The whole page pool is handed to the kernel (it is only copied where
    head_dim needs zero padding, as a contiguous cache's keys are).

    Test and sweep hooks: ``tile`` overrides the tile table, ``num_splits`` the split rule (its blocks are dealt as
    :func:`split_plan` deals them); ``out``/``lse`` take caller buffers (e.g. NaN-poisoned); ``partial_fill`` fills
    the partial buffers before the launch (NaN proves the kernel writes every element the combine reads).

    ``key_end`` (one past the last key any entry reads) and ``longest`` (the most keys one entry sees), when the
    caller read the lengths on the host (``validation.KvCacheExtent``), bound the keys the kernel is given and the
    split rule's key range; -1 (unknown): the whole cache, so that nothing here reads a device value (no wait for the
    GPU). The kernel takes each entry's own range from ``seqused_k`` / ``leftpad_k`` either way; the bound only
    changes how the key blocks are dealt to splits.
    """
    q, rows, ends = kvcache.append(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                                   options, rotary_interleaved, block_table)
    batch, seqlen_q, nheads, head_dim = q.shape
    nheads_kv = k_cache.shape[2]
    device = q.device
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=device)
    if lse is None:
        lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=device)
    leftpad = _int32(cache_leftpad)
    paged = block_table is not None
    if paged and (cache_batch_idx is not None or cache_leftpad is not None):  # (validation refuses them first)
        raise ValueError("block_table with cache_batch_idx or cache_leftpad; accepted: a block_table alone (SplitKvParams "
                         "reads k_batch_index / leftpad_k only for contiguous caches)")
    logical_len = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]  # keys one entry may hold
    if key_end < 0 or longest < 0:  # not read on the host: plan for the whole cache (no device read here)
        key_end = longest = logical_len

    d = head_dims.require(head_dim, head_dims.forward_head_dim(head_dim))
    tile = tile or tiles.decode_tile(d, _arch(device))
    qk = _for_kernel(q, d)
    if paged:  # every page may be read: the table, not the position, picks it
        kc, vc = _for_kernel(k_cache, d), _for_kernel(v_cache, d)
    else:
        kc, vc = _for_kernel(k_cache[:, :key_end], d), _for_kernel(v_cache[:, :key_end], d)  # the positions it may read
    out_full = out if d == head_dim else torch.empty(q.shape[:-1] + (d,), dtype=q.dtype, device=device)
    alibi = alibi_slopes.contiguous() if alibi_slopes is not None else None
    qk, out_k, lse_k, run = _gqa_views(qk, out_full, lse, nheads_kv, alibi is not None, options)
    _launch(qk, kc, vc, out_k, lse_k, None, qk.shape[1], longest, run, alibi, _int32(ends),
            _int32(rows) if cache_batch_idx is not None else None, leftpad, block_table, tile, d, options.softcap > 0,
            num_splits, partial_fill)
    if d != head_dim:
        out.copy_(out_full[..., :head_dim])
    return out, lse


def _gqa_views(q, out, lse, nheads_kv: int, alibi: bool, options: AttentionOptions):
    """(q, out, lse, options) as the kernel runs a dense call (q/out [B, Nq, H, d], lse [B, H, Nq], any strides):
    with GQA packing (:func:`pack_gqa`) the strided views [B, G, H_kv, d] / [B, H_kv, G] (rows = the G query heads of
    each KV head) and the options without masks; otherwise the tensors themselves."""
    batch, seqlen_q, nheads, d = q.shape
    if not pack_gqa(seqlen_q, nheads, nheads_kv, alibi, options.window_left):
        return q, out, lse, options
    group = nheads // nheads_kv
    q, out = (t.as_strided((batch, group, nheads_kv, d), (t.stride(0), t.stride(2), group * t.stride(2), 1))
              for t in (q, out))
    lse = lse.as_strided((batch, nheads_kv, group), (lse.stride(0), group * lse.stride(1), lse.stride(1)))
    return q, out, lse, AttentionOptions(softmax_scale=options.softmax_scale, softcap=options.softcap)


def forward_paged_varlen(q, k_pages, v_pages, cu_seqlens_q, cu_seqlens_k, block_table, max_seqlen_q: int,
                         longest: int, options: AttentionOptions, alibi_slopes=None, *,
                         tile: tiles.FwdTile | None = None, num_splits: int | None = None,
                         out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                         partial_fill: float | None = None):
    """flash_attn_varlen_func on a paged cache, on the decoding kernel: returns out [total_q, H, D] (q's dtype) and
    lse [H, total_q] (fp32), as the varlen forward lays them out.

    q: packed [total_q, H, D] (``cu_seqlens_q``, int32 [B + 1]); k_pages / v_pages: page pools [num_pages,
    page_block_size, kv_heads, D]; sequence b's keys are the logical positions [0, cu_seqlens_k[b + 1] -
    cu_seqlens_k[b]) of its pages ``block_table[b]`` (int32 [B, max_pages]), read by the kernel through the table
    (SplitKvParams ``cu_seqlens_q`` with ``block_table``; the key counts go to it as ``seqused_k``, computed on the
    device). ``max_seqlen_q``: at least every sequence's query count; ``longest``: at least every key count (the
    split rule's key range). Masks are bottom-right aligned per sequence, as in the varlen forward. fp32 accumulation,
    no dropout (``AttentionOptions.paged_refusal``: dispatch gathers the pages of such a call). Hooks as in
    :func:`forward_with_kvcache`.
    """
    options.check_paged()
    total_q, nheads, head_dim = q.shape
    device = q.device
    d = head_dims.require(head_dim, head_dims.forward_head_dim(head_dim))
    tile = tile or tiles.decode_tile(d, _arch(device))
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=device)
    if lse is None:
        lse = torch.empty((nheads, total_q), dtype=torch.float32, device=device)
    if total_q == 0:
        return out, lse
    out_full = out if d == head_dim else torch.empty(q.shape[:-1] + (d,), dtype=q.dtype, device=device)
    seqused = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(dtype=torch.int32).contiguous()
    alibi = alibi_slopes.contiguous() if alibi_slopes is not None else None
    qk, kc, vc = _for_kernel(q, d), _for_kernel(k_pages, d), _for_kernel(v_pages, d)
    batch = cu_seqlens_q.numel() - 1
    run, out_k, lse_k, cu_q, rows = options, out_full, lse, cu_seqlens_q.contiguous(), max_seqlen_q
    lse_dense = None
    if max_seqlen_q == 1 and total_q == batch:  # one query per sequence: a dense decoding step, GQA packing included
        # (lse [B, H, 1] of its own: the kernel writes a CTA's rows, here query heads, at unit stride)
        lse_dense = torch.empty((batch, nheads, 1), dtype=torch.float32, device=device)
        qk, out_k, lse_k, run = _gqa_views(qk.unsqueeze(1), out_k.unsqueeze(1), lse_dense, k_pages.shape[2],
                                           alibi is not None, options)
        cu_q, rows = None, qk.shape[1]
    _launch(qk, kc, vc, out_k, lse_k, cu_q, rows, longest, run, alibi, seqused, None, None, block_table, tile, d,
            options.softcap > 0, num_splits, partial_fill)
    if lse_dense is not None:
        lse.copy_(lse_dense[..., 0].t())
    if d != head_dim:
        out.copy_(out_full[..., :head_dim])
    return out, lse


def _launch(q, k, v, out, lse, cu_seqlens_q, rows: int, longest: int, options: AttentionOptions, alibi, seqused,
            batch_index, leftpad, block_table, tile: tiles.FwdTile, d: int, softcap: bool, num_splits: int | None,
            partial_fill: float | None) -> None:
    """The decoding kernel (and its split combine) on tensors already at the kernel head_dim ``d``: q/out dense [B,
    rows, H, d] or packed [total_q, H, d] (``cu_seqlens_q``); k/v contiguous [B_kv, N, H_kv, d] or, with
    ``block_table``, page pools; lse laid out as the forward lays it out. ``seqused`` / ``batch_index`` / ``leftpad``:
    int32 [B] (SplitKvParams seqused_k / k_batch_index / leftpad_k). ``rows``: query rows per entry (varlen: the
    most), ``longest``: the most keys an entry sees."""
    device = q.device
    paged = block_table is not None
    page_size = k.shape[1] if paged else 0
    if paged and page_size % tile.block_n:
        raise ValueError(f"k_cache has page_block_size {page_size}; the decoding tile for head_dim {d} reads key blocks "
                         f"of {tile.block_n}: accepted: a multiple of {tile.block_n}")
    kernel = _kernel(tiles.decode_variant(d, tile, softcap), device)
    prm = SplitKvKernelParams()
    grid = fill_common(prm, q, k, v, out, lse, cu_seqlens_q, None, rows, longest, options, kernel.geometry.block_m,
                       alibi)
    if cu_seqlens_q is not None:  # packed queries; K/V keep their own [page or batch, row, head] strides
        for name, t in (("k", k), ("v", v)):
            for axis, stride in zip(("batch", "row", "head"), t.stride()[:3]):
                setattr(prm, f"{name}_{axis}_stride", stride)
    batch = cu_seqlens_q.numel() - 1 if cu_seqlens_q is not None else q.shape[0]
    key_blocks = -(-longest // kernel.geometry.block_n)
    if num_splits is None:
        sm_count = torch.cuda.get_device_properties(device).multi_processor_count
        splits, per_split = split_plan(grid[0] * grid[1], key_blocks, sm_count)
    else:
        if not 1 <= num_splits <= COMBINE_MAX_SPLITS:
            raise ValueError(f"num_splits={num_splits}; accepted: 1..{COMBINE_MAX_SPLITS} (the split combine's limit)")
        per_split = -(-max(key_blocks, 1) // max(1, num_splits))
        splits = -(-max(key_blocks, 1) // per_split)
    prm.seqused_k = seqused.data_ptr()
    prm.k_batch_index = batch_index.data_ptr() if batch_index is not None else None
    prm.leftpad_k = leftpad.data_ptr() if leftpad is not None else None
    table = block_table.contiguous() if paged else None  # int32 (validated); rows of consecutive pages
    prm.block_table = table.data_ptr() if paged else None
    prm.block_table_batch_stride = table.stride(0) if paged else 0
    prm.page_block_size = page_size
    prm.num_splits, prm.blocks_per_split = splits, per_split
    prm.o_partial = prm.lse_partial = None
    heads = q.shape[-2]
    if splits > 1:  # [splits, B, heads, rows(, d)], fp32
        shape = (splits, batch, heads, rows)
        fill = (lambda s: torch.empty(s, dtype=torch.float32, device=device)) if partial_fill is None else (
            lambda s: torch.full(s, partial_fill, dtype=torch.float32, device=device))
        o_partial, lse_partial = fill(shape + (d,)), fill(shape)
        prm.o_partial, prm.lse_partial = o_partial.data_ptr(), lse_partial.data_ptr()

    kernel.launch(grid + (splits,), [prm])
    if splits > 1:  # the combine reads the partials and writes out / lse through the same params
        combine = tiles.combine_variant(d)
        row_blocks = -(-rows // tiles.COMBINE_ROWS_PER_CTA)
        # grid x: one per (batch, kernel head), the partials' second axis (not the kernel's CTAs: query blocks too)
        _kernel(combine, device).launch((batch * heads, row_blocks, 1), [prm])
