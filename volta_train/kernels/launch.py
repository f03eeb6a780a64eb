"""Launching the compiled Volta kernels (filled in by the kernel issues)."""

from __future__ import annotations


def forward(*args, **kwargs):
    raise NotImplementedError("the Volta forward kernel is not part of this build yet")


def backward(*args, **kwargs):
    raise NotImplementedError("the Volta backward kernel is not part of this build yet")
