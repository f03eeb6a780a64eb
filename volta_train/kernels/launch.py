"""Launching the compiled Volta kernels on PyTorch's current stream."""

from __future__ import annotations

import ctypes
import math

import torch

from .. import philox
from ..options import AttentionOptions
from . import head_dim as head_dims
from . import tiles
from .params import BackwardKernelParams, KernelParams

MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y and z (order_grid turns a grid round past it)
LOG2E = 1.0 / math.log(2.0)


def _arch(device: torch.device) -> int:
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def _kernel(variant, device: torch.device):
    """The variant's kernel on device, launched with the threads and shared memory its compiled traits export."""
    return variant.load(device, _arch(device))


def _strides(t: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, row, head) strides in elements; varlen tensors have no batch axis."""
    if varlen:
        return 0, t.stride(0), t.stride(1)
    return t.stride(0), t.stride(1), t.stride(2)


def fill_common(prm: KernelParams, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                options: AttentionOptions, block_m: int, alibi_slopes: torch.Tensor | None = None) -> tuple[int, int]:
    """Pointers, strides, lengths, masks and dropout state; returns the launch grid."""
    varlen = cu_seqlens_q is not None
    nheads, nheads_kv = q.shape[-2], k.shape[-2]
    batch = cu_seqlens_q.numel() - 1 if varlen else q.shape[0]
    for name, t in (("q", q), ("k", k), ("v", v), ("o", out)):
        setattr(prm, name, t.data_ptr())
        b, r, h = _strides(t, varlen)
        setattr(prm, f"{name}_batch_stride", b)
        setattr(prm, f"{name}_row_stride", r)
        setattr(prm, f"{name}_head_stride", h)
    prm.lse = lse.data_ptr()
    if varlen:  # (the decoding kernel's packed queries come without cu_seqlens_k: it takes seqused_k)
        prm.cu_seqlens_q = cu_seqlens_q.data_ptr()
        prm.cu_seqlens_k = cu_seqlens_k.data_ptr() if cu_seqlens_k is not None else None
        prm.lse_batch_stride, prm.lse_head_stride = 0, lse.stride(0)
    else:
        prm.cu_seqlens_q = prm.cu_seqlens_k = None
        prm.lse_batch_stride, prm.lse_head_stride = lse.stride(0), lse.stride(1)
    prm.seqlen_q, prm.seqlen_k = max_seqlen_q, max_seqlen_k
    if alibi_slopes is not None:  # [H] or [B, H] fp32, contiguous (made so by the caller)
        prm.alibi_slopes = alibi_slopes.data_ptr()
        prm.alibi_batch_stride = nheads if alibi_slopes.dim() == 2 else 0
    else:
        prm.alibi_slopes, prm.alibi_batch_stride = None, 0
    prm.nheads, prm.heads_per_kv = nheads, nheads // nheads_kv
    prm.num_m_blocks = max(1, -(-max_seqlen_q // block_m))
    prm.window_left = options.window_left
    prm.window_right = options.right_limit
    prm.scale_log2 = options.softmax_scale * LOG2E
    prm.seed, prm.offset = options.seed, options.offset
    prm.dropout_threshold = philox.dropout_threshold(options.dropout_p) if options.dropout_p > 0 else 0
    prm.dropout_rescale = 1.0 / (1.0 - options.dropout_p)
    prm.softcap_log2 = options.softcap * LOG2E  # read only by the softcap variants (softcap > 0)
    # causal: heads fastest (longest query blocks first everywhere); full: query blocks fastest (L2 reuse of K/V)
    fastest, grid = order_grid(prm.num_m_blocks, batch * nheads, not options.causal, "query blocks")
    prm.m_blocks_fastest = int(fastest)
    return grid


def order_grid(blocks: int, heads: int, blocks_fastest: bool, what: str) -> tuple[bool, tuple[int, int]]:
    """(blocks_fastest, grid): a kernel's blocks and its batch x heads in grid x and y in the preferred order, or
    the other way round where the preferred y count passes CUDA's limit on grid y (x takes 2^31 - 1)."""
    if (heads if blocks_fastest else blocks) > MAX_GRID_Y:
        blocks_fastest = not blocks_fastest
    grid = (blocks, heads) if blocks_fastest else (heads, blocks)
    if grid[1] > MAX_GRID_Y:
        raise ValueError(f"{blocks} {what} and {heads} batch x heads: a launch takes one of them above {MAX_GRID_Y} "
                         f"(CUDA's limit on grid y), not both; accepted: fewer sequences x heads or shorter sequences")
    return blocks_fastest, grid


def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options: AttentionOptions,
            alibi_slopes=None, *, tile: tiles.FwdTile | None = None, out: torch.Tensor | None = None,
            lse: torch.Tensor | None = None):
    """Volta forward kernel: returns (out, lse) like the reference backend, at the caller's head_dim.

    ``tile`` overrides the tile table (sweeps); ``out``/``lse`` let tests hand in poisoned buffers.
    """
    head_dim, value_dim = q.shape[-1], v.shape[-1]
    widest = max(head_dim, value_dim)
    kernel_d = head_dims.require(widest, head_dims.forward_head_dim(widest))
    if kernel_d == head_dim == value_dim:
        return _run_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options, alibi_slopes,
                            tile, out, lse)
    # q, k and v zero-padded to one kernel head_dim; the output's columns past v's head_dim are zeros, dropped
    q, k, v = (head_dims.pad(t, kernel_d) for t in (q, k, v))
    out_d, lse = _run_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options, alibi_slopes,
                              tile, None, lse)
    if out is None:
        return out_d[..., :value_dim], lse
    return out.copy_(out_d[..., :value_dim]), lse


def _run_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options: AttentionOptions,
                 alibi_slopes, tile, out, lse):
    """The forward kernel's launch at a head_dim it is built for."""
    head_dim = q.shape[-1]
    alibi_slopes = alibi_slopes.contiguous() if alibi_slopes is not None else None
    varlen = cu_seqlens_q is not None
    if out is None:
        out = torch.empty(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype, device=q.device)
    if lse is None:
        lse_shape = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
        lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    tile = tile or tiles.fwd_tile(head_dim, options.causal, _arch(q.device))
    variant = tiles.fwd_variant(head_dim, tile, options.accum == "fp16", options.dropout_p > 0, options.softcap > 0)
    kernel = _kernel(variant, q.device)
    prm = KernelParams()
    grid = fill_common(prm, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options,
                       kernel.geometry.block_m, alibi_slopes)
    kernel.launch(grid, [prm])
    return out, lse


def _set_strides(prm, name: str, t: torch.Tensor, varlen: bool) -> None:
    b, r, h = _strides(t, varlen)
    setattr(prm, f"{name}_batch_stride", b)
    setattr(prm, f"{name}_row_stride", r)
    setattr(prm, f"{name}_head_stride", h)


def resolve_bwd_accum(bwd_accum: str) -> str:
    """"fp16" or "fp32". ``"auto"`` is fp32 accumulation on every target: FP16-ACC is nowhere both within flash-attn's
    accuracy standard and the faster mode (a V100 runs both at one HMMA rate and every sm_70 tile is spill-free in
    fp32; on sm_80+ the emulated fp32-accumulating m8n8k4 is the faster one). docs/accuracy.md."""
    return "fp32" if bwd_accum == "auto" else bwd_accum


def dot_do_o(dout: torch.Tensor, out: torch.Tensor, varlen: bool) -> torch.Tensor:
    """D = rowsum(dO * O), products and sums in fp32, laid out like lse ([B, H, Nq], or [H, total_q] for varlen): the
    preprocess kernel's D (:func:`backward_preprocess`) in PyTorch, its specification in the kernel tests."""
    rows = (dout.float() * out.float()).sum(-1)
    return (rows.t() if varlen else rows.transpose(1, 2)).contiguous()


def backward_preprocess(bp: BackwardKernelParams, q: torch.Tensor, varlen: bool) -> None:
    """D = rowsum(dO * O) into bp.dsum and, where bp.dq_accum is set, dQ's fp32 sums zeroed: one kernel, one read of
    dO and O (csrc/flash_bwd_preprocess.cu; :func:`dot_do_o` is its specification). Packed tensors run as one batch
    of all their rows; a dense batch past grid z's limit runs in slices of batches (pointers moved, strides kept)."""
    batch, rows = (1, q.shape[0]) if varlen else (q.shape[0], q.shape[1])
    nheads = q.shape[-2]
    if rows == 0:
        return
    if nheads > MAX_GRID_Y:
        raise ValueError(f"q has {nheads} heads: the backward preprocess's grid takes at most {MAX_GRID_Y}")
    kernel = _kernel(tiles.preprocess_variant(q.shape[-1]), q.device)
    for first in range(0, batch, MAX_GRID_Y):
        part = bp if first == 0 else _from_batch(bp, first, q.element_size())
        grid = (-(-rows // kernel.geometry.block_m), nheads, min(MAX_GRID_Y, batch - first))
        kernel.launch(grid, [part, ctypes.c_int(rows)])


def _from_batch(bp: BackwardKernelParams, first: int, half: int) -> BackwardKernelParams:
    """A copy of bp whose o, dO, D and dQ sums start at batch ``first`` (the preprocess's reads and writes)."""
    part = BackwardKernelParams.from_buffer_copy(bp)
    part.fwd.o += first * bp.fwd.o_batch_stride * half
    part.dout += first * bp.do_batch_stride * half
    part.dsum += first * bp.fwd.lse_batch_stride * 4
    if bp.dq_accum is not None:
        part.dq_accum += first * bp.dq_batch_stride * 4
    return part


def finish_dq(dq_accum: torch.Tensor, softmax_scale: float, dtype: torch.dtype) -> torch.Tensor:
    """dQ from its fp32 atomics' sums: scaled by softmax_scale in fp32 and rounded to dtype in one pass (no second
    fp32 buffer of q's size)."""
    dq = torch.empty(dq_accum.shape, dtype=dtype, device=dq_accum.device)
    return torch.mul(dq_accum, softmax_scale, out=dq)


def backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
             options: AttentionOptions, alibi_slopes=None, *, tile: tiles.BwdTile | None = None,
             dq_tile: tiles.FwdTile | None = None, kernel_head_dim: int | None = None):
    """Volta backward: (dq, dk, dv) at the caller's head_dim. dK/dV kernel over key blocks; dQ by its fp32 atomics,
    or (deterministic, or head dims without an atomic tile) by the dQ kernel over query blocks, bitwise reproducible.

    The inputs are zero-padded to the backward kernels' head_dim (``head_dim.backward_head_dim`` of the larger of
    q/k's and v's head_dim, or ``kernel_head_dim`` with the tile overrides of another table) and the gradients'
    padded columns dropped: dq and dk at q/k's head_dim, dv at v's."""
    head_dim, value_dim = q.shape[-1], v.shape[-1]
    widest = max(head_dim, value_dim)
    arch = _arch(q.device)
    kernel_d = kernel_head_dim or head_dims.require(widest, head_dims.backward_head_dim(widest, arch))
    if kernel_d != head_dim or kernel_d != value_dim:
        if kernel_d < widest:
            raise ValueError(f"kernel_head_dim={kernel_d}: smaller than the inputs' head_dim {widest}; accepted: "
                             f"None (the tile table's choice) or a kernel head_dim >= {widest}")
        padded = [head_dims.pad(t, kernel_d) for t in (dout, q, k, v, out)]
        dq, dk, dv = _run_backward(*padded, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options,
                                   alibi_slopes, tile, dq_tile, arch)
        return dq[..., :head_dim].contiguous(), dk[..., :head_dim].contiguous(), dv[..., :value_dim].contiguous()
    return _run_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options,
                         alibi_slopes, tile, dq_tile, arch)


def _run_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  options: AttentionOptions, alibi_slopes, tile, dq_tile, arch: int):
    """The backward kernels' launches at a head_dim they are built for."""
    head_dim = q.shape[-1]
    alibi_slopes = alibi_slopes.contiguous() if alibi_slopes is not None else None
    varlen = cu_seqlens_q is not None
    bwd_accum = resolve_bwd_accum(options.bwd_accum)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if q.numel() == 0 or k.numel() == 0:
        return torch.zeros_like(q), dk.zero_(), dv.zero_()
    accum_f16, dropout = bwd_accum == "fp16", options.dropout_p > 0
    tile = tile or tiles.bwd_tile(head_dim, arch, accum_f16)
    use_atomics = tiles.dq_by_atomics(tile, options.deterministic)
    batch = cu_seqlens_q.numel() - 1 if varlen else q.shape[0]
    nheads_kv = k.shape[-2]

    variant = tiles.bwd_variant(head_dim, tile, accum_f16, dropout, use_atomics, options.softcap > 0)
    kernel = _kernel(variant, q.device)
    bp = BackwardKernelParams()
    fill_common(bp.fwd, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options,
                kernel.geometry.block_m, alibi_slopes)
    # D, written by the preprocess and read by the kernels through lse's strides
    dsum = torch.empty_strided(lse.shape, lse.stride(), dtype=torch.float32, device=q.device)
    bp.dout, bp.dk, bp.dv, bp.dsum = dout.data_ptr(), dk.data_ptr(), dv.data_ptr(), dsum.data_ptr()
    for name, t in (("do", dout), ("dk", dk), ("dv", dv)):
        _set_strides(bp, name, t, varlen)
    bp.softmax_scale = options.softmax_scale
    bp.num_n_blocks = -(-max_seqlen_k // kernel.geometry.block_n)
    dq_accum = torch.empty(q.shape, dtype=torch.float32, device=q.device) if use_atomics else None  # zeroed below
    dq = None if use_atomics else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dq_target = dq_accum if use_atomics else dq
    bp.dq_accum = dq_accum.data_ptr() if use_atomics else None
    bp.dq = dq.data_ptr() if dq is not None else None
    _set_strides(bp, "dq", dq_target, varlen)
    backward_preprocess(bp, q, varlen)

    # Grid order: key blocks fastest (a head's CTAs share Q and dO in L2), or (batch, kv head) fastest, which
    # dispatches every head's longest causal key blocks first (none left for the grid's tail): for causal calls on
    # the emulated m8n8k4 (compute-bound). Either turns round where its y count passes grid y's limit.
    keys_fastest, blocks = order_grid(bp.num_n_blocks, batch * nheads_kv,
                                      not (options.causal and arch >= tiles.EMULATED_MMA_ARCH), "key blocks")
    bp.fwd.m_blocks_fastest = int(keys_fastest)
    # split tiles: tile.out_split CTAs per key block (grid z: the slice of dK / dV columns each one writes)
    grid = blocks + ((tile.out_split,) if tile.out_split > 1 else ())
    kernel.launch(grid, [bp])
    if use_atomics:
        return finish_dq(dq_accum, options.softmax_scale, q.dtype), dk, dv
    dq_tile = dq_tile or tiles.dq_tile(head_dim, arch)
    dq_kernel = _kernel(tiles.dq_variant(head_dim, dq_tile, False, dropout, options.softcap > 0), q.device)
    grid = fill_common(bp.fwd, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options,
                       dq_kernel.geometry.block_m, alibi_slopes)
    dq_kernel.launch(grid, [bp])
    return dq, dk, dv
