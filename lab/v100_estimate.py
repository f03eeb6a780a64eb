#!/usr/bin/env python3
"""V100 estimate per kernel: the static pipe model, the measured bank-conflict factors and a latency estimate.

    python lab/v100_estimate.py --out DIR [--cubin-dir DIR] [--conflicts FILE] [--sass-cost PATH]
                                    [--issue-interval CYCLES] [--filter REGEX] [--no-candidates]

No GPU needed. For every shipped sm_70 kernel without soft-capping (forward, backward dK/dV, backward dQ), for the
candidate backward tiles of the head dims whose shipped dK/dV tile has fewer than 8 warps per SM
(``candidate_bwd_tiles``; where the shipped tile splits dK/dV over CTAs, head_dim 256, the template's whole tile
space there: ``split_bwd_tiles``), for candidate dQ kernel tiles where the shipped dQ kernel has fewer than 8
(``candidate_dq_tiles``) and for candidate 12-warp forward tiles where the shipped forward has fewer than 12
(``candidate_fwd_tiles``):

1. compile it for sm_70 (NVRTC 12, as ``lab/kernel_report.py`` does; a --cubin-dir that already holds the
   cubin and its meta.jsonl line is reused), which gives registers, spills, shared memory and the V100 occupancy;
2. run the static V100 pipe model (``shared/tools/v100model/sass_cost.py``, imported) on the cubin's main loop:
   cycles per SMSP per iteration for every pipe, in the ``body`` view (every block of the loop once) and the
   ``must`` view (blocks that run on every iteration);
3. **conflicts**: split the model's shared-memory cycles into loads (LDS) and stores (STS, ATOMS) from its
   instruction counts and widths, multiply each by the measured wavefronts per ideal wavefront of that kernel
   (``lab/results/smem_conflicts_sm70_tiles_h100.md``: the sm_70 tiles run on an H100, whose 32 banks of 4 bytes
   are the V100's), and recompute the bound (the largest pipe) and the tensor-core utilisation = tensor cycles /
   bound cycles. Times 125 TFLOP/s this is the *TFLOP/s upper bound on a V100*. A kernel that was not measured
   (a candidate tile) borrows the factors of the measured kernel of the same pass and quad-pair arrangement
   (see ``borrow_factors``), and the row says so;
4. **latency**: an issue-interval model. One warp, stalled only by its own dependences, issues one instruction
   every ``L`` cycles on average. With ``w`` warps per scheduler (warps per SM / 4), a main-loop iteration of all
   ``w`` warps takes at least ``w * B`` cycles (B: the conflict-scaled bound, per warp) and at least ``n * L``
   cycles (n: instructions per iteration of one warp), so

       issue efficiency E = min(1, w * B / (n * L))

   and the estimate is upper bound x E. ``B / n`` is the kernel's own slack (pipe cycles per instruction): a
   kernel bound on shared memory tolerates latency better than an issue-bound one. ``L`` is calibrated on the one
   real-V100 profile we have (shared/VOLTA_NOTES.md): a FlashAttention-2 port at 2 warps per scheduler issued
   0.37 instructions per cycle per scheduler, so ``L = 2 / 0.37 = 5.4`` cycles. That kernel is consistent with
   the model: conflicts alone brought its pipe model from 80-88% to ~36%, it measured 31% (E = 0.86 < 1, i.e.
   latency-limited, which is what makes its IPC give L).
5. per head_dim, the *pass* estimate: the forward kernel; the backward as the dK/dV kernel alone (dQ by atomics:
   5 GEMMs) or dK/dV without atomics plus the dQ kernel (4 + 3 GEMMs for the 5 useful ones:
   ``5 / (4 / r_dkdv + 3 / r_dq)``; a dK/dV tile split over s CTAs runs 2s + 2 GEMMs instead of 4), TFLOP/s
   counted as in docs/performance.md (backward = 2.5x forward). Candidate dK/dV tiles without atomics are paired
   with the shipped dQ kernel and with every candidate dQ kernel.

The CUTLASS example 41 Sm70 kernels (what PyTorch SDPA runs on a V100) get the same treatment from the figures
of shared/tools/v100model/README.md and, for head_dim 256, of ``lab/cutlass_sm70_sass.py`` (the same build,
not rerun here: ``CUTLASS_SM70``), with no conflict factor (not measured: conflict-free is assumed, which favours
CUTLASS).

Writes DIR/v100_estimate.md and DIR/v100_estimate.json; the cubins go to --cubin-dir (default: a temporary
directory). The committed results: lab/results/v100_estimate_sm70*.md, summarised in docs/performance.md;
the head_dim 256 tile search: ``--filter _d256_`` (lab/results/v100_estimate_sm70.md, its candidate table).
Everything here is an estimate for ranking kernels; what it cannot see is listed in the markdown.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace

import bank_model  # lab/bank_model.py: the shared memory of tiles that were never compiled

REPO = Path(__file__).resolve().parent.parent

# --- constants of the estimate -----------------------------------------------------------------------------------

PEAK_TFLOPS = 125.0  # V100 SXM2 tensor peak, as in sass_cost.py
SCHEDULERS_PER_SM = 4
# The real-V100 calibration point (shared/VOLTA_NOTES.md, "What real V100s measured"): a public FA2 port, forward,
# head_dim 128, 4 warps, 2 warps per scheduler, 0.37 instructions issued per cycle per scheduler.
CALIBRATION_WARPS_PER_SCHEDULER = 2
CALIBRATION_IPC = 0.37
ISSUE_INTERVAL = CALIBRATION_WARPS_PER_SCHEDULER / CALIBRATION_IPC  # L, cycles between one warp's issues: 5.41
SENSITIVITY_INTERVALS = (3.0, ISSUE_INTERVAL, 8.0)  # the candidates' ranking is shown at these L too
TARGET_WARPS_PER_SM = 8
TARGET_MUST = 0.65

# pipes entering the bound: sass_cost.BOUND_PIPES (checked against it when the model is loaded)
BOUND_PIPES = ("issue", "tensor", "fma", "alu", "fp16", "fp64", "xu", "shfl", "lsu_data", "bar")
SMEM_BYTES_PER_CLK_SM = 128  # sass_cost: LDS/STS cost 4 x max(1, bytes per warp / 128) SMSP cycles
_SMEM_OP = re.compile(r"^(LDS|LDSM|STS|ATOMS)(?:\.(\d+))?$")

# CUTLASS example 41 Sm70 kernels, half_t: shared/tools/v100model/README.md, "Results: CUTLASS example 41 Sm70
# kernels" (sm_70 cubins built from the nvidia-cutlass 4.2 wheel's example, ptxas 12.9; not rebuilt here).
# warps_per_cta follows from the HMMA count: HMMA/iter x warps x 256 FMA = the iteration's FMA (fwd 2 GEMMs of
# block_m x block_n x d, bwd 5 GEMMs); tests/test_v100_estimate.py checks it.
# lab/cutlass_sm70_sass.py rebuilds all of them the README's way (`--flags example`; `--check` compares): the
# first five rows are the README's and come out identical; the head_dim 256 rows (PyTorch's kernels for d > 128:
# fmha_cutlassF_f16_aligned_32x128_gmem_sm70 and fmha_cutlassB_f16_aligned_128x64_k65536_sm70, instances 2 and 7 of
# lab/cutlass_sm70/instance.cu, with the GEMM trips of d = 256) come from it (nvcc 13.0, ptxas 12.9.86, CUTLASS
# 4.2.0, 2026-11).
CUTLASS_SM70 = (
    dict(kernel="CUTLASS fwd 64x64 kMaxK=64", pass_name="fwd", head_dim=64, block=(64, 64), regs=168,
         spills="40/36", ctas_per_sm=3, warps_per_cta=4, hmma_per_iter=512, instr_body=2214, instr_must=2051,
         tc_util_body=0.463, tc_util_must=0.499, bound_body="issue"),
    dict(kernel="CUTLASS fwd 32x128 kMaxK=inf", pass_name="fwd", head_dim=128, block=(32, 128), regs=164,
         spills="0/0", ctas_per_sm=2, warps_per_cta=4, hmma_per_iter=1024, instr_body=4170, instr_must=3246,
         tc_util_body=0.375, tc_util_must=0.561, bound_body="lsu_data"),
    dict(kernel="CUTLASS fwd 32x128 kMaxK=128", pass_name="fwd", head_dim=128, block=(32, 128), regs=168,
         spills="64/60", ctas_per_sm=3, warps_per_cta=4, hmma_per_iter=1024, instr_body=3342, instr_must=3175,
         tc_util_body=0.544, tc_util_must=0.560, bound_body="lsu_data"),
    dict(kernel="CUTLASS bwd 64x64 kMaxK=64", pass_name="bwd", head_dim=64, block=(64, 64), regs=255,
         spills="208/256", ctas_per_sm=2, warps_per_cta=4, hmma_per_iter=1280, instr_body=6185, instr_must=4818,
         tc_util_body=0.414, tc_util_must=0.531, bound_body="issue"),
    dict(kernel="CUTLASS bwd 128x64 kMaxK=128", pass_name="bwd", head_dim=128, block=(128, 64), regs=255,
         spills="288/396", ctas_per_sm=1, warps_per_cta=8, hmma_per_iter=2560, instr_body=9167, instr_must=7525,
         tc_util_body=0.526, tc_util_must=0.642, bound_body="lsu_data"),
    dict(kernel="CUTLASS fwd 32x128 kMaxK=inf", pass_name="fwd", head_dim=256, block=(32, 128), regs=164,
         spills="0/0", ctas_per_sm=2, warps_per_cta=4, hmma_per_iter=2048, instr_body=7244, instr_must=5525,
         tc_util_body=0.388, tc_util_must=0.585, bound_body="lsu_data"),
    dict(kernel="CUTLASS bwd 128x64 kMaxK=inf", pass_name="bwd", head_dim=256, block=(128, 64), regs=255,
         spills="0/0", ctas_per_sm=1, warps_per_cta=8, hmma_per_iter=5120, instr_body=16196, instr_must=13352,
         tc_util_body=0.521, tc_util_must=0.670, bound_body="lsu_data"),
)
CUTLASS_TENSOR_CYCLES_PER_HMMA = 2  # HMMA.884.F32 steps (256 FMA each), 2 SMSP cycles


# --- the arithmetic (pure functions; tests/test_v100_estimate.py) -------------------------------------------------

def smem_op_cycles(opcode: str) -> float:
    """SMSP cycles of one shared-memory warp instruction in the pipe model: 4 x max(1, bytes per warp / 128)."""
    match = _SMEM_OP.match(opcode)
    if match is None:
        raise ValueError(f"opcode {opcode!r}: not a shared-memory instruction (LDS, LDSM, STS, ATOMS[.bits])")
    bits = int(match.group(2) or 32)
    return 4.0 * max(1.0, 32 * bits / 8 / SMEM_BYTES_PER_CLK_SM)


def smem_split(detail: dict[str, float]) -> tuple[float, float]:
    """(load cycles, store cycles) of the shared-memory pipe, from sass_cost's per-opcode counts (``detail``:
    e.g. {"LDS.128": 200, "STS.32": 14, "HMMA.884.F32.F32": 1280}); ATOMS counts as a store."""
    loads = stores = 0.0
    for opcode, count in detail.items():
        if _SMEM_OP.match(opcode):
            cycles = count * smem_op_cycles(opcode)
            if opcode.startswith("LDS"):
                loads += cycles
            else:
                stores += cycles
    return loads, stores


def scale_conflicts(cycles: dict[str, float], loads: float, stores: float, ld_factor: float,
                    st_factor: float) -> dict[str, float]:
    """The pipe cycles with shared-memory loads x ld_factor and stores x st_factor (smem and lsu_data = smem + L1
    grow by the same amount; issue does not: a conflicted access is one issued instruction)."""
    for name, factor in (("ld_factor", ld_factor), ("st_factor", st_factor)):
        if not factor >= 1.0:
            raise ValueError(f"{name}={factor}: a wavefronts-per-ideal factor is >= 1")
    if abs(loads + stores - cycles.get("smem", 0.0)) > 1e-6 * max(1.0, loads + stores):
        raise ValueError(f"loads + stores = {loads + stores} cycles, but the model's smem pipe has "
                         f"{cycles.get('smem', 0.0)}: the split does not cover the pipe")
    extra = loads * (ld_factor - 1.0) + stores * (st_factor - 1.0)
    scaled = dict(cycles)
    scaled["smem"] = cycles.get("smem", 0.0) + extra
    scaled["lsu_data"] = cycles.get("lsu_data", cycles.get("smem", 0.0) + cycles.get("l1_global", 0.0)) + extra
    return scaled


def bound(cycles: dict[str, float]) -> tuple[str, float, float]:
    """(binding pipe, its cycles, tensor-core utilisation = tensor / bound), as sass_cost.model does."""
    pipe = max(BOUND_PIPES, key=lambda p: cycles.get(p, 0.0))
    cyc = cycles.get(pipe, 0.0)
    return pipe, cyc, (cycles.get("tensor", 0.0) / cyc if cyc > 0 else 0.0)


def warps_per_scheduler(warps_per_sm: int) -> float:
    if warps_per_sm < 0:
        raise ValueError(f"warps_per_sm={warps_per_sm}: must be >= 0")
    return warps_per_sm / SCHEDULERS_PER_SM


def issue_efficiency(warps_per_sched: float, bound_cycles: float, instructions: float,
                     interval: float = ISSUE_INTERVAL) -> float:
    """min(1, w * B / (n * L)): the fraction of the pipe bound reached when each warp issues at most one
    instruction per ``interval`` cycles (see the module docstring)."""
    if instructions <= 0 or interval <= 0:
        raise ValueError(f"instructions={instructions}, interval={interval}: both must be > 0")
    return min(1.0, warps_per_sched * bound_cycles / (instructions * interval))


def view_estimate(cycles: dict[str, float], instructions: float, detail: dict[str, float], ld_factor: float,
                  st_factor: float, warps_per_sm: int, interval: float = ISSUE_INTERVAL) -> dict:
    """One view (body or must) of one kernel: model, conflict-scaled bound, latency factor, estimate."""
    pipe0, bound0, util0 = bound(cycles)
    loads, stores = smem_split(detail)
    scaled = scale_conflicts(cycles, loads, stores, ld_factor, st_factor)
    pipe, cyc, util = bound(scaled)
    w = warps_per_scheduler(warps_per_sm)
    eff = issue_efficiency(w, cyc, instructions, interval)
    latency = latency_bound(w, cycles.get("tensor", 0.0), instructions, interval)
    return {"instructions": instructions, "tensor_cycles": cycles.get("tensor", 0.0),
            "model_bound_pipe": pipe0, "model_bound_cycles": bound0, "model_tc_util": util0,
            "smem_load_cycles": loads, "smem_store_cycles": stores,
            "bound_pipe": pipe, "bound_cycles": cyc, "tc_util": util, "tflops_bound": util * PEAK_TFLOPS,
            "cycles_per_instruction": cyc / instructions, "issue_efficiency": eff,
            "tflops_latency": latency, "tflops_estimate": util * eff * PEAK_TFLOPS,
            "tflops_estimate_conflict_free": min(util0 * PEAK_TFLOPS, latency)}


def latency_bound(warps_per_sched: float, tensor_cycles: float, instructions: float,
                  interval: float = ISSUE_INTERVAL) -> float:
    """125 x w x (tensor cycles per instruction) / L: the TFLOP/s when every warp issues one instruction per L
    cycles. upper bound x E = min(upper bound, this), so a kernel's estimate is the smaller of its pipe bound and
    this latency bound, which depends only on its HMMA density and its warps per scheduler."""
    if instructions <= 0 or interval <= 0:
        raise ValueError(f"instructions={instructions}, interval={interval}: both must be > 0")
    return PEAK_TFLOPS * warps_per_sched * tensor_cycles / (instructions * interval)


def deterministic_pass_rate(dkdv_tflops: float, dq_tflops: float, out_split: int = 1) -> float:
    """Backward TFLOP/s (5 useful GEMMs) when the dK/dV kernel runs 4 GEMMs and the dQ kernel 3. A dK/dV tile split
    over ``out_split`` CTAs (tiles.BwdTile.out_split) runs 2 * out_split + 2: each CTA recomputes S^T and dP^T."""
    if dkdv_tflops <= 0 or dq_tflops <= 0:
        raise ValueError(f"dkdv_tflops={dkdv_tflops}, dq_tflops={dq_tflops}: both must be > 0")
    if out_split < 1:
        raise ValueError(f"out_split={out_split}: accepted: 1 or more")
    return 5.0 / ((2.0 * out_split + 2.0) / dkdv_tflops + 3.0 / dq_tflops)


def cutlass_estimate(entry: dict, interval: float = ISSUE_INTERVAL) -> dict:
    """A CUTLASS row of the README: bound cycles = tensor cycles / utilisation, no conflict factor."""
    tensor = entry["hmma_per_iter"] * CUTLASS_TENSOR_CYCLES_PER_HMMA
    warps = entry["ctas_per_sm"] * entry["warps_per_cta"]
    w = warps_per_scheduler(warps)
    out = dict(entry, warps_per_sm=warps, warps_per_scheduler=w)
    for view in ("body", "must"):
        util, n = entry[f"tc_util_{view}"], entry[f"instr_{view}"]
        cyc = tensor / util
        eff = issue_efficiency(w, cyc, n, interval)
        out[view] = {"instructions": n, "tensor_cycles": tensor, "bound_cycles": cyc, "tc_util": util,
                     "tflops_bound": util * PEAK_TFLOPS, "cycles_per_instruction": cyc / n,
                     "issue_efficiency": eff, "tflops_latency": latency_bound(w, tensor, n, interval),
                     "tflops_estimate": util * eff * PEAK_TFLOPS}
    return out


# --- measured conflict factors -------------------------------------------------------------------------------------

def conflict_rows(path: Path) -> list[dict]:
    """Per-launch rows {variant, ld_wavefronts, ld_conflicts, st_wavefronts, st_conflicts} of a
    lab/smem_conflicts.py result: its smem_conflicts.json, or the markdown table (lab/results/...md)."""
    text = path.read_text()
    if path.suffix == ".json":
        rows = json.loads(text)["rows"]
        return [{k: r.get(k) for k in ("variant", "ld_wavefronts", "ld_conflicts", "st_wavefronts", "st_conflicts")}
                for r in rows]
    number = _load_script("smem_conflicts").parse_value  # the same cell rule as the table's writer
    rows, header = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None if not line.strip() else header
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            if {"variant", "ld wf", "ld conflicts", "st wf", "st conflicts"} <= set(cells):
                header = cells
            continue
        if set(cells[0]) <= {"-", " ", ":"}:
            continue
        row = dict(zip(header, cells))
        rows.append({"variant": row["variant"], "ld_wavefronts": number(row["ld wf"]),
                     "ld_conflicts": number(row["ld conflicts"]), "st_wavefronts": number(row["st wf"]),
                     "st_conflicts": number(row["st conflicts"])})
    if not rows:
        raise ValueError(f"{path}: no table with the columns variant, ld wf, ld conflicts, st wf, st conflicts")
    return rows


def conflict_factors(rows: list[dict]) -> dict[str, tuple[float, float]]:
    """variant -> (ld, st) wavefronts per ideal wavefront over all its launches: sum(wf) / sum(wf - conflicts)."""
    sums: dict[str, list[float]] = {}
    for row in rows:
        acc = sums.setdefault(row["variant"], [0.0, 0.0, 0.0, 0.0])
        for i, op in enumerate(("ld", "st")):
            wf, conflicts = row.get(f"{op}_wavefronts"), row.get(f"{op}_conflicts")
            if wf is None or conflicts is None:
                continue
            acc[2 * i] += wf
            acc[2 * i + 1] += wf - conflicts
    return {v: tuple((a[2 * i] / a[2 * i + 1]) if a[2 * i + 1] > 0 else 1.0 for i in range(2))
            for v, a in sums.items()}


# --- kernels: description, borrowing factors ---------------------------------------------------------------------

@dataclass
class Kernel:
    variant: object  # volta_train.kernels.variants.KernelVariant
    role: str  # "shipped" or "candidate"
    note: str = ""
    report: dict = field(default_factory=dict)  # kernel_report row
    factors: tuple[float, float] = (1.0, 1.0)
    factor_source: str = ""
    views: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.variant.name

    @property
    def meta(self) -> dict:
        return self.variant.meta

    @property
    def pass_name(self) -> str:
        return self.meta["pass"]

    @property
    def dq_atomic(self) -> bool:
        return "_dqatomic" in self.name


def arrangement_key(variant) -> tuple:
    """What decides a tile's bank-conflict pattern (docs/performance.md, bank conflicts): the kernel shape (the
    forward and the dQ kernel share one), the quad-pair arrangement, whether operands come from shared memory,
    dQ by atomics (its extra stores)."""
    tile, meta = variant.meta["tile"], variant.meta
    smem_operands = getattr(tile, "kv_in_smem", False) or getattr(tile, "q_in_smem", False)
    family = "dkdv" if meta["pass"] == "bwd_dkdv" else "fwd-shaped"
    return family, tile.quad_pair_rows, smem_operands, "_dqatomic" in variant.name


def borrow_factors(variant, measured: dict[str, tuple[float, float]], by_name: dict) -> tuple[tuple, str]:
    """The measured (ld, st) factors of variant; else those of a measured kernel with the same arrangement_key
    (failing that, the same one but for the shared-memory operand flag): the nearest head_dim, then the same pass,
    accumulation and dropout preferred; else conflict-free. Returns (factors, where they come from)."""
    if variant.name in measured:
        return measured[variant.name], "measured"
    key, meta = arrangement_key(variant), variant.meta
    levels = ((lambda k: k == key, "same arrangement"),
              (lambda k: (k[0], k[1], k[3]) == (key[0], key[1], key[3]), "same quad-pairs, other smem operands"))
    for same, how in levels:
        pool = [by_name[n] for n in measured if n in by_name and same(arrangement_key(by_name[n]))]
        if pool:
            best = min(pool, key=lambda v: (abs(v.meta["head_dim"] - meta["head_dim"]), v.meta["pass"] != meta["pass"],
                                            v.meta["accum_f16"] != meta["accum_f16"],
                                            v.meta["dropout"] != meta["dropout"], -v.meta["head_dim"]))
            return measured[best.name], f"borrowed from {best.name} ({how})"
    return (1.0, 1.0), "none: conflict-free assumed"


# --- candidate tiles for the kernels under 8 warps per SM --------------------------------------------------------

def bwd_tile_ok(head_dim: int, tile, dq_atomic: bool) -> bool:
    """The static_asserts of BwdKernelTraits (csrc/kernel_traits.cuh) and the 96 KB limit."""
    cols = 4 // tile.quad_pair_rows
    if tile.quad_pair_rows not in (1, 2) or tile.block_m % (8 * cols) or head_dim % (8 * cols):
        return False
    if tile.out_split > 1 and (dq_atomic or head_dim % (32 * tile.out_split) or head_dim % (8 * cols * tile.out_split)):
        return False
    if dq_atomic:
        shape = bank_model.bwd_tile_shape(tile, head_dim, dq_atomic)
        dq_rows = shape.dq_rows_per_warp // 8
        if shape.dq_col_warps * shape.dq_row_warps != shape.dq_warps or dq_rows not in (1, 2, 4):
            return False
        qp_cols = 4 // dq_rows
        if head_dim % (8 * qp_cols * shape.dq_col_warps):
            return False
        pairs_of_tiles = shape.dq_cols_per_quad_pair % 16 == 0  # 8-column tiles in pairs per quad-pair
        if tile.dq_from_k and not (tile.kv_in_smem and qp_cols >= 2 and pairs_of_tiles):
            return False
    return bank_model.bwd_tile_smem_bytes(tile, head_dim, dq_atomic) <= 96 * 1024


def smem_warps_per_sm(smem_bytes: int, warps: int) -> int:
    """Warps per V100 SM that shared memory allows a kernel of ``warps`` warps per CTA (registers cannot stop 8
    warps: 255 x 256 threads fit; the 2048-thread limit caps it at 64)."""
    return min(64, (96 * 1024) // (math.ceil(smem_bytes / 256) * 256) * warps)


# The dK/dV tile space of a head_dim whose shipped tile splits dK/dV over CTAs (out_split > 1: head_dim 256), where
# the tables hold no other tile to borrow: every combination of these the kernel accepts (bwd_tile_ok). More slices
# than 4 only add recompute (2 * out_split + 2 GEMMs per key block); K/V in registers takes head_dim registers
# per lane (at head_dim 256 with 8 or 16 keys per warp: every A row of the warp, 128 + 128).
SPLIT_SPACE_WARPS = (1, 2, 4, 8)
SPLIT_SPACE_BLOCK_M = (16, 32, 64)
SPLIT_SPACE_OUT_SPLITS = (1, 2, 4)
# accumulator registers a lane may hold for dK/dV (or dQ) before the tile is dropped unbuilt: the unsplit 2x2 tile
# at d256 (256) spilled 1.8-2.9 KB (docs/performance.md, "head_dim 256"); 1x4 / split tiles (64-128) did not
MAX_ACCUMULATOR_REGS = 192


def bwd_accumulator_regs(head_dim: int, tile) -> int:
    """fp32 registers per lane of the dK and dV accumulators (BwdAccumulators: 2 x 8 x kOTilesPerQuadPair), plus
    the K and V rows when they are held in registers (2 x kQRegs)."""
    cols = 4 // tile.quad_pair_rows
    acc = 2 * head_dim // (tile.out_split * cols)
    return acc + (0 if tile.kv_in_smem else head_dim)


def split_bwd_tiles(head_dim: int) -> list[tuple[object, bool, str]]:
    """(tile, dq_atomic, where from): the template's dK/dV tiles at a head_dim whose shipped tile is split
    (``out_split`` > 1): quad-pairs 2x2 or 1x4, warps SPLIT_SPACE_WARPS, queries SPLIT_SPACE_BLOCK_M, K/V in shared
    memory or registers, lean or not, out_split SPLIT_SPACE_OUT_SPLITS (1 with or without dQ atomics); kept where
    the kernel accepts them (bwd_tile_ok) and the accumulators leave room (MAX_ACCUMULATOR_REGS)."""
    from volta_train.kernels import tiles

    out = []
    for qpr in (2, 1):
        for warps in SPLIT_SPACE_WARPS:
            for block_m in SPLIT_SPACE_BLOCK_M:
                for kv_in_smem in (True, False):
                    for out_split in SPLIT_SPACE_OUT_SPLITS:
                        for lean in (True, False):
                            for dq_atomic in ((True, False) if out_split == 1 else (False,)):
                                tile = tiles.BwdTile(quad_pair_rows=qpr, warps=warps, block_m=block_m,
                                                     kv_in_smem=kv_in_smem, dq_atomic=dq_atomic, lean=lean,
                                                     out_split=out_split)
                                if (bwd_accumulator_regs(head_dim, tile) <= MAX_ACCUMULATOR_REGS
                                        and bwd_tile_ok(head_dim, tile, dq_atomic)):
                                    out.append((tile, dq_atomic, f"split space (out_split {out_split})"))
    return out


def candidate_bwd_tiles(head_dim: int) -> list[tuple[object, bool, str]]:
    """(tile, dq_atomic, where from) for a head_dim whose shipped dK/dV tile is under 8 warps per SM.

    The pool: every backward tile of the tables in volta_train/kernels/tiles.py (any head_dim, any target), put at
    this head_dim, and the 8-warp 1x4 tiles with K/V in shared memory (two features the tables have, combined).
    Kept: the tiles the kernel accepts (bwd_tile_ok) whose shared memory lets 8 warps per SM fit (registers cannot
    stop 8 warps: 255 x 256 threads fit), and the emulated tables' own choice at this head_dim whatever its
    occupancy (the comparison the issue names). The shipped tile itself is left out.

    A head_dim whose shipped tile splits dK/dV over CTAs (head_dim 256) takes ``split_bwd_tiles`` instead, kept
    where shared memory allows at least the shipped tile's warps per SM (no tile there reaches 8).
    """
    from volta_train.kernels import tiles

    shipped = tiles.bwd_tile(head_dim, 70)
    if shipped.out_split > 1:
        floor = smem_warps_per_sm(bank_model.bwd_tile_smem_bytes(shipped, head_dim, False), shipped.warps)
        return [(tile, dq_atomic, source) for tile, dq_atomic, source in split_bwd_tiles(head_dim)
                if tile != shipped and smem_warps_per_sm(bank_model.bwd_tile_smem_bytes(tile, head_dim, dq_atomic),
                                                         tile.warps) >= floor]
    pool: dict = {}
    for table_name in ("BWD_TILES_SM70", "BWD_TILES_EMULATED", "BWD_TILES_EMULATED_FP16"):
        for d, tile in getattr(tiles, table_name).items():
            # (a dK/dV split over CTAs is head_dim 256's answer to its register need: unsplit here)
            plain = replace(tile, min_blocks_per_sm=1, min_blocks_emulated=1, out_split=1)
            pool.setdefault(plain, f"{table_name}[{d}]")
    for block_m in (32, 64):
        pool.setdefault(tiles.BwdTile(quad_pair_rows=1, warps=8, block_m=block_m, kv_in_smem=True),
                        "1x4 + 8 warps + K/V in smem")
    for kv_in_smem in (False, True):  # the 2x2 2-warp tile of d16-112 with 16 queries per block (no table has it)
        pool.setdefault(tiles.BwdTile(quad_pair_rows=2, warps=2, block_m=16, kv_in_smem=kv_in_smem, dq_atomic=False),
                        "2x2 2 warps, block_m 16")
    emulated_here = {replace(t, min_blocks_per_sm=1, min_blocks_emulated=1)
                     for t in (tiles.bwd_tile(head_dim, 90, False), tiles.bwd_tile(head_dim, 90, True))}
    out = []
    for tile, source in pool.items():
        if tile == shipped:
            continue
        for dq_atomic in ((True, False) if tile.dq_atomic else (False,)):
            if not bwd_tile_ok(head_dim, tile, dq_atomic):
                continue
            warps = smem_warps_per_sm(bank_model.bwd_tile_smem_bytes(tile, head_dim, dq_atomic), tile.warps)
            if warps >= TARGET_WARPS_PER_SM or tile in emulated_here:
                label = source + (", the emulated table's tile here" if tile in emulated_here else "")
                out.append((tile, dq_atomic, label))
    return out


def dq_tile_ok(head_dim: int, tile) -> bool:
    """The static_asserts of FwdKernelTraits and DqLayout (csrc/kernel_traits.cuh, flash_bwd_dq_kernel.cuh) for a
    dQ kernel tile, and the 96 KB limit."""
    cols = 4 // tile.quad_pair_rows
    if tile.quad_pair_rows not in (1, 2, 4) or head_dim % (8 * cols) or (tile.block_n // 8) % cols or tile.block_n % 8:
        return False
    return bank_model.dq_tile_smem_bytes(tile, head_dim) <= 96 * 1024


def dq_tile_smem(head_dim: int, tile) -> int:
    return bank_model.dq_tile_smem_bytes(tile, head_dim)


def candidate_dq_tiles(head_dim: int) -> list[tuple[object, str]]:
    """(tile, where from) for a head_dim whose shipped dQ kernel is under 8 warps per SM (head_dim 256): quad-pairs
    4x1, 2x2 or 1x4, 1-2 m-tiles, 2-8 warps, 16-64 keys per block, Q/dO in shared memory or registers; kept where
    the kernel accepts them (dq_tile_ok), the dQ accumulators (+ Q and dO rows in registers) stay within
    MAX_ACCUMULATOR_REGS and shared memory allows at least the shipped tile's warps per SM. The shipped tile is
    left out."""
    from volta_train.kernels import tiles

    shipped = tiles.dq_tile(head_dim, 70)
    floor = smem_warps_per_sm(dq_tile_smem(head_dim, shipped), shipped.warps)
    out = []
    for qpr in (4, 2, 1):
        for m_tiles in (1, 2):
            for warps in (2, 4, 8):
                for block_n in (16, 32, 64):
                    for q_in_smem in (True, False):
                        tile = tiles.FwdTile(quad_pair_rows=qpr, m_tiles=m_tiles, warps=warps, block_n=block_n,
                                             q_in_smem=q_in_smem)
                        # dQ accumulators: head_dim / quad-pair columns per m-tile; Q and dO rows: head_dim
                        regs = m_tiles * head_dim // (4 // qpr) + (0 if q_in_smem else m_tiles * head_dim)
                        if tile == shipped or regs > MAX_ACCUMULATOR_REGS or not dq_tile_ok(head_dim, tile):
                            continue
                        if smem_warps_per_sm(dq_tile_smem(head_dim, tile), warps) >= floor:
                            out.append((tile, "dQ tile space"))
    return out


def candidate_fwd_tiles(head_dim: int) -> list[tuple[object, str]]:
    """(tile, where from) for a head_dim whose shipped forward has fewer than 12 warps per SM: the shipped tile and
    the emulated table's tiles at this head_dim (Q in shared memory), each with ``min_blocks_per_sm=3`` (the
    __launch_bounds__ cap of 168 registers that 3 CTAs of 4 warps need), where their shared memory lets 3 CTAs fit."""
    from volta_train.kernels import tiles

    shipped = tiles.fwd_tile(head_dim, False, 70)
    pool = {replace(shipped, min_blocks_per_sm=3): "FWD_TILES_SM70, capped for 3 CTAs"}
    for causal in (False, True):
        tile = replace(tiles.fwd_tile(head_dim, causal, 90), min_blocks_per_sm=3, min_blocks_emulated=1)
        pool.setdefault(tile, "FWD_TILES_EMULATED" + ("_CAUSAL" if causal else "") + ", capped for 3 CTAs")
    out = []
    for tile, source in pool.items():
        smem = math.ceil(bank_model.fwd_tile_smem_bytes(tile, head_dim) / 256) * 256
        if (96 * 1024) // smem * tile.warps >= 12:
            out.append((tile, source))
    return out


# --- model, compilation --------------------------------------------------------------------------------------------

def find_sass_cost(given: str | None) -> Path:
    candidates = [Path(given)] if given else []
    if os.environ.get("V100MODEL"):
        candidates.append(Path(os.environ["V100MODEL"]))
    candidates += [p / "shared" / "tools" / "v100model" / "sass_cost.py" for p in (REPO, *REPO.parents)]
    for c in candidates:
        if c.is_file():
            return c
    raise SystemExit(f"--sass-cost: sass_cost.py not found (tried {', '.join(map(str, candidates[:4]))}, ...); "
                     "accepted: the path of shared/tools/v100model/sass_cost.py, or $V100MODEL")


def load_sass_cost(path: Path):
    spec = importlib.util.spec_from_file_location("sass_cost", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if tuple(module.BOUND_PIPES) != BOUND_PIPES:
        raise SystemExit(f"{path}: BOUND_PIPES {module.BOUND_PIPES} differ from this script's {BOUND_PIPES}")
    return module


def _loop_views(sass_cost, sass: str, mangled: str, cubin: Path) -> dict:
    functions = sass_cost.parse_sass_text(sass)
    if mangled not in functions:
        raise RuntimeError(f"{cubin}: no function {mangled} in its SASS ({', '.join(functions)})")
    args = SimpleNamespace(imad_wide_passes=2, trips={}, loop=None)
    result = sass_cost.analyse_function(mangled, functions[mangled], args)[0]
    loop = result.get("main_loop")
    if not loop:
        raise RuntimeError(f"{cubin}: no main loop found in {mangled}")
    out = {}
    for view, tally_key, model_key in (("body", "tally", "model"), ("must", "must", "model_must")):
        tally = loop[tally_key]
        out[view] = (dict(loop[model_key]["cycles"]), tally.n, dict(tally.sub), tally.hmma)
    return out


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_GUARD = re.compile(r"^@!?P\d BRA (0x[0-9a-f]+)$")


def without_dq_guard(sass: str, mangled: str) -> str:
    """The SASS with the branch that lets a dK/dV kernel's extra warps skip dQ's atomics made a NOP: what the warps
    that add dQ run. The guard is the last predicated forward branch before the function's first RED (dQ atomic)
    that jumps past its last one."""
    start = sass.find(f"Function : {mangled}")
    if start < 0:
        raise RuntimeError(f"no function {mangled} in the SASS")
    end = sass.find("Function : ", start + 1)
    lines = list(_SASS_LINE.finditer(sass, start, end if end > 0 else len(sass)))
    reds = [int(m.group(1), 16) for m in lines if m.group(2).startswith("RED.")]
    if not reds:
        raise RuntimeError(f"{mangled}: no dQ atomics (RED) in its SASS")
    for m in reversed([m for m in lines if int(m.group(1), 16) < reds[0]]):
        guard = _GUARD.match(m.group(2))
        if guard and int(guard.group(1), 16) > reds[-1]:
            return sass[:m.start(2)] + "NOP" + sass[m.end(2):]
    raise RuntimeError(f"{mangled}: no branch around its dQ atomics")


def view_minus(view: tuple, other: tuple) -> tuple:
    """One loop view (cycles, instructions, per-opcode counts, HMMA) less another, element by element."""
    def minus(a: dict, b: dict) -> dict:
        return {k: a.get(k, 0.0) - b.get(k, 0.0) for k in set(a) | set(b)}

    return minus(view[0], other[0]), view[1] - other[1], minus(view[2], other[2]), view[3] - other[3]


def combine_warp_classes(dq: tuple, rest: tuple, dq_fraction: float) -> tuple:
    """One view of a CTA whose warps differ: a fraction ``dq_fraction`` runs ``dq``'s loop, the others ``rest``'s.
    Pipe cycles and opcode counts are the warps' mean (the pipes are shared); the instruction count is the larger
    one (a warp's own issue interval binds the slower warps)."""
    cycles0, n0, detail0, hmma0 = dq
    cycles1, n1, detail1, hmma1 = rest

    def mean(a: dict, b: dict) -> dict:
        return {k: dq_fraction * a.get(k, 0.0) + (1 - dq_fraction) * b.get(k, 0.0) for k in set(a) | set(b)}

    return (mean(cycles0, cycles1), max(n0, n1), mean(detail0, detail1),
            dq_fraction * hmma0 + (1 - dq_fraction) * hmma1)


def analyse_cubin(sass_cost, cuobjdump: str, cubin: Path, mangled: str, dq_fraction: float = 1.0) -> dict:
    """body and must views of the kernel's main loop: {view: (cycles, instructions, per-opcode counts, HMMA)}.
    dq_fraction < 1: a dK/dV kernel whose first warps alone add dQ (BwdKernelTraits::kDqWarps); its views combine
    the dQ warps' loop (the SASS without the guard around the atomics) with the others' (``combine_warp_classes``)."""
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    views = _loop_views(sass_cost, sass, mangled, cubin)
    if dq_fraction >= 1.0:
        return views
    dq_views = _loop_views(sass_cost, without_dq_guard(sass, mangled), mangled, cubin)
    # body: every block once, so the dQ region is in both; the other warps' body lacks it (must_dq - must)
    rest_body = view_minus(views["body"], view_minus(dq_views["must"], views["must"]))
    return {"body": combine_warp_classes(views["body"], rest_body, dq_fraction),
            "must": combine_warp_classes(dq_views["must"], views["must"], dq_fraction)}


def dq_warp_fraction(variant) -> float:
    """The fraction of a dK/dV kernel's warps that add dQ by atomics (1 where every warp does, or none)."""
    if variant.meta.get("pass") != "bwd_dkdv" or "_dqatomic" not in variant.name:
        return 1.0
    tile = variant.meta["tile"]
    return bank_model.bwd_tile_shape(tile, variant.meta["head_dim"], True).dq_warps / tile.warps


def ensure_cubin(variant, cubin_dir: Path, kernel_report) -> dict:
    """The kernel_report row of variant, compiling it into cubin_dir unless its cubin and meta line are there."""
    cubin = cubin_dir / f"{variant.name}.cubin"
    meta_path = cubin_dir / "meta.jsonl"
    expression = variant.name_expressions[0]
    if cubin.exists() and meta_path.exists():
        for line in meta_path.read_text().splitlines():
            entry = json.loads(line)
            if entry.get("label") == expression:
                log = (cubin_dir / f"{variant.name}.ptxas.log").read_text()
                mangled = entry["match"].strip("^$").replace("\\", "")
                spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
                spill = sum(int(a) + int(b) for a, b in spills)
                row = {"name": expression, "variant": variant.name, "mangled": mangled, "registers": entry["regs"],
                       "spill_bytes": spill, "smem_bytes": entry["smem_bytes"], "threads": entry["threads"]}
                row.update(kernel_report.v100_occupancy(entry["regs"], entry["threads"], entry["smem_bytes"]))
                return row
    program = kernel_report.compile_variant(variant, 70, use_cache=True)
    rows = kernel_report.kernel_rows(variant, program, 0.0)
    kernel_report.write_cubins(cubin_dir, variant, program, rows)
    return rows[0]


def _rounded(value):
    """value with floats to 4 decimals (the JSON result), tuples as lists."""
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    return value


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "lab" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- tables ----------------------------------------------------------------------------------------------------------

def _source_mark(source: str) -> str:
    return "" if source == "measured" else " (b)" if source.startswith("borrowed") else " (-)"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _tile_text(variant) -> str:
    tile = variant.meta["tile"]
    if variant.meta["pass"] == "bwd_dkdv":
        text = (f"qp{tile.quad_pair_rows}x{4 // tile.quad_pair_rows} n{tile.block_n} m{tile.block_m} w{tile.warps}"
                f"{' kv-smem' if tile.kv_in_smem else ''}{' lean' if tile.lean else ''}")
    else:
        text = (f"qp{tile.quad_pair_rows}x{4 // tile.quad_pair_rows} m{tile.block_m} n{tile.block_n} w{tile.warps}"
                f"{' q-smem' if tile.q_in_smem else ''}{' split' if tile.split_masked else ''}")
    return text


def _kernel_label(k: Kernel) -> str:
    labels = {"fwd": "fwd", "bwd_dkdv": "bwd dK/dV" + ("+dQ atomics" if k.dq_atomic else ""), "bwd_dq": "bwd dQ"}
    return labels[k.pass_name]


def kernel_table(kernels: list[Kernel]) -> list[str]:
    head = ["kernel", "d", "accum", "dropout", "tile", "regs", "spill B", "smem KB", "warps/SM (per sched.)",
            "ld / st factor", "model TC body / must", "+ conflicts body / must (bound)", "upper bound TF/s must",
            "latency bound TF/s must", "estimate TF/s body-must"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for k in kernels:
        r, b, m = k.report, k.views["body"], k.views["must"]
        source = _source_mark(k.factor_source)
        lines.append("| " + " | ".join([
            _kernel_label(k), str(k.meta["head_dim"]), "fp16" if k.meta["accum_f16"] else "fp32",
            "yes" if k.meta["dropout"] else "", _tile_text(k.variant), str(r["registers"]), str(r["spill_bytes"]),
            f"{r['smem_bytes'] / 1024:.1f}", f"{r['warps_per_sm']} ({r['warps_per_sm'] / 4:g})",
            f"{k.factors[0]:.2f} / {k.factors[1]:.2f}{source}",
            f"{_pct(b['model_tc_util'])} / {_pct(m['model_tc_util'])}",
            f"{_pct(b['tc_util'])} / {_pct(m['tc_util'])} ({m['bound_pipe']})",
            f"{m['tflops_bound']:.1f}", f"{m['tflops_latency']:.1f}",
            f"{b['tflops_estimate']:.1f}-{m['tflops_estimate']:.1f}"]) + " |")
    return lines


def pass_rows(kernels: list[Kernel]) -> list[dict]:
    """Per head_dim and accumulation (no dropout): forward, backward with dQ by atomics where the shipped tile has
    them, deterministic backward (dK/dV + dQ kernel); body and must estimates. A head_dim whose backward runs the
    kernels of a larger one on zero-padded inputs (tiles.bwd_kernel_head_dim: d112 on d128) gets their rates times
    head_dim / kernel head_dim (the same time for the smaller head_dim's FLOPs)."""
    from volta_train.kernels import tiles

    shipped = {k.name: k for k in kernels if k.role == "shipped"}
    rows = []
    for head_dim in tiles.SUPPORTED_HEAD_DIMS:
        kernel_d = tiles.bwd_kernel_head_dim(head_dim, 70)
        useful = head_dim / kernel_d  # of the padded kernels' FLOPs
        for accum_f16 in (False, True):
            fwd = shipped.get(tiles.fwd_variant(head_dim, tiles.fwd_tile(head_dim, False, 70), accum_f16, False).name)
            tile = tiles.bwd_tile(kernel_d, 70, accum_f16)
            atomic = (shipped.get(tiles.bwd_variant(kernel_d, tile, accum_f16, False, True).name)
                      if tile.dq_atomic else None)
            det = shipped.get(tiles.bwd_variant(kernel_d, tile, accum_f16, False, False).name)
            dq = shipped.get(tiles.dq_variant(kernel_d, tiles.dq_tile(kernel_d, 70), False, False).name)
            if not (fwd and det and dq):
                continue
            row = {"head_dim": head_dim, "accum": "fp16" if accum_f16 else "fp32",
                   "fwd_warps_per_sm": fwd.report["warps_per_sm"], "bwd_warps_per_sm": det.report["warps_per_sm"],
                   "bwd_kernel_head_dim": kernel_d}
            for view in ("body", "must"):
                row[f"fwd_{view}"] = fwd.views[view]["tflops_estimate"]
                row[f"fwd_bound_{view}"] = fwd.views[view]["tflops_bound"]
                row[f"bwd_det_{view}"] = useful * deterministic_pass_rate(
                    det.views[view]["tflops_estimate"], dq.views[view]["tflops_estimate"], tile.out_split)
                row[f"bwd_det_bound_{view}"] = useful * deterministic_pass_rate(
                    det.views[view]["tflops_bound"], dq.views[view]["tflops_bound"], tile.out_split)
                src = atomic or None
                row[f"bwd_{view}"] = useful * src.views[view]["tflops_estimate"] if src else row[f"bwd_det_{view}"]
                row[f"bwd_bound_{view}"] = (useful * src.views[view]["tflops_bound"] if src
                                            else row[f"bwd_det_bound_{view}"])
            row["bwd_path"] = ("dK/dV + dQ atomics" if atomic else "dK/dV + dQ kernel") + (
                f", d{kernel_d} kernels on zero-padded inputs" if kernel_d != head_dim else "")
            rows.append(row)
    return rows


def kernel_rate(k: Kernel, view: str, interval: float, conflict_free: bool = False) -> float:
    """Estimated TFLOP/s of one kernel at issue interval ``interval``: min(pipe bound, latency bound)."""
    v = k.views[view]
    util = v["model_tc_util"] if conflict_free else v["tc_util"]
    latency = latency_bound(warps_per_scheduler(k.report["warps_per_sm"]), v["tensor_cycles"], v["instructions"],
                            interval)
    return min(util * PEAK_TFLOPS, latency)


def pass_rate(k: Kernel, dq: Kernel | None, view: str, interval: float, conflict_free: bool = False) -> float:
    """Estimated TFLOP/s of a pass: the kernel alone (forward; dK/dV with dQ atomics), or a dK/dV kernel without
    atomics followed by the dQ kernel ``dq``."""
    rate = kernel_rate(k, view, interval, conflict_free)
    if k.pass_name == "bwd_dkdv" and not k.dq_atomic:
        rate = deterministic_pass_rate(rate, kernel_rate(dq, view, interval, conflict_free), k.meta["tile"].out_split)
    return rate


def faster_when(candidate, shipped, low: float = 1.0, high: float = 20.0, step: float = 0.05) -> str:
    """Over which issue intervals L in [low, high] candidate(L) > shipped(L) (both: L -> TFLOP/s): "all", "none",
    "L > x", "L < x" or "mixed"."""
    grid = [low + i * step for i in range(int(round((high - low) / step)) + 1)]
    wins = [candidate(x) > shipped(x) * (1 + 1e-9) for x in grid]
    if all(wins):
        return "all"
    if not any(wins):
        return "none"
    first = wins.index(True)
    if all(wins[first:]):
        return f"L > {grid[first - 1]:.2f}"
    last = len(wins) - 1 - wins[::-1].index(True)
    if all(wins[:last + 1]):
        return f"L < {grid[last + 1]:.2f}"
    return "mixed"


def candidate_rows(kernels: list[Kernel], intervals: tuple[float, ...]) -> list[dict]:
    """The shipped kernel and its candidates, per head_dim (and accumulation for the forward), as a pass: the
    forward kernel; the backward (fp32 accumulation) as the dK/dV kernel with dQ atomics, or dK/dV without atomics
    + the shipped dQ kernel. No dropout. Estimates at each interval L, and at the calibrated L with every
    conflict factor 1 (the swizzles of issue 16 done)."""
    from volta_train.kernels import tiles

    by_name = {k.name: k for k in kernels}
    rows = []
    groups = []
    for head_dim in tiles.SUPPORTED_HEAD_DIMS:
        for accum_f16 in (False, True):
            groups.append(("fwd", head_dim, accum_f16))
        groups.append(("bwd_dkdv", head_dim, False))
    for pass_name, head_dim, accum_f16 in groups:
        members = [k for k in kernels if k.pass_name == pass_name and k.meta["head_dim"] == head_dim
                   and k.meta["accum_f16"] == accum_f16 and not k.meta["dropout"]]
        # dQ kernels of the deterministic path: the shipped one first, then candidates (fp32, no dropout)
        dq = by_name.get(tiles.dq_variant(head_dim, tiles.dq_tile(head_dim, 70), False, False).name)
        dq_options = [dq] + sorted((k for k in kernels if k.pass_name == "bwd_dq" and k.role == "candidate"
                                    and k.meta["head_dim"] == head_dim and not k.meta["dropout"]
                                    and pass_name == "bwd_dkdv"), key=lambda k: k.name)
        if not any(k.role == "candidate" for k in members + dq_options[1:]):
            continue
        reference = [k for k in members if k.role == "shipped" and (pass_name == "fwd" or k.dq_atomic == (
            tiles.bwd_tile(head_dim, 70).dq_atomic))]
        if not reference or (pass_name == "bwd_dkdv" and dq is None):
            continue  # left out by --filter
        reference = reference[0]
        if pass_name == "bwd_dkdv":
            members = [k for k in members if k.dq_atomic or dq is not None]
        pairs = [(k, None if pass_name == "fwd" or k.dq_atomic else d)
                 for k in sorted(members, key=lambda k: (k.role != "shipped", k.name))
                 for d in (dq_options if pass_name == "bwd_dkdv" and not k.dq_atomic else [dq])]
        for k, kdq in pairs:
            split = getattr(k.meta["tile"], "out_split", 1)
            row = {"pass": "fwd" if pass_name == "fwd" else "bwd", "head_dim": head_dim,
                   "accum": "fp16" if accum_f16 else "fp32",
                   "role": "shipped" if k.role == "shipped" and (kdq is None or kdq.role == "shipped") else "candidate",
                   "variant": k.name, "dq_variant": kdq.name if kdq is not None else "",
                   "tile": _tile_text(k.variant)
                   + (f" occ{k.meta['tile'].min_blocks_per_sm}" if pass_name == "fwd" else "")
                   + (f" split{split}" if split > 1 else ""),
                   "dq": "" if pass_name == "fwd" else "atomics" if k.dq_atomic else "dQ kernel" + (
                       f" {_tile_text(kdq.variant)} ({kdq.report['registers']} regs, {kdq.report['spill_bytes']} B "
                       f"spills, {kdq.report['warps_per_sm']} warps/SM)"
                       if kdq is not None and kdq.role == "candidate" else ""),
                   "dq_spill_bytes": kdq.report["spill_bytes"] if kdq is not None else 0,
                   "gemms": None if pass_name == "fwd" else 5 if k.dq_atomic else 2 * split + 2 + 3,
                   "from": k.note + (f"; dQ kernel: {kdq.note}" if kdq is not None and kdq.role == "candidate" else ""),
                   "registers": k.report["registers"], "spill_bytes": k.report["spill_bytes"],
                   "smem_bytes": k.report["smem_bytes"], "warps_per_sm": k.report["warps_per_sm"],
                   "factors": k.factors, "factor_source": k.factor_source,
                   "model_must": k.views["must"]["model_tc_util"], "conflict_must": k.views["must"]["tc_util"],
                   "conflict_body": k.views["body"]["tc_util"]}
            for view in ("body", "must"):
                for interval in intervals:
                    for cf in (False, True):
                        if cf and interval != intervals[1]:
                            continue
                        row[f"pass_{view}_L{interval:.1f}" + ("_conflict_free" if cf else "")] = pass_rate(
                            k, kdq, view, interval, cf)
            row["reference"] = reference.name
            is_reference = k is reference and kdq in (None, dq)
            row["faster_than_shipped_when"] = "" if is_reference else faster_when(
                lambda x, k=k, kdq=kdq: pass_rate(k, kdq, "must", x), lambda x: pass_rate(reference, dq, "must", x))
            row["faster_than_shipped_when_conflict_free"] = "" if is_reference else faster_when(
                lambda x, k=k, kdq=kdq: pass_rate(k, kdq, "must", x, True),
                lambda x: pass_rate(reference, dq, "must", x, True))
            rows.append(row)
    return rows


REPORT_KEYS = ("registers", "spill_bytes", "smem_bytes", "threads", "ctas_per_sm", "warps_per_sm", "limited_by")
HEADLINE = (("fwd", 64), ("fwd", 128), ("fwd", 256), ("bwd", 64), ("bwd", 128), ("bwd", 256))


def headline_rows(kernels: list[Kernel], candidates: list[dict], intervals: tuple[float, ...]) -> list[dict]:
    """fwd/bwd at d64/d128/d256, fp32 accumulation, no dropout, must view: the shipped default path, the best
    spill-free candidate at the calibrated L (if any), and the CUTLASS kernels, each at every interval L."""
    from volta_train.kernels import tiles

    by_name = {k.name: k for k in kernels}
    rows = []
    for pass_name, head_dim in HEADLINE:
        dq = by_name.get(tiles.dq_variant(head_dim, tiles.dq_tile(head_dim, 70), False, False).name)
        if pass_name == "fwd":
            ours = by_name.get(tiles.fwd_variant(head_dim, tiles.fwd_tile(head_dim, False, 70), False, False).name)
        else:
            tile = tiles.bwd_tile(head_dim, 70)
            ours = by_name.get(tiles.bwd_variant(head_dim, tile, False, False, tile.dq_atomic).name)
        if ours is None or (pass_name == "bwd" and not ours.dq_atomic and dq is None):
            continue
        entry = {"pass": pass_name, "head_dim": head_dim, "kernel": f"volta_train shipped ({_tile_text(ours.variant)}"
                 + (", dQ atomics" if pass_name == "bwd" and ours.dq_atomic else ", + dQ kernel" if pass_name == "bwd"
                    else "") + ")", "warps_per_sm": ours.report["warps_per_sm"],
                 "spill_bytes": ours.report["spill_bytes"],
                 "upper_bound_must": pass_rate(ours, dq, "must", 1e-9)}
        for x in intervals:
            entry[f"must_L{x:.1f}"] = pass_rate(ours, dq, "must", x)
        entry["body_calibrated"] = pass_rate(ours, dq, "body", intervals[1])
        rows.append(entry)
        pool = [r for r in candidates if r["pass"] == pass_name and r["head_dim"] == head_dim and r["accum"] == "fp32"
                and r["role"] == "candidate" and r["spill_bytes"] == 0 and not r.get("dq_spill_bytes")
                and r[f"pass_must_L{intervals[1]:.1f}"] > rows[-1][f"must_L{intervals[1]:.1f}"]]
        if pool:
            best = max(pool, key=lambda r: r[f"pass_must_L{intervals[1]:.1f}"])
            k, kdq = by_name[best["variant"]], by_name.get(best.get("dq_variant", ""), dq)
            entry = {"pass": pass_name, "head_dim": head_dim, "kernel": f"best spill-free candidate ({best['tile']}"
                     + (f", {best['dq']}" if best["dq"] else "") + ")", "warps_per_sm": best["warps_per_sm"],
                     "spill_bytes": 0, "upper_bound_must": pass_rate(k, kdq, "must", 1e-9),
                     "body_calibrated": best[f"pass_body_L{intervals[1]:.1f}"]}
            for x in intervals:
                entry[f"must_L{x:.1f}"] = best[f"pass_must_L{x:.1f}"]
            rows.append(entry)
        for c in CUTLASS_SM70:
            if c["pass_name"] == pass_name and c["head_dim"] == head_dim:
                est = {x: cutlass_estimate(c, x) for x in intervals}
                entry = {"pass": pass_name, "head_dim": head_dim, "kernel": c["kernel"] + " (conflict-free assumed)",
                         "warps_per_sm": est[intervals[1]]["warps_per_sm"], "spill_bytes": c["spills"],
                         "upper_bound_must": est[intervals[1]]["must"]["tflops_bound"],
                         "body_calibrated": est[intervals[1]]["body"]["tflops_estimate"]}
                for x in intervals:
                    entry[f"must_L{x:.1f}"] = est[x]["must"]["tflops_estimate"]
                rows.append(entry)
    return rows


def markdown(kernels: list[Kernel], cutlass: list[dict], passes: list[dict], candidates: list[dict],
             info: dict, headline: list[dict] = ()) -> str:
    L = info["issue_interval"]
    out = ["# V100 estimate per kernel (static pipe model + measured bank conflicts + latency)", "",
           f"Generated by `lab/v100_estimate.py` (its docstring has the method). NVRTC {info['nvrtc']} for sm_70; "
           f"pipe model `{info['sass_cost']}`; conflict factors `{info['conflicts']}`; issue interval "
           f"L = {L:.2f} cycles ({CALIBRATION_WARPS_PER_SCHEDULER} warps per scheduler / {CALIBRATION_IPC} IPC, the "
           "real-V100 profile of a FA2 port in shared/VOLTA_NOTES.md). No V100 ran any of this.", "",
           "Columns: `ld / st factor`: measured wavefronts per ideal wavefront (H100, whole kernel), `(b)` borrowed "
           "from a measured kernel of the same arrangement (the JSON says which), `(-)` none (conflict-free "
           "assumed). `model`: sass_cost's tensor-core utilisation bound, conflict-free. `+ conflicts`: the same with "
           "shared-memory loads and stores scaled by the factors, and the pipe that then binds. `upper bound` = 125 "
           "TFLOP/s x that. `latency bound` = 125 x (warps per scheduler) x (tensor cycles per instruction) / L: what "
           "the warps deliver if each issues one instruction every L cycles. `estimate` = the smaller of the two "
           "(= upper bound x min(1, w B / (n L))), body view - must view (`must`: an unmasked key block's steady "
           "state; `body`: every block of the loop, masking code included).", "",
           ]
    intervals = info["sensitivity_intervals"]
    ls = " / ".join(f"L={x:.1f}" for x in intervals)
    if headline:
        out += ["## Headline: d64, d128 and d256 against CUTLASS (fp32 accumulation, no dropout)", "",
                f"TFLOP/s of the pass (backward: 2.5x the forward's FLOPs), must view at {ls}, body view at "
                f"L={intervals[1]:.1f}; `upper bound`: pipes + conflicts, no latency.", "",
                f"| pass | d | kernel | warps/SM | spills B | upper bound | estimate must ({ls}) | body |",
                "|" + " --- |" * 8]
        for r in headline:
            rates = " / ".join(f"{r[f'must_L{x:.1f}']:.1f}" for x in intervals)
            out.append(f"| {r['pass']} | {r['head_dim']} | {r['kernel']} | {r['warps_per_sm']} | {r['spill_bytes']} | "
                       f"{r['upper_bound_must']:.1f} | {rates} | {r['body_calibrated']:.1f} |")
        out.append("")
    out += ["## Per kernel (shipped sm_70 tables, no soft-capping)", ""]
    out += kernel_table([k for k in kernels if k.role == "shipped"])
    out += ["", "## Per pass (no dropout): TFLOP/s, estimate body-must (upper bound must)", "",
            "Backward counted as 2.5x the forward's FLOPs (5 GEMMs); `dK/dV + dQ kernel` runs 7 GEMMs for them: "
            "5 / (4 / r_dkdv + 3 / r_dq).", "",
            "| head_dim | accum | fwd warps/SM | forward | backward warps/SM (dK/dV) | backward, default path | "
            "backward, deterministic |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in passes:
        out.append(f"| {r['head_dim']} | {r['accum']} | {r['fwd_warps_per_sm']} "
                   f"| {r['fwd_body']:.1f}-{r['fwd_must']:.1f} "
                   f"({r['fwd_bound_must']:.1f}) | {r['bwd_warps_per_sm']} | {r['bwd_body']:.1f}-{r['bwd_must']:.1f} "
                   f"({r['bwd_bound_must']:.1f}; {r['bwd_path']}) | {r['bwd_det_body']:.1f}-{r['bwd_det_must']:.1f} "
                   f"({r['bwd_det_bound_must']:.1f}) |")
    out += ["", "## CUTLASS example 41 Sm70 kernels, treated the same way", "",
            "From the figures of shared/tools/v100model/README.md, and for head_dim 256 of "
            "`lab/cutlass_sm70_sass.py` (the same build; not rebuilt here); no conflict factor was "
            "measured for them, so none is applied (conflict-free: favours CUTLASS), and their spills (in the "
            "model as L1 traffic) cost no latency here. Its backward computes dQ in the same kernel (5 GEMMs), "
            "comparable with our `dK/dV + dQ atomics` pass.", "",
            "| kernel | d | regs | spills st/ld B | warps/SM (per sched.) | model TC body / must | "
            "upper bound TF/s must | latency bound TF/s must | estimate TF/s body-must |", "|" + " --- |" * 9]
    for c in cutlass:
        b, m = c["body"], c["must"]
        out.append(f"| {c['kernel']} | {c['head_dim']} | {c['regs']} | {c['spills']} | {c['warps_per_sm']} "
                   f"({c['warps_per_scheduler']:g}) | {_pct(b['tc_util'])} / {_pct(m['tc_util'])} | "
                   f"{m['tflops_bound']:.1f} | {m['tflops_latency']:.1f} | "
                   f"{b['tflops_estimate']:.1f}-{m['tflops_estimate']:.1f} |")
    below: dict = {}
    for k in kernels:
        if k.role == "shipped" and k.report["warps_per_sm"] < TARGET_WARPS_PER_SM:
            entry = below.setdefault((_kernel_label(k).split("+")[0], k.meta["head_dim"]), set())
            entry.add((k.report["ctas_per_sm"], k.variant.meta["tile"].warps, k.report["limited_by"]))
    out += ["", f"## Shipped kernels under {TARGET_WARPS_PER_SM} warps per SM", ""]
    out += [f"- {label} d{d}: " + ", ".join(f"{c} CTA x {w} warps (limited by {why})" for c, w, why in sorted(v))
            for (label, d), v in sorted(below.items(), key=lambda kv: kv[0][1])] or ["- none"]
    for pass_name, title in (("bwd", "Candidate backward tiles for the head dims under 8 warps per SM, and the V100 "
                                      "table's next tiles (tiles.BWD_TILES_SM70_NEXT; fp32 accumulation, no dropout)"),
                             ("fwd", "Candidate forward tiles with 12 warps per SM for the head dims at 8 "
                                     "(no dropout)")):
        rows = [r for r in candidates if r["pass"] == pass_name]
        if not rows:
            continue
        out += ["", f"## {title}", "",
                f"{'Backward' if pass_name == 'bwd' else 'Forward'} TFLOP/s estimated for the pass, must view, at "
                f"{ls}; `no conflicts`: at L={intervals[1]:.1f} with every conflict factor 1"
                + (" (the dQ kernel's too). dK/dV tiles without atomics are paired with the shipped dQ kernel, and "
                   "with each candidate dQ kernel where there are any (named in the `dQ` column; registers, spills "
                   "and warps in the other columns are the dK/dV kernel's). `GEMMs`: GEMMs executed for the 5 "
                   "counted (dQ by atomics 5; dK/dV split over s CTAs + dQ kernel 2s + 2 + 3). "
                   if pass_name == "bwd" else ". ")
                + "`faster ... when`: the range of L in [1, 20] cycles over which the row's must-view estimate beats "
                "the shipped default's (dQ by atomics where the shipped tile has them). "
                + "Candidates were compiled for this estimate only: none of them was run.", "",
                "| d | accum | role | tile | dQ | GEMMs | from | regs | spill B | smem KB | warps/SM | "
                f"ld / st factor | model must | + conflicts body / must | pass TF/s must ({ls}) | no conflicts | "
                "faster than the shipped default when (no conflicts) |", "|" + " --- |" * 17]
        for r in rows:
            src = _source_mark(r["factor_source"])
            rates = " / ".join(f"{r[f'pass_must_L{x:.1f}']:.1f}" for x in intervals)
            out.append(f"| {r['head_dim']} | {r['accum']} | {r['role']} | {r['tile']} | {r['dq']} | "
                       f"{r['gemms'] or ''} | {r['from']} | "
                       f"{r['registers']} | {r['spill_bytes']} | {r['smem_bytes'] / 1024:.1f} | {r['warps_per_sm']} | "
                       f"{r['factors'][0]:.2f} / {r['factors'][1]:.2f}{src} | {_pct(r['model_must'])} | "
                       f"{_pct(r['conflict_body'])} / {_pct(r['conflict_must'])} | {rates} | "
                       f"{r[f'pass_must_L{intervals[1]:.1f}_conflict_free']:.1f} | "
                       f"{r['faster_than_shipped_when']} ({r['faster_than_shipped_when_conflict_free']}) |")
    out += ["", "## What this estimate cannot see", "",
            "- Latency beyond one average issue interval L, calibrated on one kernel (another FA2 port, forward): "
            "no dependence chains, scoreboard, HMMA or LDS latency per instruction, barrier stalls (with one CTA per "
            "SM every `__syncthreads` stalls the whole SM), register-bank conflicts, instruction-cache misses.",
            "- Conflict factors are whole-kernel averages measured on an H100 with the sm_90 build of the same tiles "
            "(same addressing, other compiler: NVRTC 13 for sm_90 against 12.9 for sm_70); a borrowed factor is a "
            "guess from the arrangement; CUTLASS's are not measured at all.",
            "- Whether a conflicted access also costs issue or MIO-queue slots on a V100 beyond the wavefronts "
            "(the model charges wavefronts only).",
            "- Global memory: L2/DRAM bandwidth and latency (the loads are charged as L1 data-path cycles only), "
            "the tail of the grid, launch overheads, causal masking's diagonal blocks (`body` counts their code, "
            "`must` does not).",
            "- The real V100 rate of each pipe (the throughputs are the programming guide's; the tensor rate is "
            "arithmetic, consistent with cuBLAS reaching 77% of 125 TFLOP/s)."]
    return "\n".join(out) + "\n"


# --- main ------------------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for v100_estimate.md and .json")
    parser.add_argument("--cubin-dir", type=Path, help="cubins + meta.jsonl (kernel_report --cubin-dir); reused "
                        "where present, else compiled into it (default: a new temporary directory)")
    parser.add_argument("--conflicts", type=Path, default=REPO / "lab" / "results" / "smem_conflicts_sm70_tiles_h100.md",
                        help="lab/smem_conflicts.py result: smem_conflicts.json or its markdown table")
    parser.add_argument("--sass-cost", help="path of shared/tools/v100model/sass_cost.py (default: $V100MODEL, "
                        "else shared/tools/v100model above the repository)")
    parser.add_argument("--issue-interval", type=float, default=ISSUE_INTERVAL,
                        help=f"L, cycles between one warp's issues (default {ISSUE_INTERVAL:.2f}: "
                        f"{CALIBRATION_WARPS_PER_SCHEDULER} / {CALIBRATION_IPC})")
    parser.add_argument("--filter", help="regex on variant names: only these kernels (tables then incomplete)")
    parser.add_argument("--no-candidates", action="store_true", help="skip the candidate tiles")
    options = parser.parse_args(argv)
    if options.issue_interval <= 0:
        parser.error(f"--issue-interval {options.issue_interval}: must be > 0")

    from volta_train.kernels import tiles

    kernel_report = _load_script("kernel_report")
    sass_cost_path = find_sass_cost(options.sass_cost)
    sass_cost = load_sass_cost(sass_cost_path)
    cuobjdump = sass_cost.find_tool("cuobjdump")
    if not cuobjdump:
        raise SystemExit("cuobjdump (CUDA 12, sm_70-capable) not found: run shared/tools/v100model/setup_tools.sh "
                         "or set $CUOBJDUMP")
    measured = conflict_factors(conflict_rows(options.conflicts))
    shipped = tiles.shipped_fwd_variants(70, softcap=(False,)) + tiles.shipped_bwd_variants(70, softcap=(False,))
    by_name = {v.name: v for v in shipped}
    kernels = [Kernel(v, "shipped") for v in shipped]
    if options.filter:
        kernels = [k for k in kernels if re.search(options.filter, k.name)]
    cubin_dir = options.cubin_dir or Path(tempfile.mkdtemp(prefix="v100_estimate_cubins_"))
    print(f"cubins: {cubin_dir}", flush=True)
    cubin_dir.mkdir(parents=True, exist_ok=True)
    options.out.mkdir(parents=True, exist_ok=True)

    def evaluate(batch: list[Kernel]) -> None:
        for i, k in enumerate(batch):
            k.report = ensure_cubin(k.variant, cubin_dir, kernel_report)
            k.factors, k.factor_source = borrow_factors(k.variant, measured, by_name)
            views = analyse_cubin(sass_cost, cuobjdump, cubin_dir / f"{k.name}.cubin", k.report["mangled"],
                                  dq_warp_fraction(k.variant))
            for view, (cycles, n, detail, _hmma) in views.items():
                k.views[view] = view_estimate(cycles, n, detail, *k.factors, k.report["warps_per_sm"],
                                              options.issue_interval)
            m = k.views["must"]
            print(f"[{i + 1}/{len(batch)}] {k.role} {k.name}: {k.report['warps_per_sm']} warps/SM, factors "
                  f"{k.factors[0]:.2f}/{k.factors[1]:.2f} ({k.factor_source}), must {_pct(m['model_tc_util'])} -> "
                  f"{_pct(m['tc_util'])} ({m['bound_pipe']}), E {m['issue_efficiency']:.2f}, "
                  f"{m['tflops_estimate']:.1f} TF/s", flush=True)

    evaluate(kernels)
    if not options.no_candidates:
        # head dims whose shipped dK/dV kernel is under 8 warps per SM: their candidate tiles (fp32, no dropout)
        low = sorted({k.meta["head_dim"] for k in kernels if k.pass_name == "bwd_dkdv"
                      and k.report["warps_per_sm"] < TARGET_WARPS_PER_SM})
        extra = [Kernel(tiles.bwd_variant(d, tile, False, False, dq_atomic), "candidate", source)
                 for d in low for tile, dq_atomic, source in candidate_bwd_tiles(d)]
        fwd_low = sorted({k.meta["head_dim"] for k in kernels if k.pass_name == "fwd" and not k.meta["dropout"]
                          and k.report["warps_per_sm"] < 12})
        extra += [Kernel(tiles.fwd_variant(d, tile, accum_f16, False), "candidate", source)
                  for d in fwd_low for tile, source in candidate_fwd_tiles(d) for accum_f16 in (False, True)]
        # head dims whose shipped dQ kernel is under 8 warps per SM: candidate dQ tiles (fp32, no dropout)
        dq_low = sorted({k.meta["head_dim"] for k in kernels if k.pass_name == "bwd_dq"
                         and k.report["warps_per_sm"] < TARGET_WARPS_PER_SM})
        extra += [Kernel(tiles.dq_variant(d, tile, False, False), "candidate", source)
                  for d in dq_low for tile, source in candidate_dq_tiles(d)]
        # tiles waiting for a GPU lease to ship (tiles.BWD_TILES_SM70_NEXT), both accumulations
        extra += [Kernel(tiles.bwd_variant(d, tile, accum_f16, False, tile.dq_atomic), "candidate",
                         "tiles.BWD_TILES_SM70_NEXT") for d, tile in tiles.BWD_TILES_SM70_NEXT.items()
                  for accum_f16 in (False, True)]
        extra = [k for k in extra if k.name not in by_name]
        evaluate(extra)
        kernels += extra
    done = kernels  # shipped, then candidates

    from volta_train.kernels.nvrtc import find_nvrtc

    shown = str(sass_cost_path)
    shown = shown[shown.find("shared/tools/"):] if "shared/tools/" in shown else shown
    info = {"nvrtc": find_nvrtc(70).version_string, "sass_cost": shown,
            "conflicts": os.path.relpath(options.conflicts.resolve(), REPO), "issue_interval": options.issue_interval,
            "calibration": {"warps_per_scheduler": CALIBRATION_WARPS_PER_SCHEDULER, "ipc": CALIBRATION_IPC},
            "sensitivity_intervals": (SENSITIVITY_INTERVALS[0], options.issue_interval, SENSITIVITY_INTERVALS[2])}
    cutlass = [cutlass_estimate(c, options.issue_interval) for c in CUTLASS_SM70]
    passes = pass_rows(done)
    candidates = candidate_rows(done, info["sensitivity_intervals"])
    headline = headline_rows(done, candidates, info["sensitivity_intervals"])
    text = markdown(done, cutlass, passes, candidates, info, headline)
    (options.out / "v100_estimate.md").write_text(text)
    payload = {"info": info, "kernels": [
        {"variant": k.name, "role": k.role, "note": k.note, "pass": k.pass_name, "head_dim": k.meta["head_dim"],
         "accum": "fp16" if k.meta["accum_f16"] else "fp32", "dropout": k.meta["dropout"], "dq_atomic": k.dq_atomic,
         "tile": _tile_text(k.variant), "report": {key: k.report[key] for key in REPORT_KEYS}, "factors": k.factors,
         "factor_source": k.factor_source,
         "views": k.views} for k in done], "passes": passes, "candidates": candidates, "cutlass": cutlass,
        "headline": headline}
    (options.out / "v100_estimate.json").write_text(json.dumps(_rounded(payload), default=str) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
