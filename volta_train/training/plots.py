"""``loss.png`` of a run directory: training and validation loss, learning rate and tokens/s against the step.

Read from the run's ``train.csv`` and ``eval.csv`` (volta_train/training/logs.py: MetricsWriter), so it draws any
run, finished or not: the trainer redraws it at each evaluation and at the end, ``volta-train plot RUN_DIR`` on
demand. matplotlib draws off-screen (no display needed).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

PLOT_NAME = "loss.png"
MARKED_POINTS = 50  # series of up to this many points get a dot on each


def _column(rows: list[dict[str, str]], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for row in rows:
        text = row.get(key) or ""
        try:
            value = float(text)
        except ValueError:
            continue
        if math.isfinite(value):
            steps.append(int(row["step"]))
            values.append(value)
    return steps, values


def _rows(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        return []
    with path.open(newline="", encoding="utf-8") as f:
        return [row for row in csv.DictReader(f) if (row.get("step") or "").isdigit()]


def _markers(steps: list[int]) -> dict:
    """A dot on each point of a short series (a line through one or two points is invisible or misleading)."""
    return {"marker": "o", "markersize": 4} if len(steps) <= MARKED_POINTS else {}


def plot_run(run_dir: str | Path, out: str | Path | None = None, title: str | None = None) -> Path:
    """Draw ``run_dir/loss.png`` (or ``out``) from the run's CSV files; returns the PNG's path.

    Raises FileNotFoundError naming the directory when it holds no ``train.csv`` rows.
    """
    from matplotlib.figure import Figure  # no pyplot: no global state, no display

    run_dir = Path(run_dir)
    train, evals = _rows(run_dir / "train.csv"), _rows(run_dir / "eval.csv")
    if not train and not evals:
        raise FileNotFoundError(f"{run_dir} has no train.csv or eval.csv rows to plot (is it a run's out_dir?)")
    fig = Figure(figsize=(12, 3.6))
    loss_ax, lr_ax, speed_ax = fig.subplots(1, 3)
    steps, values = _column(train, "loss")
    if steps:
        loss_ax.plot(steps, values, label="train", color="tab:blue", **_markers(steps))
    steps, values = _column(evals, "loss")
    if steps:
        loss_ax.plot(steps, values, "o-", label="validation", color="tab:orange")
    loss_ax.set_ylabel("loss (nats/token)")
    loss_ax.legend(loc="upper right")
    for ax, key, label in ((lr_ax, "lr", "learning rate"), (speed_ax, "tokens_per_s", "tokens/s")):
        steps, values = _column(train, key)
        if steps:
            ax.plot(steps, values, color="tab:green" if key == "lr" else "tab:purple", **_markers(steps))
        ax.set_ylabel(label)
    for ax in (loss_ax, lr_ax, speed_ax):
        ax.set_xlabel("optimizer step")
        ax.grid(True, alpha=0.3)
    lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    fig.suptitle(title or str(run_dir))
    fig.tight_layout()
    path = Path(out) if out is not None else run_dir / PLOT_NAME
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    tmp.replace(path)  # a viewer never sees a half-written file
    return path


def plot_loss_curves(curves: dict[str, list[dict]], title: str, path: Path) -> bool:
    """Training-loss curves of several runs (rows of their ``train.csv``) in one PNG, one line per label (x: ``step``,
    y: ``loss``); False when matplotlib is not installed. The GPU checks (lab/gpu_checks/) compare runs with it."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, rows in curves.items():
        ax.plot([int(r["step"]) for r in rows], [float(r["loss"]) for r in rows], label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
