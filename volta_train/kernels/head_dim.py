"""The head_dim a kernel runs a call at, and the zero padding that takes a call there.

The kernels are built for the head dims of ``tiles.SUPPORTED_HEAD_DIMS``; any other head_dim up to the largest runs
on the next one, its inputs zero-padded in the last axis and its outputs sliced back. Zero columns of q, k, v, out and
dout change no score, no row sum and no gradient of a real column, and the softmax scale stays the caller's. A v whose
head_dim differs from q's and k's (multi-head latent attention) runs the same way: all three are padded to the kernel
head_dim that holds the larger, and the output and dv are sliced to v's head_dim, dq and dk to q's.
"""

from __future__ import annotations

import torch

from . import tiles


def forward_head_dim(head_dim: int) -> int | None:
    """The smallest head_dim the forward and decoding kernels are built for that holds ``head_dim``; None if none."""
    fits = [d for d in tiles.SUPPORTED_HEAD_DIMS if d >= head_dim]
    return min(fits) if fits else None


def backward_head_dim(head_dim: int, arch: int) -> int | None:
    """The head_dim of the backward kernels that run ``head_dim`` on ``arch`` (the tile table may pick a larger one
    than the forward's: ``tiles.bwd_kernel_head_dim``)."""
    d = forward_head_dim(head_dim)
    return None if d is None else tiles.bwd_kernel_head_dim(d, arch)


def require(head_dim: int, kernel_head_dim: int | None) -> int:
    """``kernel_head_dim``, or a ValueError naming ``head_dim`` and the head dims the kernels accept."""
    if kernel_head_dim is None:
        raise ValueError(f"head_dim {head_dim}: the Volta kernels run head_dim 1 to {max(tiles.SUPPORTED_HEAD_DIMS)}")
    return kernel_head_dim


def pad(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``t`` zero-padded in its last axis to ``head_dim``; ``t`` itself (no copy) when it has that already."""
    if t.shape[-1] == head_dim:
        return t
    if t.shape[-1] > head_dim:
        raise ValueError(f"a tensor of head_dim {t.shape[-1]} cannot be padded to the smaller {head_dim}")
    return torch.nn.functional.pad(t, (0, head_dim - t.shape[-1]))
