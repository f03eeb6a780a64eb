"""Tile tables of the Volta kernels: the tile shape per head_dim, mask, accumulation mode and target, and the
NVRTC variant (volta_train/kernels/variants.py) of each.

The sm_70 tables come from the static V100 model, the sm_80+ ones from the measured sweeps; the reasons sit next to
each table and the figures in docs/performance.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from .nvrtc import normalize_arch
from .variants import PROBE_VARIANT, KernelVariant

SUPPORTED_HEAD_DIMS = (16, 32, 48, 64, 80, 96, 112, 128, 256)
V100_SMEM_PER_BLOCK = 96 * 1024


@dataclass(frozen=True)
class FwdTile:
    """Template parameters of FwdKernelTraits (csrc/kernel_traits.cuh)."""

    quad_pair_rows: int  # 4: 4x1 quad-pair arrangement (8-row quad-pairs, all keys); 2: 2x2
    m_tiles: int  # 8-row tiles per quad-pair
    warps: int
    block_n: int  # keys per block
    min_blocks_per_sm: int = 1  # __launch_bounds__ occupancy target on sm_70
    min_blocks_emulated: int = 1  # the same on sm_80+, where m8n8k4 is emulated (see kernel_traits.cuh)
    q_in_smem: bool = False  # Q read from shared memory per use instead of held in registers
    split_masked: bool = False  # masked key blocks in their own loop, skipped by warps that see none of them

    @property
    def rows_per_warp(self) -> int:
        return 8 * self.quad_pair_rows * self.m_tiles

    @property
    def block_m(self) -> int:
        return self.warps * self.rows_per_warp

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def smem_bytes(self, head_dim: int) -> int:
        """FwdKernelTraits::kSmemBytes: K block [key][head_dim] + V^T block [head_dim][key] (+ the Q tile), rows
        padded by 16 B; or the O staging (from the mirror of its tile layouts, bank_model.fwd_layouts)."""
        from .bank_model import FwdShape, fwd_smem_bytes

        return fwd_smem_bytes(FwdShape(head_dim, self.quad_pair_rows, self.m_tiles, self.warps, self.block_n, False,
                                       self.q_in_smem, self.split_masked))


EMULATED_MMA_ARCH = 80  # from sm_80 on, mma.m8n8k4 is an emulation subroutine, not a tensor-core instruction

# Forward tiles per target, head_dim -> tile (on sm_70 causal and full attention share a tile: the V100 model has
# no causal-specific winner; sm_80+ has a causal table below). Head dims not listed use the next larger one's tile.
#
# sm_70 (V100): from the V100 estimate per kernel (lab/v100_estimate.py: the static pipe model of the sm_70
#   cubins, the shared-memory conflict factors measured on the H100, occupancy, and an issue latency calibrated on
#   the one real-V100 profile, L = 5.4 cycles; docs/performance.md "Latency hiding"). Every tile runs 12 or more
#   warps per SM (3 CTAs: the 168-register cap of min_blocks_per_sm=3 is spill-free for these): at the calibrated
#   latency 12 warps beat the 8-warp tiles the pipe model alone prefers (Q in registers, 84-91% `must`), 1.1-1.4x;
#   the pipe-model tiles would win only below L = 2.3-4.9 cycles.
# sm_80+ (the Volta build on an H100/H200): from the measured sweep, docs/performance.md. Q lives in shared
#   memory there: the emulated m8n8k4 wants resident warps more than shared-memory bandwidth.
FWD_TILES_SM70: dict[int, FwdTile] = {
    48: FwdTile(2, 1, 4, 32, min_blocks_per_sm=3, q_in_smem=True),   # d 16-48: est. 49.1 vs 41.8 TFLOP/s (4x1, 8 warps)
    64: FwdTile(2, 1, 4, 32, min_blocks_per_sm=3),                   # fp32 unchanged (155 regs), fp16 171 -> 160 regs
    96: FwdTile(2, 1, 4, 16, min_blocks_per_sm=3, q_in_smem=True),   # d 80, 96: est. 52-55 vs 41-43 (fp32)
    128: FwdTile(2, 1, 4, 16, min_blocks_per_sm=3, q_in_smem=True),  # d 112, 128: est. 54-56 vs 39-41 (fp32)
    # d 129-256: 2x2, 128x16, 8 warps, Q in shared memory (in registers it would take 128 of them): 231-240
    # registers, spill-free, 88 KB: one CTA of 8 warps per SM (12 warps do not fit: docs/performance.md, "head_dim 256")
    256: FwdTile(2, 1, 8, 16, q_in_smem=True),
}
FWD_TILES_EMULATED: dict[int, FwdTile] = {
    # measured 14.4-15.6 TFLOP/s (d 16-64); the register cap of 4 CTAs per SM spills 20 B on sm_90 and is
    # still 0.5-1 TFLOP/s faster than 3 CTAs without spills (docs/bench/fwd_sweep_occupancy.md)
    64: FwdTile(2, 1, 4, 32, min_blocks_emulated=4, q_in_smem=True),
    # 3 CTAs per SM (the cap of 168 registers is spill-free; uncapped, NVRTC 13 takes 171 registers and 2 CTAs
    # fit): 13.7-14.8 TFLOP/s on an H100 against 11.2-12.9 uncapped (docs/bench/fwd_sweep_h100_occupancy.md)
    128: FwdTile(2, 1, 4, 16, min_blocks_emulated=3, q_in_smem=True),
    256: FwdTile(2, 1, 8, 16, q_in_smem=True),  # the sm_70 tile: 223-246 registers on sm_90, spill-free
}


# Causal attention on sm_80+: smaller key blocks (d64) and the split masked loop (d 80-128: warps that see none of
# a diagonal block skip it) cut the diagonal's cost, which decides short causal sequences: on an H100 at N = 1024
# 14.2 against 14.0-14.1 (d64) and 14.3 against 13.6 (d128) TFLOP/s (docs/bench/fwd_sweep_h100_causal.md); the
# split loop's 168-register cap spills 12 B on sm_90.
FWD_TILES_EMULATED_CAUSAL: dict[int, FwdTile] = {
    64: FwdTile(2, 1, 4, 16, min_blocks_emulated=4, q_in_smem=True),
    128: FwdTile(2, 1, 4, 16, min_blocks_emulated=3, q_in_smem=True, split_masked=True),
    256: FwdTile(2, 1, 8, 16, q_in_smem=True),
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


def fwd_name_expression(head_dim: int, tile: FwdTile, accum_f16: bool, dropout: bool, softcap: bool = False) -> str:
    flag = lambda b: "true" if b else "false"
    return (
        f"flash_fwd_kernel<FwdKernelTraits<{head_dim}, {tile.quad_pair_rows}, {tile.m_tiles}, {tile.warps}, "
        f"{tile.block_n}, {flag(accum_f16)}, {flag(dropout)}, {tile.min_blocks_per_sm}, {tile.min_blocks_emulated}, "
        f"{flag(tile.q_in_smem)}, {flag(tile.split_masked)}{', true' if softcap else ''}>>"
    )


def fwd_variant(head_dim: int, tile: FwdTile, accum_f16: bool, dropout: bool, softcap: bool = False) -> KernelVariant:
    expression = fwd_name_expression(head_dim, tile, accum_f16, dropout, softcap)
    return KernelVariant(
        name=f"fwd_d{head_dim}_{'f16' if accum_f16 else 'f32'}acc{'_dropout' if dropout else ''}"
        f"{'_softcap' if softcap else ''}"
        f"_qp{tile.quad_pair_rows}x{4 // tile.quad_pair_rows}_m{tile.block_m}_n{tile.block_n}_w{tile.warps}"
        f"_occ{tile.min_blocks_per_sm}.{tile.min_blocks_emulated}{'_qsmem' if tile.q_in_smem else ''}"
        f"{'_split' if tile.split_masked else ''}",
        sources=("flash_fwd.cu",),
        name_expressions=(expression,),
        dynamic_smem_bytes=tile.smem_bytes(head_dim),
        threads_per_block=tile.threads,
        meta={"head_dim": head_dim, "tile": tile, "accum_f16": accum_f16, "dropout": dropout, "softcap": softcap,
              "pass": "fwd"},
    )


@dataclass(frozen=True)
class BwdTile:
    """Template parameters of BwdKernelTraits (csrc/kernel_traits.cuh): the dK/dV kernel."""

    quad_pair_rows: int  # 2: 2x2 quad-pairs (16 keys per warp); 1: 1x4 (8 keys per warp)
    warps: int
    block_m: int  # queries per iteration
    kv_in_smem: bool = False  # K, V read from shared memory per use instead of held in registers
    min_blocks_per_sm: int = 1
    min_blocks_emulated: int = 1
    # dQ by fp32 atomics from this kernel (else always the separate, deterministic dQ kernel: the 2x2 tiles
    # of head dims 16/48/80/112 have no registers left for the atomic path's dQ tile)
    dq_atomic: bool = True
    # register-lean code path (BwdKernelTraits LEAN): for 2x2 tiles of head_dim 96/128 on sm_70, whose dK/dV
    # accumulators leave little room (docs/performance.md, "Backward tile choice")
    lean: bool = False
    # CTAs per key block (BwdKernelTraits OUT_SPLIT, grid z), each accumulating head_dim / out_split columns of dK
    # and dV and recomputing S and dP in full: head_dim 256 (docs/performance.md, "head_dim 256"); > 1 needs
    # dq_atomic=False (dQ from the dQ kernel)
    out_split: int = 1

    def __post_init__(self) -> None:
        if self.out_split < 1:
            raise ValueError(f"BwdTile out_split={self.out_split}; accepted: 1 or more")
        if self.out_split > 1 and self.dq_atomic:
            raise ValueError(f"BwdTile out_split={self.out_split} needs dq_atomic=False (dQ from the dQ kernel)")

    @property
    def block_n(self) -> int:
        return self.warps * 8 * self.quad_pair_rows

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def smem_bytes(self, head_dim: int, dq_atomic: bool) -> int:
        """BwdKernelTraits::kSmemBytes, from the mirror of its tile layouts (bank_model.bwd_layouts)."""
        from .bank_model import BwdShape, bwd_shape_smem_bytes

        return bwd_shape_smem_bytes(BwdShape(head_dim, self.quad_pair_rows, self.warps, self.block_m,
                                             dq_atomic=dq_atomic, kv_in_smem=self.kv_in_smem, lean=self.lean,
                                             out_split=self.out_split))


# Backward tiles: the dK/dV kernel, and the dQ kernel of the deterministic path (a forward-shaped tile).
# 1x4 quad-pairs need head_dim % 32 == 0 (a quarter of head_dim per quad-pair, in 8-column tiles); the other
# head dims take 2x2 tiles of 2 warps (32 keys per CTA) and the dQ kernel.
# sm_70: from the V100 estimate (docs/performance.md, "Latency hiding"): 8 warps per SM wherever a spill-free tile
#   within 96 KB has them. d 32/64: 1x4, 8 warps, 64x64 blocks, dQ atomics (model 75.5%). d80: 2x2, 4 warps, 64 keys
#   x 32 queries, K/V in smem (2 CTAs, model 69%, est. 1.7x the 2-warp tile). d96: 1x4, 8 warps, 64x64, K/V in smem
#   (model 70.6%, est. 1.5x the 4-warp lean 2x2). d128: 1x4, 8 warps, 64 keys x 32 queries, K/V in smem (model 57%,
#   est. 1.25x the 4-warp lean 2x2 at L = 5.4; slower below L = 4.3). These three without dQ atomics (registers):
#   the dQ kernel computes dQ. d 16/48/112: no 8-warp tile fits spill-free; 2x2, 2 warps, 32 keys.
BWD_TILES_SM70: dict[int, BwdTile] = {
    16: BwdTile(2, 2, 32, dq_atomic=False), 32: BwdTile(1, 8, 64), 48: BwdTile(2, 2, 32, dq_atomic=False),
    64: BwdTile(1, 8, 64), 80: BwdTile(2, 4, 32, kv_in_smem=True, dq_atomic=False),
    96: BwdTile(1, 8, 64, kv_in_smem=True, dq_atomic=False),
    # d 97-128 (d112 zero-padded to 128, BWD_KERNEL_HEAD_DIMS_SM70)
    128: BwdTile(1, 8, 32, kv_in_smem=True, dq_atomic=False),
    # d 129-256: 2x2, 64 keys x 16 queries, 4 warps, K/V in smem, lean, dK/dV split over 2 CTAs (each recomputes S
    # and dP; dQ from the dQ kernel): 218-230 registers, spill-free, 97,408 B, 1 CTA (4 warps) per SM (no d256 tile
    # has 8); also the sm_80+ tile (both modes: 208-220 registers on sm_90, spill-free). docs/performance.md,
    # "head_dim 256"
    256: BwdTile(2, 4, 16, kv_in_smem=True, dq_atomic=False, lean=True, out_split=2),
}
# sm_80+ (emulated m8n8k4): from the measured backward sweep, per accumulation mode (fp16 accumulation is
# emulated more slowly, 13.4 vs 17.0 TFLOP/s, and prefers other shapes).
BWD_TILES_EMULATED: dict[int, BwdTile] = {
    # d 64: 4 CTAs per SM (128 registers, 16 B of L1 spills on sm_90): 12.9-14.3 TFLOP/s on an H100 against
    # 10.1-11.0 with 166 registers and 3 CTAs (docs/bench/bwd_sweep_h100_occupancy.md)
    **BWD_TILES_SM70, 32: BwdTile(1, 4, 32, kv_in_smem=True),
    64: BwdTile(1, 4, 32, kv_in_smem=True, min_blocks_emulated=4),
    80: BwdTile(2, 2, 32, kv_in_smem=True, dq_atomic=False),
    96: BwdTile(1, 4, 32, kv_in_smem=True), 112: BwdTile(2, 2, 32, kv_in_smem=True, dq_atomic=False),
    128: BwdTile(2, 4, 32, kv_in_smem=True),
}
# bwd_accum="fp16", d 64/128: the register-lean 2x2 tile (the V100's d96/d128 tile), whose dK/dV products
# accumulate in fp32 (dQ's block sums stay fp16): the emulated f32-accumulating m8n8k4 is the faster one (17.0 vs
# 13.4 TFLOP/s): 11.7-13.5 TFLOP/s (d64) and 10.1-11.6 (d128) on an H100, against 9.3-10.5 and 9.1-10.1 for the
# fp16-product tiles (docs/bench/bwd_sweep_h100_fp16_lean.md)
BWD_TILES_EMULATED_FP16: dict[int, BwdTile] = {
    **BWD_TILES_EMULATED, 32: BwdTile(2, 4, 32, kv_in_smem=True), 64: BwdTile(2, 4, 32, kv_in_smem=True, lean=True),
    128: BwdTile(2, 4, 32, kv_in_smem=True, lean=True),
}
DQ_TILES_SM70: dict[int, FwdTile] = {  # 1x4 (model 87%, spill-free) where head_dim % 32 == 0, else 2x2
    64: FwdTile(2, 1, 4, 32), 80: FwdTile(2, 1, 4, 16, q_in_smem=True), 96: FwdTile(1, 1, 8, 32),
    128: FwdTile(1, 1, 8, 32),
    256: FwdTile(2, 1, 4, 16, q_in_smem=True),  # 237-244 registers, spill-free, 97,280 B: 4 warps per SM
}
DQ_TILES_EMULATED: dict[int, FwdTile] = {
    64: FwdTile(2, 1, 4, 32, q_in_smem=True), 128: FwdTile(2, 1, 4, 16, q_in_smem=True),
    256: FwdTile(2, 1, 4, 16, q_in_smem=True),  # the sm_70 tile: 233-247 registers on sm_90, spill-free
}


def _pick(table: dict, head_dim: int):
    for listed in sorted(table):
        if head_dim <= listed:
            return table[listed]
    raise ValueError(f"head_dim {head_dim}: the Volta kernels support {SUPPORTED_HEAD_DIMS}")


# sm_70: head dims whose backward runs the kernels of a larger head_dim on zero-padded inputs. No d112 tile has 8 warps
# per SM without spills (the 1x4 tiles need head_dim % 32 == 0, the 2x2 ones do not fit 8 warps in 96 KB); the d128
# kernels (8 warps) on inputs padded to 128 are estimated 1.48x the d112 4-warp tile at the calibrated latency (33.0
# against 22.3 TFLOP/s of d112 work), faster for L > 2.3 cycles, at most 3% slower below, the 14% more MMA work
# included; the padding copies cost ~1.3 ms per GB-scale step (docs/performance.md, "d112 backward").
BWD_KERNEL_HEAD_DIMS_SM70: dict[int, int] = {112: 128}


def bwd_kernel_head_dim(head_dim: int, arch: int = 70) -> int:
    """The head_dim of the backward kernels that run a (kernel) head_dim on arch: itself, or the larger one its
    inputs are zero-padded to (launch.backward pads; the padded columns' gradients are dropped)."""
    return BWD_KERNEL_HEAD_DIMS_SM70.get(head_dim, head_dim) if arch < EMULATED_MMA_ARCH else head_dim


def bwd_tile(head_dim: int, arch: int = 70, accum_f16: bool = False) -> BwdTile:
    if arch < EMULATED_MMA_ARCH:
        return _pick(BWD_TILES_SM70, head_dim)
    return _pick(BWD_TILES_EMULATED_FP16 if accum_f16 else BWD_TILES_EMULATED, head_dim)


# Head dims whose backward tile meets flash-attn's accuracy standard (max-abs error <= 2x PyTorch fp16's against
# float64) with bwd_accum="fp16"; bwd_accum="auto" (the default) takes fp32 accumulation for the others. From
# lab/kernel_accuracy_sweep.py on an H100 (docs/accuracy.md): only the register-lean 2x2 tiles (dK/dV products in
# fp32, dQ's block sums in fp16) meet it; the fp16-product tiles miss it by up to 1.6x in dV, dK and dQ. The sm_70
# table has no lean tile since its 8-warp backward tiles (issue 16), so the V100 takes fp32 accumulation throughout:
# there both modes run at the same HMMA rate; fp16 saves registers only.
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


def _flag(b: bool) -> str:
    return "true" if b else "false"


def bwd_variant(head_dim: int, tile: BwdTile, accum_f16: bool, dropout: bool, dq_atomic: bool,
                softcap: bool = False) -> KernelVariant:
    if tile.out_split > 1:
        tail = f", {_flag(tile.lean)}, {_flag(softcap)}, {tile.out_split}"
    else:
        tail = f", {_flag(tile.lean)}, true" if softcap else (", true" if tile.lean else "")
    expression = (
        f"flash_bwd_dkdv_kernel<BwdKernelTraits<{head_dim}, {tile.quad_pair_rows}, {tile.warps}, {tile.block_m}, "
        f"{_flag(accum_f16)}, {_flag(dropout)}, {_flag(dq_atomic)}, {_flag(tile.kv_in_smem)}, "
        f"{tile.min_blocks_per_sm}, {tile.min_blocks_emulated}{tail}>>"
    )
    return KernelVariant(
        name=f"bwd_dkdv_d{head_dim}_{'f16' if accum_f16 else 'f32'}acc{'_dropout' if dropout else ''}"
        f"{'_softcap' if softcap else ''}{'_dqatomic' if dq_atomic else ''}_qp{tile.quad_pair_rows}x{4 // tile.quad_pair_rows}_n{tile.block_n}"
        f"_m{tile.block_m}_w{tile.warps}{'_kvsmem' if tile.kv_in_smem else ''}{'_lean' if tile.lean else ''}"
        f"{f'_split{tile.out_split}' if tile.out_split > 1 else ''}",
        sources=("flash_bwd.cu",),
        name_expressions=(expression,),
        dynamic_smem_bytes=tile.smem_bytes(head_dim, dq_atomic),
        threads_per_block=tile.threads,
        meta={"head_dim": head_dim, "tile": tile, "accum_f16": accum_f16, "dropout": dropout, "softcap": softcap,
              "pass": "bwd_dkdv"},
    )


def dq_variant(head_dim: int, tile: FwdTile, accum_f16: bool, dropout: bool, softcap: bool = False) -> KernelVariant:
    """The deterministic path's dQ kernel (shipped with fp32 accumulation in both modes: its dQ sums over every
    key block in registers, where fp16 would cost accuracy for no memory saving)."""
    expression = fwd_name_expression(head_dim, tile, accum_f16, dropout, softcap).replace("flash_fwd_kernel",
                                                                                         "flash_bwd_dq_kernel")
    from .bank_model import FwdShape, dq_smem_bytes  # DqLayout::kBytes, from the mirror of its tile layouts

    smem = dq_smem_bytes(FwdShape(head_dim, tile.quad_pair_rows, tile.m_tiles, tile.warps, tile.block_n, False,
                                  tile.q_in_smem))
    return KernelVariant(
        name=f"bwd_dq_d{head_dim}_{'f16' if accum_f16 else 'f32'}acc{'_dropout' if dropout else ''}"
        f"{'_softcap' if softcap else ''}"
        f"_qp{tile.quad_pair_rows}x{4 // tile.quad_pair_rows}_m{tile.block_m}_n{tile.block_n}_w{tile.warps}"
        f"{'_qsmem' if tile.q_in_smem else ''}",
        sources=("flash_bwd.cu",),
        name_expressions=(expression,),
        dynamic_smem_bytes=smem,
        threads_per_block=tile.threads,
        meta={"head_dim": head_dim, "tile": tile, "accum_f16": accum_f16, "dropout": dropout, "softcap": softcap,
              "pass": "bwd_dq"},
    )


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
# the forward's 64-row tiles. Its tiles hold 16 rows: 2x2 quad-pairs, one warp (the smallest CTA that a 2x2 tile,
# which fits every head_dim % 16 == 0, allows), Q in shared memory, 32 keys per block up to head_dim 64 and 16 above
# (K/V staging: 4-8 16-byte chunks per thread); head_dim 256 takes 32 rows (below). They run flash_fwd_kernel built
# with FwdKernelTraits SPLIT_KV (csrc/params.cuh SplitKvParams), fp32 accumulation, no dropout, with and without
# soft-capping. sm_70 (NVRTC 12.9): 114-246 registers, no spills, 6-16 CTAs (warps) per V100 SM up to head_dim 128,
# 16-32 KB of K/V loads in flight per SM; the rows are in docs/performance.md ("Decoding"). Candidates that spilled
# at d128 on sm_70: 1x4 with 2 warps (Q in registers or in smem, 128-168 registers: 60-552 B), 2x2 one warp with 32
# keys (296 B).
DECODE_TILES_SM70: dict[int, FwdTile] = {
    64: FwdTile(2, 1, 1, 32, q_in_smem=True),
    128: FwdTile(2, 1, 1, 16, q_in_smem=True),
    # head_dim 256: the 2x2 one-warp tile spills 488 B (128 fp32 output registers per lane); 1x4 quad-pairs, 4 warps
    # (32 rows; warps without rows skip the tensor-core work), 32 keys: 244 registers, no spills, 58 KB (1 CTA per
    # V100 SM, 16 KB of K/V loads in flight)
    256: FwdTile(1, 1, 4, 32, q_in_smem=True),
}
# The same tiles on sm_80+ (spill-free on sm_90 too: 222 / 241 / 247 registers at d64 / d128 / d256); not measured
# against others.
DECODE_TILES_EMULATED: dict[int, FwdTile] = dict(DECODE_TILES_SM70)


def decode_tile(head_dim: int, arch: int = 70) -> FwdTile:
    """The split-KV decoding kernel's tile for head_dim on arch (DECODE_TILES_SM70 or DECODE_TILES_EMULATED)."""
    return _pick(DECODE_TILES_EMULATED if arch >= EMULATED_MMA_ARCH else DECODE_TILES_SM70, head_dim)


def decode_name_expression(head_dim: int, tile: FwdTile, softcap: bool = False, accum_f16: bool = False) -> str:
    return (
        f"flash_fwd_kernel<FwdKernelTraits<{head_dim}, {tile.quad_pair_rows}, {tile.m_tiles}, {tile.warps}, "
        f"{tile.block_n}, {_flag(accum_f16)}, false, {tile.min_blocks_per_sm}, {tile.min_blocks_emulated}, "
        f"{_flag(tile.q_in_smem)}, {_flag(tile.split_masked)}, {_flag(softcap)}, true>>"
    )


def decode_variant(head_dim: int, tile: FwdTile, softcap: bool = False, accum_f16: bool = False) -> KernelVariant:
    """The split-KV decoding kernel of one tile (shipped with fp32 accumulation: accum_f16 is for experiments)."""
    return KernelVariant(
        name=f"decode_d{head_dim}_{'f16' if accum_f16 else 'f32'}acc{'_softcap' if softcap else ''}"
        f"_qp{tile.quad_pair_rows}x{4 // tile.quad_pair_rows}_m{tile.block_m}_n{tile.block_n}_w{tile.warps}"
        f"_occ{tile.min_blocks_per_sm}.{tile.min_blocks_emulated}{'_qsmem' if tile.q_in_smem else ''}"
        f"{'_split' if tile.split_masked else ''}",
        sources=("flash_fwd.cu",),
        name_expressions=(decode_name_expression(head_dim, tile, softcap, accum_f16),),
        dynamic_smem_bytes=tile.smem_bytes(head_dim),
        threads_per_block=tile.threads,
        meta={"head_dim": head_dim, "tile": tile, "accum_f16": accum_f16, "dropout": False, "softcap": softcap,
              "pass": "decode"},
    )


COMBINE_ROWS_PER_CTA = 4  # csrc/split_kv_combine.cu kCombineRowsPerCta: one warp per row


def combine_variant(head_dim: int) -> KernelVariant:
    """The split combine of the decoding kernel (csrc/split_kv_combine.cu), launched after it when it splits the
    keys: one per kernel head_dim, no tile (a warp per row)."""
    return KernelVariant(
        name=f"combine_d{head_dim}",
        sources=("split_kv_combine.cu",),
        name_expressions=(f"flash_split_kv_combine_kernel<{head_dim}>",),
        threads_per_block=32 * COMBINE_ROWS_PER_CTA,
        meta={"head_dim": head_dim, "pass": "combine"},
    )


def shipped_combine_variants() -> list[KernelVariant]:
    """The split combines of every supported head_dim (the same on every arch)."""
    return [combine_variant(head_dim) for head_dim in SUPPORTED_HEAD_DIMS]


def shipped_decode_variants(arch: int = 70, softcap: tuple[bool, ...] = SOFTCAP_CHOICES) -> list[KernelVariant]:
    """Every split-KV decoding variant the dispatcher can launch on arch (flash_attn_with_kvcache)."""
    return [decode_variant(head_dim, decode_tile(head_dim, arch), cap)
            for cap in softcap for head_dim in SUPPORTED_HEAD_DIMS]


def shipped_variants(arch: int | str = 70) -> list[KernelVariant]:
    """The variants to compile for arch: the attention kernels the dispatcher launches there, and the probe."""
    target = normalize_arch(arch)
    return (shipped_fwd_variants(target) + shipped_bwd_variants(target) + shipped_decode_variants(target)
            + shipped_combine_variants() + [PROBE_VARIANT])


# --- calls that reach every shipped variant of a tile table ------------------------------------------------------

TILE_TABLES = ("default", "sm70")


@dataclass(frozen=True)
class TableCall:
    """One forward or backward call of the launchers (volta_train/kernels/launch.py) and the kernel variants it
    launches, in launch order.

    Table ``"sm70"``: the V100 tables, reached on any GPU through the launchers' tile overrides; table ``"default"``:
    the tables of the GPU's own arch, chosen by the launchers themselves (no overrides).
    """

    table: str
    pass_name: str  # "fwd", "bwd" or "decode" (decode_calls)
    head_dim: int
    causal: bool
    accum: str  # the forward's accum or the backward's bwd_accum: "fp32" or "fp16"
    dropout: bool
    deterministic: bool  # backward only
    tile: FwdTile | BwdTile
    dq_tile: FwdTile | None  # backward only: the dQ kernel's tile
    launches: tuple[KernelVariant, ...]
    softcap: bool = False  # the variants built with logit soft-capping (run them with softcap > 0)
    kernel_head_dim: int | None = None  # backward: the kernels' head_dim where it is larger (inputs zero-padded)

    @property
    def name(self) -> str:
        """Unique within one table_calls() list; letters, digits and '_' only (an NVTX range name)."""
        mode = ("_det" if self.deterministic else "_nondet") if self.pass_name == "bwd" else ""
        return (f"{self.table}_{self.pass_name}_d{self.head_dim}_{'causal' if self.causal else 'full'}_{self.accum}"
                f"{'_dropout' if self.dropout else ''}{'_softcap' if self.softcap else ''}{mode}")

    @property
    def overrides(self) -> dict:
        """Keyword arguments for launch.forward / launch.backward: the tiles of table "sm70", none for "default"."""
        if self.table == "default":
            return {}
        if self.pass_name in ("fwd", "decode"):  # launch.forward, decode.forward_with_kvcache
            return {"tile": self.tile}
        padded = {"kernel_head_dim": self.kernel_head_dim} if self.kernel_head_dim else {}
        return {"tile": self.tile, "dq_tile": self.dq_tile, **padded}


def table_calls(table: str, arch: int, head_dims=SUPPORTED_HEAD_DIMS, causal=(False, True), dropout=(False, True),
                accums=("fp32", "fp16"), passes=("fwd", "bwd"), unique: bool = False,
                softcap=SOFTCAP_CHOICES) -> list[TableCall]:
    """The calls that launch the shipped variants of table on a GPU of arch: per head_dim, mask and dropout, the
    forward in each accumulation mode, then the backward in each mode, dQ by atomics and deterministic.

    With every argument at its default the calls launch every variant of ``shipped_fwd_variants`` and
    ``shipped_bwd_variants`` of the table's arch (70 for "sm70", else arch). ``unique`` drops the calls that
    launch no variant an earlier call did not (the causal calls of a table whose causal tile is the full one, the
    "non-deterministic" backward of a tile without atomics), and the backward calls of a head_dim that runs the
    kernels of a larger one (``kernel_head_dim``: sm_70 d112) when that one is among ``head_dims``.
    """
    if table not in TILE_TABLES:
        raise ValueError(f"table {table!r}; accepted: {', '.join(TILE_TABLES)}")
    table_arch = 70 if table == "sm70" else normalize_arch(arch)
    calls, seen = [], set()
    for cap in softcap:
        for head_dim in head_dims:
            for is_causal in causal:
                for has_dropout in dropout:
                    if "fwd" in passes:
                        tile = fwd_tile(head_dim, is_causal, table_arch)
                        for accum in accums:
                            variant = fwd_variant(head_dim, tile, accum == "fp16", has_dropout, cap)
                            calls.append(TableCall(table, "fwd", head_dim, is_causal, accum, has_dropout, False, tile,
                                                   None, (variant,), cap))
                    if "bwd" in passes:
                        kernel_d = bwd_kernel_head_dim(head_dim, table_arch)
                        q_tile = dq_tile(kernel_d, table_arch)
                        for accum in accums:
                            tile = bwd_tile(kernel_d, table_arch, accum == "fp16")
                            for deterministic in (False, True):
                                atomics = dq_by_atomics(tile, deterministic)
                                launches = (bwd_variant(kernel_d, tile, accum == "fp16", has_dropout, atomics, cap),)
                                if not atomics:
                                    launches += (dq_variant(kernel_d, q_tile, False, has_dropout, cap),)
                                calls.append(TableCall(table, "bwd", head_dim, is_causal, accum, has_dropout,
                                                       deterministic, tile, q_tile, launches, cap,
                                                       kernel_d if kernel_d != head_dim else None))
    if unique:
        kept = []
        for call in calls:
            if call.kernel_head_dim in head_dims:
                continue  # its kernels are launched by the calls of their own head_dim
            keys = {_variant_key(v) for v in call.launches}
            if keys - seen:
                kept.append(call)
                seen |= keys
        calls = kept
    return calls


def decode_calls(table: str, arch: int, head_dims=SUPPORTED_HEAD_DIMS, softcap=SOFTCAP_CHOICES) -> list[TableCall]:
    """The flash_attn_with_kvcache calls (volta_train/kernels/decode.py forward_with_kvcache) that launch every
    shipped decoding variant of table on a GPU of arch: one per head_dim and soft-capping setting (fp32 accumulation,
    no dropout; ``causal`` False, for the caller to set), each with the split combine that follows the kernel when
    the call splits the keys."""
    if table not in TILE_TABLES:
        raise ValueError(f"table {table!r}; accepted: {', '.join(TILE_TABLES)}")
    table_arch = 70 if table == "sm70" else normalize_arch(arch)
    calls = []
    for cap in softcap:
        for head_dim in head_dims:
            tile = decode_tile(head_dim, table_arch)
            calls.append(TableCall(table, "decode", head_dim, False, "fp32", False, False, tile, None,
                                   (decode_variant(head_dim, tile, cap), combine_variant(head_dim)), cap))
    return calls


def _variant_key(variant: KernelVariant) -> tuple:
    return variant.name, variant.name_expressions
