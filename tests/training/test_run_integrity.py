"""Nothing lost, nothing misreported (issue 27): the final model and summary.json, resumes that would mix runs or
trajectories, the exit status of a stopped run, the token cache, text that cannot be encoded, and start-up failures.

The recipes run in-process on the "nano" GPT-2 (2 layers, 64 wide) for a few steps; the kill test runs one in a child
process and sends it a real SIGKILL.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from volta_train.training import checkpoint, data, fsio
from volta_train.training import examples
from volta_train.training import finetune_config as ft
from volta_train.training.trainer import (
    STOPPED_EXIT, RunStateError, Trainer, finished_run_problems, run_or_fail,
)
from tiny_trainer import make_setup, make_trainer
from checkout import ROOT, checkout_env
from tiny_recipe import gpt_args, run_gpt


def _gpt_error(tmp_path: Path, out: Path, *extra: str) -> str:
    with pytest.raises(SystemExit) as info:
        run_gpt(tmp_path, out, *extra)
    assert isinstance(info.value.code, str), info.value.code
    return info.value.code


def _log(out: Path) -> str:
    return (out / "train.log").read_text(encoding="utf-8")


def _loads(final: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(final)
    assert torch.isfinite(model(input_ids=torch.tensor([[1, 2, 3]])).logits).all()


def _final_save_fails(monkeypatch, action) -> None:
    """``action(filename)`` runs where transformers writes the final model's weights (checkpoints write theirs)."""
    import transformers.modeling_utils as mu

    real = mu.safe_save_file

    def save(tensors, filename, *args, **kwargs):
        if ".tmp-final" in str(filename):
            Path(filename).write_bytes(b"\0" * 1000)  # part of the file made it to disk
            action(filename)
        return real(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(mu, "safe_save_file", save)


# ------------------------------------------------------------------------------------------------
# 1. the final model: atomic, its write errors inside the recipe's error handling, a finished run verified
# ------------------------------------------------------------------------------------------------


def test_disk_full_while_saving_the_final_model_then_the_rerun_finishes_it(tmp_path, fresh_state, monkeypatch):
    out = tmp_path / "out"

    def enospc(filename):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(filename))

    _final_save_fails(monkeypatch, enospc)
    message = _gpt_error(tmp_path, out)
    assert re.fullmatch(rf"gpt_long.py: error: cannot write the model {re.escape(str(out / 'final'))}: OSError: "
                        r"\[Errno 28\] No space left on device.* \(\S+ \S+ free on its filesystem\)", message), message
    assert not (out / "final").exists() and not (out / ".tmp-final").exists()
    assert not (out / "summary.json").exists()
    monkeypatch.undo()

    summary = run_gpt(tmp_path, out)  # space freed: the rerun writes both from the step-4 checkpoint
    assert summary["completed"] and summary["steps"] == 4 and summary["checkpoint"] == str(out / "final")
    assert "the checkpoint is at the last step (4) but the run was not finished" in _log(out)
    assert json.loads((out / "summary.json").read_text())["completed"] is True
    assert checkpoint.verify_model(out / "final") == []
    _loads(out / "final")
    again = run_gpt(tmp_path, out)
    assert "already holds the finished run (step 4)" in _log(out) and again == summary


def test_sigkill_during_the_final_save_then_the_rerun_finishes_it(tmp_path, fresh_state):
    out = tmp_path / "out"
    code = (
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "import transformers.modeling_utils as mu\n"
        "real = mu.safe_save_file\n"
        "def save(tensors, filename, *a, **k):\n"
        "    if '.tmp-final' in str(filename):\n"
        "        Path(filename).write_bytes(b'x' * 1000)\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return real(tensors, filename, *a, **k)\n"
        "mu.safe_save_file = save\n"
        "from volta_train.recipes import gpt_long\n"
        "gpt_long.main(sys.argv[1:])\n"
    )
    child = subprocess.run([sys.executable, "-c", code, *gpt_args(tmp_path, out)], capture_output=True, text=True,
                           timeout=300, env=checkout_env(), cwd=tmp_path)
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
    assert (out / ".tmp-final").is_dir() and not (out / "final").exists() and not (out / "summary.json").exists()

    summary = run_gpt(tmp_path, out)
    assert summary["completed"] and "but the run was not finished" in _log(out)
    assert checkpoint.verify_model(out / "final") == [] and not (out / ".tmp-final").exists()
    _loads(out / "final")


def test_a_final_model_without_its_manifest_or_with_a_damaged_file_is_not_finished(tmp_path):
    final = tmp_path / "final"
    final.mkdir()
    (final / "config.json").write_text("{}")
    assert finished_run_problems(tmp_path, 4, final_expected=True) == [f"{tmp_path / 'summary.json'}: missing"]
    (tmp_path / "summary.json").write_text(json.dumps({"completed": True, "steps": 4}))
    assert finished_run_problems(tmp_path, 4, final_expected=True) == [
        f"{final / checkpoint.MANIFEST}: missing (the save did not finish)"]
    assert finished_run_problems(tmp_path, 4, final_expected=False) == []
    assert "not a completed run of 6 steps" in finished_run_problems(tmp_path, 6, final_expected=False)[0]


def _strict(text: str):
    """json.loads that refuses NaN and Infinity (not JSON; Python's json writes and reads them by default)."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_summary_json_is_strict_json_without_validation(tmp_path, fresh_state):
    """--eval-batches 0 measures no validation loss: summary.json (and final/run.json) say null, not NaN."""
    out = tmp_path / "out"
    summary = run_gpt(tmp_path, out, "--eval-batches", "0", "--seed", str(int(torch.randint(1 << 16, ()))))
    written = _strict((out / "summary.json").read_text(encoding="utf-8"))
    assert written["val_loss"] is None and summary["val_loss"] is None
    assert written["completed"] and written["steps"] == 4 and written["train_loss"] > 0
    assert _strict((out / "final" / "run.json").read_text(encoding="utf-8"))["val_loss"] is None
    assert "val loss n/a" in _log(out)


def test_strict_json_writes_null_for_non_finite_numbers():
    values = torch.randn(3).tolist()
    record = {"a": float("nan"), "b": [values[0], float("inf"), {"c": -float("inf")}], "d": values[1], "e": None}
    assert _strict(fsio.strict_json(record)) == {"a": None, "b": [values[0], None, {"c": None}], "d": values[1],
                                                  "e": None}


# ------------------------------------------------------------------------------------------------
# 2, 3. resumes that would misreport or mix runs; settings recorded with each checkpoint
# ------------------------------------------------------------------------------------------------


def _trainer(out: Path, steps: int, interval: int, resume: str = "auto", keep: int = 5, settings=None,
             fixed=(), renamed=None) -> Trainer:
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    return make_trainer(out, make_setup(), steps, interval, keep, resume=resume, settings=settings, fixed=fixed,
                        renamed=renamed)


def _steps(root: Path) -> list[int]:
    return [step for step, _ in checkpoint.complete_checkpoints(root)]


def test_fewer_steps_than_the_checkpoint_is_an_error_naming_both(tmp_path, fresh_state):
    out = tmp_path / "out"
    _trainer(out, steps=6, interval=3).run()
    (out / "checkpoints" / "step-00000006").rename(out / "checkpoints" / "gone")  # killed after step 3's checkpoint
    with pytest.raises(RunStateError) as err:
        _trainer(out, steps=2, interval=3).run()
    assert str(err.value) == (f"{out / 'checkpoints' / 'step-00000003'} is at step 3, past the 2 steps this run plans "
                              "(--steps 2): pass --steps 6 to finish that run (the steps it was planned for), or start "
                              "over with --resume never (or another out_dir)")
    with pytest.raises(SystemExit, match=r"^recipe: error: .* is at step 3, past the 2 steps"):
        run_or_fail(_trainer(out, steps=2, interval=3), lambda m: sys.exit(f"recipe: error: {m}"))
    assert not (out / "summary.json").exists()


def test_resume_never_sets_the_earlier_run_aside_and_never_mixes_runs(tmp_path, fresh_state, caplog):
    out = tmp_path / "out"
    _trainer(out, steps=6, interval=3).run()
    (out / "summary.json").write_text("{}")
    assert _steps(out / "checkpoints") == [3, 6]
    caplog.set_level(logging.WARNING)
    _trainer(out, steps=4, interval=2, resume="never").run()  # the new run (imagine it died after step 4)
    previous = out / "previous-run-1"
    assert "held an earlier run (step-00000003, step-00000006); moved checkpoints, summary.json, train.csv" in (
        caplog.text) and str(previous) in caplog.text
    assert _steps(previous / "checkpoints") == [3, 6] and (previous / "summary.json").is_file()
    assert _steps(out / "checkpoints") == [2, 4]
    resumed = _trainer(out, steps=8, interval=2).run()  # a plain rerun continues the new run, not the old one
    assert resumed["resumed_from"] == str(out / "checkpoints" / "step-00000004")
    from volta_train.training import logs

    assert [int(r["step"]) for r in logs.read_csv(out / "train.csv")] == list(range(1, 9))


def test_settings_are_recorded_and_a_changed_one_warns_or_is_refused(tmp_path, fresh_state, caplog):
    out = tmp_path / "out"
    _trainer(out, steps=2, interval=2, settings={"--lr": 0.001, "--seed": 1, "--n-layer": 2}).run()
    state = json.loads((out / "checkpoints" / "step-00000002" / checkpoint.STATE).read_text())
    assert state["settings"] == {"--lr": 0.001, "--seed": 1, "--n-layer": 2} and state["planned_steps"] == 2
    caplog.set_level(logging.WARNING)
    _trainer(out, steps=3, interval=0, settings={"--lr": 0.002, "--seed": 1, "--n-layer": 2}).run()
    assert re.search(r"resuming \S+step-00000002 with --lr 0.002; the checkpoint was written with 0.001: the run "
                     r"continues on a different trajectory from step 2", caplog.text), caplog.text
    assert "--seed" not in caplog.text
    with pytest.raises(RunStateError, match=r"it was written with --n-layer 2, this run has 3; use 2, or start over "
                                            r"with --resume never"):
        _trainer(out, steps=3, interval=0, settings={"--n-layer": 3}, fixed=("--n-layer",)).run()


def test_a_checkpoint_written_before_an_option_moved_is_compared_under_its_new_name(tmp_path, fresh_state, caplog):
    from volta_train.training import config, gpt

    out = tmp_path / "out"
    renamed = config.renamed_flags(gpt.GPTTrainConfig)
    assert renamed["--tiled-mlp"] == "--memory.tiled-mlp" and renamed["--deepspeed"] == "--parallel.deepspeed"
    old = random.choice(["off", "on"])
    new = "on" if old == "off" else "off"
    _trainer(out, steps=2, interval=2, settings={"--tiled-mlp": old, "--lr": 0.001}).run()
    caplog.set_level(logging.WARNING)
    _trainer(out, steps=3, interval=0, settings={"--memory.tiled-mlp": new, "--lr": 0.001}, renamed=renamed).run()
    assert re.search(rf"resuming \S+step-00000002 with --memory.tiled-mlp '{new}'; the checkpoint was written with "
                     rf"'{old}'", caplog.text), caplog.text
    assert "--lr" not in caplog.text


def test_the_recipe_records_the_learning_rate_and_warns_when_it_changes(tmp_path, fresh_state):
    out = tmp_path / "out"
    run_gpt(tmp_path, out, "--lr", "1e-3", "--steps", "2")
    state = json.loads((out / "checkpoints" / "step-00000002" / checkpoint.STATE).read_text())
    for flag in ("--lr", "--seed", "--n-layer", "--data", "--packing", "--weight-decay", "--min-lr-ratio",
                 "--memory.chunked-loss", "--steps", "--batch-size"):
        assert flag in state["settings"], flag
    assert "--out-dir" not in state["settings"] and "--log-interval" not in state["settings"]
    run_gpt(tmp_path, out, "--lr", "2e-3", "--steps", "3")
    assert "with --lr 0.002; the checkpoint was written with 0.001" in _log(out)
    assert "with --steps 3; the checkpoint was written with 2" in _log(out)
    message = _gpt_error(tmp_path, out, "--n-layer", "3", "--steps", "5")
    assert "it was written with --n-layer 2, this run has 3" in message


# ------------------------------------------------------------------------------------------------
# 4. a stopped run exits non-zero
# ------------------------------------------------------------------------------------------------


def test_a_run_stopped_early_exits_with_the_stopped_status(tmp_path, fresh_state):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as info:
        run_gpt(tmp_path, out, "--steps", "50", "--time-limit-min", "1e-6")
    assert info.value.code == STOPPED_EXIT == 75
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] is False and summary["stopped"].startswith("time limit")
    assert checkpoint.find_latest(out / "checkpoints").name == f"step-{summary['steps']:08d}"


# ------------------------------------------------------------------------------------------------
# 5. the token cache
# ------------------------------------------------------------------------------------------------


def test_a_damaged_token_cache_is_rebuilt_with_a_warning_naming_it(tmp_path, caplog):
    corpus = tmp_path / "c.txt"
    corpus.write_text("some text for the cache " * 200)
    tokens = np.array(data.load_tokens(str(corpus), tmp_path / "cache", data.ByteTokenizer()))
    (path,) = (tmp_path / "cache").glob("*.npy")
    assert data.cache_check_path(path).is_file()
    caplog.set_level(logging.WARNING)
    for damage in ("truncate", "flip", "no check file"):
        if damage == "truncate":
            path.write_bytes(path.read_bytes()[:1000])
        elif damage == "flip":
            raw = bytearray(path.read_bytes())
            raw[-1] ^= 1
            path.write_bytes(bytes(raw))
        else:
            data.cache_check_path(path).unlink()
        caplog.clear()
        again = data.load_tokens(str(corpus), tmp_path / "cache", data.ByteTokenizer())
        assert np.array_equal(np.array(again), tokens), damage
        assert f"token cache {path} is damaged (" in caplog.text and "rebuilding it" in caplog.text, damage
    caplog.clear()
    data.load_tokens(str(corpus), tmp_path / "cache", data.ByteTokenizer())
    assert "damaged" not in caplog.text


@pytest.mark.parametrize("kind", ["tokens", "finetune"])
def test_disk_full_while_writing_a_cache_names_it_and_leaves_no_temporary_file(tmp_path, monkeypatch, kind):
    real_open = open

    class Full:  # the cache file as np.save / np.savez see it: a few bytes land, then the disk is full
        def __init__(self, f):
            self.f, self.written = f, 0

        def write(self, b):
            if self.written > 100:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.written += len(b)
            return self.f.write(b)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def full_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return Full(f) if str(file).endswith(".tmp") and "w" in mode and ".check.json" not in str(file) else f

    monkeypatch.setattr("builtins.open", full_open)
    cache = tmp_path / "cache"
    if kind == "tokens":
        corpus = tmp_path / "c.txt"
        corpus.write_text("text " * 100)
        with pytest.raises(fsio.WriteError) as err:
            data.load_tokens(str(corpus), cache, data.ByteTokenizer())
        pattern = rf"cannot write the token cache {re.escape(str(cache))}/c-\w+\.npy: OSError: \[Errno 28\] No space"
    else:
        train = tmp_path / "t.jsonl"
        train.write_text('{"text": "hello"}\n')
        cfg = ft.FinetuneConfig(data=ft.DataSection(train=str(train), format="text", cache_dir=str(cache)))
        with pytest.raises(fsio.WriteError) as err:
            examples.load_examples(str(train), cfg, data.ByteTokenizer(), [])
        pattern = rf"cannot write the tokenised dataset {re.escape(str(cache))}/finetune-t-\w+\.npz: OSError: "
    monkeypatch.undo()
    assert re.match(pattern + r".* free on its filesystem\)$", str(err.value)), str(err.value)
    assert "\n" not in str(err.value)
    assert sorted(p.name for p in cache.iterdir()) == []  # no .tmp left behind


# ------------------------------------------------------------------------------------------------
# 6. text that cannot be encoded
# ------------------------------------------------------------------------------------------------


def test_a_lone_surrogate_is_named_with_file_and_line_in_both_recipes(tmp_path, fresh_state, monkeypatch):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "fine"}\n{"text": "broken \\ud83d here"}\n', encoding="utf-8")
    expected = (rf"{re.escape(str(corpus))}:2: 'text' holds a lone surrogate \\ud83d at character 8 \(a "
                r"\\uD800-\\uDFFF escape without its pair\)")
    with pytest.raises(ValueError, match=expected):
        data.load_tokens(str(corpus), tmp_path / "cache", data.ByteTokenizer())
    message = _gpt_error(tmp_path, tmp_path / "out", "--data", str(corpus))
    assert re.match(r"gpt_long.py: error: " + expected, message), message

    from accelerate.state import AcceleratorState

    from volta_train.recipes import finetune

    AcceleratorState._reset_state(True)
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as info:
        finetune.main(["--config", "configs/finetune/gpt2_instruct.yaml", "--train.cpu", "--data.train", str(corpus),
                       "--data.format", "text", "--logging.out-dir", str(tmp_path / "ft"), "--data.cache-dir",
                       str(tmp_path / "c2")])
    assert re.match(rf"finetune.py: error: {re.escape(str(corpus))}:2: field 'text' holds a lone surrogate \\ud83d",
                    str(info.value.code)), info.value.code


# ------------------------------------------------------------------------------------------------
# 9. start-up failures leave nothing behind; the command names itself; an out_dir that is a file
# ------------------------------------------------------------------------------------------------


def test_a_run_that_fails_at_start_up_leaves_nothing_behind(tmp_path, fresh_state):
    missing = tmp_path / "no-such-corpus.txt"
    fresh = tmp_path / "new" / "out"
    assert "neither 'synthetic' nor an existing file" in _gpt_error(tmp_path, fresh, "--data", str(missing))
    assert not (tmp_path / "new").exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "notes.txt").write_text("mine")
    _gpt_error(tmp_path, existing, "--data", str(missing))
    assert sorted(p.name for p in existing.iterdir()) == ["notes.txt"]


def test_volta_train_train_names_itself_and_an_out_dir_that_is_a_file(tmp_path, fresh_state, monkeypatch):
    from volta_train import cli

    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the command sets its own
    a_file = tmp_path / "out"
    a_file.write_text("not a directory")
    with pytest.raises(SystemExit) as info:
        cli.main(["train", *gpt_args(tmp_path, a_file)])
    assert info.value.code == (f"volta-train train: error: out_dir {str(a_file)!r} is a file, not a directory: pick "
                               "another out_dir or move the file away")
    with pytest.raises(SystemExit) as info:
        cli.main(["train", *gpt_args(tmp_path, a_file / "sub")])
    assert f"is inside {str(a_file)!r}, which is a file" in info.value.code
    assert a_file.read_text() == "not a directory"
