"""Logging for training scripts: one line per event, on the main process, next to a tqdm bar."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from tqdm.auto import tqdm

from .fsio import writing

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


class MetricsWriter:
    """Per-step numbers as CSV (``train.csv``, ``eval.csv``) and TensorBoard scalars, on the main process.

    ``start_step`` is the step a run starts from: 0 starts the files afresh; a resumed run keeps
    the rows up to its checkpoint's step and drops any that the interrupted run wrote after it
    (TensorBoard likewise purges events past ``start_step``), so the files hold one trajectory.
    Columns come from the first row written to a file; later rows may leave some empty.
    """

    def __init__(self, out_dir: str | Path, enabled: bool, start_step: int = 0, tensorboard: bool = True):
        self.enabled = enabled
        self.out_dir = Path(out_dir)
        self.columns: dict[str, list[str]] = {}
        self.tb = None
        if not enabled:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for name in ("train", "eval"):
            self._trim(self.out_dir / f"{name}.csv", start_step, name)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # tensorboard not installed
                logging.getLogger(__name__).warning("TensorBoard logging off: %s (pip install tensorboard)", e)
            else:
                self.tb = SummaryWriter(log_dir=str(self.out_dir / "tensorboard"),
                                        purge_step=start_step + 1 if start_step else None)

    def _trim(self, path: Path, start_step: int, name: str) -> None:
        import csv

        if not path.exists():
            return
        if start_step == 0:
            path.unlink()
            return
        with path.open(newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f))
        if not rows:
            path.unlink()
            return
        header, body = rows[0], rows[1:]
        keep = [r for r in body if r and r[0].isdigit() and int(r[0]) <= start_step]
        tmp = path.with_suffix(".csv.tmp")
        with tmp.open("w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(header)
            writer.writerows(keep)
        tmp.replace(path)
        self.columns[name] = header

    def write(self, name: str, step: int, values: dict[str, float | int | None]) -> None:
        """One row of ``<name>.csv`` (``step`` first) and ``<name>/<key>`` scalars in TensorBoard."""
        if not self.enabled:
            return
        import csv

        path = self.out_dir / f"{name}.csv"
        row = [step] + ["" if values.get(c) is None else repr(values[c]) if isinstance(values[c], float) else values[c]
                        for c in self.columns.get(name, ["step", *values])[1:]]
        with writing(path):  # a full disk names the file
            if name not in self.columns:
                self.columns[name] = ["step", *values]
                with path.open("w", newline="", encoding="utf-8") as f:
                    csv.writer(f).writerow(self.columns[name])
            with path.open("a", newline="", encoding="utf-8") as f:
                csv.writer(f).writerow(row)
        if self.tb is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and value == value:  # not None, not NaN
                    self.tb.add_scalar(f"{name}/{key}", value, step)
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None


def read_csv(path: str | Path) -> list[dict[str, str]]:
    """Rows of a CSV written by :class:`MetricsWriter`, as dicts of strings."""
    import csv

    with Path(path).open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))
