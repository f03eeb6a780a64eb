"""gpt_long run in this process on a nano model and a few KB of synthetic text, for the tests of runs, resumes and
usage errors."""

from __future__ import annotations

from pathlib import Path


def gpt_args(tmp_path: Path, out: Path, *extra: str, steps: int = 4, checkpoint_interval: int | None = 2) -> list[str]:
    """gpt_long's arguments for a CPU run of ``steps`` steps into ``out`` (``checkpoint_interval`` None: the
    preset's), then ``extra`` (later flags win)."""
    checkpoints = [] if checkpoint_interval is None else ["--checkpoint-interval", str(checkpoint_interval)]
    return ["--cpu", "--model", "nano", "--seq-len", "32", "--batch-size", "2", "--synthetic-mb", "0.02",
            "--eval-batches", "1", "--log-interval", "1", "--no-progress", "--steps", str(steps), *checkpoints,
            "--warmup-steps", "0", "--out-dir", str(out), "--cache-dir", str(tmp_path / "cache"), *extra]


def run_gpt(tmp_path: Path, out: Path, *extra: str) -> dict:
    """gpt_long.main on :func:`gpt_args`, accelerate's process state reset first; its summary."""
    from accelerate.state import AcceleratorState

    from volta_train.recipes import gpt_long

    AcceleratorState._reset_state(True)
    return gpt_long.main(gpt_args(tmp_path, out, *extra))
