"""The kernel variants this build ships: which csrc/ files, which template instantiations, how to launch them.

A :class:`KernelVariant` is one NVRTC program (one or more csrc/ files compiled as one translation unit, with
``csrc/`` on the include path) and the kernels taken from it (name expressions such as
``"flash_fwd_kernel<FwdKernelTraits<64, 2, 1, 4, 32, false, false, 1, 1, false, false>>"``). The attention
kernels' variants are built from the tile tables in :mod:`volta_train.kernels.tiles`, whose
:func:`~volta_train.kernels.tiles.shipped_variants` is what ``precompile_all`` and ``lab/kernel_report.py``
compile; this module does not import that one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .. import resources
from .cache import get_or_compile, memoized
from .nvrtc import CompiledProgram, normalize_arch

MAX_THREADS_PER_BLOCK = 1024


def csrc_dir() -> Path:
    """The CUDA sources: csrc/ of a checkout, or volta_train/_csrc of an installed package (volta_train/resources.py)."""
    return resources.csrc_dir()


@dataclass(frozen=True)
class KernelVariant:
    name: str
    sources: tuple[str, ...]  # file names under csrc/, concatenated in this order
    name_expressions: tuple[str, ...]  # kernels (template instantiations) to take from the program
    options: tuple[str, ...] = ()  # extra NVRTC options, e.g. ("-DHEAD_DIM=64",)
    dynamic_smem_bytes: int = 0
    threads_per_block: int = 128
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        for attribute in ("sources", "name_expressions", "options"):
            value = getattr(self, attribute)
            if isinstance(value, str):
                raise TypeError(f"KernelVariant {self.name!r}: {attribute} must be a sequence of strings, not a str")
            object.__setattr__(self, attribute, tuple(value))
        if not self.sources or not self.name_expressions:
            raise ValueError(f"KernelVariant {self.name!r} needs at least one source and one name expression")
        if not 1 <= self.threads_per_block <= MAX_THREADS_PER_BLOCK:
            raise ValueError(
                f"KernelVariant {self.name!r}: threads_per_block={self.threads_per_block}; accepted: 1..1024"
            )
        if self.dynamic_smem_bytes < 0:
            raise ValueError(f"KernelVariant {self.name!r}: dynamic_smem_bytes={self.dynamic_smem_bytes} < 0")

    def source_text(self) -> str:
        """The sources, each after a #line directive so NVRTC messages name the right file and line."""
        directory = csrc_dir()
        return "".join(f'#line 1 "{name}"\n{(directory / name).read_text()}\n' for name in self.sources)

    def compile(self, arch: int | str) -> CompiledProgram:
        """Compiled for arch through the kernel cache; after the first call, a dictionary lookup."""
        target = normalize_arch(arch)
        return memoized(
            (self, target),
            lambda: get_or_compile(
                self.source_text(), self.name_expressions, target, self.options, [csrc_dir()], self.sources[0]
            ),
        )


PROBE_WARPS_PER_BLOCK = 2
PROBE_VARIANT = KernelVariant(
    name="probe_mma",
    sources=("probe_mma.cu",),
    name_expressions=(f"volta_probe_mma_kernel<{PROBE_WARPS_PER_BLOCK}>",),
    dynamic_smem_bytes=PROBE_WARPS_PER_BLOCK * 4 * 64 * 4,  # 4 quad-pair tiles of 8x8 fp32 per warp
    threads_per_block=32 * PROBE_WARPS_PER_BLOCK,
    meta={"warps_per_block": PROBE_WARPS_PER_BLOCK, "purpose": "compile/cache/launch pipeline probe"},
)

