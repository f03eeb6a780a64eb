"""Numeric precision of both recipes, as one YAML section ``precision`` (flags ``--precision.x``).

Mixed precision (fp16 with dynamic loss scaling on a V100, bf16 where the GPU has it, or fp32), the loss scaler's
start and growth, and how many skipped fp16 steps in a row end a run: the options (:class:`PrecisionConfig`), their
checks (:func:`check`) and what "auto" becomes on the device the run lands on (:func:`resolve`). The Accelerator
that runs them is built in :mod:`.distributed`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .config import check_optimization, field, section
from .distributed import check_mixed_precision
from .models import auto_precision



@dataclass
class PrecisionConfig:
    mixed_precision: str = field("auto", "accelerate mixed precision: no, fp16, bf16, or auto (fp16 on a GPU, no on "
                                         "CPU, unless accelerate config chose one)",
                                 choices=["no", "fp16", "bf16", "auto"])
    loss_scale_init: float = field(65536.0, "fp16: initial dynamic loss scale (PyTorch GradScaler; DeepSpeed takes "
                                            "its JSON's initial_scale_power)")
    loss_scale_window: int = field(1000, "fp16: overflow-free steps before the loss scale doubles (GradScaler)")
    max_consecutive_skips: int = field(32, "fp16: stop the run (non-zero exit) after this many optimizer steps in a "
                                           "row skipped for non-finite gradients")


def config_section():
    """The `precision` section as a field of a recipe's configuration (both recipes embed it)."""
    return section(PrecisionConfig, "mixed precision and fp16 loss scaling")


def check(p: PrecisionConfig) -> None:
    check_optimization({kind: (f"precision.{kind}", getattr(p, kind))
                        for kind in ("loss_scale_init", "loss_scale_window", "max_consecutive_skips")})


def resolve(p: PrecisionConfig, device_type: str) -> PrecisionConfig:
    """``mixed_precision`` "auto" made concrete: fp16 on a GPU, fp32 on CPU, unless ``accelerate config`` chose one
    (:func:`.models.auto_precision`)."""
    if p.mixed_precision != "auto":
        return p
    on_gpu = device_type == "cuda"
    return dataclasses.replace(p, mixed_precision=auto_precision("fp16" if on_gpu else "no",
                                                                 "cuda" if on_gpu else "cpu"))


def check_device(p: PrecisionConfig, device) -> None:
    """Refuse precision.mixed_precision bf16 on a GPU without bfloat16 arithmetic (a V100), naming what would be
    accepted (:func:`.distributed.check_mixed_precision`)."""
    check_mixed_precision(p.mixed_precision, device, "precision.mixed_precision")
