"""Writing files so that a failure names the file: disk full, quota, permissions, a vanished mount.

Library writers (``torch.save``, safetensors, ``save_pretrained``) report a full disk as, e.g.,
``RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos``. :func:`writing`
turns any error raised inside its block into a :class:`WriteError` that names the path and the
free space left on its filesystem; :func:`write_text_atomic` writes through a temporary file and a
rename, so a reader never sees half a file.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import math
import os
import shutil
import time
from pathlib import Path


class WriteError(OSError):
    """Writing ``path`` failed; the message names it (the original error is the ``__cause__``)."""


def _free_space(path: Path) -> str:
    for candidate in (path, *path.parents):
        try:
            usage = shutil.disk_usage(candidate)
        except OSError:
            continue
        free = usage.free
        for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
            if free < 1024 or unit == "TiB":
                return f"{free:.0f} {unit}" if unit == "B" else f"{free:.1f} {unit}"
            free /= 1024
    return "unknown"


@contextlib.contextmanager
def writing(path: str | os.PathLike, what: str = ""):
    """Re-raise any error of the block as :class:`WriteError` naming ``path`` (and ``what`` was written), in one
    line."""
    try:
        yield
    except WriteError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised with the path, original chained
        path = Path(path)
        label = f"{what} " if what else ""
        detail = (str(e).strip().splitlines() or [""])[0][:300]
        raise WriteError(f"cannot write {label}{path}: {type(e).__name__}: {detail} ({_free_space(path)} free on "
                         "its filesystem)") from e


def temporary_name(path: Path) -> Path:
    """The temporary file beside ``path`` that :func:`atomic_file` writes (one per process)."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, what: str = "", mode: str = "wb", fsync: bool = True):
    """A file opened on a temporary name beside ``path``, flushed (and fsynced) and renamed over ``path`` when the
    block ends. On any error the temporary file is removed and :class:`WriteError` names ``path``: a reader sees
    the old file or the whole new one, and a full disk leaves nothing behind."""
    path = Path(path)
    tmp = temporary_name(path)
    with writing(path, what):
        try:
            with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
                yield f
                f.flush()
                if fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise


def strict_json(record) -> str:
    """``record`` as indented JSON that any parser reads: a NaN or infinite float (no value: a loss never measured,
    a memory peak not known) becomes null, where Python's json would write the non-JSON ``NaN``."""
    def finite(value):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: finite(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [finite(v) for v in value]
        return value

    return json.dumps(finite(record), indent=2, allow_nan=False) + "\n"


def write_text_atomic(path: str | os.PathLike, text: str, fsync: bool = True) -> None:
    """``text`` to ``path`` through :func:`atomic_file`; errors name ``path``."""
    with atomic_file(path, mode="w", fsync=fsync) as f:
        f.write(text)


STALE_TEMPORARY_S = 60  # a temporary untouched this long whose writer is gone is a leftover of a killed write


def remove_stale_temporaries(path: str | os.PathLike) -> None:
    """Remove the temporary files of ``path`` (:func:`temporary_name`) left by a write that was killed: their
    process is not running here and they have not changed for :data:`STALE_TEMPORARY_S` seconds (a writer on another
    host sharing the directory keeps writing its own)."""
    path = Path(path)
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        try:
            pid = int(tmp.name[len(path.name) + 2:-4])
            age = time.time() - tmp.stat().st_mtime
        except (ValueError, OSError):
            continue
        if age < STALE_TEMPORARY_S or _running(pid):
            continue
        try:
            tmp.unlink()
        except OSError:
            continue
        logging.getLogger(__name__).warning("removed %s, left by an interrupted write of %s", tmp, path.name)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return pid > 0
