"""lab/cutlass_sm70_sass.py on CPU: the PTX retargeting, the constants read from PTX, the kernel shapes from
mangled names, the GEMM trip schedule and its FLOP check, the matching of trips to a loop nest (synthetic SASS through
shared/tools/v100model/sass_cost.py) and the comparison with v100_estimate.CUTLASS_SM70. Building the kernels needs
nvcc, CUDA 12 ptxas/cuobjdump and CUTLASS: not in CI (the script's docstring has the command)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "lab" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


cs = _load("cutlass_sm70_sass")
ve = _load("v100_estimate")

FWD = ("_Z29attention_kernel_batched_implI15AttentionKernelIN7cutlass6half_tENS1_4arch4Sm70ELb1ELi32ELi128ELi65536ELb1E"
       "Lb1E18DefaultToBatchHookEEvNT_6ParamsE")
BWD = ("_Z38attention_kernel_backward_batched_implI23AttentionBackwardKernelIN7cutlass4arch4Sm70ENS1_6half_tELb1ELb0"
       "ELb0ELi128ELi64ELi65536ELb0ELb1EEEvNT_6ParamsE")


def test_retarget_ptx_sets_sm70_and_drops_the_l2_hints():
    ptx = ("//\n.version 9.0\n.target sm_75\n.address_size 64\n"
           "  @p ld.global.L2::128B.v4.u32 {%r1, %r2, %r3, %r4}, [%rd1];\n  ld.global.v2.u32 {%r5, %r6}, [%rd2];\n")
    out = cs.retarget_ptx(ptx)
    assert ".version 8.8\n.target sm_70\n" in out
    assert "L2::" not in out
    assert "@p ld.global.v4.u32 {%r1, %r2, %r3, %r4}, [%rd1];" in out
    assert out.count("\n") == ptx.count("\n")


@pytest.mark.parametrize("ptx", [".version 9.0\n.target sm_80\n", ".target sm_75\n", ""])
def test_retarget_ptx_refuses_other_ptx(ptx):
    with pytest.raises(ValueError, match="compute_75"):
        cs.retarget_ptx(ptx)


def test_parse_meta_ptx_reads_little_endian_bytes():
    # nvcc drops trailing zero bytes of the initialiser: {33920, 128} and {50176, 256}
    assert cs.parse_meta_ptx(".global .align 8 .b8 sm70_sass_meta[16] = {128, 132, 0, 0, 0, 0, 0, 0, 128};") == \
        (33920, 128)
    assert cs.parse_meta_ptx(".global .align 8 .b8 sm70_sass_meta[16] = {0, 196, 0, 0, 0, 0, 0, 0, 0, 1};") == \
        (50176, 256)
    with pytest.raises(ValueError, match="sm70_sass_meta"):
        cs.parse_meta_ptx(".global .b8 other[16] = {1};")


def test_kernel_shape_from_mangled_names():
    assert cs.kernel_shape(FWD) == ("fwd", 32, 128, 65536)
    assert cs.kernel_shape(BWD) == ("bwd", 128, 64, 65536)
    with pytest.raises(ValueError, match="not an example-41"):
        cs.kernel_shape("_Z6kernelILi1ELi2ELi3EEvv")


def test_gemm_schedule_has_column_loops_only_where_kmaxk_spans_tiles():
    assert cs.gemm_schedule("fwd", 64, 64, 64, 64) == [(2, None), (2, None)]
    assert cs.gemm_schedule("fwd", 32, 128, 128, 128) == [(4, None), (4, None)]
    assert cs.gemm_schedule("fwd", 32, 128, 65536, 128) == [(4, None), (4, 1)]
    assert cs.gemm_schedule("fwd", 32, 128, 65536, 256) == [(8, None), (4, 2)]
    assert cs.gemm_schedule("bwd", 64, 64, 64, 64) == [(2, None)] * 5
    # K Q^T, dV (N tiles of I), dP, dQ (N tiles of J), dK (N tiles of I)
    assert cs.gemm_schedule("bwd", 128, 64, 128, 128) == [(4, None), (4, None), (4, None), (2, 2), (4, None)]
    assert cs.gemm_schedule("bwd", 128, 64, 65536, 256) == [(8, None), (4, 2), (8, None), (2, 4), (4, 2)]
    with pytest.raises(ValueError, match="head_dim 256"):
        cs.gemm_schedule("fwd", 32, 128, 128, 256)
    with pytest.raises(ValueError, match="kind"):
        cs.gemm_schedule("dq", 32, 128, 128, 128)


@pytest.mark.parametrize("kind, bq, bk, max_k, d, threads", [
    ("fwd", 64, 64, 64, 64, 128), ("fwd", 32, 128, 128, 128, 128), ("fwd", 32, 128, 65536, 256, 128),
    ("bwd", 64, 64, 64, 64, 128), ("bwd", 128, 64, 128, 128, 256), ("bwd", 128, 64, 65536, 256, 256)])
def test_schedule_at_128_hmma_per_trip_gives_the_flops(kind, bq, bk, max_k, d, threads):
    """Every GEMM k-loop trip of these kernels is 128 HMMA per warp (32x32 warp tiles, k 32): the schedule's trips
    then cover exactly the FLOPs, which is what the script checks against sass_cost's count."""
    hmma = sum(128 * k * (c or 1) for k, c in cs.gemm_schedule(kind, bq, bk, max_k, d))
    assert hmma == cs.expected_hmma(kind, bq, bk, d, threads)


# --- trips matched to a loop nest (synthetic SASS) ------------------------------------------------------------------

def _sass(lines: list[str]) -> str:
    out = ["\tcode for sm_70", "\t\tFunction : kern"]
    out += [f"        /*{16 * i:04x}*/                   {text} ;" for i, text in enumerate(lines)]
    return "\n".join(out) + "\n"


def _nest() -> tuple[str, dict[str, int]]:
    """main loop { k-loop A (HMMA); column loop { k-loop B (HMMA) }; non-HMMA loop }; addresses by name."""
    lines, at = [], {}

    def put(name, text):
        if name:
            at[name] = 16 * len(lines)
        lines.append(text)

    put(None, "MOV R1, R2")
    put("main", "IADD3 R3, R3, R4, RZ")
    put("a", "HMMA.884.F32.F32.STEP0 R8, R10, R12, R8")
    put(None, "ISETP.NE.AND P0, PT, R5, R6, PT")
    put(None, "@P0 BRA {a}")
    put("col", "IADD3 R7, R7, R4, RZ")
    put("b", "HMMA.884.F32.F32.STEP0 R8, R10, R12, R8")
    put(None, "ISETP.NE.AND P1, PT, R5, R9, PT")
    put(None, "@P1 BRA {b}")
    put(None, "ISETP.NE.AND P2, PT, R7, R9, PT")
    put(None, "@P2 BRA {col}")
    put("c", "IADD3 R11, R11, R4, RZ")
    put(None, "ISETP.NE.AND P3, PT, R11, R9, PT")
    put(None, "@P3 BRA {c}")
    put(None, "ISETP.NE.AND P4, PT, R3, R9, PT")
    put(None, "@P4 BRA {main}")
    put(None, "EXIT")
    text = _sass([line.format(**{k: f"0x{v:x}" for k, v in at.items()}) for line in lines])
    return text, at


@pytest.fixture(scope="module")
def sass_cost():
    return ve.load_sass_cost(ve.find_sass_cost(None))


@pytest.mark.v100model
def test_loop_trips_matches_k_loops_and_column_loops(sass_cost):
    text, at = _nest()
    (name, instrs), = sass_cost.parse_sass_text(text).items()
    trips = cs.loop_trips(sass_cost, name, instrs, [(8, None), (4, 2)])
    assert trips == {at["a"]: 8, at["b"]: 4, at["col"]: 2}
    assert cs.must_view_hmma(sass_cost, name, instrs, trips) == 8 + 4 * 2


@pytest.mark.parametrize("schedule, message", [
    ([(8, None), (4, None)], "column loop around it, none expected"),
    ([(8, 2), (4, 2)], "no column loop around it, one expected"),
    ([(8, None), (4, 2), (2, None)], "2 innermost HMMA loops"),
])
@pytest.mark.v100model
def test_loop_trips_refuses_a_nest_that_does_not_fit(sass_cost, schedule, message):
    text, _ = _nest()
    (name, instrs), = sass_cost.parse_sass_text(text).items()
    with pytest.raises(ValueError, match=message):
        cs.loop_trips(sass_cost, name, instrs, schedule)


# --- rows ------------------------------------------------------------------------------------------------------------

JS = {"regs": 164, "spill_st": 0, "spill_ld": 0, "ctas_per_sm": 2, "counts": {"hmma": 2048.0},
      "instr_per_iter": 7244.0, "must_instr_per_iter": 5525.0, "tc_util": 0.3884, "tc_util_must": 0.5853,
      "bound_pipe": "lsu_data"}


def test_table_entry_and_compare_with_cutlass_sm70():
    entry = cs.table_entry(cs.row_label("fwd", 32, 128, 65536), "fwd", (32, 128), 256, 128, JS)
    table = [e for e in ve.CUTLASS_SM70 if e["kernel"] == entry["kernel"] and e["head_dim"] == 256]
    assert len(table) == 1 and cs.compare(entry, list(ve.CUTLASS_SM70)) == ""
    assert cs.compare(dict(entry, instr_must=5600), list(ve.CUTLASS_SM70)) == "instr_must 5600 (table 5525)"
    assert cs.compare(dict(entry, tc_util_body=0.40), list(ve.CUTLASS_SM70)).startswith("tc_util_body 0.4")
    assert cs.compare(dict(entry, head_dim=192), list(ve.CUTLASS_SM70)) is None
    assert cs.row_label("bwd", 64, 64, 64) == "CUTLASS bwd 64x64 kMaxK=64"


def test_every_cutlass_sm70_row_is_a_row_the_script_builds():
    """CUTLASS_SM70 holds exactly the script's ROWS (instance, head_dim): a row added to one needs the other."""
    labels = {0: "CUTLASS fwd 64x64 kMaxK=64", 1: "CUTLASS fwd 32x128 kMaxK=128", 2: "CUTLASS fwd 32x128 kMaxK=inf",
              4: "CUTLASS bwd 64x64 kMaxK=64", 6: "CUTLASS bwd 128x64 kMaxK=128", 7: "CUTLASS bwd 128x64 kMaxK=inf"}
    assert sorted((labels[i], d) for i, d in cs.ROWS) == sorted((e["kernel"], e["head_dim"]) for e in ve.CUTLASS_SM70)
