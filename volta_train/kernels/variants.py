"""The kernel variants this build ships: which csrc/ files, which template instantiations, how to launch them.

A :class:`KernelVariant` is one NVRTC program (one or more csrc/ files compiled as one translation unit, with
``csrc/`` on the include path) and the kernels taken from it (name expressions such as
``"flash_fwd_kernel<FwdKernelTraits<64, 2, 1, 4, 32, false, false, 1, 1, false, false, false, false>>"``). Its launch
geometry
(dynamic shared memory, threads per block, block sizes) is not computed here: each kernel exports it from its C++
traits (csrc/launch_geometry.cuh) and :meth:`KernelVariant.geometry` reads it from the compiled cubin. The attention
kernels' variants are built from the tile tables in :mod:`volta_train.kernels.tiles`, whose
:func:`~volta_train.kernels.tiles.shipped_variants` is what ``precompile_all`` compiles; this module does not import
that one.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

from .. import resources
from . import driver
from .cache import get_or_compile, memoized
from .nvrtc import CompiledProgram, is_variable_expression, normalize_arch


def csrc_dir() -> Path:
    """The CUDA sources: csrc/ of a checkout, or volta_train/_csrc of an installed package (volta_train/resources.py)."""
    return resources.csrc_dir()


@dataclass(frozen=True)
class LaunchGeometry:
    """A kernel's ``LaunchGeometry`` (csrc/launch_geometry.cuh, same fields in the same order), read from its cubin."""

    dynamic_smem_bytes: int
    threads: int
    block_m: int
    block_n: int

    _LAYOUT = struct.Struct("<4i")

    @classmethod
    def from_bytes(cls, data: bytes) -> LaunchGeometry:
        if len(data) != cls._LAYOUT.size:
            raise ValueError(f"a LaunchGeometry is {cls._LAYOUT.size} bytes (4 ints); the variable holds {len(data)}")
        return cls(*cls._LAYOUT.unpack(data))


def geometry_expression(kernel_expression: str) -> str:
    """The name expression of the LaunchGeometry a kernel exports: "name<ARGS>" -> "&name_geometry<ARGS>"."""
    name, bracket, arguments = kernel_expression.partition("<")
    return f"&{name.strip()}_geometry{bracket}{arguments}"


@dataclass(frozen=True)
class KernelVariant:
    name: str
    sources: tuple[str, ...]  # file names under source_dir, concatenated in this order
    name_expressions: tuple[str, ...]  # kernels (template instantiations) to take from the program
    options: tuple[str, ...] = ()  # extra NVRTC options, e.g. ("-DHEAD_DIM=64",)
    # the first kernel exports its LaunchGeometry (csrc/launch_geometry.cuh); False for kernels without one (tests)
    exports_geometry: bool = True
    source_dir: Path | None = None  # where the sources are (default: csrc_dir()); csrc/ is on the include path
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        for attribute in ("sources", "name_expressions", "options"):
            value = getattr(self, attribute)
            if isinstance(value, str):
                raise TypeError(f"KernelVariant {self.name!r}: {attribute} must be a sequence of strings, not a str")
            object.__setattr__(self, attribute, tuple(value))
        if not self.sources or not self.name_expressions:
            raise ValueError(f"KernelVariant {self.name!r} needs at least one source and one name expression")
        variables = [e for e in self.name_expressions if is_variable_expression(e)]
        if variables:
            raise ValueError(f"KernelVariant {self.name!r}: name_expressions {variables} name variables; accepted: "
                             "kernels only (the launch geometry's variable is added by exports_geometry)")

    @property
    def geometry_expression(self) -> str | None:
        """The name expression of the first kernel's exported LaunchGeometry, or None."""
        return geometry_expression(self.name_expressions[0]) if self.exports_geometry else None

    @property
    def compiled_expressions(self) -> tuple[str, ...]:
        """Everything the program is compiled with: the kernels, then the exported geometry."""
        geometry = self.geometry_expression
        return self.name_expressions + ((geometry,) if geometry else ())

    def source_text(self) -> str:
        """The sources, each after a #line directive so NVRTC messages name the right file and line."""
        directory = self.source_dir or csrc_dir()
        return "".join(f'#line 1 "{name}"\n{(directory / name).read_text()}\n' for name in self.sources)

    def compile(self, arch: int | str) -> CompiledProgram:
        """Compiled for arch through the kernel cache; after the first call, a dictionary lookup."""
        target = normalize_arch(arch)
        return memoized(
            (self, target),
            lambda: get_or_compile(
                self.source_text(), self.compiled_expressions, target, self.options, [csrc_dir()], self.sources[0]
            ),
        )

    def geometry(self, arch: int | str) -> LaunchGeometry:
        """The first kernel's launch geometry as its compiled traits export it (compiles through the cache)."""
        self._check_exports_geometry()
        return self.geometry_of(self.compile(arch))

    def geometry_of(self, program: CompiledProgram) -> LaunchGeometry:
        """The first kernel's launch geometry in program, this variant compiled with ``compiled_expressions``."""
        self._check_exports_geometry()
        return LaunchGeometry.from_bytes(program.variable(self.geometry_expression))

    def _check_exports_geometry(self) -> None:
        if not self.exports_geometry:
            raise ValueError(f"KernelVariant {self.name!r} exports no launch geometry (exports_geometry=False); "
                             "launch it with driver.load_function and explicit threads / shared memory")

    def load(self, device, arch: int | str) -> LoadedKernel:
        """The first kernel compiled for arch and loaded on device (a torch.device), with its launch geometry."""
        function = driver.load_function(self.compile(arch), self.name_expressions[0], device)
        return LoadedKernel(function, self.geometry(arch))


@dataclass(frozen=True)
class LoadedKernel:
    """A loaded kernel launched with the threads and dynamic shared memory its compiled traits export."""

    function: object  # driver.KernelFunction
    geometry: LaunchGeometry

    def launch(self, grid, args, stream=None) -> None:
        self.function.launch(grid, self.geometry.threads, self.geometry.dynamic_smem_bytes, args, stream)
