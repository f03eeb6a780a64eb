#!/usr/bin/env python3
"""The CUTLASS Sm70 attention kernels (lab/cutlass_sm70/instance.cu) compiled for sm_70 and put through the static
V100 pipe model (shared/tools/v100model/sass_cost.py), as shared/tools/v100model/README.md did for its "Results:
CUTLASS example 41 Sm70 kernels": the rows of lab/v100_estimate.py's CUTLASS_SM70 come from here.

    python3 lab/cutlass_sm70_sass.py --out DIR [--flags example|harness] [--cutlass DIR] [--check]

No GPU. For each instance: nvcc 13 ``-ptx`` for compute_75 (CUDA 13 has no sm_70), the PTX retargeted to sm_70 / PTX
8.8 (``retarget_ptx``), ptxas 12.9 ``-O3 -v`` (registers, spills) into a cubin; ``sizeof(SharedStorage)`` and the
threads per CTA are read from the PTX of a second compile that adds them as a ``__device__`` constant. sass_cost.py
then runs on the cubin with ``--ptxas-log`` and a ``--meta`` line holding the shared memory, the threads and the trip
counts of the GEMM loops, which depend on head_dim at run time: ``gemm_schedule`` gives them per GEMM (k-loop trips of
32, CUTLASS's ThreadK for Sm70 f16; a column loop over output tiles where kMaxK spans more than one), ``loop_trips``
matches them to the loops found in the SASS (in code order) and refuses a kernel whose loop nest does not fit, and
the HMMA per iteration are checked against the FLOP arithmetic (2 GEMMs of block_q x block_k x d forward, 5 backward,
256 FMA per HMMA step).

``--flags example`` (default) is the README's build: the forward with CUTLASS example 41's own kSupportsDropout =
kSupportsBias = false (``-DSM70_FWD_EXAMPLE_FLAGS``) and no ``-DNDEBUG``, so CUTLASS's device ``assert``s stay in.
``--flags harness`` is what the harness builds for sm_90 (bench_cutlass_sm70.py): PyTorch's template arguments
(bias and dropout support in the forward, without HAS_PYTORCH's Philox code) and ``-DNDEBUG`` (PyTorch's release
builds define it; c10's CUDA_KERNEL_ASSERT exists because of it). ``--check`` compares every row that
v100_estimate.CUTLASS_SM70 also has and exits 1 on a difference.

Writes DIR/cutlass_sm70_sass.md (the table, in the README's columns), DIR/cutlass_sm70_sass.json (rows in
CUTLASS_SM70's keys) and, per row, sass_cost's full report (DIR/<row>.txt); the build files stay in DIR/build.
Committed tables: lab/results/cutlass_sm70_sass_example.md and _harness.md (summarised in docs/performance.md, "V100
estimate against CUTLASS Sm70"). About 1.5 min on 2 cores.
Tools: $NVCC or nvcc (13), ptxas 12.x and cuobjdump 12.x as sass_cost finds them (~/.cache/v100tools:
shared/tools/v100model/setup_tools.sh), CUTLASS as bench_cutlass_sm70.py finds it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
HARNESS_DIR = REPO / "lab" / "cutlass_sm70"
THREAD_K = 32  # example 41's GemmType::ThreadK for Sm70 f16 tensor ops (gemm_kernel_utils.h): one k-loop trip
FMA_PER_HMMA = 256  # one HMMA.884 step (sass_cost README)
FLAGS = {"example": ["-DSM70_FWD_EXAMPLE_FLAGS"], "harness": ["-DNDEBUG"]}
NVCC_FLAGS = ["-std=c++17", "-O3", "--expt-relaxed-constexpr", "-diag-suppress", "940", "-arch=compute_75", "-ptx"]
# (instance.cu's SM70_INSTANCE, head_dim): the README's five rows, then head_dim 256 (PyTorch's kernels for d > 128)
ROWS = ((0, 64), (2, 128), (1, 128), (4, 64), (6, 128), (2, 256), (7, 256))
META_SOURCE = ('#include "instance.cu"\n'
               'extern "C" __device__ const unsigned long long sm70_sass_meta[2] = '
               '{sizeof(Kernel::SharedStorage), Kernel::kNumThreads};\n')


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "lab" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------------ pure parts

def retarget_ptx(text: str) -> str:
    """nvcc 13's compute_75 PTX made acceptable to ptxas 12.9 for sm_70: `.target sm_70`, `.version 8.8`, and no
    `.L2::128B` prefetch hints (CUTLASS's arch/memory.h emits them only when __CUDA_ARCH__ >= 750; a native sm_70
    build has the plain loads)."""
    text, targets = re.subn(r"^\.target sm_75$", ".target sm_70", text, flags=re.M)
    text, versions = re.subn(r"^\.version \d+\.\d+$", ".version 8.8", text, flags=re.M)
    if targets != 1 or versions != 1:
        raise ValueError(f"not nvcc's compute_75 PTX: {targets} '.target sm_75' and {versions} '.version' lines "
                         "(one of each expected)")
    return re.sub(r"\.L2::(?:64|128|256)B\b", "", text)


def parse_meta_ptx(text: str) -> tuple[int, int]:
    """(sizeof(SharedStorage), kNumThreads) from the PTX of META_SOURCE: the constant is a little-endian byte list."""
    match = re.search(r"sm70_sass_meta\[16\]\s*=\s*\{([\d,\s]*)\}", text)
    if match is None:
        raise ValueError("no 'sm70_sass_meta[16] = {...}' initialiser in the PTX")
    raw = bytes(int(b) for b in match.group(1).replace(" ", "").split(",") if b) if match.group(1).strip() else b""
    raw = raw.ljust(16, b"\0")
    return int.from_bytes(raw[:8], "little"), int.from_bytes(raw[8:], "little")


def kernel_shape(mangled: str) -> tuple[str, int, int, int]:
    """(pass, block_q, block_k, kMaxK) from the mangled name: the first three integer template arguments are
    kQueriesPerBlock, kKeysPerBlock, kMaxK (forward) or kBlockSizeI, kBlockSizeJ, kMaxK (backward)."""
    kind = "bwd" if "AttentionBackwardKernel" in mangled else "fwd" if "AttentionKernel" in mangled else None
    ints = [int(x) for x in re.findall(r"Li(\d+)E", mangled)]
    if kind is None or len(ints) < 3:
        raise ValueError(f"{mangled}: not an example-41 AttentionKernel / AttentionBackwardKernel")
    return kind, ints[0], ints[1], ints[2]


def gemm_schedule(kind: str, block_q: int, block_k: int, max_k: int, head_dim: int) -> list[tuple[int, int | None]]:
    """(k-loop trips, column-loop trips or None) of each GEMM of one main-loop iteration, in code order
    (kernel_forward.h / kernel_backward.h). A GEMM whose output is head_dim wide runs over it in tiles of its
    ThreadblockShape::kN; that loop exists in the code only where kMaxK spans more than one tile."""
    if head_dim < 1 or head_dim > max_k:
        raise ValueError(f"head_dim {head_dim}: accepted 1..kMaxK ({max_k})")

    def cols(n: int) -> int | None:
        return math.ceil(head_dim / n) if math.ceil(max_k / n) > 1 else None

    over_d = (math.ceil(head_dim / THREAD_K), None)
    if kind == "fwd":  # MM0 = Q K^T (k: head_dim), MM1 = P V (k: the key block, N tiles of block_k)
        return [over_d, (block_k // THREAD_K, cols(block_k))]
    if kind == "bwd":  # I = block_q, J = block_k: K Q^T, dV += P^T dO, dP = dO V^T, dQ += dS K, dK += dS^T Q
        return [over_d, (block_q // THREAD_K, cols(block_q)), over_d, (block_k // THREAD_K, cols(block_k)),
                (block_q // THREAD_K, cols(block_q))]
    raise ValueError(f"kind {kind!r}: accepted 'fwd', 'bwd'")


def expected_hmma(kind: str, block_q: int, block_k: int, head_dim: int, threads: int) -> float:
    """HMMA steps per warp per main-loop iteration that the FLOPs need: 2 (fwd) or 5 (bwd) GEMMs of
    block_q x block_k x head_dim, 256 FMA per step, spread over the CTA's warps."""
    return (2 if kind == "fwd" else 5) * block_q * block_k * head_dim / (threads // 32) / FMA_PER_HMMA


def loop_trips(sass_cost, name: str, instrs, schedule) -> dict[int, int]:
    """{loop header address: trips} for the GEMM loops inside the kernel's main loop (sass_cost's max-HMMA loop):
    the innermost HMMA loops in address order are the GEMMs' k-loops; an HMMA loop around one of them, below the main
    loop, is its column loop. Raises where the loop nest does not match ``schedule``."""
    res, blocks, _dom, loops = sass_cost.analyse_function(name, instrs, SimpleNamespace(trips={}, loop=None,
                                                                                        imad_wide_passes=2))
    if not res.get("main_loop"):
        raise ValueError(f"{name}: no loop")
    addr = {id(lp): blocks[lp.header].start for lp in loops}
    hmma = {entry["header"]: entry["hmma"] for entry in res["loops"]}
    main = next(lp for lp in loops if addr[id(lp)] == res["main_loop"]["header"])

    def below_main(lp) -> bool:
        p = lp.parent
        while p is not None and p is not main:
            p = p.parent
        return p is main

    gemm = [lp for lp in loops if below_main(lp) and hmma[addr[id(lp)]] > 0]
    k_loops = sorted((lp for lp in gemm if not any(c in gemm for c in lp.children)), key=lambda lp: addr[id(lp)])
    if len(k_loops) != len(schedule):
        raise ValueError(f"{name}: {len(k_loops)} innermost HMMA loops in the main loop, {len(schedule)} GEMMs "
                         "expected")
    trips = {}
    for lp, (k_trips, col_trips) in zip(k_loops, schedule):
        trips[addr[id(lp)]] = k_trips
        outer = lp.parent if lp.parent is not main and lp.parent in gemm else None
        if (outer is None) != (col_trips is None):
            raise ValueError(f"{name}: the k-loop at {addr[id(lp)]:#x} " + ("has a column loop around it, none "
                             "expected" if outer is not None else "has no column loop around it, one expected"))
        if outer is not None:
            trips[addr[id(outer)]] = col_trips
    left = {addr[id(lp)] for lp in gemm} - set(trips)
    if left:
        raise ValueError(f"{name}: HMMA loops not matched to a GEMM: {', '.join(f'{a:#x}' for a in sorted(left))}")
    return trips


def must_view_hmma(sass_cost, name: str, instrs, trips: dict[int, int]) -> float:
    """HMMA per iteration in sass_cost's must view with these trips. Every GEMM runs on every iteration, so a must
    view with fewer HMMA than the body has judged a GEMM's loop conditional and undercounts the iteration."""
    res, *_ = sass_cost.analyse_function(name, instrs, SimpleNamespace(trips=trips, loop=None, imad_wide_passes=2))
    return res["main_loop"]["must"].hmma


def row_label(kind: str, block_q: int, block_k: int, max_k: int) -> str:
    """The kernel's name in v100_estimate.CUTLASS_SM70."""
    return f"CUTLASS {kind} {block_q}x{block_k} kMaxK={'inf' if max_k >= 65536 else max_k}"


def table_entry(label: str, kind: str, block: tuple[int, int], head_dim: int, threads: int, js: dict) -> dict:
    """A CUTLASS_SM70 entry from sass_cost's JSON line."""
    return dict(kernel=label, pass_name=kind, head_dim=head_dim, block=block, regs=js["regs"],
                spills=f"{js['spill_st']}/{js['spill_ld']}", ctas_per_sm=js["ctas_per_sm"], warps_per_cta=threads // 32,
                hmma_per_iter=round(js["counts"]["hmma"]), instr_body=round(js["instr_per_iter"]),
                instr_must=round(js["must_instr_per_iter"]), tc_util_body=round(js["tc_util"], 3),
                tc_util_must=round(js["tc_util_must"], 3), bound_body=js["bound_pipe"])


def compare(entry: dict, table: list[dict]) -> str | None:
    """'' when ``table`` (CUTLASS_SM70) has the same row, the differences when it differs, None when it has none."""
    same = [t for t in table if t["kernel"] == entry["kernel"] and t["head_dim"] == entry["head_dim"]]
    if not same:
        return None
    diffs = []
    for key, theirs in same[0].items():
        ours = entry.get(key)
        if isinstance(theirs, float):
            equal = ours is not None and abs(ours - theirs) <= 1.5e-3
        else:
            equal = (tuple(ours) if isinstance(ours, (list, tuple)) else ours) == \
                (tuple(theirs) if isinstance(theirs, (list, tuple)) else theirs)
        if not equal:
            diffs.append(f"{key} {ours} (table {theirs})")
    return "; ".join(diffs)


# ------------------------------------------------------------------------------------------------ build, model

def run(cmd: list[str], what: str) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{what} failed ({done.returncode}):\n{done.stdout}{done.stderr}"[-4000:])
    return done


def build_instance(i: int, flags: str, nvcc: str, ptxas: str, cutlass: Path, build: Path) -> dict:
    includes = ["-I", HARNESS_DIR / "compat", "-I", HARNESS_DIR, "-I", cutlass / "include",
                "-I", cutlass / "examples" / "41_fused_multi_head_attention"]
    common = [nvcc, *NVCC_FLAGS, *FLAGS[flags], *includes, f"-DSM70_INSTANCE={i}"]
    ptx = build / f"instance{i}.ptx"
    run([*common, HARNESS_DIR / "instance.cu", "-o", ptx], f"nvcc instance {i}")
    ptx70 = build / f"instance{i}_sm70.ptx"
    ptx70.write_text(retarget_ptx(ptx.read_text()))
    cubin, log = build / f"instance{i}.cubin", build / f"instance{i}.ptxas.log"
    done = run([ptxas, "-arch=sm_70", "-O3", "-v", ptx70, "-o", cubin], f"ptxas instance {i}")
    log.write_text(done.stdout + done.stderr)
    meta_cu = build / f"meta{i}.cu"
    meta_cu.write_text(META_SOURCE)
    run([*common, meta_cu, "-o", build / f"meta{i}.ptx"], f"nvcc meta {i}")
    smem, threads = parse_meta_ptx((build / f"meta{i}.ptx").read_text())
    return {"cubin": cubin, "log": log, "smem_bytes": smem, "threads": threads}


def tool_version(tool: str) -> str:
    out = subprocess.run([tool, "--version"], capture_output=True, text=True).stdout
    match = re.search(r"release (\d+\.\d+)", out)
    return match.group(1) if match else "?"


def markdown(rows: list[dict], info: dict) -> str:
    out = ["# CUTLASS example 41 Sm70 kernels through the V100 pipe model", "",
           f"Generated by `lab/cutlass_sm70_sass.py --flags {info['flags']}` (its docstring has the method): "
           f"nvcc {info['nvcc']} PTX for compute_75, retargeted to sm_70 / PTX 8.8, ptxas {info['ptxas']} `-O3 -v`, "
           f"CUTLASS {info['cutlass']}; `{info['sass_cost']}` with the GEMM loop trips of each head_dim. Per main-loop "
           "iteration and warp; TC util = tensor cycles / bound cycles (x 125 TFLOP/s in brackets).", "",
           "| kernel | d | regs | spill st/ld B | CTA/SM | HMMA/iter | instr body / must | bound (body) | TC util body "
           "| TC util must | v100_estimate.CUTLASS_SM70 |", "|" + " --- |" * 11]
    short = []
    for r in rows:
        e = r["entry"]
        same = r["table"]
        out.append(f"| {e['kernel']} | {e['head_dim']} | {e['regs']} | {e['spills']} | {e['ctas_per_sm']} "
                   f"({r['limited_by']}) | {e['hmma_per_iter']} | {e['instr_body']} / {e['instr_must']} | "
                   f"{e['bound_body']} | {100 * e['tc_util_body']:.1f}% ({125 * e['tc_util_body']:.1f}) | "
                   f"{100 * e['tc_util_must']:.1f}% ({125 * e['tc_util_must']:.1f})"
                   + ("" if r["must_hmma"] == e["hmma_per_iter"] else " (*)") + " | "
                   + ("not in it" if same is None else "same" if same == "" else f"differs: {same}") + " |")
        if r["must_hmma"] != e["hmma_per_iter"]:
            short.append(f"{e['kernel']} d{e['head_dim']}: {r['must_hmma']:g} of {e['hmma_per_iter']}")
    if short:
        out += ["", "(*) The must view leaves a GEMM out (sass_cost judged its loop conditional), so its instruction "
                "count and utilisation undercount the iteration; HMMA in the must view: " + "; ".join(short) + "."]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the table, the JSON and the reports")
    parser.add_argument("--flags", choices=sorted(FLAGS), default="example",
                        help="example: the v100model README's build (default); harness: the harness's")
    parser.add_argument("--cutlass", type=Path, help="CUTLASS source root (default: as bench_cutlass_sm70.py)")
    parser.add_argument("--nvcc", help="nvcc (CUDA 13 or 12; default $NVCC, PATH, $CUDA_HOME)")
    parser.add_argument("--ptxas", help="ptxas 12.x, sm_70-capable (default: as sass_cost finds it)")
    parser.add_argument("--sass-cost", help="shared/tools/v100model/sass_cost.py (default: as v100_estimate.py)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a row differs from CUTLASS_SM70's")
    options = parser.parse_args(argv)

    bench = _load_script("bench_cutlass_sm70")
    estimate = _load_script("v100_estimate")
    sass_cost_path = estimate.find_sass_cost(options.sass_cost)
    sass_cost = estimate.load_sass_cost(sass_cost_path)
    nvcc = bench.find_nvcc(options.nvcc)
    cutlass = bench.find_cutlass(options.cutlass, None, bench.DEFAULT_BUILD)
    ptxas = sass_cost.find_tool("ptxas", options.ptxas)
    cuobjdump = sass_cost.find_tool("cuobjdump")
    for name, path in (("ptxas", ptxas), ("cuobjdump", cuobjdump)):
        if not path or not tool_version(path).startswith("12."):
            raise SystemExit(f"{name}: none of CUDA 12 found ({path}); shared/tools/v100model/setup_tools.sh "
                             f"fetches one" + (" (or give --ptxas)" if name == "ptxas" else " (or set $CUOBJDUMP)"))
    build = options.out / "build"
    build.mkdir(parents=True, exist_ok=True)
    version = (cutlass / "include" / "cutlass" / "version.h").read_text()
    info = {"flags": options.flags, "nvcc": tool_version(nvcc), "ptxas": tool_version(ptxas),
            "cutlass": ".".join(re.search(rf"#define CUTLASS_{k} (\d+)", version).group(1)
                                for k in ("MAJOR", "MINOR", "PATCH")),
            "sass_cost": "shared/tools/v100model/sass_cost.py"}

    built = {}
    for i in sorted({i for i, _ in ROWS}):
        built[i] = build_instance(i, options.flags, nvcc, ptxas, cutlass, build)
        print(f"instance {i}: {built[i]['cubin']}, {built[i]['smem_bytes']} B shared memory, "
              f"{built[i]['threads']} threads", file=sys.stderr)
    rows, mismatch = [], False
    for i, head_dim in ROWS:
        b = built[i]
        sass = run([cuobjdump, "-sass", b["cubin"]], "cuobjdump -sass").stdout
        functions = {n: ins for n, ins in sass_cost.parse_sass_text(sass).items()
                     if any(x.base == "HMMA" for x in ins)}
        if len(functions) != 1:
            raise SystemExit(f"{b['cubin']}: {len(functions)} functions with HMMA, one expected")
        (mangled, instrs), = functions.items()
        kind, block_q, block_k, max_k = kernel_shape(mangled)
        trips = loop_trips(sass_cost, mangled, instrs, gemm_schedule(kind, block_q, block_k, max_k, head_dim))
        must_hmma = must_view_hmma(sass_cost, mangled, instrs, trips)
        label = row_label(kind, block_q, block_k, max_k)
        stem = f"{label[8:].replace(' ', '_').replace('=', '')}_d{head_dim}"
        meta = options.out / f"{stem}.meta.jsonl"
        meta.write_text(json.dumps({"match": re.escape(mangled), "label": f"{label} d{head_dim}",
                                    "smem_bytes": b["smem_bytes"], "threads": b["threads"],
                                    "trips": {f"{a:#x}": n for a, n in sorted(trips.items())}}) + "\n")
        report = run([sys.executable, sass_cost_path, b["cubin"], "--ptxas-log", b["log"], "--meta", meta],
                     "sass_cost").stdout
        (options.out / f"{stem}.txt").write_text(report)
        js = json.loads(next(line[5:] for line in report.splitlines() if line.startswith("JSON ")))
        want = expected_hmma(kind, block_q, block_k, head_dim, b["threads"])
        if js["counts"]["hmma"] != want:
            raise SystemExit(f"{stem}: {js['counts']['hmma']} HMMA per iteration, the FLOPs need {want}: the trip "
                             f"counts {trips} do not fit this kernel")
        entry = table_entry(label, kind, (block_q, block_k), head_dim, b["threads"], js)
        same = compare(entry, list(estimate.CUTLASS_SM70))
        mismatch |= bool(same)
        if must_hmma != js["counts"]["hmma"]:
            print(f"{stem}: the must view holds {must_hmma:g} of the {js['counts']['hmma']:g} HMMA per iteration (a "
                  "GEMM loop judged conditional): its must figures leave that work out", file=sys.stderr)
        rows.append({"entry": entry, "must_hmma": must_hmma, "limited_by": js.get("occ_limited_by"),
                     "smem_bytes": b["smem_bytes"],
                     "trips": {f"{a:#x}": n for a, n in sorted(trips.items())}, "table": same,
                     "instance": i, "mangled": mangled})
    text = markdown(rows, info)
    (options.out / "cutlass_sm70_sass.md").write_text(text)
    (options.out / "cutlass_sm70_sass.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1) + "\n")
    print(text)
    for r in rows:  # CUTLASS_SM70 lines
        print(f"    dict({', '.join(f'{k}={v!r}' for k, v in r['entry'].items())}),"
              + ("" if r["must_hmma"] == r["entry"]["hmma_per_iter"] else "  # must view incomplete"))
    return 1 if options.check and mismatch else 0


if __name__ == "__main__":
    sys.exit(main())
