"""Input checks for the public attention API: every error names the argument, what it got and what is accepted."""

from __future__ import annotations

import math
import numbers
import operator
import os
from dataclasses import dataclass

import torch

from . import philox
from .options import ACCUM_CHOICES, BWD_ACCUM_CHOICES, AttentionOptions

MIN_HEAD_DIM = 1
# Any head_dim from 1 to 512: the kernels run up to their largest head_dim (zero-padded to the next one they are built
# for), the reference backend the rest (kernels.unsupported_reason says which, and the dispatcher logs it).
MAX_HEAD_DIM = 512
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
VOLTA_MAJOR = 7
INT_LIKE = "an int (Python int, NumPy integer or integer 0-d tensor)"


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def require_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")




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

    q and k share one head_dim; v may have its own (as in flash-attn: multi-head latent attention's values are
    narrower than its queries and keys), and the output has v's. 0 heads in both q and k/v is an empty call (empty
    output), not an error.
    """
    qn, kn, vn = names
    head_dim = q.shape[-1]
    for name, dim in ((qn, head_dim), (vn, v.shape[-1])):
        if not MIN_HEAD_DIM <= dim <= MAX_HEAD_DIM:
            raise ValueError(f"{name} has head_dim {dim}; accepted: {MIN_HEAD_DIM} to {MAX_HEAD_DIM}")
    if k.shape[-1] != head_dim:
        raise ValueError(f"{kn} has head_dim {k.shape[-1]} but {qn} has {head_dim}: they must be equal")
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
        require_tensor(name, t)
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
        require_tensor(name, t)
        if t.dim() != 3:
            raise ValueError(
                f"{name} must be 3-D [total_tokens, heads, head_dim] for the varlen API, got {t.dim()}-D "
                f"({_describe(t)})"
            )
    check_dtype_and_devices(q, k, v)
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k has {k.shape[0]} tokens but v has {v.shape[0]}: they must be equal")
    check_head_dims(q, k, v, head_axis=1)
    require_tensor("cu_seqlens_q", cu_seqlens_q)
    require_tensor("cu_seqlens_k", cu_seqlens_k)
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


def attention_options(
    q: torch.Tensor, *, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic=False,
    accum: str = "fp32", bwd_accum: str = "auto", batch: int, nheads: int,
) -> AttentionOptions:
    """The call's options, validated: every error names the argument and what is accepted. Dropout's Philox seed and
    offset are drawn here, from PyTorch's generator of q's device."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p is {dropout_p!r}; accepted: a float in [0, 1)")
    if softmax_scale is not None:
        softmax_scale = as_finite_float("softmax_scale", softmax_scale, "None (1/sqrt(head_dim)) or a finite float")
    softcap = as_finite_float("softcap", softcap, "0.0 (off) or a finite float > 0")
    if softcap < 0.0:
        raise ValueError(f"softcap is {softcap!r}; accepted: 0.0 (off) or a finite float > 0")
    left, right = check_window(window_size)
    if alibi_slopes is not None:
        require_tensor("alibi_slopes", alibi_slopes)
        if alibi_slopes.dtype != torch.float32:
            raise TypeError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
        if tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)):
            raise ValueError(
                f"alibi_slopes has shape {tuple(alibi_slopes.shape)}; accepted: ({nheads},) or ({batch}, {nheads})"
            )
        if alibi_slopes.device != q.device:
            raise ValueError(f"alibi_slopes is on {alibi_slopes.device} but q is on {q.device}")
    if accum not in ACCUM_CHOICES:
        raise ValueError(f"accum is {accum!r}; accepted: {', '.join(ACCUM_CHOICES)}")
    if bwd_accum not in BWD_ACCUM_CHOICES:
        raise ValueError(f"bwd_accum is {bwd_accum!r}; accepted: {', '.join(BWD_ACCUM_CHOICES)}")
    seed, offset = philox.draw_seed_offset(q.device) if dropout_p > 0.0 else (0, 0)
    return AttentionOptions(
        # the scale comes from the caller's head_dim: the kernels' zero padding never changes it
        softmax_scale=softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1]),
        causal=bool(causal), window_left=left, window_right=right, dropout_p=float(dropout_p), seed=seed,
        offset=offset, softcap=softcap, accum=accum, bwd_accum=bwd_accum, deterministic=bool(deterministic),
    )


def check_sinks(sinks, q: torch.Tensor, nheads: int) -> None:
    """sinks: None, or one float32 logit per query head on q's device."""
    if sinks is None:
        return
    require_tensor("sinks", sinks)
    if sinks.dtype != torch.float32:
        raise TypeError(f"sinks must be float32 (one logit per query head), got {sinks.dtype}")
    if tuple(sinks.shape) != (nheads,):
        raise ValueError(f"sinks has shape {tuple(sinks.shape)}; accepted: ({nheads},), one logit per query head")
    if sinks.device != q.device:
        raise ValueError(f"sinks is on {sinks.device} but q is on {q.device}: they must be on the same device")


def check_window(window_size) -> tuple[int, int]:
    """window_size as (left, right) ints, each -1 (unbounded) or >= 0."""
    window_words = "a pair (left, right) of ints, each -1 (unbounded) or >= 0"
    if isinstance(window_size, (str, bytes)) or not hasattr(window_size, "__len__") or len(window_size) != 2:
        raise ValueError(f"window_size is {window_size!r}; accepted: {window_words}")
    try:
        left, right = (as_int("window_size", w, window_words) for w in window_size)
    except TypeError:
        raise TypeError(f"window_size is {tuple(window_size)!r}; accepted: {window_words} (no truncation)") from None
    if left < -1 or right < -1:
        raise ValueError(f"window_size is {window_size!r}; each side must be -1 (unbounded) or >= 0")
    return left, right


# Page sizes of a paged KV cache (block_table): flash-attn 2.8 takes multiples of 256; volta_train takes any multiple
# of 32, the largest key block of the decoding kernel's tiles (tiles.DECODE_TILES_*), so that every key block the
# kernel loads lies in one page and costs one block-table lookup. 256, 512... are multiples of it.
PAGE_SIZE_MULTIPLE = 32


def check_block_table(block_table, k_cache: torch.Tensor, batch: int, device: torch.device, *,
                      cache_batch_idx=None, cache_leftpad=None) -> int:
    """A paged KV cache's metadata (no values read): block_table int32 [batch, max_pages] on q's device, the caches
    [num_pages, page_size, kv_heads, head_dim] with page_size a multiple of PAGE_SIZE_MULTIPLE, and neither
    cache_batch_idx nor cache_leftpad (as in flash-attn 2.8: the table already maps each entry to its pages).
    Returns the page size."""
    require_tensor("block_table", block_table)
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table must be int32 (as flash-attn), got {block_table.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.shape[1] < 1:
        raise ValueError(f"block_table has shape {tuple(block_table.shape)}; accepted: [batch={batch}, "
                         "max_num_blocks_per_seq >= 1], the cache pages of each batch entry in logical order")
    if block_table.device != device:
        raise ValueError(f"block_table is on {block_table.device} but q is on {device}: they must be on the same device")
    page_size = k_cache.shape[1]
    if page_size < 1 or page_size % PAGE_SIZE_MULTIPLE:
        raise ValueError(
            f"k_cache has page_block_size {page_size} (k_cache.shape[1]) with a block_table; accepted: a multiple of "
            f"{PAGE_SIZE_MULTIPLE} (flash-attn takes multiples of 256), caches [num_blocks, page_block_size, kv_heads, "
            "head_dim]"
        )
    if cache_batch_idx is not None:
        raise ValueError("cache_batch_idx is given with a block_table; accepted: one of them (as in flash-attn, a paged "
                         "cache maps each batch entry to its pages through block_table alone)")
    if cache_leftpad is not None:
        raise ValueError("cache_leftpad is given with a block_table; accepted: one of them (flash-attn 2.8 does not "
                         "combine a paged cache with left padding either)")
    return page_size


def check_block_table_values(block_table: torch.Tensor, num_pages: int, page_size: int, ends, on_host: bool) -> None:
    """Every page an entry reads or appends to (``block_table[b, :ceil(ends[b] / page_size)]``) is a page of the
    cache, 0 <= page < num_pages. ``ends``: host ints (then the used part of the table is read in one copy) or a long
    [B] tensor (then a device assert, no host read). Entries past an entry's last page are not read and may hold
    anything (e.g. -1)."""
    if on_host:
        needed = [-(-e // page_size) for e in ends]
        width = max(needed, default=0)
        if width == 0:
            return
        rows = block_table[:, :width].tolist()
        for b, (row, n) in enumerate(zip(rows, needed)):
            for i, page in enumerate(row[:n]):
                if not 0 <= page < num_pages:
                    raise ValueError(f"block_table[{b}, {i}] is {page}; accepted: cache pages 0 to {num_pages - 1} "
                                     f"(entry {b} uses its first {n} pages)")
        return
    used = torch.arange(block_table.shape[1], device=block_table.device).view(1, -1) * page_size < ends.view(-1, 1)
    torch._assert_async((~used | ((block_table >= 0) & (block_table < num_pages))).all(),
                        f"block_table: accepted: cache pages 0 to {num_pages - 1} in every used entry")


def check_paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table) -> list[int]:
    """flash_attn_varlen_func with a block_table: k/v are page pools [num_blocks, page_block_size, kv_heads, head_dim]
    (v may have its own head_dim), block_table int32 [batch, max_num_blocks_per_seq] as for flash_attn_with_kvcache,
    sequence b's keys the logical positions [0, cu_seqlens_k[b + 1] - cu_seqlens_k[b]) of its pages. Returns the key
    lengths (read on the host: the gather needs them)."""
    for name, t in (("k", k), ("v", v)):
        require_tensor(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [num_blocks, page_block_size, kv_heads, head_dim] with a block_table, "
                             f"got {t.dim()}-D ({_describe(t)})")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k is {tuple(k.shape)} and v {tuple(v.shape)}: with a block_table their num_blocks, "
                         "page_block_size and kv_heads must be equal")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        require_tensor(name, cu)
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
            raise ValueError(f"{name} is {_describe(cu)}; accepted: int32 [batch + 1], batch >= 1")
    batch = cu_seqlens_q.numel() - 1
    page_size = check_block_table(block_table, k, batch, q.device)
    if cu_seqlens_k.numel() != batch + 1:
        raise ValueError(f"cu_seqlens_k has {cu_seqlens_k.numel()} entries and cu_seqlens_q {batch + 1}: both must "
                         "have batch + 1")
    cu = cu_seqlens_k.tolist()
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    capacity = block_table.shape[1] * page_size
    for b, n in enumerate(lengths):
        if cu[0] != 0 or not 0 <= n <= capacity:
            raise ValueError(f"cu_seqlens_k gives sequence {b} {n} keys (cu_seqlens_k[0] = {cu[0]}); accepted: "
                             f"cu_seqlens_k[0] = 0 and 0 <= length <= max_num_blocks_per_seq * page_block_size "
                             f"({capacity})")
    check_block_table_values(block_table, k.shape[0], page_size, lengths, on_host=True)
    return lengths


KVCACHE_CHECK_ENV = "VOLTA_TRAIN_KVCACHE_CHECK"
KVCACHE_CHECK_MODES = ("host", "device")


def kvcache_checks_read_values(q: torch.Tensor) -> bool:
    """Whether flash_attn_with_kvcache reads cache_seqlens / cache_batch_idx / cache_leftpad to the host to check them
    (one device-to-host copy, which waits for the GPU): yes unless ``VOLTA_TRAIN_KVCACHE_CHECK=device``, and never
    while compiling or capturing a CUDA graph (a host read would break the graph or the capture); then the same checks
    run on the device (``torch._assert_async``: a bad value stops the CUDA context with the check's message)."""
    mode = os.environ.get(KVCACHE_CHECK_ENV, "host")
    if mode not in KVCACHE_CHECK_MODES:
        raise ValueError(f"{KVCACHE_CHECK_ENV}={mode!r}; accepted: 'host' (the default: read the cache lengths and "
                         f"raise a ValueError naming a bad one) or 'device' (check on the GPU, no wait for it)")
    if torch.compiler.is_compiling() or (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        return False
    return mode == "host"


@dataclass(frozen=True)
class KvCacheExtent:
    """What check_kvcache hands the kernel path: cache_seqlens as an int32 [batch] tensor on q's device and, when
    the lengths were read on the host, one past the last key any entry reads (``key_end``: max of cache_seqlens +
    seqlen_new) and the most keys one entry sees (``longest``: max of that minus cache_leftpad); -1 when not read
    (the kernel path then plans for the whole cache)."""

    cache_seqlens: torch.Tensor
    key_end: int = -1
    longest: int = -1


def _int_vector(name: str, t, batch: int, device: torch.device) -> torch.Tensor:
    """Checks an integer [batch] tensor on device (its metadata only: no values are read)."""
    require_tensor(name, t)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor (int32, as flash-attn), got {t.dtype}")
    if tuple(t.shape) != (batch,):
        raise ValueError(f"{name} has shape {tuple(t.shape)}; accepted: ({batch},), one entry per batch entry of q")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}: they must be on the same device")
    return t


def _read_int_vectors(vectors: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    """The values of several integer [batch] tensors of one device, in one device-to-host copy."""
    if not vectors:
        return {}
    rows = torch.stack([t.to(torch.long) for t in vectors.values()]).tolist()
    return dict(zip(vectors, rows))


def check_kvcache(
    q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, causal,
    window_size, block_table=None,
) -> KvCacheExtent:
    """Checks a flash_attn_with_kvcache call. The integer vectors' values are checked on the host when
    :func:`kvcache_checks_read_values` says so (all read in one copy), else on the device.

    With a ``block_table`` (paged cache, :func:`check_block_table`) the caches are [num_pages, page_size, kv_heads,
    head_dim] and every entry's logical cache holds ``max_num_blocks_per_seq * page_size`` positions, as in
    flash-attn; the pages it uses are checked by :func:`check_block_table_values`."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, seqlen, heads, head_dim], got {t.dim()}-D ({_describe(t)})")
    check_dtype_and_devices(q, k_cache, v_cache, names=("k_cache", "v_cache"))
    check_head_dims(q, k_cache, v_cache, head_axis=2, names=("q", "k_cache", "v_cache"))
    if v_cache.shape[-1] != q.shape[-1]:
        raise ValueError(f"v_cache has head_dim {v_cache.shape[-1]} but q has {q.shape[-1]}: flash_attn_with_kvcache "
                         "takes one head_dim for q, k and v (flash_attn_func and flash_attn_varlen_func take a v of "
                         "its own)")
    if k_cache.shape[:2] != v_cache.shape[:2]:
        raise ValueError(
            f"k_cache is {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)}: their batch and seqlen must be equal"
        )
    batch, seqlen_q = q.shape[0], q.shape[1]
    batch_cache, seqlen_cache, nheads_kv = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
    page_size = 0
    if block_table is not None:
        page_size = check_block_table(block_table, k_cache, batch, q.device, cache_batch_idx=cache_batch_idx,
                                      cache_leftpad=cache_leftpad)
        seqlen_cache = block_table.shape[1] * page_size  # each entry's logical cache
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
    vectors: dict[str, torch.Tensor] = {}  # the tensors whose values are checked
    seqlens: list[int] | None = None
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("cache_seqlens is None but k/v are given: cache_seqlens says where to append them")
        seqlens = [seqlen_cache] * batch
    elif isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.dim() == 1:
        vectors["cache_seqlens"] = _int_vector("cache_seqlens", cache_seqlens, batch, q.device)
    else:
        seqlens = [as_int("cache_seqlens", cache_seqlens, f"{INT_LIKE} or an integer [batch] tensor")] * batch
    if cache_batch_idx is not None:
        vectors["cache_batch_idx"] = _int_vector("cache_batch_idx", cache_batch_idx, batch, q.device)
    elif batch > batch_cache and block_table is None:
        raise ValueError(
            f"q has batch {batch} but k_cache holds {batch_cache} rows: pass cache_batch_idx or a cache with >= {batch}"
        )
    if cache_leftpad is not None:
        vectors["cache_leftpad"] = _int_vector("cache_leftpad", cache_leftpad, batch, q.device)
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin go together: pass both or neither")
    span = 0  # rotated positions past cache_seqlens[b]: rotary_cos must reach max(cache_seqlens) + span
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
        left, right = check_window(window_size)
        local = (left, right) != (-1, -1)
        span = max(seqlen_new, seqlen_q if (causal or local) else 1)

    limits = _KvCacheLimits(batch, batch_cache, seqlen_cache, seqlen_new, span,
                            rotary_cos.shape[0] if rotary_cos is not None else None)
    on_host = not vectors or kvcache_checks_read_values(q)
    if on_host:
        values = _read_int_vectors(vectors)
        seqlens = values.get("cache_seqlens", seqlens)
        limits.check_on_host(seqlens, values.get("cache_batch_idx"), values.get("cache_leftpad"))
        ends = [n + seqlen_new for n in seqlens]
        pads = values.get("cache_leftpad") or [0] * batch
        key_end, longest = max(ends, default=0), max((e - p for e, p in zip(ends, pads)), default=0)
    else:
        limits.assert_on_device(vectors.get("cache_seqlens"), seqlens, vectors.get("cache_batch_idx"),
                                vectors.get("cache_leftpad"))
        key_end = longest = -1
    given = vectors.get("cache_seqlens")  # .to returns the tensor itself when it is int32 already: no copy
    lengths = (given.to(torch.int32) if given is not None
               else torch.full((batch,), seqlens[0], dtype=torch.int32, device=q.device))
    if block_table is not None:
        check_block_table_values(block_table, k_cache.shape[0], page_size,
                                 ends if on_host else lengths.to(torch.long) + seqlen_new, on_host)
    return KvCacheExtent(lengths, key_end, longest)


@dataclass(frozen=True)
class _KvCacheLimits:
    """The bounds flash_attn_with_kvcache's integer vectors must keep, checked on the host or on the device."""

    batch: int
    batch_cache: int
    seqlen_cache: int
    seqlen_new: int
    rotary_span: int
    seqlen_ro: int | None

    def seqlens_message(self, b: str, n: str) -> str:
        return (f"cache_seqlens[{b}] is {n} with {self.seqlen_new} new tokens, but the cache holds {self.seqlen_cache}: "
                f"accepted: 0 <= cache_seqlens <= {self.seqlen_cache - self.seqlen_new}")

    def check_on_host(self, seqlens: list[int], rows: list[int] | None, leftpad: list[int] | None) -> None:
        for b, n in enumerate(seqlens):
            if n < 0 or n + self.seqlen_new > self.seqlen_cache:
                raise ValueError(self.seqlens_message(str(b), str(n)))
        if rows is not None:
            bad = [r for r in rows if not 0 <= r < self.batch_cache]
            if bad:
                raise ValueError(f"cache_batch_idx has {bad[0]}; accepted: cache rows 0 to {self.batch_cache - 1}")
            if self.seqlen_new and len(set(rows)) != len(rows):
                raise ValueError("cache_batch_idx repeats a cache row while k/v are appended: each row must appear once")
        if leftpad is not None:
            for b, (pad, n) in enumerate(zip(leftpad, seqlens)):
                if not 0 <= pad <= n:
                    raise ValueError(f"cache_leftpad[{b}] is {pad}; accepted: 0 to cache_seqlens[{b}] ({n})")
        if self.seqlen_ro is not None:
            needed = max(seqlens, default=0) + self.rotary_span
            if self.seqlen_ro < needed:
                raise ValueError(f"rotary_cos has {self.seqlen_ro} positions but position {needed - 1} is rotated: "
                                 f"accepted: seqlen_ro >= {needed}")

    def assert_on_device(self, seqlens: torch.Tensor | None, host_seqlens: list[int] | None,
                         rows: torch.Tensor | None, leftpad: torch.Tensor | None) -> None:
        """The same bounds as check_on_host, as asynchronous device asserts (no host read). ``seqlens`` None: the
        lengths are host ints (``host_seqlens``), whose own bounds and rotary reach are checked on the host."""
        if seqlens is None:
            self.check_on_host(host_seqlens, None, None)
        else:
            torch._assert_async(((seqlens >= 0) & (seqlens <= self.seqlen_cache - self.seqlen_new)).all(),
                                self.seqlens_message("b", "out of range"))
            if self.seqlen_ro is not None:
                torch._assert_async(seqlens.max() + self.rotary_span <= self.seqlen_ro,
                                    f"rotary_cos has {self.seqlen_ro} positions: accepted: seqlen_ro >= "
                                    f"max(cache_seqlens) + {self.rotary_span}")
        if rows is not None:
            torch._assert_async(((rows >= 0) & (rows < self.batch_cache)).all(),
                                f"cache_batch_idx: accepted: cache rows 0 to {self.batch_cache - 1}")
            if self.seqlen_new and rows.numel() > 1:
                ordered = rows.sort().values
                torch._assert_async((ordered[1:] != ordered[:-1]).all(),
                                    "cache_batch_idx repeats a cache row while k/v are appended")
        if leftpad is not None:
            upper = seqlens if seqlens is not None else torch.tensor(host_seqlens, device=leftpad.device)
            torch._assert_async(((leftpad >= 0) & (leftpad <= upper)).all(),
                                "cache_leftpad: accepted: 0 to cache_seqlens[b]")
