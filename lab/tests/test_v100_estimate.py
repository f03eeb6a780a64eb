"""lab/v100_estimate.py on CPU: the estimate's arithmetic on small synthetic inputs (conflict scaling, bound
recomputation, occupancy -> warps per scheduler, the latency factor, pass rates), the conflict-table parsing and
the candidate tiles. The compile + pipe-model run itself needs NVRTC 12 and the CUDA 12 cuobjdump (not in CI)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

from volta_train.kernels import tiles

import bank_model

REPO = Path(__file__).resolve().parents[2]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "lab" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


ve = _load("v100_estimate")
kernel_report = _load("kernel_report")


# --- shared-memory cycles and conflict scaling ---------------------------------------------------------------------

def test_smem_op_cycles_follow_the_pipe_model():
    # 4 x max(1, 32 lanes x bytes / 128): .32 and narrower 4, .64 8, .128 16
    assert [ve.smem_op_cycles(op) for op in ("LDS", "LDS.16", "LDS.32", "LDS.64", "LDS.128", "STS.128", "ATOMS")] == \
        [4, 4, 4, 8, 16, 16, 4]
    with pytest.raises(ValueError, match="LDG.128"):
        ve.smem_op_cycles("LDG.128")


def test_smem_split_separates_loads_and_stores_and_ignores_the_rest():
    detail = {"LDS.128": 10, "LDS.64": 2, "STS.32": 3, "ATOMS": 1, "STS.128": 1, "HMMA.884.F32.F32": 99,
              "LDG.128": 5, "IMAD": 40}
    loads, stores = ve.smem_split(detail)
    assert loads == 10 * 16 + 2 * 8
    assert stores == 3 * 4 + 4 + 16


def test_scale_conflicts_scales_loads_and_stores_separately():
    cycles = {"issue": 300.0, "tensor": 256.0, "smem": 208.0, "l1_global": 20.0, "lsu_data": 228.0}
    scaled = ve.scale_conflicts(cycles, 176.0, 32.0, 2.0, 1.5)
    assert scaled["smem"] == pytest.approx(176 * 2 + 32 * 1.5)
    assert scaled["lsu_data"] == pytest.approx(176 * 2 + 32 * 1.5 + 20)
    assert scaled["issue"] == 300 and scaled["tensor"] == 256 and scaled["l1_global"] == 20
    assert cycles["smem"] == 208  # the input is left alone
    assert ve.scale_conflicts(cycles, 176.0, 32.0, 1.0, 1.0) == cycles


def test_scale_conflicts_rejects_a_split_that_misses_the_pipe_and_factors_below_one():
    cycles = {"smem": 208.0, "lsu_data": 208.0}
    with pytest.raises(ValueError, match="split"):
        ve.scale_conflicts(cycles, 100.0, 32.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="ld_factor"):
        ve.scale_conflicts(cycles, 176.0, 32.0, 0.9, 1.0)


def test_bound_is_recomputed_after_scaling():
    cycles = {"issue": 300.0, "tensor": 256.0, "alu": 100.0, "smem": 208.0, "l1_global": 20.0, "lsu_data": 228.0,
              "tc_port": 999.0}  # tc_port is not a bound pipe (sass_cost reports it apart)
    pipe, cyc, util = ve.bound(cycles)
    assert (pipe, cyc) == ("issue", 300.0) and util == pytest.approx(256 / 300)
    pipe, cyc, util = ve.bound(ve.scale_conflicts(cycles, 176.0, 32.0, 2.0, 1.0))
    assert (pipe, cyc) == ("lsu_data", 176 * 2 + 32 + 20) and util == pytest.approx(256 / 404)


# --- occupancy, latency, estimate ----------------------------------------------------------------------------------

@pytest.mark.parametrize("regs, threads, smem, warps, per_scheduler", [
    (241, 128, 96000, 4, 1.0),   # the d128 backward tile: one 4-warp CTA (shared memory)
    (155, 128, 9728, 12, 3.0),   # the d64 forward: 3 CTAs (registers)
    (208, 256, 55808, 8, 2.0),   # the d64 backward: one 8-warp CTA
    (128, 128, 6144, 16, 4.0),
])
def test_occupancy_to_warps_per_scheduler(regs, threads, smem, warps, per_scheduler):
    occupancy = kernel_report.v100_occupancy(regs, threads, smem)
    assert occupancy["warps_per_sm"] == warps
    assert ve.warps_per_scheduler(occupancy["warps_per_sm"]) == per_scheduler
    with pytest.raises(ValueError, match="warps_per_sm"):
        ve.warps_per_scheduler(-1)


def test_issue_efficiency_reproduces_the_calibration_point():
    # an issue-bound kernel (B = n) at 2 warps per scheduler issues CALIBRATION_IPC instructions per cycle
    assert ve.ISSUE_INTERVAL == pytest.approx(2 / 0.37)
    assert ve.issue_efficiency(2, 1000, 1000) == pytest.approx(0.37)
    assert ve.issue_efficiency(1, 1000, 1000) == pytest.approx(0.185)
    # shared-memory-bound kernels (B > n) hide more latency; never above 1
    assert ve.issue_efficiency(2, 2000, 1000) == pytest.approx(0.74)
    assert ve.issue_efficiency(8, 2000, 1000) == 1.0
    with pytest.raises(ValueError, match="instructions"):
        ve.issue_efficiency(2, 1000, 0)


def test_view_estimate_is_the_smaller_of_pipe_bound_and_latency_bound():
    cycles = {"issue": 600.0, "tensor": 512.0, "smem": 480.0, "l1_global": 40.0, "lsu_data": 520.0}
    detail = {"LDS.128": 28, "STS.32": 8}  # 448 + 32 = 480
    for warps, ld, st in ((4, 1.0, 1.0), (8, 2.0, 1.2), (12, 1.4, 1.0), (64, 2.0, 2.0)):
        v = ve.view_estimate(cycles, 600, detail, ld, st, warps)
        upper = 125 * 512 / max(600, 448 * ld + 32 * st + 40)
        latency = 125 * (warps / 4) * 512 / (600 * ve.ISSUE_INTERVAL)
        assert v["tflops_bound"] == pytest.approx(upper)
        assert v["tflops_latency"] == pytest.approx(latency)
        assert v["tflops_estimate"] == pytest.approx(min(upper, latency))
        assert v["tflops_estimate"] == pytest.approx(v["tflops_bound"] * v["issue_efficiency"])
        assert v["model_tc_util"] == pytest.approx(512 / 600)
    # conflicts move the bound to shared memory
    v = ve.view_estimate(cycles, 600, detail, 2.0, 1.0, 8)
    assert v["bound_pipe"] == "lsu_data" and v["model_bound_pipe"] == "issue"


def test_deterministic_pass_rate_weights_the_seven_gemms():
    assert ve.deterministic_pass_rate(70.0, 70.0) == pytest.approx(50.0)  # 5 useful GEMMs of 7 executed
    assert ve.deterministic_pass_rate(40.0, 60.0) == pytest.approx(5 / (4 / 40 + 3 / 60))
    # a dK/dV tile split over 2 CTAs (head_dim 256): each recomputes S^T and dP^T, 6 GEMMs in the dK/dV kernel
    assert ve.deterministic_pass_rate(40.0, 60.0, out_split=2) == pytest.approx(5 / (6 / 40 + 3 / 60))
    with pytest.raises(ValueError, match="out_split"):
        ve.deterministic_pass_rate(40.0, 60.0, out_split=0)
    with pytest.raises(ValueError, match="dq_tflops"):
        ve.deterministic_pass_rate(40.0, 0.0)


def test_faster_when_finds_the_crossing():
    assert ve.faster_when(lambda x: 10.0, lambda x: 5.0) == "all"
    assert ve.faster_when(lambda x: 1.0, lambda x: 5.0) == "none"
    # candidate flat (pipe-bound), shipped latency-bound 20 / x: the candidate wins above x = 4
    assert ve.faster_when(lambda x: 5.0, lambda x: 20.0 / x) == "L > 4.00"
    assert ve.faster_when(lambda x: 20.0 / x, lambda x: 5.0) == "L < 4.00"


# --- CUTLASS rows -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("entry", ve.CUTLASS_SM70, ids=lambda e: e["kernel"])
def test_cutlass_rows_are_consistent(entry):
    block_m, block_n = entry["block"]
    gemms = 2 if entry["pass_name"] == "fwd" else 5
    fma = gemms * block_m * block_n * entry["head_dim"]
    assert entry["hmma_per_iter"] * entry["warps_per_cta"] * 256 == fma
    est = ve.cutlass_estimate(entry)
    assert est["warps_per_sm"] == entry["ctas_per_sm"] * entry["warps_per_cta"]
    for view in ("body", "must"):
        v = est[view]
        assert v["tflops_bound"] == pytest.approx(125 * entry[f"tc_util_{view}"])
        assert v["bound_cycles"] >= entry[f"instr_{view}"] * (1 - 2e-3)  # issue is a pipe (README rounds to 0.1%)
        assert v["tflops_estimate"] == pytest.approx(min(v["tflops_bound"], v["tflops_latency"]))
    if entry["bound_body"] == "issue":  # the bound is the instruction count, within the README's rounding
        assert est["body"]["bound_cycles"] == pytest.approx(entry["instr_body"], rel=2e-3)


# --- conflict factors ---------------------------------------------------------------------------------------------

HEADER = ("| # | call (NVTX) | variant | ld inst | ld req | ld wf | ld wf/req | ld conflicts | ld wf/ideal | st inst "
          "| st req | st wf | st wf/req | st conflicts | st wf/ideal | verdict |")
TABLE = "# title\n\n" + HEADER + """
| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |
| 1 | a | kern_a | 10 | n/a | 2,000 | n/a | 1,000 | 2.000 | 4 | n/a | 100 | n/a | 0 | 1.000 | over |
| 2 | b | kern_a | 10 | n/a | 1,000 | n/a | 0 | 1.000 | 4 | n/a | 300 | n/a | 100 | 1.500 | over |
| 3 | c | kern_b | 10 | n/a | 400 | n/a | 100 | 1.333 | 4 | n/a | 0 | n/a | 0 | n/a | ok |

| variant | CALLs | other table |
| --- | --- | --- |
| kern_c | 1 | 2 |
"""


def test_conflict_factors_aggregate_launches_by_wavefronts(tmp_path):
    path = tmp_path / "conflicts.md"
    path.write_text(TABLE)
    rows = ve.conflict_rows(path)
    assert [r["variant"] for r in rows] == ["kern_a", "kern_a", "kern_b"]
    factors = ve.conflict_factors(rows)
    assert factors["kern_a"] == pytest.approx((3000 / 2000, 400 / 300))
    assert factors["kern_b"] == pytest.approx((400 / 300, 1.0))  # no stores: nothing to conflict
    assert "kern_c" not in factors
    (tmp_path / "empty.md").write_text("no table\n")
    with pytest.raises(ValueError, match="variant, ld wf"):
        ve.conflict_rows(tmp_path / "empty.md")


def test_conflict_factors_of_the_committed_measurement():
    factors = ve.conflict_factors(ve.conflict_rows(REPO / "lab" / "results" / "smem_conflicts_sm70_tiles_h100.md"))
    ld, st = factors["bwd_dkdv_d64_f32acc_qp1x4_n64_m64_w8"]
    assert ld == pytest.approx(8_950_959 / (8_950_959 - 4_609_199))  # one launch: its wf/ideal, 2.062
    assert st == pytest.approx(572_069 / (572_069 - 23_205))
    assert len(factors) == 97  # 96 sm_70-table kernels (no soft-capping) and the mma probe
    assert factors["probe_mma"] == pytest.approx((16_942 / 8_448, 33_883 / 8_448))


def test_borrow_factors_prefers_measured_then_the_same_arrangement():
    from measured_tiles import measured_sm70_variants  # the tables the committed measurement was taken on
    shipped = measured_sm70_variants()
    by_name = {v.name: v for v in shipped}
    measured = {v.name: (1.0 + i / 1000, 1.0) for i, v in enumerate(shipped)}
    own = by_name["bwd_dkdv_d64_f32acc_qp1x4_n64_m64_w8"]
    assert ve.borrow_factors(own, measured, by_name) == (measured[own.name], "measured")
    # the 2x2 4-warp K/V-in-smem tile without atomics at d80: the nearest measured 2x2 K/V-in-smem dK/dV kernel
    tile = tiles.BwdTile(quad_pair_rows=2, warps=4, block_m=32, kv_in_smem=True)
    candidate = tiles.bwd_variant(80, tile, False, False, False)
    factors, source = ve.borrow_factors(candidate, measured, by_name)
    assert source.startswith("borrowed from bwd_dkdv_d80_f32acc_qp2x2_n32_m32_w2_kvsmem ")
    assert factors == measured["bwd_dkdv_d80_f32acc_qp2x2_n32_m32_w2_kvsmem"]
    # 1x4 with K/V in smem: no measured kernel has both; the 1x4 tile of the nearest head_dim
    tile = tiles.BwdTile(quad_pair_rows=1, warps=8, block_m=32, kv_in_smem=True)
    candidate = tiles.bwd_variant(128, tile, False, False, False)
    factors, source = ve.borrow_factors(candidate, measured, by_name)
    assert "bwd_dkdv_d64_f32acc_qp1x4_n64_m64_w8" in source and "other smem operands" in source
    # the forward with Q in smem borrows from the dQ kernel (same forward shape) with Q in smem
    tile = tiles.FwdTile(quad_pair_rows=2, m_tiles=1, warps=4, block_n=16, q_in_smem=True, min_blocks_per_sm=3)
    candidate = tiles.fwd_variant(128, tile, False, False)
    factors, source = ve.borrow_factors(candidate, measured, by_name)
    assert "bwd_dq_d112_f32acc_qp2x2_m64_n16_w4_qsmem" in source
    assert ve.borrow_factors(candidate, {}, by_name) == ((1.0, 1.0), "none: conflict-free assumed")


# --- candidate tiles ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("head_dim", [80, 96, 112, 128])
def test_candidate_bwd_tiles_fit_and_are_not_the_shipped_tile(head_dim):
    shipped = tiles.bwd_tile(head_dim, 70)
    found = ve.candidate_bwd_tiles(head_dim)
    for tile, dq_atomic, source in found:
        assert tile != shipped and source
        assert ve.bwd_tile_ok(head_dim, tile, dq_atomic)
        assert bank_model.bwd_tile_smem_bytes(tile, head_dim, dq_atomic) <= 96 * 1024
        assert not dq_atomic or tile.dq_atomic
    if head_dim in (96, 128):  # the 8-warp 1x4 tile with K/V in smem fits (without atomics)
        tile = tiles.BwdTile(quad_pair_rows=1, warps=8, block_m=32, kv_in_smem=True)
        assert (tile, False) in {(t, a) for t, a, _ in found}


def test_bwd_tile_ok_mirrors_the_kernel_asserts():
    one_by_four = tiles.BwdTile(quad_pair_rows=1, warps=8, block_m=32)
    assert not ve.bwd_tile_ok(112, tiles.BwdTile(quad_pair_rows=1, warps=4, block_m=32), False)  # needs d % 32 == 0
    # 4 queries per warp: dQ's warps split head_dim in two; without dq_from_k the K^T copy does not fit 96 KB
    assert not ve.bwd_tile_ok(128, tiles.BwdTile(quad_pair_rows=1, warps=8, block_m=32, kv_in_smem=True), True)
    assert ve.bwd_tile_ok(128, tiles.BwdTile(quad_pair_rows=1, warps=8, block_m=32, kv_in_smem=True, dq_from_k=True),
                          True)
    assert ve.bwd_tile_ok(96, tiles.BwdTile(quad_pair_rows=1, warps=8, block_m=32, kv_in_smem=True, dq_from_k=True),
                          True)  # 6 dQ warps in 2x2 quad-pairs of 16 columns
    assert not ve.bwd_tile_ok(96, tiles.BwdTile(quad_pair_rows=1, warps=4, block_m=32, kv_in_smem=True, dq_from_k=True),
                              True)  # 3 dQ warps of 32 rows: one quad-pair column, from the K tile needs 2 or 4
    assert ve.bwd_tile_ok(128, tiles.BwdTile(quad_pair_rows=1, warps=8, block_m=32), False)
    big = tiles.BwdTile(quad_pair_rows=1, warps=8, block_m=64, kv_in_smem=True)
    assert not ve.bwd_tile_ok(128, big, False)  # 107008 B > 96 KB
    for head_dim in tiles.SUPPORTED_HEAD_DIMS:  # every shipped tile passes (at the head_dim its kernels are built for)
        kernel_d = tiles.bwd_kernel_head_dim(head_dim, 70)
        tile = tiles.bwd_tile(kernel_d, 70)
        assert ve.bwd_tile_ok(kernel_d, tile, tile.dq_atomic)


def test_head_dim_256_searches_the_split_tile_space():
    """d256 (shipped tile split over 2 CTAs): the template's tiles with at least the shipped tile's 4 warps per SM,
    every one accepted by the kernel's asserts; none reaches 8 warps (K/V alone take 67.6 KB at 64 keys)."""
    shipped = tiles.bwd_tile(256, 70)
    found = ve.candidate_bwd_tiles(256)
    pairs = {(t, a) for t, a, _ in found}
    for tile, dq_atomic, source in found:
        assert tile != shipped and source.startswith("split space")
        assert ve.bwd_tile_ok(256, tile, dq_atomic) and tile.kv_in_smem
        assert ve.smem_warps_per_sm(bank_model.bwd_tile_smem_bytes(tile, 256, dq_atomic), tile.warps) == 4
        assert ve.bwd_accumulator_regs(256, tile) <= ve.MAX_ACCUMULATOR_REGS
    split = dict(kv_in_smem=True, dq_atomic=False, out_split=2)
    assert (tiles.BwdTile(quad_pair_rows=2, warps=4, block_m=16, **split), False) in pairs  # not lean
    assert (tiles.BwdTile(quad_pair_rows=1, warps=4, block_m=32, **split), False) in pairs
    space = ve.split_bwd_tiles(256)
    assert max(ve.smem_warps_per_sm(bank_model.bwd_tile_smem_bytes(t, 256, a), t.warps) for t, a, _ in space) == 4
    assert (shipped, False) in {(t, a) for t, a, _ in space}
    # the unsplit 2x2 tile (dK/dV 256 registers per lane) and K/V in registers (256 more) are not built
    unsplit = tiles.BwdTile(quad_pair_rows=2, warps=2, block_m=16, kv_in_smem=True, dq_atomic=False)
    assert ve.bwd_accumulator_regs(256, unsplit) == 256
    kv_in_registers = tiles.BwdTile(quad_pair_rows=1, warps=4, block_m=32, dq_atomic=False, out_split=2)
    assert ve.bwd_accumulator_regs(256, kv_in_registers) == 64 + 256
    assert all(t.out_split > 1 or t.quad_pair_rows == 1 for t, _, _ in space)


def test_candidate_dq_tiles_of_head_dim_256():
    shipped = tiles.dq_tile(256, 70)
    found = ve.candidate_dq_tiles(256)
    only_other = tiles.FwdTile(quad_pair_rows=1, m_tiles=1, warps=4, block_n=32, q_in_smem=True)
    assert [t for t, _ in found] == [only_other]  # the only other 4-warp fit
    assert ve.dq_tile_ok(256, shipped) and ve.dq_tile_smem(256, shipped) == 97280
    one_by_four = dict(quad_pair_rows=1, m_tiles=1, q_in_smem=True)
    assert not ve.dq_tile_ok(256, tiles.FwdTile(warps=4, block_n=16, **one_by_four))  # 2 key groups, 4 quad-pairs
    assert not ve.dq_tile_ok(256, tiles.FwdTile(warps=8, block_n=32, **one_by_four))  # 127,344 B > 96 KB
    assert ve.candidate_dq_tiles(128) is not None  # other head dims: the same rules, no crash


def _fake_kernel(variant, role, tensor, instructions, util, warps=4):
    view = {"model_tc_util": util, "tc_util": util, "tensor_cycles": tensor, "instructions": instructions}
    return ve.Kernel(variant, role, "test", report={"registers": 200, "spill_bytes": 0, "smem_bytes": 90000,
                                                    "warps_per_sm": warps},
                     factors=(1.0, 1.0), factor_source="measured", views={"body": view, "must": view})


def test_candidate_rows_pair_dkdv_tiles_with_every_dq_kernel():
    split2 = tiles.BwdTile(quad_pair_rows=2, warps=4, block_m=16, kv_in_smem=True, dq_atomic=False, out_split=2)
    only_other = tiles.FwdTile(quad_pair_rows=1, m_tiles=1, warps=4, block_n=32, q_in_smem=True)
    kernels = [
        _fake_kernel(tiles.bwd_variant(256, tiles.bwd_tile(256, 70), False, False, False), "shipped", 1536, 1374, 0.5),
        _fake_kernel(tiles.bwd_variant(256, split2, False, False, False), "candidate", 1536, 1223, 0.5),
        _fake_kernel(tiles.dq_variant(256, tiles.dq_tile(256, 70), False, False), "shipped", 1536, 1109, 0.5),
        _fake_kernel(tiles.dq_variant(256, only_other, False, False), "candidate",
                     1536, 1220, 0.5),
    ]
    intervals = (3.0, 5.4, 8.0)
    rows = ve.candidate_rows(kernels, intervals)
    assert len(rows) == 4 and [r["role"] for r in rows] == ["shipped", "candidate", "candidate", "candidate"]
    assert all(r["gemms"] == 9 for r in rows)
    assert rows[0]["faster_than_shipped_when"] == "" and rows[1]["faster_than_shipped_when"] != ""
    assert "qp1x4 m32 n32" in rows[1]["dq"] and rows[0]["dq"] == "dQ kernel"
    for r in rows:
        dkdv = next(k for k in kernels if k.name == r["variant"])
        dq = next(k for k in kernels if k.name == r["dq_variant"])
        expected = ve.deterministic_pass_rate(ve.kernel_rate(dkdv, "must", 5.4), ve.kernel_rate(dq, "must", 5.4), 2)
        assert r["pass_must_L5.4"] == pytest.approx(expected)
    # latency-bound at 4 warps: the denser candidate dK/dV kernel wins everywhere the latency binds
    assert rows[2]["pass_must_L5.4"] > rows[0]["pass_must_L5.4"]


def test_candidate_fwd_tiles_allow_three_ctas():
    for tile, source in ve.candidate_fwd_tiles(128):
        assert tile.min_blocks_per_sm == 3 and source
        smem = math.ceil(bank_model.fwd_tile_smem_bytes(tile, 128) / 256) * 256
        assert (96 * 1024) // smem >= 3


@pytest.mark.v100model
def test_bound_pipes_match_the_pipe_model():
    path = ve.find_sass_cost(None)
    assert tuple(ve.load_sass_cost(path).BOUND_PIPES) == ve.BOUND_PIPES


_SASS = """
        Function : _Zkernel
        .headerflags    @"EF_CUDA_SM70 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM70)"
        /*0000*/                   BAR.SYNC 0x0 ;
        /*0010*/                   @P1 BRA 0x0060 ;
        /*0020*/                   @!P2 BRA 0x0040 ;
        /*0030*/                   RED.E.ADD.F32.FTZ.RN.STRONG.GPU [R2], R3 ;
        /*0040*/                   RED.E.ADD.F32.FTZ.RN.STRONG.GPU [R2+0x4], R5 ;
        /*0050*/                   IADD3 R1, R1, 0x1, RZ ;
        /*0060*/                   EXIT ;
"""


def test_without_dq_guard_nops_only_the_branch_around_the_atomics():
    """The dQ warps' loop: the last predicated branch before the first RED that jumps past the last one becomes a
    NOP (not the branch inside the atomics), and nothing else changes."""
    out = ve.without_dq_guard(_SASS, "_Zkernel")
    assert "/*0010*/                   NOP ;" in out and "@P1 BRA" not in out
    assert out.replace("/*0010*/                   NOP ;", "/*0010*/                   @P1 BRA 0x0060 ;") == _SASS
    with pytest.raises(RuntimeError, match="no dQ atomics"):
        ve.without_dq_guard(_SASS.replace("RED.", "ATOMS."), "_Zkernel")
    with pytest.raises(RuntimeError, match="no branch around its dQ atomics"):
        ve.without_dq_guard(_SASS.replace("@P1 BRA 0x0060", "@P1 BRA 0x0040"), "_Zkernel")
    with pytest.raises(RuntimeError, match="no function _Zother"):
        ve.without_dq_guard(_SASS, "_Zother")


def test_two_warp_classes_share_the_pipes_and_the_slower_warps_set_the_count():
    dq = ({"tensor": 1408.0, "issue": 1422.0}, 1422.0, {"HMMA": 704.0, "RED.32": 16.0}, 704.0)
    rest = ({"tensor": 1024.0, "issue": 1097.0}, 1097.0, {"HMMA": 512.0}, 512.0)
    cycles, n, detail, hmma = ve.combine_warp_classes(dq, rest, 2 / 3)
    assert cycles == pytest.approx({"tensor": 1280.0, "issue": (2 * 1422 + 1097) / 3})
    assert n == 1422.0 and hmma == pytest.approx(640.0)
    assert detail == pytest.approx({"HMMA": 640.0, "RED.32": 32 / 3})
    less = ve.view_minus(dq, rest)
    assert less == ({"tensor": 384.0, "issue": 325.0}, 325.0, {"HMMA": 192.0, "RED.32": 16.0}, 192.0)


def test_dq_warp_fraction_is_the_kernels_kDqWarps_share():
    twelve = tiles.bwd_variant(128, tiles.bwd_tile(128, 70), False, False, True)
    assert twelve.meta["tile"].warps == 12 and ve.dq_warp_fraction(twelve) == pytest.approx(8 / 12)
    eight = tiles.BwdTile(quad_pair_rows=1, warps=8, block_m=64)  # the 8-warp 1x4 tile: every warp adds dQ
    assert ve.dq_warp_fraction(tiles.bwd_variant(64, eight, False, False, True)) == 1.0
    assert ve.dq_warp_fraction(tiles.bwd_variant(128, tiles.bwd_tile(128, 70), False, False, False)) == 1.0
    assert ve.dq_warp_fraction(tiles.fwd_variant(128, tiles.fwd_tile(128, False, 70), False, False)) == 1.0
