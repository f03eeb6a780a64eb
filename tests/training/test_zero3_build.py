"""The recipes under ZeRO-3 build their model partitioned (``distributed.partitioned_build``): two gloo processes, each
holding half of every parameter and no whole one from the build on; from the same saved weights the loss trajectory
is that of the unpartitioned build (the model built whole, partitioned at prepare()), and the weight-decay groups are
the same. (Random initial weights differ between the two builds by construction: under ``zero.Init`` transformers
skips PyTorch's default initialisation and process 0 alone draws its own, so the generator advances differently.)"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from child_process import launch_env, run_retrying_gloo_abort, stderr_tail

from volta_train.training import logs
from checkout import ROOT, checkout_env

pytestmark = pytest.mark.launches_processes  # every test here runs two processes through accelerate launch


def _check(partitioned, seen, whole, seen_whole, steps: int):
    full = seen_whole[0]["full"]
    assert full == seen_whole[0]["held"] > 0 and not seen_whole[0]["ds_id"]
    for rank in seen:  # every parameter partitioned at its creation: none whole in any process after the build
        assert rank["ds_id"] and rank["held"] == 0 and rank["full"] == full
        assert full / 2 <= rank["partition"] <= full / 2 + 64, (rank["partition"], full)
    assert seen[0]["decay"] == seen_whole[0]["decay"] and seen[0]["no_decay"] == seen_whole[0]["no_decay"]
    assert any(n.endswith(".bias") or "norm" in n for n in seen[0]["no_decay"]) and seen[0]["decay"]
    assert len(partitioned) == len(whole) == steps
    assert all(math.isclose(a, b, rel_tol=0, abs_tol=1e-6) for a, b in zip(partitioned, whole)), (partitioned, whole)
    assert partitioned[-1] < partitioned[0]


def _saved_model(directory: Path) -> Path:
    """A tiny GPT-2 with random weights, as a pretrained directory (what --model-path loads)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(1234)
    config = GPT2Config(vocab_size=263, n_positions=96, n_embd=48, n_layer=3, n_head=3, resid_pdrop=0.1,
                        embd_pdrop=0.1, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(directory)
    return directory


def _launch(tmp_path: Path, out: Path, *args: str) -> tuple[list[float], list[dict]]:
    env = checkout_env(ROOT / "tests" / "support", env=launch_env())
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "configs/accelerate/zero3.yaml"), "--num_processes", "2",
           str(ROOT / "tests/support/zero3_build_child.py"), *args]
    proc = run_retrying_gloo_abort(lambda: subprocess.run(cmd, cwd=tmp_path, env=env,
                                                          capture_output=True, text=True, timeout=300))
    assert proc.returncode == 0, stderr_tail(proc.stderr)
    losses = [float(r["loss"]) for r in logs.read_csv(out / "train.csv")]
    return losses, [json.loads((out / f"build-rank{r}.json").read_text()) for r in (0, 1)]


def _gpt_long(tmp_path: Path, name: str, model: Path, *extra: str) -> tuple[list[float], list[dict]]:
    out = tmp_path / name
    return _launch(tmp_path, out, "gpt_long", "--cpu", "--model-path", str(model), "--seq-len", "96", "--batch-size",
                   "3", "--steps", "4", "--lr", "3e-3", "--warmup-steps", "1", "--log-interval", "1", "--eval-batches",
                   "0", "--checkpoint-interval", "0", "--synthetic-mb", "0.05", "--mixed-precision", "no", "--out-dir",
                   str(out), "--cache-dir", str(tmp_path / "cache"), "--no-progress", "--no-save", "--cpu-threads", "1",
                   *extra)


@pytest.mark.slow
def test_gpt_long_zero3_builds_partitioned_and_trains_as_the_whole_build(tmp_path):
    model = _saved_model(tmp_path / "model")
    partitioned, seen = _gpt_long(tmp_path, "partitioned", model)
    whole, seen_whole = _gpt_long(tmp_path, "whole", model, "--unpartitioned")
    _check(partitioned, seen, whole, seen_whole, 4)


@pytest.mark.slow
def test_gpt_long_zero3_random_weights_partitioned(tmp_path):
    """cpu_tiny's GPT-2 from its config: initialised on gathered copies (the first loss near ln(vocabulary), as the
    N(0, 0.02) weights give), and every process's generator left where process 0's is, as after a whole build."""
    cpu_tiny = str(ROOT / "configs/gpt_long/cpu_tiny.yaml")
    losses, seen = _launch(tmp_path, tmp_path / "random", "gpt_long", "--config", cpu_tiny,
                           "--steps", "2", "--log-interval", "1", "--eval-batches", "0", "--checkpoint-interval", "0",
                           "--synthetic-mb", "0.05", "--out-dir", str(tmp_path / "random"), "--cache-dir",
                           str(tmp_path / "cache"), "--no-progress", "--no-save", "--cpu-threads", "1")
    assert all(rank["ds_id"] and rank["held"] == 0 for rank in seen)
    assert seen[0]["rng"] == seen[1]["rng"]
    assert abs(losses[0] - math.log(seen[0]["vocab"])) < 0.1, (losses, seen[0]["vocab"])


def _finetune(tmp_path: Path, name: str, model: Path, *extra: str) -> tuple[list[float], list[dict]]:
    out = tmp_path / name
    return _launch(tmp_path, out, "finetune", "--config", str(ROOT / "configs/finetune/llama_text_packed.yaml"),
                   "--model.path", str(model), "--train.deepspeed", "zero3", "--train.steps", "3",
                   "--train.batch-size", "2", "--data.max-length", "96", "--train.mixed-precision", "no",
                   "--train.cpu-threads", "1", "--logging.log-interval", "1", "--checkpoint.interval", "0",
                   "--logging.out-dir", str(out), *extra)


@pytest.mark.slow
def test_finetune_zero3_builds_partitioned_and_trains_as_the_whole_build(tmp_path):
    """finetune.py, a Llama with a padding token, packed documents (the packing check runs on the partitioned model)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(4321)
    config = AutoConfig.from_pretrained(ROOT / "configs/finetune/models/tiny_llama")
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    partitioned, seen = _finetune(tmp_path, "partitioned", tmp_path / "model")
    whole, seen_whole = _finetune(tmp_path, "whole", tmp_path / "model", "--unpartitioned")
    _check(partitioned, seen, whole, seen_whole, 3)


@pytest.mark.slow
@pytest.mark.parametrize("model", [["--arch", "llama", "--n-kv-head", "2"], ["--arch", "gpt2", "--no-patch"]],
                         ids=["llama-volta", "gpt2-sdpa"])
def test_packed_document_decision_under_zero3_is_the_whole_builds(tmp_path, model):
    """gpt_long's packing decision on the ZeRO-3 build equals the whole build's, in fp16 and fp32, and its check computes
    in fp32 even where ZeRO-3 stores the weights in fp16 (fp16 rounding decided it on a GPU: "the second document's
    logits differ by 0.0083"); the chunked loss names the real vocabulary, not the partitioned head's empty shape."""
    env = checkout_env(ROOT / "tests" / "support", env=launch_env())
    out = tmp_path / "decisions.json"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "configs/accelerate/zero3.yaml"), "--num_processes", "2",
           str(ROOT / "tests/support/zero3_packing_child.py"), str(out), "--cpu", "--n-layer", "2", "--n-head", "4",
           "--n-embd", "64", "--seq-len", "64", "--seed", str(int.from_bytes(os.urandom(2), "little")),
           "--out-dir", str(tmp_path / "run"), *model]
    proc = run_retrying_gloo_abort(lambda: subprocess.run(cmd, cwd=tmp_path, env=env,
                                                          capture_output=True, text=True, timeout=300))
    assert proc.returncode == 0, stderr_tail(proc.stderr)
    seen = json.loads(out.read_text())
    assert seen["fp16 zero3"]["partitioned"] and seen["fp16 zero3"]["weights"] == "torch.float16", seen
    assert not seen["fp16 whole"]["partitioned"] and seen["no whole"]["weights"] == "torch.float32", seen
    for precision in ("fp16", "no"):
        zero3, whole = seen[f"{precision} zero3"], seen[f"{precision} whole"]
        assert (zero3["documents"], zero3["note"]) == (whole["documents"], whole["note"]), seen
        assert zero3["documents"], seen
        assert zero3["logits"] == whole["logits"] == ["torch.float32"], seen
        assert zero3["loss"] == whole["loss"] and f" x {zero3['vocab']:,} words" in zero3["loss"], seen
