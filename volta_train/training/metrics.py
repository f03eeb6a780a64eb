"""Throughput and memory numbers for log lines."""

from __future__ import annotations

import sys
import time

import torch


def peak_memory(device: torch.device) -> tuple[float, str]:
    """(bytes, what was measured): CUDA's max allocated on a GPU, the process's peak RSS otherwise."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device)), "cuda max allocated"
    try:
        import resource
    except ImportError:  # not on Unix
        return float("nan"), "peak rss"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(rss if sys.platform == "darwin" else rss * 1024), "peak rss"


def format_bytes(n: float) -> str:
    if n != n:  # nan
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


class Throughput:
    """Tokens per second between successive :meth:`lap` calls, and over the whole run."""

    def __init__(self, device: torch.device):
        self.device = device
        self.start = self.last = time.perf_counter()
        self.tokens = self.last_tokens = 0

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def lap(self) -> float:
        """Tokens/s since the previous lap (waits for the GPU, so call it only at log points)."""
        self._sync()
        now = time.perf_counter()
        rate = (self.tokens - self.last_tokens) / max(now - self.last, 1e-9)
        self.last, self.last_tokens = now, self.tokens
        return rate

    def elapsed(self) -> float:
        self._sync()
        return time.perf_counter() - self.start

    def overall(self) -> float:
        return self.tokens / max(self.elapsed(), 1e-9)
