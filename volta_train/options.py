"""The options of one attention call: one value that travels from the public API to either backend.

The custom ops in :mod:`volta_train.dispatch` carry it packed (:meth:`AttentionOptions.pack`: a list of floats and a
list of ints), so that adding an option means adding a field here, its validation, and its use in the backends.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

ACCUM_CHOICES = ("fp32", "fp16")
# "auto": the kernels' choice, fp32 accumulation on every target today (kernels.launch.resolve_bwd_accum)
BWD_ACCUM_CHOICES = ("auto", "fp32", "fp16")
_INT64_WRAP = 1 << 64


@dataclass(frozen=True)
class AttentionOptions:
    """Everything but the tensors and the shapes that defines one attention call."""

    softmax_scale: float
    causal: bool = False
    window_left: int = -1  # -1: unbounded
    window_right: int = -1  # -1: unbounded (causal forces 0)
    dropout_p: float = 0.0
    seed: int = 0  # Philox key and counter offset of the dropout mask, unsigned 64-bit
    offset: int = 0
    softcap: float = 0.0  # 0: off; > 0: scores become softcap * tanh(scores / softcap)
    accum: str = "fp32"  # the forward's tensor-core accumulation (kernel backend only)
    bwd_accum: str = "auto"  # the backward's (kernel backend only)
    deterministic: bool = False  # a bitwise reproducible backward

    @property
    def right_limit(self) -> int:
        """The right window the masks use: 0 under causal."""
        return 0 if self.causal else self.window_right

    @property
    def window(self) -> tuple[int, int]:
        return self.window_left, self.window_right

    def paged_refusal(self) -> str | None:
        """Why a call that reads a paged cache cannot run with these options, or None. The paged path runs inference
        only, without dropout (flash_attn_varlen_func gathers the pages of such a call instead: dispatch)."""
        return f"dropout_p={self.dropout_p}: the paged path has no dropout" if self.dropout_p > 0 else None

    def check_paged(self) -> None:
        """Raise ValueError with :meth:`paged_refusal`'s reason (the paged backends' guard)."""
        reason = self.paged_refusal()
        if reason is not None:
            raise ValueError(f"{reason}; accepted: dropout_p=0")

    def pack(self) -> tuple[list[float], list[int]]:
        """(floats, ints) in field order, the form the custom ops' schema can carry; str fields as choice indices."""
        floats: list[float] = []
        ints: list[int] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "float":
                floats.append(float(value))
            elif f.type == "str":
                ints.append(_CHOICES[f.name].index(value))
            elif f.name in _UNSIGNED:
                ints.append(to_int64(value))
            else:
                ints.append(int(value))
        return floats, ints

    @classmethod
    def unpack(cls, floats: list[float], ints: list[int]) -> AttentionOptions:
        """The inverse of :meth:`pack`."""
        values = {}
        next_float, next_int = iter(floats), iter(ints)
        for f in dataclasses.fields(cls):
            if f.type == "float":
                values[f.name] = next(next_float)
            elif f.type == "str":
                values[f.name] = _CHOICES[f.name][next(next_int)]
            elif f.type == "bool":
                values[f.name] = bool(next(next_int))
            elif f.name in _UNSIGNED:
                values[f.name] = next(next_int) % _INT64_WRAP
            else:
                values[f.name] = next(next_int)
        return cls(**values)


_CHOICES = {"accum": ACCUM_CHOICES, "bwd_accum": BWD_ACCUM_CHOICES}
_UNSIGNED = ("seed", "offset")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision the PyTorch paths (reference backend, rotary, S_dmask) compute in, and the log-sum-exp's dtype:
    fp64 for fp64 inputs, fp32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def to_int64(value: int) -> int:
    """A 64-bit value (a Philox seed or offset) as the signed int64 a custom op carries."""
    value %= _INT64_WRAP
    return value - _INT64_WRAP if value >= (1 << 63) else value
