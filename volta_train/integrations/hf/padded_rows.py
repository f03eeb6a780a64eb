"""What eager attention writes at padded query positions, for the padding route of the attention function.

The padding route unpads the queries, so no query is computed at a padded position. Eager attention computes one
there like any other: a softmax over the keys its mask lets that row see (the causal or windowed pattern and the
padding mask on the keys) with the mask added as the dtype's lowest value, so a row that sees no key at all gets
equal weights on every key. No real token reads those rows through attention, but a model that mixes positions by
other means (a convolution over the sequence) or takes a per-position statistic whose derivative is infinite at zero
(gemma3n's final ``mean(h ** 2) ** 0.5`` of an all-zero pad stream) depends on them. :func:`fill` computes those rows
the way eager does, densely in PyTorch over the padded rows only (the real rows keep the flash path), one chunk of
rows at a time under activation checkpointing so that at most one chunk's scores are held.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from ...options import compute_dtype

SCORES_PER_CHUNK = 1 << 22  # score entries (rows x heads x keys) of one chunk of padded query rows


def _rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float, softcap: float,
          sinks: torch.Tensor | None) -> torch.Tensor:
    """q [n, h, d], k [sk, hkv, d], v [sk, hkv, dv], visible [n, sk] -> eager's out [n, h, dv] (compute dtype)."""
    with torch.autocast(q.device.type, enabled=False):  # fp32 (fp64) as the reference backend, whatever autocast says
        return _rows_in(q, k, v, visible, scale, softcap, sinks)


def _rows_in(q, k, v, visible, scale, softcap, sinks):
    dtype = compute_dtype(q.dtype)
    rows, heads, _ = q.shape
    heads_kv = k.shape[1]
    group = heads // heads_kv
    qg = q.to(dtype).reshape(rows, heads_kv, group, -1)
    scores = torch.einsum("nkgd,skd->kgns", qg, k.to(dtype)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    lowest = torch.finfo(dtype).min  # eager's additive mask; a row with nothing visible gets equal weights
    scores = scores + torch.where(visible, scores.new_zeros(()), scores.new_full((), lowest))
    if sinks is not None:  # gpt-oss's eager: the sink logit joins the softmax and carries no value
        sink = sinks.to(dtype).reshape(heads_kv, group, 1, 1).expand(heads_kv, group, rows, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("kgns,skd->nkgd", probs, v.to(dtype)).reshape(rows, heads, -1)


def fill(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_valid: torch.Tensor,
         key_valid: torch.Tensor, options: dict[str, Any]) -> torch.Tensor:
    """out [b, sq, h, dv] (zeros at padded queries) -> the same with eager's rows at the padded queries.

    q [b, sq, h, d]; k/v [b, sk, hkv, d or dv]; query_valid [b, sq] and key_valid [b, sk] (True for tokens). The
    queries are the last sq of the key_valid.shape[1] tokens that the 2-D mask covers (more key slots, as a static
    cache has, are unwritten and masked). Causality, window, scale, soft-cap and sinks come from ``options``;
    dropout is not applied to these rows. Differentiable: gradients reach q, k, v and the sinks as in eager.
    """
    padded = (~query_valid).nonzero()
    if padded.numel() == 0:
        return out
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    covered = key_valid.shape[1]
    if covered < seqlen_k:  # unwritten key slots: masked, as eager's mask pads the 2-D mask with zeros
        key_valid = torch.nn.functional.pad(key_valid, (0, seqlen_k - covered), value=False)
    left, right = options.get("window_size") or (-1, -1)
    if options["causal"]:
        right = 0
    keys = torch.arange(seqlen_k, device=q.device)
    scale = options.get("softmax_scale")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)  # flash-attn's default where none is given
    softcap, sinks = float(options.get("softcap") or 0.0), options.get("sinks")
    chunk = max(1, SCORES_PER_CHUNK // (q.shape[2] * seqlen_k))
    parts = []
    for batch in padded[:, 0].unique().tolist():
        for rows in padded[padded[:, 0] == batch, 1].split(chunk):
            position = (rows + covered - seqlen_q).unsqueeze(1)  # each query's own token among the keys
            visible = key_valid[batch].unsqueeze(0).expand(rows.numel(), seqlen_k)
            if left >= 0:
                visible = visible & (keys >= position - left)
            if right >= 0:
                visible = visible & (keys <= position + right)
            parts.append(checkpoint(_rows, q[batch, rows], k[batch], v[batch], visible, scale, softcap, sinks,
                                    use_reentrant=False))
    return out.index_put((padded[:, 0], padded[:, 1]), torch.cat(parts).to(out.dtype))
