"""The head_dim 256 backward on a V100 through PyTorch's memory-efficient attention backward (CUTLASS's Sm70 kernel).

At head_dim 256 no tile of the Volta backward keeps more than 4 warps per SM within 96 KB, so on sm_70 the backward
of a call the kernels run at head_dim 256 goes to the kernel ``F.scaled_dot_product_attention`` runs there, where the
two compute the same thing (docs/performance.md gives the V100 estimate). The forward stays volta_train's: its output
and log-sum-exp (natural log, +inf on rows that see no key) are what CUTLASS's backward recomputes P from.

Same thing means: dense batch (no cu_seqlens), no dropout (CUTLASS would draw its own mask, not the forward's Philox
one), no soft-capping, no ALiBi, no local window, and ``deterministic=False`` (CUTLASS may add dQ over key splits with
atomics). ``causal`` is flash-attn's bottom-right-aligned mask (CUTLASS's ``CausalFromBottomRight``). GQA / MQA: K and V
are expanded to the query heads and their gradients summed back per group.

``VOLTA_TRAIN_CUTLASS_BACKWARD``: ``auto`` (default: sm_70 only), ``always`` (wherever the call qualifies, any GPU: the
tests use it on sm_80+), ``never``.
"""

from __future__ import annotations

import os

import torch

from .kernels import head_dim as head_dims
from .kernels.support import CallDescription
from .options import AttentionOptions

POLICY_ENV = "VOLTA_TRAIN_CUTLASS_BACKWARD"
POLICY_CHOICES = ("auto", "always", "never")
CUTLASS_HEAD_DIM = 256  # the kernel head_dim whose backward this replaces
_LSE_ALIGN = 32  # PyTorch's memory-efficient kernels keep the log-sum-exp rows padded to a multiple of 32
_MASK_NONE, _MASK_CAUSAL_BOTTOM_RIGHT = 0, 2  # sdp::CustomMaskType


def policy() -> str:
    value = os.environ.get(POLICY_ENV, "auto").strip().lower() or "auto"
    if value not in POLICY_CHOICES:
        raise ValueError(f"{POLICY_ENV}={value!r}; accepted: {', '.join(POLICY_CHOICES)}")
    return value


def why_not(call: CallDescription) -> str | None:
    """None when this backward call goes to CUTLASS's kernel, else why not (for tests and the log)."""
    chosen = policy()
    if chosen == "never":
        return f"{POLICY_ENV}=never"
    if call.kernel_head_dim != CUTLASS_HEAD_DIM:
        return f"kernel head_dim {call.kernel_head_dim} (only {CUTLASS_HEAD_DIM} goes to CUTLASS)"
    if chosen == "auto" and call.arch != 70:
        return f"sm_{call.arch} (auto: sm_70 only)"
    o = call.options
    for flag, reason in ((call.varlen, "varlen (cu_seqlens)"), (o.dropout_p > 0.0, "dropout (the forward's Philox mask)"),
                         (o.softcap > 0.0, "softcap"), (call.alibi, "ALiBi"),
                         (call.value_head_dim is not None, "v's own head_dim"),
                         (o.window != (-1, -1), "a local window"),
                         (o.deterministic, "deterministic=True")):
        if flag:
            return reason
    return None


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, options: AttentionOptions) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of flash-attn layouts ([B, N, H, D], fp16) from PyTorch's memory-efficient backward at the kernels'
    head_dim; lse [B, H, Nq] fp32 as volta_train's forward returns it."""
    head_dim = q.shape[-1]
    padded = [head_dims.pad(t, CUTLASS_HEAD_DIM) for t in (dout, q, k, v, out)]
    grads = _backward(*padded, lse, options.softmax_scale, options.causal)
    return tuple(g[..., :head_dim] for g in grads)


def _backward(dout, q, k, v, out, lse, softmax_scale: float, causal: bool):
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
