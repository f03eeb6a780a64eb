"""This checkout: its root directory, and the environment a child process needs to import this checkout's volta_train
(not an installed one, nor another checkout's) whatever its working directory."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def checkout_env(*paths: Path | str, env: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """``env`` (default: os.environ) with ``extra`` set and this checkout, then ``paths``, first on PYTHONPATH."""
    env = dict(os.environ if env is None else env, **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), *map(str, paths), env.get("PYTHONPATH")]))
    return env
