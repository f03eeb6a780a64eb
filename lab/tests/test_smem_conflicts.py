"""lab/smem_conflicts.py (Nsight Compute bank conflicts of the sm_70 tiles) and lab/call_matrix.py, on CPU:
the launch plan, the ncu raw-page CSV parsing, the table and verdicts, the static SASS walk. The ncu run itself
needs a GPU (the gpu-marked test runs the workload alone)."""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from volta_train.kernels import tiles

import call_matrix
from probes import PROBE_VARIANT

REPO = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("smem_conflicts", REPO / "lab" / "smem_conflicts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sc = _load()


def _key(variant):
    return variant.name, variant.name_expressions


# --- the calls and the plan ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("table, arch", [("sm70", 90), ("sm70", 70), ("default", 90), ("default", 80), ("default", 70)])
def test_table_calls_launch_exactly_the_shipped_variants(table, arch):
    table_arch = 70 if table == "sm70" else arch
    shipped = {_key(v) for v in tiles.shipped_fwd_variants(table_arch) + tiles.shipped_bwd_variants(table_arch)
               + tiles.shipped_preprocess_variants(table_arch)}
    for unique in (False, True):
        calls = call_matrix.table_calls(table, arch, unique=unique)
        assert {_key(v) for call in calls for v in call.launches} == shipped
        names = [call.name for call in calls]
        assert len(names) == len(set(names)) and all(n.replace("_", "").isalnum() for n in names)
    # unique: no call is there for nothing
    seen = set()
    for call in call_matrix.table_calls(table, arch, unique=True):
        assert {_key(v) for v in call.launches} - seen, call.name
        seen |= {_key(v) for v in call.launches}


def test_table_calls_overrides_and_backward_launches():
    sm70 = call_matrix.table_calls("sm70", 90, head_dims=(64,), causal=(False,), dropout=(False,), softcap=(False,))
    default = call_matrix.table_calls("default", 90, head_dims=(64,), causal=(False,), dropout=(False,),
                                      softcap=(False,))
    assert [c.pass_name for c in sm70] == ["fwd", "fwd", "bwd", "bwd", "bwd", "bwd"]
    capped = call_matrix.table_calls("sm70", 90, head_dims=(64,), causal=(False,), dropout=(False,))
    assert [c.softcap for c in capped] == [False] * 6 + [True] * 6
    assert all("_softcap" in v.name for c in capped[6:] for v in c.launches if v.meta["pass"] != "preprocess")
    assert all(c.overrides == {} for c in default)
    assert sm70[0].overrides == {"tile": tiles.FWD_TILES_SM70[64]}
    det = [c for c in sm70 if c.pass_name == "bwd" and c.deterministic]
    atomic = [c for c in sm70 if c.pass_name == "bwd" and not c.deterministic]
    assert all(c.overrides == {"tile": tiles.BWD_TILES_SM70[64], "dq_tile": tiles.DQ_TILES_SM70[64]} for c in det)
    # every backward starts with its preprocess (D and dQ's sums zeroed), then the dK/dV kernel, then any dQ kernel
    bwd = det + atomic
    assert all(c.launches[0] == tiles.preprocess_variant(64) for c in bwd)
    assert all(len(c.launches) == 3 and c.launches[2].meta["pass"] == "bwd_dq" for c in det)
    assert all(len(c.launches) == 2 and "_dqatomic" in c.launches[1].name for c in atomic)
    # a tile without the atomic path runs the dQ kernel either way
    no_atomic = call_matrix.table_calls("sm70", 90, head_dims=(16,), causal=(False,), dropout=(False,), passes=("bwd",))
    assert all(len(c.launches) == 3 for c in no_atomic)
    with pytest.raises(ValueError, match="table 'v100'; accepted: default, sm70"):
        call_matrix.table_calls("v100", 90)


def test_plan_launches_every_sm70_variant_and_tile_once_plus_a_causal_forward_per_head_dim():
    plan = sc.launch_plan(90)
    assert [p.index for p in plan] == list(range(len(plan)))
    assert plan[0].call == sc.PROBE_CALL and plan[0].variant is PROBE_VARIANT
    assert plan[0].function == "volta_probe_mma_kernel"
    # every variant without soft-capping (which changes no shared-memory access)
    shipped = {_key(v) for v in tiles.shipped_fwd_variants(70, softcap=(False,))
               + tiles.shipped_bwd_variants(70, softcap=(False,)) + tiles.shipped_preprocess_variants(70)}
    launched = [_key(p.variant) for p in plan[1:]]
    assert set(launched) == shipped
    # each variant once, but for the preprocess (before every backward), the dQ kernel (after every deterministic
    # backward) and the causal forwards
    repeated = {k for k in launched if launched.count(k) > 1}
    assert all(k[0].startswith(("bwd_preprocess_", "bwd_dq_", "fwd_")) for k in repeated)
    calls = sc.plan_calls(90)
    names = [c.name for c in calls]
    assert len(names) == len(set(names))
    causal = [c for c in calls if c.causal]
    assert sorted(c.head_dim for c in causal) == list(tiles.SUPPORTED_HEAD_DIMS)
    assert all(c.pass_name == "fwd" and c.accum == "fp32" and not c.dropout for c in causal)
    assert all(not c.causal for c in calls if c.pass_name == "bwd")
    # every tile of the sm_70 tables runs (compared as tiles, not only as variant names)
    used = {(c.pass_name, c.head_dim, c.tile) for c in calls} | {("dq", c.head_dim, c.dq_tile) for c in calls
                                                                  if c.pass_name == "bwd"}
    for head_dim in tiles.SUPPORTED_HEAD_DIMS:
        assert ("fwd", head_dim, tiles.fwd_tile(head_dim, False, 70)) in used
        kernel_d = tiles.bwd_kernel_head_dim(head_dim, 70)  # d112's backward runs the d128 kernels (padded)
        assert ("dq", kernel_d, tiles.dq_tile(kernel_d, 70)) in used
        for accum_f16 in (False, True):
            assert ("bwd", kernel_d, tiles.bwd_tile(kernel_d, 70, accum_f16)) in used
    assert set(tiles.FWD_TILES_SM70.values()) <= {t for p, _, t in used if p == "fwd"}
    assert set(tiles.BWD_TILES_SM70.values()) <= {t for p, _, t in used if p == "bwd"}
    assert set(tiles.DQ_TILES_SM70.values()) <= {t for p, _, t in used if p == "dq"}
    # the kernels' function names, as ncu's filter sees them
    assert {p.function for p in plan[1:]} == {"flash_fwd_kernel", "flash_bwd_preprocess_kernel", "flash_bwd_dkdv_kernel",
                                              "flash_bwd_dq_kernel"}
    quick = sc.launch_plan(90, quick=True)
    assert {p.variant.meta["head_dim"] for p in quick[1:]} == {32, 96} and len(quick) < len(plan)


def test_function_name():
    assert sc.function_name("flash_fwd_kernel<FwdKernelTraits<64, 2>>") == "flash_fwd_kernel"
    name = "void flash_bwd_dq_kernel<FwdKernelTraits<64, 2, 1>>(BackwardParams)"
    assert sc.function_name(name) == "flash_bwd_dq_kernel"
    assert sc.function_name("volta_probe_mma_kernel") == "volta_probe_mma_kernel"


# --- ncu's raw-page CSV -------------------------------------------------------------------------------------------

NVTX = "thread Domain:Push/Pop_Range:PL_Type:PL_Value:CLR_Type:Color:Msg_Type:Msg"
START_STOP = "Id:Domain:Start/Stop_Range:PL_Type:PL_Value:CLR_Type:Color:Msg_Type:Msg"
METRIC_NAMES = sorted(sc.HW_METRICS.values())


def _raw_csv(launches, metric_names=METRIC_NAMES, prefix="==PROF== Connected to process 4242 (/usr/bin/python3.12)\n"):
    """What `ncu --csv --page raw` prints (Nsight Compute 2025): header, units row, one quoted row per launch."""
    header = ["ID", "Process ID", "Process Name", "Host Name", NVTX, START_STOP, "Kernel Name", "Context", "Stream",
              "Block Size", "Grid Size", "Device", "CC", *metric_names]
    units = [""] * 13 + ["" if "wavefronts" in m or "conflicts" in m else ("request" if "requests" in m else "inst")
                         for m in metric_names]
    buffer = io.StringIO()
    writer = csv.writer(buffer, quoting=csv.QUOTE_ALL, lineterminator="\n")
    writer.writerow(header)
    writer.writerow(units)
    for index, (kernel, nvtx, values) in enumerate(launches):
        ranges = f'1  "<default domain>:{nvtx}:none:none:none:none:none:none"' if nvtx else ""
        writer.writerow([str(index), "4242", "python3.12", "127.0.0.1", ranges, "", kernel, "1", "7", "(128, 1, 1)",
                         "(16, 8, 1)", "0", "9.0", *(values.get(m, "n/a") for m in metric_names)])
    return prefix + buffer.getvalue()


def _values(ld=(1000, 4000, 0), st=(200, 800, 0), inst=None):
    """ld/st = (requests, wavefronts, conflicts), formatted with thousands separators as ncu does."""
    result = {}
    for op, (requests, wavefronts, conflicts) in (("ld", ld), ("st", st)):
        result[sc.HW_METRICS[f"{op}_requests"]] = f"{requests:,}"
        result[sc.HW_METRICS[f"{op}_wavefronts"]] = f"{wavefronts:,}"
        result[sc.HW_METRICS[f"{op}_conflicts"]] = f"{conflicts:,}"
        result[sc.HW_METRICS[f"{op}_instructions"]] = f"{(inst or {}).get(op, requests):,}"
    return result


FWD = "void flash_fwd_kernel<FwdKernelTraits<64, 2, 1, 4, 32, false, false, 1, 1, false, false>>(AttentionParams)"
DKDV = "void flash_bwd_dkdv_kernel<BwdKernelTraits<64, 1, 8, 64, false, false, false, false, 1, 1>>(BackwardParams)"
DQ = "void flash_bwd_dq_kernel<FwdKernelTraits<64, 2, 1, 4, 32, false, false, 1, 1, false, false>>(BackwardParams)"
PRE = "void flash_bwd_preprocess_kernel<64>(BackwardParams, int)"
PROBE_NAME = "void volta_probe_mma_kernel<2>(ProbeParams)"


def _plan():
    names = [("baseline_probe_mma", "volta_probe_mma_kernel", "probe_mma"),
             ("sm70_fwd_d64_full_fp32", "flash_fwd_kernel", "fwd_d64"),
             ("sm70_bwd_d64_full_fp32_det", "flash_bwd_dkdv_kernel", "bwd_dkdv_d64"),
             ("sm70_bwd_d64_full_fp32_det", "flash_bwd_dq_kernel", "bwd_dq_d64")]
    return [sc.PlannedLaunch(i, call, function, SimpleNamespace(name=variant))
            for i, (call, function, variant) in enumerate(names)]


def test_parse_raw_csv_reads_every_launch_with_its_nvtx_range_and_numbers():
    text = _raw_csv([(PROBE_NAME, "baseline_probe_mma", _values((2112, 8448, 0), (4224, 8448, 0))),
                     (FWD, "sm70_fwd_d64_full_fp32", _values((1_234_567, 4_938_268, 0), (9_000, 36_000, 1_800))),
                     (DKDV, "sm70_bwd_d64_full_fp32_det", {**_values(), sc.HW_METRICS["ld_conflicts"]: "n/a"}),
                     (DQ, None, _values())])
    text += "==PROF== Disconnected from process 4242\n"
    rows = sc.parse_raw_csv(text)
    assert [r["id"] for r in rows] == [0, 1, 2, 3]
    assert [r["function"] for r in rows] == ["volta_probe_mma_kernel", "flash_fwd_kernel", "flash_bwd_dkdv_kernel",
                                             "flash_bwd_dq_kernel"]
    assert [r["nvtx"] for r in rows] == ["baseline_probe_mma", "sm70_fwd_d64_full_fp32", "sm70_bwd_d64_full_fp32_det",
                                         None]
    assert rows[1]["kernel"] == FWD
    assert rows[1]["metrics"][sc.HW_METRICS["ld_requests"]] == 1_234_567.0
    assert rows[1]["metrics"][sc.HW_METRICS["st_conflicts"]] == 1_800.0
    assert rows[2]["metrics"][sc.HW_METRICS["ld_conflicts"]] is None  # n/a
    assert set(rows[0]["metrics"]) == set(METRIC_NAMES)
    assert sc.match_plan(_plan(), rows) == []


def test_parse_raw_csv_without_a_header_says_so():
    with pytest.raises(ValueError, match="no ncu raw-page CSV header"):
        sc.parse_raw_csv("==PROF== Connected to process 1\n==ERROR== the profiler failed\n")


def test_match_plan_names_a_missing_launch_a_wrong_kernel_and_a_wrong_range():
    rows = sc.parse_raw_csv(_raw_csv([(PROBE_NAME, "baseline_probe_mma", _values()),
                                      (DKDV, "sm70_fwd_d64_full_fp32", _values()),
                                      (DKDV, "sm70_fwd_d64_full_fp32", _values())]))
    problems = sc.match_plan(_plan(), rows)
    assert problems[0] == "ncu profiled 3 launches, the plan has 4"
    assert any("launch 1: ncu saw flash_bwd_dkdv_kernel, the plan has flash_fwd_kernel" in p for p in problems)
    assert any("launch 2: NVTX range 'sm70_fwd_d64_full_fp32'" in p for p in problems)


def test_table_rows_compute_wavefronts_per_request_and_per_ideal_wavefront_and_the_verdict():
    launches = [(PROBE_NAME, "baseline_probe_mma", _values((2112, 8448, 0), (4224, 8448, 0))),
                # 128-bit loads without conflicts: 4 wavefronts per request, 1.0 per ideal wavefront
                (FWD, "sm70_fwd_d64_full_fp32", _values((1000, 4000, 0), (100, 400, 0))),
                # stores 1.25 wavefronts per ideal one: over the goal
                (DKDV, "sm70_bwd_d64_full_fp32_det", _values((1000, 4100, 100), (100, 500, 100))),
                # no stores at all; ld conflicts unknown
                (DQ, "sm70_bwd_d64_full_fp32_det", {**_values((10, 10, 0), (0, 0, 0)),
                                                     sc.HW_METRICS["ld_conflicts"]: "n/a"})]
    rows = sc.table_rows(_plan(), sc.parse_raw_csv(_raw_csv(launches)), sc.HW_METRICS)
    fwd, dkdv, dq = rows[1], rows[2], rows[3]
    assert fwd["ld_wavefronts_per_request"] == 4.0 and fwd["ld_wavefronts_per_ideal"] == 1.0
    assert fwd["verdict"] == "ok" and fwd["variant"] == "fwd_d64" and fwd["call"] == "sm70_fwd_d64_full_fp32"
    assert dkdv["ld_wavefronts_per_ideal"] == pytest.approx(4100 / 4000)
    assert dkdv["st_wavefronts_per_ideal"] == pytest.approx(1.25)
    assert dkdv["verdict"] == "over 1.05"
    assert dq["st_wavefronts_per_ideal"] == 1.0 and dq["st_wavefronts_per_request"] is None
    assert dq["ld_wavefronts_per_ideal"] is None and dq["verdict"] == "n/a"
    assert sc.table_rows(_plan(), sc.parse_raw_csv(_raw_csv(launches)), sc.HW_METRICS, goal=1.3)[2]["verdict"] == "ok"
    # without the bank-conflict counter, the instrumented ld+st ideal-wavefront ratio decides
    metrics = {**sc.HW_METRICS, **sc.SASS_METRICS}
    sass = {metrics["sass_wavefronts"]: "4,400", metrics["sass_wavefronts_ideal"]: "4,000",
            metrics["ld_conflicts"]: "n/a"}
    rows_sass = sc.table_rows(_plan(), sc.parse_raw_csv(_raw_csv([(PROBE_NAME, None, _values()),
                                                                  (FWD, None, {**_values(), **sass})],
                                                                 sorted(metrics.values()))), metrics)
    assert rows_sass[1]["sass_wavefronts_per_ideal"] == pytest.approx(1.1)
    assert rows_sass[1]["verdict"] == "over 1.05 (sass)"
    # the counter over the goal, the instrumented count (this ncu without its ideal: the counters' ideal stands in)
    # conflict-free: the counter's excess, not an address conflict; instrumented over it too: over
    only_sass = {**sc.HW_METRICS, "sass_wavefronts": sc.SASS_METRICS["sass_wavefronts"]}
    for instrumented, verdict in (("4,500", "ok (sass; counter over)"), ("4,700", "over 1.05")):
        values = {**_values((1000, 4100, 100), (100, 500, 100)), only_sass["sass_wavefronts"]: instrumented}
        row = sc.table_rows(_plan(), sc.parse_raw_csv(_raw_csv([(PROBE_NAME, None, _values()), (FWD, None, values)],
                                                               sorted(only_sass.values()))), only_sass)[1]
        assert row["sass_wavefronts_per_ideal"] == pytest.approx(int(instrumented.replace(",", "")) / 4400)
        assert row["verdict"] == verdict
    text = sc.markdown(rows, {}, {"verdict": "ok", "warps": 1056, "measured": {}, "expected": {}}, {"device": "H100"})
    assert "| 2 | sm70_bwd_d64_full_fp32_det | bwd_dkdv_d64 | 1,000 | 1,000 | 4,100 | 4.10 | 100 | 1.025 |" in text
    assert "over 1.05" in text and "instrumented wf/ideal" not in text
    assert rows[0]["verdict"] == "baseline"  # the probe: counted instructions only
    ok, line = sc.summary(rows, {}, {"verdict": "ok"}, [])
    assert not ok and "1/3 launches within the goal" in line
    ok, line = sc.summary(rows[:2], {"fwd_d64": {"subroutine_shared": 0}}, {"verdict": "ok"}, [])
    assert ok and line == "smem_conflicts: OK (1/1 launches within the goal; probe baseline ok)"
    ok, line = sc.summary(rows[:2], {"fwd_d64": {"subroutine_shared": 2}}, {"verdict": "ok"}, [])
    assert not ok and "1 variants with shared instructions in subroutines" in line


def test_choose_metrics_keeps_the_listed_ones_and_names_the_missing():
    listing = ("Device NVIDIA H100 80GB HBM3 (GH100)\n" + "-" * 60 + " " + "-" * 60 + "\n"
               "Metric Name                                 Metric Description\n" + "-" * 60 + "\n"
               + "".join(f"{m.rsplit('.', 1)[0]}   # of something\n" for m in sc.HW_METRICS.values()
                         if "conflicts" not in m)
               + "smsp__sass_l1tex_pipe_lsu_wavefronts_mem_shared   # of shared memory wavefronts\n")
    listed = sc.available_metrics(listing)
    assert "l1tex__t_requests_pipe_lsu_mem_shared_op_ld" in listed and "Device" not in listed
    kept, missing = sc.choose_metrics({**sc.HW_METRICS, **sc.SASS_METRICS}, listed)
    assert sorted(missing) == sorted([sc.HW_METRICS["ld_conflicts"], sc.HW_METRICS["st_conflicts"],
                                      sc.SASS_METRICS["sass_wavefronts_ideal"]])
    assert kept["sass_wavefronts"] == sc.SASS_METRICS["sass_wavefronts"]
    assert sc.choose_metrics(sc.HW_METRICS, set()) == (sc.HW_METRICS, [])  # unreadable listing: ask for all


def test_without_ncu_the_driver_says_where_it_looked(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(sc, "find_tool", lambda name, env: None)
    monkeypatch.setattr(sys, "argv", ["smem_conflicts.py", "--out", str(tmp_path)])
    assert sc.main() == 2
    assert "ncu was not found (PATH, /usr/local/cuda/bin or $NCU)" in capsys.readouterr().err


FAKE_NCU = """
import os, sys
args = sys.argv[1:]
if "--query-metrics" in args:
    print("Metric Name   Metric Description")
    print("\\n".join(os.environ["FAKE_NCU_METRICS"].split(",")))
elif "--version" in args:
    print("NVIDIA (R) Nsight Compute Command Line Profiler\\nVersion 2025.3.1.0 (build 36398880) (public-release)")
elif "--import" in args:
    sys.stdout.write(open(os.environ["FAKE_NCU_CSV"]).read())
else:
    open(os.environ["FAKE_NCU_ARGS"], "w").write("\\n".join(args))
    print("==PROF== Disconnected from process 1")
"""


def test_driver_runs_ncu_once_reads_the_report_back_and_writes_the_table(monkeypatch, tmp_path, capsys):
    """The whole driver on CPU: a fake ncu (listing, profiling run, --import of a raw-page CSV), no cuobjdump."""
    from volta_train.kernels import nvrtc, precompile

    plan = sc.launch_plan(90, quick=True)
    kernels = {"flash_fwd_kernel": FWD, "flash_bwd_preprocess_kernel": PRE, "flash_bwd_dkdv_kernel": DKDV,
               "flash_bwd_dq_kernel": DQ,
               "volta_probe_mma_kernel": PROBE_NAME}
    conflicted = plan[-1].index  # a causal forward with store conflicts
    launches = [(kernels[p.function], p.call, _values(st=(100, 500, 100) if p.index == conflicted else (100, 400, 0)))
                for p in plan]
    (tmp_path / "raw.csv").write_text(_raw_csv(launches))
    ncu = tmp_path / "ncu"
    ncu.write_text(f"#!{sys.executable}\n{FAKE_NCU}")
    ncu.chmod(0o755)
    monkeypatch.setenv("FAKE_NCU_CSV", str(tmp_path / "raw.csv"))
    monkeypatch.setenv("FAKE_NCU_ARGS", str(tmp_path / "args.txt"))
    monkeypatch.setenv("FAKE_NCU_METRICS", ",".join(m.rsplit(".", 1)[0] for m in sc.HW_METRICS.values()))
    monkeypatch.setattr(sc, "find_tool", lambda name, env: str(ncu) if name == "ncu" else None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake H100")
    monkeypatch.setattr(precompile, "compile_variants", lambda variants, arch, threads=16: len(list(variants)))
    monkeypatch.setattr(nvrtc, "find_nvrtc", lambda arch: SimpleNamespace(version_string="13.0"))
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["smem_conflicts.py", "--out", str(out), "--quick"])
    assert sc.main() == 1  # the conflicted launch, and no static SASS check (no cuobjdump) for the probe
    args = (tmp_path / "args.txt").read_text().split("\n")
    assert args[args.index("--kernel-name") + 1] == sc.KERNEL_REGEX and "--nvtx" in args
    assert sorted(args[args.index("--metrics") + 1].split(",")) == sorted(sc.HW_METRICS.values())
    assert args[args.index("--cache-control") + 1] == "none" and args[args.index("--clock-control") + 1] == "none"
    workload = args.index("--workload")
    assert args[workload - 2:workload] == [sys.executable, str(REPO / "lab" / "smem_conflicts.py")]
    assert args[workload + 1:] == ["--batch", "1", "--heads", "8", "--seqlen", "1024", "--quick"]
    report = json.loads((out / "smem_conflicts.json").read_text())
    assert report["problems"] == [] and len(report["rows"]) == len(plan)
    assert [r["verdict"] for r in report["rows"]].count("ok") == len(plan) - 2  # the conflicted one, the probe
    assert report["rows"][conflicted]["st_wavefronts_per_ideal"] == pytest.approx(1.25)
    assert report["probe"]["verdict"] == "n/a" and report["meta"]["ncu"].startswith("Version 2025.3.1")
    text = (out / "smem_conflicts.md").read_text()
    assert f"{len(plan) - 2}/{len(plan) - 1} launches within the goal" in text and "probe baseline n/a" in text
    assert "static SASS check skipped" in capsys.readouterr().out


# --- static SASS ------------------------------------------------------------------------------------------------

SASS = """
\tcode for sm_90
\t\tFunction : _Z6kernelv
\t.headerflags\t@"EF_CUDA_TEXMODE_UNIFIED EF_CUDA_64BIT_ADDRESS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                 /* 0x00000a00ff017b82 */
                                                                          /* 0x000e220000000800 */
        /*0010*/               @P0 EXIT ;                                 /* 0x000000000000094d */
                                                                          /* 0x000fea0003800000 */
        /*0020*/                   STS.128 [R0], R4 ;                     /* 0x0000000400007388 */
                                                                          /* 0x000fe80000000c00 */
        /*0030*/                   BRA.DIV UR4, 0x1c0 ;                   /* 0x0000000604007947 */
                                                                          /* 0x000fea000b800000 */
        /*0040*/                   LDS.128 R8, [R2] ;                     /* 0x0000000002087984 */
                                                                          /* 0x000e280000000c00 */
        /*0050*/                   MOV R14, 0x70 ;                        /* 0x0000007000e7802 */
                                                                          /* 0x000fe40000000f00 */
        /*0060*/                   CALL.REL.NOINC 0x100 ;                 /* 0x0000000000247944 */
                                                                          /* 0x000fea0003c00000 */
        /*0070*/               @P1 BRA P2, 0x40 ;                         /* 0x0000000000f01947 */
                                                                          /* 0x000fea0003800000 */
        /*0080*/                   EXIT ;                                 /* 0x000000000000794d */
                                                                          /* 0x000fea0003800000 */
        /*0090*/                   STS [R0], R1 ;                         /* 0x0000000100007388 */
                                                                          /* 0x000fe80000000800 */
        /*0100*/                   SHFL.IDX PT, R23, R19, R20, 0x1f ;     /* 0x00001f1413177589 */
                                                                          /* 0x000e2200000e0000 */
        /*0110*/                   FFMA R32, R0, R25, RZ ;                /* 0x0000001900207223 */
                                                                          /* 0x000fe200000000ff */
        /*0120*/                   CALL.REL.NOINC 0x160 ;                 /* 0x0000000000247944 */
                                                                          /* 0x000fea0003c00000 */
        /*0130*/                   RET.REL.NODEC R14 0x0 ;                /* 0x0000000000007950 */
                                                                          /* 0x000fea0003c3ffff */
        /*0140*/                   BRA 0x140;                             /* 0xfffffffc00fc7947 */
                                                                          /* 0x000fc0000383ffff */
        /*0150*/                   NOP;                                   /* 0x0000000000007918 */
                                                                          /* 0x000fc00000000000 */
        /*0160*/                   LDS R3, [R4] ;                         /* 0x0000000004037984 */
                                                                          /* 0x000e220000000800 */
        /*0170*/                   RET.REL.NODEC R16 0x0 ;                /* 0x0000000000007950 */
                                                                          /* 0x000fea0003c3ffff */
        /*0180*/                   NOP;                                   /* 0x0000000000007918 */
                                                                          /* 0x000fc00000000000 */
        /*01c0*/                   SHFL.BFLY PT, R4, R5, 0x2, 0x1f ;      /* 0x0c40000005047f89 */
                                                                          /* 0x000e2200000e0000 */
        /*01d0*/                   EXIT ;                                 /* 0x000000000000794d */
                                                                          /* 0x000fea0003800000 */
\t\t..........
"""


def test_sass_walk_splits_the_body_from_the_subroutines_its_calls_reach():
    functions = sc.sass_functions(SASS)
    assert list(functions) == ["_Z6kernelv"]
    code = functions["_Z6kernelv"]
    assert code[0x10] == (True, "EXIT", "") and code[0x30] == (False, "BRA.DIV", "UR4, 0x1c0")
    result = sc.shared_op_counts(code)
    # body: the predicated EXIT and BRA.DIV fall through (0x40-0x80 is reached only so); the BRA.DIV target too
    assert result["body"]["shared"] == {"LDS.128": 1, "STS.128": 1}
    assert result["body"]["instructions"] == 11
    # 0x100: SHFL, FFMA, CALL, RET; 0x160 (called from the subroutine): one LDS
    assert result["subroutines"] == {
        "0x100": {"instructions": 4, "shared": {}, "generic": {}},
        "0x160": {"instructions": 2, "shared": {"LDS": 1}, "generic": {}},
    }
    assert result["calls"] == 2
    # the STS at 0x90 sits after the unconditional EXIT and is never reached: counted apart
    assert result["unreached"]["shared"] == {"STS": 1}


def test_probe_check_compares_measured_instructions_with_warps_times_the_static_count():
    static = {"body": {"shared": {"LDS.128": 2, "STS.64": 4}}, "subroutines": {"0x630": {"shared": {}}}}
    row = {"ld_instructions": 2112.0, "st_instructions": 4224.0}
    assert sc.probe_check(row, static, 1056)["verdict"] == "ok"
    assert sc.probe_check({**row, "ld_instructions": 2113.0}, static, 1056)["verdict"] == "MISMATCH"
    with_emulation_traffic = {**static, "subroutines": {"0x630": {"shared": {"STS": 1}}}}
    assert sc.probe_check(row, with_emulation_traffic, 1056)["expected"] == {"ld": 2112, "st": 5280}
    assert sc.probe_check(None, static, 1056)["verdict"] == "n/a"


# --- GPU: the workload alone ----------------------------------------------------------------------------------


@pytest.mark.gpu
def test_workload_makes_the_planned_launches(tmp_path):
    major, minor = torch.cuda.get_device_capability()
    plan = sc.launch_plan(10 * major + minor, quick=True)
    proc = subprocess.run([sys.executable, str(REPO / "lab" / "smem_conflicts.py"), "--workload", "--quick",
                           "--seqlen", "256"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert f"[workload] {len(plan)} kernel launches" in proc.stdout
    assert f"[launch {len(plan) - 1}] {plan[-1].call} {plan[-1].function}" in proc.stdout


def test_sm70_d112_backward_runs_the_d128_kernels_on_padded_inputs():
    # no d112 tile reaches 8 warps per SM on a V100: its backward runs the d128 kernels (tiles.BWD_KERNEL_HEAD_DIMS_SM70)
    calls = call_matrix.table_calls("sm70", 90, head_dims=(112,), causal=(False,), dropout=(False,),
                                    softcap=(False,), passes=("bwd",))
    assert calls
    for call in calls:
        assert call.head_dim == 112 and call.kernel_head_dim == 128
        assert call.overrides["kernel_head_dim"] == 128 and call.tile == tiles.bwd_tile(128, 70, call.accum == "fp16")
        assert all(v.meta["head_dim"] == 128 for v in call.launches)
    assert not [v for v in tiles.shipped_bwd_variants(70) if v.meta["head_dim"] == 112]
    # the sm_80+ tables keep their own d112 kernels; forwards are not padded anywhere
    assert tiles.bwd_kernel_head_dim(112, 90) == 112 and tiles.bwd_kernel_head_dim(96, 70) == 96
    for call in call_matrix.table_calls("default", 90, head_dims=(112,), causal=(False,), dropout=(False,),
                                        softcap=(False,)):
        assert call.kernel_head_dim is None and "kernel_head_dim" not in call.overrides
        assert all(v.meta["head_dim"] == 112 for v in call.launches)
    assert all(v.meta["head_dim"] == 112 for v in tiles.shipped_fwd_variants(70) if "_d112_" in v.name)
