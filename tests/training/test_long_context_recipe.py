"""The gpt_long recipe with the long-context options on the CPU (cpu_tiny config, a few steps): the tiled MLP gives
the loss trajectory of the untiled one within rounding, activation offload bitwise that of plain checkpointing."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from volta_train.recipes import gpt_long
from volta_train.training import activation_offload, logs
from checkout import ROOT, checkout_env
from child_process import launch_env

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


@pytest.mark.launches_processes
@pytest.mark.slow
def test_tiled_mlp_under_zero3_and_ulysses(tmp_path):
    """Two gloo processes, ZeRO-3 (weights gathered per tile by DeepSpeed's hooks), Ulysses sp=2, checkpointing: tiled =
    untiled."""
    import subprocess
    import sys

    env = checkout_env(env=launch_env())
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


@pytest.mark.launches_processes
@pytest.mark.slow
def test_activation_offload_under_zero3_and_ulysses(tmp_path):
    """Two gloo processes under ZeRO-3 with Ulysses sp=2 (the offload's hooks do not depend on the ZeRO stage): the
    offload's losses are bitwise those of plain checkpointing, and hidden states did go to host memory (each 1.5 MiB
    per process, above activation_offload.MIN_BYTES)."""
    zero, sp = "zero3", 2
    import json
    import subprocess
    import sys

    env = checkout_env(env=launch_env())
    losses, summaries = {}, {}
    for mode in ("checkpointing", "offload"):
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / f"configs/accelerate/{zero}.yaml"), "--num_processes", "2", str(ROOT / "recipes/gpt_long.py"),
               "--config", str(CPU_TINY), "--steps", "2", "--log-interval", "1", "--eval-batches", "0",
               "--out-dir", str(tmp_path / mode), "--cache-dir", str(tmp_path / "cache"), "--no-progress", "--no-save",
               "--mixed-precision", "no", "--model", "nano", "--arch", "llama", "--n-embd", "192", "--seq-len",
               str(1024 * sp), "--batch-size", "2", "--sequence-parallel-size", str(sp), "--gradient-checkpointing",
               "--checkpoint-interval", "0", "--tiled-mlp", "off"] + (["--activation-offload"] if mode == "offload"
                                                                       else [])
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        losses[mode] = [float(r["loss"]) for r in logs.read_csv(tmp_path / mode / "train.csv")]
        summaries[mode] = json.loads((tmp_path / mode / "summary.json").read_text())
    assert len(losses["offload"]) == 2 and losses["offload"] == losses["checkpointing"], losses
    offloaded = summaries["offload"]["activation_offload"]
    assert offloaded["packed"] > 0 and offloaded["prefetch_hits"] > 0, offloaded
    assert "activation_offload" not in summaries["checkpointing"]


def test_shipped_8b_config_composes_everything():
    """configs/gpt_long/v100_llama8b_128k_sp8_zero3_offload.yaml, without launching: it loads and resolves for 8 GPU
    processes, names a ZeRO-3 DeepSpeed config with the optimizer and the weights offloaded to the CPU, turns every
    long-context option on, and its model (built on the meta device) has 32 tiled MLPs, checkpointed blocks whose
    inputs go to host memory, and a head the chunked loss accepts."""
    import json

    import torch

    from volta_train.training import (chunked_loss, config, data, distributed, gpt, memory, rms_norm,
                                      sequence_parallel, tiled_mlp)

    path = ROOT / "configs" / "gpt_long" / "v100_llama8b_128k_sp8_zero3_offload.yaml"
    cfg = gpt.resolve(config.parse_config(gpt.GPTTrainConfig, ["--config", str(path)]), "cuda", 8)
    gpt.check_sequence_parallel(cfg, 8)
    assert (cfg.arch, cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.intermediate_size) == \
        ("llama", 32, 4096, 32, 8, 14336)
    assert (cfg.seq_len, cfg.parallel.sequence_parallel_size, cfg.precision.mixed_precision) == (131072, 8, "fp16")
    m = cfg.memory
    assert m.gradient_checkpointing and m.activation_offload and m.chunked_loss and m.tiled_mlp == "on"
    ds = json.loads(distributed.resolve_deepspeed_spec(cfg.parallel.deepspeed).read_text())
    zero = ds["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_optimizer"]["device"] == "cpu" and zero["offload_param"]["device"] == "cpu"
    with torch.device("meta"):
        model = gpt.build_model(cfg, data.load_tokenizer(gpt.default_tokenizer(cfg)))
        memory.apply(model, m, memory.tokens_per_process(cfg.batch_size, cfg.seq_len, 8))
    sequence_parallel.check_degree(8, *sequence_parallel.heads_of(model.config), 8)
    tiled = [m for m in model.modules() if hasattr(m, tiled_mlp._ATTR)]
    assert len(tiled) == 32 and getattr(tiled[0], tiled_mlp._ATTR).tile_tokens == 2304
    assert isinstance(getattr(model, "_volta_activation_offloader", None), activation_offload.ActivationOffload)
    assert sum(hasattr(m, rms_norm._ATTR) for m in model.modules()) == 65  # lean_norm auto, on with the tiles
    assert sum(1 for m in activation_offload.checkpointed_modules(model) if hasattr(m, activation_offload._ATTR)) >= 32
    assert chunked_loss.resolve(m.chunked_loss, model, m.loss_chunk_tokens)[0]
    # Llama-3.1-8B's 8.03 B less its two 128k-word embeddings (a bytes vocabulary, tied)
    assert abs(sum(p.numel() for p in model.parameters()) - 6.98e9) < 0.05e9


def test_activation_offload_keep_option():
    """activation_offload_keep in both recipes: the top blocks keep their inputs on the device, and a count that is
    negative or leaves no block to offload is refused naming the option."""
    import torch

    from volta_train.training import activation_offload, data, gpt, memory
    from volta_train.training.config import ConfigError

    def build(keep):
        options = memory.MemoryConfig(gradient_checkpointing=True, activation_offload=True,
                                      activation_offload_keep=keep)
        cfg = gpt.resolve(gpt.GPTTrainConfig(arch="llama", model="nano", n_layer=3, seq_len=64, cpu=True,
                                             memory=options), "cpu", 1)
        with torch.device("meta"):
            model = gpt.build_model(cfg, data.ByteTokenizer())
            memory.apply(model, cfg.memory, memory.tokens_per_process(cfg.batch_size, cfg.seq_len))
            return model

    model = build(1)
    offloaded = [m for m in activation_offload.checkpointed_modules(model) if hasattr(m, activation_offload._ATTR)]
    layers = model.model.layers
    assert not hasattr(layers[2], activation_offload._ATTR) and all(hasattr(b, activation_offload._ATTR)
                                                                      for b in layers[:2])
    assert layers[2] not in offloaded
    with pytest.raises(ConfigError, match=r"memory.activation_offload_keep: .*keep_last must be in \[0, 3\)"):
        build(3)
    with pytest.raises(ConfigError, match="memory.activation_offload_keep must be >= 0"):
        build(-1)

