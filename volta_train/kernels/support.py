"""Which calls the Volta kernel can run, and in words why not when it cannot."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

MIN_ARCH = 70  # sm_70 (Volta): mma.sync.m8n8k4 and nothing newer
# flash-attn 2.8 features of volta_train.dispatch.KERNEL_FEATURE_GAPS the kernels have (the dispatcher sends such
# calls to them): logit soft-capping in every forward, backward and dQ kernel (csrc/softcap.cuh);
# flash_attn_with_kvcache on the split-KV decoding kernel (volta_train/kernels/decode.py)
KERNEL_FEATURES: frozenset[str] = frozenset({"softcap", "kvcache"})
ALIGN_BYTES = 16  # the kernels move K, V, Q and O in 16-byte vectors


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
    aligned: bool = True  # 16-byte aligned pointers and strides that are multiples of 8 elements
    positive_scale: bool = True

    @property
    def arch(self) -> int:
        major, minor = torch.cuda.get_device_capability(self.device)
        return 10 * major + minor

    @property
    def device_name(self) -> str:
        return torch.cuda.get_device_name(self.device)


def tensors_aligned(*tensors: torch.Tensor | None) -> bool:
    """True when every tensor's pointer is 16-byte aligned and its strides (but the last) are multiples of 8."""
    for t in tensors:
        if t is None:
            continue
        if t.data_ptr() % ALIGN_BYTES != 0:
            return False
        if any(s % 8 != 0 for s in t.stride()[:-1]):
            return False
    return True


@functools.lru_cache(maxsize=None)
def _compiler_problem(arch: int) -> str | None:
    from .nvrtc import NvrtcNotFoundError, find_nvrtc

    try:
        find_nvrtc(arch)
    except NvrtcNotFoundError as error:
        return str(error)
    return None


def unsupported_reason(call: CallDescription) -> str | None:
    """None when the kernel runs this call; otherwise one short sentence saying why not."""
    from .tiles import SUPPORTED_HEAD_DIMS

    if call.device.type != "cuda":
        return f"input is on {call.device.type}: the Volta kernel needs a CUDA GPU"
    if call.dtype != torch.float16:
        return f"dtype {str(call.dtype).removeprefix('torch.')}: the Volta kernel runs float16 only"
    if call.arch < MIN_ARCH:
        return f"GPU is sm_{call.arch}: the Volta kernel needs sm_70 or newer"
    if call.head_dim not in SUPPORTED_HEAD_DIMS:
        return (
            f"head_dim {call.head_dim}: the Volta kernel supports {', '.join(map(str, SUPPORTED_HEAD_DIMS))} "
            "(the dispatcher zero-pads other head dims up to 256 to the next of them)"
        )
    if not call.aligned:
        return "a tensor is not 16-byte aligned or has a stride that is not a multiple of 8 elements"
    if not call.positive_scale:
        return "softmax_scale <= 0: the Volta kernel needs a positive scale"
    problem = _compiler_problem(call.arch)
    if problem is not None:
        return f"no NVRTC to compile the kernel: {problem}"
    return None
