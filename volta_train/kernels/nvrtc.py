"""NVRTC through ctypes: find libnvrtc, compile CUDA C++ to a cubin, read ptxas -v resource lines.

No compiler is needed at install time: the kernel sources in csrc/ are compiled here, at run time, to
SASS for one architecture (``nvrtcGetCUBIN``, not PTX). NVRTC needs no GPU.

Where libnvrtc is looked for, in this order (every existing, loadable candidate is kept):

1. ``$VOLTA_TRAIN_NVRTC``: an explicit path to a libnvrtc shared library, or the name of an installed NVRTC wheel
   (``nvidia-cuda-nvrtc-cu11``: its libnvrtc), e.g. NVRTC 11.8 for a driver of CUDA 11 (an error if neither);
2. the pip wheels in every ``sys.path`` entry: ``nvidia/cuda_nvrtc/lib/libnvrtc.so.12`` (CUDA 12 wheels,
   a dependency of PyTorch's cu12x wheels), ``nvidia/cu13/lib/libnvrtc.so.13`` (PyTorch cu130 wheels),
   ``nvidia/cuda_nvrtc/lib/libnvrtc.so.11.2``;
3. ``$CUDA_HOME``, ``$CUDA_PATH``, ``/usr/local/cuda``: ``lib64/libnvrtc.so*``;
4. ``ctypes.util.find_library("nvrtc")``.

For a target architecture the first candidate whose ``nvrtcGetSupportedArchs`` lists it is used. NVRTC 13
dropped sm_70, so a V100 needs NVRTC 12 (``pip install nvidia-cuda-nvrtc-cu12``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import hashlib
import logging
import os
import re
import sys
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from . import cubin as cubin_image

logger = logging.getLogger("volta_train")

NVRTC_ENV = "VOLTA_TRAIN_NVRTC"
NVRTC12_PACKAGE = "nvidia-cuda-nvrtc-cu12"
INSTALL_HINT = f"pip install {NVRTC12_PACKAGE}"
# Relative to a site-packages directory, in order of preference.
WHEEL_LIBRARIES = (
    "nvidia/cuda_nvrtc/lib/libnvrtc.so.12",
    "nvidia/cu13/lib/libnvrtc.so.13",
    "nvidia/cuda_nvrtc/lib/libnvrtc.so.11.2",
)
TOOLKIT_ENVS = ("CUDA_HOME", "CUDA_PATH")
DEFAULT_TOOLKIT = "/usr/local/cuda"
ALWAYS_OPTIONS = ("-std=c++17", "--ptxas-options=-v")
NVRTC_SUCCESS = 0


class NvrtcNotFoundError(RuntimeError):
    """No usable libnvrtc, or none that compiles for the requested architecture."""


class CompileError(RuntimeError):
    """NVRTC rejected a program; ``.log`` holds the full program log."""

    def __init__(self, message: str, log: str = ""):
        super().__init__(f"{message}\n{log}" if log else message)
        self.log = log


def normalize_arch(arch: int | str) -> int:
    """70, "70", "sm_70" or "compute_70" -> 70."""
    if isinstance(arch, int) and not isinstance(arch, bool):
        value = arch
    elif isinstance(arch, str) and re.fullmatch(r"(sm_|compute_)?\d{2,3}", arch.strip()):
        value = int(re.sub(r"\D", "", arch))
    else:
        raise ValueError(f"architecture {arch!r}; accepted: an int such as 70 or a string such as 'sm_70'")
    if value < 50:
        raise ValueError(f"architecture {arch!r} is below sm_50, which no supported NVRTC compiles for")
    return value


@dataclass(frozen=True)
class CompiledProgram:
    cubin: bytes
    lowered_names: dict[str, str]  # name expression -> mangled name
    log: str  # NVRTC program log, including the ptxas -v lines
    nvrtc_version: tuple[int, int]
    arch: int = 0
    # name expression ("&variable<...>") -> the initial bytes of that __device__ variable in the cubin
    variables: dict[str, bytes] = field(default_factory=dict)

    @functools.cached_property
    def cubin_sha256(self) -> str:
        return hashlib.sha256(self.cubin).hexdigest()

    def lowered_name(self, name_expression: str) -> str:
        try:
            return self.lowered_names[name_expression]
        except KeyError:
            raise KeyError(
                f"name expression {name_expression!r} was not compiled; compiled: {sorted(self.lowered_names)}"
            ) from None

    def variable(self, name_expression: str) -> bytes:
        """The initial bytes of the __device__ variable named by name_expression ("&variable<...>")."""
        try:
            return self.variables[name_expression]
        except KeyError:
            raise KeyError(
                f"variable {name_expression!r} was not compiled; compiled variables: {sorted(self.variables)}"
            ) from None


def is_variable_expression(name_expression: str) -> bool:
    """Whether a name expression names a __device__ variable ("&name<...>") rather than a kernel."""
    return name_expression.lstrip().startswith("&")


class NvrtcLibrary:
    """One loaded libnvrtc: ``path``, ``version`` (major, minor), ``supported_archs``."""

    def __init__(self, path: str):
        self.path = path
        self._lib = ctypes.CDLL(path)
        self._declare_functions()
        self.version = self._query_version()
        self.supported_archs = self._query_supported_archs()

    def __repr__(self) -> str:
        return f"NvrtcLibrary({self.path!r}, version={self.version_string})"

    @property
    def version_string(self) -> str:
        return f"{self.version[0]}.{self.version[1]}"

    def supports(self, arch: int) -> bool:
        return arch in self.supported_archs

    def _declare_functions(self) -> None:
        lib = self._lib
        c_int_p = ctypes.POINTER(ctypes.c_int)
        signatures = {
            "nvrtcGetErrorString": ([ctypes.c_int], ctypes.c_char_p),
            "nvrtcVersion": ([c_int_p, c_int_p], ctypes.c_int),
            "nvrtcGetNumSupportedArchs": ([c_int_p], ctypes.c_int),
            "nvrtcGetSupportedArchs": ([c_int_p], ctypes.c_int),
            "nvrtcCreateProgram": (
                [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int,
                 ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_char_p)],
                ctypes.c_int,
            ),
            "nvrtcDestroyProgram": ([ctypes.POINTER(ctypes.c_void_p)], ctypes.c_int),
            "nvrtcAddNameExpression": ([ctypes.c_void_p, ctypes.c_char_p], ctypes.c_int),
            "nvrtcCompileProgram": ([ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)], ctypes.c_int),
            "nvrtcGetProgramLogSize": ([ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)], ctypes.c_int),
            "nvrtcGetProgramLog": ([ctypes.c_void_p, ctypes.c_char_p], ctypes.c_int),
            "nvrtcGetCUBINSize": ([ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)], ctypes.c_int),
            "nvrtcGetCUBIN": ([ctypes.c_void_p, ctypes.c_char_p], ctypes.c_int),
            "nvrtcGetLoweredName": ([ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p)], ctypes.c_int),
        }
        for name, (argtypes, restype) in signatures.items():
            try:
                function = getattr(lib, name)
            except AttributeError:
                raise NvrtcNotFoundError(
                    f"{self.path} has no {name}: NVRTC 11.2 or newer is needed ({INSTALL_HINT})"
                ) from None
            function.argtypes = argtypes
            function.restype = restype

    def check(self, result: int, function: str) -> None:
        if result != NVRTC_SUCCESS:
            message = self._lib.nvrtcGetErrorString(result)
            text = message.decode() if message else f"NVRTC error {result}"
            raise RuntimeError(f"{function} failed: {text} ({result}) [{self.path}]")

    def _query_version(self) -> tuple[int, int]:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.check(self._lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        return major.value, minor.value

    def _query_supported_archs(self) -> tuple[int, ...]:
        count = ctypes.c_int()
        self.check(self._lib.nvrtcGetNumSupportedArchs(ctypes.byref(count)), "nvrtcGetNumSupportedArchs")
        archs = (ctypes.c_int * count.value)()
        self.check(self._lib.nvrtcGetSupportedArchs(archs), "nvrtcGetSupportedArchs")
        return tuple(archs)

    # --- one compilation ---------------------------------------------------------------------------------

    def compile(self, source: str, name_expressions: Sequence[str], options: Sequence[str], program_name: str):
        """(cubin, lowered_names, log); raises CompileError with the log when NVRTC rejects the program."""
        lib = self._lib
        program = ctypes.c_void_p()
        self.check(
            lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), program_name.encode(), 0, None, None),
            "nvrtcCreateProgram",
        )
        try:
            for expression in name_expressions:
                self.check(lib.nvrtcAddNameExpression(program, expression.encode()), "nvrtcAddNameExpression")
            encoded = [option.encode() for option in options]
            result = lib.nvrtcCompileProgram(program, len(encoded), (ctypes.c_char_p * len(encoded))(*encoded))
            log = self._program_log(program)
            if result != NVRTC_SUCCESS:
                reason = lib.nvrtcGetErrorString(result).decode()
                raise CompileError(
                    f"NVRTC {self.version_string} could not compile {program_name} ({reason}) with options "
                    f"{' '.join(options)}; program log:",
                    log,
                )
            return self._cubin(program), self._lowered_names(program, name_expressions), log
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(program))

    def _program_log(self, program: ctypes.c_void_p) -> str:
        size = ctypes.c_size_t()
        self.check(self._lib.nvrtcGetProgramLogSize(program, ctypes.byref(size)), "nvrtcGetProgramLogSize")
        buffer = ctypes.create_string_buffer(size.value)
        self.check(self._lib.nvrtcGetProgramLog(program, buffer), "nvrtcGetProgramLog")
        return buffer.value.decode(errors="replace")

    def _cubin(self, program: ctypes.c_void_p) -> bytes:
        size = ctypes.c_size_t()
        self.check(self._lib.nvrtcGetCUBINSize(program, ctypes.byref(size)), "nvrtcGetCUBINSize")
        if size.value == 0:
            raise CompileError("NVRTC produced no cubin: pass a real architecture (sm_XX), not compute_XX")
        buffer = ctypes.create_string_buffer(size.value)
        self.check(self._lib.nvrtcGetCUBIN(program, buffer), "nvrtcGetCUBIN")
        return buffer.raw

    def _lowered_names(self, program: ctypes.c_void_p, name_expressions: Sequence[str]) -> dict[str, str]:
        lowered = {}
        for expression in name_expressions:
            name = ctypes.c_char_p()
            self.check(
                self._lib.nvrtcGetLoweredName(program, expression.encode(), ctypes.byref(name)),
                f"nvrtcGetLoweredName({expression!r})",
            )
            lowered[expression] = name.value.decode()
        return lowered


# --- finding libnvrtc ------------------------------------------------------------------------------------

_loaded: dict[str, NvrtcLibrary] = {}
_load_failures: dict[str, str] = {}
_load_lock = threading.Lock()


def site_package_dirs() -> list[str]:
    return [entry for entry in sys.path if entry and os.path.isdir(os.path.join(entry, "nvidia"))]


def toolkit_library_paths() -> list[str]:
    roots = [os.environ.get(name) for name in TOOLKIT_ENVS] + [DEFAULT_TOOLKIT]
    paths = []
    for root in filter(None, roots):
        # libnvrtc.so first, then the versioned names (libnvrtc.so.12, libnvrtc.so.12.9.86, ...).
        paths.extend(sorted(glob.glob(os.path.join(root, "lib64", "libnvrtc.so*")), key=len))
    return paths


@functools.cache
def system_nvrtc_name() -> str | None:
    """ctypes.util.find_library("nvrtc"): a soname such as "libnvrtc.so.12" for dlopen (runs ldconfig: cached)."""
    return ctypes.util.find_library("nvrtc")


def wheel_library(distribution: str) -> str | None:
    """The libnvrtc shared library that the installed pip distribution ``distribution`` (e.g.
    ``nvidia-cuda-nvrtc-cu11``) ships, or None when it is not installed or ships none."""
    from importlib import metadata

    try:
        dist = metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return None
    for file in dist.files or ():
        if re.fullmatch(r"libnvrtc\.so\.\d+(\.\d+)*", file.name):
            path = str(dist.locate_file(file))
            if os.path.isfile(path):
                return path
    return None


def explicit_library() -> str | None:
    """``$VOLTA_TRAIN_NVRTC`` as a library path (a path, or an installed wheel's name); None when unset."""
    explicit = os.environ.get(NVRTC_ENV)
    if not explicit:
        return None
    if os.path.isfile(explicit):
        return explicit
    if os.sep not in explicit and (found := wheel_library(explicit)) is not None:
        return found
    raise NvrtcNotFoundError(
        f"{NVRTC_ENV}={explicit!r} is neither a file nor an installed NVRTC wheel; set it to a libnvrtc.so path or "
        "a wheel's name (nvidia-cuda-nvrtc-cu11, nvidia-cuda-nvrtc-cu12), or unset it"
    )


def nvrtc_candidate_paths() -> list[str]:
    """Every libnvrtc found, in order of preference, without duplicates (by real path)."""
    candidates = []
    explicit = explicit_library()
    if explicit:
        candidates.append(explicit)
    for site in site_package_dirs():
        candidates.extend(os.path.join(site, relative) for relative in WHEEL_LIBRARIES)
    candidates.extend(toolkit_library_paths())
    unique, seen = [], set()
    for path in candidates:
        if not os.path.isfile(path):
            continue
        real = os.path.realpath(path)
        if real not in seen:
            seen.add(real)
            unique.append(path)
    system = system_nvrtc_name()
    if system and system not in {os.path.basename(path) for path in unique}:
        unique.append(system)
    return unique


def load_nvrtc(path: str) -> NvrtcLibrary | None:
    """The library at path, loaded once per process; None (reason in load_failures()) if it cannot be used."""
    with _load_lock:
        if path in _loaded:
            return _loaded[path]
        if path in _load_failures:
            return None
        try:
            library = NvrtcLibrary(path)
        except (OSError, RuntimeError) as error:
            _load_failures[path] = str(error).splitlines()[0]
            logger.info("volta_train: skipping libnvrtc %s: %s", path, _load_failures[path])
            return None
        _loaded[path] = library
        return library


def load_failures() -> dict[str, str]:
    return dict(_load_failures)


def available_nvrtc_libraries() -> list[NvrtcLibrary]:
    return [library for library in map(load_nvrtc, nvrtc_candidate_paths()) if library is not None]


def select_nvrtc(libraries: Sequence[NvrtcLibrary], arch: int | None) -> NvrtcLibrary:
    """The first library that compiles for arch (any, when arch is None); NvrtcNotFoundError saying why not."""
    if not libraries:
        failures = "; ".join(f"{path}: {why}" for path, why in _load_failures.items())
        raise NvrtcNotFoundError(
            "no usable libnvrtc found (looked in $VOLTA_TRAIN_NVRTC, the nvidia/* pip wheels on sys.path, "
            f"$CUDA_HOME/$CUDA_PATH/{DEFAULT_TOOLKIT} lib64, the system library path)"
            + (f"; could not load: {failures}" if failures else "")
            + f". Install NVRTC 12 with `{INSTALL_HINT}` (it compiles sm_70 ... sm_90 and newer)"
        )
    if arch is None:
        return libraries[0]
    for library in libraries:
        if library.supports(arch):
            return library
    found = ", ".join(
        f"NVRTC {library.version_string} at {library.path} (sm_{min(library.supported_archs)}.."
        f"sm_{max(library.supported_archs)})"
        for library in libraries
    )
    hint = f"install NVRTC 12 with `{INSTALL_HINT}`"
    if arch < 75 and all(library.version[0] >= 13 for library in libraries):
        hint = f"NVRTC 13 and newer cannot compile sm_{arch} (CUDA 13 dropped Volta); " + hint
    raise NvrtcNotFoundError(f"no libnvrtc found compiles for sm_{arch}: found {found}; {hint}")


def find_nvrtc(arch: int | str | None = None) -> NvrtcLibrary:
    """The libnvrtc to use for arch (e.g. 70 or "sm_70"); any usable one when arch is None."""
    target = None if arch is None else normalize_arch(arch)
    return select_nvrtc(available_nvrtc_libraries(), target)


# --- compiling ------------------------------------------------------------------------------------------


def compile_options(arch: int, options: Iterable[str] = (), include_dirs: Iterable[str] = ()) -> list[str]:
    """The full NVRTC option list: target, C++17, ptxas -v, the include paths, then the caller's options."""
    return (
        [f"--gpu-architecture=sm_{arch}", *ALWAYS_OPTIONS]
        + [f"--include-path={os.fspath(directory)}" for directory in include_dirs]
        + list(options)
    )


def compile_program(
    source: str,
    name_expressions: Sequence[str],
    arch: int | str,
    options: Sequence[str] = (),
    include_dirs: Sequence[str | os.PathLike] = (),
    program_name: str = "volta_train.cu",
    library: NvrtcLibrary | None = None,
) -> CompiledProgram:
    """Compile source to an sm_<arch> cubin; name_expressions (e.g. "kernel<64, true>") get lowered names, and
    those of __device__ variables ("&variable<64>") their initial bytes too."""
    target = normalize_arch(arch)
    library = library or find_nvrtc(target)
    full_options = compile_options(target, options, include_dirs)
    cubin, lowered, log = library.compile(source, list(name_expressions), full_options, program_name)
    variables = {expression: cubin_image.variable_bytes(cubin, lowered[expression])
                 for expression in name_expressions if is_variable_expression(expression)}
    return CompiledProgram(cubin=cubin, lowered_names=lowered, log=log, nvrtc_version=library.version, arch=target,
                           variables=variables)


# --- ptxas -v ---------------------------------------------------------------------------------------------

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for 'sm_\d+\w*'")
_PROPERTIES = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


_NO_RESOURCES = {
    "registers": 0, "spill_store_bytes": 0, "spill_load_bytes": 0, "stack_bytes": 0, "static_smem_bytes": 0,
    "entry": False,
}


def parse_ptxas_log(log: str) -> dict[str, dict[str, int | bool]]:
    """mangled name -> {registers, spill_store_bytes, spill_load_bytes, stack_bytes, static_smem_bytes, entry}.

    Reads the ptxas -v lines of an NVRTC log. Entry functions (kernels) have entry=True; non-inlined device
    functions appear too (registers 0: ptxas reports their frame and spills only).
    """
    functions: dict[str, dict[str, int | bool]] = {}
    current_entry = None  # the kernel a "Used N registers" line belongs to
    frame_owner = None  # the function a "bytes stack frame" line belongs to
    for line in log.splitlines():
        if match := _ENTRY.search(line):
            current_entry = match.group(1)
            functions.setdefault(current_entry, dict(_NO_RESOURCES))["entry"] = True
        elif match := _PROPERTIES.search(line):
            frame_owner = match.group(1)
            functions.setdefault(frame_owner, dict(_NO_RESOURCES))
        elif (match := _FRAME.search(line)) and frame_owner is not None:
            stack, stores, loads = map(int, match.groups())
            functions[frame_owner].update(stack_bytes=stack, spill_store_bytes=stores, spill_load_bytes=loads)
            frame_owner = None
        elif (match := _USED.search(line)) and current_entry is not None:
            smem = _SMEM.search(line)
            functions[current_entry].update(
                registers=int(match.group(1)), static_smem_bytes=int(smem.group(1)) if smem else 0
            )
    return functions
