"""Attention sinks: one learned logit per query head that joins every row's softmax denominator, with no value.

Both backends compute attention without them; :func:`fold` then adds them to the finished output and log-sum-exp,
which is exact: with ``lse' = logaddexp(lse, sink)`` each probability becomes ``exp(s - lse')``, so the output is the
sink-free one scaled by ``exp(lse - lse')``. A row that sees no key (``lse = +inf`` by convention) gets ``out = 0``
and ``lse' = sink``. The backward of either backend, given ``out'`` and ``lse'``, then recomputes the probabilities
with the sinks in the denominator, and :func:`backward` gives the sinks' own gradient.
"""

from __future__ import annotations

import torch


def _per_row(sinks: torch.Tensor, lse: torch.Tensor, varlen: bool) -> torch.Tensor:
    """sinks [H] shaped to broadcast with lse ([H, total_q] varlen, else [B, H, Nq])."""
    return sinks.to(lse.dtype).view(-1, 1) if varlen else sinks.to(lse.dtype).view(1, -1, 1)


def _to_out_layout(per_row: torch.Tensor, varlen: bool) -> torch.Tensor:
    """[H, total_q] -> [total_q, H, 1]; [B, H, Nq] -> [B, Nq, H, 1]: a per-row factor for out."""
    return (per_row.t() if varlen else per_row.transpose(1, 2)).unsqueeze(-1)


def fold(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, varlen: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of attention with sinks, from those of the same call without them."""
    sink = _per_row(sinks, lse, varlen)
    seen = torch.isfinite(lse)
    base = torch.where(seen, lse, torch.full_like(lse, -torch.inf))  # rows that see no key: only the sink remains
    new_lse = torch.logaddexp(base, sink)
    scale = torch.exp(base - new_lse)  # 0 on those rows
    folded = (out.to(lse.dtype) * _to_out_layout(scale, varlen)).to(out.dtype)
    return folded, new_lse


def backward(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor,
             varlen: bool) -> torch.Tensor:
    """The gradient of the sink logits [H] from the folded ``out`` and ``lse``: a sink's probability in row i is
    ``exp(sink - lse_i)`` and it carries no value, so its score gradient is ``-p_sink * rowsum(dO * O)``, summed over
    the rows of its head."""
    delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(dim=-1)  # [B, Nq, H] or [total_q, H]
    p_sink = torch.exp(_per_row(sinks, lse, varlen) - lse)
    per_row = p_sink * (delta.t() if varlen else delta.transpose(1, 2))
    return -per_row.sum(dim=tuple(d for d in range(per_row.dim()) if d != (0 if varlen else 1))).to(sinks.dtype)
