"""Input checks for the public attention API: every error names the argument, what it got and what is accepted."""

from __future__ import annotations

import math
import numbers
import operator

import torch

MIN_HEAD_DIM = 1
MAX_HEAD_DIM = 256  # flash-attn's limit: any head_dim from 1 to 256 (the dispatcher pads for the kernel)
# integrations/hf.py still checks model head_dims against a multiple of this; the attention API itself takes any
# head_dim from MIN_HEAD_DIM to MAX_HEAD_DIM.
HEAD_DIM_MULTIPLE = 8
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
VOLTA_MAJOR = 7
INT_LIKE = "an int (Python int, NumPy integer or integer 0-d tensor)"


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def require_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


_require_tensor = require_tensor


def as_int(name: str, value, accepted: str = INT_LIKE) -> int:
    """value as a Python int when it is integer-like (int, NumPy integer, integer 0-d tensor); TypeError otherwise.

    bool is refused (True is not a length); floats are refused even when whole (no silent truncation).
    """
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and (value.dim() != 0 or value.dtype == torch.bool)):
        raise TypeError(f"{name} is {value!r}; accepted: {accepted}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} is {value!r} ({type(value).__name__}); accepted: {accepted}") from None


def as_finite_float(name: str, value, accepted: str) -> float:
    """value as a finite Python float (int, float, NumPy scalar, 0-d tensor); ValueError otherwise."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.dtype.is_complex:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} is {value!r} ({type(value).__name__}); accepted: {accepted}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} is {value!r}; accepted: {accepted}")
    return value


def is_volta(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    major, minor = torch.cuda.get_device_capability(device)
    return major == VOLTA_MAJOR and minor == 0


def check_dtype_and_devices(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, names=("k", "v")) -> None:
    for name, t in zip(names, (k, v)):
        if t.device != q.device:
            raise ValueError(
                f"{name} is on {t.device} but q is on {q.device}: q, {', '.join(names)} must be on the same device"
            )
        if t.dtype != q.dtype:
            raise TypeError(
                f"{name} has dtype {t.dtype} but q has {q.dtype}: q, {', '.join(names)} must share one dtype"
            )
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


def check_head_dims(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_axis: int, names=("q", "k", "v")) -> None:
    """head_axis: the axis of the heads (dense 2, varlen 1); head_dim is the last axis.

    0 heads in both q and k/v is an empty call (empty output), not an error.
    """
    qn, kn, vn = names
    head_dim = q.shape[-1]
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"{qn} has head_dim {head_dim}; accepted: {MIN_HEAD_DIM} to {MAX_HEAD_DIM}")
    if k.shape[-1] != head_dim:
        raise ValueError(f"{kn} has head_dim {k.shape[-1]} but {qn} has {head_dim}: they must be equal")
    if v.shape[-1] != head_dim:
        raise ValueError(f"{vn} has head_dim {v.shape[-1]} but {qn} has {head_dim}: they must be equal")
    if k.shape[head_axis] != v.shape[head_axis]:
        raise ValueError(
            f"{kn} has {k.shape[head_axis]} heads but {vn} has {v.shape[head_axis]}: they must have the same heads"
        )
    nheads, nheads_kv = q.shape[head_axis], k.shape[head_axis]
    if (nheads_kv == 0 and nheads != 0) or (nheads_kv != 0 and nheads % nheads_kv != 0):
        raise ValueError(
            f"{qn} has {nheads} heads and {kn}/{vn} have {nheads_kv}: the number of {qn} heads must be a multiple of "
            f"the {kn}/{vn} heads (GQA/MQA)"
        )
    for name, t in ((qn, q), (kn, k), (vn, v)):
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


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> tuple[int, int]:
    """Checks the packed call; returns (max_seqlen_q, max_seqlen_k) as ints."""
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
    _require_tensor("cu_seqlens_q", cu_seqlens_q)
    _require_tensor("cu_seqlens_k", cu_seqlens_k)
    if not torch.compiler.is_compiling():
        max_seqlen_q = as_int("max_seqlen_q", max_seqlen_q)
        max_seqlen_k = as_int("max_seqlen_k", max_seqlen_k)
    lengths = {}
    for name, cu, total, max_seqlen, max_name in (
        ("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "max_seqlen_q"),
        ("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, "max_seqlen_k"),
    ):
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
        if max_seqlen < max(seq_lengths):
            raise ValueError(
                f"{max_name} is {max_seqlen} but the longest sequence in {name} has {max(seq_lengths)} tokens: "
                f"{max_name} must be >= every sequence length"
            )
        lengths[name] = len(values)
    if lengths["cu_seqlens_q"] != lengths["cu_seqlens_k"]:
        raise ValueError(
            f"cu_seqlens_q has {lengths['cu_seqlens_q']} entries and cu_seqlens_k {lengths['cu_seqlens_k']}: both "
            "must have batch + 1"
        )
    return max_seqlen_q, max_seqlen_k


def check_options(
    q, dropout_p, softmax_scale, window_size, alibi_slopes, softcap, batch, nheads
) -> tuple[int, int, float]:
    """Validates the scalar options; returns the window as (left, right) ints and softcap as a float."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p is {dropout_p!r}; accepted: a float in [0, 1)")
    if softmax_scale is not None:
        as_finite_float("softmax_scale", softmax_scale, "None (1/sqrt(head_dim)) or a finite float")
    softcap = as_finite_float("softcap", softcap, "0.0 (off) or a finite float > 0")
    if softcap < 0.0:
        raise ValueError(f"softcap is {softcap!r}; accepted: 0.0 (off) or a finite float > 0")
    window_words = "a pair (left, right) of ints, each -1 (unbounded) or >= 0"
    if isinstance(window_size, (str, bytes)) or not hasattr(window_size, "__len__") or len(window_size) != 2:
        raise ValueError(f"window_size is {window_size!r}; accepted: {window_words}")
    try:
        left, right = (as_int("window_size", w, window_words) for w in window_size)
    except TypeError:
        raise TypeError(f"window_size is {tuple(window_size)!r}; accepted: {window_words} (no truncation)") from None
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
    return left, right, softcap


def check_block_table(block_table) -> None:
    if block_table is not None:
        raise NotImplementedError(
            "block_table (a paged KV cache) is not implemented in volta_train; pass block_table=None with "
            "contiguous caches [batch, seqlen, heads, head_dim]"
        )


def _int_vector(name: str, t, batch: int, device: torch.device) -> list[int]:
    """An integer [batch] tensor on device, read to the host."""
    require_tensor(name, t)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor (int32, as flash-attn), got {t.dtype}")
    if tuple(t.shape) != (batch,):
        raise ValueError(f"{name} has shape {tuple(t.shape)}; accepted: ({batch},), one entry per batch entry of q")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}: they must be on the same device")
    return t.tolist()


def check_kvcache(
    q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, causal,
    window_size,
) -> torch.Tensor:
    """Checks a flash_attn_with_kvcache call; returns cache_seqlens as an int32 [batch] tensor on q's device."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, seqlen, heads, head_dim], got {t.dim()}-D ({_describe(t)})")
    check_dtype_and_devices(q, k_cache, v_cache, names=("k_cache", "v_cache"))
    check_head_dims(q, k_cache, v_cache, head_axis=2, names=("q", "k_cache", "v_cache"))
    if k_cache.shape[:2] != v_cache.shape[:2]:
        raise ValueError(
            f"k_cache is {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)}: their batch and seqlen must be equal"
        )
    batch, seqlen_q = q.shape[0], q.shape[1]
    batch_cache, seqlen_cache, nheads_kv = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
    if (k is None) != (v is None):
        raise ValueError("k and v go together: pass both new keys and values to append, or neither")
    seqlen_new = 0
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            require_tensor(name, t)
            expected = (batch, t.shape[1] if t.dim() == 4 else -1, nheads_kv, q.shape[-1])
            if t.dim() != 4 or tuple(t.shape) != expected or t.shape[1] != k.shape[1]:
                raise ValueError(
                    f"{name} has shape {tuple(t.shape)}; accepted: [batch={batch}, seqlen_new, kv_heads={nheads_kv}, "
                    f"head_dim={q.shape[-1]}] with one seqlen_new for k and v"
                )
        check_dtype_and_devices(q, k, v)
        seqlen_new = k.shape[1]
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("cache_seqlens is None but k/v are given: cache_seqlens says where to append them")
        seqlens = [seqlen_cache] * batch
    elif isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.dim() == 1:
        seqlens = _int_vector("cache_seqlens", cache_seqlens, batch, q.device)
    else:
        seqlens = [as_int("cache_seqlens", cache_seqlens, f"{INT_LIKE} or an integer [batch] tensor")] * batch
    for b, n in enumerate(seqlens):
        if n < 0 or n + seqlen_new > seqlen_cache:
            raise ValueError(
                f"cache_seqlens[{b}] is {n} with {seqlen_new} new tokens, but the cache holds {seqlen_cache}: "
                f"accepted: 0 <= cache_seqlens <= {seqlen_cache - seqlen_new}"
            )
    if cache_batch_idx is not None:
        rows = _int_vector("cache_batch_idx", cache_batch_idx, batch, q.device)
        bad = [r for r in rows if not 0 <= r < batch_cache]
        if bad:
            raise ValueError(f"cache_batch_idx has {bad[0]}; accepted: cache rows 0 to {batch_cache - 1}")
        if k is not None and len(set(rows)) != len(rows):
            raise ValueError("cache_batch_idx repeats a cache row while k/v are appended: each row must appear once")
    elif batch > batch_cache:
        raise ValueError(
            f"q has batch {batch} but k_cache holds {batch_cache} rows: pass cache_batch_idx or a cache with >= {batch}"
        )
    if cache_leftpad is not None:
        leftpad = _int_vector("cache_leftpad", cache_leftpad, batch, q.device)
        for b, (pad, n) in enumerate(zip(leftpad, seqlens)):
            if not 0 <= pad <= n:
                raise ValueError(f"cache_leftpad[{b}] is {pad}; accepted: 0 to cache_seqlens[{b}] ({n})")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin go together: pass both or neither")
    if rotary_cos is not None:
        if k is None:
            raise ValueError("rotary_cos/rotary_sin are given without k/v: rotary embedding applies to new keys")
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            require_tensor(name, t)
            if t.dim() != 2 or not 1 <= t.shape[1] <= q.shape[-1] // 2 or t.shape != rotary_cos.shape:
                raise ValueError(
                    f"{name} has shape {tuple(t.shape)}; accepted: [seqlen_ro, rotary_dim / 2] with "
                    f"2 <= rotary_dim <= head_dim ({q.shape[-1]}), the same for rotary_cos and rotary_sin"
                )
            if not t.dtype.is_floating_point or t.device != q.device:
                raise ValueError(f"{name} must be a floating-point tensor on {q.device}, got {_describe(t)}")
        left, right, _ = check_options(q, 0.0, None, window_size, None, 0.0, batch, q.shape[2])
        local = (left, right) != (-1, -1)
        span = max(seqlen_new, seqlen_q if (causal or local) else 1)
        needed = max(seqlens, default=0) + span
        if rotary_cos.shape[0] < needed:
            raise ValueError(
                f"rotary_cos has {rotary_cos.shape[0]} positions but position {needed - 1} is rotated: "
                f"accepted: seqlen_ro >= {needed}"
            )
    return torch.tensor(seqlens, dtype=torch.int32, device=q.device)
