"""Input checks for the public attention API: every error names the argument, what it got and what is accepted."""

from __future__ import annotations

import torch

MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
VOLTA_MAJOR = 7


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def _require_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def is_volta(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    major, minor = torch.cuda.get_device_capability(device)
    return major == VOLTA_MAJOR and minor == 0


def check_dtype_and_devices(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            raise ValueError(
                f"{name} is on {t.device} but q is on {q.device}: q, k and v must be on the same device"
            )
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}: q, k and v must share one dtype")
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"q has dtype {q.dtype}; accepted: float16 (the Volta kernel), bfloat16 (not on V100), "
            "float32 or float64 (reference backend)"
        )
    if q.dtype == torch.bfloat16 and is_volta(q.device):
        raise TypeError(
            "q has dtype bfloat16, but a V100 (sm_70) has no bfloat16 tensor cores: use float16 with dynamic "
            "loss scaling (torch.amp.GradScaler, accelerate --mixed_precision fp16 or DeepSpeed fp16)"
        )


def check_head_dims(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_axis: int) -> None:
    """head_axis: the axis of the heads (dense 2, varlen 1); head_dim is the last axis."""
    head_dim = q.shape[-1]
    if head_dim > MAX_HEAD_DIM or head_dim % HEAD_DIM_MULTIPLE != 0 or head_dim == 0:
        raise ValueError(
            f"q has head_dim {head_dim}; accepted: a multiple of {HEAD_DIM_MULTIPLE} from 8 to {MAX_HEAD_DIM}"
        )
    if k.shape[-1] != head_dim:
        raise ValueError(f"k has head_dim {k.shape[-1]} but q has {head_dim}: they must be equal")
    if v.shape[-1] != head_dim:
        raise ValueError(f"v has head_dim {v.shape[-1]} but q has {head_dim}: they must be equal")
    if k.shape[head_axis] != v.shape[head_axis]:
        raise ValueError(
            f"k has {k.shape[head_axis]} heads but v has {v.shape[head_axis]}: k and v must have the same heads"
        )
    nheads, nheads_kv = q.shape[head_axis], k.shape[head_axis]
    if nheads_kv == 0 or nheads % nheads_kv != 0:
        raise ValueError(
            f"q has {nheads} heads and k/v have {nheads_kv}: the number of q heads must be a multiple of "
            "the k/v heads (GQA/MQA)"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension (head_dim), got strides {t.stride()}")


def check_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        _require_tensor(name, t)
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D [batch, seqlen, heads, head_dim], got {t.dim()}-D ({_describe(t)})"
            )
    check_dtype_and_devices(q, k, v)
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        raise ValueError(
            f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}; they must be equal"
        )
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k has seqlen {k.shape[1]} but v has {v.shape[1]}: they must be equal")
    check_head_dims(q, k, v, head_axis=2)


def _assert_cu_seqlens_on_device(name: str, cu: torch.Tensor, total: int, max_seqlen, max_name: str) -> None:
    seq_lengths = cu[1:] - cu[:-1]
    torch._assert_async(cu[0] == 0, f"{name} must start at 0")
    torch._assert_async((seq_lengths >= 0).all(), f"{name} must be non-decreasing")
    torch._assert_async(cu[-1] == total, f"{name} must end at the packed tensor's token count ({total})")
    torch._assert_async(
        (seq_lengths <= max_seqlen).all(), f"{max_name} ({max_seqlen}) must be >= every sequence length in {name}"
    )


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        _require_tensor(name, t)
        if t.dim() != 3:
            raise ValueError(
                f"{name} must be 3-D [total_tokens, heads, head_dim] for the varlen API, got {t.dim()}-D "
                f"({_describe(t)})"
            )
    check_dtype_and_devices(q, k, v)
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k has {k.shape[0]} tokens but v has {v.shape[0]}: they must be equal")
    check_head_dims(q, k, v, head_axis=1)
    lengths = {}
    for name, cu, total, max_seqlen, max_name in (
        ("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "max_seqlen_q"),
        ("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, "max_seqlen_k"),
    ):
        _require_tensor(name, cu)
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must be int32 (flash-attn convention), got {cu.dtype}")
        if cu.dim() != 1 or cu.numel() < 2:
            raise ValueError(f"{name} must be 1-D with batch + 1 >= 2 entries, got shape {tuple(cu.shape)}")
        if cu.device != q.device:
            raise ValueError(f"{name} is on {cu.device} but q is on {q.device}: they must be on the same device")
        if torch.compiler.is_compiling():
            # Inside a compiled graph a host read (.tolist()) would break the graph and sync every call:
            # the same checks run on the device and raise when the result is read.
            _assert_cu_seqlens_on_device(name, cu, total, max_seqlen, max_name)
            lengths[name] = cu.numel()
            continue
        values = cu.tolist()
        if values[0] != 0:
            raise ValueError(f"{name} must start at 0, got {values[0]}")
        seq_lengths = [b - a for a, b in zip(values[:-1], values[1:])]
        if min(seq_lengths) < 0:
            bad = next(i for i, n in enumerate(seq_lengths) if n < 0)
            raise ValueError(
                f"{name} must be non-decreasing, but entry {bad + 1} ({values[bad + 1]}) < entry {bad} ({values[bad]})"
            )
        if values[-1] != total:
            raise ValueError(
                f"{name} ends at {values[-1]} but the packed tensor has {total} tokens: the last entry must equal "
                "the total number of tokens"
            )
        if not isinstance(max_seqlen, int) or max_seqlen < max(seq_lengths):
            raise ValueError(
                f"{max_name} is {max_seqlen} but the longest sequence in {name} has {max(seq_lengths)} tokens: "
                f"{max_name} must be an int >= every sequence length"
            )
        lengths[name] = len(values)
    if lengths["cu_seqlens_q"] != lengths["cu_seqlens_k"]:
        raise ValueError(
            f"cu_seqlens_q has {lengths['cu_seqlens_q']} entries and cu_seqlens_k {lengths['cu_seqlens_k']}: both "
            "must have batch + 1"
        )


def check_options(q, dropout_p, softmax_scale, window_size, alibi_slopes, softcap, batch, nheads) -> tuple[int, int]:
    """Validates the scalar options; returns the window as (left, right) ints."""
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p is {dropout_p!r}; accepted: a float in [0, 1)")
    if softmax_scale is not None and (not isinstance(softmax_scale, (int, float)) or softmax_scale != softmax_scale):
        raise ValueError(f"softmax_scale is {softmax_scale!r}; accepted: None (1/sqrt(head_dim)) or a float")
    if softcap:
        raise NotImplementedError(
            f"softcap={softcap!r}: logit soft-capping is not implemented in volta_train; pass softcap=0.0"
        )
    try:
        left, right = (int(w) for w in window_size)
    except (TypeError, ValueError):
        raise ValueError(f"window_size is {window_size!r}; accepted: a pair (left, right) of ints, -1 = unbounded")
    if left < -1 or right < -1:
        raise ValueError(f"window_size is {window_size!r}; each side must be -1 (unbounded) or >= 0")
    if alibi_slopes is not None:
        _require_tensor("alibi_slopes", alibi_slopes)
        if alibi_slopes.dtype != torch.float32:
            raise TypeError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
        if tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)):
            raise ValueError(
                f"alibi_slopes has shape {tuple(alibi_slopes.shape)}; accepted: ({nheads},) or ({batch}, {nheads})"
            )
        if alibi_slopes.device != q.device:
            raise ValueError(f"alibi_slopes is on {alibi_slopes.device} but q is on {q.device}")
    return left, right
