"""Padding helpers with flash_attn.bert_padding's names, signatures and return values (flash-attn 2.8).

Between a padded batch ``[batch, seqlen, ...]`` with an attention mask and the packed ``[total_tokens, ...]``
layout of the varlen API::

    x_unpad, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, attention_mask)
    out_unpad = flash_attn_varlen_func(q_unpad, k_unpad, v_unpad, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    out = pad_input(out_unpad, indices, batch, seqlen)      # padded positions are zeros

All are differentiable (gathers and scatters of PyTorch's own), and work under any device.
"""

from __future__ import annotations

import torch

from . import validation

__all__ = [
    "index_first_axis",
    "index_put_first_axis",
    "unpad_input",
    "pad_input",
    "unpad_input_for_concatenated_sequences",
]


def _check_indices(indices: torch.Tensor, size: int, what: str) -> None:
    validation.require_tensor("indices", indices)
    if indices.dim() != 1 or indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"indices must be a 1-D int64 (or int32) tensor, got {indices.dtype} {tuple(indices.shape)}")
    if not indices.numel() or torch.compiler.is_compiling():
        return
    if indices.is_cuda:  # checked on the GPU: a host read here would stall every layer of a padded batch
        in_range = (indices.min() >= 0) & (indices.max() < size)
        torch._assert_async(in_range, f"indices out of range; accepted: 0 to {size - 1} ({what})")
        return
    low, high = int(indices.min()), int(indices.max())
    if low < 0 or high >= size:
        raise ValueError(f"indices run from {low} to {high}; accepted: 0 to {size - 1} ({what})")


def index_first_axis(input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """input[indices] along the first axis: [n, ...] -> [len(indices), ...]."""
    validation.require_tensor("input", input)
    if input.dim() < 1:
        raise ValueError("input must have at least one axis")
    _check_indices(indices, input.shape[0], "the rows of input")
    return input.index_select(0, indices.long())


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
    """A zero tensor [first_axis_dim, ...] with rows ``indices`` set to ``values``; the inverse of index_first_axis."""
    validation.require_tensor("values", values)
    first_axis_dim = validation.as_int("first_axis_dim", first_axis_dim)
    _check_indices(indices, first_axis_dim, f"first_axis_dim is {first_axis_dim}")
    if values.shape[0] != indices.shape[0]:
        raise ValueError(f"values has {values.shape[0]} rows but indices {indices.shape[0]}: they must be equal")
    out = values.new_zeros((first_axis_dim,) + tuple(values.shape[1:]))
    return out.index_put((indices.long(),), values)


def _mask(name: str, mask, hidden_states: torch.Tensor) -> torch.Tensor:
    validation.require_tensor(name, mask)
    if mask.dim() != 2 or tuple(mask.shape) != tuple(hidden_states.shape[:2]):
        raise ValueError(
            f"{name} has shape {tuple(mask.shape)}; accepted: [batch, seqlen] = {tuple(hidden_states.shape[:2])}"
        )
    if mask.dtype != torch.bool:
        if mask.dtype.is_floating_point or mask.dtype.is_complex or not ((mask == 0) | (mask == 1)).all():
            raise ValueError(f"{name} must hold 0/1 (bool or integer): 1 = a token, 0 = padding; got {mask.dtype}")
        mask = mask.bool()
    return mask


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask: torch.Tensor | None = None):
    """[batch, seqlen, ...] + mask [batch, seqlen] (1 = token) -> the tokens packed, as flash-attn 2.8 returns them.

    ``unused_mask`` (optional, [batch, seqlen]): positions that are allocated but unused; they are packed too
    (counted in cu_seqlens) but not in ``seqused``. Tokens keep their order within a row; a row's tokens need
    not be contiguous.

    Returns (hidden_states_unpad [total, ...], indices [total] int64 into the flattened batch*seqlen axis,
    cu_seqlens [batch + 1] int32, max_seqlen int, seqused [batch] int32: the tokens of attention_mask per row).
    """
    validation.require_tensor("hidden_states", hidden_states)
    if hidden_states.dim() < 2:
        raise ValueError(f"hidden_states must be [batch, seqlen, ...], got shape {tuple(hidden_states.shape)}")
    mask = _mask("attention_mask", attention_mask, hidden_states)
    used = mask.sum(dim=-1, dtype=torch.int32)
    if unused_mask is not None:
        unused = _mask("unused_mask", unused_mask, hidden_states)
        if (mask & unused).any():
            raise ValueError("attention_mask and unused_mask overlap: a position is either a token or unused")
        mask = mask | unused
    seqlens = mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max()) if seqlens.numel() else 0
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape((-1,) + tuple(hidden_states.shape[2:]))
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen, used


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Packed [total, ...] back to [batch, seqlen, ...] at ``indices`` (from unpad_input); other positions zero."""
    batch = validation.as_int("batch", batch)
    seqlen = validation.as_int("seqlen", seqlen)
    validation.require_tensor("hidden_states", hidden_states)
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.view((batch, seqlen) + tuple(hidden_states.shape[1:]))


def unpad_input_for_concatenated_sequences(hidden_states: torch.Tensor, attention_mask_in_length: torch.Tensor):
    """Unpad rows that each hold several sequences back to back (packing without cross-attention).

    ``attention_mask_in_length`` [batch, seqlen]: row b lists the lengths of the sequences packed into row b,
    then zeros, e.g. ``[[2, 3, 0, 0, 0, 0], [3, 2, 0, 0, 0, 0]]``; the sequences occupy the first
    sum(lengths) positions of the row. Returns (hidden_states_unpad, indices, cu_seqlens [n_sequences + 1] int32,
    max_seqlen int): cu_seqlens has one entry per sequence, so no token attends across sequences.
    """
    validation.require_tensor("hidden_states", hidden_states)
    lengths = attention_mask_in_length
    validation.require_tensor("attention_mask_in_length", lengths)
    if lengths.dim() != 2 or tuple(lengths.shape) != tuple(hidden_states.shape[:2]):
        raise ValueError(
            f"attention_mask_in_length has shape {tuple(lengths.shape)}; accepted: [batch, seqlen] = "
            f"{tuple(hidden_states.shape[:2])}"
        )
    if lengths.dtype.is_floating_point or lengths.dtype == torch.bool or (lengths < 0).any():
        raise ValueError("attention_mask_in_length must hold non-negative integer sequence lengths")
    seqlen = lengths.shape[1]
    per_row = lengths.sum(dim=-1)
    if (per_row > seqlen).any():
        raise ValueError(f"a row of attention_mask_in_length sums to {int(per_row.max())} > seqlen {seqlen}")
    seqlens = lengths[lengths > 0].to(torch.int32)  # row-major: the sequences in order
    positions = torch.arange(seqlen, device=lengths.device).view(1, -1)
    mask = positions < per_row.view(-1, 1)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max()) if seqlens.numel() else 0
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape((-1,) + tuple(hidden_states.shape[2:]))
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen
