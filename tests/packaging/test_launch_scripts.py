"""scripts/launch_node.sh and scripts/launch_multi_node.sh: the accelerate command they build, and their usage
errors (exit 2, naming what is accepted). accelerate and nvidia-smi are stand-ins that print what they were given."""

from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path

import pytest

from checkout import ROOT


@pytest.fixture
def fake_bin(tmp_path: Path) -> dict[str, str]:
    gpus = random.randint(1, 8)
    (tmp_path / "accelerate").write_text('#!/usr/bin/env bash\necho "accelerate $*"\n')
    (tmp_path / "nvidia-smi").write_text(
        "#!/usr/bin/env bash\n" + "".join(f'echo "GPU {i}: Tesla V100-SXM2-32GB"\n' for i in range(gpus)))
    for tool in ("accelerate", "nvidia-smi"):
        (tmp_path / tool).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NUM_", "MACHINE_", "MAIN_", "GPUS_"))}
    env["PATH"] = f"{tmp_path}:{env['PATH']}"
    env["FAKE_GPUS"] = str(gpus)
    return env


def _run(script: str, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts" / script), *args], env=env, capture_output=True, text=True,
                          cwd=ROOT)


def test_launch_node_passes_config_processes_and_options(fake_bin):
    result = _run("launch_node.sh", ["zero2", "gpt_long", "--steps", "3"], fake_bin)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [
        "accelerate", "launch", "--config_file", str(ROOT / "configs/accelerate/zero2.yaml"),
        "--num_processes", fake_bin["FAKE_GPUS"], str(ROOT / "recipes/gpt_long.py"), "--steps", "3"]
    for config in ("one_process", "single_gpu"):
        single = _run("launch_node.sh", [config, "finetune"], dict(fake_bin, NUM_PROCESSES="5"))
        assert f"{config}.yaml --num_processes 1 " in single.stdout
    chosen = _run("launch_node.sh", ["ddp", "finetune"], dict(fake_bin, NUM_PROCESSES="3"))
    assert "--num_processes 3 " in chosen.stdout


@pytest.mark.parametrize("args, expected", [
    (["ddp"], "usage"),
    (["zero9", "gpt_long"], "accepted: one_process single_gpu ddp zero2 zero3 zero3_offload"),
    (["multi_node", "gpt_long"], "scripts/launch_multi_node.sh"),
    (["ddp", "no_such_recipe"], "accepted: gpt_long, finetune"),
])
def test_launch_node_usage_errors(fake_bin, args, expected):
    result = _run("launch_node.sh", args, fake_bin)
    assert result.returncode == 2 and expected in result.stderr and not result.stdout


def test_launch_multi_node_builds_the_ranked_command(fake_bin):
    machines, rank = random.randint(2, 4), 1
    env = dict(fake_bin, NUM_MACHINES=str(machines), MACHINE_RANK=str(rank), MAIN_PROCESS_IP="10.1.2.3")
    result = _run("launch_multi_node.sh", ["gpt_long", "--out-dir", "/shared/x"], env)
    assert result.returncode == 0, result.stderr
    gpus = int(fake_bin["FAKE_GPUS"])
    assert result.stdout.split() == [
        "accelerate", "launch", "--config_file", str(ROOT / "configs/accelerate/multi_node.yaml"),
        "--num_machines", str(machines), "--num_processes", str(machines * gpus), "--machine_rank", str(rank),
        "--main_process_ip", "10.1.2.3", "--main_process_port", "29500", str(ROOT / "recipes/gpt_long.py"),
        "--out-dir", "/shared/x"]
    slurm = _run("launch_multi_node.sh", ["finetune"],
                 dict(fake_bin, SLURM_JOB_NUM_NODES="2", SLURM_NODEID="0", MAIN_PROCESS_IP="h0"))
    assert "--num_machines 2 " in slurm.stdout and "--machine_rank 0 " in slurm.stdout


def test_launch_multi_node_names_what_is_missing(fake_bin):
    result = _run("launch_multi_node.sh", ["gpt_long"], dict(fake_bin, NUM_MACHINES="2", MACHINE_RANK="0"))
    assert result.returncode == 2 and "MAIN_PROCESS_IP is not set" in result.stderr
