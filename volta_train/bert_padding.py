"""Padding helpers with flash-attn's ``flash_attn.bert_padding`` names and signatures.

``unpad_input`` turns a padded ``[batch, seqlen, ...]`` tensor and its 2-D mask into
the packed ``[total, ...]`` tokens plus the ``cu_seqlens`` that
:func:`volta_train.flash_attn_varlen_func` takes; ``pad_input`` puts the output
back. :func:`volta_train.install_flash_attn` serves this module as
``flash_attn.bert_padding``. All are plain differentiable tensor indexing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def index_first_axis(input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``input[indices]`` along the first axis: input [total, ...], indices [n] (int64) -> [n, ...]."""
    if input.dim() < 1:
        raise ValueError(f"input must have a first axis to index, got a {input.dim()}-D tensor")
    return input.index_select(0, indices)


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
    """Zeros of [first_axis_dim, ...] with ``values`` [n, ...] at rows ``indices`` [n]."""
    if values.shape[0] != indices.shape[0]:
        raise ValueError(f"values has {values.shape[0]} rows but indices has {indices.shape[0]}: they must match")
    out = values.new_zeros(first_axis_dim, *values.shape[1:])
    return out.index_copy(0, indices, values)


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask: torch.Tensor | None = None):
    """hidden_states [batch, seqlen, ...], attention_mask [batch, seqlen] (1 = token, 0 = padding) ->
    (tokens [total, ...], indices [total], cu_seqlens int32 [batch + 1], max_seqlen_in_batch int, seqused int32 [batch]).

    ``unused_mask`` marks tokens that are kept (counted in cu_seqlens) but not used; ``seqused`` counts the used
    tokens of each row (flash-attn 2.6's five return values).
    """
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != tuple(hidden_states.shape[:2]):
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}; it must be [batch, seqlen] = "
            f"{tuple(hidden_states.shape[:2])}, the first two axes of hidden_states"
        )
    used = attention_mask.to(torch.bool)
    kept = used | unused_mask.to(torch.bool) if unused_mask is not None else used
    seqlens = kept.sum(dim=-1, dtype=torch.int32)
    seqused = used.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(kept.reshape(-1), as_tuple=False).reshape(-1)
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    tokens = index_first_axis(hidden_states.reshape(-1, *hidden_states.shape[2:]), indices)
    return tokens, indices, cu_seqlens, int(seqlens.max()) if seqlens.numel() else 0, seqused


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """tokens [total, ...] at ``indices`` of the flattened [batch * seqlen] positions -> [batch, seqlen, ...], zeros elsewhere."""
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.view(batch, seqlen, *hidden_states.shape[1:])


def unpad_input_for_concatenated_sequences(hidden_states: torch.Tensor, attention_mask_in_length: torch.Tensor):
    """Rows that hold several sequences back to back: ``attention_mask_in_length`` [batch, seqlen] lists each
    row's sequence lengths (then zeros), as in flash-attn. Returns (tokens, indices, cu_seqlens, max_seqlen)."""
    lengths = attention_mask_in_length.reshape(-1)
    lengths = lengths[lengths > 0].to(torch.int32)
    seqlen = attention_mask_in_length.shape[-1]
    row_tokens = attention_mask_in_length.sum(dim=-1)
    keep = torch.arange(seqlen, device=row_tokens.device)[None, :] < row_tokens[:, None]
    indices = torch.nonzero(keep.reshape(-1), as_tuple=False).reshape(-1)
    cu_seqlens = F.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))
    tokens = index_first_axis(hidden_states.reshape(-1, *hidden_states.shape[2:]), indices)
    return tokens, indices, cu_seqlens, int(lengths.max()) if lengths.numel() else 0


__all__ = [
    "index_first_axis",
    "index_put_first_axis",
    "pad_input",
    "unpad_input",
    "unpad_input_for_concatenated_sequences",
]
