"""The mask function volta_train registers with transformers' ``AttentionMaskInterface``.

Like transformers' ``flash_attention_mask`` it returns the 2-D ``[batch, kv_len]``
boolean padding mask, or ``None`` when nothing is padded; for packed rows
(transformers found several sequences in a row from ``position_ids``) it returns
a :class:`Packing`. Causality and sliding windows (causal or bidirectional) are not
in the mask: the attention function takes them from the module and its
``sliding_window`` kwarg, as flash-attn's path does. Any other mask pattern (extra
or/and mask functions, chunked or block masks) is refused, never dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .base import ATTN_IMPLEMENTATION


@dataclass(frozen=True)
class Packing:
    """Sequences packed back to back in the rows of a batch (padding-free training), in flash-attn's terms.

    ``cu_seqlens_q``/``cu_seqlens_k`` (int32) delimit the sequences of the flattened
    ``[batch * seqlen]`` tokens; ``source`` says where the packing was found. The
    mask function returns one when transformers found packed sequences in
    ``position_ids``; the attention function then runs one varlen call in which
    no token sees another sequence.
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    source: str


def packing_from_starts(starts: torch.Tensor, source: str) -> Packing:
    """starts bool [batch, seqlen], True where a sequence begins (column 0 always) -> its Packing."""
    begin = torch.nonzero(starts.reshape(-1), as_tuple=False).reshape(-1)
    total = torch.tensor([starts.numel()], dtype=begin.dtype, device=begin.device)
    cu_seqlens = torch.cat([begin, total]).to(torch.int32)
    longest = int(cu_seqlens.diff().max())
    return Packing(cu_seqlens, cu_seqlens, longest, longest, source)


def starts_from_ids(ids: torch.Tensor) -> torch.Tensor:
    """ids [batch, seqlen] (a sequence number per token) -> True where a sequence begins."""
    return F.pad(ids[:, 1:] != ids[:, :-1], (1, 0), value=True)


def starts_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """As transformers' find_packed_sequence_indices: a sequence begins wherever the position does not grow by 1."""
    return F.pad(position_ids[:, 1:] - position_ids[:, :-1] != 1, (1, 0), value=True)


_PLAIN_MASK_FUNCTIONS: dict[Callable, str] = {}


def _plain_mask_functions() -> dict[Callable, str]:
    """masking_utils' causal / bidirectional mask functions -> "causal" / "bidirectional"."""
    if not _PLAIN_MASK_FUNCTIONS:
        from transformers import masking_utils

        for name, kind in (("causal_mask_function", "causal"), ("bidirectional_mask_function", "bidirectional")):
            if hasattr(masking_utils, name):
                _PLAIN_MASK_FUNCTIONS[getattr(masking_utils, name)] = kind
    return _PLAIN_MASK_FUNCTIONS


def _maker_and_cells(function: Callable) -> tuple[str, dict[str, Any]]:
    """('and_masks', {'mask_functions': ...}) for a closure that and_masks() returned, and so on."""
    qualname = getattr(function, "__qualname__", "")
    maker = qualname.split(".<locals>.")[0] if ".<locals>." in qualname else ""
    code, closure = getattr(function, "__code__", None), getattr(function, "__closure__", None) or ()
    names = code.co_freevars if code is not None else ()
    return maker, {name: cell.cell_contents for name, cell in zip(names, closure)}


def _unexpressible(function: Callable, part: Callable) -> NotImplementedError:
    name = getattr(part, "__qualname__", repr(part))
    return NotImplementedError(
        f"mask_function {getattr(function, '__qualname__', repr(function))} contains {name}: attn_implementation="
        f"{ATTN_IMPLEMENTATION!r} expresses causal or bidirectional attention with padding, sliding windows and packed "
        "sequences only (not chunked or block masks, or extra or/and mask functions); use 'sdpa' or 'eager'"
    )


def _mask_parts(function: Callable, part: Callable | None = None) -> list[tuple[str, Any]]:
    """Split a transformers mask function into ("causal" | "bidirectional" | "window" | "packed", value) parts.

    Knows the closures masking_utils builds (5.x): and_masks(...), sliding_window_overlay(w),
    packed_sequence_mask_function(ids), remap_positions_for_packed_sequence(f, position_ids).
    Anything else raises NotImplementedError rather than being dropped.
    """
    part = function if part is None else part
    plain = _plain_mask_functions().get(part)
    if plain is not None:
        return [(plain, None)]
    maker, cells = _maker_and_cells(part)
    if maker == "and_masks" and "mask_functions" in cells:
        return [piece for inner in cells["mask_functions"] for piece in _mask_parts(function, inner)]
    if maker in ("sliding_window_overlay", "sliding_window_bidirectional_overlay") and "sliding_window" in cells:
        return [("window", cells["sliding_window"])]
    if maker == "chunked_overlay":
        raise NotImplementedError(
            f"chunked attention (mask_function {getattr(function, '__qualname__', repr(function))}): "
            f"attn_implementation={ATTN_IMPLEMENTATION!r} has no chunked masks; use 'sdpa' or 'eager'"
        )
    if maker == "packed_sequence_mask_function" and isinstance(cells.get("packed_sequence_mask"), torch.Tensor):
        return [("packed", cells["packed_sequence_mask"])]
    if maker == "remap_positions_for_packed_sequence" and "mask_function" in cells:
        # positions inside one packed sequence are consecutive: the remapped pattern is the same per sequence
        return [("remapped", None), *_mask_parts(function, cells["mask_function"])]
    raise _unexpressible(function, part)


@dataclass(frozen=True)
class Windowed:
    """A mask whose mask function carried a sliding window, as flash-attn's ``window_size`` (left, right).

    What eager and sdpa compute is this mask, so the attention function applies the
    window from here even where a model does not pass its ``sliding_window`` kwarg
    (Qwen2-MoE), and refuses a kwarg that disagrees with it.
    """

    inner: torch.Tensor | Packing | None
    window_size: tuple[int, int]

    # generate() with a static cache keeps the mask it built and hands it back to transformers' mask builder as the
    # attention_mask of the next step, which reads .ndim / calls .to() / .contiguous() on it as on a 2-D padding mask:
    # Windowed answers like its padding mask, and padding_mask() unwraps it (the window comes again from the mask
    # function), so the re-fed mask is the padding mask, as with a plain 2-D tensor.
    @property
    def ndim(self) -> int:
        return self.inner.ndim if isinstance(self.inner, torch.Tensor) else 2

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.inner.shape) if isinstance(self.inner, torch.Tensor) else ()

    def to(self, *args: Any, **kwargs: Any) -> "Windowed":
        inner = self.inner.to(*args, **kwargs) if isinstance(self.inner, torch.Tensor) else self.inner
        return Windowed(inner, self.window_size)

    def contiguous(self) -> "Windowed":
        inner = self.inner.contiguous() if isinstance(self.inner, torch.Tensor) else self.inner
        return Windowed(inner, self.window_size)


def _pattern_of(mask_function: Callable | None) -> tuple[torch.Tensor | None, tuple[int, int] | None]:
    """(transformers' packed_sequence_mask or None, window_size or None) of mask_function.

    Refuses patterns it cannot express. ``sliding_window_overlay(w)`` (causal: the
    query and the w - 1 keys before it) is (w - 1, 0); ``sliding_window_bidirectional_overlay(w)``
    (|q - kv| <= w) is (w, w).
    """
    if mask_function is None:
        return None, None
    parts = _mask_parts(mask_function)
    kinds = [kind for kind, _ in parts]
    bases = [kind for kind in kinds if kind in ("causal", "bidirectional")]
    if len(bases) != 1 or kinds.count("window") > 1 or kinds.count("packed") > 1 or (
        "remapped" in kinds and "packed" not in kinds
    ):
        raise _unexpressible(mask_function, mask_function)
    packed = next((value for kind, value in parts if kind == "packed"), None)
    window = next((value for kind, value in parts if kind == "window"), None)
    if window is None:
        return packed, None
    window = int(window)
    return packed, ((window - 1, 0) if bases[0] == "causal" else (window, window))


def _tokens_written(kv_length: int, kv_offset: int, kwargs: dict[str, Any]) -> tuple[int, torch.device | None] | None:
    """(key slots written so far, device) when the keys may hold unwritten slots (static caches), else None."""
    if "q_length" in kwargs:  # transformers >= 5.x: q_length / q_offset
        q_length, q_offset = int(kwargs["q_length"]), kwargs.get("q_offset", 0)
        if kv_length <= q_length:
            return None
        device = q_offset.device if isinstance(q_offset, torch.Tensor) else None
        return int(q_offset) + q_length - kv_offset, device
    cache_position = kwargs.get("cache_position")  # older releases: cache_position
    if not isinstance(cache_position, torch.Tensor) or cache_position.numel() == 0:
        return None
    if kv_length <= cache_position.numel():
        return None
    return int(cache_position[-1]) + 1 - kv_offset, cache_position.device


def _packed_or_none(ids: torch.Tensor, kv_length: int, kv_offset: int) -> Packing | None:
    if kv_offset or ids.dim() != 2 or ids.shape[-1] != kv_length:
        raise NotImplementedError(
            f"packed sequences with kv_length={kv_length}, kv_offset={kv_offset} and a packed_sequence_mask of shape "
            f"{tuple(ids.shape)}: attn_implementation={ATTN_IMPLEMENTATION!r} packs rows without cached keys only"
        )
    starts = starts_from_ids(ids)
    # transformers keeps the packed mask under torch.compile even for one sequence per row: plain attention then
    if not bool(starts[:, 1:].any()):
        return None
    return packing_from_starts(starts, "position_ids (transformers' packed_sequence_mask)")


def padding_mask(
    batch_size: int,
    kv_length: int,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | Packing | Windowed | None:
    """transformers mask function: the 2-D [batch, kv_len] bool padding mask, a :class:`Packing`, or None.

    Called by ``create_causal_mask`` / ``create_sliding_window_causal_mask`` /
    ``create_bidirectional_mask`` / ``create_bidirectional_sliding_window_mask``; the
    attention function receives its result as ``attention_mask``. Causality is not in
    the mask (the attention function takes it from the module); a sliding window is
    carried along as :class:`Windowed`. With a cache that drops old tokens
    (``kv_offset > 0``) the keys are the last ``kv_length`` tokens: the padding mask
    is sliced from the right, like ``flash_attention_mask`` does.
    """
    if isinstance(attention_mask, Windowed):  # a static cache's kept mask, fed back (see Windowed)
        attention_mask = attention_mask.inner if isinstance(attention_mask.inner, torch.Tensor) else None
    packed, window = _pattern_of(mask_function)
    bidirectional = mask_function is not None and any(kind == "bidirectional" for kind, _ in _mask_parts(mask_function))
    inner = _padding_or_packing(batch_size, kv_length, kv_offset, mask_function, attention_mask, _packed=packed,
                                _bidirectional=bidirectional, **kwargs)
    return inner if window is None else Windowed(inner, window)


def _padding_or_packing(
    batch_size: int,
    kv_length: int,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | Packing | None:
    """The padding mask, the Packing of packed rows, or None (see :func:`padding_mask`)."""
    packed = kwargs.pop("_packed", None)
    bidirectional = kwargs.pop("_bidirectional", False)
    if packed is not None:
        if attention_mask is not None:
            raise NotImplementedError(
                f"packed sequences and an attention_mask together: attn_implementation={ATTN_IMPLEMENTATION!r} "
                "packs rows without padding only (DataCollatorWithFlattening gives no attention_mask)"
            )
        return _packed_or_none(packed, kv_length, kv_offset)
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)}; attn_implementation="
                f"{ATTN_IMPLEMENTATION!r} accepts a 2-D [batch, seqlen] padding mask (1 = token, 0 = padding)"
            )
        attention_mask = attention_mask[:, -kv_length:].to(torch.bool)
        # Shorter than kv_length only with a StaticCache: then the mask also tells which key slots are written.
        if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
            return None
        return attention_mask
    if bidirectional:  # encoder or cross-attention keys (a decoder shorter than its encoder): all are tokens
        return None
    written = _tokens_written(kv_length, kv_offset, kwargs)
    if written is None or written[0] >= kv_length:
        return None
    # No padding, but a StaticCache with kv_length slots of which only the first ones are written (transformers drops
    # an all-ones mask during generate): a mask of that length makes the attention ignore the unwritten slots.
    device = kwargs.get("device") or written[1]
    if device is None:
        raise RuntimeError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r}: the cache holds {kv_length} key slots but only {written[0]} "
            "are written, and no device was given to build their mask; pass an attention_mask"
        )
    return torch.ones(batch_size, written[0], dtype=torch.bool, device=device)
