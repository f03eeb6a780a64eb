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
