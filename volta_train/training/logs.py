"""Logging for training scripts: one line per event, on the main process, next to a tqdm bar."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from tqdm.auto import tqdm

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATEFMT = "%H:%M:%S"


class TqdmHandler(logging.StreamHandler):
    """Writes records through ``tqdm.write`` so that they do not tear the progress bar."""

    def emit(self, record):
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


def setup_logging(is_main: bool, log_file: str | Path | None = None) -> logging.Logger:
    """INFO on the main process (stderr, and ``log_file`` if given), WARNING elsewhere; returns the root logger."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    formatter = logging.Formatter(FORMAT, DATEFMT)
    console = TqdmHandler(sys.stderr)
    console.setFormatter(formatter)
    root.addHandler(console)
    if is_main and log_file is not None:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(log_file, mode="a", encoding="utf-8")
        file_handler.setFormatter(formatter)
        root.addHandler(file_handler)
    root.setLevel(logging.INFO if is_main else logging.WARNING)
    # libraries that log at INFO on every call stay quiet unless something is wrong
    for noisy in ("httpx", "urllib3", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return root


def progress_bar(total: int, enabled: bool, desc: str = "train"):
    """A tqdm bar when ``enabled`` and stderr is a terminal (log files get the log lines only)."""
    return tqdm(total=total, desc=desc, disable=None if enabled else True, dynamic_ncols=True, file=sys.stderr)
