"""Loading and launching NVRTC cubins through the CUDA driver API (volta_train/kernels/driver.py).

The gpu-marked tests compile the probe (tests/kernels/probe_mma.cu: one m8n8k4 mma per warp, four independent 8x8x4
products per warp, one per quad-pair) for the GPU present, launch it on PyTorch's stream and compare with a
float64 matmul. The unmarked tests check argument marshalling and need no GPU.
"""

from __future__ import annotations

import ctypes
import os
import threading

import pytest
import torch

from volta_train.kernels import cache, driver
from volta_train.kernels.nvrtc import CompiledProgram, NvrtcNotFoundError

from probes import PROBE_SMEM_BYTES, PROBE_THREADS, PROBE_VARIANT, PROBE_WARPS_PER_BLOCK, ProbeParams

PROBE = PROBE_VARIANT.name_expressions[0]
FLOATS_PER_WARP = 4 * 64  # four 8x8 fp32 tiles


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def probe_program(tmp_path_factory) -> CompiledProgram:
    """The probe compiled for the present GPU, through a fresh cache directory."""
    major, minor = torch.cuda.get_device_capability(0)
    saved = os.environ.get(cache.CACHE_DIR_ENV)
    os.environ[cache.CACHE_DIR_ENV] = str(tmp_path_factory.mktemp("kernel-cache"))
    cache.clear_memo()
    try:
        return PROBE_VARIANT.compile(10 * major + minor)
    except NvrtcNotFoundError as error:
        pytest.skip(f"no NVRTC for sm_{major}{minor}: {error}")
    finally:
        if saved is None:
            os.environ.pop(cache.CACHE_DIR_ENV, None)
        else:
            os.environ[cache.CACHE_DIR_ENV] = saved
        cache.clear_memo()


@pytest.fixture(scope="module")
def probe(probe_program) -> driver.KernelFunction:
    """The probe kernel loaded on cuda:0."""
    return driver.load_function(probe_program, PROBE, torch.device("cuda", 0))


def _random_problem(num_warps: int, device: torch.device, seed: int):
    generator = torch.Generator(device=device).manual_seed(seed)
    products = num_warps * 4
    a = torch.randn(products, 8, 4, generator=generator, device=device).half()
    b = torch.randn(products, 4, 8, generator=generator, device=device).half()
    c = torch.randn(products, 8, 8, generator=generator, device=device)
    return a, b, c


def _problem(num_warps: int, device: torch.device, seed: int, spare_warps: int = 2):
    """(a, b, c, d): random inputs and a NaN output with room for spare_warps more warps than the kernel may write."""
    a, b, c = _random_problem(num_warps, device, seed)
    d = torch.full(((num_warps + spare_warps) * 4, 8, 8), float("nan"), device=device)
    return a, b, c, d


def _expected(a, b, c, alpha: float) -> torch.Tensor:
    return alpha * (torch.matmul(a.double(), b.double()) + c.double())


def _params(a, b, c, d, num_warps: int, alpha: float) -> ProbeParams:
    return ProbeParams(a.data_ptr(), b.data_ptr(), c.data_ptr(), d.data_ptr(), num_warps, alpha)


def _blocks(num_warps: int) -> int:
    return -(-num_warps // PROBE_WARPS_PER_BLOCK)


def _launch(kernel, params: ProbeParams, num_warps: int, shared_bytes: int | None = None, stream=None) -> None:
    kernel.launch(
        grid=(_blocks(num_warps),),
        block=(PROBE_THREADS,),
        shared_bytes=PROBE_SMEM_BYTES if shared_bytes is None else shared_bytes,
        args=[params],
        stream=stream,
    )


def _check(d: torch.Tensor, a, b, c, alpha: float, num_warps: int) -> None:
    products = num_warps * 4
    torch.testing.assert_close(d[:products].double(), _expected(a, b, c, alpha), rtol=1e-5, atol=1e-4)
    assert torch.isnan(d[products:]).all(), "the kernel wrote past num_warps"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("num_warps, seed", [(1, 0), (5, 1), (64, 2)])
def test_probe_matches_float64_matmul(probe, num_warps, seed):
    device = probe.device
    a, b, c, d = _problem(num_warps, device, seed)
    _launch(probe, _params(a, b, c, d, num_warps, 0.5), num_warps)
    torch.cuda.synchronize(device)
    _check(d, a, b, c, 0.5, num_warps)


@pytest.mark.gpu
@needs_gpu
def test_probe_on_a_side_stream_with_64_kb_of_dynamic_shared_memory(probe):
    device, num_warps = probe.device, 7
    a, b, c, d = _problem(num_warps, device, 3)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        _launch(probe, _params(a, b, c, d, num_warps, -2.0), num_warps, shared_bytes=64 * 1024)  # above 48 KB
    side.synchronize()
    _check(d, a, b, c, -2.0, num_warps)


@pytest.mark.gpu
@needs_gpu
def test_probe_launched_from_a_fresh_thread(probe):
    device, num_warps = probe.device, 3
    a, b, c, d = _problem(num_warps, device, 4)
    errors = []

    def launch_in_thread():
        try:
            _launch(probe, _params(a, b, c, d, num_warps, 1.0), num_warps)  # no context current in this thread yet
        except Exception as error:  # reported below
            errors.append(error)

    worker = threading.Thread(target=launch_in_thread)
    worker.start()
    worker.join()
    assert not errors, errors
    torch.cuda.synchronize(device)
    _check(d, a, b, c, 1.0, num_warps)


@pytest.mark.gpu
@needs_gpu
def test_probe_inside_a_cuda_graph(probe):
    device, num_warps = probe.device, 4
    a, b, c, d = _problem(num_warps, device, 5)
    params = _params(a, b, c, d, num_warps, 1.0)
    graph = torch.cuda.CUDAGraph()
    capture_stream = torch.cuda.Stream(device)
    capture_stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.graph(graph, stream=capture_stream):
        _launch(probe, params, num_warps)  # on the capturing stream, torch's current stream inside the block
    torch.cuda.current_stream(device).wait_stream(capture_stream)
    for seed in (6, 7):
        fresh_a, fresh_b, fresh_c = _random_problem(num_warps, device, seed)
        a.copy_(fresh_a)
        b.copy_(fresh_b)
        c.copy_(fresh_c)
        d.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize(device)
        _check(d, a, b, c, 1.0, num_warps)


@pytest.mark.gpu
@needs_gpu
def test_loaded_kernel_attributes_and_caching(probe, probe_program):
    attributes = probe.attributes
    assert attributes.num_regs > 0
    assert attributes.max_threads_per_block == PROBE_THREADS  # __launch_bounds__
    assert attributes.static_smem_bytes == 0 and attributes.local_bytes == 0
    if probe.param_sizes is not None:
        assert probe.param_sizes == (ctypes.sizeof(ProbeParams),)
    assert driver.load_function(probe_program, PROBE, "cuda:0") is probe
    assert driver.load_function(probe_program, PROBE, 0) is probe


@pytest.mark.gpu
@needs_gpu
def test_wrong_arguments_are_refused_before_the_launch(probe):
    with pytest.raises(TypeError, match="accepted: ctypes instances"):
        probe.launch((1,), (64,), 0, [7])
    if probe.param_sizes is not None:
        with pytest.raises(TypeError, match="parameter 0 is 40 bytes"):
            probe.launch((1,), (64,), 0, [ctypes.c_int(1)])
        with pytest.raises(TypeError, match="takes 1 parameters, 2 arguments"):
            probe.launch((1,), (64,), 0, [ProbeParams(), ctypes.c_int(1)])


@pytest.mark.gpu
@needs_gpu
def test_driver_errors_name_the_call(probe):
    with pytest.raises(driver.CudaDriverError, match=r"cuLaunchKernel\(.*CUDA_ERROR_INVALID_VALUE"):
        probe.launch((1,), (2048,), 0, [ProbeParams()])  # more threads than a block may have


@pytest.mark.gpu
@needs_gpu
def test_cubin_for_another_architecture_is_refused():
    major, _ = torch.cuda.get_device_capability(0)
    other = CompiledProgram(cubin=b"", lowered_names={"k": "k"}, log="", nvrtc_version=(12, 9), arch=10 * (major + 1))
    with pytest.raises(ValueError, match=f"compiled for sm_{10 * (major + 1)} cannot run on"):
        driver.load_function(other, "k", 0)


# --- no GPU needed ---------------------------------------------------------------------------------------------


def _unloaded_kernel(param_sizes=(ctypes.sizeof(ProbeParams),)) -> driver.KernelFunction:
    kernel = driver.KernelFunction.__new__(driver.KernelFunction)
    kernel.name, kernel.device, kernel.param_sizes = "probe", torch.device("cuda", 0), param_sizes
    return kernel


def test_struct_argument_is_passed_by_address_of_its_bytes():
    params = ProbeParams(1, 2, 3, 4, 5, 0.5)
    objects, addresses = _unloaded_kernel()._argument_addresses([params])
    assert objects == [params] and addresses == [ctypes.addressof(params)]
    assert ctypes.sizeof(ProbeParams) == 40


def test_argument_checks_without_a_gpu():
    kernel = _unloaded_kernel()
    with pytest.raises(TypeError, match="argument 0 is a int"):
        kernel._argument_addresses([3])
    with pytest.raises(TypeError, match="parameter 0 is 40 bytes; argument 0 \\(c_int\\) is 4 bytes"):
        kernel._argument_addresses([ctypes.c_int(3)])
    with pytest.raises(TypeError, match="takes 1 parameters, 0 arguments"):
        kernel._argument_addresses([])
    with pytest.raises(ValueError, match="tensor on cpu"):
        _unloaded_kernel(None)._argument_addresses([torch.zeros(1)])
    unchecked = _unloaded_kernel(None)
    values = [ctypes.c_void_p(1), ctypes.c_int(2), ctypes.c_float(3.0), ctypes.c_int64(4)]
    assert unchecked._argument_addresses(values)[1] == [ctypes.addressof(value) for value in values]


@pytest.mark.parametrize(
    "given, expected", [(4, (4, 1, 1)), ((4,), (4, 1, 1)), ([2, 3], (2, 3, 1)), ((1, 2, 3), (1, 2, 3))]
)
def test_dim3(given, expected):
    assert driver._dim3(given, "grid") == expected


@pytest.mark.parametrize("bad", [0, (), (1, 2, 3, 4), (2.0,), (-1,)])
def test_dim3_rejects(bad):
    with pytest.raises(ValueError, match="grid="):
        driver._dim3(bad, "grid")


def test_cpu_device_is_refused():
    with pytest.raises(ValueError, match="CUDA devices only"):
        driver.cuda_device("cpu")
