"""Both recipes set PyTorch's CUDA allocator to expandable segments before anything can initialise CUDA (at long
lengths fixed segments fragment: a step ran out of memory with 3.7 GiB reserved but unallocated), and keep a
PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF the user set."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from volta_train.training import distributed
from checkout import ROOT


@pytest.fixture
def no_alloc_conf(monkeypatch, fresh_state):
    """Neither variable set; whatever a test sets is removed afterwards."""
    for name in distributed.ALLOC_CONF_NAMES:
        monkeypatch.setenv(name, "placeholder")  # records the original state, restored after the test
        monkeypatch.delenv(name)
    return monkeypatch


def _run(recipe: str, tmp_path: Path, monkeypatch) -> list[dict]:
    """The allocator variables as the recipe's process state is started (its first possible CUDA use)."""
    import os

    from volta_train.recipes import finetune, gpt_long

    seen, init_state = [], distributed.init_state

    def recorded(*args, **kwargs):
        seen.append({name: os.environ.get(name) for name in distributed.ALLOC_CONF_NAMES})
        return init_state(*args, **kwargs)

    monkeypatch.setattr(distributed, "init_state", recorded)
    out = tmp_path / recipe
    if recipe == "gpt_long":
        gpt_long.main(["--cpu", "--model", "nano", "--seq-len", "32", "--batch-size", "2", "--steps", "1",
                       "--synthetic-mb", "0.02", "--eval-batches", "0", "--no-progress", "--no-save",
                       "--checkpoint-interval", "0", "--out-dir", str(out), "--cache-dir", str(tmp_path / "cache")])
    else:
        monkeypatch.chdir(ROOT)
        finetune.main(["--config", "configs/finetune/llama_text_packed.yaml", "--train.cpu", "--train.steps", "1",
                       "--train.batch-size", "2", "--data.max-length", "64", "--checkpoint.interval", "0",
                       "--eval.batches", "1", "--logging.out-dir", str(out), "--data.cache-dir",
                       str(tmp_path / "cache")])
    return seen


@pytest.mark.parametrize("recipe", ["gpt_long", "finetune"])
def test_the_recipes_set_expandable_segments_before_cuda_and_keep_the_users(tmp_path, no_alloc_conf, recipe):
    monkeypatch = no_alloc_conf
    assert _run(recipe, tmp_path / "unset", monkeypatch) == [
        {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "PYTORCH_ALLOC_CONF": None}]
    for name in distributed.ALLOC_CONF_NAMES:
        mine = f"max_split_size_mb:{int(torch.randint(64, 512, ()))}"
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
        monkeypatch.setenv(name, mine)
        seen = _run(recipe, tmp_path / name, monkeypatch)
        assert seen == [{n: (mine if n == name else None) for n in distributed.ALLOC_CONF_NAMES}]
        monkeypatch.delenv(name)


def test_where_cuda_is_already_up_the_setting_goes_to_the_allocator(no_alloc_conf):
    monkeypatch, applied = no_alloc_conf, []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", applied.append)
    note = distributed.cuda_allocator_env()
    assert applied == ["expandable_segments:True"] and "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in note
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert distributed.cuda_allocator_env() == ("CUDA allocator: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False "
                                                "(your setting, kept)")
    assert applied == ["expandable_segments:True"]
