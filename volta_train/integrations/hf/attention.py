"""The attention function volta_train registers with transformers' ``AttentionInterface``.

:func:`hf_attention_forward` (not to be confused with the custom op
``volta_train::attention_forward`` in ``dispatch``) runs the public API,
:func:`volta_train.interface.flash_attn_func`, when there is no mask and no packing.
Padding: it unpads q/k/v (:mod:`volta_train.bert_padding`), runs
:func:`~volta_train.interface.flash_attn_varlen_func`, pads the output back and writes
at the padded query positions what eager attention writes there (:mod:`.padded_rows`).
Packed rows
(``cu_seq_lens_q/k`` kwargs as transformers' flash path and
``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` pass them, the mask
function's :class:`~.masks.Packing`, ``seq_idx``, or causal ``position_ids`` that
restart inside a row): one varlen call over the flattened tokens, so no sequence
sees another. Causal masks are bottom-right aligned, so KV-cache decoding
(``seqlen_q < seqlen_k``) is right. ``sliding_window=w`` becomes
``window_size=(w - 1, 0)`` (causal) or ``(w - 1, w - 1)`` (bidirectional), as in
transformers' flash_attention_2. ``s_aux`` (attention sinks) becomes ``sinks``.
"""

from __future__ import annotations

import numbers
import weakref
from typing import Any, Callable

import logging

import torch
from torch import nn

from ... import bert_padding, interface
from . import padded_rows
from .base import ATTN_IMPLEMENTATION
from .families import check_head_dim, is_cross_attention, require_family

logger = logging.getLogger("volta_train")
_LOGGED_WINDOWS: set = set()  # model types whose window disagreement was logged
from .masks import Packing, Windowed, packing_from_starts, starts_from_ids, starts_from_positions

# kwargs of transformers' attention call whose meaning this implementation does not have: silently ignoring any of
# them would compute something else than the model asks for.
_UNSUPPORTED_KWARGS = {
    "position_bias": "additive position bias (T5-style)",
    "head_mask": "head masks",
    "cache": "paged caches (continuous batching)",
    "block_table": "paged caches (continuous batching)",
}


_OUTPUT_COLLECTOR: list[Any] = []  # [transformers' output-capture ContextVar, or None], filled on first use


def _output_collector() -> Any:
    """transformers' context variable of outputs being captured (output_attentions=...), if this version has it."""
    if not _OUTPUT_COLLECTOR:
        try:
            from transformers.utils.output_capturing import _active_collector
        except ImportError:
            _active_collector = None
        _OUTPUT_COLLECTOR.append(_active_collector)
    return _OUTPUT_COLLECTOR[0]


def _attention_weights_requested(kwargs: dict[str, Any]) -> bool:
    if kwargs.get("output_attentions"):
        return True
    if torch.compiler.is_compiling():
        # dynamo cannot read a ContextVar (a graph break in every layer); the forward pre-hook of patch() still
        # refuses output_attentions=True
        return False
    collector = _output_collector()
    active = collector.get() if collector is not None else None
    return bool(active) and any(str(key).endswith("attentions") for key in active)


def refuse_attention_weights(where: str) -> ValueError:
    return ValueError(
        f"output_attentions=True ({where}): attn_implementation={ATTN_IMPLEMENTATION!r} never builds the "
        "attention probability matrix (flash attention keeps only its log-sum-exp). For attention maps run "
        "volta_train.unpatch(model) and model.set_attn_implementation('eager')"
    )


def _check_kwargs(model_type: Any, kwargs: dict[str, Any]) -> None:
    if _attention_weights_requested(kwargs):
        raise refuse_attention_weights("requested from the attention function")
    for name, feature in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"{model_type}: {name} was passed to the attention function: {feature} are not supported by "
                f"attn_implementation={ATTN_IMPLEMENTATION!r}; use 'sdpa' or 'eager' for this model or input"
            )


def _window_size(sliding_window: Any, causal: bool, seqlen_k: int) -> tuple[int, int] | None:
    """flash-attn's window_size for transformers' ``sliding_window`` (tokens a query sees, itself included).

    As transformers' flash_attention_2: (w - 1, w - 1), causal then clips the right side to 0, and no window at
    all when the keys fit in it. Same keys as the sdpa mask ``q_idx - sliding_window < kv_idx <= q_idx``.
    """
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, numbers.Integral) or sliding_window < 1:
        raise ValueError(
            f"sliding_window is {sliding_window!r}; attn_implementation={ATTN_IMPLEMENTATION!r} accepts None or an "
            "int >= 1 (the tokens a query sees, itself included)"
        )
    if seqlen_k <= sliding_window:
        return None
    left = int(sliding_window) - 1
    return (left, 0 if causal else left)


def _varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    cross_attention: bool,
    options: dict[str, Any],
) -> torch.Tensor:
    """q [b, sq, h, d], k/v [b, sk, hkv, d], mask [b, L] (L <= sk) -> out [b, sq, h, d]."""
    batch, seqlen_q = q.shape[:2]
    if mask.shape[0] != batch or mask.shape[1] > k.shape[1]:
        raise ValueError(
            f"attention_mask has shape {tuple(mask.shape)} but the keys are [batch={k.shape[0]}, seqlen={k.shape[1]}]: "
            "the mask must have the batch size and at most seqlen_k columns"
        )
    k_full, v_full = k, v
    if mask.shape[1] < k.shape[1]:  # StaticCache: key slots past the mask are not written yet
        k, v = k[:, : mask.shape[1]], v[:, : mask.shape[1]]
    k_packed, indices_k, cu_seqlens_k, max_seqlen_k, _ = bert_padding.unpad_input(k, mask)
    v_packed = v.reshape(-1, *v.shape[2:]).index_select(0, indices_k)  # the indices unpad_input just checked
    if cross_attention:  # the mask pads the keys (encoder tokens); every query is a token
        q_packed = q.reshape(batch * seqlen_q, *q.shape[2:])
        cu_seqlens_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32, device=q.device)
        out = interface.flash_attn_varlen_func(
            q_packed, k_packed, v_packed, cu_seqlens_q, cu_seqlens_k, seqlen_q, max_seqlen_k, **options
        )
        return out.view(batch, seqlen_q, *out.shape[1:])
    if seqlen_q > mask.shape[1]:
        raise ValueError(
            f"attention_mask covers {mask.shape[1]} tokens but there are {seqlen_q} queries: a self-attention mask "
            "must cover the past tokens and the queries"
        )
    if seqlen_q == mask.shape[1]:  # no cache: the queries are the key tokens
        q_packed = q.reshape(-1, *q.shape[2:]).index_select(0, indices_k)
        indices_q, cu_seqlens_q, max_seqlen_q = indices_k, cu_seqlens_k, max_seqlen_k
    else:  # KV cache: the queries are the last seqlen_q tokens
        q_packed, indices_q, cu_seqlens_q, max_seqlen_q, _ = bert_padding.unpad_input(q, mask[:, -seqlen_q:])
    out = interface.flash_attn_varlen_func(
        q_packed, k_packed, v_packed, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **options
    )
    out = bert_padding.pad_input(out, indices_q, batch, seqlen_q)
    return padded_rows.fill(out, q, k_full, v_full, mask[:, -seqlen_q:], mask, options)


# ---- packed rows (padding-free training) ---------------------------------------------------------


def _as_rows(x: torch.Tensor, name: str, batch: int, seqlen: int) -> torch.Tensor:
    """A per-token [batch or 1, seqlen] (or [seqlen]) tensor as [batch, seqlen]."""
    rows = x.unsqueeze(0) if x.dim() == 1 else x
    if rows.dim() != 2 or rows.shape[-1] != seqlen or rows.shape[0] not in (1, batch):
        raise ValueError(
            f"{name} has shape {tuple(x.shape)}; to find packed sequences it must be [batch={batch} or 1, "
            f"seqlen={seqlen}], one entry per token"
        )
    return rows.expand(batch, seqlen)


def _max_length(value: Any, cu_seqlens: torch.Tensor) -> int:
    return int(value) if value is not None else int(cu_seqlens.diff().max())


def _packing_from_kwargs(kwargs: dict[str, Any], device: torch.device) -> Packing | None:
    """cu_seq_lens_q/k and max_length_q/k, as DataCollatorWithFlattening(return_flash_attn_kwargs=True) gives them."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None and cu_k is None:
        return None
    if cu_q is None or cu_k is None:
        given, missing = ("cu_seq_lens_q", "cu_seq_lens_k") if cu_k is None else ("cu_seq_lens_k", "cu_seq_lens_q")
        raise ValueError(f"{given} was passed without {missing}: packed sequences need both (flash-attn kwargs)")
    cu_q = torch.as_tensor(cu_q, device=device).to(torch.int32).reshape(-1)
    cu_k = torch.as_tensor(cu_k, device=device).to(torch.int32).reshape(-1)
    return Packing(
        cu_q, cu_k, _max_length(kwargs.get("max_length_q"), cu_q), _max_length(kwargs.get("max_length_k"), cu_k),
        "cu_seq_lens_q/cu_seq_lens_k",
    )


class _LastPositions:
    """The packing found in the last position_ids tensor seen.

    Every layer of one forward gets the same position_ids tensor: checking it once
    saves a device sync per layer. Keyed on the tensor itself (a weak reference,
    so a new tensor with a recycled id never matches) and its in-place version
    counter; inference-mode tensors have none and are checked every time.
    """

    def __init__(self) -> None:
        self.entry: tuple[Callable[[], Any], tuple[int, int, int], Packing | None] = (lambda: None, (0, 0, 0), None)

    def packing(self, position_ids: torch.Tensor, batch: int, seqlen: int) -> Packing | None:
        remember = not torch.compiler.is_compiling() and not position_ids.is_inference()
        key = (position_ids._version, batch, seqlen) if remember else None
        if remember:
            ref, known_key, known = self.entry
            if ref() is position_ids and known_key == key:
                return known
        starts = starts_from_positions(_as_rows(position_ids, "position_ids", batch, seqlen))
        packing = packing_from_starts(starts, "position_ids") if bool(starts[:, 1:].any()) else None
        if remember:
            self.entry = (weakref.ref(position_ids), key, packing)
        return packing


_LAST_POSITIONS = _LastPositions()


def _packing(
    mask: Packing | None, kwargs: dict[str, Any], causal: bool, batch: int, seqlen_q: int, seqlen_k: int,
    device: torch.device,
) -> Packing | None:
    """The packed sequences of these rows, or None for one sequence per row.

    Sources, first found wins: the cu_seq_lens_q/k kwargs; the mask function's
    :class:`Packing` (transformers saw the packing in position_ids, without a
    cache); seq_idx; and, for causal attention without cached keys, position_ids
    that restart inside a row, as transformers' flash_attention_2 does (with
    use_cache=True transformers' mask never looks for packing, and sdpa attends
    across the sequences).
    """
    explicit = _packing_from_kwargs(kwargs, device)
    if explicit is not None or mask is not None:
        return explicit if explicit is not None else mask
    if seqlen_q != seqlen_k or seqlen_q < 2:  # cached keys: each row continues one sequence
        return None
    seq_idx = kwargs.get("seq_idx")
    if isinstance(seq_idx, torch.Tensor):
        starts = starts_from_ids(_as_rows(seq_idx, "seq_idx", batch, seqlen_q))
        return packing_from_starts(starts, "seq_idx") if bool(starts[:, 1:].any()) else None
    position_ids = kwargs.get("position_ids")
    if causal and isinstance(position_ids, torch.Tensor):
        return _LAST_POSITIONS.packing(position_ids, batch, seqlen_q)
    return None


def _packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing: Packing, options: dict[str, Any]
) -> torch.Tensor:
    """q [b, sq, h, d], k/v [b, sk, hkv, d] holding packed sequences -> out [b, sq, h, d]; one varlen call."""
    batch, seqlen_q = q.shape[:2]
    for name, cu, tokens in (("q", packing.cu_seqlens_q, q.shape[0] * q.shape[1]),
                             ("k", packing.cu_seqlens_k, k.shape[0] * k.shape[1])):
        if cu.numel() < 2 or int(cu[-1]) != tokens:
            raise ValueError(
                f"packed sequences from {packing.source}: cu_seqlens_{name} ends at {int(cu[-1])} but there are "
                f"{tokens} {name} tokens (batch x seqlen); the last entry must equal the token count"
            )
    out = interface.flash_attn_varlen_func(
        q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]),
        packing.cu_seqlens_q, packing.cu_seqlens_k, packing.max_seqlen_q, packing.max_seqlen_k, **options,
    )
    return out.view(batch, seqlen_q, *out.shape[1:])


def _causality(module: nn.Module, is_causal: bool | None) -> bool:
    if is_causal is None:
        is_causal = getattr(module, "is_causal", None)
        if is_causal is None:
            raise ValueError(
                f"{type(module).__name__} has no is_causal attribute and no is_causal kwarg was passed: "
                "volta_train cannot tell causal from bidirectional attention"
            )
    return bool(is_causal)


def _attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | Packing | None,
    cross_attention: bool,
    options: dict[str, Any],
    kwargs: dict[str, Any],
    model_type: Any = None,
) -> torch.Tensor:
    """Picks the route (padding, packed rows, dense) and runs it: q [b, h, sq, d] -> out [b, sq, h, d]."""
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if isinstance(attention_mask, torch.Tensor):
        if attention_mask.dim() != 2:
            raise ValueError(
                f"{model_type}: attention_mask is {tuple(attention_mask.shape)}; attn_implementation={ATTN_IMPLEMENTATION!r} "
                "accepts None or the 2-D [batch, seqlen_k] padding mask its mask function builds (a custom 4-D mask "
                "needs 'sdpa' or 'eager')"
            )
        if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
            raise ValueError(
                "cu_seq_lens_q/cu_seq_lens_k were passed together with a padding attention_mask: packed rows have no "
                "padding; pass one or the other"
            )
        return _varlen_attention(q, k, v, attention_mask.to(torch.bool), cross_attention, options)
    if attention_mask is not None and not isinstance(attention_mask, Packing):
        raise ValueError(
            f"attention_mask is a {type(attention_mask).__name__}; attn_implementation={ATTN_IMPLEMENTATION!r} "
            "accepts None, a 2-D padding mask or the Packing its mask function builds"
        )
    causal = bool(options["causal"])
    packing = _packing(attention_mask, kwargs, causal, q.shape[0], q.shape[1], k.shape[1], q.device)
    if packing is not None:
        return _packed_attention(q, k, v, packing, options)
    return interface.flash_attn_func(q, k, v, **options)


def _mask_window(
    model_type: Any, from_mask: tuple[int, int], from_kwarg: tuple[int, int] | None, causal: bool, seqlen_k: int
) -> tuple[int, int] | None:
    """The window the mask function saw: what eager and sdpa compute, since they apply that mask. Where the module's
    ``sliding_window`` kwarg says otherwise (T5Gemma's encoder passes w and masks |i - j| <= w, which is w + 1 keys
    a side), the mask wins, logged once per model type."""
    left, right = from_mask
    right = 0 if causal else right
    effective = None if left >= seqlen_k - 1 and right >= (0 if causal else seqlen_k - 1) else (left, right)
    if from_kwarg is not None and from_kwarg != effective and model_type not in _LOGGED_WINDOWS:
        _LOGGED_WINDOWS.add(model_type)
        logger.info("volta_train attention: %s's mask has window_size=%s, its sliding_window kwarg gives %s: the "
                    "mask's, which eager attention applies", model_type, effective, from_kwarg)
    return effective



def _check_shapes(model_type: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    head_dim = query.shape[-1]
    if key.shape[-1] != head_dim:
        raise ValueError(
            f"{model_type}: query/key head_dim {head_dim}/{key.shape[-1]}: queries and keys must share one head_dim "
            "(values may have their own)"
        )
    check_head_dim(model_type, head_dim, "the query's last dimension", value.shape[-1])


def _sinks(s_aux: Any, nheads: int) -> torch.Tensor | None:
    """gpt-oss's ``s_aux`` (one logit per query head, in the model's dtype) as the API's fp32 ``sinks``; the cast is
    differentiable, so the parameter gets its gradient in its own dtype."""
    if s_aux is None:
        return None
    return s_aux.reshape(nheads).float()


def hf_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | Packing | Windowed | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: q [b, h, sq, d], k/v [b, hkv, sk, d] -> (out [b, sq, h, d], None).

    ``attention_mask`` is what :func:`~.masks.padding_mask` built (None, 2-D bool,
    or a :class:`~.masks.Packing`). Causality: the ``is_causal`` kwarg, else
    ``module.is_causal``. Dropout: the ``dropout`` kwarg, in training mode only.
    Scale: the ``scaling`` kwarg, else the family's default. ``sliding_window``:
    flash-attn's ``window_size``. ``softcap``: passed on. ``s_aux``: ``sinks``. Packed rows: see :func:`_packing`. K/V heads are passed as they are
    (GQA/MQA). Cross-attention (the mask pads keys only): :func:`~.families.is_cross_attention`,
    or bidirectional attention whose queries and keys differ in length.
    """
    model_type = getattr(getattr(module, "config", None), "model_type", None)
    family = require_family(model_type, type(module).__name__)
    _check_kwargs(model_type, kwargs)
    _check_shapes(model_type, query, key, value)
    causal = _causality(module, is_causal if is_causal is not None else family.is_causal(module))
    scale = scaling if scaling is not None else family.default_scaling(module)
    cross = is_cross_attention(module) or (not causal and query.shape[2] != key.shape[2])
    dropout_p = float(dropout) if module.training else 0.0
    return _run(model_type, query, key, value, attention_mask, causal, dropout_p, scale, cross, kwargs), None


def _run(
    model_type: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | Packing | Windowed | None,
    causal: bool,
    dropout_p: float,
    scale: float | None,
    cross: bool,
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """The options both attention functions share, their kwargs and shapes checked: q [b, h, sq, d] -> out
    [b, sq, h, d]."""
    softcap = kwargs.get("softcap")
    options: dict[str, Any] = {
        "dropout_p": dropout_p,
        "softmax_scale": scale,
        "causal": causal,
        "deterministic": bool(kwargs.get("deterministic") or False),
    }
    if softcap:
        options["softcap"] = float(softcap)
    sinks = _sinks(kwargs.get("s_aux"), query.shape[1])
    if sinks is not None:
        options["sinks"] = sinks
    window = _window_size(kwargs.get("sliding_window"), causal, key.shape[2])
    if isinstance(attention_mask, Windowed):
        window = _mask_window(model_type, attention_mask.window_size, window, causal, key.shape[2])
        attention_mask = attention_mask.inner
    if window is not None:
        options["window_size"] = window
    # Under autocast, flash_attn_func / flash_attn_varlen_func cast q/k/v to autocast's dtype themselves.
    # Under torch.compile the dense route traces into the graph; the padding and packing routes read
    # lengths on the host (nonzero, .item()) and break it there.
    return _attend(query, key, value, attention_mask, cross, options, kwargs, model_type)


def flash_attention_forward(
    query_states: torch.Tensor,
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    attention_mask: torch.Tensor | Packing | Windowed | None,
    query_length: int,
    is_causal: bool,
    dropout: float = 0.0,
    position_ids: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    sliding_window: int | None = None,
    use_top_left_mask: bool = False,
    softcap: float | None = None,
    deterministic: bool | None = None,
    target_dtype: torch.dtype | None = None,
    *,
    volta_model_type: Any = None,
    volta_window: int | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """transformers' ``_flash_attention_forward`` contract on volta_train: q [b, sq, h, d], k/v [b, sk, hkv, d] ->
    out [b, sq, h, d].

    The flash-attention classes of models that compute attention themselves (Falcon, GPT-Neo; see
    :mod:`.swaps`) call it in place of transformers' function, with the mask volta_train's mask function built.
    ``dropout`` comes already zeroed outside training (those classes do it); ``use_top_left_mask`` is flash-attn
    < 2.1's causal alignment, which volta_train never has (its causal masks are bottom-right aligned).
    ``volta_window`` is the module's own window where its class passes none (GPT-Neo's local layers).
    """
    require_family(volta_model_type, f"the flash-attention class of a {volta_model_type} model")
    if target_dtype is not None and query_states.dtype == torch.float32:  # as transformers: PEFT's fp32 upcasts
        query_states, key_states, value_states = (x.to(target_dtype) for x in (query_states, key_states, value_states))
    if sliding_window is None:
        sliding_window = volta_window
    kwargs = {**kwargs, "position_ids": position_ids, "softcap": softcap, "deterministic": deterministic,
              "sliding_window": sliding_window}
    query, key, value = (x.transpose(1, 2) for x in (query_states, key_states, value_states))
    _check_kwargs(volta_model_type, kwargs)
    _check_shapes(volta_model_type, query, key, value)
    causal = bool(is_causal)
    cross = not causal and query.shape[2] != key.shape[2]
    return _run(volta_model_type, query, key, value, attention_mask, causal, float(dropout), softmax_scale, cross,
                kwargs)
