"""What eager attention writes at padded query positions, for the padding route of the attention function.

The padding route unpads the queries, so no query is computed at a padded position. Eager attention computes one
there like any other: a softmax over the keys its mask lets that row see (the causal or windowed pattern and the
padding mask on the keys) with the mask added as the dtype's lowest value, so a row that sees no key at all gets
equal weights on every key. No real token reads those rows through attention, but a model that mixes positions by
other means (a convolution over the sequence) or takes a per-position statistic whose derivative is infinite at zero
(gemma3n's final ``mean(h ** 2) ** 0.5`` of an all-zero pad stream) depends on them. :func:`fill` computes those rows
the way eager does, over the padded rows only (the real rows keep the flash path), by what each row sees:

* no key (left padding under causality, rows past a window), without gradients: eager's equal weights, the mean of
  v over every key slot (with sinks: zero, the sink takes the whole weight); with gradients the dense path below,
  whose autograd gives q and k eager's gradient there;
* every token key of its sequence (right padding under causality without a window, bidirectional padding): one
  non-causal ``flash_attn_varlen_func`` call over the sequence's tokens, on the kernel where it runs;
* anything else (a window that cuts the tokens): densely in PyTorch, one chunk of rows at a time under activation
  checkpointing so that at most one chunk's scores are held.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from ...interface import flash_attn_varlen_func
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
    seen = torch.nn.functional.pad(key_valid.long().cumsum(1), (1, 0))  # [b, sk + 1]: tokens among keys [0, j)
    position = padded[:, 1] + covered - seqlen_q  # each padded query's own slot among the keys
    lo = (position - left).clamp(0, seqlen_k) if left >= 0 else torch.zeros_like(position)
    hi = (position + right + 1).clamp(0, seqlen_k) if right >= 0 else torch.full_like(position, seqlen_k)
    hi = torch.maximum(hi, lo)
    count = seen[padded[:, 0], hi] - seen[padded[:, 0], lo]
    sees_none, sees_all = count == 0, (count == seen[padded[:, 0], -1]) & (count > 0)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        # eager's autograd gives q and k a gradient at those rows (through the lowest value added to every score),
        # which the mean of v does not have: with gradients they take the dense path
        sees_none = torch.zeros_like(sees_none)
    index, parts = [], []
    if sees_none.any():
        none = padded[sees_none]
        index.append(none)
        parts.append(_no_key_rows(v, q.shape[2], sinks)[none[:, 0]])
    if sees_all.any():
        every = padded[sees_all]
        index.append(every)
        parts.append(_token_key_rows(q, k, v, key_valid, every, scale, softcap, sinks))
    dense = padded[~(sees_none | sees_all)]
    for batch in dense[:, 0].unique().tolist():
        for rows in dense[dense[:, 0] == batch, 1].split(chunk):
            index.append(torch.stack([torch.full_like(rows, batch), rows], 1))
            at = (rows + covered - seqlen_q).unsqueeze(1)
            visible = key_valid[batch].unsqueeze(0).expand(rows.numel(), seqlen_k)
            if left >= 0:
                visible = visible & (keys >= at - left)
            if right >= 0:
                visible = visible & (keys <= at + right)
            parts.append(checkpoint(_rows, q[batch, rows], k[batch], v[batch], visible, scale, softcap, sinks,
                                    use_reentrant=False))
    where = torch.cat(index)
    return out.index_put((where[:, 0], where[:, 1]), torch.cat([p.to(out.dtype) for p in parts]))


def _no_key_rows(v: torch.Tensor, heads: int, sinks: torch.Tensor | None) -> torch.Tensor:
    """What a row that sees no key holds, per batch entry: v [b, sk, hkv, dv] -> [b, h, dv], eager's equal weights
    over every key slot (its mask adds the dtype's lowest value everywhere), or zero where a sink logit takes the
    whole weight."""
    dtype = compute_dtype(v.dtype)
    mean = v.to(dtype).mean(dim=1)
    out = mean.repeat_interleave(heads // v.shape[2], dim=1)
    return out * 0 if sinks is not None else out


def _token_key_rows(q, k, v, key_valid, rows, scale, softcap, sinks) -> torch.Tensor:
    """Rows (pairs batch, query) that see every token key of their sequence and nothing else: one non-causal varlen
    call of those queries over their sequences' tokens -> [n, h, dv]."""
    batches, counts = rows[:, 0].unique_consecutive(return_counts=True)
    lengths = key_valid[batches].sum(1)
    zero = torch.zeros(1, dtype=torch.int32, device=q.device)
    cu_q = torch.cat([zero, counts.cumsum(0).to(torch.int32)])
    cu_k = torch.cat([zero, lengths.cumsum(0).to(torch.int32)])
    entry, slot = key_valid[batches].nonzero(as_tuple=True)  # the token keys of those sequences, in order
    options = {"softmax_scale": scale, "causal": False}
    if softcap:
        options["softcap"] = softcap
    if sinks is not None:
        options["sinks"] = sinks
    out = flash_attn_varlen_func(q[rows[:, 0], rows[:, 1]], k[batches[entry], slot], v[batches[entry], slot], cu_q,
                                 cu_k, int(counts.max()), int(lengths.max()), **options)
    return out.to(compute_dtype(q.dtype))
