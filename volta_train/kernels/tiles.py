"""Tile tables of the Volta kernels: the tile of each head_dim, mask, accumulation mode and target, and the NVRTC
variant (volta_train/kernels/variants.py) that instantiates it. A variant's name expression and name are derived from
the kernel templates' declaration (volta_train/kernels/templates.py).

The sm_70 tables come from the V100 estimate (lab/v100_estimate.py), the sm_80+ ones from sweeps on an H100; the
figures behind each choice are in docs/performance.md. A variant's shared memory and block size are not computed
here: the compiled kernel exports them (csrc/launch_geometry.cuh).
"""

from __future__ import annotations

from dataclasses import dataclass

from .nvrtc import normalize_arch
from .templates import DECODE_KERNEL, DKDV_KERNEL, DQ_KERNEL, FWD_KERNEL, KernelTemplate
from .variants import KernelVariant

SUPPORTED_HEAD_DIMS = (16, 32, 48, 64, 80, 96, 112, 128, 256)


@dataclass(frozen=True, kw_only=True)
class FwdTile:
    """The tile's template parameters of FwdKernelTraits (templates.FWD_TRAITS): the forward, dQ and decoding kernels'
    tile."""

    quad_pair_rows: int  # quad-pairs along query rows: 4 (4x1: 8 rows each, all keys), 2 (2x2) or 1 (1x4)
    m_tiles: int  # 8-row tiles per quad-pair
    warps: int  # per CTA
    block_n: int  # keys per block
    min_blocks_per_sm: int = 1  # __launch_bounds__ occupancy target on sm_70
    min_blocks_emulated: int = 1  # the same on sm_80+, where m8n8k4 is emulated (see kernel_traits.cuh)
    q_in_smem: bool = False  # Q read from shared memory per use instead of held in registers
    split_masked: bool = False  # masked key blocks in their own loop, skipped by warps that see none of them
    # the forward rescales O only where a key block raises a row's max by more than 2^8 (fp32 accumulation; the
    # forward tile only: the dQ and decoding kernels keep the exact rescale)
    lazy_rescale: bool = False

    @property
    def rows_per_warp(self) -> int:
        return 8 * self.quad_pair_rows * self.m_tiles

    @property
    def block_m(self) -> int:
        return self.warps * self.rows_per_warp

    @property
    def threads(self) -> int:
        return 32 * self.warps


EMULATED_MMA_ARCH = 80  # from sm_80 on, mma.m8n8k4 is an emulation subroutine, not a tensor-core instruction

# Forward tiles per target, head_dim -> tile; head dims not listed use the next larger one's tile.
#
# sm_70 (V100): the best tile of the V100 estimate per head_dim. Every one runs 12 or more warps per SM (3 CTAs
#   within the 168-register cap of min_blocks_per_sm=3, spill-free): at the issue latency calibrated on a real-V100
#   profile, more resident warps beat the 8-warp tiles with Q in registers that the pipe model alone prefers. Full
#   and causal attention share a tile. head_dim 256 fits one CTA of 8 warps per SM (Q in registers would take 128 of
#   them). docs/performance.md, "Forward tile choice" and "Latency hiding". With fp32 accumulation they rescale O
#   lazily (lazy_rescale): the V100 runs latency-bound, and the rescale of O is a sizeable share of a key block's
#   instructions (docs/performance.md, "Lazy rescaling").
# sm_80+ (the Volta build on an H100/H200, m8n8k4 emulated): the fastest tiles of the H100 sweeps. Q lives in shared
#   memory there: the emulated m8n8k4 wants resident warps more than shared-memory bandwidth; the occupancy targets
#   trade a few bytes of L1 spills for more resident warps. docs/performance.md, "Forward tile choice".
FWD_TILES_SM70: dict[int, FwdTile] = {
    48: FwdTile(quad_pair_rows=2, m_tiles=1, warps=4, block_n=32, min_blocks_per_sm=3, q_in_smem=True,
                lazy_rescale=True),
    64: FwdTile(quad_pair_rows=2, m_tiles=1, warps=4, block_n=32, min_blocks_per_sm=3, lazy_rescale=True),
    96: FwdTile(quad_pair_rows=2, m_tiles=1, warps=4, block_n=16, min_blocks_per_sm=3, q_in_smem=True,
                lazy_rescale=True),
    128: FwdTile(quad_pair_rows=2, m_tiles=1, warps=4, block_n=16, min_blocks_per_sm=3, q_in_smem=True,
                 lazy_rescale=True),
    256: FwdTile(quad_pair_rows=2, m_tiles=1, warps=8, block_n=16, q_in_smem=True, lazy_rescale=True),
}
FWD_TILES_EMULATED: dict[int, FwdTile] = {
    64: FwdTile(quad_pair_rows=2, m_tiles=1, warps=4, block_n=32, min_blocks_emulated=4, q_in_smem=True),
    128: FwdTile(quad_pair_rows=2, m_tiles=1, warps=4, block_n=16, min_blocks_emulated=3, q_in_smem=True),
    256: FwdTile(quad_pair_rows=2, m_tiles=1, warps=8, block_n=16, q_in_smem=True),  # the sm_70 tile
}
# Causal attention on sm_80+: smaller key blocks (d64) and the split masked loop (d 80-128: warps that see none of a
# diagonal block skip it) cut the cost of the diagonal, which decides short causal sequences.
FWD_TILES_EMULATED_CAUSAL: dict[int, FwdTile] = {
    64: FwdTile(quad_pair_rows=2, m_tiles=1, warps=4, block_n=16, min_blocks_emulated=4, q_in_smem=True),
    128: FwdTile(quad_pair_rows=2, m_tiles=1, warps=4, block_n=16, min_blocks_emulated=3, q_in_smem=True,
                 split_masked=True),
    256: FwdTile(quad_pair_rows=2, m_tiles=1, warps=8, block_n=16, q_in_smem=True),
}


def fwd_tile(head_dim: int, causal: bool = False, arch: int = 70) -> FwdTile:
    if arch >= EMULATED_MMA_ARCH:
        table = FWD_TILES_EMULATED_CAUSAL if causal else FWD_TILES_EMULATED
    else:
        table = FWD_TILES_SM70
    for listed in sorted(table):
        if head_dim <= listed:
            return table[listed]
    raise ValueError(f"head_dim {head_dim}: the Volta forward kernel supports {SUPPORTED_HEAD_DIMS}")


def _variant(kernel: KernelTemplate, head_dim: int, tile: FwdTile | BwdTile, **arguments: bool) -> KernelVariant:
    """One variant of kernel: its name expression and name both derived from the template's declaration."""
    values = kernel.values(tile, head_dim=head_dim, **arguments)
    return KernelVariant(
        name=kernel.variant_name(values),
        sources=(kernel.source,),
        name_expressions=(kernel.expression(values),),
        meta={"head_dim": head_dim, "tile": tile, "accum_f16": values["accum_f16"], "dropout": values["dropout"],
              "softcap": values["softcap"], "pass": kernel.prefix},
    )


def fwd_variant(head_dim: int, tile: FwdTile, accum_f16: bool, dropout: bool, softcap: bool = False) -> KernelVariant:
    # (lazy rescaling applies to fp32 accumulation only: an fp16 variant of a lazy tile is the exact one)
    return _variant(FWD_KERNEL, head_dim, tile, accum_f16=accum_f16, dropout=dropout,
                    softcap=softcap, lazy_rescale=tile.lazy_rescale and not accum_f16)


@dataclass(frozen=True, kw_only=True)
class BwdTile:
    """The tile's template parameters of BwdKernelTraits (templates.BWD_TRAITS): the dK/dV kernel's tile."""

    quad_pair_rows: int  # quad-pairs along keys: 2 (2x2, 16 keys per warp) or 1 (1x4, 8 keys per warp)
    warps: int  # per CTA
    block_m: int  # queries per iteration
    kv_in_smem: bool = False  # K, V read from shared memory per use instead of held in registers
    min_blocks_per_sm: int = 1  # __launch_bounds__ occupancy target on sm_70
    min_blocks_emulated: int = 1  # the same on sm_80+
    # dQ by fp32 atomics from this kernel; else always the separate, deterministic dQ kernel (tiles without the
    # registers for the atomic path's dQ tile)
    dq_atomic: bool = True
    # the register-lean code path (BwdKernelTraits LEAN) for 2x2 tiles whose dK/dV accumulators leave little room
    lean: bool = False
    # CTAs per key block (BwdKernelTraits OUT_SPLIT, grid z), each accumulating head_dim / out_split columns of dK
    # and dV and recomputing S and dP in full (head_dim 256); > 1 needs dq_atomic=False (dQ from the dQ kernel)
    out_split: int = 1
    # dQ atomics read B from the K tile in shared memory (row-major B, kv_in_smem) instead of a K^T copy
    dq_from_k: bool = False
    # dK / dV read B from the Q / dO tiles' rows (row-major B) instead of transposed copies (1x4 tiles, no split)
    dkdv_row_b: bool = False

    def __post_init__(self) -> None:
        if self.out_split < 1:
            raise ValueError(f"BwdTile out_split={self.out_split}; accepted: 1 or more")
        if self.out_split > 1 and self.dq_atomic:
            raise ValueError(f"BwdTile out_split={self.out_split} needs dq_atomic=False (dQ from the dQ kernel)")
        if self.dq_from_k and not (self.dq_atomic and self.kv_in_smem):
            raise ValueError("BwdTile dq_from_k=True needs dq_atomic=True and kv_in_smem=True (B is the K tile)")
        if self.dkdv_row_b and not (self.quad_pair_rows == 1 and self.out_split == 1):
            raise ValueError(f"BwdTile dkdv_row_b=True needs quad_pair_rows=1 and out_split=1, got quad_pair_rows="
                             f"{self.quad_pair_rows}, out_split={self.out_split}")

    @property
    def block_n(self) -> int:
        return self.warps * 8 * self.quad_pair_rows

    @property
    def threads(self) -> int:
        return 32 * self.warps


# Backward tiles: the dK/dV kernel, and the dQ kernel of the deterministic path (a forward-shaped tile).
# 1x4 quad-pairs need head_dim % 32 == 0 (a quarter of head_dim per quad-pair, in 8-column tiles); the other head
# dims take 2x2 tiles.
# sm_70: the best tile of the V100 estimate per head_dim: 1x4 tiles of 12 warps with K/V in shared memory at d 64-128
#   (d64 dQ atomics on 8 warps from a K^T copy, with Q^T / dO^T copies; d96 lean, dQ atomics on 6 warps of 2x2 dQ
#   quad-pairs reading the K tile; d128 lean, dQ atomics on 8 warps reading the K tile, dK/dV's B from the Q/dO rows),
#   where latency outweighs their lower pipe bound; d32 a 1x4 tile of 8 warps with dQ atomics; d 16/48 have no 8-warp
#   tile and take 2x2 tiles of 2 warps; d80 and d112 run on the d96 and d128 kernels (BWD_KERNEL_HEAD_DIMS_SM70).
#   head_dim 256: 2x2, 4 warps, K/V in shared memory, lean, dK/dV split over 2 CTAs, one CTA per SM; also the sm_80+
#   tile. docs/performance.md, "Backward tile choice", "Latency hiding" and "head_dim 256".
# sm_80+ (emulated m8n8k4): the fastest tiles of the H100 backward sweeps, per accumulation mode (the emulated
#   fp16-accumulating m8n8k4 is the slower one and prefers other shapes); d128 a 1x4 tile of 12 warps with K^T, Q^T
#   and dO^T copies (.row.col products, 127 KB: sm_80+ only), lean in both modes.
BWD_TILES_SM70: dict[int, BwdTile] = {
    16: BwdTile(quad_pair_rows=2, warps=2, block_m=32, dq_atomic=False),
    32: BwdTile(quad_pair_rows=1, warps=8, block_m=64),
    48: BwdTile(quad_pair_rows=2, warps=2, block_m=32, dq_atomic=False),
    64: BwdTile(quad_pair_rows=1, warps=12, block_m=32, kv_in_smem=True),
    96: BwdTile(quad_pair_rows=1, warps=12, block_m=32, kv_in_smem=True, lean=True, dq_from_k=True),
    128: BwdTile(quad_pair_rows=1, warps=12, block_m=32, kv_in_smem=True, lean=True, dq_from_k=True, dkdv_row_b=True),
    256: BwdTile(quad_pair_rows=2, warps=4, block_m=16, kv_in_smem=True, dq_atomic=False, lean=True, out_split=2),
}
BWD_TILES_EMULATED: dict[int, BwdTile] = {
    **BWD_TILES_SM70,
    32: BwdTile(quad_pair_rows=1, warps=4, block_m=32, kv_in_smem=True),
    64: BwdTile(quad_pair_rows=1, warps=4, block_m=32, kv_in_smem=True, min_blocks_emulated=4),
    80: BwdTile(quad_pair_rows=2, warps=2, block_m=32, kv_in_smem=True, dq_atomic=False),
    96: BwdTile(quad_pair_rows=1, warps=4, block_m=32, kv_in_smem=True),
    112: BwdTile(quad_pair_rows=2, warps=2, block_m=32, kv_in_smem=True, dq_atomic=False),
    128: BwdTile(quad_pair_rows=1, warps=12, block_m=32, kv_in_smem=True, lean=True),
}
# bwd_accum="fp16" on sm_80+: register-lean tiles at d 64/128 (2x2 at d64; at d128 the fp32 table's 12-warp 1x4
# tile, lean already), whose dK/dV products accumulate in fp32 (dQ's block sums stay fp16): the emulated
# fp32-accumulating m8n8k4 is the faster one; d32 a 2x2 tile.
BWD_TILES_EMULATED_FP16: dict[int, BwdTile] = {
    **BWD_TILES_EMULATED,
    32: BwdTile(quad_pair_rows=2, warps=4, block_m=32, kv_in_smem=True),
    64: BwdTile(quad_pair_rows=2, warps=4, block_m=32, kv_in_smem=True, lean=True),
}
# What BWD_TILES_SM70 takes once a GPU lease has run it (the gpu tests, the sanitizer): reached only through tile=
# until then. Empty: nothing waits.
BWD_TILES_SM70_NEXT: dict[int, BwdTile] = {}
# The dQ kernel: 1x4 where head_dim % 32 == 0, else 2x2; head_dim 256 a 2x2 tile of 4 warps (one CTA per SM).
DQ_TILES_SM70: dict[int, FwdTile] = {
    64: FwdTile(quad_pair_rows=2, m_tiles=1, warps=4, block_n=32),
    96: FwdTile(quad_pair_rows=1, m_tiles=1, warps=8, block_n=32),
    128: FwdTile(quad_pair_rows=1, m_tiles=1, warps=8, block_n=32),
    256: FwdTile(quad_pair_rows=2, m_tiles=1, warps=4, block_n=16, q_in_smem=True),
}
DQ_TILES_EMULATED: dict[int, FwdTile] = {
    64: FwdTile(quad_pair_rows=2, m_tiles=1, warps=4, block_n=32, q_in_smem=True),
    128: FwdTile(quad_pair_rows=2, m_tiles=1, warps=4, block_n=16, q_in_smem=True),
    256: FwdTile(quad_pair_rows=2, m_tiles=1, warps=4, block_n=16, q_in_smem=True),  # the sm_70 tile
}


def _pick(table: dict, head_dim: int):
    for listed in sorted(table):
        if head_dim <= listed:
            return table[listed]
    raise ValueError(f"head_dim {head_dim}: the Volta kernels support {SUPPORTED_HEAD_DIMS}")


# sm_70: head dims whose backward runs the kernels of a larger head_dim on zero-padded inputs. d80 and d112 have no
# spill-free tile of 12 warps per SM (1x4 tiles need head_dim % 32 == 0; 2x2 ones spill at 12 warps' register cap
# or do not fit 8 warps in 96 KB); the 12-warp d96 and d128 kernels on padded inputs are estimated faster despite
# the extra MMA work and the padding copies (docs/performance.md, "Backward tile choice" and "d112 backward").
BWD_KERNEL_HEAD_DIMS_SM70: dict[int, int] = {80: 96, 112: 128}


def bwd_kernel_head_dim(head_dim: int, arch: int = 70) -> int:
    """The head_dim of the backward kernels that run a (kernel) head_dim on arch: itself, or the larger one its
    inputs are zero-padded to (launch.backward pads; the padded columns' gradients are dropped)."""
    return BWD_KERNEL_HEAD_DIMS_SM70.get(head_dim, head_dim) if arch < EMULATED_MMA_ARCH else head_dim


def bwd_tile(head_dim: int, arch: int = 70, accum_f16: bool = False) -> BwdTile:
    if arch < EMULATED_MMA_ARCH:
        return _pick(BWD_TILES_SM70, head_dim)
    return _pick(BWD_TILES_EMULATED_FP16 if accum_f16 else BWD_TILES_EMULATED, head_dim)


# Head dims whose backward tile meets flash-attn's accuracy standard (max-abs error <= 2x PyTorch fp16's against
# float64) with bwd_accum="fp16" (lab/kernel_accuracy_sweep.py, docs/accuracy.md; the gpu tests hold the listed ones
# to the standard). Only register-lean tiles (dK/dV products in fp32, dQ's block sums in fp16) meet it; the sm_70
# d128 tile is lean but was not swept in fp16 mode. bwd_accum="auto" takes fp32 regardless: FP16-ACC is not the
# faster mode on any target (launch.resolve_bwd_accum).
BWD_FP16_MEETS_STANDARD_SM70: frozenset[int] = frozenset()
BWD_FP16_MEETS_STANDARD_EMULATED: frozenset[int] = frozenset({128})


def fp16_backward_meets_standard(head_dim: int, arch: int = 70) -> bool:
    table = BWD_FP16_MEETS_STANDARD_EMULATED if arch >= EMULATED_MMA_ARCH else BWD_FP16_MEETS_STANDARD_SM70
    listed = [d for d in sorted(SUPPORTED_HEAD_DIMS) if head_dim <= d]
    return bool(listed) and listed[0] in table


def dq_tile(head_dim: int, arch: int = 70) -> FwdTile:
    return _pick(DQ_TILES_EMULATED if arch >= EMULATED_MMA_ARCH else DQ_TILES_SM70, head_dim)


def backward_overrides(head_dim: int, arch: int, accum_f16: bool) -> dict:
    """Keyword arguments for launch.backward that run a (kernel) head_dim on arch's backward tiles from any GPU (the
    tile overrides): the dK/dV and dQ tiles of the kernels' head_dim, and ``kernel_head_dim`` where that is larger."""
    kernel_d = bwd_kernel_head_dim(head_dim, arch)
    padded = {"kernel_head_dim": kernel_d} if kernel_d != head_dim else {}
    return {"tile": bwd_tile(kernel_d, arch, accum_f16), "dq_tile": dq_tile(kernel_d, arch), **padded}


def bwd_variant(head_dim: int, tile: BwdTile, accum_f16: bool, dropout: bool, dq_atomic: bool,
                softcap: bool = False) -> KernelVariant:
    return _variant(DKDV_KERNEL, head_dim, tile, accum_f16=accum_f16, dropout=dropout,
                    dq_atomic=dq_atomic, softcap=softcap)


def dq_variant(head_dim: int, tile: FwdTile, accum_f16: bool, dropout: bool, softcap: bool = False) -> KernelVariant:
    """The deterministic path's dQ kernel (shipped with fp32 accumulation in both modes: its dQ sums over every
    key block in registers, where fp16 would cost accuracy for no memory saving)."""
    return _variant(DQ_KERNEL, head_dim, tile, accum_f16=accum_f16, dropout=dropout,
                    softcap=softcap)


def dq_by_atomics(tile: BwdTile, deterministic: bool) -> bool:
    """Whether a backward on tile adds dQ with the dK/dV kernel's atomics (else the dQ kernel computes it)."""
    return tile.dq_atomic and not deterministic


SOFTCAP_CHOICES = (False, True)  # every kernel is built with and without logit soft-capping (csrc/softcap.cuh)


def shipped_bwd_variants(arch: int = 70, softcap: tuple[bool, ...] = SOFTCAP_CHOICES) -> list[KernelVariant]:
    """Every backward variant (dK/dV and dQ kernels) the dispatcher can launch on arch."""
    variants = []
    for cap in softcap:
        for head_dim in sorted({bwd_kernel_head_dim(d, arch) for d in SUPPORTED_HEAD_DIMS}):
            for dropout in (False, True):
                for accum_f16 in (False, True):
                    tile = bwd_tile(head_dim, arch, accum_f16)
                    for dq_atomic in ((True, False) if tile.dq_atomic else (False,)):
                        variants.append(bwd_variant(head_dim, tile, accum_f16, dropout, dq_atomic, cap))
                variants.append(dq_variant(head_dim, dq_tile(head_dim, arch), False, dropout, cap))
    return variants


def shipped_fwd_variants(arch: int = 70, softcap: tuple[bool, ...] = SOFTCAP_CHOICES) -> list[KernelVariant]:
    """Every forward variant the dispatcher can launch on arch."""
    variants = []
    for cap in softcap:
        for head_dim in SUPPORTED_HEAD_DIMS:
            tiles = {fwd_tile(head_dim, causal, arch) for causal in (False, True)}
            for tile in sorted(tiles, key=repr):
                for accum_f16 in (False, True):
                    for dropout in (False, True):
                        variants.append(fwd_variant(head_dim, tile, accum_f16, dropout, cap))
    return variants


# --- decoding: the split-KV kernel's tiles (flash_attn_with_kvcache; volta_train/kernels/decode.py) -----------------
#
# Decoding has 1-16 query rows per (batch, head) (after GQA packing: the query heads of one KV group), far fewer than
# the forward's 64-row tiles. Its tiles hold 16 rows: 2x2 quad-pairs, one warp (the smallest CTA a 2x2 tile, which
# fits every head_dim % 16 == 0, allows), Q in shared memory, 32 keys per block up to head_dim 64 and 16 above.
# head_dim 256 takes 1x4 quad-pairs, 4 warps, 32 rows (the one-warp 2x2 tile would spill; warps without rows skip the
# tensor-core work). They run flash_fwd_kernel built with FwdKernelTraits SPLIT_KV (csrc/params.cuh SplitKvParams),
# fp32 accumulation, no dropout, with and without soft-capping; spill-free on sm_70 and sm_90. docs/performance.md,
# "Decoding".
DECODE_TILES_SM70: dict[int, FwdTile] = {
    64: FwdTile(quad_pair_rows=2, m_tiles=1, warps=1, block_n=32, q_in_smem=True),
    128: FwdTile(quad_pair_rows=2, m_tiles=1, warps=1, block_n=16, q_in_smem=True),
    256: FwdTile(quad_pair_rows=1, m_tiles=1, warps=4, block_n=32, q_in_smem=True),
}
DECODE_TILES_EMULATED: dict[int, FwdTile] = dict(DECODE_TILES_SM70)  # the same tiles on sm_80+


def decode_tile(head_dim: int, arch: int = 70) -> FwdTile:
    """The split-KV decoding kernel's tile for head_dim on arch (DECODE_TILES_SM70 or DECODE_TILES_EMULATED)."""
    return _pick(DECODE_TILES_EMULATED if arch >= EMULATED_MMA_ARCH else DECODE_TILES_SM70, head_dim)


def decode_variant(head_dim: int, tile: FwdTile, softcap: bool = False, accum_f16: bool = False) -> KernelVariant:
    """The split-KV decoding kernel of one tile (shipped with fp32 accumulation: accum_f16 is for experiments)."""
    return _variant(DECODE_KERNEL, head_dim, tile, accum_f16=accum_f16, softcap=softcap)


COMBINE_ROWS_PER_CTA = 4  # csrc/split_kv_combine.cu kCombineRowsPerCta: one warp per row


def combine_variant(head_dim: int) -> KernelVariant:
    """The split combine of the decoding kernel (csrc/split_kv_combine.cu), launched after it when it splits the
    keys: one per kernel head_dim, no tile (a warp per row)."""
    return KernelVariant(
        name=f"combine_d{head_dim}",
        sources=("split_kv_combine.cu",),
        name_expressions=(f"flash_split_kv_combine_kernel<{head_dim}>",),
        meta={"head_dim": head_dim, "pass": "combine"},
    )


def shipped_combine_variants() -> list[KernelVariant]:
    """The split combines of every supported head_dim (the same on every arch)."""
    return [combine_variant(head_dim) for head_dim in SUPPORTED_HEAD_DIMS]


def shipped_decode_variants(arch: int = 70, softcap: tuple[bool, ...] = SOFTCAP_CHOICES) -> list[KernelVariant]:
    """Every split-KV decoding variant the dispatcher can launch on arch (flash_attn_with_kvcache)."""
    return [decode_variant(head_dim, decode_tile(head_dim, arch), cap)
            for cap in softcap for head_dim in SUPPORTED_HEAD_DIMS]


def preprocess_variant(head_dim: int) -> KernelVariant:
    """The backward's preprocess (csrc/flash_bwd_preprocess.cu): D = rowsum(dO * O) and dQ's fp32 sums zeroed, in one
    read, before the dK/dV kernel. One per kernel head_dim, no tile (a warp per row)."""
    return KernelVariant(
        name=f"bwd_preprocess_d{head_dim}",
        sources=("flash_bwd_preprocess.cu",),
        name_expressions=(f"flash_bwd_preprocess_kernel<{head_dim}>",),
        meta={"head_dim": head_dim, "pass": "preprocess"},
    )


def shipped_preprocess_variants(arch: int = 70) -> list[KernelVariant]:
    """The preprocess of every backward kernel head_dim on arch."""
    return [preprocess_variant(d) for d in sorted({bwd_kernel_head_dim(h, arch) for h in SUPPORTED_HEAD_DIMS})]


def shipped_variants(arch: int | str = 70) -> list[KernelVariant]:
    """The variants to compile for arch: every kernel the dispatcher can launch there."""
    target = normalize_arch(arch)
    return (shipped_fwd_variants(target) + shipped_bwd_variants(target) + shipped_decode_variants(target)
            + shipped_combine_variants() + shipped_preprocess_variants(target))
