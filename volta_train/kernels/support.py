"""Which calls the Volta kernels run, and in words why not when they cannot: the kernels' one capability table."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..options import AttentionOptions
from . import head_dim as head_dims
from . import nvrtc, tiles

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
    page_block_size: int = 0  # flash_attn_varlen_func reading a paged cache on the decoding kernel (0: not such a call)

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
             alibi: bool, backward: bool = False, kvcache: bool = False, page_block_size: int = 0,
             extra: tuple[torch.Tensor, ...] = ()) -> CallDescription:
    """The call as the kernels would run it. Padded copies are fresh, hence aligned; a call at a kernel head_dim is
    run on its own tensors, which must then be aligned (the decoding kernel's inputs are made so: decode.py).
    ``page_block_size``: a varlen call on a paged cache (k/v page pools) for the decoding kernel."""
    head_dim = q.shape[-1]
    padded = head_dims.forward_head_dim(head_dim) != head_dim or v.shape[-1] != head_dim
    decoding = kvcache or page_block_size > 0
    return CallDescription(
        device=q.device, dtype=q.dtype, head_dim=head_dim, options=options,
        value_head_dim=v.shape[-1] if v.shape[-1] != head_dim else None, varlen=varlen, alibi=alibi,
        backward=backward, kvcache=kvcache, page_block_size=page_block_size,
        aligned=q.is_cuda and (decoding or padded or tensors_aligned(q, k, v, *extra)),
    )


@functools.lru_cache(maxsize=None)
def _compiler_problem(arch: int) -> str | None:
    try:
        nvrtc.find_nvrtc(arch)
    except nvrtc.NvrtcNotFoundError as error:
        return str(error)
    return None


def unsupported_reason(call: CallDescription) -> str | None:
    """None when the kernels run this call; otherwise one short sentence saying why not.

    Every option of :class:`~volta_train.options.AttentionOptions` runs on the kernels: causal, windows, dropout,
    ALiBi, softcap, both accumulations, deterministic backward, varlen and the KV cache. What they lack is checked here.
    A varlen call on a paged cache (``page_block_size``; inference only, no dropout: ``dispatch.paged_varlen_choice``)
    runs on the decoding kernel, which reads the pages through the block table: with fp32 accumulation, v's head_dim
    that of q, pages a multiple of the decoding tile's key block (else flash_attn_varlen_func gathers the pages and
    runs the varlen forward).
    """
    if call.device.type != "cuda":
        return f"input is on {call.device.type}: the Volta kernel needs a CUDA GPU"
    if call.dtype != torch.float16:
        return f"dtype {str(call.dtype).removeprefix('torch.')}: the Volta kernel runs float16 only"
    if call.arch < MIN_ARCH:
        return f"GPU is sm_{call.arch}: the Volta kernel needs sm_70 or newer"
    paged_varlen = call.page_block_size > 0
    if call.value_head_dim is not None and (call.kvcache or paged_varlen):
        return f"v_cache's head_dim {call.value_head_dim} differs from q's {call.head_dim}: the decoding kernel runs one"
    if call.kernel_head_dim is None:
        return (f"head_dim {call.widest_head_dim}: the Volta kernels run head_dim 1 to {max(tiles.SUPPORTED_HEAD_DIMS)} (a "
                "larger tile does not fit the V100's 96 KiB of shared memory per block)")
    if paged_varlen:
        if call.options.accum != "fp32":
            return f"accum={call.options.accum!r}: the decoding kernel that reads pages accumulates in fp32 only"
        block_n = tiles.decode_tile(call.kernel_head_dim, call.arch).block_n
        if call.page_block_size % block_n:
            return (f"page_block_size {call.page_block_size}: the decoding kernel reads key blocks of {block_n} "
                    "within one page")
    if not call.aligned:
        return "a tensor is not 16-byte aligned or has a stride that is not a multiple of 8 elements"
    if call.options.softmax_scale <= 0:
        return "softmax_scale <= 0: the Volta kernel needs a positive scale"
    problem = _compiler_problem(call.arch)
    if problem is not None:
        return f"no NVRTC to compile the kernel: {problem}"
    return None
