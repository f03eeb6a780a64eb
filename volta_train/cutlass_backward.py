"""head_dim 256 backward on a V100 through PyTorch's memory-efficient attention backward (the CUTLASS Sm70 kernel).

At head_dim 256 no tile of the Volta backward reaches more than 4 warps per SM within 96 KB, and its split dK/dV
kernel recomputes S and dP in both halves: the V100 estimate puts it at 15.3 TFLOP/s against 35.5 for CUTLASS's
``fmha_cutlassB_f16_aligned_128x64_k65536_sm70`` (what ``F.scaled_dot_product_attention`` runs on a V100), and the
H100 harness measured it 0.86-0.93x CUTLASS (docs/performance.md, "head_dim 256"). So where the two compute the
same thing, the backward of a head_dim 129-256 call on sm_70 runs CUTLASS's: the forward stays volta_train's
(1.4x CUTLASS's there), its output and log-sum-exp (natural log, +inf on rows that see no key) are what CUTLASS's
backward recomputes P from.

Same thing means: dense batch (no cu_seqlens), no dropout (CUTLASS would draw its own mask, not the forward's
Philox one), no soft-capping, no ALiBi, no local window, and ``deterministic=False`` (CUTLASS may add dQ over key
splits with atomics). ``causal`` is flash-attn's bottom-right-aligned mask (CUTLASS's ``CausalFromBottomRight``).
GQA / MQA: K and V are expanded to the query heads and their gradients summed back per group.

``VOLTA_TRAIN_D256_BACKWARD``: ``auto`` (default: sm_70 only), ``cutlass`` (wherever the call qualifies, any GPU:
the tests use it on sm_80+), ``volta`` (never).
"""

from __future__ import annotations

import os

import torch

D256_BACKWARD_ENV = "VOLTA_TRAIN_D256_BACKWARD"
D256_BACKWARD_CHOICES = ("auto", "cutlass", "volta")
CUTLASS_HEAD_DIM = 256  # the kernel head_dim whose backward this replaces
_LSE_ALIGN = 32  # PyTorch's memory-efficient kernels keep the log-sum-exp rows padded to a multiple of 32
_MASK_NONE, _MASK_CAUSAL_BOTTOM_RIGHT = 0, 2  # sdp::CustomMaskType


def policy() -> str:
    value = os.environ.get(D256_BACKWARD_ENV, "auto").strip().lower() or "auto"
    if value not in D256_BACKWARD_CHOICES:
        raise ValueError(f"{D256_BACKWARD_ENV}={value!r}; accepted: {', '.join(D256_BACKWARD_CHOICES)}")
    return value


def why_not(kernel_head_dim: int, arch: int, varlen: bool, dropout_p: float, softcap: float, alibi: bool,
            window: tuple[int, int], deterministic: bool) -> str | None:
    """None when this backward call goes to CUTLASS's kernel, else why not (for tests and the log)."""
    chosen = policy()
    if chosen == "volta":
        return f"{D256_BACKWARD_ENV}=volta"
    if kernel_head_dim != CUTLASS_HEAD_DIM:
        return f"kernel head_dim {kernel_head_dim} (only {CUTLASS_HEAD_DIM} goes to CUTLASS)"
    if chosen == "auto" and arch != 70:
        return f"sm_{arch} (auto: sm_70 only)"
    for flag, reason in ((varlen, "varlen (cu_seqlens)"), (dropout_p > 0.0, "dropout (the forward's Philox mask)"),
                         (softcap > 0.0, "softcap"), (alibi, "ALiBi"), (window != (-1, -1), "a local window"),
                         (deterministic, "deterministic=True")):
        if flag:
            return reason
    return None


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, softmax_scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of flash-attn layouts ([B, N, H, D], fp16, head_dim a multiple of 8) from PyTorch's memory-efficient
    backward; lse [B, H, Nq] fp32 as volta_train's forward returns it."""
    batch, seqlen_q, nheads, _ = q.shape
    nheads_kv = k.shape[2]
    group = nheads // nheads_kv
    if group > 1:
        k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
    rows = -(-seqlen_q // _LSE_ALIGN) * _LSE_ALIGN
    lse_padded = torch.zeros((batch, nheads, rows), dtype=torch.float32, device=q.device)
    lse_padded[:, :, :seqlen_q] = lse
    no_rng = torch.zeros((), dtype=torch.int64)  # read only under dropout
    dq, dk, dv, _ = torch.ops.aten._efficient_attention_backward(
        dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), None, out.contiguous(), None, None,
        seqlen_q, k.shape[1], lse_padded, 0.0, no_rng, no_rng,
        _MASK_CAUSAL_BOTTOM_RIGHT if causal else _MASK_NONE, False, scale=softmax_scale)
    if group > 1:  # the expanded heads' gradients, summed per KV head (in fp32)
        dk, dv = (g.view(batch, g.shape[1], nheads_kv, group, g.shape[-1]).float().sum(3).to(g.dtype)
                  for g in (dk, dv))
    return dq, dk, dv
