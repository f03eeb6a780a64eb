"""Training runs that never silently go wrong (issue 14): non-finite values, concurrent runs on one out_dir,
checkpoint integrity on resume, option ranges, data validation, and write errors that name the file.

Almost everything runs in-process on a 2-layer, 64-wide GPT-2 ("nano") for a handful of steps; the few
subprocess tests (``@pytest.mark.slow``) run the recipes as a user does.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from volta_train.training import checkpoint, config, data, distributed, fsio, gpt, logs, runlock
from volta_train.training import examples
from volta_train.training import finetune_config as ft
from volta_train.training.trainer import TrainingFailed, end_training
from tiny_trainer import make_setup, make_trainer
from checkout import ROOT, checkout_env

GPT_RECIPE = ROOT / "recipes" / "gpt_long.py"
FT_RECIPE = ROOT / "recipes" / "finetune.py"


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_setup = make_setup


def _trainer(out: Path, setup, steps=6, interval=1, keep=2, loss_fn=None, resume="auto", **loop_kwargs):
    return make_trainer(out, setup, steps, interval, keep, loss_fn, resume, **loop_kwargs)


class _StepCounter:
    """A loss function that counts its calls (= steps, with grad_accum 1) and returns NaN on chosen steps."""

    def __init__(self, bad_steps):
        self.bad_steps, self.calls = set(bad_steps), 0

    def __call__(self, model, batch):
        self.calls += 1
        loss = model(**batch).loss
        return loss * math.nan if self.calls in self.bad_steps else loss


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------------------------------------
# 1. non-finite loss, gradient or weights
# ------------------------------------------------------------------------------------------------


def test_nan_loss_stops_before_the_update_and_keeps_the_good_checkpoints(tmp_path, fresh_state):
    out = tmp_path / "out"
    trainer = _trainer(out, _setup(), steps=6, interval=1, keep=2, loss_fn=_StepCounter({4}))
    before = None
    original_save = trainer._save

    def save(step, totals):
        nonlocal before
        original_save(step, totals)
        before = _weights(trainer.model)

    trainer._save = save
    with pytest.raises(TrainingFailed, match=r"non-finite values at step 4 \(loss nan.*stopped at step 3/6 without "
                                             r"saving anything: the last good checkpoint is .*step-00000003"):
        trainer.run()
    root = out / "checkpoints"
    assert [s for s, _ in checkpoint.complete_checkpoints(root)] == [2, 3]
    assert (root / "latest").read_text().strip() == "step-00000003"
    after = _weights(trainer.model)  # the NaN step's gradients were never applied
    assert all(torch.equal(after[k], before[k]) for k in before)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] is False and summary["failed"] is True and summary["steps"] == 3
    assert "non-finite values at step 4" in summary["reason"]
    assert summary["last_checkpoint"].endswith("step-00000003") and summary["train_loss"] is None


def test_infinite_gradient_with_a_finite_loss_stops_the_run(tmp_path, fresh_state):
    trainer = _trainer(tmp_path / "out", _setup(), steps=5, interval=0)
    calls = {"n": 0}
    param = next(trainer.model.parameters())

    def hook(grad):
        calls["n"] += 1
        return grad * math.inf if calls["n"] == 2 else grad

    param.register_hook(hook)
    with pytest.raises(TrainingFailed, match=r"non-finite values at step 2 \(loss [0-9.]+, gradient norm inf\)"):
        trainer.run()
    assert torch.isfinite(param).all()
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_weights_that_turn_non_finite_are_never_checkpointed(tmp_path, fresh_state):
    out = tmp_path / "out"
    trainer = _trainer(out, _setup(), steps=6, interval=2, keep=5)
    inner = trainer.optimizer.optimizer
    count = {"n": 0}

    def poison(opt, args, kwargs):  # step 3's update writes a NaN into one weight (the loss of step 3 is fine)
        count["n"] += 1
        if count["n"] == 3:
            with torch.no_grad():
                opt.param_groups[0]["params"][0].view(-1)[0] = math.nan

    inner.register_step_post_hook(poison)
    with pytest.raises(TrainingFailed):
        trainer.run()  # step 4 sees a NaN loss; without it the check before saving step 4 would fire
    assert [s for s, _ in checkpoint.complete_checkpoints(out / "checkpoints")] == [2]

    # the same poison on the last step: caught by the check at the end, so no final model is written
    out2 = tmp_path / "out2"
    trainer = _trainer(out2, _setup(), steps=3, interval=0)
    count["n"] = 0
    trainer.optimizer.optimizer.register_step_post_hook(poison)
    with pytest.raises(TrainingFailed, match=r"the weights became non-finite in step 3's optimizer update"):
        trainer.run()
    assert json.loads((out2 / "summary.json").read_text())["completed"] is False


def test_fp16_skips_are_bounded(tmp_path, fresh_state):
    """With a dynamic loss scaler, isolated overflow steps are skipped and training goes on; a run of
    max_consecutive_skips of them stops the run."""
    setup = _setup("fp16")
    assert setup.accelerator.scaler is not None
    trainer = _trainer(tmp_path / "ok", setup, steps=6, interval=0, loss_fn=_StepCounter({2, 4}),
                       max_consecutive_skips=2)
    summary = trainer.run()
    assert summary["completed"] and summary["skipped_steps"] == 2

    trainer = _trainer(tmp_path / "bad", _setup("fp16"), steps=10, interval=0, loss_fn=_StepCounter(range(3, 11)),
                       max_consecutive_skips=3)
    with pytest.raises(TrainingFailed, match=r"3 optimizer steps in a row \(to step 5\) were skipped for non-finite "
                                             r"fp16 gradients \(max_consecutive_skips 3; loss scale now \d+"):
        trainer.run()
    summary = json.loads((tmp_path / "bad" / "summary.json").read_text())
    assert summary["completed"] is False and summary["steps"] == 4


@pytest.mark.slow
def test_recipe_exits_non_zero_on_divergence(tmp_path):
    """`gpt_long.py --lr 1e30` (a legal value) diverges at step 2: exit 1, summary says so, no final/."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(GPT_RECIPE), "--cpu", "--model", "nano", "--seq-len", "64", "--steps", "6",
         "--checkpoint-interval", "1", "--lr", "1e30", "--warmup-steps", "0", "--log-interval", "1", "--no-progress",
         "--out-dir", str(out), "--cache-dir", str(tmp_path / "cache"), "--synthetic-mb", "1"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert re.search(r"gpt_long.py: error: non-finite values at step \d", proc.stderr), proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] is False and "non-finite" in summary["reason"]
    assert not (out / "final").exists()
    found = checkpoint.complete_checkpoints(out / "checkpoints")
    assert found and found[-1][0] == summary["steps"]
    for name in ("--lr inf", "--weight-decay nan"):  # the reproductions are now refused up front
        proc = subprocess.run([sys.executable, str(GPT_RECIPE), "--cpu", *name.split(), "--out-dir", str(out)],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert proc.returncode != 0 and "must be a finite number" in proc.stderr


# ------------------------------------------------------------------------------------------------
# 2. one run per out_dir
# ------------------------------------------------------------------------------------------------


def _hold_lock(out: Path) -> subprocess.Popen:
    code = ("import sys, time; from volta_train.training.runlock import RunLock; lock = RunLock(sys.argv[1]).acquire(); "
            "print('locked', flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True,
                            env=checkout_env())
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_second_run_on_a_locked_out_dir_is_refused(tmp_path, fresh_state, capsys):
    out = tmp_path / "out"
    holder = _hold_lock(out)
    try:
        with pytest.raises(runlock.RunLockError) as err:
            runlock.RunLock(out).acquire()
        message = str(err.value)
        assert f"pid {holder.pid} on host {socket.gethostname()}, started " in message and str(out) in message
        started = time.perf_counter()
        with pytest.raises(SystemExit) as info:  # the recipe stops at once, before writing anything
            _load(GPT_RECIPE, "gpt_long_lock").main(["--cpu", "--out-dir", str(out), "--model", "nano"])
        assert time.perf_counter() - started < 30
        assert f"is in use by another run (pid {holder.pid}" in str(info.value.code)
        assert sorted(p.name for p in out.iterdir()) == [runlock.LOCK_FILE]  # no train.log appended to
    finally:
        holder.send_signal(signal.SIGKILL)  # the kernel drops the flock with the process
        holder.wait()
    with runlock.RunLock(out) as lock:
        assert runlock.holder(out)["pid"] == os.getpid() and lock.fd is not None
    runlock.RunLock(out).acquire().release()  # released by the context manager


def test_runlock_held_locks_are_released_however_the_block_ends(tmp_path):
    def free(out):  # another process could take it now
        probe = runlock.RunLock(out)
        try:
            probe.acquire()
        except runlock.RunLockError:
            return False
        probe.release()
        return True

    def run(out, ending):
        with runlock.held_locks() as held:
            held.append(None)  # what acquire_for_run returns on the other processes
            held.append(runlock.RunLock(out).acquire())
            assert not free(out)
            if ending == "exit":
                sys.exit("stopped")
            if ending == "error":
                raise ValueError("failed")
            return held

    out = tmp_path / "out"
    assert run(out, "return")[1].fd is None and free(out)
    with pytest.raises(SystemExit):
        run(out, "exit")
    assert free(out)
    with pytest.raises(ValueError):
        run(out, "error")
    assert free(out)


def _lock_worker(rank: int, out: str, port: int, results, released):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        for attempt in ("held", "free"):  # first while the test holds the lock, then after it let go
            if attempt == "free":
                released.wait(60)
            try:
                lock = runlock.acquire_for_run(out, rank == 0, 2, "cpu")
                results.put((attempt, rank, "acquired" if (lock is not None) == (rank == 0) else "wrong holder"))
            except runlock.RunLockError as e:
                results.put((attempt, rank, str(e)))
    finally:
        dist.destroy_process_group()


@pytest.mark.launches_processes  # a gloo group of its own
def test_lock_is_taken_by_the_main_process_only_and_all_stop_together(tmp_path):
    import torch.multiprocessing as mp

    out = tmp_path / "out"
    ctx = mp.get_context("spawn")
    lock = runlock.RunLock(out).acquire()
    results, released = ctx.Queue(), ctx.Event()
    port = distributed._free_port()
    procs = [ctx.Process(target=_lock_worker, args=(r, str(out), port, results, released)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    for _ in range(2):
        attempt, rank, outcome = results.get(timeout=120)  # neither process waits on the lock
        got[attempt, rank] = outcome
    assert "in use by another run" in got["held", 0] and "the main process could not lock" in got["held", 1]
    lock.release()
    released.set()
    for _ in range(2):
        attempt, rank, outcome = results.get(timeout=60)
        got[attempt, rank] = outcome
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert got["free", 0] == got["free", 1] == "acquired"


# ------------------------------------------------------------------------------------------------
# 3. checkpoint manifest, verification and fallback
# ------------------------------------------------------------------------------------------------


_TEMPLATE: list[Path] = []


def _two_checkpoints(tmp_path):
    """Checkpoints of steps 2 and 4 of a 4-step run (trained once per session, copied); returns (out_dir, root)."""
    import shutil

    if not _TEMPLATE:
        template = tmp_path / "template"
        _trainer(template, _setup(), steps=4, interval=2, keep=3).run()
        _TEMPLATE.append(template)
    out = tmp_path / "out"
    shutil.copytree(_TEMPLATE[0], out)
    return out, out / "checkpoints"


def _zero_safetensors_data(f: Path) -> None:
    raw = bytearray(f.read_bytes())
    header = 8 + struct.unpack("<Q", raw[:8])[0]
    raw[header:] = bytes(len(raw) - header)
    f.write_bytes(bytes(raw))


def _truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


CORRUPTIONS = {
    "zeroed weights, header intact": ("model/model.safetensors", _zero_safetensors_data, "contents differ"),
    "truncated weights": ("model/model.safetensors", _truncate, "truncated or overwritten"),
    "0-byte optimizer.pt": ("optimizer.pt", lambda f: f.write_bytes(b""), "0 bytes, the manifest says"),
    "truncated trainer_state.json": ("trainer_state.json", _truncate, "trainer_state.json: unreadable"),
    "half-written rng file": ("rng-rank0000.pt", _truncate, "truncated or overwritten"),
    "missing rng file": ("rng-rank0000.pt", lambda f: f.unlink(), "rng-rank0000.pt: missing"),
}


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_corrupt_latest_checkpoint_falls_back_with_a_warning(tmp_path, fresh_state, caplog, name):
    out, root = _two_checkpoints(tmp_path)
    manifest = json.loads((root / "step-00000004" / checkpoint.MANIFEST).read_text())
    assert {"model/model.safetensors", "optimizer.pt", "rng-rank0000.pt", "trainer_state.json"} <= set(
        manifest["files"])
    rel, corrupt, problem = CORRUPTIONS[name]
    corrupt(root / "step-00000004" / rel)
    assert checkpoint.verify_checkpoint(root / "step-00000002") == ([], [])
    problems, _ = checkpoint.verify_checkpoint(root / "step-00000004")
    assert any(rel in p and problem in p for p in problems), problems

    caplog.set_level("WARNING")
    trainer = _trainer(out, _setup(), steps=5, interval=0)
    summary = trainer.run()
    assert summary["resumed_from"] == str(root / "step-00000002") and summary["start_step"] == 2
    warning = next(r.getMessage() for r in caplog.records if "cannot be resumed from" in r.getMessage())
    assert str(root / "step-00000004" / rel) in warning and problem in warning and "older step-00000002" in warning
    assert (root / "step-00000004.corrupt").is_dir() and not (root / "step-00000004").exists()


def test_no_valid_checkpoint_is_an_error_not_a_fresh_start(tmp_path, fresh_state):
    out, root = _two_checkpoints(tmp_path)
    _zero_safetensors_data(root / "step-00000004" / "model" / "model.safetensors")
    (root / "step-00000002" / "optimizer.pt").write_bytes(b"")
    trainer = _trainer(out, _setup(), steps=5, interval=0)
    with pytest.raises(checkpoint.CheckpointError) as err:
        trainer.run()
    message = str(err.value)
    assert "step-00000004: " in message and "model.safetensors: contents differ" in message
    assert "step-00000002: " in message and "optimizer.pt: 0 bytes" in message and "resume to never" in message
    assert (root / "step-00000004").is_dir() and (root / "step-00000002").is_dir()  # nothing renamed
    # an explicit path to a corrupt checkpoint: an error, no fallback
    with pytest.raises(checkpoint.CheckpointError, match="optimizer.pt: 0 bytes"):
        _trainer(out, _setup(), steps=5, interval=0, resume=str(root / "step-00000002")).run()
    assert _trainer(out, _setup(), steps=3, interval=0, resume="never").run()["completed"]  # the explicit choice


def test_missing_rng_file_needs_an_explicit_choice(tmp_path, fresh_state, caplog):
    out, root = _two_checkpoints(tmp_path)
    for step in (2, 4):
        (root / f"step-0000000{step}" / "rng-rank0000.pt").unlink()
    with pytest.raises(checkpoint.CheckpointError, match="rng-rank0000.pt: missing"):
        _trainer(out, _setup(), steps=5, interval=0).run()
    with pytest.raises(checkpoint.CheckpointError, match=r"rng-rank0000.pt \(process 0's random-generator state\) "
                                                         r"is missing.*resume_without_rng"):
        setup = _setup()
        trainer = _trainer(out, setup, steps=5, interval=0)
        checkpoint.load_checkpoint(setup.accelerator, trainer.model, trainer.optimizer, root / "step-00000004")
    caplog.set_level("WARNING")
    summary = _trainer(out, _setup(), steps=5, interval=0, allow_missing_rng=True).run()
    assert summary["start_step"] == 4
    assert any("generators are not restored" in r.getMessage() for r in caplog.records)


def test_checkpoints_without_a_manifest_are_checked_structurally(tmp_path, fresh_state, caplog):
    out, root = _two_checkpoints(tmp_path)
    for step in (2, 4):
        (root / f"step-0000000{step}" / checkpoint.MANIFEST).unlink()
    problems, notes = checkpoint.verify_checkpoint(root / "step-00000004")
    assert problems == [] and "no MANIFEST.json" in notes[0]
    _truncate(root / "step-00000004" / "model" / "model.safetensors")
    caplog.set_level("WARNING")
    assert checkpoint.select_resume(root) == root / "step-00000002"
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "model.safetensors: unreadable" in messages and "contents cannot be verified" in messages


def test_resume_matches_the_uninterrupted_run_after_a_fallback(tmp_path, fresh_state):
    """Zeroed weights in the latest checkpoint (the issue's silent 5.77-vs-3.14 case): the fallback resume
    repeats the uninterrupted trajectory exactly."""
    full = _trainer(tmp_path / "full", _setup(), steps=5, interval=0).run()
    out, root = _two_checkpoints(tmp_path)
    _zero_safetensors_data(root / "step-00000004" / "model" / "model.safetensors")
    resumed = _trainer(out, _setup(), steps=5, interval=0).run()
    assert resumed["start_step"] == 2
    a = [float(r["loss"]) for r in logs.read_csv(tmp_path / "full" / "train.csv")]
    b = [float(r["loss"]) for r in logs.read_csv(out / "train.csv")]
    assert a == b and full["train_loss"] == resumed["train_loss"]


# ------------------------------------------------------------------------------------------------
# 5. every optimizer and schedule option validated
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag, value, message", [
    ("--lr", "inf", "lr must be a finite number > 0, got inf"),
    ("--lr", "nan", "lr must be a finite number > 0, got nan"),
    ("--lr=-1e-3", None, "lr must be a finite number > 0, got -0.001"),
    ("--weight-decay", "nan", "weight_decay must be a finite number >= 0, got nan"),
    ("--beta1", "1.5", "beta1 must be a finite number in [0, 1), got 1.5"),
    ("--beta2", "-0.1", "beta2 must be a finite number in [0, 1), got -0.1"),
    ("--beta2", "1", "beta2 must be a finite number in [0, 1), got 1.0"),
    ("--grad-clip", "nan", "grad_clip must be a finite number >= 0, got nan; 0 turns clipping off"),
    ("--grad-clip", "inf", "grad_clip must be a finite number >= 0, got inf"),
    ("--min-lr-ratio", "nan", "min_lr_ratio must lie in [0, 1], got nan"),
    ("--loss-scale-init", "inf", "loss_scale_init must be a finite number > 0, got inf"),
    ("--max-consecutive-skips", "0", "max_consecutive_skips must be an integer >= 1, got 0"),
    ("--time-limit-min", "nan", "time_limit_min must be a finite number >= 0, got nan"),
    ("--rope-theta", "inf", "rope_theta must be a finite number > 0, got inf"),
])
def test_gpt_options_are_range_checked(flag, value, message):
    cfg = config.parse_config(gpt.GPTTrainConfig, ["--cpu", flag] + ([value] if value is not None else []))
    with pytest.raises(config.ConfigError, match=re.escape(message)):
        gpt.resolve(cfg, "cpu")


@pytest.mark.parametrize("flag, value, message", [
    ("--optimizer.lr", "nan", "optimizer.lr must be a finite number > 0, got nan"),
    ("--optimizer.weight-decay", "-0.1", "optimizer.weight_decay must be a finite number >= 0, got -0.1"),
    ("--optimizer.beta1", "1", "optimizer.beta1 must be a finite number in [0, 1), got 1.0"),
    ("--optimizer.eps", "0", "optimizer.eps must be a finite number > 0, got 0.0"),
    ("--optimizer.momentum", "-0.5", "optimizer.momentum must be a finite number in [0, 1), got -0.5"),
    ("--train.grad-clip", "inf", "train.grad_clip must be a finite number >= 0, got inf"),
    ("--schedule.warmup-steps", "-3", "schedule.warmup_steps must be an integer >= 0, got -3"),
    ("--schedule.min-lr-ratio", "nan", "schedule.min_lr_ratio must be a finite number in [0, 1], got nan"),
    ("--train.epochs", "nan", "train.epochs must be a finite number > 0, got nan"),
    ("--train.loss-scale-window", "0", "precision.loss_scale_window must be an integer >= 1, got 0"),
    ("--train.max-consecutive-skips", "0", "precision.max_consecutive_skips must be an integer >= 1, got 0"),
])
def test_finetune_options_are_range_checked(monkeypatch, flag, value, message):
    monkeypatch.chdir(ROOT)
    cfg = config.parse_config(ft.FinetuneConfig, ["--config", "configs/finetune/gpt2_instruct.yaml",
                                                  "--train.steps", "0" if flag == "--train.epochs" else "5", flag, value])
    if flag == "--train.epochs":
        cfg.train.steps = None
    with pytest.raises(config.ConfigError, match=re.escape(message)):
        ft.check(cfg)


def test_recipe_exits_with_the_option_named(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        _load(GPT_RECIPE, "gpt_long_opts").main(["--cpu", "--beta1", "1.5", "--out-dir", str(tmp_path / "o")])
    assert "beta1 must be a finite number in [0, 1), got 1.5" in str(info.value.code)
    assert not (tmp_path / "o").exists()  # refused before anything is written


# ------------------------------------------------------------------------------------------------
# 4, 7. data validation: fine-tuning records, corpus files, tokenizers
# ------------------------------------------------------------------------------------------------


def _ft_cfg(tmp_path, fmt: str, task: str = "causal_lm", **data_kwargs) -> ft.FinetuneConfig:
    cfg = ft.FinetuneConfig(task=task)
    cfg.data.cache_dir = str(tmp_path / "cache")
    cfg.data.format = fmt
    for k, v in data_kwargs.items():
        setattr(cfg.data, k, v)
    return cfg


def _jsonl(tmp_path, lines, name="d.jsonl") -> Path:
    f = tmp_path / name
    f.write_bytes(b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines))
    return f


@pytest.mark.parametrize("fmt, lines, message", [
    ("classification", [{"text": "a", "label": 1}, {"text": "b", "label": "1"}],
     r"labels mix integers and strings: \S+d.jsonl:1 has 1, \S+d.jsonl:2 has '1'"),
    ("classification", [{"text": "a", "label": "neg"}, {"text": "b", "label": "pos"}, {"text": "c", "label": 1}],
     r"labels mix integers and strings: \S+d.jsonl:3 has 1, \S+d.jsonl:1 has 'neg'"),
    ("classification", [{"text": "a", "label": None}], r"d.jsonl:1: label null \(null\); expected a label name"),
    ("classification", [{"text": "a", "label": 1.0}], r"d.jsonl:1: label 1.0 \(float\)"),
    ("classification", [{"text": "a", "label": True}], r"d.jsonl:1: label true \(bool\)"),
    ("classification", [{"text": "a", "label": 0}, {"text": "b", "label": -1}], r"d.jsonl:2: label -1 is negative"),
    ("classification", [{"text": {"a": 1}, "label": "x"}], r"d.jsonl:1: field 'text' is dict \{\"a\": 1\}; expected "
                                                            "a string"),
    ("text", [{"text": "fine"}, {"text": None}], r"d.jsonl:2: field 'text' is null; expected a string"),
    ("text", [{"text": ["a"]}], r"d.jsonl:1: field 'text' is list"),
    ("instruction", [{"instruction": "Say hi.", "output": None}], r"d.jsonl:1: field 'output' is null"),
    ("instruction", [{"instruction": 3, "output": "x"}], r"d.jsonl:1: field 'instruction' is int 3"),
    ("instruction", [{"instruction": "a", "input": {"x": 1}, "output": "x"}], r"d.jsonl:1: field 'input' is dict"),
    ("text", [{"text": "ok"}, b'{"text": "caf\xe9"}'],
     r"d.jsonl:2: not valid UTF-8 \(byte 0xe9 at column 14\)"),
    ("text", [], r"d.jsonl: no records \(the file is empty\)"),
    ("classification", [], r"d.jsonl: no records \(the file is empty\)"),
])
def test_bad_finetune_records_are_refused_with_file_and_line(tmp_path, fmt, lines, message):
    f = _jsonl(tmp_path, lines)
    task = "classification" if fmt == "classification" else "causal_lm"
    cfg = _ft_cfg(tmp_path, fmt, task, train=str(f))
    with pytest.raises(ValueError, match=message):
        records = examples.read_records(str(f))
        names = examples.label_names(records, cfg.data) if task == "classification" else []
        examples.tokenize(records, cfg, data.ByteTokenizer(), names)


def test_labels_unknown_ambiguous_and_accepted(tmp_path):
    byte = data.ByteTokenizer()
    train = examples.read_records(str(_jsonl(tmp_path, [{"text": "a", "label": "neg"}, {"text": "b", "label": "pos"}])))
    cfg = _ft_cfg(tmp_path, "classification", "classification")
    names = examples.label_names(train, cfg.data)
    assert names == ["neg", "pos"]
    unknown = examples.read_records(str(_jsonl(tmp_path, [{"text": "c", "label": "meh"}], "e.jsonl")))
    with pytest.raises(ValueError, match=r"e.jsonl:1: label 'meh' is not one of the labels of data.train"):
        examples.tokenize(unknown, cfg, byte, names)
    ints = examples.read_records(str(_jsonl(tmp_path, [{"text": "a", "label": 2}, {"text": "b", "label": 0}], "i.jsonl")))
    assert examples.label_names(ints, cfg.data) == ["0", "1", "2"]
    assert examples.tokenize(ints, cfg, byte, ["0", "1", "2"])["label"].tolist() == [2, 0]
    cfg.data.labels = ["neg", "pos"]  # integer labels index data.labels
    one = examples.read_records(str(_jsonl(tmp_path, [{"text": "a", "label": 1}], "one.jsonl")))
    assert examples.tokenize(one, cfg, byte, ["neg", "pos"])["label"].tolist() == [1]
    cfg.data.labels = ["1", "0"]  # 1 as an index is "0", as a name is "1": refused
    with pytest.raises(ValueError, match=r"one.jsonl:1: label 1 is ambiguous"):
        examples.tokenize(one, cfg, byte, ["1", "0"])
    # a null input is an absent input
    rec = examples.read_records(str(_jsonl(tmp_path, [{"instruction": "Hi.", "input": None, "output": "yo"}], "n.jsonl")))
    examples.tokenize(rec, _ft_cfg(tmp_path, "instruction"), byte, [])


def test_examples_without_targets_are_counted_dropped_or_refused(tmp_path, caplog):
    byte = data.ByteTokenizer()
    long_prompt = "x" * 40
    f = _jsonl(tmp_path, [{"instruction": "Hi.", "output": "yo"}, {"instruction": long_prompt, "output": "z"},
                          {"instruction": "Ok.", "output": "k"}])
    cfg = _ft_cfg(tmp_path, "instruction", max_length=48)
    caplog.set_level("WARNING")
    arrays = examples.load_examples(str(f), cfg, byte, [])
    assert arrays["offsets"].size - 1 == 2 and (examples.target_counts(arrays) > 0).all()
    assert any("1 of 3 examples have no token to learn (the prompt fills data.max_length 48)" in r.getMessage()
               for r in caplog.records)
    cfg.data.max_length = 16  # the issue's `--data.max-length 16` on gpt2_instruct: no response token survives
    with pytest.raises(ValueError, match=r"d.jsonl: none of its 3 examples has a token to learn \(the prompt fills "
                                         r"data.max_length 16\)"):
        examples.load_examples(str(f), cfg, byte, [])
    empty_texts = _jsonl(tmp_path, [{"text": ""}, {"text": ""}], "t.jsonl")
    with pytest.raises(ValueError, match=r"none of its 2 examples has a token to learn \(the text is empty\)"):
        examples.load_examples(str(empty_texts), _ft_cfg(tmp_path, "text"), byte, [])


def test_finetune_recipe_refuses_max_length_16_on_gpt2_instruct(tmp_path, monkeypatch, fresh_state):
    monkeypatch.chdir(ROOT)
    recipe = _load(FT_RECIPE, "finetune_targets")
    with pytest.raises(SystemExit) as info:
        recipe.main(["--config", "configs/finetune/gpt2_instruct.yaml", "--data.max-length", "16", "--train.cpu",
                     "--logging.out-dir", str(tmp_path / "o"), "--data.cache-dir", str(tmp_path / "c")])
    assert "instructions_train.jsonl: none of its" in str(info.value.code) and "data.max_length 16" in str(
        info.value.code)


def test_eval_without_tokens_reports_no_loss(tmp_path, fresh_state, caplog):
    caplog.set_level("INFO")
    trainer = _trainer(tmp_path / "out", _setup(), steps=1, interval=0)
    trainer.evaluate = lambda: {"loss": None, "perplexity": None}
    summary = trainer.run()
    assert summary["eval_loss"] is None
    assert any("eval step 1 | val loss n/a | perplexity n/a" in r.getMessage() for r in caplog.records)


def test_tokenizer_directory_errors_name_it(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=rf"tokenizer directory {re.escape(str(empty))} is empty"):
        data.load_tokenizer(str(empty))
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "tokenizer.json").write_text("this is not json {")
    with pytest.raises(ValueError, match=rf"tokenizer directory {re.escape(str(garbage))}: cannot be loaded"):
        data.load_tokenizer(str(garbage))


@pytest.mark.parametrize("name, content, message", [
    ("c.txt", b"line one\nline two\nabc\xffdef\n", r"c.txt:3: not valid UTF-8 \(byte 0xff at column 4\)"),
    ("c.jsonl", b'{"text": "a"}\n{"text": "\xc3("}\n', r"c.jsonl:2: not valid UTF-8 \(byte 0xc3 at column 11\)"),
    ("c.jsonl", b'{"text": "a"}\n{"text": null}\n', r"c.jsonl:2: 'text' is null; expected a string"),
])
def test_corpus_files_name_file_and_line(tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError, match=message):
        data.load_tokens(str(tmp_path / name), tmp_path / "cache", data.ByteTokenizer())


# ------------------------------------------------------------------------------------------------
# 6. write errors name the path
# ------------------------------------------------------------------------------------------------


def test_disk_full_while_checkpointing_names_the_file_and_keeps_the_last_one(tmp_path, fresh_state, monkeypatch):
    out, root = _two_checkpoints(tmp_path)
    setup = _setup()
    trainer = _trainer(out, setup, steps=6, interval=2, resume="never")
    real_save = torch.save

    def save_to_full_disk(obj, f, *args, **kwargs):
        if str(f).endswith("optimizer.pt"):
            return real_save(obj, "/dev/full", *args, **kwargs)  # ENOSPC, as on a full disk
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_to_full_disk)
    with pytest.raises(fsio.WriteError, match=r"cannot write .*\.tmp-step-00000006/optimizer.pt: RuntimeError: .*"
                                              r"free on its filesystem\)"):
        checkpoint.save_checkpoint(setup.accelerator, trainer.model, trainer.optimizer, root, 6, {}, keep=1)
    assert checkpoint.find_latest(root) == root / "step-00000004"  # untouched, still verifies
    assert checkpoint.verify_checkpoint(root / "step-00000004")[0] == []


def test_log_and_summary_write_errors_name_the_file(tmp_path):
    out = tmp_path / "out"
    writer = logs.MetricsWriter(out, True, tensorboard=False)
    (out / "train.csv").symlink_to("/dev/full")
    with pytest.raises(fsio.WriteError, match=rf"cannot write {re.escape(str(out / 'train.csv'))}: OSError: .*No "
                                              "space left"):
        writer.write("train", 1, {"loss": 1.0})
    fsio.temporary_name(out / "summary.json").symlink_to("/dev/full")
    with pytest.raises(fsio.WriteError, match=rf"cannot write {re.escape(str(out / 'summary.json'))}"):
        fsio.write_text_atomic(out / "summary.json", "{}\n")
    assert not (out / "summary.json").exists()


def test_end_training_waits_for_every_process_first():
    """The recipes end through trainer.end_training: the barrier comes before the process group is torn down (a gloo
    peer that closes its sockets while the main process still writes summary.json can abort the main process)."""
    calls: list[str] = []

    class Recorder:
        def wait_for_everyone(self):
            calls.append("barrier")

        def end_training(self):
            calls.append("end")

    end_training(Recorder())
    assert calls == ["barrier", "end"]
    for recipe in ("gpt_long", "finetune"):
        source = (ROOT / "volta_train" / "recipes" / f"{recipe}.py").read_text()
        assert "accelerator.end_training()" not in source, f"{recipe} ends training without the barrier"
