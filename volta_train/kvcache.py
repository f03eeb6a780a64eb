"""The KV-cache append (with its rotary embedding, :mod:`volta_train.rotary`) of flash_attn_with_kvcache, shared by the kernel and reference backends."""

from __future__ import annotations

import torch

from .options import AttentionOptions
from .rotary import rotate_at


def page_slots(block_table: torch.Tensor, page_size: int, positions: torch.Tensor,
               entries: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Where logical key positions of a paged cache live: (physical page, row in the page), each shaped like
    ``positions``: page ``block_table[b, p // page_size]``, row ``p % page_size``, where b is the position's row of
    ``positions`` ([B, N] long, one row per batch entry) or, given ``entries`` (shaped like ``positions``), its
    entry there."""
    logical_page = torch.div(positions, page_size, rounding_mode="floor")
    table = block_table.to(device=positions.device, dtype=torch.long)
    physical = torch.gather(table, 1, logical_page) if entries is None else table[entries, logical_page]
    return physical, positions - logical_page * page_size


def append(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, options: AttentionOptions,
           rotary_interleaved=True, block_table=None):
    """What both backends of flash_attn_with_kvcache do before attention: new k/v (rotated when rotary_cos is given)
    are written in place into cache row ``cache_batch_idx[b]`` at positions ``cache_seqlens[b]..``, and q is rotated
    at ``cache_seqlens[b] + i`` (causal or windowed) or ``cache_seqlens[b]`` (otherwise).

    Paged cache (``block_table`` int32 [B, max_pages], caches [num_pages, page_size, kv_heads, D]): logical position
    p of entry b is row ``p % page_size`` of page ``block_table[b, p // page_size]`` (:func:`page_slots`), so an
    append that crosses a page boundary continues at the top of the entry's next page.

    Returns (q, rows, ends): q rotated (q itself without rotary), the cache row of each batch entry (long [B]; with a
    block table simply b, the pages being looked up per position) and one past its last key, ``cache_seqlens +
    seqlen_new`` (long [B]), both on q's device.
    """
    batch, seqlen_q = q.shape[0], q.shape[1]
    seqlen_new = 0 if k is None else k.shape[1]
    device = q.device
    starts = cache_seqlens.to(device=device, dtype=torch.long)
    rows = (
        cache_batch_idx.to(device=device, dtype=torch.long)
        if cache_batch_idx is not None
        else torch.arange(batch, device=device)
    )
    if k is not None:
        positions = starts.view(-1, 1) + torch.arange(seqlen_new, device=device).view(1, -1)  # [B, Nnew]
        if rotary_cos is not None:
            k = rotate_at(k, rotary_cos, rotary_sin, positions, rotary_interleaved)
        if block_table is not None:
            row_index, positions = page_slots(block_table, k_cache.shape[1], positions)
        else:
            row_index = rows.view(-1, 1).expand_as(positions)
        k_cache.index_put_((row_index, positions), k.to(k_cache.dtype))
        v_cache.index_put_((row_index, positions), v.to(v_cache.dtype))
    if rotary_cos is not None:
        local = options.window_left >= 0 or options.window_right >= 0
        offsets = torch.arange(seqlen_q, device=device) if (options.causal or local) else torch.zeros(
            seqlen_q, dtype=torch.long, device=device
        )
        q = rotate_at(q, rotary_cos, rotary_sin, starts.view(-1, 1) + offsets.view(1, -1), rotary_interleaved)
    return q, rows, starts + seqlen_new


def gather_paged_varlen(k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor,
                        lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """flash_attn_varlen_func's paged k/v ([num_blocks, page_size, kv_heads, D]) as packed k/v [sum(lengths),
    kv_heads, D]: sequence b's logical keys [0, lengths[b]) gathered from its pages (:func:`page_slots`), in sequence
    order, so that cu_seqlens_k indexes the result. A copy (differentiable: gradients flow back into the pages)."""
    device = k_pages.device
    batch = len(lengths)
    counts = torch.tensor(lengths, dtype=torch.long, device=device)
    starts = torch.cumsum(counts, 0) - counts
    seq = torch.repeat_interleave(torch.arange(batch, device=device), counts)  # [total_k]: the sequence of each key
    positions = torch.arange(int(counts.sum()), device=device) - starts[seq]  # its logical position
    page, row = page_slots(block_table, k_pages.shape[1], positions, entries=seq)
    rows = page * k_pages.shape[1] + row
    return k_pages.flatten(0, 1)[rows], v_pages.flatten(0, 1)[rows]
