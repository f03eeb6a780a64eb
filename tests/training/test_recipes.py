"""The GPT recipe and the training machinery it shares with the fine-tuning recipe.

Fast tests (in-process, well under a second each): configuration, data packing and sampling,
FLOP counting, checkpoint atomicity and safe loading, DeepSpeed/accelerate config files.
Slow tests (``@pytest.mark.slow``, subprocesses as a user runs them, CPU only): smoke runs through
``python`` and ``accelerate launch``, a SIGKILL-and-resume run that must repeat the uninterrupted
loss trajectory, two-process DDP, DeepSpeed ZeRO-2 (with resume) and ZeRO-3 with CPU offload on
gloo, and the end-to-end benchmark's smoke mode.
"""

from __future__ import annotations

import importlib.util
import json
import math
import pickle
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from volta_train.training import checkpoint, config, data, distributed, gpt, logs, metrics, optim
from child_process import launch_env, stderr_tail
from checkout import ROOT

RECIPE = ROOT / "recipes" / "gpt_long.py"
CONFIGS = sorted((ROOT / "configs" / "gpt_long").glob("*.yaml"))
ACCELERATE_CONFIGS = sorted((ROOT / "configs" / "accelerate").glob("*.yaml"))
DEEPSPEED_CONFIGS = sorted((ROOT / "configs" / "deepspeed").glob("*.json"))
CPU_TINY = ROOT / "configs" / "gpt_long" / "cpu_tiny.yaml"
STEP_LINE = re.compile(r"step (\d+)/(\d+) \| loss (\S+) \| lr \S+ \| grad norm \S+ \| [\d,]+ tok/s \| peak mem ")
ACCELERATE = (sys.executable, "-m", "accelerate.commands.launch")


def _patch_supports(model_type: str) -> bool:
    try:
        from volta_train.integrations import hf
    except ImportError:
        return False
    return model_type in hf.FAMILIES


def _run(cmd: list[str], cwd: Path, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env or launch_env())
    assert proc.returncode == 0, (
        f"{' '.join(cmd)}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{stderr_tail(proc.stderr)}"
    )
    return proc


def _recipe_cmd(tmp_path: Path, *extra: str, launcher=(sys.executable,), out="out") -> list[str]:
    return [
        *launcher, str(RECIPE), "--config", str(CPU_TINY), "--steps", "4", "--log-interval", "2",
        "--eval-batches", "1", "--out-dir", str(tmp_path / out), "--cache-dir", str(tmp_path / "cache"),
        "--no-progress", *extra,
    ]


def _check_run(proc: subprocess.CompletedProcess, out: Path, attention: str, model_type: str = "gpt2",
               tokens: str = "8,192", processes: int = 1) -> dict:
    log = proc.stderr
    steps = STEP_LINE.findall(log)
    assert [(int(a), int(b)) for a, b, _ in steps] == [(2, 4), (4, 4)], log  # --steps 4 overrode the YAML's 200
    assert all(math.isfinite(float(loss)) for _, _, loss in steps), log
    assert re.search(r"eval step 4 \| val loss [\d.]+", log), log
    assert re.search(rf"done: 4 steps, {tokens} tokens in [\d.]+ s \(", log), log
    summary = json.loads((out / "summary.json").read_text())
    assert math.isfinite(summary["train_loss"]) and math.isfinite(summary["val_loss"])
    assert summary["attention"] == attention and summary["processes"] == processes
    assert f"attention {attention}" in log
    assert (out / "train.log").read_text().count("step 4/4") == 1
    rows = logs.read_csv(out / "train.csv")
    assert [int(r["step"]) for r in rows] == [2, 4] and all(float(r["tokens_per_s"]) > 0 for r in rows)
    assert [int(r["step"]) for r in logs.read_csv(out / "eval.csv")] == [4]
    # TensorBoard is opt-in; loss.png is always drawn; the last line names the run's files
    assert bool(list((out / "tensorboard").glob("events.out.tfevents.*"))) == ("--tensorboard" in proc.args)
    assert (out / "loss.png").stat().st_size > 1000 and (out / "config.yaml").is_file()
    assert re.search(r"in .*: train\.csv, eval\.csv, summary\.json, loss\.png", log.strip().splitlines()[-1]), log
    assert "Setting accelerator to CPU" not in proc.stdout + log

    final = out / "final"
    for name in ("model.safetensors", "config.json", "train_config.yaml", "run.json"):
        assert (final / name).is_file(), sorted(p.name for p in final.iterdir())
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(final)
    assert model.config.model_type == model_type
    ids = torch.tensor([list(b"Registry of Elmstead.")])
    assert torch.isfinite(model(input_ids=ids).logits).all()
    if model_type == "gpt2" and "--tokenizer" not in proc.args:  # the byte tokenizer is saved and round-trips
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(final)
        text = "Registry of Elmstead, naïve — 北"
        assert tokenizer(text)["input_ids"] == list(text.encode()) and tokenizer.decode(list(text.encode())) == text
    # the saved training config is a valid --config file that reproduces the run's settings
    saved = config.load_yaml(final / "train_config.yaml", gpt.GPTTrainConfig)
    assert saved["steps"] == 4 and saved["seq_len"] == 256
    return summary


@pytest.mark.slow
def test_cpu_smoke(tmp_path):
    """`python recipes/gpt_long.py`: GPT-2, attention through volta_train.patch (the default), checkpoints."""
    if not _patch_supports("gpt2"):
        pytest.skip("volta_train.patch (volta_train/integrations/hf.py) is not available")
    proc = _run(_recipe_cmd(tmp_path, "--checkpoint-interval", "2", "--tensorboard"), tmp_path)
    summary = _check_run(proc, tmp_path / "out", attention="volta_train")
    assert summary["packing"] in ("documents", "stream") and "packing" in proc.stderr
    found = checkpoint.complete_checkpoints(tmp_path / "out" / "checkpoints")
    assert [step for step, _ in found] == [2, 4]  # keep_checkpoints 2
    assert (tmp_path / "out" / "checkpoints" / "latest").read_text().strip() == "step-00000004"


@pytest.mark.launches_processes
@pytest.mark.slow
def test_cpu_smoke_accelerate_launch_llama_no_patch(tmp_path):
    """`accelerate launch` with no accelerate config file (1 process), Llama-style model, stock SDPA attention."""
    proc = _run(_recipe_cmd(tmp_path, "--no-patch", "--arch", "llama", "--n-kv-head", "1", "--packing", "documents",
                            launcher=ACCELERATE), tmp_path)
    summary = _check_run(proc, tmp_path / "out", attention="sdpa", model_type="llama")
    assert summary["packing"] == "documents"


@pytest.mark.slow
def test_sigkill_resume_repeats_the_loss_trajectory(tmp_path):
    """SIGKILL a run mid-way, resume from its last checkpoint: every logged step matches an uninterrupted run.

    fp16 (CPU autocast + GradScaler, growth every 3 steps, so the loss scale changes), dropout (RNG),
    gradient accumulation and shuffled data: the loss, the loss scale and the learning rate must all
    continue exactly where the killed run left them.
    """
    steps = 16
    common = [
        sys.executable, str(RECIPE), "--config", str(CPU_TINY), "--model", "nano", "--seq-len", "64",
        "--batch-size", "4", "--grad-accum", "2", "--dropout", "0.1", "--mixed-precision", "fp16",
        "--loss-scale-init", "1024", "--loss-scale-window", "3", "--steps", str(steps), "--log-interval", "1",
        "--checkpoint-interval", "4", "--eval-batches", "1", "--no-progress", "--cache-dir", str(tmp_path / "cache"),
    ]
    _run(common + ["--out-dir", str(tmp_path / "ref")], tmp_path)

    out = tmp_path / "killed"
    proc = subprocess.Popen(common + ["--out-dir", str(out)], cwd=tmp_path, stderr=subprocess.PIPE, text=True,
                            env=launch_env())
    seen = []
    try:
        for line in proc.stderr:
            seen.append(line)
            m = re.search(rf"step (\d+)/{steps} \|", line)
            if m and int(m.group(1)) >= 6:
                proc.send_signal(signal.SIGKILL)
                break
    finally:
        proc.wait(timeout=120)
    assert proc.returncode == -signal.SIGKILL, "".join(seen[-30:])
    last = checkpoint.find_latest(out / "checkpoints")
    assert last is not None, "".join(seen[-30:])
    resumed_at = int(last.name.split("-")[1])
    assert 4 <= resumed_at < steps

    proc = _run(common + ["--out-dir", str(out)], tmp_path)
    assert f"resumed from {last} at step {resumed_at}/{steps}" in proc.stderr
    ref, got = logs.read_csv(tmp_path / "ref" / "train.csv"), logs.read_csv(out / "train.csv")
    assert [int(r["step"]) for r in got] == list(range(1, steps + 1))  # the killed run's extra rows were dropped
    scales = {float(r["loss_scale"]) for r in ref}
    assert len(scales) > 2, "the loss scale should have grown during the run"
    for a, b in zip(ref, got):
        assert float(a["loss_scale"]) == float(b["loss_scale"]), (a, b)
        assert float(a["lr"]) == float(b["lr"])
        assert float(a["loss"]) == pytest.approx(float(b["loss"]), rel=1e-6, abs=1e-6), (a, b)
    ref_summary = json.loads((tmp_path / "ref" / "summary.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    assert summary["val_loss"] == pytest.approx(ref_summary["val_loss"], rel=1e-6)
    assert summary["resumed_from"] == str(last) and summary["total_tokens"] == ref_summary["total_tokens"]


@pytest.mark.slow
def test_sigterm_stops_with_a_checkpoint(tmp_path):
    """SIGTERM (a scheduler's notice): the run finishes its step, checkpoints, writes its summary and exits with the
    stopped status (75), which a job chain tells from a finished run (0)."""
    cmd = _recipe_cmd(tmp_path, "--model", "nano", "--seq-len", "64", "--steps", "500", "--log-interval", "1",
                      "--checkpoint-interval", "0")
    proc = subprocess.Popen(cmd, cwd=tmp_path, stderr=subprocess.PIPE, text=True, env=launch_env())
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if re.search(r"step 3/500 \|", line):
            proc.send_signal(signal.SIGTERM)
            break
    lines += proc.stderr.readlines()
    assert proc.wait(timeout=120) == 75, "".join(lines[-30:])
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["stopped"] == "SIGTERM" and 3 <= summary["steps"] < 500 and not summary["completed"]
    assert summary["checkpoint"] is None  # no final model for an unfinished run
    assert checkpoint.find_latest(tmp_path / "out" / "checkpoints").name == f"step-{summary['steps']:08d}"


@pytest.mark.launches_processes
@pytest.mark.slow
def test_two_processes_ddp_config_on_cpu(tmp_path):
    """configs/accelerate/ddp.yaml with ACCELERATE_USE_CPU=1: two gloo processes, Llama-style, packed documents."""
    extra = ["--arch", "llama", "--n-kv-head", "1", "--grad-accum", "2", "--batch-size", "4"]
    if not _patch_supports("llama"):
        extra.append("--no-patch")
    launcher = (*ACCELERATE, "--config_file", str(ROOT / "configs/accelerate/ddp.yaml"), "--num_processes", "2")
    proc = _run(_recipe_cmd(tmp_path, *extra, launcher=launcher), tmp_path, env=launch_env(ACCELERATE_USE_CPU="1"))
    attention = "volta_train" if _patch_supports("llama") else "sdpa"
    _check_run(proc, tmp_path / "out", attention=attention, model_type="llama", tokens="16,384", processes=2)
    assert "x 2 process(es)" in proc.stderr


def _zero_cmd(tmp_path: Path, accelerate_config: str, out: str, *extra: str) -> list[str]:
    launcher = (*ACCELERATE, "--config_file", str(ROOT / "configs/accelerate" / accelerate_config),
                "--num_processes", "2")
    return _recipe_cmd(tmp_path, "--mixed-precision", "no", "--model", "nano", "--seq-len", "64",
                       "--batch-size", "4", "--log-interval", "1", *extra, launcher=launcher, out=out)


@pytest.mark.launches_processes
@pytest.mark.slow
def test_deepspeed_zero2_two_processes_and_resume(tmp_path):
    """configs/accelerate/zero2.yaml on CPU (DeepSpeed over gloo): 2 processes, a checkpoint, resume exactly."""
    cmd = _zero_cmd(tmp_path, "zero2.yaml", "out", "--checkpoint-interval", "2")
    proc = _run(cmd, tmp_path)
    assert "DeepSpeed ZeRO stage 2" in proc.stderr and "x 2 process(es)" in proc.stderr
    out = tmp_path / "out"
    assert (out / "checkpoints" / "step-00000002" / "deepspeed" / "state").is_dir()
    full = logs.read_csv(out / "train.csv")
    shutil.rmtree(out / "checkpoints" / "step-00000004")
    proc = _run(cmd, tmp_path)
    assert "resumed from" in proc.stderr and "at step 2/4" in proc.stderr
    again = logs.read_csv(out / "train.csv")
    assert [r["loss"] for r in again] == [r["loss"] for r in full]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["zero_stage"] == 2 and summary["processes"] == 2


@pytest.mark.launches_processes
@pytest.mark.slow
def test_deepspeed_zero3_cpu_offload_two_processes(tmp_path):
    """configs/accelerate/zero3_offload.yaml on CPU: ZeRO-3, parameters and optimizer offloaded, final weights
    gathered into one safetensors file. On a DeepSpeed older than versions.ZERO3_ON_GLOO (whose gloo gathers can
    leave garbage weights) the run is refused at start instead, naming the release needed, leaving no file."""
    from volta_train import versions

    cmd = _zero_cmd(tmp_path, "zero3_offload.yaml", "out", "--checkpoint-interval", "0")
    installed = versions.installed("deepspeed")
    if versions.older(installed, versions.ZERO3_ON_GLOO):
        proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=launch_env())
        assert proc.returncode != 0
        assert (f"needs DeepSpeed {versions.ZERO3_ON_GLOO} or newer; DeepSpeed {installed} gathers partitioned "
                "parameters") in proc.stderr, stderr_tail(proc.stderr)
        assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
        return
    proc = _run(cmd, tmp_path)
    assert "DeepSpeed ZeRO stage 3 (offload_optimizer, offload_param to CPU)" in proc.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["zero_stage"] == 3 and math.isfinite(summary["val_loss"])
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "final")
    assert sum(p.numel() for p in model.parameters()) == summary["parameters"]


@pytest.mark.slow
def test_bench_train_smoke(tmp_path):
    """scripts/bench_train.py --smoke: every attention, two lengths, the max-length search, table + JSON + PNG."""
    out = tmp_path / "bench"
    proc = _run([sys.executable, str(ROOT / "scripts" / "bench_train.py"), "--smoke", "--out", str(out)], tmp_path)
    results = json.loads((out / "bench_train.json").read_text())
    rows = results["runs"]
    assert {r["attention"] for r in rows} == {"volta_train", "sdpa", "eager"} if _patch_supports("gpt2") else True
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in rows), rows
    assert results["max_seq_len"], results
    assert (out / "bench_train.md").read_text().count("|") > 10
    if importlib.util.find_spec("matplotlib"):
        assert (out / "bench_train.png").stat().st_size > 1000
    assert "tokens/s" in proc.stdout


def test_bench_train_interleaved_losses(tmp_path):
    """--interleave-losses: both losses on one model, steps alternating; medians, their ratio, the table and JSON."""
    out = tmp_path / "bench"
    _run([sys.executable, str(ROOT / "scripts" / "bench_train.py"), "--models", "nano:320", "--seq-lens", "32",
          "--steps", "3", "--warmup", "1", "--tokens-per-step", "64", "--cpu", "--attention", "sdpa",
          "--interleave-losses", "--out", str(out)], tmp_path)
    (result,) = json.loads((out / "bench_train_interleaved.json").read_text())
    assert {k: len(v) for k, v in result["step_times"].items()} == {"unchunked": 3, "chunked": 3}
    medians = result["median_s"]
    assert medians["unchunked"] > 0 and medians["chunked"] > 0
    assert result["ratio"] == pytest.approx(medians["chunked"] / medians["unchunked"])
    assert result["gpu_ratio"] is None  # no GPU: no kernel time
    assert "| nano | 320 | 32 x 2 |" in (out / "bench_train_interleaved.md").read_text()


# ------------------------------------------------------------------------------------------------
# configuration
# ------------------------------------------------------------------------------------------------


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
        ("packing: maybe\n", "packing is 'maybe'; accepted: auto, documents, stream"),
        ("arch: mamba\n", "arch is 'mamba'; accepted: gpt2, llama"),
        ("- steps: 3\n", "expected a mapping"),
    ],
)
def test_bad_yaml_values(tmp_path, text, message):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(config.ConfigError, match=re.escape(message)):
        config.load_yaml(bad, gpt.GPTTrainConfig)


def test_yaml_is_read_with_the_safe_loader(tmp_path):
    marker = tmp_path / "pwned"
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"steps: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(config.ConfigError, match="not valid YAML"):
        config.load_yaml(bad, gpt.GPTTrainConfig)
    assert not marker.exists()


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
    assert (cpu.model, cpu.seq_len, cpu.precision.mixed_precision, cpu.warmup_steps) == ("tiny", 256, "no", 20)
    assert (cpu.checkpoint_interval, cpu.resume, cpu.packing) == (100, "auto", "auto")
    cuda = gpt.resolve(gpt.GPTTrainConfig(), "cuda")
    assert (cuda.model, cuda.n_layer, cuda.seq_len, cuda.precision.mixed_precision) == ("small", 12, 4096, "fp16")
    assert cuda.synthetic_mb * 1e6 >= cuda.steps * cuda.batch_size * cuda.grad_accum * cuda.seq_len
    with pytest.raises(config.ConfigError, match="multiple of n_head"):
        gpt.resolve(gpt.GPTTrainConfig(n_embd=100, n_head=3), "cpu")


def test_llama_config_and_errors(tmp_path):
    cfg = gpt.resolve(gpt.GPTTrainConfig(arch="llama", model="mini"), "cpu")
    assert (cfg.n_kv_head, cfg.intermediate_size) == (6, 1024)
    with pytest.raises(config.ConfigError, match=r"n_kv_head \(4\) must divide n_head \(6\)"):
        gpt.resolve(gpt.GPTTrainConfig(arch="llama", model="mini", n_kv_head=4), "cpu")
    with pytest.raises(config.ConfigError, match="n_kv_head applies to arch llama"):
        gpt.resolve(gpt.GPTTrainConfig(n_kv_head=1), "cpu")
    with pytest.raises(config.ConfigError, match="model_path 'nowhere' does not exist"):
        gpt.resolve(gpt.GPTTrainConfig(model_path="nowhere"), "cpu")
    (tmp_path / "m").mkdir()
    with pytest.raises(config.ConfigError, match="n_layer is set together with model_path"):
        gpt.resolve(gpt.GPTTrainConfig(model_path=str(tmp_path / "m"), n_layer=2), "cpu")
    model = gpt.build_model(gpt.resolve(gpt.GPTTrainConfig(arch="llama", model="nano", n_kv_head=1, seq_len=64),
                                        "cpu"), data.ByteTokenizer())
    shape = gpt.describe(model)
    assert (shape["model_type"], shape["n_kv_head"], shape["head_dim"]) == ("llama", 1, 32)
    # a saved model directory loads back as model_path, and a config.json as model_config
    model.save_pretrained(tmp_path / "saved")
    cfg = gpt.resolve(gpt.GPTTrainConfig(model_path=str(tmp_path / "saved"), seq_len=64), "cpu")
    again = gpt.build_model(cfg, data.ByteTokenizer())
    assert torch.equal(again.model.embed_tokens.weight, model.model.embed_tokens.weight)
    cfg = gpt.resolve(gpt.GPTTrainConfig(model_config=str(tmp_path / "saved" / "config.json"), seq_len=64), "cpu")
    assert gpt.describe(gpt.build_model(cfg, data.ByteTokenizer()))["n_layer"] == 2


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_shipped_configs_are_valid(path):
    values = config.load_yaml(path, gpt.GPTTrainConfig)
    for device in ("cpu", "cuda"):
        gpt.resolve(config.from_flat(gpt.GPTTrainConfig, values), device)


@pytest.mark.parametrize("path", DEEPSPEED_CONFIGS, ids=[p.stem for p in DEEPSPEED_CONFIGS])
def test_shipped_deepspeed_configs(path):
    ds = json.loads(path.read_text())
    assert ds["fp16"]["loss_scale"] == 0, "dynamic loss scaling"  # 0 = dynamic in DeepSpeed
    assert ds["fp16"]["enabled"] == "auto" and ds["gradient_accumulation_steps"] == "auto"
    assert ds["train_micro_batch_size_per_gpu"] == "auto" and ds["gradient_clipping"] == "auto"
    assert ds["zero_optimization"]["stage"] == int(path.stem[4])
    assert distributed.resolve_deepspeed_spec(path.stem) == path


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=[p.stem for p in ACCELERATE_CONFIGS])
def test_shipped_accelerate_configs(path):
    cfg = yaml.safe_load(path.read_text())
    assert cfg["distributed_type"] in ("NO", "MULTI_GPU", "MULTI_CPU", "DEEPSPEED")
    if cfg["distributed_type"] == "DEEPSPEED":
        ds_file = ROOT / cfg["deepspeed_config"]["deepspeed_config_file"]
        assert ds_file.is_file() and "mixed_precision" not in cfg  # accelerate refuses both with a JSON file
        assert cfg["deepspeed_config"]["zero3_init_flag"] is False
    from accelerate.commands.config.config_args import load_config_from_file

    load_config_from_file(str(path))  # accelerate itself accepts the file


def test_deepspeed_json_must_agree_with_the_recipe():
    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": "auto"}
    distributed._fill(ds, "gradient_clipping", 1.0, "grad_clip")
    assert ds["gradient_clipping"] == 1.0
    with pytest.raises(config.ConfigError, match="train_micro_batch_size_per_gpu: 4 but the recipe's batch_size is 8"):
        distributed._fill(ds, "train_micro_batch_size_per_gpu", 8, "batch_size")
    with pytest.raises(config.ConfigError, match="neither a file nor one of zero1, zero2, zero3, zero3_offload"):
        distributed.resolve_deepspeed_spec("zero4")


# ------------------------------------------------------------------------------------------------
# data
# ------------------------------------------------------------------------------------------------


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
    assert "position_ids" not in item


def test_document_packing_restarts_positions_and_masks_boundaries():
    eos = 9
    stream = np.array([1, 2, eos, 3, 4, 5, eos, 6, 7, 8, 1, 2], dtype=np.uint16)
    ds = data.PackedDataset(stream, 6, documents=True, eos_token_id=eos)
    first, second = ds[0], ds[1]
    assert first["position_ids"].tolist() == [0, 1, 2, 0, 1, 2]  # a new document after each EOS
    assert first["labels"].tolist() == [1, 2, eos, -100, 4, 5]  # the EOS does not learn the next document's start
    assert second["position_ids"].tolist() == [0, 0, 1, 2, 3, 4]  # the window starts a segment; EOS at 0 ends it
    assert second["labels"].tolist() == [eos, -100, 7, 8, 1, 2]
    with pytest.raises(ValueError, match="eos_token_id"):
        data.PackedDataset(stream, 6, documents=True)


def test_packed_documents_do_not_see_each_other():
    """What the recipe's packing relies on: with restarting position_ids the second document's logits equal
    those of the document alone (sdpa here; volta_train when its integration handles packed rows)."""
    from volta_train.training import attention_choice

    tok = data.ByteTokenizer()
    for arch in ("gpt2", "llama"):
        cfg = gpt.resolve(gpt.GPTTrainConfig(arch=arch, model="nano", seq_len=64), "cpu")
        model = gpt.build_model(cfg, tok)
        assert attention_choice.packed_documents_supported(model) == (True, "")
        if _patch_supports(arch):
            attention_choice.apply_patch(model)
            ok, why = attention_choice.packed_documents_supported(model)
            assert isinstance(ok, bool) and (ok or why)


def test_packed_document_check_computes_in_fp32_whatever_the_weights():
    """A model stored in fp16 or bf16 is checked with fp32 copies of each module's weights, restored afterwards: the
    decision never rests on 16-bit rounding (the packed and the single row round differently on a GPU)."""
    from volta_train.training import attention_choice

    tok = data.ByteTokenizer()
    cfg = gpt.resolve(gpt.GPTTrainConfig(arch="llama", model="nano", seq_len=64, seed=int(torch.randint(9999, ()))),
                      "cpu")
    for dtype in (torch.float16, torch.bfloat16):
        model = gpt.build_model(cfg, tok).to(dtype)
        before = {n: p.clone() for n, p in model.state_dict().items()}
        seen = []
        hook = model.get_output_embeddings().register_forward_hook(lambda m, a, out: seen.append(out.dtype))
        assert attention_choice.packed_documents_supported(model) == (True, "")
        hook.remove()
        assert seen and set(seen) == {torch.float32}
        after = model.state_dict()
        assert all(after[n].dtype == dtype and torch.equal(after[n], t) for n, t in before.items())


def test_sharded_batch_sampler_is_a_function_of_the_micro_batch():
    n, bs, world = 50, 4, 2
    samplers = [data.ShardedBatchSampler(n, bs, world, rank, seed=3) for rank in range(world)]
    assert samplers[0].batches_per_epoch == 6
    epoch0 = [samplers[r].batch(m) for m in range(6) for r in range(world)]
    flat = [i for b in epoch0 for i in b]
    assert len(flat) == len(set(flat)) == 48  # no index twice in an epoch, 2 dropped
    assert samplers[0].batch(6) != samplers[0].batch(0)  # the next epoch is reshuffled
    it = iter(data.ShardedBatchSampler(n, bs, world, 1, seed=3, start=5))
    assert [next(it) for _ in range(3)] == [samplers[1].batch(m) for m in (5, 6, 7)]
    with pytest.raises(ValueError, match="fewer than one batch"):
        data.ShardedBatchSampler(7, 4, 2, 0)
    assert data.eval_indices(20, 4, 10, 2, 1) == [[4, 5, 6, 7], [12, 13, 14, 15]]


def test_flop_counter():
    counter = metrics.FlopCounter(matmul_params=1000, n_layer=2, d_attn=8)
    ids = torch.zeros(2, 10, dtype=torch.long)
    tokens, flops = counter({"input_ids": ids})
    assert tokens == 20 and flops == 6 * 1000 * 20 + 6 * 2 * 8 * (2 * 100)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]] * 2)  # documents of 4 and 6 tokens
    assert counter({"input_ids": ids, "position_ids": positions}) == (20, 6 * 1000 * 20 + 96 * 2 * (16 + 36))
    mask = torch.tensor([[1] * 10, [1] * 5 + [0] * 5])
    assert counter({"input_ids": ids, "attention_mask": mask}) == (15, 6 * 1000 * 15 + 96 * (100 + 25))
    model = gpt.build_model(gpt.resolve(gpt.GPTTrainConfig(model="nano", seq_len=64), "cpu"), data.ByteTokenizer())
    # 2 blocks x (qkv 3d^2 + proj d^2 + mlp 8d^2) + the (tied) LM head
    assert metrics.matmul_parameters(model) == 2 * 12 * 64 * 64 + 320 * 64


def test_lr_schedule():
    lrs = [optim.lr_at(s, 100, 1e-3, 10, 0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert max(lrs) == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert optim.lr_at(100, 100, 1e-3, 10, 0.1) == pytest.approx(1e-4)
    assert optim.lr_at(55, 100, 1e-3, 10, 0.0, "linear") == pytest.approx(5e-4)
    assert optim.lr_at(90, 100, 1e-3, 10, 0.0, "constant") == 1e-3


def test_metrics_writer_keeps_one_trajectory_on_resume(tmp_path):
    w = logs.MetricsWriter(tmp_path, True, 0, tensorboard=False)
    for step in range(1, 7):
        w.write("train", step, {"loss": 1.0 / step, "loss_scale": None})
    w.close()
    w = logs.MetricsWriter(tmp_path, True, 4, tensorboard=False)  # resumed at step 4: rows 5, 6 go
    w.write("train", 5, {"loss": 0.5, "loss_scale": 8.0})
    rows = logs.read_csv(tmp_path / "train.csv")
    assert [r["step"] for r in rows] == ["1", "2", "3", "4", "5"] and rows[-1]["loss"] == "0.5"
    assert rows[0]["loss_scale"] == "" and float(rows[2]["loss"]) == 1.0 / 3


# ------------------------------------------------------------------------------------------------
# checkpoints
# ------------------------------------------------------------------------------------------------


class _Payload:
    """Pickles to a call of Path.touch: what a malicious checkpoint would run on load."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


@pytest.fixture
def cpu_accelerator(fresh_state):
    from accelerate import Accelerator

    return Accelerator(cpu=True)


def _tiny_training(accelerator):
    torch.manual_seed(0)
    model = gpt.build_model(gpt.resolve(gpt.GPTTrainConfig(model="nano", seq_len=32), "cpu"), data.ByteTokenizer())
    opt = optim.build_adamw(model, 1e-3, 0.1)
    model, opt = accelerator.prepare(model, opt)

    def step():
        ids = torch.randint(0, 256, (2, 32))
        accelerator.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()

    return model, opt, step


def test_checkpoint_killed_while_saving_keeps_the_last_good_one(tmp_path, cpu_accelerator, monkeypatch):
    acc = cpu_accelerator
    model, opt, step = _tiny_training(acc)
    root = tmp_path / "checkpoints"
    step()
    checkpoint.save_checkpoint(acc, model, opt, root, 1, {"tokens": 64}, keep=1)
    saved_weights = {k: v.clone() for k, v in model.state_dict().items()}
    step()

    def die(*args, **kwargs):  # the process "dies" after weights and optimizer state were written
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(checkpoint, "rng_state", die)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_checkpoint(acc, model, opt, root, 2, {"tokens": 128}, keep=1)
    monkeypatch.undo()
    assert (root / ".tmp-step-00000002" / "model" / "model.safetensors").is_file()  # half-written, ignored
    assert checkpoint.find_latest(root) == root / "step-00000001"
    assert (root / "latest").read_text().strip() == "step-00000001"

    fresh, fresh_opt, _ = _tiny_training(acc)
    state = checkpoint.load_checkpoint(acc, fresh, fresh_opt, root / "step-00000001")
    assert state["step"] == 1 and state["tokens"] == 64 and state["rng"] is not None
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, saved_weights[k]), k
    assert fresh_opt.state_dict()["state"][0]["step"] == 1

    checkpoint.save_checkpoint(acc, model, opt, root, 2, {"tokens": 128}, keep=1)
    assert [s for s, _ in checkpoint.complete_checkpoints(root)] == [2]  # keep=1: step 1 deleted after step 2
    assert not list(root.glob(".tmp-*"))  # the stale partial directory is gone


def test_checkpoint_loading_runs_no_pickled_code(tmp_path, cpu_accelerator):
    acc = cpu_accelerator
    model, opt, step = _tiny_training(acc)
    step()
    path = checkpoint.save_checkpoint(acc, model, opt, tmp_path, 1, {})
    marker = tmp_path / "pwned"
    torch.save({"state": {}, "param_groups": [], "evil": _Payload(marker)}, path / "optimizer.pt")
    with pytest.raises(checkpoint.CheckpointError, match=re.escape(str(path / "optimizer.pt"))) as err:
        checkpoint.load_checkpoint(acc, model, opt, path)
    assert isinstance(err.value.__cause__, pickle.UnpicklingError)
    # DeepSpeed's loader asks for weights_only=False; inside weights_only_loading that request is overridden
    with checkpoint.weights_only_loading(), pytest.raises(pickle.UnpicklingError):
        torch.load(path / "optimizer.pt", weights_only=False)
    assert not marker.exists()
    torch.load(path / "optimizer.pt", weights_only=False)  # outside: the payload would run
    assert marker.exists()


def test_rng_state_round_trip():
    import random

    state = checkpoint.rng_state()
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    checkpoint.set_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
