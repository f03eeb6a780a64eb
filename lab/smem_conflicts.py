#!/usr/bin/env python3
"""Shared-memory bank conflicts of the sm_70 tile table's kernels, measured with Nsight Compute (needs a GPU + ncu).

    python lab/smem_conflicts.py [--out DIR] [--quick] [--sass-ideal]
    python lab/smem_conflicts.py --workload [--quick]     # the launches alone (what ncu profiles)
    python lab/smem_conflicts.py --sass-only --arch 90    # the static SASS check alone (NVRTC + cuobjdump, no GPU)

The workload launches every kernel variant of the V100 tile tables (``call_matrix.table_calls("sm70", ...)``, the calls
lab/sanitize_kernels.py makes too; on a GPU other than a V100 through the launchers' tile overrides) once, on
one dense non-causal call big enough that the main loop dominates (batch 1, 8 heads, seqlen 1024: 16-64 key or query
blocks per CTA), plus one causal forward per head_dim, and first a baseline: the mma probe (tests/kernels/probe_mma.cu), one
m8n8k4 per warp and a known number of shared-memory instructions. Each call runs inside an NVTX range named after it;
the backward's forward output comes from the reference backend, so every profiled launch is one of the plan's.

The driver compiles the variants for the GPU (threads), runs the workload under ``ncu`` (one pass of the few
metrics below, volta_train's kernels only), reads the report back as CSV (``--csv --page raw``) and maps its rows to
the plan by launch order (checked against each row's kernel function and NVTX range). Per launch and op (ld, st):

* requests (``l1tex__t_requests_pipe_lsu_mem_shared_op_*``), wavefronts (``l1tex__data_pipe_lsu_wavefronts_mem_
  shared_op_*``), warp instructions (``smsp__inst_executed_op_shared_*``) and bank conflicts (``l1tex__data_bank_
  conflicts_pipe_lsu_mem_shared_op_*``: the wavefronts beyond the access width's minimum);
* wavefronts per request: 1 for a conflict-free 32-bit access, but 2 for 64-bit and 4 for 128-bit ones (512 bytes
  per warp, 128 bytes per wavefront), so it is no conflict measure for kernels that load 16-byte fragments;
* wavefronts per ideal wavefront, ``wavefronts / (wavefronts - bank conflicts)``: the goal, <= 1.05 for ld and st.
  ``--sass-ideal`` also collects the instrumented ``smsp__sass_l1tex_pipe_lsu_wavefronts_mem_shared{,_ideal}``
  (ld and st together; SASS patching makes the run slower) as a cross-check: the wavefronts the instructions'
  addresses need. Where this ncu lacks the ``_ideal`` one, the counters' ideal (wavefronts - conflicts) stands in. A
  launch whose bank-conflict counter is above the goal while the instrumented count is within it is ``ok (sass;
  counter over)``: on an H100 the counter reads 0-4% above the instrumented count on conflict-free code, varying
  run to run (docs/performance.md).

Does the emulated m8n8k4 (on sm_80+ a CALL of an emulation subroutine) touch shared memory? Statically: every
variant's sm_<arch> SASS (``cuobjdump -sass``) is split into the kernel body and the subroutines its CALLs reach,
and the shared-memory instructions of each are counted (expected: none in the subroutines). Dynamically: the probe's
measured shared instructions must equal its warps times its static LDS/STS count (straight-line code).

Writes ``smem_conflicts.md`` and ``.json`` (and the ncu report, its CSV and the workload log) into --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "tests" / "support")]
import call_matrix  # noqa: E402  (lab/call_matrix.py: the calls that launch every variant)

GOAL = 1.05  # wavefronts per ideal (conflict-free) wavefront, ld and st
KERNEL_REGEX = "regex:flash_|volta_probe_mma"
PROBE_CALL = "baseline_probe_mma"
PROBE_BLOCKS = 528  # 1056 warps: 4 blocks of 2 warps per SM on an H100

OPS = ("ld", "st")
HW_METRICS = {  # key -> metric; requests, wavefronts, instructions and bank conflicts per op
    **{f"{op}_requests": f"l1tex__t_requests_pipe_lsu_mem_shared_op_{op}.sum" for op in OPS},
    **{f"{op}_wavefronts": f"l1tex__data_pipe_lsu_wavefronts_mem_shared_op_{op}.sum" for op in OPS},
    **{f"{op}_instructions": f"smsp__inst_executed_op_shared_{op}.sum" for op in OPS},
    **{f"{op}_conflicts": f"l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_{op}.sum" for op in OPS},
}
SASS_METRICS = {  # instrumented (SASS patching), ld and st together
    "sass_wavefronts": "smsp__sass_l1tex_pipe_lsu_wavefronts_mem_shared.sum",
    "sass_wavefronts_ideal": "smsp__sass_l1tex_pipe_lsu_wavefronts_mem_shared_ideal.sum",
}

SHARED_OPCODES = {"LDS", "STS", "LDSM", "STSM", "ATOMS", "LDGSTS"}
GENERIC_OPCODES = {"LD", "ST", "ATOM"}  # generic addresses: may reach shared memory


# --- the plan: which launches, in which order ---------------------------------------------------------------------


class PlannedLaunch(NamedTuple):
    index: int
    call: str  # the NVTX range (TableCall.name, or PROBE_CALL)
    function: str  # the kernel's function name, as ncu's kernel filter sees it
    variant: object  # volta_train.kernels.variants.KernelVariant


def plan_calls(arch: int, quick: bool = False) -> list:
    """The sm70-table calls of the workload: each variant once (non-causal), then one causal forward per head_dim."""
    from volta_train.kernels import tiles

    head_dims = tiles.SUPPORTED_HEAD_DIMS[1::4] if quick else tiles.SUPPORTED_HEAD_DIMS  # quick: d 32 and 96
    # soft-capping changes no shared-memory access (it is arithmetic on the scores in registers): plain variants only
    calls = call_matrix.table_calls("sm70", arch, head_dims=head_dims, causal=(False,), unique=True, softcap=(False,))
    return calls + call_matrix.table_calls("sm70", arch, head_dims=head_dims, causal=(True,), dropout=(False,),
                                           accums=("fp32",), passes=("fwd",), softcap=(False,))


def launch_plan(arch: int, quick: bool = False) -> list[PlannedLaunch]:
    """Every kernel launch ncu will see, in order: the probe, then the kernels of each call."""
    from probes import PROBE_VARIANT

    plan = [PlannedLaunch(0, PROBE_CALL, function_name(PROBE_VARIANT.name_expressions[0]), PROBE_VARIANT)]
    for call in plan_calls(arch, quick):
        for variant in call.launches:
            plan.append(PlannedLaunch(len(plan), call.name, function_name(variant.name_expressions[0]), variant))
    return plan


def function_name(kernel_name: str) -> str:
    """'flash_fwd_kernel' of 'flash_fwd_kernel<...>' or of ncu's 'void flash_fwd_kernel<...>(AttentionParams)'."""
    match = re.match(r"\s*(?:void\s+)?([A-Za-z_]\w*)", kernel_name)
    return match.group(1) if match else kernel_name.strip()


# --- the workload (runs under ncu) --------------------------------------------------------------------------------


def _workload(quick: bool, batch: int, heads: int, seqlen: int) -> int:
    import torch

    from volta_train import reference
    from volta_train.options import AttentionOptions
    from volta_train.kernels import driver, launch
    from volta_train.kernels.precompile import compile_variants
    from probes import PROBE_SMEM_BYTES, PROBE_THREADS, PROBE_VARIANT, PROBE_WARPS_PER_BLOCK, ProbeParams

    torch.manual_seed(0)
    major, minor = torch.cuda.get_device_capability()
    arch = 10 * major + minor
    plan = launch_plan(arch, quick)
    calls = plan_calls(arch, quick)
    compile_variants([p.variant for p in plan], arch)  # cache hits after the driver's compile
    for p in plan:
        print(f"[launch {p.index}] {p.call} {p.function} {p.variant.name}", flush=True)

    # baseline: the probe, one emulated m8n8k4 per warp and a fixed set of LDS/STS
    warps = PROBE_BLOCKS * PROBE_WARPS_PER_BLOCK
    a = torch.randn(warps * 4, 8, 4, device="cuda").half()
    b = torch.randn(warps * 4, 4, 8, device="cuda").half()
    c = torch.randn(warps * 4, 8, 8, device="cuda")
    d = torch.empty_like(c)
    probe = driver.load_function(PROBE_VARIANT.compile(arch), PROBE_VARIANT.name_expressions[0])
    torch.cuda.nvtx.range_push(PROBE_CALL)
    probe.launch((PROBE_BLOCKS,), (PROBE_THREADS,), PROBE_SMEM_BYTES,
                 [ProbeParams(a.data_ptr(), b.data_ptr(), c.data_ptr(), d.data_ptr(), warps, 1.0)])
    torch.cuda.nvtx.range_pop()

    inputs = {}
    for call in calls:
        prm = AttentionOptions(softmax_scale=call.head_dim ** -0.5, causal=call.causal,
                               dropout_p=0.1 if call.dropout else 0.0, seed=1234, offset=0)
        if call.head_dim not in inputs:
            q, k, v = (torch.randn(batch, seqlen, heads, call.head_dim, device="cuda").half() for _ in range(3))
            # the backward's O and lse from the reference backend: no extra volta_train launch for ncu to count
            out, lse = reference.reference_forward(q, k, v, AttentionOptions(softmax_scale=call.head_dim ** -0.5))
            inputs[call.head_dim] = (q, k, v, out, lse.contiguous(), torch.randn_like(q))
        q, k, v, out, lse, dout = inputs[call.head_dim]
        torch.cuda.nvtx.range_push(call.name)
        if call.pass_name == "fwd":
            launch.forward(q, k, v, None, None, seqlen, seqlen, dataclasses.replace(prm, accum=call.accum), None, **call.overrides)
        else:
            launch.backward(dout, q, k, v, out, lse, None, None, seqlen, seqlen, dataclasses.replace(
                prm, bwd_accum=call.accum, deterministic=call.deterministic), None, **call.overrides)
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    print(f"[workload] {len(plan)} kernel launches ({len(calls)} calls and the probe)", flush=True)
    return 0


# --- ncu ----------------------------------------------------------------------------------------------------------


def find_tool(name: str, env: str) -> str | None:
    """$env, else name on PATH, else /usr/local/cuda/bin/name."""
    if os.environ.get(env):
        return os.environ[env]
    found = shutil.which(name)
    if found:
        return found
    fallback = Path("/usr/local/cuda/bin") / name
    return str(fallback) if fallback.is_file() else None


def available_metrics(query_output: str) -> set[str]:
    """Base metric names (no .sum) listed by ``ncu --query-metrics``."""
    names = set()
    for line in query_output.splitlines():
        token = line.split(maxsplit=1)[0] if line.strip() else ""
        if re.fullmatch(r"[a-z0-9]+__[a-z0-9_]+", token):
            names.add(token)
    return names


def choose_metrics(wanted: dict[str, str], available: set[str] | None) -> tuple[dict[str, str], list[str]]:
    """(the wanted metrics ncu lists, the missing ones); all of them when the listing could not be read."""
    if not available:
        return dict(wanted), []
    kept = {key: metric for key, metric in wanted.items() if metric.rsplit(".", 1)[0] in available}
    return kept, [metric for metric in wanted.values() if metric not in kept.values()]


def parse_value(text: str | None) -> float | None:
    """A raw-page cell: '1,234,567', '12.5' or 'n/a' / '' (None)."""
    if text is None:
        return None
    cleaned = text.strip().replace(",", "")
    try:
        return float(cleaned)
    except ValueError:
        return None


def parse_raw_csv(text: str) -> list[dict]:
    """The rows of ``ncu --csv --page raw``: one dict per profiled launch, in ID order, with 'id', 'kernel',
    'function', 'nvtx' (the innermost push/pop range, or None) and 'metrics' (name -> float or None).

    The text may hold ncu's ==PROF== lines and program output before the header; the header row starts with "ID",
    the units row follows it (empty ID), then one row per launch.
    """
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID",')), None)
    if start is None:
        raise ValueError("no ncu raw-page CSV header (a line starting with '\"ID\",') in the text")
    table = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header = table[0]
    column = {name: i for i, name in enumerate(header)}
    for needed in ("ID", "Kernel Name"):
        if needed not in column:
            raise ValueError(f"ncu CSV header lacks the {needed!r} column: {header}")
    nvtx_columns = [i for i, name in enumerate(header) if "Push/Pop_Range" in name]
    metric_columns = {name: i for i, name in enumerate(header) if re.fullmatch(r"[a-z0-9]+__[\w.]+", name)}
    rows = []
    for cells in table[1:]:
        if len(cells) != len(header) or not cells[column["ID"]].strip().isdigit():
            continue  # the units row, blank lines
        nvtx = None
        for i in nvtx_columns:
            ranges = re.findall(r"<[^>]*>:([^:\"]+):", cells[i])
            nvtx = ranges[-1] if ranges else nvtx
        kernel = cells[column["Kernel Name"]]
        rows.append({
            "id": int(cells[column["ID"]]), "kernel": kernel, "function": function_name(kernel), "nvtx": nvtx,
            "metrics": {name: parse_value(cells[i]) for name, i in metric_columns.items()},
        })
    return sorted(rows, key=lambda r: r["id"])


def match_plan(plan: list[PlannedLaunch], rows: list[dict]) -> list[str]:
    """Problems of mapping rows to the plan by launch order (empty: every row is the planned launch)."""
    problems = []
    if len(rows) != len(plan):
        problems.append(f"ncu profiled {len(rows)} launches, the plan has {len(plan)}")
    for p, row in zip(plan, rows):
        if row["function"] != p.function:
            problems.append(f"launch {p.index}: ncu saw {row['function']}, the plan has {p.function} ({p.call})")
        elif row["nvtx"] is not None and row["nvtx"] != p.call:
            problems.append(f"launch {p.index}: NVTX range {row['nvtx']!r}, the plan has {p.call!r}")
    return problems


def _ratio(numerator, denominator):
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def table_rows(plan: list[PlannedLaunch], rows: list[dict], metrics: dict[str, str], goal: float = GOAL) -> list[dict]:
    """One dict per planned launch: the counts, wavefronts per request, wavefronts per ideal wavefront, verdict."""
    result = []
    for p, row in zip(plan, rows):
        values = {key: row["metrics"].get(metric) for key, metric in metrics.items()}
        entry = {"index": p.index, "call": p.call, "function": p.function, "variant": p.variant.name,
                 "kernel": row["kernel"], "nvtx": row["nvtx"]}
        verdicts = []
        for op in OPS:
            requests, wavefronts = values.get(f"{op}_requests"), values.get(f"{op}_wavefronts")
            conflicts = values.get(f"{op}_conflicts")
            ideal = wavefronts - conflicts if wavefronts is not None and conflicts is not None else None
            excess = _ratio(wavefronts, ideal)
            if wavefronts == 0:
                excess = 1.0  # no accesses of this kind: nothing to conflict
            entry.update({f"{op}_instructions": values.get(f"{op}_instructions"), f"{op}_requests": requests,
                          f"{op}_wavefronts": wavefronts, f"{op}_conflicts": conflicts,
                          f"{op}_wavefronts_per_request": _ratio(wavefronts, requests),
                          f"{op}_wavefronts_per_ideal": excess})
            verdicts.append(None if excess is None else excess <= goal)
        sass_ideal = values.get("sass_wavefronts_ideal")
        if sass_ideal is None and None not in (entry["ld_wavefronts"], entry["st_wavefronts"], entry["ld_conflicts"],
                                               entry["st_conflicts"]):
            # this ncu has no instrumented ideal: the counters' (wavefronts - bank conflicts, ld + st) stands in
            sass_ideal = (entry["ld_wavefronts"] + entry["st_wavefronts"] - entry["ld_conflicts"]
                          - entry["st_conflicts"])
        sass = _ratio(values.get("sass_wavefronts"), sass_ideal)
        entry["sass_wavefronts_per_ideal"] = sass
        if p.call == PROBE_CALL:
            entry["verdict"] = "baseline"  # its store pattern is no tile's: instruction counts only (probe_check)
        elif None in verdicts and sass is not None:  # no bank-conflict counter: the instrumented ld+st ratio
            entry["verdict"] = "ok (sass)" if sass <= goal else f"over {goal} (sass)"
        elif None in verdicts:
            entry["verdict"] = "n/a"
        elif not all(verdicts) and sass is not None and sass <= goal:
            # the counter's excess without a conflicted address: the instrumented count (what the instructions'
            # addresses need) is within the goal; the counter varies run to run by up to 3% on the same code
            entry["verdict"] = "ok (sass; counter over)"
        else:
            entry["verdict"] = "ok" if all(verdicts) else f"over {goal}"
        result.append(entry)
    return result


# --- static SASS: shared-memory instructions of the kernel body and of the subroutines it calls ------------------

_INSTRUCTION = re.compile(r"/\*([0-9a-f]+)\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)([^;]*);")
_HEX = re.compile(r"0x([0-9a-f]+)")


def sass_functions(text: str) -> dict[str, dict[int, tuple[bool, str, str]]]:
    """``cuobjdump -sass`` text -> function name -> address -> (guarded, opcode, operands)."""
    functions, current = {}, None
    for line in text.splitlines():
        header = re.search(r"Function\s*:\s*(\S+)", line)
        if header:
            current = functions.setdefault(header.group(1), {})
            continue
        match = _INSTRUCTION.search(line)
        if match and current is not None:
            guard = (match.group(2) or "").strip()
            current[int(match.group(1), 16)] = (guard not in ("", "@PT"), match.group(3), match.group(4).strip())
    return functions


def _successors(address: int, instruction: tuple[bool, str, str], next_address: int | None) -> list[int]:
    guarded, opcode, operands = instruction
    base = opcode.split(".")[0]
    targets = [int(h, 16) for h in _HEX.findall(operands)]
    if base in ("EXIT", "RET", "KILL"):
        return [next_address] if guarded and next_address is not None else []
    if base in ("BRA", "JMP") and targets:
        # taken always only when unguarded with the target as sole operand: "BRA P4, 0x..", "BRA.DIV UR4, 0x.." and
        # "@P0 BRA 0x.." may fall through
        conditional = guarded or not re.fullmatch(r"0x[0-9a-f]+", operands)
        return [targets[-1]] + ([next_address] if conditional and next_address is not None else [])
    if base in ("BRX", "JMX"):  # indirect: its targets are not in the text
        return [next_address] if next_address is not None else []
    return [next_address] if next_address is not None else []


def _reach(code: dict, start: int, order: list[int]) -> tuple[set[int], list[int]]:
    """Addresses reachable from start without entering CALLs (a CALL falls through), and the CALL targets seen."""
    following = {a: (order[i + 1] if i + 1 < len(order) else None) for i, a in enumerate(order)}
    seen, stack, callees = set(), [start], []
    while stack:
        address = stack.pop()
        if address is None or address in seen or address not in code:
            continue
        seen.add(address)
        instruction = code[address]
        if instruction[1].split(".")[0] == "CALL":
            targets = _HEX.findall(instruction[2])
            if targets:
                callees.append(int(targets[-1], 16))
        stack.extend(_successors(address, instruction, following[address]))
    return seen, callees


def shared_op_counts(code: dict[int, tuple[bool, str, str]]) -> dict:
    """Shared-memory (and generic) instructions of a kernel's body and of the subroutines its CALLs reach."""
    order = sorted(code)
    body, pending = _reach(code, order[0], order) if order else (set(), [])
    subroutines, reached = {}, set()
    while pending:
        target = pending.pop()
        if target in subroutines:
            continue
        addresses, more = _reach(code, target, order)
        subroutines[target] = addresses - body
        reached |= subroutines[target]
        pending.extend(more)

    def count(addresses):
        kinds = Counter(code[a][1] for a in addresses)
        shared = {op: n for op, n in kinds.items() if op.split(".")[0] in SHARED_OPCODES}
        generic = {op: n for op, n in kinds.items() if op.split(".")[0] in GENERIC_OPCODES}
        return {"instructions": len(addresses), "shared": dict(sorted(shared.items())),
                "generic": dict(sorted(generic.items()))}

    calls = sum(1 for a in body | reached if code[a][1].split(".")[0] == "CALL")
    unreached = set(code) - body - reached  # alignment NOPs; anything else would be a gap in this walk
    return {"body": count(body), "calls": calls,
            "subroutines": {f"0x{t:x}": count(a) for t, a in sorted(subroutines.items())},
            "unreached": count(unreached)}


def static_check(variants, arch: int, cuobjdump: str, workdir: Path, threads: int = 16) -> dict[str, dict]:
    """Per variant (name -> result): compile for arch (kernel cache), disassemble, count shared instructions."""
    workdir.mkdir(parents=True, exist_ok=True)
    distinct = {v.name: v for v in variants}

    def one(variant):
        program = variant.compile(arch)
        mangled = program.lowered_name(variant.name_expressions[0])
        cubin = workdir / f"{variant.name}.sm_{arch}.cubin"
        cubin.write_bytes(program.cubin)
        proc = subprocess.run([cuobjdump, "-sass", str(cubin)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
        functions = sass_functions(proc.stdout)
        if mangled not in functions:
            return variant.name, {"error": f"cuobjdump -sass printed no function {mangled} (exit {proc.returncode}: "
                                           f"{proc.stderr.strip()[:200]})"}
        result = shared_op_counts(functions[mangled])
        result["subroutine_shared"] = sum(sum(s["shared"].values()) + sum(s["generic"].values())
                                          for s in result["subroutines"].values())
        unreached = result["unreached"]
        if unreached["shared"] or unreached["generic"]:
            result["error"] = (f"{sum(unreached['shared'].values()) + sum(unreached['generic'].values())} shared or "
                               "generic instructions the control-flow walk did not reach: static count incomplete")
        return variant.name, result

    with ThreadPoolExecutor(threads) as pool:
        return dict(pool.map(one, distinct.values()))


def probe_check(row: dict | None, static: dict | None, warps: int) -> dict:
    """The probe's measured shared instructions against warps x its static LDS/STS count (all of body and
    subroutines: straight-line code, every warp runs each once)."""
    if row is None or static is None or "error" in static:
        return {"verdict": "n/a", "why": "no probe row or no static count"}
    expected = {}
    for op, prefixes in (("ld", ("LDS", "LDSM")), ("st", ("STS", "STSM"))):
        parts = [static["body"]] + list(static["subroutines"].values())
        per_warp = sum(n for part in parts for code, n in part["shared"].items() if code.split(".")[0] in prefixes)
        expected[op] = per_warp * warps
    measured = {op: row.get(f"{op}_instructions") for op in OPS}
    ok = all(measured[op] is not None and measured[op] == expected[op] for op in OPS)
    return {"warps": warps, "expected": expected, "measured": measured,
            "verdict": "ok" if ok else ("n/a" if None in measured.values() else "MISMATCH")}


# --- report -------------------------------------------------------------------------------------------------------


def _fmt(value, digits: int = 0) -> str:
    if value is None:
        return "n/a"
    return f"{value:,.{digits}f}" if digits else f"{int(round(value)):,}"


def markdown(rows: list[dict], static: dict[str, dict], probe: dict, meta: dict, goal: float = GOAL) -> str:
    lines = [f"# Shared-memory bank conflicts of the sm_70 tiles ({meta.get('device', '?')})", ""]
    lines += [f"{k}: {v}  " for k, v in meta.items()] + [""]
    lines += ["Per launch (whole kernel; main loop dominates). `wf/req`: wavefronts per request (4 for a "
              "conflict-free 128-bit access); `wf/ideal`: wavefronts / (wavefronts - bank conflicts), the goal "
              f"<= {goal}.", ""]
    sass = any(r.get("sass_wavefronts_per_ideal") is not None for r in rows)
    if sass:
        lines += ["`instrumented wf/ideal`: the wavefronts the instructions' addresses need, counted by SASS "
                  "instrumentation (`smsp__sass_l1tex_pipe_lsu_wavefronts_mem_shared`, ld + st), over the ideal "
                  "(the instrumented ideal where this ncu has it, else the counters' wavefronts - bank conflicts). "
                  "`ok (sass; counter over)`: the bank-conflict counter is above the goal but no address conflicts "
                  "(the counter varies run to run by up to 3% on the same code).", ""]
    head = ["#", "call (NVTX)", "variant", "ld inst", "ld req", "ld wf", "ld wf/req", "ld conflicts", "ld wf/ideal",
            "st inst", "st req", "st wf", "st wf/req", "st conflicts", "st wf/ideal"]
    head += ["instrumented wf/ideal (ld+st)"] if sass else []
    head += ["verdict"]
    lines += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        cells = [str(r["index"]), r["call"], r["variant"]]
        for op in OPS:
            cells += [_fmt(r[f"{op}_instructions"]), _fmt(r[f"{op}_requests"]), _fmt(r[f"{op}_wavefronts"]),
                      _fmt(r[f"{op}_wavefronts_per_request"], 2), _fmt(r[f"{op}_conflicts"]),
                      _fmt(r[f"{op}_wavefronts_per_ideal"], 3)]
        cells += [_fmt(r["sass_wavefronts_per_ideal"], 3)] if sass else []
        cells += [r["verdict"]]
        lines.append("| " + " | ".join(cells) + " |")
    if static:
        lines += ["", "Static SASS (`cuobjdump -sass`): shared-memory instructions of the kernel body and of the "
                      "subroutines its CALLs reach (the emulated m8n8k4 among them).", "",
                  "| variant | CALLs | body: shared instructions | subroutines (instructions) | "
                  "shared or generic instructions in subroutines |", "| --- | --- | --- | --- | --- |"]
        for name, s in sorted(static.items()):
            if "error" in s:
                lines.append(f"| {name} | | {s['error']} | | |")
                continue
            body = ", ".join(f"{n} {op}" for op, n in s["body"]["shared"].items()) or "none"
            subs = ", ".join(f"{k}: {v['instructions']}" for k, v in s["subroutines"].items()) or "none"
            lines.append(f"| {name} | {s['calls']} | {body} | {subs} | {s['subroutine_shared']} |")
    lines += ["", f"Probe baseline ({probe.get('warps', '?')} warps, one emulated m8n8k4 each): "
                  f"measured shared instructions {probe.get('measured')} against warps x static LDS/STS "
                  f"{probe.get('expected')}: {probe['verdict']}"]
    return "\n".join(lines) + "\n"


def summary(rows: list[dict], static: dict[str, dict], probe: dict, problems: list[str]) -> tuple[bool, str]:
    rows = [r for r in rows if r["call"] != PROBE_CALL]
    over = [r for r in rows if not r["verdict"].startswith("ok")]
    subroutine_shared = {n: s.get("subroutine_shared") for n, s in static.items() if s.get("subroutine_shared")}
    errors = [n for n, s in static.items() if "error" in s]
    ok = not problems and not over and not subroutine_shared and not errors and probe["verdict"] == "ok"
    parts = [f"{len(rows) - len(over)}/{len(rows)} launches within the goal"]
    parts += [f"{len(subroutine_shared)} variants with shared instructions in subroutines"] if subroutine_shared else []
    parts += [f"static check failed for {len(errors)} variants"] if errors else []
    parts += [f"probe baseline {probe['verdict']}"] + ([f"{len(problems)} mapping problems"] if problems else [])
    return ok, "smem_conflicts: " + ("OK" if ok else "FINDINGS") + " (" + "; ".join(parts) + ")"


# --- driver -------------------------------------------------------------------------------------------------------


def _run_static(plan, arch: int, out: Path) -> dict:
    cuobjdump = find_tool("cuobjdump", "CUOBJDUMP")
    if cuobjdump is None:
        print("smem_conflicts: no cuobjdump (PATH, /usr/local/cuda/bin or $CUOBJDUMP): static SASS check skipped",
              flush=True)
        return {}
    started = time.time()
    static = static_check([p.variant for p in plan], arch, cuobjdump, out / "cubins")
    print(f"static SASS check of {len(static)} variants in {time.time() - started:.0f} s", flush=True)
    return static


def _sass_only(args) -> int:
    from volta_train.kernels.nvrtc import normalize_arch

    arch = normalize_arch(args.arch)
    plan = launch_plan(arch, args.quick)
    args.out.mkdir(parents=True, exist_ok=True)
    static = _run_static(plan, arch, args.out)
    if not static:
        return 2
    (args.out / "smem_static.json").write_text(json.dumps(static, indent=2))
    bad = {n: s for n, s in static.items() if "error" in s or s.get("subroutine_shared")}
    for name, s in sorted(static.items()):
        if "error" in s:
            print(f"{name}: {s['error']}")
            continue
        body = sum(s["body"]["shared"].values())
        print(f"{name}: {body} shared instructions in the body; {len(s['subroutines'])} subroutines, "
              f"{s['subroutine_shared']} shared or generic instructions in them")
    print(f"smem_conflicts --sass-only: {len(static) - len(bad)}/{len(static)} variants without shared "
          f"instructions in subroutines")
    return 1 if bad else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "smem_conflicts_out")))
    parser.add_argument("--workload", action="store_true", help="run the launches only (what ncu profiles)")
    parser.add_argument("--sass-only", action="store_true", help="static SASS check only (no GPU; needs --arch)")
    parser.add_argument("--arch", default=None, help="target of --sass-only, e.g. 90 or sm_90")
    parser.add_argument("--quick", action="store_true", help="head dims 32 and 96 only (a smoke run)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seqlen", type=int, default=1024)
    parser.add_argument("--sass-ideal", action="store_true",
                        help="also collect the instrumented ideal-wavefront metrics (slower: SASS patching)")
    parser.add_argument("--goal", type=float, default=GOAL, help=f"wavefronts per ideal wavefront (default {GOAL})")
    parser.add_argument("--ncu-timeout", type=float, default=600.0, help="seconds the ncu run may take")
    args = parser.parse_args()
    for name in ("batch", "heads", "seqlen"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: {getattr(args, name)}; accepted: 1 or more")
    if args.workload:
        return _workload(args.quick, args.batch, args.heads, args.seqlen)
    if args.sass_only:
        if args.arch is None:
            parser.error("--sass-only needs --arch (e.g. 90)")
        return _sass_only(args)
    if args.arch is not None:
        parser.error("--arch goes with --sass-only; the ncu run profiles the GPU present")

    ncu = find_tool("ncu", "NCU")
    if ncu is None:
        print("smem_conflicts: Nsight Compute's ncu was not found (PATH, /usr/local/cuda/bin or $NCU); install Nsight "
              "Compute or point $NCU at it", file=sys.stderr)
        return 2
    import torch

    from volta_train.kernels.nvrtc import find_nvrtc
    from volta_train.kernels.precompile import compile_variants

    if not torch.cuda.is_available():
        print("smem_conflicts: no CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    major, minor = torch.cuda.get_device_capability()
    arch = 10 * major + minor
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    plan = launch_plan(arch, args.quick)
    started = time.time()
    count = compile_variants([p.variant for p in plan], arch)
    print(f"compiled {count} variants for sm_{arch} in {time.time() - started:.0f} s", flush=True)

    query = subprocess.run([ncu, "--query-metrics"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    listed = available_metrics(query.stdout)
    wanted = {**HW_METRICS, **(SASS_METRICS if args.sass_ideal else {})}
    metrics, missing = choose_metrics(wanted, listed)
    if missing:
        shared = sorted(m for m in listed if "shared" in m)
        print(f"smem_conflicts: this ncu lists no {', '.join(missing)}; going on without. Its shared-memory "
              f"metrics:\n  " + "\n  ".join(shared), flush=True)
    if not listed:
        print(f"smem_conflicts: could not read `ncu --query-metrics` (exit {query.returncode}); asking for every "
              "metric", flush=True)

    report = out / "smem_conflicts"
    workload = [sys.executable, os.path.abspath(__file__), "--workload", "--batch", str(args.batch), "--heads",
                str(args.heads), "--seqlen", str(args.seqlen)] + (["--quick"] if args.quick else [])
    command = [ncu, "--nvtx", "--kernel-name", KERNEL_REGEX, "--metrics", ",".join(metrics.values()),
               "--cache-control", "none", "--clock-control", "none", "-f", "-o", str(report)] + workload
    print("+ " + " ".join(command), flush=True)
    started = time.time()
    try:
        run = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             timeout=args.ncu_timeout)
        log, exit_code = run.stdout, run.returncode
    except subprocess.TimeoutExpired as stopped:
        partial = stopped.stdout or b""
        log = (partial.decode() if isinstance(partial, bytes) else partial) + f"\n[stopped after {args.ncu_timeout} s]"
        exit_code = "timeout"
    (out / "workload.log").write_text(log)
    print(f"ncu run: exit {exit_code} in {time.time() - started:.0f} s (log: {out / 'workload.log'})", flush=True)
    imported = subprocess.run([ncu, "--import", f"{report}.ncu-rep", "--csv", "--page", "raw", "--print-units",
                               "base"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    (out / "smem_conflicts_raw.csv").write_text(imported.stdout)
    try:
        rows = parse_raw_csv(imported.stdout)
    except ValueError as error:
        print(f"smem_conflicts: {error}; ncu --import said: {imported.stderr.strip()[-2000:]}\n"
              f"ncu run log tail:\n{log[-3000:]}", file=sys.stderr)
        return 1
    problems = match_plan(plan, rows)
    for line in problems[:20]:
        print(f"smem_conflicts: {line}", flush=True)
    table = table_rows(plan, rows, metrics, args.goal)
    static = _run_static(plan, arch, out)
    probe_row = next((r for r in table if r["call"] == PROBE_CALL), None)
    from probes import PROBE_VARIANT, PROBE_WARPS_PER_BLOCK

    probe = probe_check(probe_row, static.get(PROBE_VARIANT.name), PROBE_BLOCKS * PROBE_WARPS_PER_BLOCK)
    version = subprocess.run([ncu, "--version"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    meta = {"device": torch.cuda.get_device_name(), "arch": f"sm_{arch}",
            "ncu": version.stdout.strip().splitlines()[-1] if version.stdout.strip() else "?",
            "nvrtc": find_nvrtc(arch).version_string, "torch": torch.__version__,
            "workload": f"batch {args.batch}, {args.heads} heads, seqlen {args.seqlen}, fp16, non-causal "
                        f"(+ one causal forward per head_dim){', quick' if args.quick else ''}",
            "metrics": ", ".join(metrics.values()), "missing metrics": ", ".join(missing) or "none",
            "ncu exit": exit_code}
    ok, line = summary(table, static, probe, problems)
    text = markdown(table, static, probe, meta, args.goal)
    (out / "smem_conflicts.md").write_text(text + "\n" + line + "\n")
    (out / "smem_conflicts.json").write_text(json.dumps(
        {"meta": meta, "goal": args.goal, "rows": table, "static": static, "probe": probe, "problems": problems,
         "ok": ok}, indent=2, default=str))
    print(text)
    print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
