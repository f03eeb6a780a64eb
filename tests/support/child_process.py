"""What the tests that start training processes share: the environment of a recipe or ``accelerate launch`` child
(:func:`launch_env`, which silences the deprecation warning DeepSpeed's ZeRO-3 triggers on every collective), the end of
a child's stderr without those warnings, so that a failure shows its cause, and one retry of a gloo abort."""

from __future__ import annotations

import os

# DeepSpeed's ZeRO-3 calls deprecated collectives (all_gather_into_tensor, reduce_scatter_tensor) every step; their
# warnings would fill the stderr a failure shows. Python matches a warning filter's message as a prefix.
COLLECTIVE_DEPRECATION = "`torch.distributed."


def without_collective_warnings(env: dict) -> dict:
    """env with a PYTHONWARNINGS filter for those warnings added to any already there."""
    env = dict(env)
    env["PYTHONWARNINGS"] = ",".join(filter(None, [env.get("PYTHONWARNINGS"),
                                                   f"ignore:{COLLECTIVE_DEPRECATION}:FutureWarning"]))
    return env


def launch_env(**extra: str) -> dict:
    """os.environ with ``extra`` set, for a child that runs a recipe or ``accelerate launch``: the collective warnings
    silenced, and ACCELERATE_USE_DEEPSPEED left out (an earlier in-process DeepSpeed run sets it in os.environ; the
    child's own options or accelerate config decide)."""
    env = without_collective_warnings(dict(os.environ, **extra))
    env.pop("ACCELERATE_USE_DEEPSPEED", None)
    return env


def stderr_tail(text: str, chars: int = 8000) -> str:
    """The end of a child's stderr without those warnings (and the source line each repeats)."""
    lines = text.splitlines()
    noise = [COLLECTIVE_DEPRECATION in line and "FutureWarning" in line for line in lines]
    kept = [line for i, line in enumerate(lines) if not noise[i] and not (i and noise[i - 1])]
    return "\n".join(kept)[-chars:]


# What a gloo worker thread prints when a process of a CPU process group aborts in C++ (std::terminate) under load, on
# no wrong input of ours; a command that ended so is run once more, and must then pass like any other.
GLOO_ABORT = "terminate called without an active exception"


def run_retrying_gloo_abort(run):
    """``run()`` (a CompletedProcess), and once more if it failed with the gloo abort above."""
    proc = run()
    if proc.returncode != 0 and GLOO_ABORT in proc.stderr:
        print(f"gloo abort ({GLOO_ABORT!r}); running the command once more")
        proc = run()
    return proc
