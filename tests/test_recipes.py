"""The GPT recipe: a few CPU training steps end to end, and its configuration handling.

The end-to-end runs are subprocesses (as a user runs them) and are marked ``slow``;
the configuration and data tests run in-process in well under a second each.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from volta_train.training import config, data, gpt, optim

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "gpt_long.py"
CONFIGS = sorted((ROOT / "configs" / "gpt_long").glob("*.yaml"))
CPU_TINY = ROOT / "configs" / "gpt_long" / "cpu_tiny.yaml"
STEP_LINE = re.compile(r"step (\d+)/(\d+) \| loss (\S+) \| lr \S+ \| grad norm \S+ \| [\d,]+ tok/s \| peak mem ")


def _patch_available() -> bool:
    try:
        import volta_train

        volta_train.patch  # noqa: B018 - the attribute imports the HF integration
        return True
    except ImportError:
        return False


def _run_recipe(tmp_path: Path, *extra: str, launcher=(sys.executable,)) -> subprocess.CompletedProcess:
    cmd = [
        *launcher, str(RECIPE), "--config", str(CPU_TINY), "--steps", "4", "--log-interval", "2",
        "--eval-batches", "1", "--out-dir", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache"),
        "--no-progress", *extra,
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    return proc


def _check_run(proc: subprocess.CompletedProcess, out: Path, attention: str) -> None:
    log = proc.stderr
    steps = STEP_LINE.findall(log)
    assert [(int(a), int(b)) for a, b, _ in steps] == [(2, 4), (4, 4)], log  # --steps 4 overrode the YAML's 200
    assert all(math.isfinite(float(loss)) for _, _, loss in steps), log
    assert re.search(r"eval step 4 \| val loss [\d.]+", log), log
    assert re.search(r"done: 4 steps, 8,192 tokens in [\d.]+ s \(", log), log
    summary = json.loads((out / "summary.json").read_text())
    assert math.isfinite(summary["train_loss"]) and math.isfinite(summary["val_loss"])
    assert summary["attention"] == attention
    assert f"attention {attention}" in log
    assert (out / "train.log").read_text().count("step 4/4") == 1

    final = out / "final"
    for name in ("model.safetensors", "config.json", "train_config.yaml", "run.json"):
        assert (final / name).is_file(), sorted(p.name for p in final.iterdir())
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(final)
    assert (model.config.n_layer, model.config.n_embd, model.config.n_positions) == (4, 128, 256)
    ids = torch.tensor([list(b"Registry of Elmstead.")])
    assert torch.isfinite(model(input_ids=ids).logits).all()
    # the saved training config is a valid --config file that reproduces the run's settings
    saved = config.load_yaml(final / "train_config.yaml", gpt.GPTTrainConfig)
    assert saved["steps"] == 4 and saved["model"] == "tiny" and saved["seq_len"] == 256


@pytest.mark.slow
def test_cpu_smoke(tmp_path):
    """`python recipes/gpt_long.py`, attention through volta_train.patch (the default)."""
    if not _patch_available():
        pytest.skip("volta_train.patch (volta_train/integrations/hf.py) is not available")
    proc = _run_recipe(tmp_path)
    _check_run(proc, tmp_path / "out", attention="volta_train")


@pytest.mark.slow
def test_cpu_smoke_accelerate_launch_no_patch(tmp_path):
    """`accelerate launch` with no accelerate config file (1 process, OMP_NUM_THREADS=1), stock SDPA attention."""
    launcher = (sys.executable, "-m", "accelerate.commands.launch")
    proc = _run_recipe(tmp_path, "--no-patch", launcher=launcher)
    _check_run(proc, tmp_path / "out", attention="sdpa")


def _load_recipe():
    spec = importlib.util.spec_from_file_location("gpt_long_recipe", RECIPE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_unknown_yaml_key_is_an_error(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: tiny\nn_layers: 3\n")
    with pytest.raises(config.ConfigError, match=r"unknown key 'n_layers' \(did you mean 'n_layer'\?\)"):
        config.load_yaml(bad, gpt.GPTTrainConfig)
    with pytest.raises(SystemExit) as exit_info:  # through the recipe's command line: usage error, status 2
        _load_recipe().main(["--config", str(bad)])
    assert exit_info.value.code == 2
    assert "unknown key 'n_layers'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text, message",
    [
        ("steps: many\n", "steps must be int, got 'many'"),
        ("mixed_precision: no\n", "quote it"),
        ("mixed_precision: fp8\n", "mixed_precision is 'fp8'; accepted: no, fp16, bf16"),
        ("model: huge\n", "model is 'huge'; accepted: nano, tiny"),
        ("- steps: 3\n", "expected a mapping"),
    ],
)
def test_bad_yaml_values(tmp_path, text, message):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(config.ConfigError, match=re.escape(message)):
        config.load_yaml(bad, gpt.GPTTrainConfig)


def test_cli_overrides_yaml(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("model: tiny\nsteps: 200\nlr: 3e-4\nseq-len: 128\npatch: true\n")  # 3e-4: a YAML string
    cfg = config.parse_config(gpt.GPTTrainConfig, ["--config", str(cfg_file), "--steps", "7", "--no-patch"])
    assert (cfg.steps, cfg.patch) == (7, False)  # flags win
    assert (cfg.model, cfg.lr, cfg.seq_len) == ("tiny", 3e-4, 128)  # the rest comes from the YAML
    assert cfg.batch_size is None  # neither: auto, resolved per device
    cfg = gpt.resolve(cfg, "cpu")
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.batch_size) == (4, 2, 128, 8)
    cfg = config.parse_config(gpt.GPTTrainConfig, ["--config", str(cfg_file), "--n-layer", "3", "--model", "mini"])
    cfg = gpt.resolve(cfg, "cuda")
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.seq_len) == (3, 6, 384, 128)  # preset, then single fields


def test_auto_defaults_per_device():
    cpu = gpt.resolve(gpt.GPTTrainConfig(), "cpu")
    assert (cpu.model, cpu.seq_len, cpu.mixed_precision, cpu.warmup_steps) == ("tiny", 256, "no", 20)
    cuda = gpt.resolve(gpt.GPTTrainConfig(), "cuda")
    assert (cuda.model, cuda.n_layer, cuda.seq_len, cuda.mixed_precision) == ("small", 12, 4096, "fp16")
    assert cuda.synthetic_mb * 1e6 >= cuda.steps * cuda.batch_size * cuda.grad_accum * cuda.seq_len
    with pytest.raises(config.ConfigError, match="multiple of n_head"):
        gpt.resolve(gpt.GPTTrainConfig(n_embd=100, n_head=3), "cpu")


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_shipped_configs_are_valid(path):
    values = config.load_yaml(path, gpt.GPTTrainConfig)
    for device in ("cpu", "cuda"):
        gpt.resolve(gpt.GPTTrainConfig(**values), device)


def test_tokenizer_cache_and_packing(tmp_path):
    tok = data.ByteTokenizer()
    assert tok.decode(tok.encode("héllo")) == "héllo"
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("first document")
    (docs / "b.jsonl").write_text(json.dumps({"text": "second"}) + "\n" + json.dumps({"text": "third"}) + "\n")
    tokens = data.load_tokens(str(docs), tmp_path / "cache", tok)
    assert tok.decode(tokens).split("<|eos|>") == ["first document", "second", "third", ""]
    cached = list((tmp_path / "cache").glob("*.npy"))
    assert len(cached) == 1
    mtime = cached[0].stat().st_mtime_ns
    assert np.array_equal(data.load_tokens(str(docs), tmp_path / "cache", tok), tokens)
    assert cached[0].stat().st_mtime_ns == mtime  # read from the cache, not rewritten

    synthetic = data.load_tokens("synthetic", tmp_path / "cache", tok, synthetic_bytes=20_000)
    assert synthetic.size >= 20_000 and synthetic[-1] == tok.eos_token_id
    train, val = data.split_tokens(synthetic, 0.1, 64)
    assert train.size + val.size == synthetic.size and val.size >= 64
    ds = data.PackedDataset(train, 64)
    assert len(ds) == train.size // 64
    item = ds[len(ds) - 1]
    assert item["input_ids"].shape == (64,) and item["input_ids"].dtype == torch.int64
    assert torch.equal(item["input_ids"], torch.from_numpy(train[-(train.size % 64) - 64 :][:64].astype(np.int64)))


def test_lr_schedule():
    lrs = [optim.lr_at(s, 100, 1e-3, 10, 0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert max(lrs) == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert optim.lr_at(100, 100, 1e-3, 10, 0.1) == pytest.approx(1e-4)
