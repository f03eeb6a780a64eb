"""The naive float64 attention every test compares against: the full score matrix, no tricks.

FLOAT64_RTOL / FLOAT64_ATOL: float64 comparisons on the CPU use these, not 1e-12. PyTorch's CPU float64
exp is not reproducible across processes here (some runs take a vectorised path with ~1e-9 relative
error), so a bound tighter than ~1e-8 would test libm, not attention.
"""

from __future__ import annotations

import math

import torch

FLOAT64_RTOL = 1e-7
FLOAT64_ATOL = 1e-8


def visible_mask(seqlen_q, seqlen_k, causal=False, window_size=(-1, -1), device="cpu"):
    """[Nq, Nk] bool: key j visible from query i (flash-attn >= 2.1, bottom-right aligned)."""
    left, right = window_size
    if causal:
        right = 0
    i = torch.arange(seqlen_q, device=device).view(-1, 1)
    j = torch.arange(seqlen_k, device=device).view(1, -1)
    diag = i + seqlen_k - seqlen_q
    ok = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        ok &= j <= diag + right
    if left >= 0:
        ok &= j >= diag - left
    return ok


def naive_attention(q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1), alibi_slopes=None,
                    keep_mask=None, dropout_p=0.0, softcap=0.0):
    """float64 attention on [B, N, H, D]; returns (out [B, Nq, H, D] float64, lse [B, H, Nq] float64).

    keep_mask: optional bool [B, H, Nq, Nk] dropout keep mask (scaled by 1/(1-p)).
    softcap > 0: scaled scores s become softcap * tanh(s / softcap), before ALiBi and masks (flash-attn >= 2.6).
    Rows with no visible key give out 0 and lse +inf.
    """
    q, k, v = (t.double() for t in (q, k, v))
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    group = nheads // nheads_kv
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        i = torch.arange(seqlen_q, device=q.device).view(-1, 1)
        j = torch.arange(seqlen_k, device=q.device).view(1, -1)
        dist = (i + seqlen_k - seqlen_q - j).abs().double()
        slopes = alibi_slopes.double()
        slopes = slopes.view(1, nheads, 1, 1) if slopes.dim() == 1 else slopes.view(batch, nheads, 1, 1)
        s = s - slopes * dist
    ok = visible_mask(seqlen_q, seqlen_k, causal, window_size, device=q.device)
    s = s.masked_fill(~ok, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    empty = torch.isneginf(lse)
    p = torch.exp(s - torch.where(empty, torch.zeros_like(lse), lse).unsqueeze(-1))
    p = torch.where(empty.unsqueeze(-1), torch.zeros_like(p), p)
    if keep_mask is not None:
        p = p * keep_mask.to(p.device).double() / (1.0 - dropout_p)
    out = torch.einsum("bhij,bjhd->bihd", p, v)
    lse = torch.where(empty, torch.full_like(lse, float("inf")), lse)
    return out, lse
