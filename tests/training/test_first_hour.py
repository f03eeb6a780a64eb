"""The first hour of a new user (issue 38): usage errors exit 2 with "did you mean", a bad --resume says what it
accepts and leaves nothing, no run.lock outlives its run, plots of short runs show their points, `env` prints a
count and where the list is, and the main job starts without accelerate's block of default-value warnings."""

from __future__ import annotations

import csv
import random
import subprocess
import sys
from pathlib import Path

import pytest

from volta_train.training import runlock
from checkout import ROOT
from tiny_recipe import gpt_args


def _gpt_args(tmp_path: Path, out: Path, *extra: str) -> list[str]:
    return gpt_args(tmp_path, out, *extra, steps=2, checkpoint_interval=None)


def _exit(main, argv) -> object:
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    with pytest.raises(SystemExit) as info:
        main(argv)
    return info.value.code


def _gpt_main():
    from volta_train.recipes import gpt_long

    return gpt_long.main


def _ft_main():
    from volta_train.recipes import finetune

    return finetune.main


# ------------------------------------------------------------------------------------------------
# usage errors: status 2, flags and YAML alike, "did you mean"
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("typo, flag", [("--stpes", "--steps"), ("--seq-ln", "--seq-len"),
                                        ("--learning-rate", None)])
def test_a_misspelled_flag_exits_2_with_did_you_mean(tmp_path, capsys, typo, flag):
    code = _exit(_gpt_main(), ["--cpu", typo, "5", "--out-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and f"unrecognized arguments: {typo} 5" in err
    if flag:
        assert f"({typo}: did you mean {flag}?)" in err
    else:
        assert "did you mean" not in err
    assert not (tmp_path / "out").exists()


def test_a_misspelled_finetune_flag_suggests_the_sectioned_one(tmp_path, capsys):
    code = _exit(_ft_main(), ["--config", "gpt2_instruct", "--train.stpes", "5"])
    assert code == 2 and "(--train.stpes: did you mean --train.steps?)" in capsys.readouterr().err


def test_bad_values_and_unknown_configs_exit_2_naming_them(tmp_path, capsys, fresh_state):
    out = tmp_path / "out"
    seq = random.choice(["0", "-4"])
    code = _exit(_gpt_main(), _gpt_args(tmp_path, out, "--seq-len", seq))
    assert code == 2 and "seq_len" in str(code) and seq in str(code)
    assert str(code) in capsys.readouterr().err
    code = _exit(_gpt_main(), _gpt_args(tmp_path, out, "--config", "cpu_tny"))
    assert code == 2 and "--config 'cpu_tny' is neither a file nor a shipped gpt_long config (did you mean " \
                         "'cpu_tiny'?)" in str(code)
    bad = tmp_path / "bad.yaml"
    bad.write_text("beta1: 1.5\n")
    code = _exit(_gpt_main(), _gpt_args(tmp_path, out, "--config", str(bad)))
    assert code == 2 and "beta1 must be a finite number in [0, 1), got 1.5" in str(code)
    code = _exit(_ft_main(), ["--config", "gpt2_instruct", "--train.cpu", "--train.loss-chunk-tokens", "0",
                              "--logging.out-dir", str(out)])
    assert code == 2 and "memory.loss_chunk_tokens must be positive" in str(code)
    assert not out.exists()


# ------------------------------------------------------------------------------------------------
# a bad --resume: what it accepts, and nothing left behind
# ------------------------------------------------------------------------------------------------


def test_a_bad_resume_says_what_it_accepts_and_leaves_nothing(tmp_path, capsys, fresh_state):
    missing = tmp_path / f"no_such_ckpt_{random.randrange(10**6)}"
    fresh = tmp_path / "fresh" / "out"
    code = _exit(_gpt_main(), _gpt_args(tmp_path, fresh, "--resume", str(missing)))
    assert code == 2
    assert str(code) == (f"gpt_long.py: error: --resume {str(missing)!r}: no such file or directory; --resume "
                         "accepts auto (the newest complete checkpoint in out_dir/checkpoints; none: a fresh start), "
                         "never (start over; an earlier run moves to out_dir/previous-run-N) or a path: a checkpoint "
                         "(out_dir/checkpoints/step-N), a checkpoints directory, or an out_dir that holds one")
    assert not (tmp_path / "fresh").exists()
    not_a_checkpoint = tmp_path / "empty-dir"
    not_a_checkpoint.mkdir()
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "notes.txt").write_text("mine")
    code = _exit(_gpt_main(), _gpt_args(tmp_path, existing, "--resume", str(not_a_checkpoint)))
    assert code == 2 and "neither a complete checkpoint nor a directory of checkpoints; --resume accepts" in str(code)
    assert sorted(p.name for p in existing.iterdir()) == ["notes.txt"]  # no config.yaml, train.log, run.lock
    code = _exit(_ft_main(), ["--config", "gpt2_instruct", "--train.cpu", "--checkpoint.resume", str(missing),
                              "--logging.out-dir", str(fresh)])
    assert code == 2 and f"--checkpoint.resume {str(missing)!r}: no such file or directory; --checkpoint.resume " \
                         "accepts auto" in str(code)
    assert not (tmp_path / "fresh").exists()


# ------------------------------------------------------------------------------------------------
# no run.lock outlives its run
# ------------------------------------------------------------------------------------------------


def test_no_run_lock_outlives_a_finished_or_failed_run(tmp_path, fresh_state):
    out = tmp_path / "out"
    summary = _gpt_main()(_gpt_args(tmp_path, out))
    assert summary["completed"] and not (out / runlock.LOCK_FILE).exists()
    code = _exit(_gpt_main(), _gpt_args(tmp_path, out, "--steps", "4", "--lr", "1e30"))  # diverges: exit 1
    assert "non-finite values" in str(code) and not (out / runlock.LOCK_FILE).exists()
    lock = runlock.RunLock(out).acquire()  # a held lock still refuses a second run, and goes with it
    with pytest.raises(runlock.RunLockError, match="is in use by another run"):
        runlock.RunLock(out).acquire()
    assert (out / runlock.LOCK_FILE).is_file()
    lock.release()
    assert not (out / runlock.LOCK_FILE).exists()
    runlock.RunLock(out).acquire().release()


# ------------------------------------------------------------------------------------------------
# plots of short runs, env, the main job's first lines
# ------------------------------------------------------------------------------------------------


def _pixels_near(png: Path, rgb: tuple[int, int, int]) -> int:
    import matplotlib.image
    import numpy as np

    image = matplotlib.image.imread(png)[..., :3] * 255
    return int((np.abs(image - np.array(rgb)).max(axis=-1) < 40).sum())


def test_the_plot_of_a_one_row_run_shows_its_points(tmp_path):
    from volta_train.training.plots import plot_run

    rng = random.Random()
    with (tmp_path / "train.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "loss", "lr", "tokens_per_s"])
        writer.writerow([1, rng.uniform(2, 6), rng.uniform(1e-4, 1e-3), rng.uniform(1e3, 1e5)])
    png = plot_run(tmp_path)
    for rgb in ((31, 119, 180), (44, 160, 44), (148, 103, 189)):  # tab:blue (loss), tab:green (lr), tab:purple
        assert _pixels_near(png, rgb) >= 10, rgb


def test_env_prints_a_count_of_supported_model_types_and_where_the_list_is():
    from volta_train import env
    from volta_train.integrations import hf

    text = "\n".join(env.transformers_lines())
    supported = hf.supported_model_types()
    assert f"{len(supported)} ok" in text and "the list: docs/hf_integration.md" in text
    assert "hf.supported_model_types()" in text
    assert not any(f" {name}," in text for name in supported) and max(map(len, text.splitlines())) < 600


@pytest.mark.launches_processes
def test_the_main_job_starts_without_accelerates_default_value_warnings(tmp_path):
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
              str(ROOT / "configs" / "accelerate" / "one_process.yaml"), str(ROOT / "recipes" / "gpt_long.py"),
              "--help"]
    done = subprocess.run(launch, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "usage: gpt_long.py" in done.stdout
    assert "were not passed to `accelerate launch`" not in done.stderr, done.stderr
    readme = (ROOT / "README.md").read_text()
    assert "accelerate launch --config_file configs/accelerate/one_process.yaml recipes/gpt_long.py" in readme
