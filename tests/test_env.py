"""`python -m volta_train.env`: one screen about torch, the GPU, NVRTC, the kernel cache and the backend."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from volta_train import env
from volta_train.kernels import cache, nvrtc


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
