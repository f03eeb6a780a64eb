"""Rotary position embedding: flash-attn's ``flash_attn.layers.rotary.apply_rotary_emb``, and the rotation at cache positions that flash_attn_with_kvcache applies (:mod:`volta_train.kvcache`).

One rotation serves both: the first ``rotary_dim = 2 * cos.shape[-1]`` features of each head are rotated in pairs by
the angle whose cosine and sine ``cos[pos]``/``sin[pos]`` hold, pairs ``(2i, 2i + 1)`` when ``interleaved`` (GPT-J),
``(i, i + rotary_dim / 2)`` otherwise (GPT-NeoX); the other features pass through. It is computed in fp32 (fp64 for
fp64 inputs), as flash-attn's Triton kernel computes in fp32, and rounded once to x's dtype.
"""

from __future__ import annotations

import torch

from .options import compute_dtype
from .validation import as_int


def _rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [..., H, D] with its first 2 * half features rotated by c/s ([..., 1, half], compute dtype), in x's dtype."""
    half = c.shape[-1]
    xr = x[..., : 2 * half].to(c.dtype)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rotated = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        rotated = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., 2 * half :]), dim=-1)


def rotate_at(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """x [..., H, D] rotated at integer ``positions`` (x.shape[:-2], all within cos's rows); cos/sin [seqlen_ro, half].

    No checks and no autograd Function: the KV-cache append validated the positions already, and both of its
    backends call this so that the caches come out bit-identical.
    """
    cdt = compute_dtype(x.dtype)
    c = cos.to(cdt)[positions].unsqueeze(-2)
    s = sin.to(cdt)[positions].unsqueeze(-2)
    return _rotate(x, c, s, interleaved)


class _ApplyRotaryEmb(torch.autograd.Function):
    """The rotation by gathered cos/sin; its backward is the rotation by the opposite angle (cos, -sin)."""

    @staticmethod
    def forward(ctx, x, c, s, interleaved, inplace):
        out = _rotate(x, c, s, interleaved)
        ctx.save_for_backward(c, s)
        ctx.interleaved = interleaved
        if not inplace:
            return out
        rotary_dim = 2 * c.shape[-1]
        x[..., :rotary_dim].copy_(out[..., :rotary_dim])
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        c, s = ctx.saved_tensors
        return _rotate(grad, c, -s, ctx.interleaved), None, None, None, None


def _check_int_tensor(name: str, t: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> None:
    if t.dtype not in (torch.int32, torch.int64) or tuple(t.shape) != shape:
        raise ValueError(
            f"{name} has shape {tuple(t.shape)} and dtype {t.dtype}; accepted: an int32 or int64 tensor of shape {shape}"
        )
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but x is on {device}: they must be on the same device")


def _positions(
    x: torch.Tensor,
    seqlen_offsets: int | torch.Tensor,
    cu_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(positions, valid): each token's position (x.shape[:-2], broadcastable for dense x) and, for varlen, whether
    the token lies in a sequence at all (None for dense)."""
    device = x.device
    if cu_seqlens is None:
        local = torch.arange(x.shape[1], device=device).view(1, -1)
        offsets = seqlen_offsets.view(-1, 1) if isinstance(seqlen_offsets, torch.Tensor) else seqlen_offsets
        return local + offsets, None
    cu = cu_seqlens.to(torch.long)
    batch = cu.numel() - 1
    token = torch.arange(x.shape[0], device=device)
    # the sequence each packed token belongs to (right=True skips empty sequences); outside every sequence: < 0 or batch
    seq = torch.searchsorted(cu, token, right=True) - 1
    inside = (seq >= 0) & (seq < batch)
    seq = seq.clamp(0, max(batch - 1, 0))
    positions = token - cu[seq]
    if isinstance(seqlen_offsets, torch.Tensor):
        positions = positions + seqlen_offsets.to(torch.long)[seq]
    else:
        positions = positions + seqlen_offsets
    return positions, inside


def apply_rotary_emb(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = False,
    inplace: bool = False,
    seqlen_offsets: int | torch.Tensor = 0,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
) -> torch.Tensor:
    """flash-attn 2.8's ``flash_attn.layers.rotary.apply_rotary_emb``: rotary embedding of x, differentiable in x.

    x: [batch, seqlen, nheads, headdim], or [total_seqlen, nheads, headdim] packed as ``cu_seqlens`` ([batch + 1]
    int32/int64 cumulative lengths, with ``max_seqlen`` >= every length) says. cos/sin: [seqlen_ro, rotary_dim / 2],
    rotary_dim <= headdim. Token i of sequence b sits at position ``i + seqlen_offsets`` (an int) or
    ``i + seqlen_offsets[b]`` (an int32/int64 [batch] tensor, e.g. the lengths of a KV cache); positions outside
    ``[0, seqlen_ro)``, reachable only with tensor offsets, and packed tokens in no sequence are left unrotated (flash-attn's
    kernel reads cos 1, sin 0 there). ``interleaved``: rotate feature pairs (0, 1), (2, 3)... (GPT-J) instead of
    (i, i + rotary_dim / 2) (GPT-NeoX). ``inplace``: write the result into x and return x. As in flash-attn, cos and
    sin get no gradient, and an int ``seqlen_offsets`` must keep ``seqlen_offsets + seqlen <= seqlen_ro`` (seqlen:
    x's, or ``max_seqlen`` for varlen).
    """
    for name, t in (("x", x), ("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    varlen = cu_seqlens is not None
    layout = "[total_seqlen, nheads, headdim] (cu_seqlens given)" if varlen else "[batch, seqlen, nheads, headdim]"
    if x.dim() != (3 if varlen else 4):
        raise ValueError(f"x has shape {tuple(x.shape)}; accepted: {layout}")
    if not x.is_floating_point():
        raise TypeError(f"x has dtype {x.dtype}; accepted: a floating-point dtype")
    if cos.dim() != 2 or cos.shape != sin.shape or not cos.is_floating_point() or not sin.is_floating_point():
        raise ValueError(
            f"cos/sin have shapes {tuple(cos.shape)}/{tuple(sin.shape)} and dtypes {cos.dtype}/{sin.dtype}; accepted: "
            "two floating-point tensors of one shape [seqlen_ro, rotary_dim / 2]"
        )
    for name, t in (("cos", cos), ("sin", sin)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}: they must be on the same device")
    seqlen_ro, rotary_dim = cos.shape[0], 2 * cos.shape[1]
    if rotary_dim > x.shape[-1]:
        raise ValueError(f"rotary_dim = 2 * cos.shape[1] = {rotary_dim} exceeds x's headdim {x.shape[-1]}; "
                         "accepted: rotary_dim <= headdim")
    if varlen:
        if not isinstance(cu_seqlens, torch.Tensor):
            raise TypeError(f"cu_seqlens must be a torch.Tensor or None, got {type(cu_seqlens).__name__}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
            raise ValueError(f"cu_seqlens has shape {tuple(cu_seqlens.shape)}; accepted: [batch + 1]")
        _check_int_tensor("cu_seqlens", cu_seqlens, (cu_seqlens.numel(),), x.device)
        if max_seqlen is None:
            raise ValueError("max_seqlen is None; accepted with cu_seqlens: an int >= every sequence length")
        seqlen = as_int("max_seqlen", max_seqlen)
        batch = cu_seqlens.numel() - 1
    else:
        seqlen, batch = x.shape[1], x.shape[0]
    if seqlen_ro < seqlen:
        raise ValueError(f"cos/sin have {seqlen_ro} rows (seqlen_ro) but the sequences are up to {seqlen} long; "
                         "accepted: seqlen_ro >= seqlen (max_seqlen for varlen)")
    if isinstance(seqlen_offsets, torch.Tensor) and seqlen_offsets.dim() == 1:
        _check_int_tensor("seqlen_offsets", seqlen_offsets, (batch,), x.device)
    else:
        seqlen_offsets = as_int("seqlen_offsets", seqlen_offsets,
                                f"an int, or an int32/int64 tensor of shape ({batch},)")
        if seqlen_offsets < 0 or seqlen_offsets + seqlen > seqlen_ro:
            raise ValueError(f"seqlen_offsets is {seqlen_offsets} with sequences up to {seqlen} long and {seqlen_ro} "
                             "cos/sin rows; accepted: 0 <= seqlen_offsets <= seqlen_ro - seqlen")

    positions, inside = _positions(x, seqlen_offsets, cu_seqlens)
    cdt = compute_dtype(x.dtype)
    valid = (positions >= 0) & (positions < seqlen_ro)
    if inside is not None:
        valid = valid & inside
    rows = positions.clamp(0, max(seqlen_ro - 1, 0))
    cos_c, sin_c = cos.detach().to(cdt), sin.detach().to(cdt)
    if seqlen_ro == 0:  # no rows to gather (only empty x gets here): any angle
        cos_c, sin_c = cos_c.new_ones((1, cos.shape[1])), cos_c.new_zeros((1, cos.shape[1]))
    c = torch.where(valid.unsqueeze(-1), cos_c[rows], 1.0).unsqueeze(-2)
    s = torch.where(valid.unsqueeze(-1), sin_c[rows], 0.0).unsqueeze(-2)
    return _ApplyRotaryEmb.apply(x, c, s, bool(interleaved), bool(inplace))


apply_rotary_emb_func = apply_rotary_emb  # flash-attn keeps this name for backward compatibility

__all__ = ["apply_rotary_emb", "apply_rotary_emb_func", "rotate_at"]
