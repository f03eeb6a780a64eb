"""Nothing lost, nothing stale (issue 37): a finished run is never overwritten, the token cache follows the data's
contents, SIGTERM at any moment ends with a summary or exit 75, start-up write errors are one line and leave nothing,
pickled weights and empty data files are named, killed cache writes are cleaned up, YAML merge keys load.

The recipes run in-process on the "nano" GPT-2 (2 layers, 64 wide) for a few steps; the kill tests run a child process
and send it a real signal.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from volta_train.training import config, data, fsio
from volta_train.recipes import finetune as finetune_recipe
from volta_train.training import examples
from volta_train.training import finetune_config as ft
from checkout import ROOT, checkout_env
from tiny_recipe import gpt_args, run_gpt


def _gpt_exit(tmp_path: Path, out: Path, *extra: str):
    with pytest.raises(SystemExit) as info:
        run_gpt(tmp_path, out, *extra)
    return info.value.code


def _text(rng: random.Random, n: int) -> str:
    words = ["alder", "birch", "cedar", "delta", "ember", "flint", "grove", "heron"]
    return " ".join(rng.choice(words) for _ in range(n)) + "\n"


# ------------------------------------------------------------------------------------------------
# 2. the token cache follows the contents, whatever the mtime
# ------------------------------------------------------------------------------------------------


def test_an_edit_that_keeps_size_and_mtime_is_seen_by_the_token_cache(tmp_path):
    rng = random.Random()
    corpus = tmp_path / "c.txt"
    text = _text(rng, 300)
    corpus.write_text(text)
    first = np.array(data.load_tokens(str(corpus), tmp_path / "cache", data.ByteTokenizer()))
    st = corpus.stat()
    i = rng.randrange(len(text) - 1)
    edited = text[:i] + ("X" if text[i] != "X" else "Y") + text[i + 1:]  # a same-length fix
    corpus.write_text(edited)
    os.utime(corpus, ns=(st.st_atime_ns, st.st_mtime_ns))  # as cp -p / rsync -t / tar x leave it
    assert corpus.stat().st_size == st.st_size and corpus.stat().st_mtime_ns == st.st_mtime_ns
    again = np.array(data.load_tokens(str(corpus), tmp_path / "cache", data.ByteTokenizer()))
    assert again.size == first.size and not np.array_equal(again, first)
    assert data.ByteTokenizer().decode(again[:-1]) == edited


def test_an_edit_that_keeps_size_and_mtime_is_seen_by_the_finetune_cache(tmp_path):
    rng = random.Random()
    train = tmp_path / "t.jsonl"
    records = [{"text": _text(rng, 20).strip()} for _ in range(4)]
    train.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = ft.FinetuneConfig(data=ft.DataSection(train=str(train), format="text", cache_dir=str(tmp_path / "cache")))
    first = examples.load_examples(str(train), cfg, data.ByteTokenizer(), [])
    st = train.stat()
    raw = train.read_text()
    swapped = raw.replace("alder", "ALDER") if "alder" in raw else raw.replace("birch", "BIRCH")
    assert swapped != raw and len(swapped) == len(raw)
    train.write_text(swapped)
    os.utime(train, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = examples.load_examples(str(train), cfg, data.ByteTokenizer(), [])
    assert not np.array_equal(again["ids"], first["ids"])


# ------------------------------------------------------------------------------------------------
# 6. an empty data file is named
# ------------------------------------------------------------------------------------------------


def test_an_empty_data_file_is_named_as_empty(tmp_path, fresh_state):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=rf"data file {re.escape(str(empty))} is empty \(0 bytes\)"):
        data.load_tokens(str(empty), tmp_path / "cache", data.ByteTokenizer())
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n")
    with pytest.raises(ValueError, match=rf"data source {re.escape(str(blank))} holds no text"):
        data.load_tokens(str(blank), tmp_path / "cache", data.ByteTokenizer())
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())
    message = _gpt_exit(tmp_path, tmp_path / "out", "--data", str(empty))
    assert message == f"gpt_long.py: error: data file {empty} is empty (0 bytes): give a file that holds text, or " \
                      "'synthetic'"
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------
# 7. a killed cache write leaves no temporary once the cache is next opened; YAML merge keys
# ------------------------------------------------------------------------------------------------


def test_a_sigkill_during_the_token_cache_write_leaves_nothing_once_the_cache_is_reopened(tmp_path, caplog):
    corpus = tmp_path / "c.txt"
    corpus.write_text(_text(random.Random(), 2000))
    cache = tmp_path / "cache"
    code = (
        "import os, signal, sys\n"
        "import numpy as np\n"
        "from volta_train.training import data\n"
        "def save(f, value, *a, **k):\n"
        "    f.write(b'x' * 4096)\n"
        "    f.flush()\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "np.save = save\n"
        "data.load_tokens(sys.argv[1], sys.argv[2], data.ByteTokenizer())\n"
    )
    child = subprocess.run([sys.executable, "-c", code, str(corpus), str(cache)], capture_output=True, text=True,
                           timeout=120, env=checkout_env())
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    (tmp,) = cache.glob(".*.tmp")
    assert tmp.stat().st_size == 4096
    mine = tmp.with_name(re.sub(r"\.\d+\.tmp$", f".{os.getppid()}.tmp", tmp.name))  # a live writer's
    mine.write_bytes(b"y")
    old = time.time() - 2 * fsio.STALE_TEMPORARY_S
    for f in (tmp, mine):
        os.utime(f, (old, old))  # the kill happened a while ago
    caplog.set_level(logging.WARNING)
    tokens = data.load_tokens(str(corpus), cache, data.ByteTokenizer())
    assert tokens.size == corpus.stat().st_size + 1
    assert not tmp.exists() and mine.exists()
    assert f"removed {tmp}, left by an interrupted write of" in caplog.text
    mine.unlink()
    assert sorted(p.name for p in cache.iterdir() if p.name.startswith(".")) == []


def test_yaml_merge_keys_load_and_python_tags_are_still_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  <<: &d {batch_size: 3, seed: 5}\n  steps: 7\n  seed: 6\n")  # seed overrides
    values = config.load_yaml(path, ft.FinetuneConfig)
    assert values == {"train.batch_size": 3, "train.seed": 6, "train.steps": 7}
    path.write_text("train:\n  steps: 7\n  steps: 8\n")
    with pytest.raises(config.ConfigError, match="duplicate key 'steps'"):
        config.load_yaml(path, ft.FinetuneConfig)
    path.write_text("train: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(config.ConfigError, match="not valid YAML"):
        config.load_yaml(path, ft.FinetuneConfig)
    doc = yaml.load("a: &a {x: 1, y: 2}\nb:\n  <<: *a\n  y: 3\n", Loader=config._UniqueKeySafeLoader)  # noqa: S506
    assert doc == {"a": {"x": 1, "y": 2}, "b": {"x": 1, "y": 3}}


# ------------------------------------------------------------------------------------------------
# 5. pickled weights in a model directory: named, not loaded, and the conversion that works
# ------------------------------------------------------------------------------------------------


def test_pickled_weights_are_named_not_loaded_and_the_given_command_converts_them(tmp_path, monkeypatch):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from volta_train.training import gpt

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=320, n_positions=64))
    directory = tmp_path / "pickled"
    model.save_pretrained(directory)
    (directory / "model.safetensors").unlink()
    weights = directory / "pytorch_model.bin"
    torch.save(model.state_dict(), weights)  # tied: wte and lm_head share storage
    loads = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(a) or pytest.fail("a pickle was loaded"))
    train = tmp_path / "t.jsonl"
    train.write_text('{"text": "hello"}\n')
    cfg = ft.FinetuneConfig(model=ft.ModelSection(path=str(directory)),
                            data=ft.DataSection(train=str(train), format="text", max_length=32))
    with pytest.raises(config.ConfigError) as err:
        finetune_recipe.build_model(cfg, data.ByteTokenizer(), [])
    message = str(err.value)
    assert message.startswith(f"model.path {directory}: its weights are pickled ({weights}), and pickled weights are "
                              "not loaded"), message
    gcfg = gpt.resolve(config.parse_config(gpt.GPTTrainConfig, ["--cpu", "--model-path", str(directory),
                                                                "--seq-len", "32"]), "cpu")
    with pytest.raises(config.ConfigError, match=re.escape(f"model_path {directory}: its weights are pickled")):
        gpt.build_model(gcfg, data.ByteTokenizer())
    assert loads == []
    monkeypatch.undo()
    command = re.search(r'python -c "(.*)"$', message).group(1)
    subprocess.run([sys.executable, "-c", command], check=True, timeout=120)
    rebuilt = finetune_recipe.build_model(cfg, data.ByteTokenizer(), [])
    ids = torch.randint(0, 260, (1, 8))
    assert torch.equal(rebuilt(input_ids=ids).logits, model.eval()(input_ids=ids).logits)


# ------------------------------------------------------------------------------------------------
# 4. a full disk when the run's first files are written: one line naming the file, nothing left
# ------------------------------------------------------------------------------------------------


def _disk_full_for(monkeypatch, name: str) -> None:
    """Writes to the file called ``name`` (or its temporary, ``.name.PID.tmp``) fail as on a full disk."""
    real_open = open

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, b):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def writelines(self, lines):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, attr):
            return getattr(self.f, attr)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def full_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        base = Path(str(file)).name
        hit = base == name or (base.startswith(f".{name}.") and base.endswith(".tmp"))
        return Full(f) if hit and ("w" in mode or "a" in mode) else f

    monkeypatch.setattr("builtins.open", full_open)


@pytest.mark.parametrize("name", ["train.log", "config.yaml"])
def test_a_full_disk_at_start_is_one_line_naming_the_file_and_leaves_nothing(tmp_path, fresh_state, monkeypatch,
                                                                             capsys, name):
    out = tmp_path / "new" / "out"
    _disk_full_for(monkeypatch, name)
    message = _gpt_exit(tmp_path, out)
    monkeypatch.undo()
    assert isinstance(message, str) and "\n" not in message, message
    what = "the run's log " if name == "train.log" else ""
    assert re.fullmatch(rf"gpt_long.py: error: cannot write {what}{re.escape(str(out / name))}: OSError: \[Errno 28\] "
                        r"No space left on device \(\S+ \S+ free on its filesystem\)", message), message
    assert not (tmp_path / "new").exists()  # no train.log, config.yaml, run.lock or out_dir
    assert "Traceback" not in capsys.readouterr().err
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "notes.txt").write_text("mine")
    _disk_full_for(monkeypatch, name)
    _gpt_exit(tmp_path, existing)
    monkeypatch.undo()
    assert sorted(p.name for p in existing.iterdir()) == ["notes.txt"]


# ------------------------------------------------------------------------------------------------
# 3. SIGTERM at any moment: summary.json (finished) or exit 75 with a resumable state
# ------------------------------------------------------------------------------------------------

_SIGTERM_CHILD = '''
import os, signal, sys
from volta_train.recipes import gpt_long
from volta_train.training import checkpoint, data, fsio, optim, trainer

phase, argv = sys.argv[1], sys.argv[2:]

def term_then(real, when=lambda *a, **k: True):
    def wrapper(*a, **k):
        if when(*a, **k):
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)
    return wrapper

calls = []
if phase == "data":
    data.load_tokens = term_then(data.load_tokens)
elif phase == "step":
    optim.set_lr = term_then(optim.set_lr, lambda *a, **k: calls.append(1) or len(calls) == 2)
elif phase == "resume":
    checkpoint.load_checkpoint = term_then(checkpoint.load_checkpoint)
elif phase == "final-eval":
    gpt_long._Evaluation.__call__ = term_then(gpt_long._Evaluation.__call__)
elif phase == "final-save":
    checkpoint.save_model = term_then(checkpoint.save_model)
elif phase == "summary":
    fsio.write_text_atomic = term_then(fsio.write_text_atomic, lambda path, *a, **k: path.name == "summary.json")
gpt_long.main(argv)
'''


def _sigterm_child(tmp_path: Path, out: Path, phase: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _SIGTERM_CHILD, phase, *gpt_args(tmp_path, out, *extra)],
                          capture_output=True, text=True, timeout=300, env=checkout_env(), cwd=tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["final-eval", "final-save", "summary"])
def test_sigterm_after_the_last_step_finishes_the_run(tmp_path, phase):
    out = tmp_path / "out"
    child = _sigterm_child(tmp_path, out, phase, "--checkpoint-interval", "0")  # nothing to fall back to
    assert child.returncode == 0, child.stderr[-3000:]
    assert "SIGTERM after the last step: finishing the final" in child.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] is True and summary["steps"] == 4 and np.isfinite(summary["val_loss"])
    from volta_train.training import checkpoint

    assert checkpoint.verify_model(out / "final") == []
    assert not (out / "run.lock").exists()


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["data", "step", "resume"])
def test_sigterm_before_or_during_the_steps_exits_75_with_a_resumable_state(tmp_path, phase):
    from volta_train.training import checkpoint

    out = tmp_path / "out"
    if phase == "resume":
        first = _sigterm_child(tmp_path, out, "none", "--steps", "2")
        assert first.returncode == 0, first.stderr[-3000:]
    child = _sigterm_child(tmp_path, out, phase, "--checkpoint-interval", "0")
    assert child.returncode == 75, child.stderr[-3000:]
    assert "Traceback" not in child.stderr, child.stderr[-3000:]
    if phase == "data":  # before the run began: nothing written, a rerun starts it
        assert not out.exists()
    else:
        summary = json.loads((out / "summary.json").read_text())
        assert summary["completed"] is False and summary["stopped"] == "SIGTERM"
        assert checkpoint.find_latest(out / "checkpoints").name == f"step-{summary['steps']:08d}"
    assert not (out / "run.lock").exists()
    if phase == "resume":
        return  # the same state as "step"'s, whose rerun finishes
    rerun = _sigterm_child(tmp_path, out, "none", "--checkpoint-interval", "0")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["completed"] is True


# ------------------------------------------------------------------------------------------------
# 1. a finished run is never overwritten: resume auto without checkpoints
# ------------------------------------------------------------------------------------------------


def _log(out: Path) -> str:
    return (out / "train.log").read_text(encoding="utf-8")


@pytest.mark.parametrize("how", ["interval 0", "checkpoints deleted"])
def test_a_finished_run_without_checkpoints_is_reported_finished_or_set_aside(tmp_path, fresh_state, how):
    from volta_train.training import checkpoint

    out = tmp_path / "out"
    extra = ("--checkpoint-interval", "0") if how == "interval 0" else ()
    first = run_gpt(tmp_path, out, *extra)
    if how == "checkpoints deleted":
        shutil.rmtree(out / "checkpoints")
    assert first["completed"] and not (out / "checkpoints").exists()
    final_bytes = {p.name: p.read_bytes() for p in (out / "final").iterdir() if p.is_file()}

    again = run_gpt(tmp_path, out, *extra)  # the unchanged command: finished, nothing retrained or rewritten
    assert again == first
    assert "holds this run, finished (step 4, same settings): nothing to train" in _log(out)
    assert "already holds the finished run (step 4)" in _log(out)
    assert {p.name: p.read_bytes() for p in (out / "final").iterdir() if p.is_file()} == final_bytes
    assert not (out / "previous-run-1").exists() and not (out / "checkpoints").exists()

    lr = str(first["settings"]["--lr"] * random.choice([0.5, 2.0, 3.0]))
    changed = run_gpt(tmp_path, out, *extra, "--lr", lr)  # another run: the finished one moves aside first
    previous = out / "previous-run-1"
    assert json.loads((previous / "summary.json").read_text()) == first
    assert {p.name: p.read_bytes() for p in (previous / "final").iterdir() if p.is_file()} == final_bytes
    assert (previous / "train.csv").is_file() and checkpoint.verify_model(previous / "final") == []
    assert changed["completed"] and changed["start_step"] == 0 and changed["settings"]["--lr"] == float(lr)
    assert re.search(r"--resume auto: \S+ holds an earlier run and no checkpoint to continue it from \(it was run "
                     r"with other settings \(--lr\)\): moved final, summary.json, train.csv, eval.csv, loss.png to "
                     rf"{re.escape(str(previous))}, starting over", _log(out)), _log(out)[-3000:]
    more = run_gpt(tmp_path, out, *extra, "--lr", lr, "--steps", "5")
    assert more["completed"] and more["steps"] == 5
    if how == "interval 0":  # nothing to continue from: set aside again
        assert more["start_step"] == 0 and (out / "previous-run-2" / "final").is_dir()
    else:  # the new run has checkpoints again: it continues
        assert more["resumed_from"] == str(out / "checkpoints" / "step-00000004")
        assert not (out / "previous-run-2").exists()


# ------------------------------------------------------------------------------------------------
# beyond: files read back damaged, a log that stops being writable mid-run
# ------------------------------------------------------------------------------------------------


def test_a_damaged_train_csv_is_kept_aside_and_the_resumed_run_goes_on(tmp_path, fresh_state):
    out = tmp_path / "out"
    run_gpt(tmp_path, out)
    garbage = bytes(random.randrange(256) for _ in range(64)) + b"\xff\xfe\x00"
    (out / "train.csv").write_bytes((out / "train.csv").read_bytes()[:20] + garbage)
    resumed = run_gpt(tmp_path, out, "--steps", "6")
    assert resumed["completed"] and resumed["resumed_from"].endswith("step-00000004")
    assert (out / "train.csv.damaged").read_bytes().endswith(garbage)
    assert re.search(r"train.csv is unreadable \(\w+: .*\): moved to train.csv.damaged; a new train.csv starts at "
                     r"step 5", _log(out)), _log(out)[-3000:]
    from volta_train.training import logs

    assert [int(r["step"]) for r in logs.read_csv(out / "train.csv")] == [5, 6]


def test_a_log_that_fills_the_disk_mid_run_is_one_line_and_the_run_goes_on(tmp_path, capsys):
    from volta_train.training import logs

    log_file = tmp_path / "train.log"
    logs.setup_logging(True, log_file, deferred=True)
    try:
        logging.getLogger("run").info("before")
        logs.commit_log_file()
        (handler,) = [h for h in logging.getLogger().handlers if isinstance(h, logs.RunLogFile)]

        class Full:
            def write(self, text):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            def flush(self):
                pass

        handler.stream.close()
        handler.stream = Full()
        for i in range(3):
            logging.getLogger("run").info("line %d", i)
        err = capsys.readouterr().err
        assert err.count(f"cannot write the run's log {log_file}: OSError: [Errno 28] No space left on device; "
                         "later lines go to stderr only") == 1
        assert "Traceback" not in err and "--- Logging error ---" not in err and "line 2" in err
        assert "before" in log_file.read_text()
    finally:
        logs.discard_log_file()
        logging.getLogger().handlers.clear()


# ------------------------------------------------------------------------------------------------
# the same faults against finetune
# ------------------------------------------------------------------------------------------------


def _ft_args(tmp_path: Path, out: Path, *extra: str) -> list[str]:
    return ["--config", str(ROOT / "configs/finetune/gpt2_instruct.yaml"), "--train.cpu", "--train.steps", "2",
            "--logging.out-dir", str(out), "--logging.no-progress", "--data.cache-dir", str(tmp_path / "cache"),
            *extra]


@pytest.mark.slow
def test_finetune_a_finished_run_without_checkpoints_is_reported_finished_or_set_aside(tmp_path, fresh_state,
                                                                                      monkeypatch):
    from accelerate.state import AcceleratorState

    from volta_train.recipes import finetune

    monkeypatch.chdir(ROOT)
    out = tmp_path / "ft"
    first = finetune.main(_ft_args(tmp_path, out, "--checkpoint.interval", "0"))
    assert first["completed"] and not (out / "checkpoints").exists()
    AcceleratorState._reset_state(True)
    assert finetune.main(_ft_args(tmp_path, out, "--checkpoint.interval", "0")) == first
    assert "holds this run, finished (step 2, same settings)" in _log(out)
    AcceleratorState._reset_state(True)
    finetune.main(_ft_args(tmp_path, out, "--checkpoint.interval", "0", "--optimizer.lr", "1e-4"))
    assert json.loads((out / "previous-run-1" / "summary.json").read_text()) == first
    assert "--checkpoint.resume auto: " in _log(out) and "(--optimizer.lr)" in _log(out)


@pytest.mark.slow
def test_finetune_sigterm_during_the_final_save_finishes_the_run(tmp_path):
    out = tmp_path / "ft"
    code = (
        "import os, signal, sys\n"
        "from volta_train.recipes import finetune\n"
        "from volta_train.training import checkpoint\n"
        "real = checkpoint.save_model\n"
        "def save(*a, **k):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return real(*a, **k)\n"
        "checkpoint.save_model = save\n"
        "finetune.main(sys.argv[1:])\n"
    )
    child = subprocess.run([sys.executable, "-c", code, *_ft_args(tmp_path, out, "--checkpoint.interval", "0")],
                           capture_output=True, text=True, timeout=300, env=checkout_env(), cwd=ROOT)
    assert child.returncode == 0, child.stderr[-3000:]
    assert "SIGTERM after the last step: finishing the final" in child.stderr
    assert json.loads((out / "summary.json").read_text())["completed"] is True
    assert not (out / "run.lock").exists()


def test_temporaries_a_killed_write_left_in_out_dir_go_when_the_next_run_begins(tmp_path, fresh_state):
    out = tmp_path / "out"
    out.mkdir()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()  # a process that has ended
    old = time.time() - 2 * fsio.STALE_TEMPORARY_S
    left = [out / f".{name}.{gone}.tmp" for name in ("summary.json", "train.csv")]
    for f in left:
        f.write_text("half")
        os.utime(f, (old, old))
    run_gpt(tmp_path, out, "--steps", "1")
    assert not any(f.exists() for f in left)
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []


def test_finetune_a_full_disk_at_start_is_one_line_and_leaves_nothing(tmp_path, fresh_state, monkeypatch):
    from volta_train.recipes import finetune

    monkeypatch.chdir(ROOT)
    out = tmp_path / "new" / "ft"
    _disk_full_for(monkeypatch, "config.yaml")
    with pytest.raises(SystemExit) as info:
        finetune.main(_ft_args(tmp_path, out))
    monkeypatch.undo()
    assert re.fullmatch(rf"finetune.py: error: cannot write {re.escape(str(out / 'config.yaml'))}: OSError: "
                        r"\[Errno 28\] No space left on device \(\S+ \S+ free on its filesystem\)", info.value.code)
    assert not (tmp_path / "new").exists()
