"""Fill the kernel cache ahead of time: ``python -m volta_train.kernels.precompile [--arch sm_70]``.

Needs NVRTC, no GPU. ``python setup.py precompile --arch sm_70`` calls :func:`precompile_all` too.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

from .cache import ensure_cache_dir
from .nvrtc import CompiledProgram, find_nvrtc, normalize_arch
from .tiles import shipped_variants
from .variants import KernelVariant, csrc_dir


def _compile_one(task: tuple[int, int]) -> tuple[str, int, float]:
    index, target = task
    variant = shipped_variants(target)[index]
    started = time.perf_counter()
    program = variant.compile(target)
    return variant.name, len(program.cubin), time.perf_counter() - started


def precompile_all(arch: int | str = "sm_70", jobs: int = 1) -> list[CompiledProgram]:
    """Compile every shipped variant for arch into the kernel cache; prints one line per variant.

    ``jobs`` > 1 compiles in that many worker processes first (each writes the cache; its per-key locks keep
    them apart); the programs returned are then read back from the cache in this process.
    """
    if jobs < 1:
        raise ValueError(f"jobs={jobs}; accepted: 1 or more")
    target = normalize_arch(arch)
    library = find_nvrtc(target)
    variants = shipped_variants(target)
    print(f"volta_train precompile: {len(variants)} variants for sm_{target} with NVRTC {library.version_string} "
          f"from {csrc_dir()} into {ensure_cache_dir()}" + (f", {jobs} processes" if jobs > 1 else ""), flush=True)
    started_all = time.perf_counter()
    if jobs > 1:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(jobs) as pool:
            for name, size, seconds in pool.imap(_compile_one, [(i, target) for i in range(len(variants))]):
                print(f"  {name}: {size} B cubin in {seconds:.2f} s", flush=True)
        programs = [variant.compile(target) for variant in variants]  # cache hits
    else:
        programs = []
        for variant in variants:
            started = time.perf_counter()
            programs.append(variant.compile(target))
            print(f"  {variant.name}: {len(programs[-1].cubin)} B cubin in {time.perf_counter() - started:.2f} s",
                  flush=True)
    print(f"volta_train precompile: {len(programs)} variants ready in {time.perf_counter() - started_all:.1f} s")
    return programs


def compile_variants(variants: Iterable[KernelVariant], arch: int | str, threads: int = 16) -> int:
    """Compile variants for arch through the kernel cache, ``threads`` at a time (NVRTC releases the GIL), e.g.
    another arch's tile table for this GPU; returns how many distinct variants there were."""
    if threads < 1:
        raise ValueError(f"threads={threads}; accepted: 1 or more")
    target = normalize_arch(arch)
    distinct = {(v.name, v.name_expressions): v for v in variants}
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda v: v.compile(target), distinct.values()))
    return len(distinct)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_70", help="target architecture, e.g. sm_70 (default) or sm_90")
    parser.add_argument("--jobs", type=int, default=1, help="compile in this many processes (default 1)")
    args = parser.parse_args(argv)
    precompile_all(args.arch, args.jobs)


if __name__ == "__main__":
    main()
