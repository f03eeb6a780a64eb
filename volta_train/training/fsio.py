"""Writing files so that a failure names the file: disk full, quota, permissions, a vanished mount.

Library writers (``torch.save``, safetensors, ``save_pretrained``) report a full disk as, e.g.,
``RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos``. :func:`writing`
turns any error raised inside its block into a :class:`WriteError` that names the path and the
free space left on its filesystem; :func:`write_text_atomic` writes through a temporary file and a
rename, so a reader never sees half a file.
"""

from __future__ import annotations

import contextlib
import os
import shutil
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
    """Re-raise any error of the block as :class:`WriteError` naming ``path`` (and ``what`` was written)."""
    try:
        yield
    except WriteError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised with the path, original chained
        path = Path(path)
        label = f"{what} " if what else ""
        raise WriteError(f"cannot write {label}{path}: {type(e).__name__}: {e} ({_free_space(path)} free on its "
                         "filesystem)") from e


def write_text_atomic(path: str | os.PathLike, text: str, fsync: bool = True) -> None:
    """``text`` to ``path`` via ``.<name>.tmp`` + rename; errors name ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with writing(path):
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                if fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
