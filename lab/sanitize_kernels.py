#!/usr/bin/env python3
"""compute-sanitizer over every shipped Volta kernel variant, for both tile tables, in one command (needs a GPU).

    python lab/sanitize_kernels.py [--out DIR] [--tools racecheck,initcheck,memcheck,synccheck]
                                       [--tables default,sm70]

Runs this script's own workload under each compute-sanitizer tool (the tools in parallel, one process each),
checking only volta_train's kernels (``--kernel-name kns=flash_``: PyTorch's own kernels run unchecked), and
writes ``sanitizer.md`` (a table per tool and table) and ``sanitizer.json`` to --out, plus each tool's full log.

The workload launches every kernel variant the dispatcher can pick on this GPU ("default": on an H100 the
emulated-m8n8k4 tiles) and every tile of the V100 table ("sm70", reached through the launchers' tile override),
by the calls of ``lab/call_matrix.py table_calls`` (lab/smem_conflicts.py makes them too):
forward (both tiles of each head_dim: full and causal; fp32 and fp16 accumulation; dropout on and off; logit
soft-capping on and off), backward dK/dV (both accumulation modes, dropout, soft-capping, dQ by atomics and the
deterministic dQ kernel) on two calls each (soft-capping: the dense call without dropout and the varlen call with it;
the forward also with the other setting, so that the causal and the full tiles each run every pair):

* dense, causal, seqlen_q 203 > seqlen_k 113 (90 query rows see no key: whole key-less query blocks and a mixed
  one), GQA (4 query heads on 2 KV heads), a partial key and query block;
* variable length (3 sequences: 37/90, 150/64 and 1/17 query/key tokens), a local window (12, 15) and ALiBi.

and the split-KV decoding kernel (flash_attn_with_kvcache, every head_dim, soft-capping on and off; the calls of
``call_matrix.decode_calls``) on the calls of ``_decode_calls``: GQA-packed with three key splits, unpacked with one
split, a causal window, cache_leftpad and ALiBi, a paged cache, and flash_attn_varlen_func's packed queries on a paged
cache (``decode.forward_paged_varlen``) with three splits and with one.

Each call's output is also checked: finite, key-less rows exactly 0, and within 2e-2 of the reference backend.
``--workload`` runs the workload alone (what each sanitizer process runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import call_matrix  # noqa: E402  (lab/call_matrix.py: the calls that launch every variant)

TOOLS = ("racecheck", "initcheck", "memcheck", "synccheck")
TABLES = ("default", "sm70")


def _workload(tables: list[str], quick: bool, check: bool = True, only: tuple[int, ...] = ()) -> int:
    import torch

    from volta_train import reference
    from volta_train.options import AttentionOptions
    from volta_train.kernels import tiles, launch

    torch.manual_seed(0)
    dev = "cuda"
    head_dims = tiles.SUPPORTED_HEAD_DIMS[:2] if quick else tiles.SUPPORTED_HEAD_DIMS
    head_dims = tuple(d for d in head_dims if not only or d in only)
    failures: list[str] = []
    calls = 0

    def dense_call(d):
        q = torch.randn(2, 203, 4, d, device=dev).half()
        k = torch.randn(2, 113, 2, d, device=dev).half()
        v = torch.randn(2, 113, 2, d, device=dev).half()
        return dict(q=q, k=k, v=v, cu_q=None, cu_k=None, max_q=203, max_k=113, causal=True, window=(-1, 0),
                    alibi=None, name="dense causal 203x113 gqa")

    def varlen_call(d):
        lens_q, lens_k = [37, 150, 1], [90, 64, 17]
        cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        q = torch.randn(sum(lens_q), 4, d, device=dev).half()
        k = torch.randn(sum(lens_k), 2, d, device=dev).half()
        v = torch.randn(sum(lens_k), 2, d, device=dev).half()
        alibi = torch.rand(4, device=dev) * 0.3
        return dict(q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k, max_q=max(lens_q), max_k=max(lens_k), causal=False,
                    window=(12, 15), alibi=alibi, name="varlen window(12,15) alibi gqa")

    def params_of(c, dropout_p, softcap):
        return AttentionOptions(softmax_scale=c["q"].shape[-1] ** -0.5, causal=c["causal"], window_left=c["window"][0],
                               window_right=c["window"][1], dropout_p=dropout_p, seed=1234, offset=8,
                               softcap=6.0 if softcap else 0.0)

    def reference_outputs(c, prm):
        args = (c["q"].float(), c["k"].float(), c["v"].float())
        if c["cu_q"] is None:
            return reference.reference_forward(*args, prm, c["alibi"])
        return reference.reference_varlen_forward(*args, c["cu_q"], c["cu_k"], prm, c["alibi"])

    def compare(label, got, want):
        if not check:
            return
        if not torch.isfinite(got).all():
            failures.append(f"{label}: non-finite values")
            return
        err = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
        if err > 2e-2 * max(1.0, want.float().abs().max().item()):
            failures.append(f"{label}: max-abs error {err:.3e} against the reference backend")

    major, minor = torch.cuda.get_device_capability()
    arch = 10 * major + minor
    for table in tables:
        for d in head_dims:
            for make in (dense_call, varlen_call):
                c = make(d)
                for dropout_p in (0.0, 0.2):
                    # soft-capping: the dense call without dropout, the varlen call with it (forward and backward);
                    # the forward alone with the other setting
                    cap = (c["cu_q"] is None) == (dropout_p == 0.0)
                    table_calls = call_matrix.table_calls(table, arch, head_dims=(d,), causal=(c["causal"],),
                                                          dropout=(dropout_p > 0,), softcap=(not cap,),
                                                          passes=("fwd",))
                    table_calls += call_matrix.table_calls(table, arch, head_dims=(d,), causal=(c["causal"],),
                                                           dropout=(dropout_p > 0,), softcap=(cap,))
                    # the forward in each mode, then the backward in each mode on the fp32 forward's output
                    references = {}
                    for call in table_calls:
                        prm = params_of(c, dropout_p, call.softcap)
                        if call.softcap not in references:
                            references[call.softcap] = reference_outputs(c, prm) if check else (None, None)
                        ref_out, ref_lse = references[call.softcap]
                        label = f"{table} d{d} {c['name']} p={dropout_p} softcap={prm.softcap} fwd accum=fp32"
                        if call.pass_name == "bwd":
                            grads = launch.backward(dout, c["q"], c["k"], c["v"], fwd_out, fwd_lse, c["cu_q"],
                                                    c["cu_k"], c["max_q"], c["max_k"],
                                                    dataclasses.replace(prm, bwd_accum=call.accum,
                                                                        deterministic=call.deterministic),
                                                    c["alibi"], **call.overrides)
                            calls += 1
                            for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
                                compare(f"{label} bwd_accum={call.accum} det={call.deterministic} {name}", g, r)
                            continue
                        out = torch.full(c["q"].shape, float("nan"), dtype=torch.half, device=dev)
                        lse_shape = (4, c["q"].shape[0]) if c["cu_q"] is not None else (2, 4, c["q"].shape[1])
                        lse = torch.full(lse_shape, float("nan"), device=dev)
                        out, lse = launch.forward(c["q"], c["k"], c["v"], c["cu_q"], c["cu_k"], c["max_q"], c["max_k"],
                                                  dataclasses.replace(prm, accum=call.accum), c["alibi"], out=out,
                                                  lse=lse, **call.overrides)
                        calls += 1
                        fwd_label = f"{table} d{d} {c['name']} p={dropout_p} softcap={prm.softcap} fwd accum={call.accum}"
                        compare(fwd_label, out, ref_out)
                        if check and not torch.equal(torch.isposinf(lse), torch.isinf(ref_lse)):
                            failures.append(f"{fwd_label}: lse is not +inf exactly on the rows that see no key")
                        if call.accum == "fp32":
                            fwd_out, fwd_lse = out, lse
                            dout = torch.randn_like(c["q"])
                            ref_grads = _reference_grads(c, prm, dout) if check else (None, None, None)
                torch.cuda.synchronize()
                print(f"[workload] {table} d{d} {c['name']}: done ({calls} calls so far)", flush=True)
        for call in call_matrix.decode_calls(table, arch, head_dims=head_dims):
            calls += _decode_calls(call, failures, check)
        torch.cuda.synchronize()
        print(f"[workload] {table} decoding: done ({calls} calls so far)", flush=True)
    torch.cuda.synchronize()
    for line in failures:
        print(f"[workload] WRONG: {line}", flush=True)
    print(f"[workload] {calls} kernel calls, {len(failures)} wrong results", flush=True)
    return 1 if failures else 0


def _decode_calls(call, failures: list[str], check: bool) -> int:
    """The calls of one decoding variant (call_matrix.decode_calls), each against the reference backend (on copies of
    the caches): flash_attn_with_kvcache GQA-packed (1 query, 8 heads on 2, cache lengths 0 / full / 77, one appended
    token, cache_batch_idx, 3 key splits: partial outputs and their combine), unpacked (5 queries, causal window
    (40, 0), cache_leftpad, ALiBi, 5 appended tokens, one split: the kernel writes out / lse itself), and paged (a
    block table over shuffled pages of 64 keys, 3 appended tokens crossing a page, 2 key splits); then
    flash_attn_varlen_func's packed queries on pages of 256 keys (``_paged_varlen_call``): causal with key-less rows
    and empty sequences over 3 splits, and a window over one split."""
    import torch

    from volta_train import reference
    from volta_train.options import AttentionOptions
    from volta_train.kernels import decode

    d, dev = call.head_dim, "cuda"
    cases = [
        dict(batch=3, sq=1, h=8, hk=2, cache=(4, 300), seqlens=[0, 299, 77], new=1, rows=[2, 0, 3], leftpad=None,
             causal=True, window=(-1, -1), alibi=False, splits=3, name="packed gqa, 3 splits"),
        dict(batch=2, sq=5, h=4, hk=2, cache=(2, 200), seqlens=[3, 150], new=5, rows=None, leftpad=[0, 20],
             causal=True, window=(40, 0), alibi=True, splits=1, name="window(40,0) leftpad alibi, 1 split"),
        dict(batch=2, sq=1, h=8, hk=2, cache=(9, 64), seqlens=[62, 190], new=3, rows=None, leftpad=None,
             causal=True, window=(-1, -1), alibi=False, splits=2, pages=[[7, 2, 5, 0], [1, 8, 3, 6]],
             name="paged, 64-key pages, 2 splits"),
        # flash_attn_varlen_func on a paged cache: 20 queries on 9 keys (causal: 11 see none), 0 keys, 0 queries
        dict(varlen=True, lens_q=[3, 20, 7, 0], lens_k=[300, 9, 0, 256], h=8, hk=2, pages=[[5, 1], [3, -1], [-1, -1],
             [0, -1]], num_pages=6, causal=True, window=(-1, -1), splits=3, name="varlen paged, 3 splits"),
        dict(varlen=True, lens_q=[17, 40], lens_k=[257, 700], h=4, hk=4, pages=[[2, 0, -1], [4, 1, 3]], num_pages=5,
             causal=False, window=(30, 4), splits=1, name="varlen paged window(30,4), 1 split"),
    ]
    for c in cases:
        if c.get("varlen"):
            _paged_varlen_call(call, c, failures, check)
            continue
        q = torch.randn(c["batch"], c["sq"], c["h"], d, device=dev).half()
        k_cache = torch.randn(c["cache"][0], c["cache"][1], c["hk"], d, device=dev).half()
        v_cache = torch.randn_like(k_cache)
        k_new = torch.randn(c["batch"], c["new"], c["hk"], d, device=dev).half()
        v_new = torch.randn_like(k_new)
        seqlens = torch.tensor(c["seqlens"], dtype=torch.int32, device=dev)
        rows = torch.tensor(c["rows"], dtype=torch.int32, device=dev) if c["rows"] else None
        leftpad = torch.tensor(c["leftpad"], dtype=torch.int32, device=dev) if c["leftpad"] else None
        alibi = torch.rand(c["batch"], c["h"], device=dev) * 0.3 if c["alibi"] else None
        table = torch.tensor(c["pages"], dtype=torch.int32, device=dev) if c.get("pages") else None
        prm = AttentionOptions(softmax_scale=d**-0.5, causal=c["causal"], window_left=c["window"][0],
                               window_right=c["window"][1], softcap=6.0 if call.softcap else 0.0)
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        args = (k_new, v_new, None, None, seqlens, rows, leftpad, prm, alibi, True)
        out, lse = decode.forward_with_kvcache(q, k_cache, v_cache, *args, num_splits=c["splits"], block_table=table,
                                               **call.overrides)
        label = f"{call.table} d{d} decode {c['name']} softcap={prm.softcap}"
        if check:
            ref_out, ref_lse = reference.reference_kvcache_forward(q, k_ref, v_ref, *args, block_table=table)
            if not (torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)):
                failures.append(f"{label}: the caches differ from the reference backend's after the append")
            err = (out.float() - ref_out.float()).abs().max().item()
            if not torch.isfinite(out).all() or err > 2e-2 * max(1.0, ref_out.float().abs().max().item()):
                failures.append(f"{label}: max-abs error {err:.3e} against the reference backend (or non-finite)")
            if not torch.equal(torch.isposinf(lse), torch.isinf(ref_lse)):
                failures.append(f"{label}: lse is not +inf exactly on the rows that see no key")
    return len(cases)


def _paged_varlen_call(call, c, failures: list[str], check: bool) -> None:
    """One decode.forward_paged_varlen call (packed queries, a page pool of 256-key pages) against the reference
    backend's paged varlen forward."""
    import torch

    from volta_train import reference
    from volta_train.options import AttentionOptions
    from volta_train.kernels import decode

    d, dev = call.head_dim, "cuda"
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)  # noqa: E731
    q = torch.randn(sum(c["lens_q"]), c["h"], d, device=dev).half()
    k_pages = torch.randn(c["num_pages"], 256, c["hk"], d, device=dev).half()
    v_pages = torch.randn_like(k_pages)
    cu_q, cu_k = cu(c["lens_q"]), cu(c["lens_k"])
    table = torch.tensor(c["pages"], dtype=torch.int32, device=dev)
    prm = AttentionOptions(softmax_scale=d**-0.5, causal=c["causal"], window_left=c["window"][0],
                           window_right=c["window"][1], softcap=6.0 if call.softcap else 0.0)
    out, lse = decode.forward_paged_varlen(q, k_pages, v_pages, cu_q, cu_k, table, max(c["lens_q"]),
                                           max(c["lens_k"]), prm, num_splits=c["splits"], **call.overrides)
    if not check:
        return
    label = f"{call.table} d{d} decode {c['name']} softcap={prm.softcap}"
    ref_out, ref_lse = reference.reference_paged_varlen_forward(q, k_pages, v_pages, cu_q, cu_k, table, prm)
    err = (out.float() - ref_out.float()).abs().max().item()
    if not torch.isfinite(out).all() or err > 2e-2 * max(1.0, ref_out.float().abs().max().item()):
        failures.append(f"{label}: max-abs error {err:.3e} against the reference backend (or non-finite)")
    if not torch.equal(torch.isposinf(lse), torch.isinf(ref_lse)):
        failures.append(f"{label}: lse is not +inf exactly on the rows that see no key")


def _reference_grads(c, prm, dout):
    from volta_train import reference

    q, k, v = (c[n].float() for n in "qkv")
    if c["cu_q"] is None:
        out, lse = reference.reference_forward(q, k, v, prm, c["alibi"])
        return reference.reference_backward(dout.float(), q, k, v, out, lse, prm, c["alibi"])
    out, lse = reference.reference_varlen_forward(q, k, v, c["cu_q"], c["cu_k"], prm, c["alibi"])
    return reference.reference_varlen_backward(dout.float(), q, k, v, out, lse, c["cu_q"], c["cu_k"], prm, c["alibi"])


def precompile_tables(arch: int, processes: int | None = None) -> int:
    """Compile every variant of both tile tables for arch into the kernel cache, in worker processes; returns the
    count."""
    from volta_train.kernels import tiles
    from volta_train.kernels.precompile import compile_variants

    variants = [v for table_arch in sorted({70, arch})
                for v in tiles.shipped_fwd_variants(table_arch) + tiles.shipped_bwd_variants(table_arch)
                + tiles.shipped_decode_variants(table_arch) + tiles.shipped_preprocess_variants(table_arch)]
    variants += tiles.shipped_combine_variants()
    return compile_variants(variants, arch, processes)


_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) errors?")
_RACE = re.compile(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)")


_OURS = re.compile(r"^=========\s+at .*flash_(fwd|bwd)", re.M)


def _run_tool(tool: str, table: str, out: Path, quick: bool, timeout_s: float | None, only: list[str]) -> dict:
    """One compute-sanitizer process over one table's workload.

    racecheck, memcheck and synccheck check volta_train's kernels only (``--kernel-name kns=flash_``). initcheck checks
    every kernel: with a filter, the writes of PyTorch's unchecked kernels (randn, zeros, the D = rowsum(dO * O)
    reduction) would go unseen and every read of those tensors would count as uninitialized. Its workload skips the
    reference comparisons (fewer PyTorch kernels to instrument), and only findings located in volta_train's kernels
    count; the others are listed apart.
    """
    log = out / f"sanitizer_{tool}_{table}.log"
    if tool == "initcheck":
        options = ["--check-api-memory-access", "no"]
        workload = ["--no-check"]
    else:
        options = ["--kernel-name", "kns=flash_"]
        workload = []
    cmd = ["compute-sanitizer", "--tool", tool, *options, "--print-limit", "200",
           sys.executable, __file__, "--workload", "--tables", table, *workload, *only] + (["--quick"] if quick else [])
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1" if tool == "memcheck" else "0")
    start = time.time()
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                              timeout=timeout_s)
        text, exit_code = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as stopped:
        partial = stopped.stdout or b""
        text = (partial.decode() if isinstance(partial, bytes) else partial) + f"\n[stopped after {timeout_s} s]\n"
        exit_code = "timeout"
    log.write_text(text)
    errors = [int(m) for m in _SUMMARY.findall(text)]
    race = _RACE.findall(text)
    if race and not errors:  # racecheck prints its own summary line, "... (N errors, M warnings)"
        errors = [int(race[-1][1])]
    wrong = re.findall(r"\[workload\] (\d+) kernel calls, (\d+) wrong results", text)
    ours = len(_OURS.findall(text))
    return {
        "tool": tool, "table": table, "exit_code": exit_code, "seconds": round(time.time() - start, 1),
        "errors": errors[-1] if errors else None, "errors_in_volta_train_kernels": ours,
        "hazards": int(race[-1][0]) if race else None,
        "calls": int(wrong[-1][0]) if wrong else None, "wrong_results": int(wrong[-1][1]) if wrong else None,
        "log": log.name,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "sanitizer_out")))
    parser.add_argument("--tools", default=",".join(TOOLS))
    parser.add_argument("--tables", default=",".join(TABLES))
    parser.add_argument("--workload", action="store_true", help="run the kernel workload only (no sanitizer)")
    parser.add_argument("--quick", action="store_true", help="two head dims only (a smoke run)")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[], help="only these head dims (default: all)")
    parser.add_argument("--no-check", action="store_true", help="workload without the reference comparisons")
    parser.add_argument("--tool-timeout", type=float, default=None, help="seconds each sanitizer process may run")
    parser.add_argument("--precompile-only", action="store_true", help="compile both tables' variants and exit")
    args = parser.parse_args()
    if args.precompile_only:
        import torch

        major, minor = torch.cuda.get_device_capability()
        start = time.time()
        count = precompile_tables(10 * major + minor)
        print(f"compiled {count} variants for sm_{major}{minor} in {time.time() - start:.0f} s", flush=True)
        return 0
    tables = [t for t in args.tables.split(",") if t]
    for table in tables:
        if table not in TABLES:
            parser.error(f"--tables: {table!r}; accepted: {', '.join(TABLES)}")
    if args.workload:
        return _workload(tables, args.quick, check=not args.no_check, only=tuple(args.head_dims))
    tools = [t for t in args.tools.split(",") if t]
    for tool in tools:
        if tool not in TOOLS:
            parser.error(f"--tools: {tool!r}; accepted: {', '.join(TOOLS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    # compile every variant once, outside the sanitizer, so the checked runs load from the kernel cache
    only = ["--head-dims", *map(str, args.head_dims)] if args.head_dims else []
    warm = subprocess.run([sys.executable, __file__, "--workload", "--tables", ",".join(tables), *only]
                          + (["--quick"] if args.quick else []), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    (args.out / "workload_plain.log").write_text(warm.stdout)
    print(warm.stdout.strip().splitlines()[-1] if warm.stdout.strip() else "workload printed nothing", flush=True)
    jobs = [(tool, table) for tool in tools for table in tables]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: _run_tool(*job, args.out, args.quick, args.tool_timeout, only), jobs))
    (args.out / "sanitizer.json").write_text(json.dumps({"plain_exit": warm.returncode, "results": results}, indent=2))
    lines = ["| tool | table | kernel calls | result | wrong results | exit | seconds |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    ok = warm.returncode == 0
    for r in results:
        if r["tool"] == "racecheck":
            verdict = f"racecheck: {r['hazards']} hazards"
            clean = r["hazards"] == 0 and r["errors"] == 0
        elif r["tool"] == "initcheck":
            other = (r["errors"] or 0) - r["errors_in_volta_train_kernels"]
            verdict = f"initcheck: {r['errors_in_volta_train_kernels']} errors in volta_train's kernels"
            verdict += f" ({other} in PyTorch's own)" if other else ""
            clean = r["errors"] is not None and r["errors_in_volta_train_kernels"] == 0
        else:
            verdict = f"{r['tool']}: {r['errors']} errors"
            clean = r["errors"] == 0
        ok &= clean and r["exit_code"] == 0 and r["wrong_results"] == 0
        lines.append(f"| {r['tool']} | {r['table']} | {r['calls']} | {verdict} | {r['wrong_results']} | "
                     f"{r['exit_code']} | {r['seconds']} |")
    table = "\n".join(lines)
    (args.out / "sanitizer.md").write_text(table + "\n")
    print(table)
    print("sanitizer: CLEAN" if ok else "sanitizer: FINDINGS (see the logs)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
