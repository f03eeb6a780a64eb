"""What `pip install volta_train` gives: the sdist and the wheel carry the CUDA sources, the configs, the sample
data and the recipes; the installed wheel, run from outside the checkout, compiles every shipped sm_70 kernel from
its own copy of the sources and trains through the `volta-train` console script.

The wheel is built from the sdist (so a missing file in the sdist fails here) with setuptools' PEP 517 hooks in
this environment (no build isolation, no network), and installed with --no-deps into a fresh virtual environment
that reuses this environment's packages (CPU torch, transformers, NVRTC 12) through a .pth file naming this
environment's site-packages: ``--system-site-packages`` would give it the base interpreter's packages instead,
which lack them when this environment is itself a virtual environment. Kernels compile into the test run's kernel
cache (tests/conftest.py), so those another test compiled are not compiled again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from volta_train.kernels import cache, nvrtc
from volta_train.kernels.tiles import shipped_variants
from venvs import make_venv, outer_site_packages
from checkout import ROOT

CSRC = sorted(p.name for p in (ROOT / "csrc").iterdir() if p.suffix in (".cu", ".cuh"))
CONFIGS = sorted(str(p.relative_to(ROOT / "configs")) for p in (ROOT / "configs").rglob("*")
                 if p.suffix in (".yaml", ".json"))
SAMPLES = sorted(p.name for p in (ROOT / "data" / "samples").glob("*.jsonl"))
CENSUS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "volta_train/integrations/hf/census").glob("*.json"))
RECIPES = ["volta_train/recipes/__init__.py", "volta_train/recipes/gpt_long.py", "volta_train/recipes/finetune.py"]


def _build(hook: str, source: Path, out: Path) -> Path:
    """setuptools' PEP 517 hook run in `source` (as `pip wheel --no-build-isolation` would); the file it made."""
    code = f"from setuptools import build_meta as b; print(b.{hook}({str(out)!r}))"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", code], cwd=source, capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "project.license" not in done.stderr and "SetuptoolsDeprecationWarning" not in done.stderr, done.stderr
    return out / done.stdout.strip().splitlines()[-1]


def _user_env(venv: Path, home: Path) -> dict:
    """An environment like a user's shell with the venv active: no PYTHONPATH pointing into the checkout."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "ACCELERATE_USE_DEEPSPEED")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv),
               VOLTA_TRAIN_CACHE_DIR=_kernel_cache(home), HF_HUB_OFFLINE="1", MPLCONFIGDIR=str(home / "mpl"))
    return env


def _kernel_cache(home: Path) -> str:
    """The test run's kernel cache (tests/conftest.py), else one of this test's own."""
    return os.environ.get(cache.CACHE_DIR_ENV) or str(home / "kernel-cache")


def _run(cmd: list[str], cwd: Path, env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(map(str, cmd))}\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}"
    return done


@pytest.mark.slow
@pytest.mark.compiles_kernels
def test_sdist_and_wheel_install_and_run_outside_the_checkout(tmp_path):
    # --- build: sdist from the checkout, wheel from the unpacked sdist
    sdist = _build("build_sdist", ROOT, tmp_path / "dist")
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
        tar.extractall(tmp_path / "sdist", filter="data")
    top = f"volta_train-{sdist.name.removesuffix('.tar.gz').split('-')[-1]}"
    for relative in ([f"csrc/{n}" for n in CSRC] + [f"configs/{n}" for n in CONFIGS]
                     + [f"data/samples/{n}" for n in SAMPLES] + RECIPES
                     + CENSUS + ["recipes/gpt_long.py", "recipes/finetune.py", "LICENSE", "volta_train/py.typed"]
                     + [f"scripts/{p.name}" for p in sorted((ROOT / "scripts").iterdir()) if p.is_file()]):
        assert f"{top}/{relative}" in names, relative
    wheel = _build("build_wheel", tmp_path / "sdist" / top, tmp_path / "dist")
    with zipfile.ZipFile(wheel) as zf:
        files = set(zf.namelist())
        metadata = zf.read(f"{top}.dist-info/METADATA").decode()
        entry_points = zf.read(f"{top}.dist-info/entry_points.txt").decode()
    expected = ([f"volta_train/_csrc/{n}" for n in CSRC] + [f"volta_train/_configs/{n}" for n in CONFIGS]
                + [f"volta_train/_data/samples/{n}" for n in SAMPLES] + RECIPES + CENSUS
                + ["volta_train/py.typed", "volta_train/cli.py", "volta_train/bench.py", f"{top}.dist-info/licenses/LICENSE"])
    missing = [name for name in expected if name not in files]
    assert not missing, missing
    assert "License-Expression: Apache-2.0" in metadata
    assert "volta-train = volta_train.cli:main" in entry_points

    # --- install into a fresh venv that reuses this environment's packages; run from outside the checkout
    venv = tmp_path / "venv"
    python = make_venv(venv)
    home = tmp_path / "user"
    home.mkdir()
    env = _user_env(venv, home)
    _run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)], home, env)
    where = _run([str(python), "-c", "import volta_train, volta_train.resources as r; "
                  "print(volta_train.__file__); print(r.csrc_dir()); print(r.configs_dir())"], home, env)
    package_file, csrc, configs = where.stdout.split()
    installed = Path(package_file).parent
    assert installed.is_relative_to(venv), f"imported {package_file}, not the venv's copy"
    assert Path(csrc) == installed / "_csrc" and Path(configs) == installed / "_configs"

    script = str(venv / "bin" / "volta-train")
    for command in ([], ["env"], ["train"], ["finetune"], ["bench"], ["precompile"], ["plot"], ["configs"]):
        shown = _run([script, *command, "--help"], home, env, timeout=120)
        assert "usage:" in shown.stdout, command

    report = _run([script, "env"], home, env, timeout=120).stdout  # exit 0: sources here, no GPU -> reference
    assert f"kernel sources: {csrc} ({len(CSRC)} files)" in report
    assert "volta_train.patch takes any model" in report and "text model types" in report and "transformers " in report

    shorthand = _run([str(python), "-c", "from volta_train.training.distributed import resolve_deepspeed_spec as r;"
                      "print(r('zero2'))"], home, env)
    assert Path(shorthand.stdout.strip()) == installed / "_configs" / "deepspeed" / "zero2.json"

    # the installed sources compile (NVRTC, no GPU): the head_dim 64 kernels through the console script, into the run's
    # cache (test_precompile_all_fills_the_cache compiles every shipped variant from the checkout's identical sources)
    if not _has_nvrtc70():
        pytest.skip("no NVRTC that targets sm_70 (pip install nvidia-cuda-nvrtc-cu12)")
    for name in CSRC:
        assert (Path(csrc) / name).read_bytes() == (ROOT / "csrc" / name).read_bytes(), name
    d64 = [v for v in shipped_variants(70) if v.meta["head_dim"] == 64]
    compiled = _run([script, "precompile", "--arch", "sm_70", "--jobs", "2", "--head-dims", "64"], home, env,
                    timeout=900).stdout
    assert f"{len(d64)} variants ready" in compiled and f"from {csrc} " in compiled, compiled[-2000:]
    assert all(f"  {v.name}: " in compiled for v in d64), compiled[-2000:]

    # a few steps of the main job through the console script
    out = home / "run"
    trained = _run([script, "train", "--cpu", "--steps", "3", "--model", "nano", "--seq-len", "64",
                    "--batch-size", "2", "--synthetic-mb", "0.05", "--eval-batches", "1", "--log-interval", "1",
                    "--no-progress", "--out-dir", str(out), "--cache-dir", str(home / "tokens")], home, env)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["completed"]
    assert (out / "loss.png").is_file() and (out / "final" / "model.safetensors").is_file()
    assert "summary.json, loss.png" in trained.stderr.strip().splitlines()[-1]
    assert "Setting accelerator to CPU" not in trained.stdout + trained.stderr
    assert "TensorBoard" not in trained.stderr  # opt-in: nothing said when not asked for

    # a shipped fine-tuning config by name: its model config and sample data come from the installed package
    tuned = _run([script, "finetune", "--config", "gpt2_instruct", "--train.steps", "2", "--logging.out-dir",
                  str(home / "ft"), "--logging.no-progress", "--eval.interval", "0"], home, env)
    assert "using the shipped" in tuned.stderr
    assert json.loads((home / "ft" / "summary.json").read_text())["steps"] == 2


def _has_nvrtc70() -> bool:
    try:
        nvrtc.find_nvrtc(70)
    except nvrtc.NvrtcNotFoundError:
        return False
    return True


def test_the_venv_sees_this_environments_packages_not_the_base_interpreters(tmp_path):
    """From inside a virtual environment (an outer venv holding a package the base interpreter lacks), the venv that
    make_venv creates imports that package; --system-site-packages would not (issue 27: torch was missing there)."""
    outer = tmp_path / "outer"
    subprocess.run([sys.executable, "-m", "venv", str(outer)], check=True, timeout=300)
    outer_python = outer / "bin" / "python"
    purelib = subprocess.run([str(outer_python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    Path(purelib, "only_in_outer.py").write_text("WHERE = __file__\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT / "tests" / "support")  # venvs.py only: standard library
    code = ("import sys; from pathlib import Path; from venvs import make_venv; "
            "python = make_venv(Path(sys.argv[1])); print(python)")
    made = subprocess.run([str(outer_python), "-c", code, str(tmp_path / "inner")], capture_output=True, text=True,
                          timeout=300, env=env)
    assert made.returncode == 0, made.stderr[-3000:]
    inner_python = made.stdout.strip()
    env.pop("PYTHONPATH")
    code = "import sys, only_in_outer; print(only_in_outer.WHERE); print(sys.prefix)"
    seen = subprocess.run([inner_python, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert seen.returncode == 0, seen.stderr[-3000:]
    where, prefix = seen.stdout.split()
    assert Path(where).parent == Path(purelib) and Path(prefix) == tmp_path / "inner"
    python = make_venv(tmp_path / "here")  # and from this environment: torch is there
    found = subprocess.run([str(python), "-c", "import torch; print(torch.__file__)"], capture_output=True, text=True,
                           timeout=300, env=env)
    assert found.returncode == 0, found.stderr[-3000:]
    assert any(Path(found.stdout.strip()).is_relative_to(d) for d in outer_site_packages())
