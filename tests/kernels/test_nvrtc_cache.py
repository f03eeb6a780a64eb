"""Run-time compilation (NVRTC), the on-disk cubin cache and the sm_70 resource report. CPU only."""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import multiprocessing
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from volta_train.kernels import cache, nvrtc, tiles, variants
from volta_train.kernels.cache import CacheDirError, get_or_compile
from volta_train.kernels.nvrtc import CompileError, NvrtcNotFoundError, compile_program, parse_ptxas_log
from volta_train.kernels.variants import KernelVariant

from checkout import ROOT
from probes import PROBE_VARIANT

PROBE = PROBE_VARIANT.name_expressions[0]
ELF_MAGIC = b"\x7fELF"


def _nvrtc_for(arch: int) -> nvrtc.NvrtcLibrary:
    try:
        return nvrtc.find_nvrtc(arch)
    except NvrtcNotFoundError as error:
        pytest.skip(f"no libnvrtc for sm_{arch} here (pip install nvidia-cuda-nvrtc-cu12==12.9.86): {error}")


@pytest.fixture
def nvrtc70() -> nvrtc.NvrtcLibrary:
    return _nvrtc_for(70)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    """An empty cache directory of this test, and an empty in-process memo."""
    directory = tmp_path / "kernel-cache"
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(directory))
    monkeypatch.delenv(cache.LOCK_TIMEOUT_ENV, raising=False)
    cache.clear_memo()
    yield directory
    cache.clear_memo()


def _probe_source() -> str:
    return PROBE_VARIANT.source_text()


def _entries(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"*{cache.ENTRY_SUFFIX}"))


def _compile_probe_cached() -> nvrtc.CompiledProgram:
    return get_or_compile(_probe_source(), [PROBE], 70, (), [variants.csrc_dir()])


# --- finding NVRTC --------------------------------------------------------------------------------------------


def test_find_nvrtc_reports_path_version_and_archs(nvrtc70):
    assert os.path.exists(nvrtc70.path) or "/" not in nvrtc70.path
    assert nvrtc70.version >= (11, 2)
    assert 70 in nvrtc70.supported_archs
    assert nvrtc.find_nvrtc("sm_70").path == nvrtc70.path


def test_explicit_nvrtc_path_is_used(nvrtc70, monkeypatch):
    monkeypatch.setenv(nvrtc.NVRTC_ENV, nvrtc70.path)
    assert nvrtc.nvrtc_candidate_paths()[0] == nvrtc70.path
    assert nvrtc.find_nvrtc(70).path == nvrtc70.path


def test_explicit_nvrtc_path_that_does_not_exist_is_an_error(monkeypatch, tmp_path):
    missing = str(tmp_path / "libnvrtc.so.99")
    monkeypatch.setenv(nvrtc.NVRTC_ENV, missing)
    with pytest.raises(NvrtcNotFoundError, match="libnvrtc.so.99"):
        nvrtc.find_nvrtc(70)


class _FakeLibrary:
    def __init__(self, version, archs):
        self.path = f"/fake/libnvrtc.so.{version[0]}"
        self.version = version
        self.version_string = f"{version[0]}.{version[1]}"
        self.supported_archs = tuple(archs)

    def supports(self, arch):
        return arch in self.supported_archs


def test_only_nvrtc13_on_a_v100_names_the_cu12_package():
    nvrtc13 = _FakeLibrary((13, 0), [75, 80, 86, 89, 90, 100, 120])
    with pytest.raises(NvrtcNotFoundError) as caught:
        nvrtc.select_nvrtc([nvrtc13], 70)
    message = str(caught.value)
    assert "sm_70" in message and "NVRTC 13" in message and "pip install nvidia-cuda-nvrtc-cu12" in message
    assert nvrtc.select_nvrtc([nvrtc13], 90) is nvrtc13


def test_first_library_that_supports_the_arch_is_chosen():
    nvrtc13 = _FakeLibrary((13, 0), [75, 90])
    nvrtc12 = _FakeLibrary((12, 9), [70, 75, 90])
    assert nvrtc.select_nvrtc([nvrtc13, nvrtc12], 70) is nvrtc12
    assert nvrtc.select_nvrtc([nvrtc13, nvrtc12], 90) is nvrtc13
    assert nvrtc.select_nvrtc([nvrtc13, nvrtc12], None) is nvrtc13


def test_no_nvrtc_at_all_names_the_package_to_install():
    with pytest.raises(NvrtcNotFoundError, match="pip install nvidia-cuda-nvrtc-cu12"):
        nvrtc.select_nvrtc([], 70)


@pytest.mark.parametrize("given, expected", [(70, 70), ("sm_70", 70), ("70", 70), ("compute_90", 90)])
def test_normalize_arch(given, expected):
    assert nvrtc.normalize_arch(given) == expected


@pytest.mark.parametrize("bad", ["sm70a", "volta", 7, True])
def test_normalize_arch_rejects(bad):
    with pytest.raises(ValueError, match="architecture"):
        nvrtc.normalize_arch(bad)


# --- compiling ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", [70, 90])
def test_probe_compiles_to_a_cubin_with_a_clean_resource_report(arch):
    library = _nvrtc_for(arch)
    program = compile_program(_probe_source(), [PROBE], arch, include_dirs=[variants.csrc_dir()])
    assert program.cubin.startswith(ELF_MAGIC)
    assert program.arch == arch and program.nvrtc_version == library.version
    mangled = program.lowered_name(PROBE)
    assert mangled.startswith("_Z") and "volta_probe_mma_kernel" in mangled
    assert f"for 'sm_{arch}'" in program.log
    report = parse_ptxas_log(program.log)[mangled]
    assert report["entry"] is True
    assert report["registers"] > 0
    assert report["spill_store_bytes"] == report["spill_load_bytes"] == report["stack_bytes"] == 0


def test_compile_error_carries_the_program_log(nvrtc70):
    with pytest.raises(CompileError) as caught:
        compile_program("__global__ void broken() { undeclared_name = 1; }", [], 70, program_name="broken.cu")
    assert "undeclared_name" in caught.value.log
    assert "broken.cu" in str(caught.value)


def test_unknown_name_expression_is_a_compile_error(nvrtc70):
    with pytest.raises((CompileError, RuntimeError), match="no_such_kernel"):
        compile_program("__global__ void k() {}", ["no_such_kernel<1>"], 70)


def test_include_dirs_become_include_paths(nvrtc70, tmp_path):
    (tmp_path / "scale.cuh").write_text("#pragma once\nconstexpr float kScale = 2.0f;\n")
    source = '#include "scale.cuh"\n__global__ void scale(float* x) { x[threadIdx.x] *= kScale; }\n'
    program = compile_program(source, ["scale"], 70, include_dirs=[tmp_path])
    assert program.lowered_names == {"scale": "_Z5scalePf"}


SAMPLE_LOG = """\
nvrtc: warning: Architectures prior to '<compute/sm>_75' are deprecated and may be removed in a future release
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z3bigPfi' for 'sm_70'
ptxas info    : Function properties for _Z3bigPfi
ptxas         .     368 bytes stack frame, 268 bytes spill stores, 264 bytes spill loads
ptxas info    : Used 24 registers, used 0 barriers, 368 bytes cumulative stack size, 364 bytes cmem[0]
ptxas info    : Compile time = 15.895 ms
ptxas info    : Compiling entry function '_Z1kILi64EEv1P' for 'sm_70'
ptxas info    : Function properties for _Z1kILi64EEv1P
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 8 registers, used 1 barriers, 256 bytes smem, 368 bytes cmem[0]
ptxas info    : Function properties for _Z6helperPfi
ptxas         .     16 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
"""


def test_parse_ptxas_log_reads_every_field():
    parsed = parse_ptxas_log(SAMPLE_LOG)
    assert parsed["_Z3bigPfi"] == {
        "registers": 24, "spill_store_bytes": 268, "spill_load_bytes": 264, "stack_bytes": 368,
        "static_smem_bytes": 0, "entry": True,
    }
    assert parsed["_Z1kILi64EEv1P"]["registers"] == 8
    assert parsed["_Z1kILi64EEv1P"]["static_smem_bytes"] == 256
    assert parsed["_Z6helperPfi"]["entry"] is False
    assert parsed["_Z6helperPfi"]["spill_store_bytes"] == 4


def test_parse_ptxas_log_of_a_real_spilling_kernel(nvrtc70):
    source = """
    __global__ void big(float* d, int i) {
        float a[64];
    #pragma unroll
        for (int j = 0; j < 64; j++) a[j] = d[j * i];
        float s = 0;
    #pragma unroll
        for (int j = 0; j < 64; j++) s += a[j] * a[63 - j] * d[j + i];
        d[0] = s;
    }"""
    program = compile_program(source, ["big"], 70, options=["--maxrregcount=24"])
    report = parse_ptxas_log(program.log)[program.lowered_name("big")]
    assert report["registers"] <= 24
    assert report["spill_store_bytes"] > 0 and report["spill_load_bytes"] > 0


# --- the cache ------------------------------------------------------------------------------------------------


def test_cache_dir_is_created_user_only(cache_dir):
    assert cache.ensure_cache_dir() == cache_dir
    assert cache_dir.stat().st_mode & 0o777 == 0o700


def test_cache_dir_location_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv(cache.CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache.cache_dir_path() == tmp_path / "volta_train" / "kernels"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache.cache_dir_path() == Path.home() / ".cache" / "volta_train" / "kernels"


def test_readable_cache_dir_is_tightened(cache_dir, caplog):
    cache_dir.mkdir(mode=0o755)
    os.chmod(cache_dir, 0o755)
    with caplog.at_level(logging.WARNING, logger="volta_train"):
        cache.ensure_cache_dir()
    assert cache_dir.stat().st_mode & 0o777 == 0o700
    assert "tightened to 700" in caplog.text


@pytest.mark.parametrize("mode", [0o770, 0o757, 0o777])
def test_group_or_other_writable_cache_dir_is_refused(cache_dir, mode):
    cache_dir.mkdir()
    os.chmod(cache_dir, mode)
    with pytest.raises(CacheDirError, match="writable by group/others"):
        cache.ensure_cache_dir()
    assert cache_dir.stat().st_mode & 0o777 == mode  # left as it was


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another user needs root")
def test_cache_dir_of_another_user_is_refused(cache_dir):
    cache_dir.mkdir(mode=0o700)
    os.chown(cache_dir, 12345, 12345)
    with pytest.raises(CacheDirError, match="belongs to uid 12345"):
        cache.ensure_cache_dir()


def test_second_call_is_a_memo_hit_and_a_new_process_is_a_disk_hit(nvrtc70, cache_dir):
    before = cache.CacheStats(**vars(cache.stats))
    first = _compile_probe_cached()
    (entry,) = _entries(cache_dir)
    written = entry.stat().st_mtime_ns
    assert _compile_probe_cached() is first
    cache.clear_memo()  # as a fresh process would start
    third = _compile_probe_cached()
    assert third.cubin == first.cubin and third.lowered_names == first.lowered_names and third.log == first.log
    assert cache.stats.compiles - before.compiles == 1
    assert cache.stats.memo_hits - before.memo_hits == 1
    assert cache.stats.disk_hits - before.disk_hits == 1
    assert entry.stat().st_mtime_ns == written
    assert entry.stat().st_mode & 0o777 == 0o600


def test_key_changes_with_source_options_arch_names_and_headers(tmp_path):
    (tmp_path / "a.cuh").write_text("constexpr int kA = 1;\n")
    source = '#include "a.cuh"\n__global__ void k(int* x) { *x = kA; }\n'
    base = dict(source=source, name_expressions=["k"], arch=70, options=[], include_dirs=[tmp_path],
                nvrtc_version=(12, 9))
    keys = {cache.cache_key(**base)}
    for change in (dict(source=source + "\n"), dict(options=["-DX=1"]), dict(arch=75), dict(name_expressions=["&k"]),
                   dict(nvrtc_version=(12, 8))):
        keys.add(cache.cache_key(**{**base, **change}))
    (tmp_path / "a.cuh").write_text("constexpr int kA = 2;\n")
    keys.add(cache.cache_key(**base))
    assert len(keys) == 7


def _truncate_half(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _flip_last_byte(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0x01])


def _truncate_to_magic(data: bytes) -> bytes:
    return data[:12]


def _flip_cubin_byte(data: bytes) -> bytes:
    at = data.index(ELF_MAGIC) + 100
    return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :]


def _flip_header_byte(data: bytes) -> bytes:
    at = data.index(b'"arch"') + 2
    return data[:at] + bytes([data[at] ^ 0x20]) + data[at + 1 :]


def _bad_magic(data: bytes) -> bytes:
    return b"NOTCUBIN" + data[8:]


def _empty(data: bytes) -> bytes:
    return b""


def _append_garbage(data: bytes) -> bytes:
    return data + b"\0"


@pytest.mark.parametrize(
    "corrupt, reason",
    [
        (_truncate_half, "entry checksum mismatch"),
        (_truncate_to_magic, "truncated"),
        (_flip_last_byte, "entry checksum mismatch"),
        (_flip_cubin_byte, "entry checksum mismatch"),
        (_flip_header_byte, "entry checksum mismatch"),
        (_bad_magic, "bad magic"),
        (_empty, "bad magic"),
        (_append_garbage, "entry checksum mismatch"),
    ],
)
def test_corrupt_entry_is_rejected_and_recompiled(nvrtc70, cache_dir, caplog, corrupt, reason):
    good = _compile_probe_cached()
    (entry,) = _entries(cache_dir)
    entry.write_bytes(corrupt(entry.read_bytes()))
    cache.clear_memo()
    before = cache.CacheStats(**vars(cache.stats))
    with caplog.at_level(logging.WARNING, logger="volta_train"):
        again = _compile_probe_cached()
    assert again.cubin == good.cubin
    assert cache.stats.rejected_entries - before.rejected_entries == 1
    assert cache.stats.compiles - before.compiles == 1
    (message,) = [record.getMessage() for record in caplog.records if "rejected" in record.getMessage()]
    assert "\n" not in message and entry.name in message
    assert re.search(reason, message), message
    key = entry.name.removesuffix(cache.ENTRY_SUFFIX)
    assert cache.decode_entry(entry.read_bytes(), key).cubin == good.cubin  # rewritten whole


def test_entry_of_another_key_is_rejected(nvrtc70, cache_dir):
    _compile_probe_cached()
    (entry,) = _entries(cache_dir)
    with pytest.raises(ValueError, match="key mismatch"):
        cache.decode_entry(entry.read_bytes(), "0" * 64)


def _reseal(body: bytes) -> bytes:
    """An entry with a valid overall checksum around body: only the inner checks can catch what is wrong."""
    return body + hashlib.sha256(body).digest()


def test_inner_checks_catch_a_consistent_but_wrong_entry(nvrtc70, cache_dir):
    program = _compile_probe_cached()
    (entry,) = _entries(cache_dir)
    key = entry.name.removesuffix(cache.ENTRY_SUFFIX)
    body = entry.read_bytes()[:-32]
    wrong_cubin = body[:-1] + bytes([body[-1] ^ 0x01])
    with pytest.raises(ValueError, match="cubin size or sha256"):
        cache.decode_entry(_reseal(wrong_cubin), key)
    wrong_field = body.replace(b'"arch"', b'"Arch"', 1)
    with pytest.raises(ValueError, match="header field 'arch'"):
        cache.decode_entry(_reseal(wrong_field), key)
    assert cache.decode_entry(_reseal(body), key).cubin == program.cubin


def test_a_changed_header_recompiles(nvrtc70, cache_dir, tmp_path):
    headers = tmp_path / "headers"
    headers.mkdir()
    (headers / "value.cuh").write_text("constexpr int kValue = 1;\n")
    source = '#include "value.cuh"\n__global__ void k(int* x) { *x = kValue; }\n'
    before = cache.stats.compiles
    get_or_compile(source, ["k"], 70, (), [headers])
    cache.clear_memo()
    get_or_compile(source, ["k"], 70, (), [headers])
    assert cache.stats.compiles - before == 1
    (headers / "value.cuh").write_text("constexpr int kValue = 2;\n")
    cache.clear_memo()
    get_or_compile(source, ["k"], 70, (), [headers])
    assert cache.stats.compiles - before == 2
    assert len(_entries(cache_dir)) == 2


def test_a_held_lock_times_out_and_compiles_anyway(nvrtc70, cache_dir, monkeypatch, caplog):
    key = cache.cache_key(_probe_source(), [PROBE], 70, (), [variants.csrc_dir()], nvrtc70.version)
    cache_dir.mkdir(mode=0o700)
    monkeypatch.setenv(cache.LOCK_TIMEOUT_ENV, "0.3")
    with open(cache_dir / f"{key}{cache.LOCK_SUFFIX}", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with caplog.at_level(logging.WARNING, logger="volta_train"):
            program = _compile_probe_cached()
    assert program.cubin.startswith(ELF_MAGIC)
    assert "compiling without the lock" in caplog.text
    assert [path.name for path in _entries(cache_dir)] == [f"{key}{cache.ENTRY_SUFFIX}"]


def test_an_unwritable_cache_still_serves_entries_and_compiles_uncached(nvrtc70, cache_dir, monkeypatch, caplog):
    cached = _compile_probe_cached()
    cache.clear_memo()
    real_open = os.open

    def refuse_lock_files(path, *args, **kwargs):
        if str(path).endswith(cache.LOCK_SUFFIX):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    def refuse_temporary_files(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(cache.os, "open", refuse_lock_files)
    monkeypatch.setattr(cache.tempfile, "mkstemp", refuse_temporary_files)
    assert _compile_probe_cached().cubin == cached.cubin  # served from the entry
    before = cache.stats.compiles
    with caplog.at_level(logging.WARNING, logger="volta_train"):
        other = get_or_compile("__global__ void k(int* x) { *x = 1; }", ["k"], 70)
    assert other.cubin.startswith(ELF_MAGIC) and cache.stats.compiles == before + 1
    assert "compiling without the lock" in caplog.text and "using it uncached" in caplog.text
    assert len(_entries(cache_dir)) == 1


def _compile_in_child(cache_dir: str, barrier, results) -> None:
    """One of several processes compiling the probe at once (run under multiprocessing spawn)."""
    os.environ[cache.CACHE_DIR_ENV] = cache_dir
    try:
        barrier.wait(timeout=60)
        program = _compile_probe_cached()
        results.put(("ok", program.cubin_sha256, cache.stats.compiles))
    except Exception as error:  # reported to the parent, which fails the test
        results.put(("error", repr(error), 0))


def test_concurrent_processes_compile_once_and_leave_one_valid_entry(nvrtc70, cache_dir):
    processes = 4
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(processes), context.Queue()
    children = [
        context.Process(target=_compile_in_child, args=(str(cache_dir), barrier, results)) for _ in range(processes)
    ]
    for child in children:
        child.start()
    outcomes = [results.get(timeout=120) for _ in children]
    for child in children:
        child.join(timeout=30)
        assert child.exitcode == 0
    assert all(status == "ok" for status, _, _ in outcomes), outcomes
    assert len({digest for _, digest, _ in outcomes}) == 1
    assert sum(compiles for _, _, compiles in outcomes) == 1  # the others waited on the lock, then loaded
    (entry,) = _entries(cache_dir)
    assert not list(cache_dir.glob("*.tmp"))
    key = entry.name.removesuffix(cache.ENTRY_SUFFIX)
    assert cache.decode_entry(entry.read_bytes(), key).cubin_sha256 == outcomes[0][1]


# --- variants, precompile and the report ----------------------------------------------------------------------


def test_kernel_variant_validates_its_fields():
    with pytest.raises(TypeError, match="sequence of strings"):
        KernelVariant(name="x", sources="probe_mma.cu", name_expressions=("k",))
    with pytest.raises(ValueError, match=r"name_expressions \['&g<1>'\] name variables; accepted: kernels only"):
        KernelVariant(name="x", sources=("a.cu",), name_expressions=("k<1>", "&g<1>"))
    assert KernelVariant(name="x", sources=["a.cu"], name_expressions=["k"]).sources == ("a.cu",)


def test_variant_compile_is_memoized_without_rereading_sources(nvrtc70, cache_dir, monkeypatch):
    first = PROBE_VARIANT.compile("sm_70")

    def no_sources():
        raise AssertionError("sources reread on a memo hit")

    monkeypatch.setattr(variants, "csrc_dir", no_sources)
    assert PROBE_VARIANT.compile(70) is first
    cache.clear_memo()
    with pytest.raises(AssertionError, match="reread"):
        PROBE_VARIANT.compile(70)


@pytest.mark.compiles_kernels
def test_precompile_all_fills_the_cache(nvrtc70, capsys):
    """Into the run's kernel cache (conftest.py), which other tests fill too: every shipped variant has its entry."""
    from volta_train.kernels.precompile import precompile_all

    programs = precompile_all("sm_70", jobs=2)  # (two processes: ~190 variants on a 2-core CI machine)
    assert len(programs) == len(tiles.shipped_variants(70))
    assert len(_entries(cache.cache_dir_path())) >= len(programs)
    assert "combine_d64" in capsys.readouterr().out


@pytest.mark.parametrize("head_dims, named", [([65], "[65]"), ([64, 300], "[300]"), ([], "none given")])
def test_precompile_head_dims_refuses_what_no_kernel_has(head_dims, named):
    from volta_train.kernels.precompile import precompile_all

    with pytest.raises(ValueError, match=r"no shipped kernels for " + re.escape(named) + r"; accepted: 16, 32, .*128"):
        precompile_all("sm_70", head_dims=head_dims)


def test_precompile_module_form_names_the_command():
    """The command's options live in one parser (volta-train precompile): the module form says so and fails."""
    import sys

    run = subprocess.run([sys.executable, "-m", "volta_train.kernels.precompile", "--arch", "sm_70"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and run.stdout == ""
    assert "run `volta-train precompile` instead (options --arch, --jobs, --head-dims" in run.stderr


def _load_kernel_report():
    spec = importlib.util.spec_from_file_location("kernel_report", ROOT / "lab" / "kernel_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "registers, threads, smem, ctas, limited_by",
    [
        (168, 128, 0, 3, "registers"),  # the CUTLASS Sm70 forward: 3 blocks, 12 warps
        (255, 128, 0, 2, "registers"),
        (32, 1024, 0, 2, "registers"),  # 2 by registers and 2 by threads: the first wins
        (16, 1024, 0, 2, "threads"),
        (64, 128, 48 * 1024 + 1, 1, "smem"),
        (32, 32, 0, 32, "ctas"),
        (64, 128, 96 * 1024 + 1, 0, "smem"),
        (256, 32, 0, 0, "registers"),
    ],
)
def test_v100_occupancy(registers, threads, smem, ctas, limited_by):
    occupancy = _load_kernel_report().v100_occupancy(registers, threads, smem)
    assert occupancy["ctas_per_sm"] == ctas
    assert occupancy["warps_per_sm"] == ctas * ((threads + 31) // 32)
    assert occupancy["limited_by"] == limited_by


@pytest.mark.compiles_kernels
def test_kernel_report_prints_json_lines_and_exits_0(nvrtc70, tmp_path):
    environment = dict(os.environ)  # the run's kernel cache (conftest.py): kernels other tests compiled are reused
    json_out, cubins = tmp_path / "report.jsonl", tmp_path / "cubins"
    finished = subprocess.run(
        [sys.executable, str(ROOT / "lab" / "kernel_report.py"), "--arch", "sm_70",
         "--json-out", str(json_out), "--cubin-dir", str(cubins), "--jobs", "2"],
        capture_output=True, text=True, env=environment, timeout=900,  # ~190 kernels on 2 busy cores
    )
    assert finished.returncode == 0, finished.stderr
    rows = [json.loads(line) for line in finished.stdout.splitlines()]
    kernels, summary = rows[:-1], rows[-1]
    assert summary["summary"] is True and summary["ok"] is True and summary["kernels"] == len(kernels) >= 1
    for row in kernels:
        assert row["registers"] > 0 and row["spill_bytes"] == 0 and row["stack_bytes"] == 0
        assert row["threads"] > 0 and row["ctas_per_sm"] >= 1 and row["warps_per_sm"] >= 1
        assert row["smem_bytes"] == row["static_smem_bytes"] + row["dynamic_smem_bytes"]
    assert [json.loads(line) for line in json_out.read_text().splitlines()] == rows
    assert (cubins / "combine_d64.cubin").read_bytes().startswith(ELF_MAGIC)
    meta = [json.loads(line) for line in (cubins / "meta.jsonl").read_text().splitlines()]
    assert meta[0]["smem_bytes"] == kernels[0]["smem_bytes"] and meta[0]["threads"] == kernels[0]["threads"]


@pytest.fixture
def scratch_csrc(tmp_path, monkeypatch) -> Path:
    """csrc_dir() pointing at an empty scratch directory."""
    directory = tmp_path / "csrc"
    directory.mkdir()
    monkeypatch.setattr(variants, "csrc_dir", lambda: directory)
    return directory


def test_kernel_report_fails_on_spills(nvrtc70, cache_dir, scratch_csrc, capsys):
    (scratch_csrc / "spill.cu").write_text(
        "__global__ void big(float* d, int i) {\n float a[64];\n#pragma unroll\n"
        " for (int j = 0; j < 64; j++) a[j] = d[j * i];\n float s = 0;\n#pragma unroll\n"
        " for (int j = 0; j < 64; j++) s += a[j] * a[63 - j] * d[j + i];\n d[0] = s;\n}\n"
    )
    spilling = KernelVariant("spill", ("spill.cu",), ("big",), options=("--maxrregcount=24",), exports_geometry=False)
    assert _load_kernel_report().main(["--arch", "sm_70"], variants=[spilling]) == 1
    captured = capsys.readouterr()
    assert "big spills" in captured.err
    assert json.loads(captured.out.splitlines()[-1])["ok"] is False


def test_kernel_report_fails_above_96_kb_of_shared_memory(nvrtc70, cache_dir, scratch_csrc, capsys):
    (scratch_csrc / "small.cu").write_text(  # the shared memory the report sees is the one the kernel exports
        "struct LaunchGeometry { int dynamic_smem_bytes, threads, block_m, block_n; };\n"
        "__global__ void small(float* d) { d[threadIdx.x] = 1.0f; }\n"
        "__device__ LaunchGeometry small_geometry = {98304 + 256, 128, 0, 0};\n")
    greedy = KernelVariant("greedy", ("small.cu",), ("small",))
    assert _load_kernel_report().main(["--arch", "sm_70"], variants=[greedy]) == 1
    assert "98560 B shared memory > 98304 B" in capsys.readouterr().err
