#!/usr/bin/env python3
"""Baseline: the CUTLASS "Sm70" memory-efficient attention kernels (what PyTorch's SDPA runs on a V100), timed and
checked by our harness (lab/cutlass_sm70/), on the GPU we have (an H100 runs their m8n8k4 code emulated, like
volta_train's Volta build, so the two compare on the same footing).

    python3 lab/bench_cutlass_sm70.py --suite all --out $OUT/cutlass          # build (if needed) and run
    python3 lab/bench_cutlass_sm70.py --binary .cutlass_build/harness --suite all --out $OUT/cutlass
    python3 lab/bench_cutlass_sm70.py --build-only                            # build .cutlass_build/harness
    python3 lab/bench_cutlass_sm70.py --suite hd256 decode --head-dims 256     # some suites only

Suites: ``check`` (every built kernel on small odd shapes, forced, verified, no timing), ``train`` (forward and
backward, B*N = --tokens, H = --hidden / head_dim, head_dim 64/128/256, N 1024/4096, causal and not), ``hd256``
(``train`` at head_dim 256 only), ``workload`` (``volta-train bench --workload``'s packed documents, one case
per document length, summed per row; ``--volta-json`` adds volta_train's times and the ratio), ``decode`` (forward with seqlen_q 1, --decode-heads heads for Q and K/V, i.e. GQA
expanded as SDPA's memory-efficient backend needs it, head_dim 128/256, N_k 4096/32768, batch 1/8), ``all`` (check,
train, decode). Which kernel runs, the timing, the FLOP counts, the key-split sweep and the fp32 reference check are
the harness's (lab/cutlass_sm70/harness.cu, header comment). Writes cutlass_sm70.md, .json, .jsonl (the harness's
lines), _train.png and _decode.png to --out; exit status 0 when every case ran and verified, 1 otherwise, 2 for a
usage or build problem.

Getting CUTLASS (headers only, never committed; the device has no network, so carry the wheel or the binary):

    pip download nvidia-cutlass==4.2.0 --no-deps -d /tmp/cutl
    mkdir -p /tmp/cutl/unpacked
    python3 -m zipfile -e /tmp/cutl/nvidia_cutlass-4.2.0.0-py3-none-any.whl /tmp/cutl/unpacked
    # CUTLASS root = /tmp/cutl/unpacked/cutlass_library/source (include/, tools/util/include/, examples/41_...)

``--cutlass DIR`` names that root (or a CUTLASS git checkout); ``--cutlass-wheel FILE`` unpacks the wheel into the
build directory; otherwise $CUTLASS_DIR, an installed ``cutlass_library`` package and /tmp/cutl/unpacked are tried.
The build (nvcc, C++17, -O3, sm_90 SASS, static cudart) compiles one translation unit per kernel in parallel
(--jobs) into .cutlass_build/ and reuses it while sources, flags and compiler are unchanged.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HARNESS_DIR = Path(__file__).resolve().parent / "cutlass_sm70"
DEFAULT_BUILD = REPO / ".cutlass_build"
INSTANCES = 8  # instance.cu's SM70_INSTANCE 0..7
SOURCES = ("harness.cu", "instance.cu", "api.h", "compat/curand_kernel.h")
ARCH = "sm_90"
# CUTLASS's own builds pass --expt-relaxed-constexpr; warning 940 ("missing return statement") comes from
# CustomMmaPipelined::set_prologue_done / set_zero_outside_bounds in example 41, whose results are never used.
NVCC_FLAGS = ["-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr",
              f"-gencode=arch=compute_{ARCH[3:]},code={ARCH}"]
INSTANCE_FLAGS = ["-diag-suppress", "940", "-Xptxas", "-v"]
SUITES = ("check", "train", "hd256", "decode", "workload", "all")
STEM = "cutlass_sm70"


# ------------------------------------------------------------------------------------------------ CUTLASS, build

def is_cutlass_root(path: Path) -> bool:
    return (path / "include" / "cutlass" / "cutlass.h").is_file() and \
        (path / "examples" / "41_fused_multi_head_attention" / "kernel_forward.h").is_file()


def unpack_wheel(wheel: Path, dest: Path) -> Path:
    root = dest / "cutlass_wheel" / "cutlass_library" / "source"
    if not is_cutlass_root(root):
        with zipfile.ZipFile(wheel) as z:
            members = [m for m in z.namelist() if m.startswith("cutlass_library/source/")]
            if not members:
                raise SystemExit(f"--cutlass-wheel {wheel}: no cutlass_library/source/ in it (an nvidia-cutlass wheel "
                                 "has one)")
            z.extractall(dest / "cutlass_wheel", members)
    return root


def find_cutlass(arg: Path | None, wheel: Path | None, build_dir: Path) -> Path:
    """The CUTLASS source root to compile against; SystemExit naming what was tried when there is none."""
    if arg is not None:
        if not is_cutlass_root(arg):
            raise SystemExit(f"--cutlass {arg}: not a CUTLASS source root (needs include/cutlass/cutlass.h and "
                             "examples/41_fused_multi_head_attention/kernel_forward.h)")
        return arg
    if wheel is not None:
        if not wheel.is_file():
            raise SystemExit(f"--cutlass-wheel {wheel}: no such file")
        return unpack_wheel(wheel, build_dir)
    tried = []
    candidates = []
    if os.environ.get("CUTLASS_DIR"):
        candidates.append(Path(os.environ["CUTLASS_DIR"]))
    try:
        import cutlass_library  # the nvidia-cutlass wheel, if installed

        candidates.append(Path(cutlass_library.__file__).parent / "source")
    except ImportError:
        pass
    candidates += [build_dir / "cutlass_wheel" / "cutlass_library" / "source",
                   Path("/tmp/cutl/unpacked/cutlass_library/source")]
    for path in candidates:
        if is_cutlass_root(path):
            return path
        tried.append(str(path))
    raise SystemExit("no CUTLASS source root found (tried " + ", ".join(tried) + "); give --cutlass DIR or "
                     "--cutlass-wheel FILE (this script's docstring says how to get it)")


def find_nvcc(arg: str | None) -> str:
    for candidate in (arg, os.environ.get("NVCC"), shutil.which("nvcc"),
                      os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")):
        if candidate and Path(candidate).is_file():
            return candidate
    raise SystemExit("nvcc not found: give --nvcc PATH or set CUDA_HOME")


def build_commands(nvcc: str, cutlass: Path, build_dir: Path) -> tuple[list[list[str]], list[str]]:
    """(compile commands, link command): one object per kernel instance plus the harness, linked with static cudart."""
    includes = ["-I", str(HARNESS_DIR / "compat"), "-I", str(HARNESS_DIR), "-I", str(cutlass / "include"),
                "-I", str(cutlass / "examples" / "41_fused_multi_head_attention")]
    compiles = [[nvcc, *NVCC_FLAGS, *INSTANCE_FLAGS, *includes, f"-DSM70_INSTANCE={i}", "-c",
                 str(HARNESS_DIR / "instance.cu"), "-o", str(build_dir / f"instance{i}.o")] for i in range(INSTANCES)]
    compiles.append([nvcc, *NVCC_FLAGS, "-I", str(HARNESS_DIR), f"-DSM70_INSTANCE_COUNT={INSTANCES}", "-c",
                     str(HARNESS_DIR / "harness.cu"), "-o", str(build_dir / "harness.o")])
    link = [nvcc, *NVCC_FLAGS, "-cudart", "static", "-Xcompiler", "-static-libstdc++,-static-libgcc",
            str(build_dir / "harness.o"),
            *[str(build_dir / f"instance{i}.o") for i in range(INSTANCES)], "-o", str(build_dir / "harness")]
    return compiles, link


def build_stamp(nvcc: str, cutlass: Path, commands: list[list[str]]) -> str:
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update((HARNESS_DIR / name).read_bytes())
    version = cutlass / "include" / "cutlass" / "version.h"
    digest.update(version.read_bytes() if version.is_file() else b"")
    digest.update(json.dumps(commands).encode())
    digest.update(subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.encode())
    return digest.hexdigest()


def build(nvcc: str, cutlass: Path, build_dir: Path, jobs: int, force: bool = False) -> Path:
    """Builds build_dir/harness (reused while the stamp matches); SystemExit with the compiler's output on failure."""
    build_dir.mkdir(parents=True, exist_ok=True)
    compiles, link = build_commands(nvcc, cutlass, build_dir)
    binary = build_dir / "harness"
    stamp = build_stamp(nvcc, cutlass, compiles + [link])
    stamp_file = build_dir / "stamp"
    if not force and binary.is_file() and stamp_file.is_file() and stamp_file.read_text() == stamp:
        print(f"build: {binary} is up to date", file=sys.stderr)
        return binary
    print(f"build: {len(compiles)} translation units with {jobs} jobs, CUTLASS {cutlass}", file=sys.stderr)
    start = time.time()

    def compile_one(cmd: list[str]) -> tuple[str, float, subprocess.CompletedProcess]:
        t0 = time.time()
        done = subprocess.run(cmd, capture_output=True, text=True)
        obj = Path(cmd[cmd.index("-o") + 1])
        obj.with_suffix(".log").write_text(done.stdout + done.stderr)
        return obj.name, time.time() - t0, done

    failed = []
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for name, seconds, done in pool.map(compile_one, compiles):
            print(f"build: {name} {seconds:.0f} s{'' if done.returncode == 0 else ' FAILED'}", file=sys.stderr)
            if done.returncode != 0:
                failed.append((name, done.stdout + done.stderr))
    if failed:
        for name, output in failed:
            print(f"--- {name}\n{output[-4000:]}", file=sys.stderr)
        raise SystemExit(f"build failed: {', '.join(n for n, _ in failed)} (logs in {build_dir})")
    done = subprocess.run(link, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"link failed:\n{done.stdout}{done.stderr}")
    stamp_file.write_text(stamp)
    print(f"build: {binary} ({binary.stat().st_size / 2**20:.1f} MiB) in {time.time() - start:.0f} s", file=sys.stderr)
    return binary


# ------------------------------------------------------------------------------------------------ cases

def flops(pass_name: str, batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, causal: bool) -> float:
    """As volta_train.bench.flops (seqlen_q == seqlen_k there) and the harness: forward 4*B*H*Nq*Nk*D, half under
    causal when Nq == Nk, backward 2.5x the forward."""
    forward = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim * (0.5 if causal and seqlen_q == seqlen_k else 1.0)
    return 2.5 * forward if pass_name == "bwd" else forward


def train_cases(args, head_dims) -> list[str]:
    cases = []
    for pass_name in args.passes:
        for d in head_dims:
            if args.hidden % d:
                raise SystemExit(f"--hidden {args.hidden} is not a multiple of head_dim {d}")
            for n in args.seqlens:
                if args.tokens % n:
                    raise SystemExit(f"--tokens {args.tokens} is not a multiple of seqlen {n}")
                for causal in args.causal:
                    spec = (f"tag=train,pass={pass_name},b={args.tokens // n},h={args.hidden // d},n={n},d={d},"
                            f"causal={int(causal)}")
                    cases.append(spec + (f",splits={args.splits}" if pass_name == "bwd" else ""))
    return cases


def decode_cases(args) -> list[str]:
    return [f"tag=decode,pass=fwd,b={b},h={args.decode_heads},nq=1,nk={n},d={d},causal=0"
            for d in args.decode_head_dims for b in args.decode_batches for n in args.decode_seqlens]


def workload_documents(args) -> list[tuple[str, int, list[int]]]:
    """(pass, packed row length, document lengths) of the ``--workload`` (volta_train.bench's, same seed), per pass."""
    from volta_train.bench import WORKLOADS, document_lengths  # needs torch: only for this suite
    work = WORKLOADS[args.workload]
    return [(p, total, document_lengths(total, work.shortest_document, total // 2))
            for p in args.passes for total in work.rows]


def workload_cases(args) -> list[str]:
    """One case per distinct document length of each packed row, causal, K/V expanded to the query heads (what
    PyTorch's memory-efficient SDPA runs per document); backward at PyTorch's own key split."""
    from volta_train.bench import WORKLOADS
    work = WORKLOADS[args.workload]
    cases = []
    for pass_name, total, lengths in workload_documents(args):
        for n in sorted(set(lengths)):
            spec = f"tag=workload-{total},pass={pass_name},b=1,h={work.heads},n={n},d={work.head_dim},causal=1"
            cases.append(spec + (f",splits={args.workload_splits}" if pass_name == "bwd" else ""))
    return cases


def suite_cases(args) -> tuple[bool, list[str]]:
    """(run the harness's --check, case specs) for the chosen suites."""
    suites = set(args.suite)
    if "all" in suites:
        suites |= {"check", "train", "decode"}
    cases = []
    if "train" in suites:
        cases += train_cases(args, args.head_dims)
    elif "hd256" in suites:
        cases += train_cases(args, [256])
    if "decode" in suites:
        cases += decode_cases(args)
    if "workload" in suites:
        cases += workload_cases(args)
    return "check" in suites, cases


# ------------------------------------------------------------------------------------------------ run, parse

def parse_lines(lines) -> dict:
    """The harness's JSON lines sorted by type; lines that are not JSON objects are kept under 'other'."""
    result = {"environment": {}, "kernels": [], "cases": [], "summary": None, "fatal": [], "other": []}
    for line in lines:
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            result["other"].append(line)
            continue
        kind = obj.get("type") if isinstance(obj, dict) else None
        if kind == "environment":
            result["environment"] = obj
        elif kind == "kernel":
            result["kernels"].append(obj)
        elif kind == "case":
            result["cases"].append(obj)
        elif kind == "summary":
            result["summary"] = obj
        elif kind == "fatal":
            result["fatal"].append(obj)
        else:
            result["other"].append(line)
    return result


def flops_mismatch(row: dict) -> bool:
    if row.get("flops") is None:
        return False
    want = flops(row["pass"], row["batch"], row["heads"], row["seqlen_q"], row["seqlen_k"], row["head_dim"],
                 row["causal"])
    # the harness prints numbers with 6 significant digits: a relative difference up to 5e-6 is rounding
    return abs(row["flops"] - want) > 1e-5 * want


def exit_status(result: dict, returncode: int | None) -> int:
    """0 only when the harness exited 0 (None: stopped by --timeout), printed its summary, and every case ran and
    verified with the FLOP count this script expects."""
    cases = result["cases"]
    bad = any(not c.get("ok") or c.get("error") or flops_mismatch(c) for c in cases)
    if returncode != 0 or result["summary"] is None or result["fatal"] or bad:
        return 1
    return 0


def summary_line(row: dict) -> str:
    shape = (f"{row['pass']} d{row['head_dim']} B{row['batch']} H{row['heads']} Nq{row['seqlen_q']} Nk{row['seqlen_k']}"
             f"{' causal' if row.get('causal') else ''}")
    if row.get("error"):
        return f"{shape}: ERROR {row['error']}"
    parts = []
    if row.get("tflops") is not None:
        parts.append(f"{row['tflops']:.2f} TFLOP/s ({row['ms']:.3f} ms)")
    if row.get("best_split"):
        parts.append(f"best split {row['best_split']}")
    if row.get("tflops_split1") is not None:
        parts.append(f"split 1 {row['tflops_split1']:.2f}")
    if row.get("tflops_pytorch_split") is not None:
        parts.append(f"PyTorch split {row.get('pytorch_split')} {row['tflops_pytorch_split']:.2f}")
    if row.get("verified"):
        parts.append(f"max_abs {row.get('max_abs') if row.get('max_abs') is None else format(row['max_abs'], '.1e')}")
    parts.append("ok" if row.get("ok") else "FAILED")
    return f"{shape} [{row.get('kernel', '?')}]: " + ", ".join(parts)


def run_harness(binary: Path, check: bool, cases: list[str], args, out: Path) -> tuple[dict, int | None]:
    """Runs the harness on the cases, echoing a line per case; returns the parsed lines and its exit status (None
    when it was stopped by --timeout)."""
    out.mkdir(parents=True, exist_ok=True)
    spec = out / f"{STEM}_cases.txt"
    spec.write_text("".join(c + "\n" for c in cases))
    cmd = [str(binary), "--warmup", str(args.warmup), "--repeats", str(args.repeats), "--bwd-warmup",
           str(args.bwd_warmup), "--bwd-repeats", str(args.bwd_repeats), "--input-sets", str(args.input_sets),
           "--verify-heads", str(args.verify_heads), "--tol", str(args.tol)]
    if check:
        cmd.append("--check")
    if cases:
        cmd += ["--spec", str(spec)]
    if not args.verify:
        cmd.append("--no-verify")
    print("run: " + " ".join(cmd), file=sys.stderr, flush=True)
    lines = []
    timed_out = threading.Event()
    with open(out / f"{STEM}.jsonl", "w", encoding="utf-8") as raw, \
            subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, bufsize=1) as proc:

        def stop():
            timed_out.set()
            proc.kill()

        timer = threading.Timer(args.timeout, stop) if args.timeout else None
        if timer:
            timer.start()
        try:
            for line in proc.stdout:
                raw.write(line)
                raw.flush()
                lines.append(line)
                for row in parse_lines([line])["cases"]:
                    print(summary_line(row), flush=True)
        except KeyboardInterrupt:
            proc.kill()
            print("run: interrupted; writing what was measured", file=sys.stderr)
        returncode = proc.wait()
        if timer:
            timer.cancel()
    if timed_out.is_set():
        print(f"run: stopped by --timeout {args.timeout:g} s; writing what was measured", file=sys.stderr)
        returncode = None
    return parse_lines(lines), returncode


# ------------------------------------------------------------------------------------------------ reports

def _f(value, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def environment_line(result: dict, extra: dict) -> str:
    env = result.get("environment") or {}
    keys = ("gpu", "cc", "sms", "driver_version", "runtime_version", "cutlass_version")
    parts = [f"{k} {env[k]}" for k in keys if env.get(k) not in (None, "")]
    parts += [f"{k} {v}" for k, v in extra.items() if v]
    return "environment: " + "; ".join(parts)


def kernel_table(kernels: list[dict]) -> list[str]:
    lines = ["| kernel | pass | block | kMaxK | threads | shared memory (B) | fits a V100 (96 KB) | V100 blocks/SM by "
             "smem | registers here | local bytes here | blocks/SM here |", "|" + "---|" * 11]
    for k in kernels:
        lines.append(f"| {k['name']} | {k['pass']} | {k.get('block', '')} | {k.get('max_k', '')} | "
                     f"{k.get('threads', '')} | {k.get('smem_bytes', '')} | {'yes' if k.get('fits_v100') else 'NO'} | "
                     f"{k.get('v100_blocks_by_smem', '')} | {k.get('regs_here', '')} | "
                     f"{k.get('local_bytes_here', '')} | {k.get('blocks_per_sm_here', '')} |")
    return lines


def _status(row: dict) -> str:
    if row.get("error"):
        return "ERROR"
    if flops_mismatch(row):
        return "FLOPs?"
    if not row.get("verified"):
        return "ok (not verified)" if row.get("ok") else "FAILED"
    return "ok" if row.get("ok") else "FAILED"


def train_table(rows: list[dict]) -> list[str]:
    lines = ["| pass | head_dim | N | batch x heads | causal | kernel | ms | TFLOP/s | split 1 TFLOP/s | best split | "
             "PyTorch's split: TFLOP/s | max_abs | status |", "|" + "---|" * 13]
    for r in rows:
        pt = r.get("tflops_pytorch_split")
        pt = "" if pt is None else f"{r.get('pytorch_split')}: {pt:.2f}"
        lines.append(f"| {r['pass']} | {r['head_dim']} | {r['seqlen_q']} | {r['batch']}x{r['heads']} | "
                     f"{'yes' if r['causal'] else 'no'} | {r.get('kernel', '')} | {_f(r.get('ms'), '.3f')} | "
                     f"{_f(r.get('tflops'), '.2f')} | {_f(r.get('tflops_split1'), '.2f')} | "
                     f"{r.get('best_split') or ''} | {pt} | {_f(r.get('max_abs'), '.1e')} | {_status(r)} |")
    return lines


def decode_table(rows: list[dict]) -> list[str]:
    lines = ["| batch | heads (Q = K/V) | head_dim | N_k | kernel | ms | TFLOP/s | GB/s (K/V read) | max_abs | "
             "status |",
             "|" + "---|" * 10]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['heads']} | {r['head_dim']} | {r['seqlen_k']} | {r.get('kernel', '')} | "
                     f"{_f(r.get('ms'), '.4f')} | {_f(r.get('tflops'), '.3f')} | {_f(r.get('gbps'), '.0f')} | "
                     f"{_f(r.get('max_abs'), '.1e')} | {_status(r)} |")
    return lines


def check_table(rows: list[dict]) -> list[str]:
    lines = ["| kernel | pass | B x H | Nq x Nk | head_dim | causal | splits | max_abs | bound | status |",
             "|" + "---|" * 10]
    for r in rows:
        splits = " ".join(str(s["splits"]) for s in r.get("split_runs", []))
        lines.append(f"| {r.get('kernel', '')} | {r['pass']} | {r['batch']}x{r['heads']} | "
                     f"{r['seqlen_q']}x{r['seqlen_k']} | {r['head_dim']} | {'yes' if r['causal'] else 'no'} | "
                     f"{splits} | "
                     f"{_f(r.get('max_abs'), '.1e')} | {_f(r.get('tol'), '.1e')} | {_status(r)} |")
    return lines


def workload_rows(result: dict, args) -> list[dict]:
    """Per (pass, packed row): the documents' summed time (each distinct length's case times its count), the
    workload's FLOPs (volta_train.bench.packed_flops) and, with --volta-json, volta_train's rows of the same lease."""
    from volta_train.bench import WORKLOADS, packed_flops
    work = WORKLOADS[args.workload]
    volta = []
    if getattr(args, "volta_json", None):
        volta = [r for r in json.loads(Path(args.volta_json).read_text())["rows"] if r["backend"].startswith("volta-")]
    by_case = {(c["pass"], c.get("tag"), c["seqlen_q"]): c for c in result["cases"]}
    rows = []
    for pass_name, total, lengths in workload_documents(args):
        cases = [by_case.get((pass_name, f"workload-{total}", n)) for n in lengths]
        key = "ms_pytorch_split" if pass_name == "bwd" and args.workload_splits == "pt" else "ms"
        complete = all(c is not None and c.get(key) is not None and c.get("ok") for c in cases)
        ms = sum(c[key] for c in cases) if complete else None
        fl = packed_flops(pass_name, lengths, work.heads, work.head_dim)
        row = dict(pass_name=pass_name, seqlen=total, documents=len(lengths), flops=fl, peer_ms=ms,
                   peer_tflops=fl / ms / 1e9 if ms else None, split=args.workload_splits if pass_name == "bwd" else "")
        for v in volta:
            if v["pass_name"] == pass_name and v["seqlen"] == total and v.get("ms"):
                row[v["backend"]] = v["ms"]
        rows.append(row)
    return rows


def workload_table(rows: list[dict]) -> list[str]:
    backends = sorted({k for r in rows for k in r if k.startswith("volta-")})
    head = "| pass | packed row | documents | TFLOP (sum over documents) | CUTLASS Sm70 ms | TFLOP/s |"
    head += "".join(f" {b} ms | {b} TFLOP/s | {b} speed-up |" for b in backends)
    lines = [head, "|" + "---|" * (6 + 3 * len(backends))]
    for r in rows:
        line = (f"| {r['pass_name']} | {r['seqlen']} | {r['documents']} | {r['flops'] / 1e12:.2f} | "
                f"{_f(r['peer_ms'], '.1f')} | {_f(r['peer_tflops'], '.2f')} |")
        for b in backends:
            ms = r.get(b)
            line += (f" {_f(ms, '.1f')} | {_f(r['flops'] / ms / 1e9 if ms else None, '.2f')} | "
                     f"{_f(r['peer_ms'] / ms if ms and r['peer_ms'] else None, '.2f')}x |")
        lines.append(line)
    return lines


def markdown(result: dict, extra_env: dict | None = None, args=None) -> str:
    env = result.get("environment") or {}
    cases = result["cases"]
    lines = [environment_line(result, extra_env or {}), "",
             "CUTLASS example 41 attention kernels with ArchTag Sm70 and PyTorch's sm_70 fp16 template arguments, "
             "chosen per case as PyTorch dispatches them on a V100 (96 KB opt-in shared memory), built for sm_90 "
             "(m8n8k4 emulated) by lab/bench_cutlass_sm70.py. FLOPs: forward 4*B*H*Nq*Nk*D, half under causal "
             "when Nq == Nk, backward 2.5x; median of "
             f"{env.get('repeats', '?')} (fwd) / {env.get('bwd_repeats', '?')} (bwd, per key split) CUDA-event timings "
             f"after {env.get('warmup', '?')} / {env.get('bwd_warmup', '?')} warm-up calls. Backward: TFLOP/s of the "
             "best num_splits_key among those timed (1-8 by default), split 1, and PyTorch's own heuristic split; "
             "the backward call includes the workspace zeroing and, for the k65536 kernel, the delta kernel. "
             f"max_abs: worst of out / dQ / dK / dV against an fp32 GPU reference on batch 0 x "
             f"{env.get('verify_heads', '?')} heads; a case fails above {env.get('tol', '?')} x max(1, max |ref|) or "
             "with "
             f"||x - ref|| / ||ref|| above {env.get('tol', '?')}.", ""]
    if result["kernels"]:
        lines += ["Kernels built (resources of this sm_90 build; V100 fit from sizeof(SharedStorage)):", ""]
        lines += kernel_table(result["kernels"]) + [""]
    groups = (("Training shapes", "train", train_table), ("Decoding (seqlen_q = 1)", "decode", decode_table),
              ("Correctness check (kernel forced, small odd shapes, not timed)", "check", check_table))
    known = {tag for _, tag, _ in groups} | {r.get("tag") for r in cases if str(r.get("tag")).startswith("workload-")}
    if args is not None and "workload" in args.suite:
        lines += [f"Workload {args.workload} (volta-train bench --workload): causal attention over each packed row's "
                  "documents, one case per document with K/V expanded to the query heads, times summed; backward at "
                  f"key split {args.workload_splits!r} ('pt': PyTorch's own). A `volta-*` column is that backend's "
                  "row of --volta-json (measured in the same lease); `speed-up`: CUTLASS's time over that backend's.",
                  ""] + workload_table(workload_rows(result, args)) + [""]
    for title, tag, table in groups:
        rows = [r for r in cases if r.get("tag") == tag]
        if rows:
            lines += [f"{title}:", ""] + table(rows) + [""]
    other = [r for r in cases if r.get("tag") not in known]
    if other:
        lines += ["Other cases:", ""] + train_table(other) + [""]
    errors = [r for r in cases if r.get("error")] + result["fatal"]
    if errors:
        lines += ["Errors:", ""] + [f"- `{r.get('spec', r.get('type'))}`: {r['error']}" for r in errors] + [""]
    summary = result.get("summary")
    lines.append(f"summary: {summary['cases']} cases, {summary['failed']} failed verification, {summary['errors']} "
                 "could not run" if summary else "summary: missing (the harness did not finish)")
    return "\n".join(lines) + "\n"


def plot(result: dict, out: Path) -> list[Path]:
    """TFLOP/s against N (training shapes, one panel per pass x head_dim x causal) and GB/s against N_k (decoding, one
    panel per batch x head_dim), with volta_train.bench.plot_panels."""
    if str(REPO) not in sys.path:  # run as lab/bench_cutlass_sm70.py from a checkout that is not installed
        sys.path.insert(0, str(REPO))
    try:
        from volta_train.bench import plot_panels
    except ImportError as error:  # no matplotlib / volta_train: tables only
        print(f"plot: skipped ({error})", file=sys.stderr)
        return []
    title_gpu = (result.get("environment") or {}).get("gpu", "GPU")
    written = []
    train = []
    for r in result["cases"]:
        if r.get("tag") not in ("train", None) or r.get("error"):
            continue
        base = {k: r[k] for k in ("pass", "head_dim", "causal", "seqlen_q")}
        if r.get("tflops") is not None:
            train.append(dict(base, backend="cutlass-sm70" + (" best split" if r["pass"] == "bwd" else ""),
                              tflops=r["tflops"]))
        if r.get("tflops_split1") is not None:
            train.append(dict(base, backend="cutlass-sm70 split 1", tflops=r["tflops_split1"]))
        if r.get("tflops_pytorch_split") is not None:
            train.append(dict(base, backend="cutlass-sm70 PyTorch's split", tflops=r["tflops_pytorch_split"]))
    panel = lambda r: (r["pass"], r["head_dim"], r["causal"])  # noqa: E731
    path = plot_panels(train, out / f"{STEM}_train.png", f"CUTLASS Sm70 attention on {title_gpu}",
                       sorted({panel(r) for r in train}), panel, "seqlen_q", "tflops",
                       lambda k: f"{k[0]}, head_dim {k[1]}, {'causal' if k[2] else 'full'}", "N (seqlen)", "TFLOP/s")
    if path:
        written.append(path)
    decode = [dict(r, backend="cutlass-sm70") for r in result["cases"]
              if r.get("tag") == "decode" and r.get("gbps") is not None]
    panel = lambda r: (r["batch"], r["head_dim"])  # noqa: E731
    path = plot_panels(decode, out / f"{STEM}_decode.png", f"CUTLASS Sm70 decoding on {title_gpu}",
                       sorted({panel(r) for r in decode}), panel, "seqlen_k", "gbps",
                       lambda k: f"batch {k[0]}, head_dim {k[1]}", "cache length N_k", "GB/s of K/V")
    if path:
        written.append(path)
    return written


def write_results(result: dict, out: Path, settings: dict, extra_env: dict | None = None, args=None) -> str:
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(result, extra_env, args)
    (out / f"{STEM}.md").write_text(table, encoding="utf-8")
    (out / f"{STEM}.json").write_text(json.dumps({"settings": settings, "extra_environment": extra_env or {},
                                                  **result}, indent=1) + "\n", encoding="utf-8")
    plot(result, out)
    return table


# ------------------------------------------------------------------------------------------------ main

def _bool(text: str) -> bool:
    # volta_train.bench._bool's rule, kept here: this script runs where torch (which volta_train.bench imports) is not
    value = text.lower()
    if value in ("1", "true", "yes", "causal"):
        return True
    if value in ("0", "false", "no", "full"):
        return False
    raise argparse.ArgumentTypeError(f"--causal takes true or false, not {text!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", nargs="+", choices=SUITES, default=["all"], help="what to run (default: all)")
    p.add_argument("--binary", type=Path, help="a prebuilt harness; no build")
    p.add_argument("--build-only", action="store_true", help="build the harness and stop")
    p.add_argument("--rebuild", action="store_true", help="build even if the stamp matches")
    p.add_argument("--cutlass", type=Path, help="CUTLASS source root (include/, examples/41_...)")
    p.add_argument("--cutlass-wheel", type=Path, help="an nvidia-cutlass wheel to unpack into the build directory")
    p.add_argument("--build-dir", type=Path, default=DEFAULT_BUILD)
    p.add_argument("--nvcc", help="nvcc to use (default: $NVCC, PATH, $CUDA_HOME/bin/nvcc)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="parallel compiles")
    p.add_argument("--passes", nargs="+", choices=("fwd", "bwd"), default=["fwd", "bwd"])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256], help="train suite head dims")
    p.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--causal", type=_bool, nargs="+", default=[False, True])
    p.add_argument("--tokens", type=int, default=16384, help="batch x seqlen of the training shapes")
    p.add_argument("--hidden", type=int, default=2048, help="heads x head_dim of the training shapes")
    p.add_argument("--splits", default="1-8+pt", help="backward key splits: '+'-joined ints, ranges a-b, pt")
    p.add_argument("--workload", default="llama3-8b", help="workload suite: a volta_train.bench workload")
    p.add_argument("--workload-splits", default="pt", help="workload suite: backward key splits (default PyTorch's)")
    p.add_argument("--volta-json", type=Path, help="workload suite: bench.json of `volta-train bench --workload` "
                   "from the same lease, for the ratio columns")
    p.add_argument("--decode-head-dims", type=int, nargs="+", default=[128, 256])
    p.add_argument("--decode-seqlens", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--decode-batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--decode-heads", type=int, default=32, help="query heads = K/V heads (GQA expanded)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--bwd-warmup", type=int, default=2)
    p.add_argument("--bwd-repeats", type=int, default=5)
    p.add_argument("--input-sets", type=int, default=0, help="0: enough to exceed twice the L2 cache")
    p.add_argument("--no-verify", dest="verify", action="store_false")
    p.add_argument("--verify-heads", type=int, default=2)
    p.add_argument("--tol", type=float, default=2e-2)
    p.add_argument("--timeout", type=float, default=0, help="stop the harness after this many seconds (0: never)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")) / "cutlass_sm70",
                   help="output directory (default: $OUT/cutlass_sm70 or bench_out/cutlass_sm70)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("head_dims", "seqlens", "decode_head_dims", "decode_seqlens", "decode_batches"):
        if any(v <= 0 for v in getattr(args, name)):
            print(f"error: --{name.replace('_', '-')} must be positive, got {getattr(args, name)}", file=sys.stderr)
            return 2
    try:
        check, cases = suite_cases(args)
        extra = {"python": platform.python_version()}
        if args.binary is not None:
            if not args.binary.is_file():
                print(f"error: --binary {args.binary}: no such file", file=sys.stderr)
                return 2
            binary = args.binary
            extra["harness"] = f"{binary} (prebuilt)"
        else:
            nvcc = find_nvcc(args.nvcc)
            cutlass = find_cutlass(args.cutlass, args.cutlass_wheel, args.build_dir)
            binary = build(nvcc, cutlass, args.build_dir, args.jobs, force=args.rebuild)
            extra["harness"] = f"{binary} (built here, {' '.join(NVCC_FLAGS)})"
            if args.build_only:
                return 0
    except SystemExit as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if not check and not cases:
        print("error: the chosen suites give no case", file=sys.stderr)
        return 2
    try:
        result, returncode = run_harness(binary, check, cases, args, args.out)
    except OSError as error:  # not executable, wrong architecture
        print(f"error: cannot run the harness {binary}: {error}", file=sys.stderr)
        return 2
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    table = write_results(result, args.out, settings, extra, args)
    print(table)
    print(f"wrote {args.out / (STEM + '.md')}, .json, .jsonl, _train.png, _decode.png", file=sys.stderr)
    status = exit_status(result, returncode)
    if returncode not in (0, 1, None):
        print(f"harness exited with status {returncode}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
