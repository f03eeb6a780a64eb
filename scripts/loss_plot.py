"""Training-loss curves of several recipes/gpt_long.py runs (rows of their train.csv) in one PNG.

Shared by the GPU check reports (scripts/gpu_train_check.sh, scripts/sp_check_report.py).
"""

from __future__ import annotations

from pathlib import Path


def plot_loss_curves(curves: dict[str, list[dict]], title: str, path: Path) -> bool:
    """One line per label (x: ``step``, y: ``loss``); False when matplotlib is not installed."""
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
