"""Pure-PyTorch reference attention: the CPU fallback and the oracle of the kernel tests.

It implements exactly the semantics of the Volta kernels:

* FlashAttention-2's algorithm: an online softmax over key blocks of ``BLOCK_K``
  columns, so no [seqlen_q, seqlen_k] score matrix is ever built (memory is
  O(seqlen_q x BLOCK_K) per head), and a backward that recomputes the
  probabilities from the saved fp32 log-sum-exp.
* causal masks aligned to the bottom-right corner, local windows and ALiBi as in
  flash-attn >= 2.1: query ``i`` sees key ``j`` iff
  ``i + sk - sq - left <= j <= i + sk - sq + right``.
* logit soft-capping as in flash-attn >= 2.6: the scaled score ``x = scale * q.k``
  becomes ``softcap * tanh(x / softcap)`` before ALiBi and masks (``softcap = 0``: off).
* rows with no visible key give ``out = 0`` and ``lse = +inf`` (so that
  ``exp(s - lse) = 0`` in the backward), never NaN.
* the log-sum-exp is fp32, or fp64 for fp64 inputs (so fp64 gradients are not limited
  by an fp32 log-sum-exp at large scores).
* dropout from :func:`volta_train.philox.dropout_keep_mask`, a pure function of
  ``(seed, offset, batch, head, row, col)``, regenerated in the backward.

Tensors come in flash-attn layout ``[batch, seqlen, heads, head_dim]``; GQA is
handled by viewing the query heads as ``[kv_heads, group]`` so K and V are
never repeated in memory.
"""

from __future__ import annotations

import torch

from . import kvcache
from .options import AttentionOptions, compute_dtype
from .philox import dropout_keep_mask

BLOCK_K = 256  # keys per block of the online softmax


def _visible_and_bias(
    params: AttentionOptions,
    rows: torch.Tensor,
    cols: torch.Tensor,
    seqlen_q: int,
    seqlen_k: int,
    alibi_slopes: torch.Tensor | None,
    dtype: torch.dtype,
):
    """Mask [rows, cols] (None if all visible) and the ALiBi bias (None without slopes).

    ``alibi_slopes`` arrives already shaped to broadcast against the scores:
    [Hkv, G, 1, 1] or [B, Hkv, G, 1, 1].
    """
    diag = rows.view(-1, 1) + (seqlen_k - seqlen_q)  # column of each row's diagonal
    distance = diag - cols.view(1, -1)  # >0: key lies before the diagonal
    visible = None
    if params.right_limit >= 0:
        visible = distance >= -params.right_limit
    if params.window_left >= 0:
        left_ok = distance <= params.window_left
        visible = left_ok if visible is None else visible & left_ok
    bias = None
    if alibi_slopes is not None:
        bias = -alibi_slopes.to(dtype) * distance.abs().to(dtype)
    return visible, bias


def _block_is_empty(params: AttentionOptions, col0: int, col1: int, seqlen_q: int, seqlen_k: int) -> bool:
    """True when no query row sees any key in [col0, col1)."""
    shift = seqlen_k - seqlen_q
    if params.right_limit >= 0 and col0 > (seqlen_q - 1) + shift + params.right_limit:
        return True
    if params.window_left >= 0 and col1 - 1 < shift - params.window_left:
        return True
    return False


def scores(q, k_blk, params, rows, cols, seqlen_q, seqlen_k, alibi_slopes):
    """Scaled, soft-capped, biased and masked scores of one key block: [B, Hkv, G, Nq, bk].

    Returns (scores, cap_slope): cap_slope is d(capped)/d(scaled) = 1 - tanh^2 with
    softcap, None without.
    """
    s = torch.matmul(q, k_blk.transpose(-1, -2)) * params.softmax_scale
    cap_slope = None
    if params.softcap > 0.0:
        t = torch.tanh(s / params.softcap)
        s = t * params.softcap
        cap_slope = 1.0 - t * t
    visible, bias = _visible_and_bias(params, rows, cols, seqlen_q, seqlen_k, alibi_slopes, s.dtype)
    if bias is not None:
        s = s + bias
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    return s, cap_slope


def _dropout_scale(params, batch_index, nheads, q_shape, rows, cols, device, dtype):
    """keep / (1 - p) for one key block, shaped like the scores [B, Hkv, G, Nq, bk]."""
    batch, nheads_kv, group = q_shape[0], q_shape[1], q_shape[2]
    bh = (
        (batch_index.view(-1, 1) * nheads + torch.arange(nheads, device=device).view(1, -1))
        .reshape(-1)
    )
    keep = dropout_keep_mask(params.seed, params.offset, params.dropout_p, bh, rows, cols)
    keep = keep.view(batch, nheads_kv, group, rows.numel(), cols.numel())
    return keep.to(dtype) / (1.0 - params.dropout_p)


def shape_alibi(alibi_slopes: torch.Tensor | None, nheads_kv: int) -> torch.Tensor | None:
    """[H] or [B, H] slopes -> [Hkv, G, 1, 1] or [B, Hkv, G, 1, 1] to broadcast with the scores."""
    if alibi_slopes is None:
        return None
    lead = alibi_slopes.shape[:-1]
    return alibi_slopes.reshape(*lead, nheads_kv, -1, 1, 1)


def _split_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, compute_dtype):
    """[B, N, H, D] -> q [B, Hkv, G, Nq, D], k/v [B, Hkv, 1, Nk, D] in the compute dtype."""
    batch, seqlen_q, nheads, head_dim = q.shape
    nheads_kv = k.shape[2]
    group = nheads // nheads_kv
    qh = q.to(compute_dtype).permute(0, 2, 1, 3).reshape(batch, nheads_kv, group, seqlen_q, head_dim)
    kh = k.to(compute_dtype).permute(0, 2, 1, 3).unsqueeze(2)
    vh = v.to(compute_dtype).permute(0, 2, 1, 3).unsqueeze(2)
    return qh, kh, vh


def reference_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    params: AttentionOptions,
    alibi_slopes: torch.Tensor | None = None,
    batch_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocked FlashAttention-2 forward. Returns out [B, Nq, H, Dv] (q's dtype) and lse [B, H, Nq].

    lse is fp32, fp64 for fp64 inputs. Needs at least one q and one k/v head (the dispatcher
    answers empty calls itself).

    ``batch_index`` gives the batch coordinate each of the B entries uses in the
    dropout function (varlen passes the sequence number); default arange(B).
    """
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k = k.shape[1]
    cdt = compute_dtype(q.dtype)
    device = q.device
    qh, kh, vh = _split_heads(q, k, v, cdt)
    alibi_slopes = shape_alibi(alibi_slopes, kh.shape[1])
    if batch_index is None:
        batch_index = torch.arange(batch, device=device)
    rows = torch.arange(seqlen_q, device=device)

    stat_shape = qh.shape[:-1] + (1,)
    row_max = torch.full(stat_shape, float("-inf"), dtype=cdt, device=device)
    row_sum = torch.zeros(stat_shape, dtype=cdt, device=device)
    acc = torch.zeros(qh.shape[:-1] + (vh.shape[-1],), dtype=cdt, device=device)

    for col0 in range(0, seqlen_k, BLOCK_K):
        col1 = min(col0 + BLOCK_K, seqlen_k)
        if _block_is_empty(params, col0, col1, seqlen_q, seqlen_k):
            continue
        cols = torch.arange(col0, col1, device=device)
        s, _ = scores(qh, kh[..., col0:col1, :], params, rows, cols, seqlen_q, seqlen_k, alibi_slopes)
        new_max = torch.maximum(row_max, s.amax(dim=-1, keepdim=True))
        safe_max = torch.where(torch.isneginf(new_max), torch.zeros_like(new_max), new_max)
        p = torch.exp(s - safe_max)
        rescale = torch.exp(row_max - safe_max)
        row_sum = row_sum * rescale + p.sum(dim=-1, keepdim=True)
        if params.dropout_p > 0.0:
            p = p * _dropout_scale(params, batch_index, nheads, qh.shape, rows, cols, device, cdt)
        acc = acc * rescale + torch.matmul(p, vh[..., col0:col1, :])
        row_max = new_max

    empty = row_sum == 0
    out = torch.where(empty, torch.zeros_like(acc), acc / torch.where(empty, torch.ones_like(row_sum), row_sum))
    lse = torch.where(
        empty, torch.full_like(row_sum, float("inf")), row_max + torch.log(torch.where(empty, torch.ones_like(row_sum), row_sum))
    )
    out = out.reshape(batch, nheads, seqlen_q, vh.shape[-1]).permute(0, 2, 1, 3).to(q.dtype)
    lse = lse.reshape(batch, nheads, seqlen_q).to(cdt)
    return out, lse


def reference_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    params: AttentionOptions,
    alibi_slopes: torch.Tensor | None = None,
    batch_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashAttention-2 backward with recompute from the saved log-sum-exp. Returns dq, dk, dv."""
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k = k.shape[1]
    cdt = compute_dtype(q.dtype)
    device = q.device
    qh, kh, vh = _split_heads(q, k, v, cdt)
    nheads_kv, group = qh.shape[1], qh.shape[2]
    alibi_slopes = shape_alibi(alibi_slopes, nheads_kv)
    if batch_index is None:
        batch_index = torch.arange(batch, device=device)
    rows = torch.arange(seqlen_q, device=device)
    to_heads = lambda t: t.to(cdt).permute(0, 2, 1, 3).reshape(batch, nheads_kv, group, seqlen_q, t.shape[-1])
    do_h, o_h = to_heads(dout), to_heads(out)
    lse_h = lse.to(cdt).reshape(batch, nheads_kv, group, seqlen_q, 1)
    delta = (do_h * o_h).sum(dim=-1, keepdim=True)  # D = rowsum(dO * O)

    dq = torch.zeros_like(qh)
    dk = torch.zeros(kh.shape[:2] + kh.shape[3:], dtype=cdt, device=device)
    dv = torch.zeros(vh.shape[:2] + vh.shape[3:], dtype=cdt, device=device)
    for col0 in range(0, seqlen_k, BLOCK_K):
        col1 = min(col0 + BLOCK_K, seqlen_k)
        if _block_is_empty(params, col0, col1, seqlen_q, seqlen_k):
            continue
        cols = torch.arange(col0, col1, device=device)
        k_blk, v_blk = kh[..., col0:col1, :], vh[..., col0:col1, :]
        s, cap_slope = scores(qh, k_blk, params, rows, cols, seqlen_q, seqlen_k, alibi_slopes)
        p = torch.exp(s - lse_h)  # lse = +inf on empty rows gives 0
        dp = torch.matmul(do_h, v_blk.transpose(-1, -2))
        if params.dropout_p > 0.0:
            z = _dropout_scale(params, batch_index, nheads, qh.shape, rows, cols, device, cdt)
            p_dropped, dp = p * z, dp * z
        else:
            p_dropped = p
        dv[:, :, col0:col1] = torch.matmul(p_dropped.transpose(-1, -2), do_h).sum(dim=2)
        ds = p * (dp - delta)
        if cap_slope is not None:  # through softcap * tanh(x / softcap)
            ds = ds * cap_slope
        dq += torch.matmul(ds, k_blk) * params.softmax_scale
        dk[:, :, col0:col1] = torch.matmul(ds.transpose(-1, -2), qh).sum(dim=2) * params.softmax_scale

    dq = dq.reshape(batch, nheads, seqlen_q, head_dim).permute(0, 2, 1, 3).to(q.dtype)
    dk = dk.permute(0, 2, 1, 3).to(k.dtype)
    dv = dv.permute(0, 2, 1, 3).to(v.dtype)
    return dq, dk, dv


def _sequences(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor):
    starts_q = cu_seqlens_q.tolist()
    starts_k = cu_seqlens_k.tolist()
    for index in range(len(starts_q) - 1):
        yield index, starts_q[index], starts_q[index + 1], starts_k[index], starts_k[index + 1]


def reference_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, params, alibi_slopes=None):
    """Packed [total, H, D] forward, one sequence at a time. lse is [H, total_q] (fp32; fp64 for fp64 inputs)."""
    out = torch.zeros(q.shape[:2] + (v.shape[-1],), dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("inf"), dtype=compute_dtype(q.dtype), device=q.device)
    for index, q0, q1, k0, k1 in _sequences(cu_seqlens_q, cu_seqlens_k):
        if q1 == q0:
            continue
        bidx = torch.tensor([index], device=q.device)
        seq_alibi = alibi_slopes[index : index + 1] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        o, l = reference_forward(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], params, seq_alibi, bidx)
        out[q0:q1] = o[0]
        lse[:, q0:q1] = l[0]
    return out, lse


def reference_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, params, alibi_slopes=None):
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for index, q0, q1, k0, k1 in _sequences(cu_seqlens_q, cu_seqlens_k):
        if q1 == q0 or k1 == k0:
            continue
        bidx = torch.tensor([index], device=q.device)
        seq_alibi = alibi_slopes[index : index + 1] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        g = reference_backward(
            dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], out[None, q0:q1],
            lse[None, :, q0:q1], params, seq_alibi, bidx,
        )
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = g[0][0], g[1][0], g[2][0]
    return dq, dk, dv


def reference_kvcache_forward(
    q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, params,
    alibi_slopes=None, rotary_interleaved=True, block_table=None,
):
    """flash_attn_with_kvcache on the reference backend: out [B, Nq, H, D], lse [B, H, Nq].

    New k/v (rotated when rotary_cos is given) are written into cache row ``cache_batch_idx[b]`` at positions
    ``cache_seqlens[b]..`` (:func:`volta_train.kvcache.append`); entry b then attends to that row's keys ``[cache_leftpad[b],
    cache_seqlens[b] + seqlen_new)`` with masks aligned to the bottom right. The caches are read as views (no copy).
    With a ``block_table`` (paged cache) entry b's keys are gathered from its pages ``block_table[b, :ceil(end /
    page_size)]`` into a contiguous copy first.
    """
    batch, seqlen_q = q.shape[0], q.shape[1]
    device = q.device
    q, rows, ends = kvcache.append(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                                   params, rotary_interleaved, block_table)
    ends = ends.tolist()
    first = cache_leftpad.tolist() if cache_leftpad is not None else [0] * batch
    out = torch.empty(q.shape[:-1] + (v_cache.shape[-1],), dtype=q.dtype, device=device)
    lse = torch.empty((batch, q.shape[2], seqlen_q), dtype=compute_dtype(q.dtype), device=device)
    for b, row in enumerate(rows.tolist()):
        slopes = alibi_slopes[b : b + 1] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        keys = slice(first[b], ends[b])
        if block_table is None:
            k_b, v_b = k_cache[row, keys], v_cache[row, keys]
        else:
            k_b, v_b = _entry_keys(k_cache, v_cache, block_table, b, ends[b])
        o, l = reference_forward(q[b : b + 1], k_b.unsqueeze(0), v_b.unsqueeze(0), params, slopes)
        out[b], lse[b] = o[0], l[0]
    return out, lse


def _entry_keys(k_pages, v_pages, block_table, b: int, end: int):
    """Logical keys [0, end) of entry b of a paged cache: its pages ``block_table[b, :ceil(end / page_size)]``, in
    logical order, copied into contiguous [end, Hkv, D] k and v."""
    pages = block_table[b, : -(-end // k_pages.shape[1])].to(device=k_pages.device, dtype=torch.long)
    return k_pages[pages].flatten(0, 1)[:end], v_pages[pages].flatten(0, 1)[:end]


def reference_paged_varlen_forward(q, k_pages, v_pages, cu_seqlens_q, cu_seqlens_k, block_table, params,
                                   alibi_slopes=None):
    """flash_attn_varlen_func on a paged cache without gradients, on the reference backend: packed q [total_q, H,
    D], page pools [num_pages, page_size, Hkv, D], sequence b's keys the logical positions [0, cu_seqlens_k[b + 1] -
    cu_seqlens_k[b]) of its pages ``block_table[b]``. One sequence at a time, each reading only its own pages (what
    the decoding kernel does); out [total_q, H, Dv] and lse [H, total_q] as :func:`reference_varlen_forward` gives
    them. No dropout (the paged path runs inference only)."""
    params.check_paged()
    out = torch.zeros(q.shape[:2] + (v_pages.shape[-1],), dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("inf"), dtype=compute_dtype(q.dtype), device=q.device)
    for index, q0, q1, k0, k1 in _sequences(cu_seqlens_q, cu_seqlens_k):
        if q1 == q0:
            continue
        k_b, v_b = _entry_keys(k_pages, v_pages, block_table, index, k1 - k0)
        slopes = alibi_slopes[index : index + 1] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        o, l = reference_forward(q[None, q0:q1], k_b[None], v_b[None], params, slopes)
        out[q0:q1] = o[0]
        lse[:, q0:q1] = l[0]
    return out, lse
