"""The CUDA driver API through ctypes (libcuda.so.1): load cubins and launch kernels on PyTorch's streams.

No PyTorch C++ ABI is involved. Modules are loaded into the device's primary context, the one PyTorch's
runtime uses, and cached per (context, cubin sha256); kernels are launched with ``cuLaunchKernel`` on
``torch.cuda.current_stream(device)`` unless a stream is given. Every driver call is checked; a failure raises
:class:`CudaDriverError` naming the call, ``cuGetErrorName`` and ``cuGetErrorString``.

Kernel arguments are ctypes instances (``c_void_p``, ``c_int``, ``c_float``, ``c_int64``, ..., or a
``ctypes.Structure`` passed by value as one parameter) or ``torch.Tensor`` (passed as its data pointer). Where
the driver has ``cuFuncGetParamInfo`` (CUDA 12.4+), the sizes of the arguments are checked against the kernel's
parameters before the launch, and their number too where it also has ``cuFuncGetParamCount``; the driver is never
asked about a parameter index the kernel does not have.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .nvrtc import CompiledProgram

logger = logging.getLogger("volta_train")

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
DEFAULT_DYNAMIC_SMEM_LIMIT = 48 * 1024

# CUfunction_attribute
CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0
CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1
CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES = 2
CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES = 3
CU_FUNC_ATTRIBUTE_NUM_REGS = 4
CU_FUNC_ATTRIBUTE_PTX_VERSION = 5
CU_FUNC_ATTRIBUTE_BINARY_VERSION = 6
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8

_CTYPES_ARGUMENT = (ctypes._SimpleCData, ctypes.Structure, ctypes.Union, ctypes.Array)


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed (``.code``: the CUresult, ``.error_name``: e.g. CUDA_ERROR_INVALID_VALUE)."""

    def __init__(self, message: str, code: int = -1, error_name: str = ""):
        super().__init__(message)
        self.code = code
        self.error_name = error_name


class _Driver:
    """libcuda.so.1 with the signatures used here declared."""

    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as error:
            raise CudaDriverError(
                f"cannot load libcuda.so.1 ({error}): the NVIDIA driver is not installed or not visible here"
            ) from error
        void_p, c_int, c_uint, size_t = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_size_t
        pointer = ctypes.POINTER
        signatures = {
            "cuGetErrorName": [c_int, pointer(ctypes.c_char_p)],
            "cuGetErrorString": [c_int, pointer(ctypes.c_char_p)],
            "cuInit": [c_uint],
            "cuDriverGetVersion": [pointer(c_int)],
            "cuDeviceGet": [pointer(c_int), c_int],
            "cuDevicePrimaryCtxRetain": [pointer(void_p), c_int],
            "cuCtxGetCurrent": [pointer(void_p)],
            "cuCtxPushCurrent_v2": [void_p],
            "cuCtxPopCurrent_v2": [pointer(void_p)],
            "cuModuleLoadData": [pointer(void_p), ctypes.c_char_p],
            "cuModuleGetFunction": [pointer(void_p), void_p, ctypes.c_char_p],
            "cuFuncGetAttribute": [pointer(c_int), c_int, void_p],
            "cuFuncSetAttribute": [void_p, c_int, c_int],
            "cuLaunchKernel": [void_p, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, void_p,
                               pointer(void_p), pointer(void_p)],
        }
        for name, argtypes in signatures.items():
            function = getattr(self.lib, name)
            function.argtypes = argtypes
            function.restype = c_int
        self.get_param_info = getattr(self.lib, "cuFuncGetParamInfo", None)  # CUDA 12.4+
        if self.get_param_info is not None:
            self.get_param_info.argtypes = [void_p, size_t, pointer(size_t), pointer(size_t)]
            self.get_param_info.restype = c_int
        self.get_param_count = getattr(self.lib, "cuFuncGetParamCount", None)  # newer drivers
        if self.get_param_count is not None:
            self.get_param_count.argtypes = [void_p, pointer(size_t)]
            self.get_param_count.restype = c_int

    def error_text(self, code: int) -> tuple[str, str]:
        name, text = ctypes.c_char_p(), ctypes.c_char_p()
        self.lib.cuGetErrorName(code, ctypes.byref(name))
        self.lib.cuGetErrorString(code, ctypes.byref(text))
        return (name.value or b"CUDA_ERROR_UNKNOWN_CODE").decode(), (text.value or b"unknown error").decode()

    def check(self, code: int, call: str) -> None:
        if code != CUDA_SUCCESS:
            error_name, text = self.error_text(code)
            raise CudaDriverError(f"{call} failed: {error_name} ({code}): {text}", code, error_name)


_driver: _Driver | None = None
_lock = threading.RLock()  # guards the caches below; held while loading so each load happens once
_primary_contexts: dict[int, int] = {}  # device index -> CUcontext
_modules: dict[tuple[int, str], int] = {}  # (CUcontext, cubin sha256) -> CUmodule
_functions: dict[tuple[int, str, str], KernelFunction] = {}  # (CUcontext, cubin sha256, mangled name)


def driver() -> _Driver:
    global _driver
    with _lock:
        if _driver is None:
            loaded = _Driver()
            loaded.check(loaded.lib.cuInit(0), "cuInit")
            _driver = loaded
        return _driver


def driver_version() -> tuple[int, int]:
    """The CUDA version the installed driver supports, e.g. (12, 8)."""
    version = ctypes.c_int()
    api = driver()
    api.check(api.lib.cuDriverGetVersion(ctypes.byref(version)), "cuDriverGetVersion")
    return version.value // 1000, (version.value % 1000) // 10


# --- devices and contexts ----------------------------------------------------------------------------------


def cuda_device(device: torch.device | str | int | None) -> torch.device:
    """torch.device("cuda", index) with the index filled in; ValueError for anything but a CUDA device."""
    if device is None:
        device = torch.device("cuda")
    elif isinstance(device, int):
        device = torch.device("cuda", device)
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device {device}: the Volta kernels launch on CUDA devices only (e.g. 'cuda:0')")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def primary_context(device: torch.device) -> int:
    """The device's primary context (PyTorch's), initialised by PyTorch first and retained once per process."""
    index = device.index
    with _lock:
        if index not in _primary_contexts:
            torch.cuda.init()
            with torch.cuda.device(index):
                torch.empty(0, device=device)  # PyTorch sets the device (and its primary context) up on this thread
            api = driver()
            handle, context = ctypes.c_int(), ctypes.c_void_p()
            api.check(api.lib.cuDeviceGet(ctypes.byref(handle), index), f"cuDeviceGet({index})")
            api.check(
                api.lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), handle), f"cuDevicePrimaryCtxRetain({index})"
            )
            _primary_contexts[index] = context.value
        return _primary_contexts[index]


class _InContext:
    """Make context current for a block, restoring the thread's previous context after it (no-op if current)."""

    __slots__ = ("api", "context", "pushed")

    def __init__(self, api: _Driver, context: int):
        self.api, self.context, self.pushed = api, context, False

    def __enter__(self) -> None:
        current = ctypes.c_void_p()
        self.api.check(self.api.lib.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
        if current.value != self.context:
            self.api.check(self.api.lib.cuCtxPushCurrent_v2(self.context), "cuCtxPushCurrent")
            self.pushed = True

    def __exit__(self, *exc) -> None:
        if self.pushed:
            popped = ctypes.c_void_p()
            self.api.check(self.api.lib.cuCtxPopCurrent_v2(ctypes.byref(popped)), "cuCtxPopCurrent")
            self.pushed = False


# --- modules and functions ---------------------------------------------------------------------------------


def check_binary_compatible(compiled: CompiledProgram, device: torch.device) -> None:
    """An sm_XY cubin runs on sm_XZ with Z >= Y only; raise ValueError naming both otherwise."""
    major, minor = torch.cuda.get_device_capability(device)
    if compiled.arch and (compiled.arch // 10 != major or compiled.arch % 10 > minor):
        raise ValueError(
            f"cubin compiled for sm_{compiled.arch} cannot run on {device} "
            f"({torch.cuda.get_device_name(device)}, sm_{major}{minor}); compile for sm_{major}{minor}"
        )


def load_module(compiled: CompiledProgram, device: torch.device) -> tuple[int, int]:
    """(context, CUmodule) with the cubin loaded in device's primary context, once per process."""
    context = primary_context(device)
    key = (context, compiled.cubin_sha256)
    with _lock:
        if key not in _modules:
            check_binary_compatible(compiled, device)
            api = driver()
            module = ctypes.c_void_p()
            with _InContext(api, context):
                api.check(
                    api.lib.cuModuleLoadData(ctypes.byref(module), compiled.cubin), f"cuModuleLoadData on {device}"
                )
            _modules[key] = module.value
        return context, _modules[key]


def load_function(
    compiled: CompiledProgram, name_expression: str, device: torch.device | str | int | None = None
) -> KernelFunction:
    """The kernel name_expression (e.g. "volta_probe_mma_kernel<2>") of compiled, loaded on device."""
    device = cuda_device(device)
    mangled = compiled.lowered_name(name_expression)
    context, module = load_module(compiled, device)
    key = (context, compiled.cubin_sha256, mangled)
    with _lock:
        if key not in _functions:
            api = driver()
            handle = ctypes.c_void_p()
            api.check(
                api.lib.cuModuleGetFunction(ctypes.byref(handle), module, mangled.encode()),
                f"cuModuleGetFunction({name_expression!r} = {mangled})",
            )
            _functions[key] = KernelFunction(handle.value, name_expression, device, context)
        return _functions[key]


@dataclass(frozen=True)
class FunctionAttributes:
    num_regs: int
    max_threads_per_block: int
    static_smem_bytes: int
    const_bytes: int
    local_bytes: int
    max_dynamic_smem_bytes: int
    binary_version: int
    ptx_version: int


class KernelFunction:
    """One loaded kernel: ``.attributes``, ``.param_sizes`` and ``.launch(...)``."""

    def __init__(self, handle: int, name: str, device: torch.device, context: int):
        self.handle = handle
        self.name = name
        self.device = device
        self.context = context
        self._api = driver()
        self.attributes = self._read_attributes()
        self._dynamic_smem_limit = self.attributes.max_dynamic_smem_bytes
        self.param_sizes = self._read_param_sizes()
        self._set_smem_lock = threading.RLock()  # guards the caches below; held while loading so each load happens once

    def __repr__(self) -> str:
        return f"KernelFunction({self.name!r} on {self.device}, {self.attributes.num_regs} registers)"

    def _attribute(self, attribute: int, label: str) -> int:
        value = ctypes.c_int()
        self._api.check(
            self._api.lib.cuFuncGetAttribute(ctypes.byref(value), attribute, self.handle),
            f"cuFuncGetAttribute({label}) of {self.name}",
        )
        return value.value

    def _read_attributes(self) -> FunctionAttributes:
        return FunctionAttributes(
            num_regs=self._attribute(CU_FUNC_ATTRIBUTE_NUM_REGS, "NUM_REGS"),
            max_threads_per_block=self._attribute(CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, "MAX_THREADS_PER_BLOCK"),
            static_smem_bytes=self._attribute(CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, "SHARED_SIZE_BYTES"),
            const_bytes=self._attribute(CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES, "CONST_SIZE_BYTES"),
            local_bytes=self._attribute(CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, "LOCAL_SIZE_BYTES"),
            max_dynamic_smem_bytes=self._attribute(
                CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, "MAX_DYNAMIC_SHARED_SIZE_BYTES"
            ),
            binary_version=self._attribute(CU_FUNC_ATTRIBUTE_BINARY_VERSION, "BINARY_VERSION"),
            ptx_version=self._attribute(CU_FUNC_ATTRIBUTE_PTX_VERSION, "PTX_VERSION"),
        )

    def _read_param_sizes(self) -> tuple[int, ...] | None:
        """Byte size of each kernel parameter, or None where the driver cannot say how many there are.

        The count comes from ``cuFuncGetParamCount`` (newer drivers); the sizes from ``cuFuncGetParamInfo``
        (CUDA 12.4+), asked only for indices below the count: probing past the last parameter would be a call the
        driver rejects (compute-sanitizer's memcheck reports each one). Without the count, :meth:`_param_size`
        checks the arguments actually given, index by index, at the first launch with that many arguments.
        """
        get_param_count, get_param_info = self._api.get_param_count, self._api.get_param_info
        if get_param_count is None or get_param_info is None:
            return None
        count = ctypes.c_size_t()
        code = get_param_count(self.handle, ctypes.byref(count))
        if code != CUDA_SUCCESS:  # e.g. not supported by this driver: the per-argument check below still runs
            logger.debug("volta_train: cuFuncGetParamCount(%s) gave %d; parameter count unchecked", self.name, code)
            return None
        sizes = tuple(self._param_size(index) for index in range(count.value))
        return None if None in sizes else sizes

    def _param_size(self, index: int, given: int | None = None) -> int | None:
        """Size of parameter `index` from cuFuncGetParamInfo; None where the driver lacks it or declines.

        Raises TypeError when the driver says the kernel has no parameter `index` (more arguments than
        parameters)."""
        get_param_info = self._api.get_param_info
        if get_param_info is None:
            return None
        offset, size = ctypes.c_size_t(), ctypes.c_size_t()
        code = get_param_info(self.handle, index, ctypes.byref(offset), ctypes.byref(size))
        if code == CUDA_ERROR_INVALID_VALUE:
            raise TypeError(f"{self.name} takes {index} parameters, {given if given is not None else 'more'} arguments were given")
        if code != CUDA_SUCCESS:
            logger.debug("volta_train: cuFuncGetParamInfo(%s, %d) gave %d; argument sizes unchecked", self.name, index, code)
            return None
        return size.value

    def _given_param_sizes(self, count: int) -> tuple[int, ...] | None:
        """Sizes of the first `count` parameters where the driver gives no parameter count (asked once per count)."""
        cache = self.__dict__.setdefault("_given_sizes", {})
        if count not in cache:
            sizes = tuple(self._param_size(index, count) for index in range(count)) if hasattr(self, "_api") else ()
            cache[count] = None if (not sizes or None in sizes) else sizes
        return cache[count]

    def set_max_dynamic_smem(self, nbytes: int) -> None:
        """Opt in to nbytes of dynamic shared memory (needed above 48 KB)."""
        with self._set_smem_lock:
            self._api.check(
                self._api.lib.cuFuncSetAttribute(self.handle, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes),
                f"cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES={nbytes}) of {self.name}",
            )
            self._dynamic_smem_limit = max(self._dynamic_smem_limit, nbytes)

    def launch(
        self,
        grid: int | Sequence[int],
        block: int | Sequence[int],
        shared_bytes: int = 0,
        args: Sequence = (),
        stream: torch.cuda.Stream | int | None = None,
    ) -> None:
        """Launch on stream (default: torch.cuda.current_stream(self.device)); asynchronous like any launch."""
        grid_xyz = _dim3(grid, "grid")
        block_xyz = _dim3(block, "block")
        if shared_bytes < 0:
            raise ValueError(f"shared_bytes={shared_bytes}; accepted: >= 0")
        if shared_bytes > self._dynamic_smem_limit:
            self.set_max_dynamic_smem(shared_bytes)
        objects, addresses = self._argument_addresses(args)  # objects stay alive until the launch returns
        parameters = (ctypes.c_void_p * len(addresses))(*addresses) if addresses else None
        stream_handle = _stream_handle(stream, self.device)
        with _InContext(self._api, self.context):
            code = self._api.lib.cuLaunchKernel(
                self.handle, *grid_xyz, *block_xyz, shared_bytes, stream_handle, parameters, None
            )
        if code != CUDA_SUCCESS:
            self._api.check(
                code, f"cuLaunchKernel({self.name}, grid={grid_xyz}, block={block_xyz}, shared_bytes={shared_bytes})"
            )

    def _argument_addresses(self, args: Sequence) -> tuple[list, list[int]]:
        """(objects to keep alive, address of each argument's bytes); checks sizes against the kernel's params."""
        if self.param_sizes is not None and len(args) != len(self.param_sizes):
            raise TypeError(f"{self.name} takes {len(self.param_sizes)} parameters, {len(args)} arguments were given")
        objects = [self._as_ctypes(index, value) for index, value in enumerate(args)]
        sizes = self.param_sizes if self.param_sizes is not None else self._given_param_sizes(len(objects))
        if sizes is not None:
            for index, (value, expected) in enumerate(zip(objects, sizes)):
                if ctypes.sizeof(value) != expected:
                    raise TypeError(
                        f"{self.name} parameter {index} is {expected} bytes; argument {index} "
                        f"({type(value).__name__}) is {ctypes.sizeof(value)} bytes"
                    )
        return objects, [ctypes.addressof(value) for value in objects]

    def _as_ctypes(self, index: int, value):
        if isinstance(value, _CTYPES_ARGUMENT):
            return value
        if isinstance(value, torch.Tensor):
            if value.device != self.device:
                raise ValueError(f"{self.name} argument {index}: tensor on {value.device}, kernel on {self.device}")
            return ctypes.c_void_p(value.data_ptr())
        raise TypeError(
            f"{self.name} argument {index} is a {type(value).__name__}; accepted: ctypes instances (c_void_p, c_int, "
            "c_float, c_int64, ..., a ctypes.Structure passed by value) or a torch.Tensor (its data pointer)"
        )


def _dim3(value: int | Sequence[int], what: str) -> tuple[int, int, int]:
    dims = (value,) if isinstance(value, int) else tuple(value)
    if not 1 <= len(dims) <= 3 or not all(isinstance(d, int) and d >= 1 for d in dims):
        raise ValueError(f"{what}={value!r}; accepted: 1 to 3 positive ints, e.g. (num_blocks,) or (x, y, z)")
    return dims + (1,) * (3 - len(dims))


def _stream_handle(stream: torch.cuda.Stream | int | None, device: torch.device) -> int:
    if stream is None:
        return torch.cuda.current_stream(device).cuda_stream
    if isinstance(stream, int):
        return stream
    if isinstance(stream, torch.cuda.Stream):
        if stream.device != device:
            raise ValueError(f"stream is on {stream.device}, kernel on {device}")
        return stream.cuda_stream
    raise TypeError(f"stream is a {type(stream).__name__}; accepted: None, a torch.cuda.Stream or a CUstream int")
