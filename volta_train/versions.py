"""The releases of volta_train's dependencies that its tests run on: the lowest supported (pyproject.toml's lower bound,
run in CI by tests/packaging/test_lowest_versions.py) and the newest tested (what a fresh install got when the census table of
that transformers release was recorded). ``volta-train env`` says where the installed ones stand."""

from __future__ import annotations

from importlib import metadata

TESTED: dict[str, tuple[str, str]] = {
    "transformers": ("5.24.0", "5.25.0"),
    "accelerate": ("1.12.0", "1.16.0"),
    "deepspeed": ("0.18.2", "0.19.8"),
}
"""package -> (lowest supported and tested, newest tested)."""

ZERO3_ON_GLOO = "0.19.8"
"""The first DeepSpeed whose ZeRO-3 parameter all-gather waits for every gloo handle. Before it, ZeRO-3 over several
CPU (gloo) processes can read parameters before they arrive, and the run starts from garbage weights
(docs/compatibility.md). NCCL is not affected."""


def older(version: str, than: str) -> bool:
    """``version`` is an older release than ``than``."""
    return _release(version) < _release(than)


def _release(version: str) -> tuple[int, ...]:
    from packaging.version import Version

    return Version(version).release


def installed(package: str) -> str | None:
    """The installed version of ``package``, or None."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def standing(package: str) -> str:
    """One line: the installed version of ``package`` against its tested range."""
    lowest, newest = TESTED[package]
    version = installed(package)
    if version is None:
        return f"{package}: not installed (tested {lowest} to {newest})"
    if older(version, lowest):
        return f"{package} {version}: older than the lowest supported, {lowest} (pip install -U '{package}>={lowest}')"
    if older(newest, version):
        return (f"{package} {version}: newer than the newest tested, {newest} (not known to fail: the test suite "
                "checks it)")
    return f"{package} {version}: within the tested range {lowest} to {newest}"
