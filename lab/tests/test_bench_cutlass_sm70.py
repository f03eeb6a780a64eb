"""lab/bench_cutlass_sm70.py on CPU: the cases each suite asks for, parsing the harness's JSON lines, the tables,
the exit status, the result files, and a whole run against a fake harness binary (a Python script printing canned
lines). The harness itself (lab/cutlass_sm70/) needs nvcc, CUTLASS and a GPU: not in CI."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "lab" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


bench = _load("bench_cutlass_sm70")

ENV = {"type": "environment", "gpu": "NVIDIA H100 80GB HBM3", "cc": "90", "sms": 132, "driver_version": 13000,
       "runtime_version": 13000, "cutlass_version": "4.2.0", "warmup": 3, "repeats": 10, "bwd_warmup": 2,
       "bwd_repeats": 5, "verify_heads": 2, "tol": 0.02}
KERNEL = {"type": "kernel", "name": "fmha_cutlassB_f16_aligned_128x64_k65536_sm70", "pass": "bwd", "block": "128x64",
          "max_k": 65536, "threads": 256, "smem_bytes": 50176, "fits_v100": True, "v100_blocks_by_smem": 1,
          "regs_here": 188, "local_bytes_here": 0, "blocks_per_sm_here": 1}


def case(**kw):
    row = {"type": "case", "tag": "train", "pass": "fwd", "batch": 4, "heads": 8, "seqlen_q": 4096, "seqlen_k": 4096,
           "head_dim": 256, "causal": False, "kernel": "fmha_cutlassF_f16_aligned_32x128_gmem_sm70", "verified": True,
           "ok": True, "max_abs": 1.2e-3}
    row.update(kw)
    if "flops" not in row:
        row["flops"] = bench.flops(row["pass"], row["batch"], row["heads"], row["seqlen_q"], row["seqlen_k"],
                                   row["head_dim"], row["causal"])
    return row


FWD = case(ms=61.0, tflops=9.01)
BWD = case(**{"pass": "bwd", "kernel": KERNEL["name"], "ms": 210.0, "tflops": 6.55, "best_split": 4,
              "tflops_split1": 3.21, "pytorch_split": 6, "tflops_pytorch_split": 6.40,
              "split_runs": [{"splits": 1, "ms": 428.0}, {"splits": 4, "ms": 210.0}, {"splits": 6, "ms": 215.0}]})
DECODE = case(tag="decode", batch=8, heads=32, seqlen_q=1, seqlen_k=32768, head_dim=128, ms=2.5, tflops=0.11,
              gbps=3436.0, kernel="fmha_cutlassF_f16_aligned_32x128_rf_sm70")
CHECK_BAD = case(tag="check", batch=1, heads=2, seqlen_q=130, seqlen_k=130, head_dim=64, ok=False, max_abs=0.5,
                 tol=0.02, kernel="fmha_cutlassF_f16_aligned_64x64_rf_sm70")
ERROR = case(tag="decode", batch=8, heads=32, seqlen_q=1, seqlen_k=32768, head_dim=256, ok=False,
             error="cudaMalloc(4.000 GiB): out of memory", spec="tag=decode,pass=fwd,b=8")
SUMMARY = {"type": "summary", "cases": 3, "failed": 0, "errors": 0}


def lines(*objs):
    return [json.dumps(o) + "\n" for o in objs]


def test_flops_match_the_project_benchmark():
    from volta_train.bench import flops as project_flops

    for pass_name in ("fwd", "bwd"):
        for causal in (False, True):
            assert bench.flops(pass_name, 4, 8, 4096, 4096, 256, causal) == \
                project_flops(pass_name, 4, 8, 4096, 4096, 256, causal)
    assert bench.flops("fwd", 8, 32, 1, 32768, 128, False) == 4.0 * 8 * 32 * 32768 * 128  # decoding: 4*B*H*Nk*D
    assert bench.flops("fwd", 1, 2, 77, 301, 64, True) == 4.0 * 2 * 77 * 301 * 64  # causal halves only Nq == Nk


def test_suites_give_the_requested_shapes():
    args = bench.build_parser().parse_args(["--suite", "hd256"])
    check, cases = bench.suite_cases(args)
    assert not check and len(cases) == 8  # fwd/bwd x N 1024/4096 x causal
    assert "tag=train,pass=fwd,b=16,h=8,n=1024,d=256,causal=0" in cases
    assert "tag=train,pass=bwd,b=4,h=8,n=4096,d=256,causal=1,splits=1-8+pt" in cases
    args = bench.build_parser().parse_args(["--suite", "decode"])
    _, cases = bench.suite_cases(args)
    assert len(cases) == 8 and all(",nq=1," in c and ",h=32," in c and "pass=fwd" in c for c in cases)
    assert "tag=decode,pass=fwd,b=8,h=32,nq=1,nk=32768,d=256,causal=0" in cases
    check, cases = bench.suite_cases(bench.build_parser().parse_args([]))  # all
    assert check and len(cases) == 2 * 3 * 2 * 2 + 8
    with pytest.raises(SystemExit, match="--hidden 2048 is not a multiple of head_dim 96"):
        bench.suite_cases(bench.build_parser().parse_args(["--suite", "train", "--head-dims", "96"]))


def test_parse_sorts_lines_and_keeps_the_rest():
    result = bench.parse_lines(lines(ENV, KERNEL, FWD, BWD) + ["not json\n", "\n"] + lines(SUMMARY))
    assert result["environment"]["gpu"] == ENV["gpu"] and len(result["kernels"]) == 1
    assert [c["pass"] for c in result["cases"]] == ["fwd", "bwd"]
    assert result["summary"]["cases"] == 3 and result["other"] == ["not json"]


def test_exit_status_needs_every_case_ok_and_the_summary():
    good = bench.parse_lines(lines(ENV, FWD, BWD, DECODE, SUMMARY))
    assert bench.exit_status(good, 0) == 0
    assert bench.exit_status(good, 1) == 1  # the harness said so
    assert bench.exit_status(good, None) == 1  # stopped by --timeout
    assert bench.exit_status(bench.parse_lines(lines(ENV, FWD)), 0) == 1  # no summary: it did not finish
    assert bench.exit_status(bench.parse_lines(lines(ENV, FWD, CHECK_BAD, SUMMARY)), 0) == 1
    assert bench.exit_status(bench.parse_lines(lines(ENV, FWD, ERROR, SUMMARY)), 0) == 1
    wrong_flops = dict(FWD, flops=FWD["flops"] * 2)  # the harness and this script disagree on the FLOP count
    assert bench.exit_status(bench.parse_lines(lines(ENV, wrong_flops, SUMMARY)), 0) == 1
    # the harness prints "%.6g": 2.5 * 4*16*32*1024^2*64 = 343597383680 arrives as 3.43597e+11 (seen on the H100)
    printed = dict(BWD, batch=16, heads=32, seqlen_q=1024, seqlen_k=1024, head_dim=64, causal=False,
                   flops=float("%.6g" % bench.flops("bwd", 16, 32, 1024, 1024, 64, False)))
    assert printed["flops"] != bench.flops("bwd", 16, 32, 1024, 1024, 64, False)
    assert bench.exit_status(bench.parse_lines(lines(ENV, printed, SUMMARY)), 0) == 0


def test_markdown_tables():
    text = bench.markdown(bench.parse_lines(lines(ENV, KERNEL, FWD, BWD, DECODE, CHECK_BAD, ERROR, SUMMARY)),
                          {"python": "3.11"})
    assert text.startswith("environment: gpu NVIDIA H100 80GB HBM3; cc 90;")
    assert "cutlass_version 4.2.0" in text and "python 3.11" in text
    assert ("| fmha_cutlassB_f16_aligned_128x64_k65536_sm70 | bwd | 128x64 | 65536 | 256 | 50176 | yes | 1 | 188 |"
            in text)
    assert "| fwd | 256 | 4096 | 4x8 | no | fmha_cutlassF_f16_aligned_32x128_gmem_sm70 | 61.000 | 9.01 |" in text
    assert "| 210.000 | 6.55 | 3.21 | 4 | 6: 6.40 | 1.2e-03 | ok |" in text
    assert "| 8 | 32 | 128 | 32768 | fmha_cutlassF_f16_aligned_32x128_rf_sm70 | 2.5000 | 0.110 | 3436 |" in text
    assert re.search(r"\| fmha_cutlassF_f16_aligned_64x64_rf_sm70 \| fwd \| 1x2 \| 130x130 \| 64 \| no \|  \| "
                     r"5\.0e-01 \| 2\.0e-02 \| FAILED \|", text)
    assert "- `tag=decode,pass=fwd,b=8`: cudaMalloc(4.000 GiB): out of memory" in text
    assert "| ERROR |" in text
    assert text.rstrip().endswith("summary: 3 cases, 0 failed verification, 0 could not run")
    assert "summary: missing" in bench.markdown(bench.parse_lines(lines(ENV, FWD)))


def test_write_results_writes_tables_json_and_plots(tmp_path):
    result = bench.parse_lines(lines(ENV, KERNEL, FWD, BWD, DECODE, SUMMARY,
                                     dict(FWD, seqlen_q=1024, seqlen_k=1024, batch=16, flops=None, tflops=8.8)))
    table = bench.write_results(result, tmp_path, {"suite": ["all"]})
    assert (tmp_path / "cutlass_sm70.md").read_text() == table
    saved = json.loads((tmp_path / "cutlass_sm70.json").read_text())
    assert saved["settings"] == {"suite": ["all"]} and len(saved["cases"]) == 4
    assert (tmp_path / "cutlass_sm70_train.png").stat().st_size > 1000
    assert (tmp_path / "cutlass_sm70_decode.png").stat().st_size > 1000


FAKE = """#!{python}
import json, sys
argv = sys.argv[1:]
open({argv_file!r}, "w").write(json.dumps(argv))
spec = argv[argv.index("--spec") + 1]
cases = [l.strip() for l in open(spec) if l.strip()]
for line in {lines!r}:
    print(line, end="")
print(json.dumps({{"type": "summary", "cases": len(cases), "failed": 0, "errors": 0}}))
sys.exit({status})
"""


@pytest.mark.parametrize("status", [0, 1])
def test_main_runs_a_prebuilt_binary(tmp_path, status, capsys):
    fake = tmp_path / "harness"
    argv_file = tmp_path / "argv.json"
    fake.write_text(FAKE.format(python=sys.executable, argv_file=str(argv_file), lines=lines(ENV, KERNEL, FWD, BWD),
                                status=status))
    fake.chmod(0o755)
    out = tmp_path / "out"
    code = bench.main(["--binary", str(fake), "--suite", "hd256", "--passes", "bwd", "--seqlens", "4096",
                       "--out", str(out), "--bwd-repeats", "7"])
    assert code == status
    argv = json.loads(argv_file.read_text())
    assert "--check" not in argv and argv[argv.index("--bwd-repeats") + 1] == "7"
    spec = (out / "cutlass_sm70_cases.txt").read_text().split()
    assert spec == ["tag=train,pass=bwd,b=4,h=8,n=4096,d=256,causal=0,splits=1-8+pt",
                    "tag=train,pass=bwd,b=4,h=8,n=4096,d=256,causal=1,splits=1-8+pt"]
    assert (out / "cutlass_sm70.jsonl").read_text().count("\n") == 5
    assert "summary: 2 cases" in (out / "cutlass_sm70.md").read_text()
    printed = capsys.readouterr().out
    assert "bwd d256 B4 H8 Nq4096 Nk4096 [fmha_cutlassB_f16_aligned_128x64_k65536_sm70]: 6.55 TFLOP/s" in printed


def test_main_refuses_a_missing_or_unrunnable_binary(tmp_path, capsys):
    assert bench.main(["--binary", str(tmp_path / "nope"), "--out", str(tmp_path)]) == 2
    assert "--binary" in capsys.readouterr().err
    not_executable = tmp_path / "harness"
    not_executable.write_text("not a program")
    assert bench.main(["--binary", str(not_executable), "--suite", "decode", "--out", str(tmp_path)]) == 2
    assert "cannot run the harness" in capsys.readouterr().err


def test_sources_agree_on_the_instances():
    """instance.cu builds bench.INSTANCES kernels, each named in harness.cu's PyTorch dispatch order."""
    instance = (REPO / "lab" / "cutlass_sm70" / "instance.cu").read_text()
    harness = (REPO / "lab" / "cutlass_sm70" / "harness.cu").read_text()
    names = re.findall(r'SM70_(?:FORWARD|BACKWARD)\("(fmha_cutlass[FB]_f16_aligned_\w+)"', instance)
    assert len(names) == bench.INSTANCES == len(re.findall(r"#(?:el)?if SM70_INSTANCE == \d", instance))
    for name in names:
        assert f'{{"{name}"' in harness


def test_workload_suite_sums_each_packed_row_over_its_documents(tmp_path):
    """--suite workload: one case per distinct document length of volta_train.bench's workload, and per packed row the
    sum of each document's time (times its count), its FLOPs and the ratio to --volta-json's rows."""
    from volta_train.bench import WORKLOADS, document_lengths, packed_flops
    work = WORKLOADS["llama3-8b"]
    volta = tmp_path / "bench.json"
    volta.write_text(json.dumps({"rows": [
        {"pass_name": "bwd", "backend": "volta-fp32acc", "seqlen": 32768, "ms": 100.0},
        {"pass_name": "bwd", "backend": "sdpa-efficient", "seqlen": 32768, "ms": 1.0}]}))
    args = bench.build_parser().parse_args(["--suite", "workload", "--passes", "bwd", "--volta-json", str(volta)])
    check, cases = bench.suite_cases(args)
    assert not check
    lengths = {t: document_lengths(t, work.shortest_document, t // 2) for t in work.rows}
    assert len(cases) == sum(len(set(ls)) for ls in lengths.values())
    assert all(",causal=1" in c and ",splits=pt" in c and f",h={work.heads}," in c for c in cases)
    ms_by_length = {n: 0.5 + (n % 7) for ls in lengths.values() for n in ls}  # a time per document length
    result = bench.parse_lines([json.dumps(ENV)] + [json.dumps(case(
        tag=f"workload-{t}", **{"pass": "bwd"}, batch=1, heads=work.heads, seqlen_q=n, seqlen_k=n, head_dim=128,
        causal=True, ms=None, ms_pytorch_split=ms_by_length[n])) for t, ls in lengths.items() for n in set(ls)])
    rows = bench.workload_rows(result, args)
    assert [r["seqlen"] for r in rows] == list(work.rows)
    for r in rows:
        want = sum(ms_by_length[n] for n in lengths[r["seqlen"]])
        assert r["peer_ms"] == pytest.approx(want)
        assert r["flops"] == packed_flops("bwd", lengths[r["seqlen"]], work.heads, work.head_dim)
    assert rows[0]["volta-fp32acc"] == 100.0 and "sdpa-efficient" not in rows[0] and "volta-fp32acc" not in rows[1]
    table = "\n".join(bench.workload_table(rows))
    assert f"{rows[0]['peer_ms'] / 100.0:.2f}x" in table
    # a document that failed verification leaves its row without a total rather than a partial sum
    bad = dict(result, cases=[dict(c, ok=False) if c["seqlen_q"] == lengths[32768][0] else c for c in result["cases"]])
    assert bench.workload_rows(bad, args)[0]["peer_ms"] is None
