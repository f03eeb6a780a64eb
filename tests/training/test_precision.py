"""The recipes' precision rule: the model's weights are fp32 whatever its config.json or checkpoint says
(``"torch_dtype": "bfloat16"``, as Llama-3 configs have), so mixed precision computes in fp16 or bf16 with fp32 master
weights; bf16 mixed precision on a GPU without bfloat16 (V100, sm_70) is refused at start, naming the option."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from volta_train.training import config, distributed, optim
from checkout import ROOT


def _bf16_config(directory: Path) -> Path:
    """tiny_llama's config.json saying torch_dtype bfloat16, in a directory of its own."""
    values = json.loads((ROOT / "configs/finetune/models/tiny_llama/config.json").read_text())
    values["torch_dtype"] = "bfloat16"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(values))
    return directory


def _recorded_dtypes(monkeypatch) -> list[set]:
    """The dtypes of the parameters the optimizer is built over, per optimizer built."""
    seen, groups = [], optim.param_groups

    def recorded(model, weight_decay):
        seen.append({str(p.dtype) for p in model.parameters()})
        return groups(model, weight_decay)

    monkeypatch.setattr(optim, "param_groups", recorded)
    return seen


def _saved_dtypes(final: Path) -> set:
    from safetensors import safe_open

    with safe_open(str(final / "model.safetensors"), "pt") as f:
        return {str(f.get_tensor(k).dtype) for k in f.keys()}


@pytest.mark.parametrize("mixed_precision", ["fp16", "no"])
def test_a_bfloat16_model_config_trains_with_fp32_master_weights_in_gpt_long(tmp_path, fresh_state, monkeypatch,
                                                                              mixed_precision):
    from volta_train.recipes import gpt_long

    seen = _recorded_dtypes(monkeypatch)
    out = tmp_path / "out"
    summary = gpt_long.main([
        "--cpu", "--model-config", str(_bf16_config(tmp_path / "model")), "--seq-len", "64", "--batch-size", "2",
        "--steps", "2", "--warmup-steps", "0", "--synthetic-mb", "0.02", "--eval-batches", "0", "--no-progress",
        "--checkpoint-interval", "0", "--mixed-precision", mixed_precision, "--out-dir", str(out), "--cache-dir",
        str(tmp_path / "cache"), "--cpu-threads", "1", "--seed", str(int(torch.randint(1 << 16, ())))])
    assert seen == [{"torch.float32"}]
    assert summary["completed"] and summary["steps"] == 2
    assert _saved_dtypes(out / "final") == {"torch.float32"}


def test_a_bfloat16_model_config_trains_with_fp32_master_weights_in_finetune(tmp_path, fresh_state, monkeypatch):
    from volta_train.recipes import finetune

    seen = _recorded_dtypes(monkeypatch)
    monkeypatch.chdir(ROOT)
    out = tmp_path / "out"
    summary = finetune.main([
        "--config", "configs/finetune/llama_text_packed.yaml", "--model.config", str(_bf16_config(tmp_path / "m")),
        "--train.cpu", "--train.steps", "2", "--train.batch-size", "2", "--data.max-length", "64",
        "--train.mixed-precision", "fp16", "--train.cpu-threads", "1", "--checkpoint.interval", "0",
        "--eval.batches", "1", "--logging.out-dir", str(out), "--data.cache-dir", str(tmp_path / "cache")])
    assert seen == [{"torch.float32"}]
    assert summary["completed"]
    assert _saved_dtypes(out / "final") == {"torch.float32"}


def test_bf16_mixed_precision_on_a_gpu_without_bf16_is_refused_naming_the_option(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-32GB")
    gpu = torch.device("cuda", 0)
    for option in ("mixed_precision", "train.mixed_precision"):
        with pytest.raises(config.ConfigError) as info:
            distributed.check_mixed_precision("bf16", gpu, option)
        message = str(info.value)
        assert message.startswith(f"{option} bf16: Tesla V100-SXM2-32GB (sm_70) has no bfloat16")
        assert "fp16" in message and "no (fp32)" in message
    for accepted in ("fp16", "no"):
        distributed.check_mixed_precision(accepted, gpu, "mixed_precision")
    distributed.check_mixed_precision("bf16", torch.device("cpu"), "mixed_precision")  # CPU autocast has bf16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    distributed.check_mixed_precision("bf16", gpu, "mixed_precision")
