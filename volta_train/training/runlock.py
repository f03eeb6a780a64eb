"""One run per output directory: an exclusive ``flock`` on ``<out_dir>/run.lock`` for the run's whole life.

The main process (global rank 0) takes the lock before anything is written into ``out_dir``
and keeps the file open until the run ends, when it removes the file (a normal end, an error, a
signal); the kernel drops the lock when the process exits, however it exits (``SIGKILL`` included,
which leaves the file), so a stale lock file never blocks a later run. The file holds the holder's
pid, host and start time, which a refused run prints. The other
processes of a multi-process run take no lock: they learn the main process's outcome through
one all-reduce, and all of them stop when it failed (none waits on a lock or a barrier).

``flock`` is honoured by local filesystems and by NFSv4/Lustre/GPFS mounts that support it; on a
filesystem without lock support the run stops with an error saying so rather than running unguarded.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

LOCK_FILE = "run.lock"


class RunLockError(RuntimeError):
    """out_dir is held by another run (or cannot be locked)."""


class RunLock:
    """An exclusive, non-blocking ``flock`` on ``out_dir/run.lock``; :meth:`release` (or process exit) frees it."""

    def __init__(self, out_dir: str | os.PathLike):
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / LOCK_FILE
        self.fd: int | None = None
        self.created: list[Path] = []  # what acquire() created (directories, then the lock file), for discard()

    def acquire(self) -> RunLock:
        for existing in (self.out_dir, *self.out_dir.parents):
            if existing.exists():
                if not existing.is_dir():
                    what = "is a file" if existing == self.out_dir else f"is inside {str(existing)!r}, which is a file"
                    raise RunLockError(f"out_dir {str(self.out_dir)!r} {what}, not a directory: pick another out_dir "
                                       "or move the file away")
                break
        missing = [d for d in (self.out_dir, *self.out_dir.parents) if not d.exists()]
        lock_existed = self.path.exists()
        while True:  # a holder that ends removes the file: lock the file that is at the path now
            try:
                self.out_dir.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise RunLockError(f"cannot create the lock file {self.path}: {e}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                break  # in use (or no flock here): reported below
            if _same_file(fd, self.path):
                break
            os.close(fd)  # locked a file its holder had just removed
        self.created = missing + ([] if lock_existed else [self.path])
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(_read(fd))
            os.close(fd)
            raise RunLockError(f"out_dir {str(self.out_dir)!r} is in use by another run ({holder}); wait for it to "
                               f"finish or stop it, or pick another out_dir (lock file {self.path})") from None
        except OSError as e:
            os.close(fd)
            raise RunLockError(f"cannot lock {self.path} ({e}): the filesystem may not support flock; pick an "
                               "out_dir on one that does") from None
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                "command": " ".join(sys.argv)[:500]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        """Remove the lock file (while still holding it: no other run can hold it in between) and unlock."""
        if self.fd is not None:
            fd, self.fd = self.fd, None
            try:
                if _same_file(fd, self.path):
                    with contextlib.suppress(OSError):
                        self.path.unlink()
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    def discard(self) -> None:
        """Release, and remove what :meth:`acquire` created (the lock file, then out_dir and its parents when they
        are empty): for a run that stopped before it began, so that it leaves nothing behind."""
        owned = self.fd is not None
        self.release()
        if owned:
            for directory in self.created:
                if directory != self.path:
                    with contextlib.suppress(OSError):
                        directory.rmdir()  # only when empty
        self.created = []

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self):
        self.release()


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except OSError:
        return False


def _read(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode("utf-8", errors="replace") or "{}")
    except (OSError, ValueError):
        return {}


def _describe(info: dict) -> str:
    if not info:
        return "holder unknown: the lock file is empty"
    return f"pid {info.get('pid', '?')} on host {info.get('host', '?')}, started {info.get('started', '?')}" + (
        f": {info['command']}" if info.get("command") else "")


def holder(out_dir: str | os.PathLike) -> dict:
    """What ``out_dir``'s lock file says about its holder; {} when there is none (no run holds it, or the file
    is empty)."""
    path = Path(out_dir) / LOCK_FILE
    try:
        return json.loads(path.read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        return {}


def acquire_for_run(out_dir: str | os.PathLike, is_main: bool, num_processes: int = 1,
                    device=None) -> RunLock | None:
    """Take ``out_dir``'s lock on the main process; every process raises :class:`RunLockError` if that failed.

    With several processes the outcome travels in one all-reduce (torch.distributed must be
    initialised, as accelerate's ``PartialState`` does), so no process waits on a lock or a barrier.
    """
    lock, error = None, None
    if is_main:
        try:
            lock = RunLock(out_dir).acquire()
        except RunLockError as e:
            error = e
    if num_processes > 1:
        import torch
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            flag = torch.tensor([1.0 if error else 0.0], device=device or "cpu")
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() > 0 and error is None:
                if lock is not None:
                    lock.release()
                raise RunLockError(f"the main process could not lock out_dir {str(out_dir)!r} (see its message)")
    if error is not None:
        raise error
    return lock


@contextlib.contextmanager
def held_locks() -> Iterator[list]:
    """A list for a run's locks (what :func:`acquire_for_run` returns, None included); each one in it is released
    when the block ends, however it ends (a return, an exception, ``sys.exit``). The recipes wrap their run in it."""
    held: list = []
    try:
        yield held
    finally:
        for lock in held:
            if lock is not None:
                lock.release()
