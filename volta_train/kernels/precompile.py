"""Fill the kernel cache ahead of time: :func:`precompile_all`, which ``volta-train precompile [--arch sm_70]
[--jobs 2] [--head-dims 64]`` and ``python setup.py precompile --arch sm_70`` run. Needs NVRTC, no GPU.
"""

from __future__ import annotations

import os
import time
from typing import Iterable, Sequence

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


def precompile_all(arch: int | str = "sm_70", jobs: int = 1,
                   head_dims: Sequence[int] | None = None) -> list[CompiledProgram]:
    """Compile every shipped variant for arch (of ``head_dims`` only, if given) into the kernel cache; prints one line
    per variant.

    ``jobs`` > 1 compiles in that many worker processes first (each writes the cache; its per-key locks keep
    them apart); the programs returned are then read back from the cache in this process.
    """
    if jobs < 1:
        raise ValueError(f"jobs={jobs}; accepted: 1 or more")
    target = normalize_arch(arch)
    shipped = shipped_variants(target)
    if head_dims is not None:
        accepted = sorted({v.meta["head_dim"] for v in shipped})
        unknown = sorted(set(head_dims) - set(accepted))
        if unknown or not head_dims:
            raise ValueError(f"head_dims={list(head_dims)}: no shipped kernels for {unknown or 'none given'}; "
                             f"accepted: {', '.join(map(str, accepted))}")
    chosen = [i for i, v in enumerate(shipped) if head_dims is None or v.meta["head_dim"] in head_dims]
    library = find_nvrtc(target)
    variants = [shipped[i] for i in chosen]
    print(f"volta_train precompile: {len(variants)} variants for sm_{target} with NVRTC {library.version_string} "
          f"from {csrc_dir()} into {ensure_cache_dir()}" + (f", {jobs} processes" if jobs > 1 else ""), flush=True)
    started_all = time.perf_counter()
    if jobs > 1:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(jobs) as pool:
            for name, size, seconds in pool.imap(_compile_one, [(i, target) for i in chosen]):
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


def _compile_into_cache(task: tuple[list[KernelVariant], int]) -> int:
    variants, target = task
    for variant in variants:
        variant.compile(target)
    return len(variants)


def compile_variants(variants: Iterable[KernelVariant], arch: int | str, processes: int | None = None) -> int:
    """Compile variants for arch into the kernel cache, e.g. another arch's tile table for this GPU, in ``processes``
    worker processes (default: one per CPU, at most 32; processes, not threads, because NVRTC 13 holds the GIL);
    returns how many distinct variants there were."""
    if processes is not None and processes < 1:
        raise ValueError(f"processes={processes}; accepted: 1 or more (or None: one per CPU)")
    target = normalize_arch(arch)
    distinct = list({(v.name, v.name_expressions): v for v in variants}.values())
    processes = min(processes or max(1, min(32, os.cpu_count() or 1)), max(1, len(distinct)))
    if processes == 1:
        return _compile_into_cache((distinct, target))
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    slices = [(distinct[i::processes], target) for i in range(processes)]
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        return sum(pool.map(_compile_into_cache, slices))


if __name__ == "__main__":  # the command's options live in one parser, the CLI's
    raise SystemExit("python -m volta_train.kernels.precompile: run `volta-train precompile` instead "
                     "(options --arch, --jobs, --head-dims; `volta-train precompile --help`)")
