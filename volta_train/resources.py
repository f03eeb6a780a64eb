"""Where the files volta_train ships beside its Python code live: the CUDA sources and the YAML/JSON configs.

In a checkout they have one home each, at the repository root: ``csrc/`` and ``configs/``. A wheel or an sdist
build copies them into the package as ``volta_train/_csrc`` and ``volta_train/_configs`` (setup.py: ``build_py``),
so an installed package finds them beside its modules. A checkout is recognised by ``pyproject.toml`` beside the
package directory; there the root directories win, so that edits to ``csrc/`` are what compiles.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
CHECKOUT_ROOT = PACKAGE_DIR.parent
CSRC_ENV = "VOLTA_TRAIN_CSRC"  # a directory of CUDA sources to compile instead of the shipped ones


def _is_checkout() -> bool:
    return (CHECKOUT_ROOT / "pyproject.toml").is_file()


def _candidates(root_name: str, packaged_name: str) -> list[Path]:
    checkout, packaged = CHECKOUT_ROOT / root_name, PACKAGE_DIR / packaged_name
    return [checkout, packaged] if _is_checkout() else [packaged]


def csrc_candidates() -> list[Path]:
    """The directories searched for the CUDA sources, in order."""
    if os.environ.get(CSRC_ENV):
        return [Path(os.environ[CSRC_ENV])]
    return _candidates("csrc", "_csrc")


def csrc_dir() -> Path:
    """The directory of the CUDA sources (``*.cu``, ``*.cuh``) that the kernels compile from."""
    candidates = csrc_candidates()
    for candidate in candidates:
        if candidate.is_dir() and any(candidate.glob("*.cuh")):
            return candidate
    where = " and ".join(map(str, candidates))
    hint = f" ({CSRC_ENV} is set)" if os.environ.get(CSRC_ENV) else \
        ": reinstall volta_train from a wheel or sdist built by its setup.py, or run from a checkout"
    raise FileNotFoundError(f"no CUDA source directory: looked for *.cuh in {where}{hint}")


def configs_dir() -> Path:
    """The shipped configs: ``accelerate/``, ``deepspeed/``, ``gpt_long/``, ``finetune/``."""
    candidates = _candidates("configs", "_configs")
    for candidate in candidates:
        if (candidate / "deepspeed").is_dir():
            return candidate
    raise FileNotFoundError(f"no configs directory: looked for {' and '.join(map(str, candidates))}")


def data_dir() -> Path:
    """The shipped sample data (``samples/*.jsonl``) the fine-tuning configs train on."""
    candidates = _candidates("data", "_data")
    for candidate in candidates:
        if (candidate / "samples").is_dir():
            return candidate
    raise FileNotFoundError(f"no sample data directory: looked for {' and '.join(map(str, candidates))}")


def shipped_config(relative: str | os.PathLike) -> Path | None:
    """``configs/<relative>`` (e.g. ``"deepspeed/zero2.json"``, or with the ``configs/`` prefix), if shipped."""
    parts = Path(relative).parts
    if parts and parts[0] == "configs":
        parts = parts[1:]
    if not parts:
        return None
    try:
        path = configs_dir().joinpath(*parts)
    except FileNotFoundError:
        return None
    return path if path.exists() else None


def shipped_path(relative: str | os.PathLike) -> Path | None:
    """A path written relative to the repository root (``configs/...`` or ``data/...``), found in what is shipped.

    The shipped configs name their models and sample data that way; run from elsewhere than a checkout's root
    (an installed package), those paths are found here. None when it is neither.
    """
    parts = Path(relative).parts
    if Path(relative).is_absolute() or len(parts) < 2:
        return None
    if parts[0] == "configs":
        return shipped_config(relative)
    if parts[0] == "data":
        try:
            path = data_dir().joinpath(*parts[1:])
        except FileNotFoundError:
            return None
        return path if path.exists() else None
    return None


def config_names(family: str) -> list[str]:
    """The shipped YAML configs of a recipe (``"gpt_long"``, ``"finetune"``), by name without ``.yaml``."""
    try:
        return sorted(p.stem for p in (configs_dir() / family).glob("*.yaml"))
    except FileNotFoundError:
        return []


def resolve_config_option(argv: list[str], family: str) -> list[str]:
    """``--config NAME`` (a shipped config's name, e.g. ``cpu_tiny``) becomes that file's path; others stay.

    A value that is neither a file nor a shipped name stops with the accepted names.
    """
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--config" and i + 1 < len(out):
            index, value = i + 1, out[i + 1]
        elif arg.startswith("--config="):
            index, value = i, arg.split("=", 1)[1]
        else:
            continue
        if Path(value).is_file():
            continue
        stem = value.removesuffix(".yaml")
        shipped = shipped_config(f"{family}/{stem}.yaml") or shipped_path(value)
        if shipped is None:
            names = config_names(family)
            close = difflib.get_close_matches(stem, names, n=1)
            raise FileNotFoundError(f"--config {value!r} is neither a file nor a shipped {family} config"
                                    f"{f' (did you mean {close[0]!r}?)' if close else ''}; shipped: "
                                    f"{', '.join(names) if names else 'none found'}")
        out[index] = str(shipped) if index == i + 1 else f"--config={shipped}"
    return out
