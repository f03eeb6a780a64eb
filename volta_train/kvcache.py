"""The KV-cache append and rotary embedding of flash_attn_with_kvcache, shared by the kernel and reference backends."""

from __future__ import annotations

import torch

from .options import AttentionOptions


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """Rotary embedding of x [B, N, H, D] at integer positions [B, N]; cos/sin are [seqlen_ro, rotary_dim / 2].

    The first rotary_dim features are rotated in pairs: (0, 1), (2, 3)... when ``interleaved``,
    (i, i + rotary_dim / 2) otherwise (GPT-NeoX); the others pass through. Computed in fp32 (fp64 for fp64).
    """
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    half = cos.shape[-1]
    c = cos.to(cdt)[positions].unsqueeze(2)  # [B, N, 1, half]
    s = sin.to(cdt)[positions].unsqueeze(2)
    xr = x[..., : 2 * half].to(cdt)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rotated = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        rotated = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., 2 * half :]), dim=-1)


def append(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, options: AttentionOptions,
           rotary_interleaved=True):
    """What both backends of flash_attn_with_kvcache do before attention: new k/v (rotated when rotary_cos is given) are written in place into cache row
    ``cache_batch_idx[b]`` at positions ``cache_seqlens[b]..``, and q is rotated at ``cache_seqlens[b] + i`` (causal
    or windowed) or ``cache_seqlens[b]`` (otherwise).

    Returns (q, rows, ends): q rotated (q itself without rotary), the cache row of each batch entry (long [B]) and one
    past its last key, ``cache_seqlens + seqlen_new`` (long [B]), both on q's device.
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
            k = apply_rotary(k, rotary_cos, rotary_sin, positions, rotary_interleaved)
        row_index = rows.view(-1, 1).expand_as(positions)
        k_cache.index_put_((row_index, positions), k.to(k_cache.dtype))
        v_cache.index_put_((row_index, positions), v.to(v_cache.dtype))
    if rotary_cos is not None:
        local = options.window_left >= 0 or options.window_right >= 0
        offsets = torch.arange(seqlen_q, device=device) if (options.causal or local) else torch.zeros(
            seqlen_q, dtype=torch.long, device=device
        )
        q = apply_rotary(q, rotary_cos, rotary_sin, starts.view(-1, 1) + offsets.view(1, -1), rotary_interleaved)
    return q, rows, starts + seqlen_new
