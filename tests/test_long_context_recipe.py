"""The gpt_long recipe with the long-context options on the CPU (cpu_tiny config, a few steps): the tiled MLP gives
the loss trajectory of the untiled one within rounding, activation offload bitwise that of plain checkpointing."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from volta_train.recipes import gpt_long
from volta_train.training import activation_offload, logs

ROOT = Path(__file__).resolve().parents[1]
CPU_TINY = ROOT / "configs" / "gpt_long" / "cpu_tiny.yaml"


def _losses(tmp_path: Path, name: str, *extra: str) -> list[float]:
    out = tmp_path / name
    gpt_long.main(["--config", str(CPU_TINY), "--steps", "5", "--log-interval", "1", "--eval-batches", "0",
                   "--out-dir", str(out), "--cache-dir", str(tmp_path / "cache"), "--no-progress", "--no-save",
                   "--cpu-threads", "1", *extra])
    rows = logs.read_csv(out / "train.csv")
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5]
    return [float(r["loss"]) for r in rows]


@pytest.mark.slow
def test_tiled_mlp_and_offload_keep_the_loss_trajectory(tmp_path, monkeypatch):
    made = []

    class Recorded(activation_offload.ActivationOffload):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(activation_offload, "ActivationOffload", Recorded)
    monkeypatch.setattr(activation_offload, "MIN_BYTES", 1)
    plain = _losses(tmp_path, "off", "--tiled-mlp", "off")
    tiled = _losses(tmp_path, "on", "--tiled-mlp", "on", "--tiled-mlp-tokens", "100")  # 8 x 256 tokens: 21 tiles
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(plain, tiled)), (plain, tiled)
    checkpointed = _losses(tmp_path, "ckpt", "--tiled-mlp", "on", "--tiled-mlp-tokens", "100",
                           "--gradient-checkpointing")
    offloaded = _losses(tmp_path, "offload", "--tiled-mlp", "on", "--tiled-mlp-tokens", "100",
                        "--gradient-checkpointing", "--activation-offload")
    assert offloaded == checkpointed  # bitwise
    (offload,) = made
    assert offload.stats.packed == offload.stats.unpacked == 5 * 4 and offload.stats.prefetch_hits == 5 * 3
    assert "tiled MLP on: 4 MLP modules over tiles of 100 tokens" in (tmp_path / "on" / "train.log").read_text()
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(plain, checkpointed)), (plain, checkpointed)


@pytest.mark.slow
def test_tiled_mlp_under_zero3_and_ulysses(tmp_path):
    """Two gloo processes, ZeRO-3 (the ds_grad_is_ready path), Ulysses sp=2, checkpointing: tiled = untiled."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_DEEPSPEED"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    losses = {}
    for mode in ("off", "on"):
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "configs/accelerate/zero3.yaml"), "--num_processes", "2", str(ROOT / "recipes/gpt_long.py"),
               "--config", str(CPU_TINY), "--steps", "3", "--log-interval", "1", "--eval-batches", "0",
               "--out-dir", str(tmp_path / mode), "--cache-dir", str(tmp_path / "cache"), "--no-progress", "--no-save",
               "--mixed-precision", "no", "--model", "nano", "--arch", "llama", "--seq-len", "128", "--batch-size",
               "2", "--sequence-parallel-size", "2", "--gradient-checkpointing", "--checkpoint-interval", "0",
               "--tiled-mlp", mode, "--tiled-mlp-tokens", "30"]
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        losses[mode] = [float(r["loss"]) for r in logs.read_csv(tmp_path / mode / "train.csv")]
    assert len(losses["on"]) == 3
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(losses["off"], losses["on"])), losses
