"""The launch geometry each kernel exports (csrc/launch_geometry.cuh): read from the cubin (volta_train/kernels/
cubin.py), kept by the kernel cache, and equal to what the tile tables describe. CPU only (NVRTC, no GPU)."""

from __future__ import annotations

import pytest

from volta_train.kernels import cache, cubin, nvrtc, tiles
from volta_train.kernels.nvrtc import CompiledProgram, NvrtcNotFoundError
from volta_train.kernels.variants import KernelVariant, LaunchGeometry, geometry_expression


@pytest.fixture
def compiles(tmp_path, monkeypatch):
    """NVRTC for sm_70 (else skip), an empty cache directory and memo."""
    try:
        nvrtc.find_nvrtc(70)
    except NvrtcNotFoundError as error:
        pytest.skip(f"no libnvrtc for sm_70 here: {error}")
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path / "kernel-cache"))
    cache.clear_memo()
    yield
    cache.clear_memo()


def test_the_cubin_reader_finds_a_device_variable(compiles):
    source = ("struct Pair { int a, b; };\n"
              "template <int N> __device__ Pair pair = {N, 2 * N};\n"
              "__device__ int zeros[3];\n"
              "__global__ void touch(int* d) { d[0] = pair<7>.a + zeros[1]; }\n")
    program = nvrtc.compile_program(source, ["touch", "&pair<7>", "&zeros"], 70)
    assert program.variable("&pair<7>") == (7).to_bytes(4, "little") + (14).to_bytes(4, "little")
    assert program.variable("&zeros") == bytes(12)
    assert "touch" not in program.variables  # kernels are not variables
    with pytest.raises(cubin.CubinError, match="the cubin has no symbol _Znothing"):
        cubin.variable_bytes(program.cubin, "_Znothing")
    with pytest.raises(cubin.CubinError, match="not a little-endian ELF64 image"):
        cubin.variable_bytes(b"not a cubin", "x")
    with pytest.raises(KeyError, match="variable '&pair<8>' was not compiled"):
        program.variable("&pair<8>")


def test_the_cache_entry_keeps_the_exported_bytes():
    program = CompiledProgram(cubin=b"\x7fELF-not-really", lowered_names={"&g<1>": "_Z1gILi1EE"}, log="",
                              nvrtc_version=(12, 9), arch=70, variables={"&g<1>": b"\x01\x00\x00\x00"})
    decoded = cache.decode_entry(cache.encode_entry("k", program), "k")
    assert decoded.variables == program.variables and decoded.cubin == program.cubin


def _shipped_samples() -> list[KernelVariant]:
    return [
        tiles.fwd_variant(64, tiles.fwd_tile(64, False, 70), False, False),
        tiles.fwd_variant(128, tiles.fwd_tile(128, True, 90), True, True, True),
        tiles.bwd_variant(64, tiles.bwd_tile(64, 70), False, False, True),
        tiles.bwd_variant(256, tiles.bwd_tile(256, 70), False, True, False),
        tiles.dq_variant(128, tiles.dq_tile(128, 70), False, False),
        tiles.decode_variant(256, tiles.decode_tile(256, 70), True),
    ]


@pytest.mark.parametrize("variant", _shipped_samples(), ids=lambda v: v.name)
def test_shipped_kernels_export_the_geometry_of_their_tile(compiles, variant):
    tile = variant.meta["tile"]
    geometry = variant.geometry(70)
    assert (geometry.threads, geometry.block_m, geometry.block_n) == (tile.threads, tile.block_m, tile.block_n)
    assert 0 < geometry.dynamic_smem_bytes <= 96 * 1024 and geometry.dynamic_smem_bytes % 16 == 0
    assert variant.compiled_expressions == variant.name_expressions + (geometry_expression(variant.name_expressions[0]),)


def test_the_split_combine_exports_its_warp_per_row_geometry(compiles):
    geometry = tiles.combine_variant(64).geometry(70)
    assert geometry == LaunchGeometry(0, 32 * tiles.COMBINE_ROWS_PER_CTA, tiles.COMBINE_ROWS_PER_CTA, 0)


def test_geometry_names_and_refusals():
    kernel = "flash_fwd_kernel<FwdKernelTraits<64, 2>>"
    assert geometry_expression(kernel) == "&flash_fwd_kernel_geometry<FwdKernelTraits<64, 2>>"
    assert geometry_expression("plain") == "&plain_geometry"
    none = KernelVariant(name="t", sources=("t.cu",), name_expressions=("t",), exports_geometry=False)
    assert none.compiled_expressions == ("t",)
    with pytest.raises(ValueError, match="KernelVariant 't' exports no launch geometry"):
        none.geometry(70)
    with pytest.raises(ValueError, match=r"a LaunchGeometry is 16 bytes \(4 ints\); the variable holds 8"):
        LaunchGeometry.from_bytes(bytes(8))
