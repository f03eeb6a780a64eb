"""On-disk cubin cache in front of :func:`volta_train.kernels.nvrtc.compile_program`.

Directory: ``$VOLTA_TRAIN_CACHE_DIR``, else ``$XDG_CACHE_HOME/volta_train/kernels``, else
``~/.cache/volta_train/kernels``. It is created with mode 0o700. Permission policy for an existing directory
(a cubin from the cache runs inside this process's CUDA context, so others must not be able to plant one):

- owned by another user: refused (:class:`CacheDirError`);
- writable by group or others: refused, since entries could already have been planted: check or delete it,
  then ``chmod 700`` it, or point ``VOLTA_TRAIN_CACHE_DIR`` elsewhere;
- readable/searchable by group or others only: tightened to 0o700, with a one-line warning.

One entry per compiled program, ``<key>.entry``, key = sha256 over the source (and every header it includes
from the include dirs, recursively), the name expressions, the options, the architecture, the NVRTC version
and :data:`CACHE_FORMAT_VERSION`. An entry is ``MAGIC``, a 4-byte little-endian header length, a JSON header
(key, arch, NVRTC version, lowered names, exported variables' bytes, log, cubin size and sha256), the cubin, and a
sha256 of all of that. Entries are written to a temporary file in the same directory, flushed, fsynced and renamed
over the entry (``os.replace``), so readers see either no entry or a whole one. Every load checks magic, checksum,
header, key and cubin sha256; a bad entry is logged in one line and recompiled, never loaded. A cache directory that
cannot be written (read-only) still serves its entries; new compiles are then used uncached, with a warning.

Concurrent processes (e.g. the ranks of one node) serialise the compile of one key on ``<key>.lock`` (fcntl
flock): one compiles, the others wait and then load its entry. After ``$VOLTA_TRAIN_CACHE_LOCK_TIMEOUT``
seconds (default 600) a waiter compiles by itself; the atomic rename keeps that safe. Lock files are left in
place (deleting them would race with waiters); they are empty.

Within a process every distinct call is compiled or loaded once (an in-memory memo).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import stat
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .nvrtc import CompiledProgram, compile_program, find_nvrtc, normalize_arch

logger = logging.getLogger("volta_train")

CACHE_DIR_ENV = "VOLTA_TRAIN_CACHE_DIR"
LOCK_TIMEOUT_ENV = "VOLTA_TRAIN_CACHE_LOCK_TIMEOUT"
DEFAULT_LOCK_TIMEOUT_S = 600.0
CACHE_FORMAT_VERSION = 2  # 2: the header holds the exported variables' bytes
MAGIC = b"VTCUBIN\x00"
_HEADER_LENGTH = struct.Struct("<I")
_DIGEST_BYTES = 32  # sha256 of everything before it
ENTRY_SUFFIX = ".entry"
LOCK_SUFFIX = ".lock"
_LOCK_POLL_S = 0.05
_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^">]+)[">]', re.MULTILINE)


class CacheDirError(RuntimeError):
    """The cache directory cannot be used safely."""


@dataclass
class CacheStats:
    """What this process's cache did; tests and the kernel report read it."""

    compiles: int = 0
    disk_hits: int = 0
    memo_hits: int = 0
    rejected_entries: int = 0


stats = CacheStats()
_memo: dict[Hashable, CompiledProgram] = {}
_memo_lock = threading.RLock()  # memoized() nests: a variant's key, then the source's
_checked_dirs: set[Path] = set()


# --- the directory -----------------------------------------------------------------------------------------


def cache_dir_path() -> Path:
    """Where the cache lives; creates nothing."""
    explicit = os.environ.get(CACHE_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "volta_train" / "kernels"


def ensure_cache_dir() -> Path:
    """The cache directory, created with mode 0o700 and checked once per process (see the module docstring)."""
    directory = cache_dir_path()
    if directory in _checked_dirs:
        return directory
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as error:
        raise CacheDirError(
            f"cannot create the kernel cache directory {directory}: {error}; set {CACHE_DIR_ENV} to a writable path"
        ) from error
    _check_permissions(directory)
    _checked_dirs.add(directory)
    return directory


def _check_permissions(directory: Path) -> None:
    info = directory.stat()
    if not stat.S_ISDIR(info.st_mode):
        raise CacheDirError(f"kernel cache path {directory} is not a directory; set {CACHE_DIR_ENV} to a directory")
    if info.st_uid != os.getuid():
        raise CacheDirError(
            f"kernel cache directory {directory} belongs to uid {info.st_uid}, not to this user ({os.getuid()}); "
            f"set {CACHE_DIR_ENV} to a directory of your own"
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheDirError(
            f"kernel cache directory {directory} is writable by group/others (mode {mode:o}), so its cubins cannot "
            f"be trusted; delete its entries (or check them) and `chmod 700 {directory}`, or set {CACHE_DIR_ENV}"
        )
    if mode & 0o077:
        os.chmod(directory, 0o700)
        logger.warning("volta_train: kernel cache directory %s had mode %o; tightened to 700", directory, mode)


# --- the key -----------------------------------------------------------------------------------------------


def included_files(source: str, include_dirs: Sequence[str | os.PathLike]) -> dict[str, str]:
    """Every file the source includes, recursively, that exists in include_dirs: {include name: text}.

    Includes that are not found there (system headers, or names NVRTC builds in) are not part of the key.
    """
    found: dict[str, str] = {}
    pending = [(source, None)]
    while pending:
        text, including_dir = pending.pop()
        for name in _INCLUDE.findall(text):
            path = _resolve_include(name, including_dir, include_dirs)
            if path is None:
                continue
            key = str(path)
            if key in found:
                continue
            found[key] = path.read_text(errors="replace")
            pending.append((found[key], path.parent))
    return found


def _resolve_include(name: str, including_dir: Path | None, include_dirs: Sequence) -> Path | None:
    directories = ([including_dir] if including_dir is not None else []) + [Path(d) for d in include_dirs]
    for directory in directories:
        candidate = directory / name
        if candidate.is_file():
            return candidate.resolve()
    return None


def cache_key(
    source: str,
    name_expressions: Sequence[str],
    arch: int,
    options: Sequence[str],
    include_dirs: Sequence[str | os.PathLike],
    nvrtc_version: tuple[int, int],
) -> str:
    headers = included_files(source, include_dirs)
    material = {
        "format": CACHE_FORMAT_VERSION,
        "source": source,
        # Header texts, not their paths: the key must not depend on where the checkout lives.
        "headers": sorted(headers.values()),
        "name_expressions": list(name_expressions),
        "options": list(options),
        "arch": arch,
        "nvrtc_version": list(nvrtc_version),
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


# --- entries -----------------------------------------------------------------------------------------------


def entry_path(directory: Path, key: str) -> Path:
    return directory / f"{key}{ENTRY_SUFFIX}"


def encode_entry(key: str, program: CompiledProgram) -> bytes:
    header = {
        "format": CACHE_FORMAT_VERSION,
        "key": key,
        "arch": program.arch,
        "nvrtc_version": list(program.nvrtc_version),
        "lowered_names": program.lowered_names,
        "variables": {expression: data.hex() for expression, data in program.variables.items()},
        "log": program.log,
        "cubin_bytes": len(program.cubin),
        "cubin_sha256": program.cubin_sha256,
    }
    header_bytes = json.dumps(header, sort_keys=True).encode()
    body = MAGIC + _HEADER_LENGTH.pack(len(header_bytes)) + header_bytes + program.cubin
    return body + hashlib.sha256(body).digest()


_HEADER_TYPES = {
    "format": int, "key": str, "arch": int, "nvrtc_version": list, "lowered_names": dict, "variables": dict,
    "log": str,
    "cubin_bytes": int, "cubin_sha256": str,
}


def decode_entry(data: bytes, key: str) -> CompiledProgram:
    """The program stored in data; ValueError naming the first check that failed."""
    if not data.startswith(MAGIC):
        raise ValueError("bad magic")
    start = len(MAGIC) + _HEADER_LENGTH.size
    if len(data) < start + _DIGEST_BYTES:
        raise ValueError(f"truncated ({len(data)} bytes)")
    body, digest = data[:-_DIGEST_BYTES], data[-_DIGEST_BYTES:]
    if hashlib.sha256(body).digest() != digest:
        raise ValueError("entry checksum mismatch (truncated or corrupt)")
    (header_length,) = _HEADER_LENGTH.unpack_from(body, len(MAGIC))
    if len(body) < start + header_length:
        raise ValueError("header length beyond the entry")
    try:
        header = json.loads(body[start : start + header_length])
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"unreadable header ({error})") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    for name, kind in _HEADER_TYPES.items():
        if not isinstance(header.get(name), kind):
            raise ValueError(f"header field {name!r} missing or not a {kind.__name__}")
    if header["format"] != CACHE_FORMAT_VERSION:
        raise ValueError(f"format {header['format']}, expected {CACHE_FORMAT_VERSION}")
    if header["key"] != key:
        raise ValueError("key mismatch")
    cubin = body[start + header_length :]
    if len(cubin) != header["cubin_bytes"] or hashlib.sha256(cubin).hexdigest() != header["cubin_sha256"]:
        raise ValueError("cubin size or sha256 differs from the header")
    try:
        variables = {expression: bytes.fromhex(data) for expression, data in header["variables"].items()}
    except (TypeError, ValueError):
        raise ValueError("header field 'variables' is not a map of name expressions to hex bytes") from None
    return CompiledProgram(
        cubin=cubin,
        lowered_names=header["lowered_names"],
        log=header["log"],
        nvrtc_version=tuple(header["nvrtc_version"]),
        arch=header["arch"],
        variables=variables,
    )


def load_entry(path: Path, key: str) -> CompiledProgram | None:
    """The verified entry at path; None if there is none or it is bad (logged in one line)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as error:
        logger.warning("volta_train: cannot read kernel cache entry %s (%s); recompiling", path, error)
        return None
    try:
        return decode_entry(data, key)
    except ValueError as error:
        stats.rejected_entries += 1
        logger.warning("volta_train: rejected kernel cache entry %s (%s); recompiling", path, error)
        return None


def write_entry(path: Path, key: str, program: CompiledProgram) -> None:
    """Write atomically: temporary file in the same directory, fsync, rename over path."""
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{key[:16]}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(encode_entry(key, program))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        raise


# --- locking -----------------------------------------------------------------------------------------------


def lock_timeout_s() -> float:
    value = os.environ.get(LOCK_TIMEOUT_ENV, "")
    if not value:
        return DEFAULT_LOCK_TIMEOUT_S
    try:
        timeout = float(value)
    except ValueError:
        raise ValueError(f"{LOCK_TIMEOUT_ENV}={value!r}; accepted: a number of seconds") from None
    if timeout < 0:
        raise ValueError(f"{LOCK_TIMEOUT_ENV}={value!r}; accepted: a number of seconds >= 0")
    return timeout


class _KeyLock:
    """An exclusive flock on <key>.lock, given up after timeout_s (then .acquired is False)."""

    def __init__(self, path: Path, timeout_s: float):
        self.path = path
        self.timeout_s = timeout_s
        self.acquired = False
        self._descriptor = -1

    def __enter__(self) -> _KeyLock:
        try:
            self._descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as error:  # e.g. a read-only cache directory
            logger.warning("volta_train: cannot open %s (%s); compiling without the lock", self.path, error)
            return self
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                fcntl.flock(self._descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self.acquired = True
                return self
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    logger.warning(
                        "volta_train: waited %.0f s for %s; compiling without the lock", self.timeout_s, self.path
                    )
                    return self
                time.sleep(_LOCK_POLL_S)

    def __exit__(self, *exc) -> None:
        if self.acquired:
            fcntl.flock(self._descriptor, fcntl.LOCK_UN)
        if self._descriptor >= 0:
            os.close(self._descriptor)


# --- the entry point ---------------------------------------------------------------------------------------


def get_or_compile(
    source: str,
    name_expressions: Sequence[str],
    arch: int | str,
    options: Sequence[str] = (),
    include_dirs: Sequence[str | os.PathLike] = (),
    program_name: str = "volta_train.cu",
) -> CompiledProgram:
    """The compiled program: from this process's memo, else from the disk cache, else compiled and stored."""
    target = normalize_arch(arch)
    memo_key = (source, tuple(name_expressions), target, tuple(options), tuple(map(os.fspath, include_dirs)))
    return memoized(
        memo_key, lambda: _load_or_compile(source, name_expressions, target, options, include_dirs, program_name)
    )


def memoized(key: Hashable, compute: Callable[[], CompiledProgram]) -> CompiledProgram:
    """compute() once per key and process (until clear_memo); callers with a cheap key skip rebuilding sources."""
    with _memo_lock:
        program = _memo.get(key)
        if program is not None:
            stats.memo_hits += 1
            return program
        program = compute()
        _memo[key] = program
        return program


def _load_or_compile(source, name_expressions, arch, options, include_dirs, program_name) -> CompiledProgram:
    library = find_nvrtc(arch)
    key = cache_key(source, name_expressions, arch, options, include_dirs, library.version)
    directory = ensure_cache_dir()
    path = entry_path(directory, key)
    seen = _file_signature(path)
    program = load_entry(path, key) if seen else None
    if program is not None:
        stats.disk_hits += 1
        return program
    with _KeyLock(directory / f"{key}{LOCK_SUFFIX}", lock_timeout_s()):
        if _file_signature(path) != seen:  # another process wrote the entry while this one waited
            program = load_entry(path, key)
            if program is not None:
                stats.disk_hits += 1
                return program
        started = time.perf_counter()
        program = compile_program(source, name_expressions, arch, options, include_dirs, program_name, library)
        stats.compiles += 1
        logger.info(
            "volta_train: compiled %s for sm_%d with NVRTC %s in %.2f s",
            program_name, arch, library.version_string, time.perf_counter() - started,
        )
        try:
            write_entry(path, key, program)
        except OSError as error:
            logger.warning("volta_train: could not store kernel cache entry %s (%s); using it uncached", path, error)
    return program


def _file_signature(path: Path) -> tuple[int, int, int] | None:
    """(inode, size, mtime) of path, None if it does not exist: tells whether an entry was replaced."""
    try:
        info = path.stat()
    except FileNotFoundError:
        return None
    return info.st_ino, info.st_size, info.st_mtime_ns


def clear_memo() -> None:
    """Forget this process's compiled programs (the disk cache stays)."""
    with _memo_lock:
        _memo.clear()
    _checked_dirs.clear()
