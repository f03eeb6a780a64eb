#!/usr/bin/env python3
"""Resource report of every shipped kernel, from NVRTC's ptxas -v output, with V100 occupancy.

    python lab/kernel_report.py --arch sm_70 [--json-out FILE] [--cubin-dir DIR] [--no-cache] [--only NAME]

Compiles each variant of volta_train.kernels.tiles.shipped_variants through the kernel cache (the same
compile function the run-time path uses) and prints one JSON line per kernel, then one summary line. The exit
code is 1 when a kernel spills, needs more than 96 KB of shared memory, or cannot fit one block on a V100 SM.
Occupancy uses the V100 (sm_70) limits whatever --arch is.

--cubin-dir writes <variant>.cubin, <variant>.ptxas.log and meta.jsonl (the --meta input of
shared/tools/v100model/sass_cost.py: the dynamic shared memory the kernel exports, which ptxas does not report).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

from volta_train.kernels.nvrtc import compile_program, normalize_arch, parse_ptxas_log
from volta_train.kernels.tiles import shipped_variants
from volta_train.kernels.variants import KernelVariant, LaunchGeometry, csrc_dir

# V100 (GV100, sm_70) per-SM limits, as the CUDA occupancy calculator uses them.
V100_REGISTERS_PER_SM = 65536
V100_REGISTER_ALLOCATION_UNIT = 256  # registers, allocated per warp
V100_WARP_ALLOCATION_GRANULARITY = 4
V100_MAX_REGISTERS_PER_THREAD = 255
V100_MAX_THREADS_PER_SM = 2048
V100_MAX_CTAS_PER_SM = 32
V100_MAX_SMEM_PER_SM = 96 * 1024
V100_MAX_SMEM_PER_BLOCK = 96 * 1024
V100_SMEM_ALLOCATION_UNIT = 256
WARP_SIZE = 32


def v100_occupancy(registers: int, threads: int, smem_bytes: int) -> dict:
    """CTAs and warps per V100 SM for a kernel of that many registers/thread, threads/block, smem/block.

    limited_by names the binding limit (registers, threads, ctas or smem; the first of them on a tie).
    """
    warps_per_cta = math.ceil(threads / WARP_SIZE)
    limits = {
        "registers": _ctas_by_registers(registers, warps_per_cta),
        "threads": V100_MAX_THREADS_PER_SM // (warps_per_cta * WARP_SIZE),
        "ctas": V100_MAX_CTAS_PER_SM,
        "smem": _ctas_by_smem(smem_bytes),
    }
    limited_by = min(limits, key=limits.get)
    ctas = limits[limited_by]
    return {"ctas_per_sm": ctas, "warps_per_sm": ctas * warps_per_cta, "limited_by": limited_by}


def _ctas_by_registers(registers: int, warps_per_cta: int) -> int:
    if registers > V100_MAX_REGISTERS_PER_THREAD:
        return 0
    unit = V100_REGISTER_ALLOCATION_UNIT
    registers_per_warp = math.ceil(max(registers, 1) * WARP_SIZE / unit) * unit
    warps = V100_REGISTERS_PER_SM // registers_per_warp
    warps -= warps % V100_WARP_ALLOCATION_GRANULARITY
    return warps // warps_per_cta


def _ctas_by_smem(smem_bytes: int) -> int:
    allocated = math.ceil(smem_bytes / V100_SMEM_ALLOCATION_UNIT) * V100_SMEM_ALLOCATION_UNIT
    if allocated == 0:
        return V100_MAX_CTAS_PER_SM
    if allocated > V100_MAX_SMEM_PER_BLOCK:
        return 0
    return V100_MAX_SMEM_PER_SM // allocated


def compile_variant(variant: KernelVariant, arch: int, use_cache: bool):
    if use_cache:
        return variant.compile(arch)
    return compile_program(
        variant.source_text(), variant.compiled_expressions, arch, variant.options, [csrc_dir()], variant.sources[0]
    )


def kernel_rows(variant: KernelVariant, program, compile_s: float) -> list[dict]:
    """One report row per kernel (name expression) of the variant."""
    resources = parse_ptxas_log(program.log)
    # the launch geometry the kernel exports; a test kernel without one: no dynamic shared memory, meta's threads
    geometry = variant.geometry_of(program) if variant.exports_geometry else LaunchGeometry(
        0, variant.meta.get("threads", 128), 0, 0)
    rows = []
    for expression in variant.name_expressions:
        mangled = program.lowered_name(expression)
        if mangled not in resources:
            raise RuntimeError(f"no ptxas -v lines for {expression} ({mangled}) in the log of {variant.name}")
        used = resources[mangled]
        smem = used["static_smem_bytes"] + geometry.dynamic_smem_bytes
        rows.append(
            {
                "name": expression,
                "variant": variant.name,
                "mangled": mangled,
                "arch": f"sm_{program.arch}",
                "registers": used["registers"],
                "spill_bytes": used["spill_store_bytes"] + used["spill_load_bytes"],
                "spill_store_bytes": used["spill_store_bytes"],
                "spill_load_bytes": used["spill_load_bytes"],
                "stack_bytes": used["stack_bytes"],
                "smem_bytes": smem,
                "static_smem_bytes": used["static_smem_bytes"],
                "dynamic_smem_bytes": geometry.dynamic_smem_bytes,
                "threads": geometry.threads,
                **v100_occupancy(used["registers"], geometry.threads, smem),
                "nvrtc": "%d.%d" % program.nvrtc_version,
                "compile_s": round(compile_s, 3),
            }
        )
    return rows


def problems(row: dict) -> list[str]:
    found = []
    if row["spill_bytes"]:
        found.append(f"{row['name']} spills {row['spill_store_bytes']} B stores / {row['spill_load_bytes']} B loads")
    if row["smem_bytes"] > V100_MAX_SMEM_PER_BLOCK:
        found.append(f"{row['name']} needs {row['smem_bytes']} B shared memory > {V100_MAX_SMEM_PER_BLOCK} B")
    elif row["ctas_per_sm"] == 0:
        found.append(f"{row['name']} cannot fit one block on a V100 SM (limited by {row['limited_by']})")
    return found


def write_cubins(directory: Path, variant: KernelVariant, program, rows: list[dict]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{variant.name}.cubin").write_bytes(program.cubin)
    (directory / f"{variant.name}.ptxas.log").write_text(program.log)
    with open(directory / "meta.jsonl", "a") as meta:
        for row in rows:
            entry = {
                "match": "^" + re.escape(row["mangled"]) + "$",
                "label": row["name"],
                "smem_bytes": row["smem_bytes"],
                "threads": row["threads"],
                "regs": row["registers"],
            }
            meta.write(json.dumps(entry) + "\n")


def main(argv: list[str] | None = None, variants: list[KernelVariant] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_70", help="target architecture (default sm_70)")
    parser.add_argument("--json-out", type=Path, help="also write the JSON lines (kernels, then summary) here")
    parser.add_argument("--cubin-dir", type=Path, help="write each variant's cubin, ptxas log and meta.jsonl here")
    parser.add_argument("--no-cache", action="store_true", help="compile with NVRTC directly, bypassing the cache")
    parser.add_argument("--jobs", type=int, default=1,
                        help="fill the kernel cache in this many processes first (not with --no-cache; default 1)")
    parser.add_argument("--only", help="only the variants whose name contains this (e.g. decode_)")
    options = parser.parse_args(argv)
    if options.jobs < 1:
        parser.error(f"--jobs {options.jobs}: accepted: 1 or more")
    arch = normalize_arch(options.arch)
    if arch != 70:
        print(f"note: occupancy below is for a V100 (sm_70), not for sm_{arch}", file=sys.stderr)
    if options.cubin_dir is not None:
        (options.cubin_dir / "meta.jsonl").unlink(missing_ok=True)

    lines, all_problems, kernels = [], [], 0
    variants = variants if variants is not None else shipped_variants(arch)
    if options.only:
        variants = [v for v in variants if options.only in v.name]
    if options.jobs > 1 and not options.no_cache:
        from volta_train.kernels.precompile import compile_variants

        compile_variants(variants, arch, options.jobs)  # the loop below then reads the cache
    for variant in variants:
        started = time.perf_counter()
        program = compile_variant(variant, arch, use_cache=not options.no_cache)
        rows = kernel_rows(variant, program, time.perf_counter() - started)
        if options.cubin_dir is not None:
            write_cubins(options.cubin_dir, variant, program, rows)
        for row in rows:
            kernels += 1
            all_problems.extend(problems(row))
            lines.append(json.dumps(row))
            print(lines[-1], flush=True)
    summary = {"summary": True, "arch": f"sm_{arch}", "kernels": kernels, "problems": all_problems,
               "ok": not all_problems}
    lines.append(json.dumps(summary))
    print(lines[-1])
    if options.json_out is not None:
        options.json_out.write_text("\n".join(lines) + "\n")
    if all_problems:
        print("kernel_report: FAILED: " + "; ".join(all_problems), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
