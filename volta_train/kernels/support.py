"""Which calls the Volta kernels run, and in words why not when they cannot: the kernels' one capability table."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..options import AttentionOptions
from . import head_dim as head_dims

MIN_ARCH = 70  # sm_70 (Volta): mma.sync.m8n8k4 and nothing newer
ALIGN_BYTES = 16  # the kernels move K, V, Q and O in 16-byte vectors


@dataclass(frozen=True)
class CallDescription:
    """What decides whether the kernels run a call: device, dtype, head dims, layout and options."""

    device: torch.device
    dtype: torch.dtype
    head_dim: int  # the caller's head_dim of q and k
    options: AttentionOptions
    value_head_dim: int | None = None  # v's head_dim, when it differs from head_dim
    varlen: bool = False
    alibi: bool = False
    backward: bool = False
    kvcache: bool = False
    aligned: bool = True  # 16-byte aligned pointers and strides that are multiples of 8 elements

    @property
    def widest_head_dim(self) -> int:
        """The larger of q/k's and v's head_dim: the kernels run q, k and v at one head_dim that holds both."""
        return max(self.head_dim, self.value_head_dim or 0)

    @property
    def kernel_head_dim(self) -> int | None:
        """The head_dim the kernels run this call at (inputs zero-padded to it); None: beyond every kernel."""
        if self.backward and self.device.type == "cuda":
            return head_dims.backward_head_dim(self.widest_head_dim, self.arch)
        return head_dims.forward_head_dim(self.widest_head_dim)

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


def describe(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: AttentionOptions, *, varlen: bool,
             alibi: bool, backward: bool = False, kvcache: bool = False,
             extra: tuple[torch.Tensor, ...] = ()) -> CallDescription:
    """The call as the kernels would run it. Padded copies are fresh, hence aligned; a call at a kernel head_dim is
    run on its own tensors, which must then be aligned."""
    head_dim = q.shape[-1]
    padded = head_dims.forward_head_dim(head_dim) != head_dim or v.shape[-1] != head_dim
    return CallDescription(
        device=q.device, dtype=q.dtype, head_dim=head_dim, options=options,
        value_head_dim=v.shape[-1] if v.shape[-1] != head_dim else None, varlen=varlen, alibi=alibi,
        backward=backward, kvcache=kvcache,
        aligned=q.is_cuda and (kvcache or padded or tensors_aligned(q, k, v, *extra)),
    )


@functools.lru_cache(maxsize=None)
def _compiler_problem(arch: int) -> str | None:
    from .nvrtc import NvrtcNotFoundError, find_nvrtc

    try:
        find_nvrtc(arch)
    except NvrtcNotFoundError as error:
        return str(error)
    return None


def unsupported_reason(call: CallDescription) -> str | None:
    """None when the kernels run this call; otherwise one short sentence saying why not.

    Every option of :class:`~volta_train.options.AttentionOptions` runs on the kernels: causal, windows, dropout,
    ALiBi, softcap, both accumulations, deterministic backward, varlen and the KV cache. What they lack is checked here.
    """
    from .tiles import SUPPORTED_HEAD_DIMS

    if call.device.type != "cuda":
        return f"input is on {call.device.type}: the Volta kernel needs a CUDA GPU"
    if call.dtype != torch.float16:
        return f"dtype {str(call.dtype).removeprefix('torch.')}: the Volta kernel runs float16 only"
    if call.arch < MIN_ARCH:
        return f"GPU is sm_{call.arch}: the Volta kernel needs sm_70 or newer"
    if call.value_head_dim is not None and call.kvcache:
        return f"v_cache's head_dim {call.value_head_dim} differs from q's {call.head_dim}: the decoding kernel runs one"
    if call.kernel_head_dim is None:
        return (f"head_dim {call.widest_head_dim}: the Volta kernels run head_dim 1 to {max(SUPPORTED_HEAD_DIMS)} (a "
                "larger tile does not fit the V100's 96 KiB of shared memory per block)")
    if not call.aligned:
        return "a tensor is not 16-byte aligned or has a stride that is not a multiple of 8 elements"
    if call.options.softmax_scale <= 0:
        return "softmax_scale <= 0: the Volta kernel needs a positive scale"
    problem = _compiler_problem(call.arch)
    if problem is not None:
        return f"no NVRTC to compile the kernel: {problem}"
    return None
