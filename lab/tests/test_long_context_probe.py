"""lab/long_context_probe.py --smoke on the CPU (the search, the features, the table and JSON), and its memory
model's arithmetic."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _probe():
    spec = importlib.util.spec_from_file_location("long_context_probe", ROOT / "lab" / "long_context_probe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_and_memory_model(tmp_path):
    probe = _probe()
    summary = probe.main(["--smoke", "--variants", "baseline,tiled+offload", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "long_context_probe.json").read_text())
    assert [r["variant"] for r in saved["results"]] == ["baseline", "tiled+offload"]
    assert all(r["longest"] == 512 and r["first_fail"] is None for r in summary["results"])
    assert summary["results"][1]["offloaded_bytes"] > 0
    assert "| tiled+offload | 512 |" in (tmp_path / "long_context_probe.md").read_text()
    shape = probe.model_shape("llama1b", 128256)
    assert abs(shape["parameters"] - 1.2358e9) < 1e6  # Llama-3.2-1B with tied embeddings
    base = probe.memory_model(shape, 1000, False, False)
    both = probe.memory_model(shape, 1000, True, True)
    # tiling removes the 8 x intermediate bytes of the MLP, offload all but two layers' hidden states
    assert base["bytes_per_token"] - both["bytes_per_token"] == 8 * 8192 + 15 * 2048 * 4
    assert probe.predicted_max_tokens(shape, 32, True, True) > probe.predicted_max_tokens(shape, 32, False, False)
