"""Which calls the Volta kernel can run, and in words why not when it cannot."""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_ARCH = 70  # sm_70 (Volta): mma.sync.m8n8k4 and nothing newer


@dataclass(frozen=True)
class CallDescription:
    device: torch.device
    dtype: torch.dtype
    head_dim: int
    varlen: bool
    causal: bool
    window: tuple[int, int]
    alibi: bool
    dropout: bool
    accum: str
    backward: bool = False
    deterministic: bool = False

    @property
    def arch(self) -> int:
        major, minor = torch.cuda.get_device_capability(self.device)
        return 10 * major + minor

    @property
    def device_name(self) -> str:
        return torch.cuda.get_device_name(self.device)


def unsupported_reason(call: CallDescription) -> str | None:
    """None when the kernel runs this call; otherwise one short sentence saying why not."""
    if call.device.type != "cuda":
        return f"input is on {call.device.type}: the Volta kernel needs a CUDA GPU"
    if call.dtype != torch.float16:
        return f"dtype {str(call.dtype).removeprefix('torch.')}: the Volta kernel runs float16 only"
    if call.arch < MIN_ARCH:
        return f"GPU is sm_{call.arch}: the Volta kernel needs sm_70 or newer"
    return "the Volta kernel is not part of this build yet"
