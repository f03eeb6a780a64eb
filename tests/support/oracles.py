"""Oracles the tests and the GPU check scripts compare the kernels against (no GPU needed to import).

* :func:`naive_attention`: float64 attention with the full score matrix, no tricks: the truth.
* :func:`torch_fp16_attention`: PyTorch's own fp16 attention on the same inputs (fp16 matmuls, fp32 softmax
  rounded to fp16, as transformers' eager path computes it), differentiable: the yardstick. flash-attn's own test
  suite holds its kernels to twice this attention's max-abs error against the truth; so do ours.
* :func:`error_vs_yardstick`: that comparison for one tensor, as numbers a test can assert on and a report can print.

FLOAT64_RTOL / FLOAT64_ATOL: float64 comparisons on the CPU use these, not 1e-12. PyTorch's CPU float64 exp is
not reproducible across processes here (some runs take a vectorised path with ~1e-9 relative error), so a bound
tighter than ~1e-8 would test libm, not attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FLOAT64_RTOL = 1e-7
FLOAT64_ATOL = 1e-8
# The absolute floor added to twice the yardstick's max-abs error, as a fraction of max |truth|: 1/8 of an fp16
# rounding step (2^-11 relative), so a tensor whose yardstick error happens to be ~0 is not held to exactly 0.
YARDSTICK_FLOOR = 2.0**-14


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


def _alibi_bias(alibi_slopes, batch, nheads, seqlen_q, seqlen_k, device):
    i = torch.arange(seqlen_q, device=device).view(-1, 1)
    j = torch.arange(seqlen_k, device=device).view(1, -1)
    dist = (i + seqlen_k - seqlen_q - j).abs().double()
    slopes = alibi_slopes.double().to(device)
    slopes = slopes.view(1, nheads, 1, 1) if slopes.dim() == 1 else slopes.view(batch, nheads, 1, 1)
    return -slopes * dist


def naive_attention(q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1), alibi_slopes=None,
                    keep_mask=None, dropout_p=0.0, softcap=0.0, return_probs=False):
    """float64 attention on [B, N, H, D]; returns (out [B, Nq, H, D] float64, lse [B, H, Nq] float64), and the
    softmax probabilities [B, H, Nq, Nk] (before dropout) third when return_probs.

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
        s = s + _alibi_bias(alibi_slopes, batch, nheads, seqlen_q, seqlen_k, q.device)
    ok = visible_mask(seqlen_q, seqlen_k, causal, window_size, device=q.device)
    s = s.masked_fill(~ok, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    empty = torch.isneginf(lse)
    p = torch.exp(s - torch.where(empty, torch.zeros_like(lse), lse).unsqueeze(-1))
    p = torch.where(empty.unsqueeze(-1), torch.zeros_like(p), p)
    probs = p
    if keep_mask is not None:
        p = p * keep_mask.to(p.device).double() / (1.0 - dropout_p)
    out = torch.einsum("bhij,bjhd->bihd", p, v)
    lse = torch.where(empty, torch.full_like(lse, float("inf")), lse)
    return (out, lse, probs) if return_probs else (out, lse)


def torch_fp16_attention(q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1), alibi_slopes=None,
                         keep_mask=None, dropout_p=0.0, softcap=0.0):
    """PyTorch's fp16 eager attention on [B, N, H, D] inputs (the yardstick), differentiable.

    Scores and P V as fp16 matmuls, the softmax in fp32 rounded to fp16; rows with no visible key give zeros.
    """
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, group = k.shape[1], nheads // k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    kk, vv = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    s = torch.einsum("bihd,bjhd->bhij", q, kk).float() * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        s = s + _alibi_bias(alibi_slopes, batch, nheads, seqlen_q, seqlen_k, q.device).float()
    ok = visible_mask(seqlen_q, seqlen_k, causal, window_size, device=q.device)
    p = torch.softmax(s.masked_fill(~ok, float("-inf")), dim=-1).nan_to_num(0.0)
    if keep_mask is not None:
        p = p * keep_mask.to(p.device).float() / (1.0 - dropout_p)
    return torch.einsum("bhij,bjhd->bihd", p.to(q.dtype), vv)


@dataclass(frozen=True)
class YardstickError:
    """Max-abs and relative-norm errors of a result and of the yardstick, both against the float64 truth."""

    max_abs: float
    yardstick_max_abs: float
    rel_norm: float
    yardstick_rel_norm: float
    floor: float

    @property
    def bound(self) -> float:
        return 2.0 * self.yardstick_max_abs + self.floor

    @property
    def ratio(self) -> float:
        """max_abs over twice the yardstick's (plus the floor): <= 1 passes flash-attn's standard."""
        return self.max_abs / self.bound

    @property
    def ok(self) -> bool:
        return math.isfinite(self.max_abs) and self.max_abs <= self.bound

    def __str__(self) -> str:
        return (f"max-abs {self.max_abs:.3e} vs PyTorch fp16 {self.yardstick_max_abs:.3e} (bound {self.bound:.3e}, "
                f"ratio {self.ratio:.2f}); rel-norm {self.rel_norm:.2e} vs {self.yardstick_rel_norm:.2e}")


FP16_UNIT_ROUNDOFF = 2.0**-11


def saved_output_floors(q, k, out, dout, probs, softmax_scale, dropout_p=0.0) -> tuple[float, float]:
    """Extra floors for dQ and dK: the error that rounding the saved output O to fp16 causes through
    D = rowsum(dO * O), which FlashAttention's backward (flash-attn's and ours) takes instead of rowsum(P * dP).

    Where the truth is exactly 0 by cancellation (every row sees one key: dS = P (dP - D) = 0), PyTorch's autograd
    gets 0 too, so "twice its error" would demand exact zeros that no FlashAttention backward can give. Each row's
    error in D is about u * ||dO_i * O_i|| (u = 2^-11, rounding errors of random sign); it reaches
    dQ_i = scale * sum_j dS_ij K_j through sum_j P_ij = 1 (1 / (1 - p) under dropout), and
    dK_j = scale * sum_i dS_ij Q_i through sqrt(sum_i P_ij^2 eps_i^2) over the rows of every head of its group.
    probs: the float64 softmax [B, H, Nq, Nk] (naive_attention(..., return_probs=True)).
    """
    keep_scale = 1.0 / (1.0 - dropout_p)
    eps = FP16_UNIT_ROUNDOFF * (dout.double() * out.double()).pow(2).sum(-1).sqrt()  # [B, Nq, H]
    eps = eps.transpose(1, 2)  # [B, H, Nq]
    dq_floor = softmax_scale * keep_scale * eps.max().item() * k.double().abs().max().item() if eps.numel() else 0.0
    per_key = (probs.pow(2) * eps.pow(2).unsqueeze(-1)).sum(2)  # [B, H, Nk]
    group = q.shape[2] // k.shape[2]
    per_key = per_key.view(per_key.shape[0], k.shape[2], group, -1).sum(2).sqrt()
    dk_floor = softmax_scale * keep_scale * (per_key.max().item() if per_key.numel() else 0.0) * q.double().abs().max().item()
    return dq_floor, dk_floor


def error_vs_yardstick(got: torch.Tensor, yardstick: torch.Tensor, truth: torch.Tensor,
                       extra_floor: float = 0.0) -> YardstickError:
    truth = truth.double()
    got_err = got.double() - truth
    yard_err = yardstick.double() - truth
    norm = truth.norm().clamp_min(1e-30)
    scale = truth.abs().max().item() if truth.numel() else 0.0
    return YardstickError(
        max_abs=got_err.abs().max().item() if truth.numel() else 0.0,
        yardstick_max_abs=yard_err.abs().max().item() if truth.numel() else 0.0,
        rel_norm=(got_err.norm() / norm).item(),
        yardstick_rel_norm=(yard_err.norm() / norm).item(),
        floor=YARDSTICK_FLOOR * scale + 1e-7 + extra_floor,
    )


def dense_keep_mask(seed: int, offset: int, dropout_p: float, batch: int, nheads: int, seqlen_q: int, seqlen_k: int,
                    device="cpu") -> torch.Tensor:
    """[B, H, Nq, Nk] bool: the dropout keep mask every backend draws for these coordinates (volta_train.philox)."""
    from volta_train import philox

    bh = torch.arange(batch * nheads, device=device)
    rows = torch.arange(seqlen_q, device=device)
    cols = torch.arange(seqlen_k, device=device)
    return philox.dropout_keep_mask(seed, offset, dropout_p, bh, rows, cols).view(batch, nheads, seqlen_q, seqlen_k)
