"""Compatibility name of :mod:`volta_train.kernels.tiles` (the tile tables), kept for code that imports
``volta_train.kernels.configs``; new code imports ``tiles``."""

from .tiles import *  # noqa: F401,F403
from .tiles import _pick  # noqa: F401
