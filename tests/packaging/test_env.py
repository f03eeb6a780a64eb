"""`python -m volta_train.env`: one screen about torch, the GPU, NVRTC, the kernel cache and the backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from volta_train import env
from volta_train.kernels import cache, nvrtc
from checkout import ROOT


def test_python_m_volta_train_env_runs(tmp_path):
    environment = {**os.environ, cache.CACHE_DIR_ENV: str(tmp_path / "cache")}
    environment.pop("VOLTA_TRAIN_BACKEND", None)
    finished = subprocess.run(
        [sys.executable, "-m", "volta_train.env"], capture_output=True, text=True, env=environment, timeout=120
    )
    assert finished.returncode == 0, finished.stderr
    out = finished.stdout
    assert f"torch {torch.__version__}" in out
    assert "NVRTC for sm_" in out
    assert f"kernel cache: {tmp_path / 'cache'} (not created yet)" in out
    assert "typical call (fp16, [2, 4096, 16, 64], causal" in out
    if not torch.cuda.is_available():
        assert "no CUDA GPU" in out
        assert "on cpu): reference backend, because input is on cpu" in out
    assert len(out.splitlines()) <= 24  # one screen


def test_report_names_the_nvrtc_in_use_or_how_to_get_one():
    text = env.report()
    try:
        library = nvrtc.find_nvrtc(env.target_arch())
    except nvrtc.NvrtcNotFoundError:
        assert "NOT FOUND" in text and "nvidia-cuda-nvrtc-cu12" in text
    else:
        assert f"{library.version_string} at {library.path}" in text


def test_report_survives_a_missing_explicit_nvrtc(monkeypatch, tmp_path):
    monkeypatch.setenv(nvrtc.NVRTC_ENV, str(tmp_path / "missing.so"))
    text = env.report()
    assert "NOT FOUND" in text and "missing.so" in text
    assert f"{nvrtc.NVRTC_ENV}={tmp_path / 'missing.so'}" in text


def test_report_shows_cache_entries_and_mode(monkeypatch, tmp_path):
    directory = tmp_path / "cache"
    directory.mkdir(mode=0o700)
    (directory / f"{'0' * 64}{cache.ENTRY_SUFFIX}").write_bytes(b"")
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(directory))
    assert f"kernel cache: {directory} (entries: 1, mode 700)" in env.report()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU answer")
def test_forced_kernel_backend_is_reported_not_raised(monkeypatch):
    monkeypatch.setenv("VOLTA_TRAIN_BACKEND", "kernel")
    assert "error: VOLTA_TRAIN_BACKEND=kernel, but the Volta kernel cannot run this call" in env.report()


# --- kernel sources, verdict and exit status (`volta-train env`) -------------------------------------------------


def test_report_names_the_kernel_sources_transformers_and_families():
    import transformers

    from volta_train import resources
    from volta_train.integrations import hf

    text = env.report()
    directory = resources.csrc_dir()
    assert f"kernel sources: {directory} (" in text and any(directory.glob("*.cuh"))
    assert f"transformers {transformers.__version__}: " in text and "volta_train.patch takes any model" in text
    record = hf.census()
    assert f"of transformers {record['transformers']}" in text and f"{len(record['results'])} text model types" in text
    assert f"{len(hf.supported_model_types())} ok" in text and "the list: docs/hf_integration.md" in text
    assert len(hf.supported_model_types()) >= 11


def test_report_places_each_dependency_against_its_tested_range(monkeypatch):
    from volta_train import versions

    lowest, newest = versions.TESTED["deepspeed"]
    for version, said in (("0.1.0", f"older than the lowest supported, {lowest}"),
                          ("99.0.0", f"newer than the newest tested, {newest}"),
                          (newest, f"within the tested range {lowest} to {newest}")):
        monkeypatch.setattr(versions, "installed", lambda package, v=version: v)
        assert f"deepspeed {version}: {said}" in env.report()
    monkeypatch.setattr(versions, "installed", lambda package: None)
    assert f"deepspeed: not installed (tested {lowest} to {newest})" in env.report()


def test_pyproject_lower_bounds_are_the_lowest_tested():
    """pyproject.toml's lower bound of each dependency is versions.TESTED's lowest, the release CI runs."""
    import re

    from volta_train import versions

    text = (ROOT / "pyproject.toml").read_text()
    for package, (lowest, newest) in versions.TESTED.items():
        assert re.search(rf'"{package}>={re.escape(lowest)}"', text), (package, lowest)


def test_missing_sources_exit_1_saying_why(monkeypatch, tmp_path, capsys):
    from volta_train import resources

    monkeypatch.setenv(resources.CSRC_ENV, str(tmp_path / "empty"))
    assert env.main([]) == 1
    out = capsys.readouterr().out
    assert f"kernel sources: MISSING: no CUDA source directory: looked for *.cuh in {tmp_path / 'empty'}" in out
    assert out.strip().splitlines()[-1].startswith("NOT READY: the CUDA sources are missing")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU answer")
def test_cpu_with_sources_exits_0_naming_the_reference_backend(capsys):
    assert env.main([]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("ready: no GPU -> reference backend")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU answer")
def test_cpu_without_any_nvrtc_exits_3_cpu_only(monkeypatch, capsys):
    """No GPU and no NVRTC: training runs (reference backend) but nothing can be built: status 3, not 0 or 1."""
    monkeypatch.setattr(env, "nvrtc_problem", lambda arch: "no usable libnvrtc found")
    assert env.main([]) == env.CPU_ONLY == 3
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith(
        "CPU only: no GPU -> reference backend; no NVRTC for sm_70")


def test_an_nvrtc_newer_than_the_driver_is_not_ready(monkeypatch, capsys):
    from volta_train.kernels import driver, nvrtc

    class Library:
        version, version_string, path, supported_archs = (12, 9), "12.9", "/x/libnvrtc.so.12", (70, 75)

        def supports(self, arch):
            return arch in self.supported_archs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(env, "target_arch", lambda: 70)
    monkeypatch.setattr(nvrtc, "available_nvrtc_libraries", lambda: [Library()])
    monkeypatch.setattr(driver, "driver_version", lambda: (11, 8))
    found = env.problems()
    assert found == ["NVRTC 12.9 (/x/libnvrtc.so.12) makes cubins that this driver (CUDA 11.8) cannot load: update the "
                     "driver, or pip install nvidia-cuda-nvrtc-cu11 and set VOLTA_TRAIN_NVRTC to its libnvrtc "
                     "(docs/kernel_build.md)"]
    assert env.status(found) == env.NOT_READY == 1
    monkeypatch.setattr(driver, "driver_version", lambda: (12, 2))
    assert env.problems() == [] and env.status([]) == env.READY == 0


def test_gpu_without_an_nvrtc_for_it_is_not_ready(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(env, "target_arch", lambda: 70)
    monkeypatch.setattr(env, "nvrtc_problem", lambda arch: f"no NVRTC supports sm_{arch}\nmore")
    found = env.problems()
    assert found == ["no NVRTC targets the GPU present (sm_70): no NVRTC supports sm_70"]
    assert env.verdict_line(found).startswith("NOT READY: no NVRTC targets the GPU present")


def test_sources_are_found_in_a_checkout_and_in_an_installed_layout(monkeypatch, tmp_path):
    from volta_train import resources

    assert resources.csrc_dir() == resources.CHECKOUT_ROOT / "csrc"  # this checkout
    site = tmp_path / "site-packages"  # an installed wheel: no pyproject.toml beside the package
    (site / "volta_train" / "_csrc").mkdir(parents=True)
    (site / "volta_train" / "_csrc" / "a.cuh").write_text("// x\n")
    (site / "csrc").mkdir()  # some other distribution's top-level csrc/ is never taken
    (site / "csrc" / "b.cuh").write_text("// y\n")
    monkeypatch.setattr(resources, "PACKAGE_DIR", site / "volta_train")
    monkeypatch.setattr(resources, "CHECKOUT_ROOT", site)
    assert resources.csrc_dir() == site / "volta_train" / "_csrc"
    (site / "volta_train" / "_csrc" / "a.cuh").unlink()
    with pytest.raises(FileNotFoundError, match="no CUDA source directory.*reinstall volta_train"):
        resources.csrc_dir()


def test_deepspeed_shorthand_and_unknown_names(tmp_path):
    from volta_train import resources
    from volta_train.training import config, distributed

    assert distributed.resolve_deepspeed_spec("zero2") == resources.configs_dir() / "deepspeed" / "zero2.json"
    with pytest.raises(config.ConfigError, match=r"'zero9' is neither a file nor one of zero1, zero2, zero3, "
                                                 r"zero3_offload \("):
        distributed.resolve_deepspeed_spec("zero9")


def test_config_names_resolve_to_shipped_files_and_unknown_names_list_them(tmp_path):
    from volta_train import resources

    argv = resources.resolve_config_option(["--config", "cpu_tiny", "--steps", "2"], "gpt_long")
    assert argv == ["--config", str(resources.configs_dir() / "gpt_long" / "cpu_tiny.yaml"), "--steps", "2"]
    mine = tmp_path / "cpu_tiny"  # an existing file wins over the shipped name
    mine.write_text("steps: 1\n")
    assert resources.resolve_config_option([f"--config={mine}"], "gpt_long") == [f"--config={mine}"]
    with pytest.raises(FileNotFoundError, match="shipped finetune config; shipped: bert_sentiment, gpt2_instruct"):
        resources.resolve_config_option(["--config", "nope"], "finetune")
    assert resources.shipped_path("data/samples/stories.jsonl").is_file()
    assert resources.shipped_path("data/missing.jsonl") is None and resources.shipped_path("/etc/passwd") is None


# --- the console script's other commands on CPU -----------------------------------------------------------------


def test_cli_lists_commands_and_rejects_unknown_ones(capsys):
    from volta_train import cli

    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for command in ("env", "train", "finetune", "bench", "precompile", "plot", "configs"):
        assert command in out
    with pytest.raises(SystemExit) as info:
        cli.main(["trian"])
    assert info.value.code == 2 and "invalid choice: 'trian'" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU answer")
def test_bench_on_cpu_stops_clearly(capsys, tmp_path):
    from volta_train import cli

    assert cli.main(["bench", "--out", str(tmp_path)]) == 2
    assert "volta-train bench: error: needs a CUDA GPU, and torch sees none" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_bench_accuracy_catches_a_wrong_backend_and_writes_table_json_png(tmp_path):
    from volta_train import bench

    for pass_name in ("fwd", "bwd"):
        good = bench.accuracy(bench.eager_fn(True), pass_name, 77, 2, 64, True, device="cpu")
        bad = bench.accuracy(bench.eager_fn(False), pass_name, 77, 2, 64, True, device="cpu")  # mask ignored
        assert good["rel"] < 2e-3 and bad["rel"] > 0.1, (good, bad)
    assert bench.flops("fwd", 2, 3, 5, 5, 8, False) == 4 * 2 * 3 * 5 * 5 * 8
    assert bench.flops("bwd", 2, 3, 5, 5, 8, True) == 2.5 * 2 * 2 * 3 * 5 * 5 * 8
    args = bench.build_parser().parse_args(["--out", str(tmp_path)])
    rows = [dict(pass_name="fwd", backend=b, head_dim=64, seqlen=n, causal=False, batch=1, heads=2, flops=1e9,
                 ms=1.0 / n, tflops=n / 1e3, peak_mib=1.0, note="", max_abs=1e-3, rel=1e-4)
            for b in ("volta-fp32acc", "sdpa-math") for n in (1024, 2048)]
    table = bench.write_results(rows, args)
    assert "| fwd | volta-fp32acc | 64 | 1024 | False |" in table and "torch " + torch.__version__ in table
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["rows"] == rows and saved["environment"]["torch"] == torch.__version__
    assert (tmp_path / "bench.png").stat().st_size > 1000


def test_bench_workload_packs_documents_counts_their_flops_and_catches_a_wrong_split(tmp_path):
    from volta_train import bench

    lengths = bench.document_lengths(32768, 1024, 16384, seed=3)
    assert sum(lengths) == 32768 and lengths == bench.document_lengths(32768, 1024, 16384, seed=3)
    assert all(n <= 16384 for n in lengths) and all(n >= 1024 for n in lengths[:-1]) and len(lengths) > 2
    assert bench.packed_flops("bwd", [3, 5], 4, 8) == 2.5 * (2 * 4 * 9 * 8 + 2 * 4 * 25 * 8)
    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    lengths = [int(n) for n in torch.randint(1, 60, (3,), generator=gen)]
    q = torch.randn(sum(lengths), 6, 16, generator=gen)
    k, v = (torch.randn(sum(lengths), 2, 16, generator=gen) for _ in range(2))
    packed = bench.packed_fn("volta-fp32acc", lengths, "fwd")(q, k, v)  # the reference backend on the CPU
    per_document = bench.packed_fn("sdpa-math", lengths, "fwd")(q, k, v)
    across = bench.packed_fn("sdpa-math", [sum(lengths)], "fwd")(q, k, v)  # documents attending to each other
    assert (packed - per_document).abs().max() < 1e-5 < (packed - across).abs().max()
    work = bench.Workload(heads=4, kv_heads=1, head_dim=32, rows=(64,))
    for pass_name in ("fwd", "bwd"):
        good = bench.packed_accuracy(lambda ls: bench.packed_fn("volta-fp32acc", ls, pass_name), pass_name, work, 77,
                                     device="cpu")
        bad = bench.packed_accuracy(lambda ls: bench.packed_fn("sdpa-math", [1, ls[0] - 1], pass_name), pass_name,
                                    work, 77, device="cpu")
        assert good["rel"] < 2e-3 and bad["rel"] > 0.1, (good, bad)
    args = bench.build_parser().parse_args(["--workload", "llama3-8b", "--out", str(tmp_path)])
    row = dict(pass_name="bwd", backend="volta-fp16acc", head_dim=128, seqlen=32768, causal=True, batch=1, heads=32,
               kv_heads=8, documents=8, flops=1e12, ms=100.0, tflops=10.0, peak_mib=1.0, note="llama3-8b: 8 documents")
    table = bench.write_results([row], args)
    assert "workload llama3-8b: 32 query and 8 key/value heads of 128" in table
    assert "| bwd | volta-fp16acc | 128 | 32768 | True |" in table


def test_plot_command_draws_a_run_and_refuses_an_empty_dir(tmp_path, capsys):
    from volta_train import cli
    from volta_train.training import logs

    writer = logs.MetricsWriter(tmp_path / "run", True)
    for step in (1, 2, 3):
        writer.write("train", step, {"loss": 5.0 - step / 10, "lr": 1e-3, "tokens_per_s": 1000.0 + step})
    writer.write("eval", 3, {"loss": 4.8})  # an eval redraws loss.png
    assert (tmp_path / "run" / "loss.png").stat().st_size > 1000
    (tmp_path / "run" / "loss.png").unlink()
    assert cli.main(["plot", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "loss.png").is_file()
    with pytest.raises(SystemExit) as info:
        cli.main(["plot", str(tmp_path)])
    assert info.value.code == 1 and "has no train.csv or eval.csv rows" in capsys.readouterr().err


def test_tensorboard_requested_without_tensorboard_is_an_error(monkeypatch):
    import builtins

    from volta_train.training import logs

    logs.check_tensorboard(False)  # not requested: nothing to check, nothing said
    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name == "tensorboard":
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    with pytest.raises(ImportError, match="--tensorboard asks for TensorBoard.*pip install tensorboard"):
        logs.check_tensorboard(True)


def test_the_test_run_never_uses_the_users_kernel_cache():
    """conftest.py points the kernel cache at the run's temporary directory (a run once left 212 kernels in
    ~/.cache/volta_train/kernels)."""
    from volta_train.kernels import cache

    directory = cache.cache_dir_path()
    assert directory != Path.home() / ".cache" / "volta_train" / "kernels"
    if os.environ.get("VOLTA_TRAIN_TEST_RUN_CACHE"):
        assert str(directory) == os.environ["VOLTA_TRAIN_TEST_RUN_CACHE"]
        assert Path(directory).name.startswith("volta_train-test-kernels-")
