"""Logging for training scripts: one line per event, on the main process, next to a tqdm bar."""

from __future__ import annotations

import io
import logging
import sys
from pathlib import Path

from tqdm.auto import tqdm

from .fsio import write_text_atomic, writing
from .plots import plot_run

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATEFMT = "%H:%M:%S"


class TqdmHandler(logging.StreamHandler):
    """Writes records through ``tqdm.write`` so that they do not tear the progress bar."""

    def emit(self, record):
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


class PendingLogFile(logging.Handler):
    """The records meant for a run's log file, held until the run begins (:func:`commit_log_file` writes them and
    goes on appending) or stops before it began (:func:`discard_log_file`: no file is left behind)."""

    def __init__(self, path: str | Path):
        super().__init__()
        self.path = Path(path)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def setup_logging(is_main: bool, log_file: str | Path | None = None, deferred: bool = False) -> logging.Logger:
    """INFO on the main process (stderr, and ``log_file`` if given), WARNING elsewhere; returns the root logger.
    ``deferred``: ``log_file`` is written from :func:`commit_log_file` on (the records before it are kept)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    formatter = logging.Formatter(FORMAT, DATEFMT)
    console = TqdmHandler(sys.stderr)
    console.setFormatter(formatter)
    root.addHandler(console)
    if is_main and log_file is not None and deferred:
        pending = PendingLogFile(log_file)
        pending.setFormatter(formatter)
        root.addHandler(pending)
    elif is_main and log_file is not None:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(log_file, mode="a", encoding="utf-8")
        file_handler.setFormatter(formatter)
        root.addHandler(file_handler)
    root.setLevel(logging.INFO if is_main else logging.WARNING)
    # libraries that log at INFO on every call stay quiet unless something is wrong
    for noisy in ("httpx", "urllib3", "torch.distributed", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    quiet_cpu_notices()
    return root


class _DropMessages(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


# DeepSpeed's notice that it runs on the CPU (it is imported for checkpoints and ZeRO even without a GPU): on a
# machine where torch sees no GPU, the recipe's own "device: cpu" line says the same.
_CPU_NOTICES = ("Setting accelerator to CPU", "Setting ds_accelerator to cpu")


def quiet_cpu_notices() -> None:
    """Drop DeepSpeed's "Setting accelerator to CPU" where torch sees no GPU (where it says nothing new)."""
    import torch

    ds_logger = logging.getLogger("DeepSpeed")  # deepspeed.utils.logger; filters stay when DeepSpeed configures it
    if torch.cuda.is_available() or any(isinstance(f, _DropMessages) for f in ds_logger.filters):
        return
    ds_logger.addFilter(_DropMessages(_CPU_NOTICES))


def commit_log_file() -> None:
    """The run has begun: the pending log file (:func:`setup_logging` ``deferred``) gets its records and every
    later one."""
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, PendingLogFile)]:
        with writing(handler.path, "the run's log"):  # written here, so that a full disk raises (logging would not)
            handler.path.parent.mkdir(parents=True, exist_ok=True)
            with open(handler.path, "a", encoding="utf-8") as f:
                f.writelines(handler.format(record) + "\n" for record in handler.records)
            file_handler = RunLogFile(handler.path, mode="a", encoding="utf-8")
        file_handler.setFormatter(handler.formatter)
        root.removeHandler(handler)
        root.addHandler(file_handler)


class RunLogFile(logging.FileHandler):
    """A run's train.log once the run has begun (:func:`discard_log_file` closes it). A write that fails later (a
    full disk) gives one line on stderr, not logging's traceback per record, and the log goes on on stderr only."""

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        error = sys.exc_info()[1]
        logging.getLogger().removeHandler(self)
        sys.stderr.write(f"cannot write the run's log {self.baseFilename}: {type(error).__name__}: {error}; later "
                         "lines go to stderr only\n")


def discard_log_file() -> None:
    """The run stopped before it began: its pending log file is never written (or, when :func:`commit_log_file`
    already opened it, it is closed)."""
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, (PendingLogFile, RunLogFile))]:
        root.removeHandler(handler)
        handler.close()


def log_config(logger: logging.Logger, options: dict, out_dir: str | Path, is_main: bool, write: bool = True) -> Path:
    """Log the options as a YAML block that names ``out_dir/config.yaml``, and write that file (main process;
    ``write=False``: later, through :func:`write_config`)."""
    import yaml

    path = Path(out_dir) / "config.yaml"
    text = yaml.safe_dump(options, sort_keys=False, default_flow_style=False, width=100)
    if is_main and write:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    logger.info("config (saved to %s; rerun with --config %s):\n%s", path, path,
                "\n".join("  " + line for line in text.rstrip().splitlines()))
    return path


def write_config(options: dict, out_dir: str | Path) -> Path:
    """``out_dir/config.yaml``: the options, a valid ``--config`` file."""
    import yaml

    path = Path(out_dir) / "config.yaml"
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, yaml.safe_dump(options, sort_keys=False, default_flow_style=False, width=100), fsync=False)
    return path


def run_files(out_dir: str | Path) -> str:
    """The files a run leaves in out_dir, for its final log line (those that exist)."""
    out_dir = Path(out_dir)
    names = [n for n in ("train.csv", "eval.csv", "summary.json", "loss.png", "train.log", "config.yaml")
             if (out_dir / n).is_file()]
    return f"in {out_dir}: {', '.join(names) if names else 'no files'}"


def check_tensorboard(requested: bool, flag: str = "--tensorboard") -> None:
    """Raise ImportError, saying what to do, when TensorBoard files are requested but tensorboard is missing."""
    if not requested:
        return
    try:
        import tensorboard  # noqa: F401
    except ImportError as e:
        raise ImportError(f"{flag} asks for TensorBoard event files but tensorboard is not installed ({e}): "
                          f"pip install tensorboard, or leave {flag} off (train.csv and loss.png are always "
                          "written)") from e


def progress_bar(total: int, enabled: bool, desc: str = "train"):
    """A tqdm bar when ``enabled`` and stderr is a terminal (log files get the log lines only)."""
    return tqdm(total=total, desc=desc, disable=None if enabled else True, dynamic_ncols=True, file=sys.stderr)


class MetricsWriter:
    """Per-step numbers as CSV (``train.csv``, ``eval.csv``), ``loss.png`` and, opt-in, TensorBoard scalars.

    Everything happens on the main process. ``loss.png`` (volta_train/training/plots.py) is redrawn after each
    ``eval`` row and at :meth:`close`; a drawing failure logs one warning and never stops training.

    ``start_step`` is the step a run starts from: 0 starts the files afresh; a resumed run keeps
    the rows up to its checkpoint's step and drops any that the interrupted run wrote after it
    (TensorBoard likewise purges events past ``start_step``), so the files hold one trajectory.
    Columns come from the first row written to a file; later rows may leave some empty.
    """

    def __init__(self, out_dir: str | Path, enabled: bool, start_step: int = 0, tensorboard: bool = False,
                 plot: bool = True):
        self.enabled = enabled
        self.out_dir = Path(out_dir)
        self.columns: dict[str, list[str]] = {}
        self.tb = None
        self.plot = plot
        if not enabled:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for name in ("train", "eval"):
            self._trim(self.out_dir / f"{name}.csv", start_step, name)
        if plot:
            try:  # load matplotlib (~1 s the first time) now rather than inside the first timed interval
                import matplotlib.backends.backend_agg  # noqa: F401
                import matplotlib.figure  # noqa: F401
            except ImportError as e:
                logging.getLogger(__name__).warning("loss.png off: %s (pip install matplotlib)", e)
                self.plot = False
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # tensorboard not installed (the recipes check first: check_tensorboard)
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
        try:
            with path.open(newline="", encoding="utf-8") as f:
                rows = list(csv.reader(f))
        except (OSError, ValueError, csv.Error) as e:  # not text (a damaged disk block, a binary file)
            kept = path.with_name(path.name + ".damaged")
            path.replace(kept)
            logging.getLogger(__name__).warning(
                "%s is unreadable (%s: %s): moved to %s; a new %s starts at step %d", path, type(e).__name__,
                str(e)[:200], kept.name, path.name, start_step + 1)
            return
        if not rows:
            path.unlink()
            return
        header, body = rows[0], rows[1:]
        keep = [r for r in body if r and r[0].isdigit() and int(r[0]) <= start_step]
        text = io.StringIO(newline="")
        writer = csv.writer(text)
        writer.writerow(header)
        writer.writerows(keep)
        write_text_atomic(path, text.getvalue(), fsync=False)  # a full disk names the file and leaves it whole
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
        if name == "eval":
            self.draw()

    def draw(self) -> Path | None:
        """Redraw ``loss.png`` from the CSV files; None (and one warning) when it cannot be drawn."""
        if not (self.enabled and self.plot):
            return None
        try:
            return plot_run(self.out_dir)
        except Exception as e:  # noqa: BLE001 - a picture must never stop a run
            logging.getLogger(__name__).warning("loss.png not drawn: %s: %s", type(e).__name__, e)
            self.plot = False
            return None

    def close(self) -> None:
        if self.enabled and self.plot and (self.out_dir / "train.csv").is_file():
            self.draw()
        if self.tb is not None:
            self.tb.close()
            self.tb = None


def read_csv(path: str | Path) -> list[dict[str, str]]:
    """Rows of a CSV written by :class:`MetricsWriter`, as dicts of strings."""
    import csv

    with Path(path).open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))
