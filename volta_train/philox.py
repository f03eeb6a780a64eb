"""Philox 4x32-10 and the dropout keep/drop function shared by every backend.

The dropout decision for one attention-score element is a pure function of
``(seed, offset, batch, head, row, col)``; the CUDA kernels (csrc/philox.cuh)
implement exactly the same function, so a kernel's mask can be compared with
this module's bit for bit.

Specification (docs/dropout.md gives the reasoning)::

    key     = (lo32(seed), hi32(seed) ^ hi32(offset))
    counter = (col >> 3, row, batch * nheads + head, lo32(offset))
    r0..r3  = philox4x32_10(counter, key)
    u16     = 16-bit chunk number (col & 7) of (r0, r1, r2, r3), low half first
    keep    = u16 >= dropout_threshold(p)

One Philox call therefore decides eight consecutive columns of one row: the
row-major layout in which the Volta kernels hold P after the softmax.
"""

from __future__ import annotations

import torch

PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
PHILOX_ROUNDS = 10
MASK32 = 0xFFFFFFFF
COLS_PER_PHILOX_CALL = 8
DROPOUT_RESOLUTION = 1 << 16  # dropout decisions compare 16-bit uniform integers


def _mulhilo32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of the 64-bit product a * b; b holds uint32 values in int64.

    The product can exceed int64, so a is split into 16-bit halves: each partial
    product stays below 2**48.
    """
    a_lo, a_hi = a & 0xFFFF, a >> 16
    p_lo = b * a_lo                      # < 2**48
    p_hi = b * a_hi                      # < 2**48
    lo = (p_lo + ((p_hi & 0xFFFF) << 16)) & MASK32
    carry = (p_lo + ((p_hi & 0xFFFF) << 16)) >> 32
    hi = ((p_hi >> 16) + carry) & MASK32
    return hi, lo


def philox4x32_10(counter: tuple[torch.Tensor, ...], key: tuple[torch.Tensor | int, torch.Tensor | int]):
    """Philox 4x32 with 10 rounds (Salmon et al., SC'11) on int64 tensors holding uint32 words."""
    c0, c1, c2, c3 = (c & MASK32 for c in counter)
    k0, k1 = key
    for round_index in range(PHILOX_ROUNDS):
        hi0, lo0 = _mulhilo32(PHILOX_M0, c0)
        hi1, lo1 = _mulhilo32(PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        if round_index + 1 < PHILOX_ROUNDS:
            k0 = (k0 + PHILOX_W0) & MASK32
            k1 = (k1 + PHILOX_W1) & MASK32
    return c0, c1, c2, c3


def dropout_threshold(p: float) -> int:
    """16-bit threshold: an element is kept when its uniform 16-bit integer is >= this.

    The realised drop probability is threshold / 65536, within 2**-17 of p.
    """
    return min(DROPOUT_RESOLUTION - 1, int(round(p * DROPOUT_RESOLUTION)))


def philox_key(seed: int, offset: int) -> tuple[int, int]:
    return seed & MASK32, ((seed >> 32) ^ (offset >> 32)) & MASK32


def dropout_keep_mask(
    seed: int,
    offset: int,
    p: float,
    batch_head: torch.Tensor,
    rows: torch.Tensor,
    cols: torch.Tensor,
) -> torch.Tensor:
    """Boolean keep mask of shape [len(batch_head), len(rows), len(cols)].

    ``batch_head`` holds ``batch * nheads + head`` for each leading entry; rows and
    cols are the element coordinates (within the sequence for varlen).
    """
    device = rows.device
    k0, k1 = philox_key(seed, offset)
    groups = torch.unique_consecutive(cols >> 3)
    bh = batch_head.to(torch.int64).view(-1, 1, 1)
    r = rows.to(torch.int64).view(1, -1, 1)
    g = groups.to(torch.int64).view(1, 1, -1)
    shape = (bh.shape[0], r.shape[1], g.shape[2])
    counter = (
        g.expand(shape),
        r.expand(shape),
        (bh & MASK32).expand(shape),
        torch.full(shape, offset & MASK32, dtype=torch.int64, device=device),
    )
    words = torch.stack(philox4x32_10(counter, (k0, k1)), dim=-1)  # [BH, R, G, 4]
    halves = torch.stack((words & 0xFFFF, words >> 16), dim=-1).flatten(-2)  # [BH, R, G, 8]
    # pick, for every requested column, its group and its chunk within the group
    group_index = torch.searchsorted(groups, cols >> 3)
    u16 = halves[:, :, group_index, (cols & 7)]
    return u16 >= dropout_threshold(p)


def draw_seed_offset(device: torch.device) -> tuple[int, int]:
    """(seed, offset) for one dropout call, taken from PyTorch's generator of that device.

    CUDA: the device generator's seed and Philox offset, which is then advanced, as PyTorch's own fused kernels do, so
    ``torch.manual_seed`` reproduces a run. Other devices: a 63-bit seed drawn from the default CPU generator, offset 0.
    """
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            raise NotImplementedError(
                "dropout_p > 0 inside CUDA graph capture: the Philox offset would be frozen into the graph and every "
                "replay would reuse one dropout mask; capture with dropout_p=0.0"
            )
        index = device.index if device.index is not None else torch.cuda.current_device()
        generator = torch.cuda.default_generators[index]
        offset = generator.get_offset()
        generator.set_offset(offset + 4)
        return generator.initial_seed(), offset
    seed = int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64).item())
    return seed, 0
