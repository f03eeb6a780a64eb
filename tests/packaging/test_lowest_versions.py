"""The lowest supported transformers, accelerate and DeepSpeed (volta_train/versions.py, pyproject.toml's lower bounds)
exercised in CI: a virtual environment that sees this one's packages (tests/support/venvs.py) with those three releases
installed over them runs the HF integration's tests (torch.compile's and the census of every model type aside: the
newest releases run those) and the CPU recipe runs (one process, and DeepSpeed ZeRO-2 over gloo) in a child pytest.
Needs the package index (CI has it); the newest releases are what the suite itself runs on."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from volta_train import versions
from venvs import make_venv
from checkout import ROOT

LOWEST_EXTRAS: tuple[str, ...] = ()  # what the lowest releases need beyond their own requirements (nothing today)

CHILD_TESTS = (
    "tests/hf/test_patch_hf.py", "tests/hf/test_patch_hf_families.py", "tests/hf/test_patch_hf_flash_attn.py",
    "tests/hf/test_hf_padded_rows.py",
    "tests/training/test_recipes.py::test_cpu_smoke", "tests/training/test_recipes.py::test_cpu_smoke_accelerate_launch_llama_no_patch",
    "tests/training/test_recipes.py::test_deepspeed_zero2_two_processes_and_resume",
    # on the lowest DeepSpeed: ZeRO-3 over gloo refused at start (versions.ZERO3_ON_GLOO)
    "tests/training/test_recipes.py::test_deepspeed_zero3_cpu_offload_two_processes",
)


@pytest.mark.slow
@pytest.mark.launches_processes  # its recipe runs use accelerate's default rendezvous port
def test_hf_and_recipe_tests_pass_on_the_lowest_supported_releases(tmp_path):
    python = make_venv(tmp_path / "venv")
    wanted = [f"{package}=={lowest}" for package, (lowest, _) in versions.TESTED.items()]
    pip = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *wanted,
                          *LOWEST_EXTRAS], capture_output=True, text=True, timeout=900)
    assert pip.returncode == 0, f"pip install {' '.join(wanted)}: {pip.stderr[-3000:]}"
    shown = subprocess.run([str(python), "-c", "from volta_train import versions; "
                            "print(' '.join(versions.installed(p) for p in versions.TESTED))"],
                           capture_output=True, text=True, timeout=300, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert shown.stdout.split()[-3:] == [lowest for lowest, _ in versions.TESTED.values()], shown.stderr[-2000:]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "-o", "addopts=", "-k", "not torch_compile", *CHILD_TESTS], capture_output=True, text=True, timeout=2400, cwd=ROOT,
                          env=env)
    summary = (done.stdout.strip().splitlines() or [""])[-1]
    assert done.returncode == 0, f"{' '.join(wanted)}: {summary}\n{done.stdout[-6000:]}\n{done.stderr[-2000:]}"
    assert " passed" in summary and "failed" not in summary, summary
    print(f"{' '.join(wanted)}: {summary}", file=sys.stderr)
