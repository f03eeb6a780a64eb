"""Fill the kernel cache ahead of time: ``python -m volta_train.kernels.precompile [--arch sm_70]``.

Needs NVRTC, no GPU. ``python setup.py precompile --arch sm_70`` calls :func:`precompile_all` too.
"""

from __future__ import annotations

import argparse
import time

from .cache import ensure_cache_dir
from .nvrtc import CompiledProgram, find_nvrtc, normalize_arch
from .variants import shipped_variants


def precompile_all(arch: int | str = "sm_70") -> list[CompiledProgram]:
    """Compile every shipped variant for arch into the kernel cache; prints one line per variant."""
    target = normalize_arch(arch)
    library = find_nvrtc(target)
    print(f"volta_train precompile: sm_{target} with NVRTC {library.version_string} into {ensure_cache_dir()}")
    programs = []
    for variant in shipped_variants(target):
        started = time.perf_counter()
        programs.append(variant.compile(target))
        print(f"  {variant.name}: {len(programs[-1].cubin)} B cubin in {time.perf_counter() - started:.2f} s")
    return programs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_70", help="target architecture, e.g. sm_70 (default) or sm_90")
    precompile_all(parser.parse_args(argv).arch)


if __name__ == "__main__":
    main()
