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


# Dense fp16 tensor-core peaks (TFLOP/s per device) that MFU is counted against. The V100's 125 is the
# SXM2 figure NVIDIA quotes for its m8n8k4 tensor cores; what the kernels are designed against.
PEAK_TFLOPS = (("V100", 125.0), ("A100", 312.0), ("H100", 989.0), ("H200", 989.0), ("A10G", 125.0), ("L4", 121.0))


def peak_tflops(device: torch.device) -> float | None:
    """The fp16 tensor-core peak of the device, from its name (None on CPU or an unlisted GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_TFLOPS:
        if key in name:
            return value
    return None


def matmul_parameters(model: torch.nn.Module) -> int:
    """Weights that take part in a matrix product per token: Linear and GPT-2's Conv1D weights, the LM head
    included even when it is tied to the input embedding (the lookup itself is free)."""
    total = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, torch.nn.Embedding) or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            continue
        if isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D":
            total += weight.numel() if weight.numel() else getattr(weight, "ds_numel", 0)  # ZeRO-3: ds_numel
    return total


class FlopCounter:
    """Model FLOPs of a training step (forward + backward, no recomputation: MFU, not hardware FLOPs).

    Per token, ``6 * matmul parameters``; attention scores and their product with V add, per layer
    and per sequence of length n (the part of a row a token attends to), ``6 * n^2 * d_attn`` under a
    causal mask (half of the 12 * n^2 * d of full attention) and ``12 * n^2 * d_attn`` without.
    Sequences are read from the batch: ``position_ids`` that restart (packed documents), else
    ``attention_mask`` (padding), else whole rows.
    """

    def __init__(self, matmul_params: int, n_layer: int, d_attn: int, causal: bool = True):
        self.matmul_params, self.n_layer, self.d_attn = matmul_params, n_layer, d_attn
        self.attn_coeff = (6 if causal else 12) * n_layer * d_attn

    def __call__(self, batch: dict) -> tuple[int, float]:
        """(tokens, FLOPs) of one micro-batch of CPU tensors."""
        ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        positions = batch.get("position_ids")
        if positions is not None:
            starts = positions == 0
            lengths = []
            for row in starts:
                idx = torch.nonzero(row).flatten().tolist() + [row.numel()]
                if idx[0] != 0:
                    idx = [0] + idx
                lengths += [b - a for a, b in zip(idx, idx[1:])]
            sq = sum(n * n for n in lengths)
            tokens = ids.numel()
        elif mask is not None:
            per_row = mask.sum(dim=-1)
            tokens = int(per_row.sum())
            sq = int((per_row.double() ** 2).sum())
        else:
            tokens = ids.numel()
            sq = ids.shape[0] * ids.shape[-1] ** 2
        return tokens, 6.0 * self.matmul_params * tokens + float(self.attn_coeff) * sq
