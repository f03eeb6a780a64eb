"""ctypes mirrors of the kernels' parameter structs in csrc/params.cuh (``AttentionParams``, ``SplitKvParams``,
``BackwardParams``): same fields, same order."""

from __future__ import annotations

import ctypes

_POINTERS = ("q", "k", "v", "o", "lse", "cu_seqlens_q", "cu_seqlens_k", "alibi_slopes")
_STRIDES = (
    "alibi_batch_stride",
    "q_batch_stride", "q_row_stride", "q_head_stride",
    "k_batch_stride", "k_row_stride", "k_head_stride",
    "v_batch_stride", "v_row_stride", "v_head_stride",
    "o_batch_stride", "o_row_stride", "o_head_stride",
    "lse_batch_stride", "lse_head_stride",
)


class KernelParams(ctypes.Structure):
    """ctypes mirror of ``AttentionParams`` in csrc/params.cuh: what every kernel reads."""

    _fields_ = (
        [(name, ctypes.c_void_p) for name in _POINTERS]
        + [(name, ctypes.c_longlong) for name in _STRIDES]
        + [("seed", ctypes.c_ulonglong), ("offset", ctypes.c_ulonglong)]
        + [
            ("seqlen_q", ctypes.c_int),
            ("seqlen_k", ctypes.c_int),
            ("nheads", ctypes.c_int),
            ("heads_per_kv", ctypes.c_int),
            ("num_m_blocks", ctypes.c_int),
            ("window_left", ctypes.c_int),
            ("window_right", ctypes.c_int),
            ("scale_log2", ctypes.c_float),
            ("dropout_threshold", ctypes.c_uint),
            ("dropout_rescale", ctypes.c_float),
            ("m_blocks_fastest", ctypes.c_int),
            ("softcap_log2", ctypes.c_float),  # fills what was the struct's tail padding: the size is unchanged
        ]
    )


assert ctypes.sizeof(KernelParams) == 248, "KernelParams must match AttentionParams in csrc/params.cuh (248 bytes)"


class SplitKvKernelParams(KernelParams):
    """ctypes mirror of ``SplitKvParams`` in csrc/params.cuh (the split-KV decoding kernel): ``AttentionParams``'
    fields, then these (a ctypes subclass appends its fields after the base's, as the C++ derived struct does)."""

    _fields_ = (
        [(name, ctypes.c_void_p) for name in ("seqused_k", "k_batch_index", "leftpad_k", "o_partial", "lse_partial")]
        + [("num_splits", ctypes.c_int), ("blocks_per_split", ctypes.c_int)]
        + [("block_table", ctypes.c_void_p), ("block_table_batch_stride", ctypes.c_int),
           ("page_block_size", ctypes.c_int)]  # paged KV cache; block_table None: contiguous K/V
    )


assert ctypes.sizeof(SplitKvKernelParams) == 248 + 5 * 8 + 2 * 4 + 8 + 2 * 4, "SplitKvKernelParams must match SplitKvParams"


_BWD_STRIDES = tuple(f"{t}_{axis}_stride" for t in ("do", "dq", "dk", "dv") for axis in ("batch", "row", "head"))


class BackwardKernelParams(ctypes.Structure):
    """ctypes mirror of ``BackwardParams`` in csrc/params.cuh."""

    _fields_ = (
        [("fwd", KernelParams)]
        + [(name, ctypes.c_void_p) for name in ("dout", "dq_accum", "dq", "dk", "dv", "dsum")]
        + [(name, ctypes.c_longlong) for name in _BWD_STRIDES]
        + [("softmax_scale", ctypes.c_float), ("num_n_blocks", ctypes.c_int)]
    )


assert ctypes.sizeof(BackwardKernelParams) == 248 + 6 * 8 + 12 * 8 + 8, "BackwardKernelParams must match BackwardParams in csrc/params.cuh"

