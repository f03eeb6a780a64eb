"""HuggingFace transformers models on volta_train attention, through transformers' attention interface.

::

    import volta_train
    model = volta_train.patch(model)     # attention now runs volta_train.flash_attn_func / _varlen_func
    volta_train.unpatch(model)           # back to the previous implementation ("sdpa", "eager", ...)

or at load time::

    from volta_train.integrations import hf
    hf.register()
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="volta_train")

How it works. transformers (5.x; GPT-2: >= 5.3.0) looks attention up by name in two
registries: ``AttentionInterface`` (the attention function) and
``AttentionMaskInterface`` (the function that builds the mask the model hands
to it). :func:`register` puts one of each under :data:`ATTN_IMPLEMENTATION`;
:func:`patch` checks the model's family and sets that name on its config(s).

* The mask function returns, like transformers' ``flash_attention_mask``, the 2-D
  ``[batch, kv_len]`` boolean padding mask, or ``None`` when nothing is padded.
  For packed rows (transformers found several sequences in a row from
  ``position_ids``) it returns a :class:`Packing` instead. Sliding windows
  are accepted (the attention function applies them from its ``sliding_window``
  kwarg, as flash-attn's path does); any other mask pattern (extra or/and mask
  functions, chunked or block masks) is refused, never dropped.
* The attention function runs :func:`volta_train.flash_attn_func` when there is
  no mask and no packing. Padding: it unpads q/k/v, runs
  :func:`volta_train.flash_attn_varlen_func` and pads the output back (zeros at
  padded query positions). Packed rows (``cu_seq_lens_q/k`` kwargs from
  ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``, the mask
  function's :class:`Packing`, ``seq_idx``, or causal ``position_ids`` that
  restart inside a row, whatever ``use_cache`` is):
  one varlen call over the flattened tokens, so no sequence sees another.
  Causal masks are bottom-right aligned, so KV-cache decoding
  (``seqlen_q < seqlen_k``) is right; query lengths come from the last
  ``seqlen_q`` columns of the mask. ``sliding_window=w`` becomes
  ``window_size=(w - 1, 0)`` (causal) as in transformers' flash_attention_2.

Model families are a registry keyed by ``config.model_type``: one small function
per family (see :func:`_gpt2`, :func:`_llama`, :func:`_bert`) that validates a
model and returns its attention modules. Adding a family is adding one such
function. Families whose modeling code never calls the attention interface are
listed in :data:`REFUSED` with the reason.

Why the name is not "volta_flash": transformers treats every implementation
whose name contains "flash" as a flash-attn build and tries to import one at
load time (``from_pretrained(attn_implementation=...)`` then fails).
"""

from __future__ import annotations

import logging
import numbers
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import volta_train

from .. import _validation

logger = logging.getLogger("volta_train")

ATTN_IMPLEMENTATION = "volta_train"
"""The name registered with transformers: ``attn_implementation="volta_train"``."""

MASK_INTERFACE_SINCE = "4.53.0"
"""First transformers release with ``AttentionMaskInterface`` (transformers.masking_utils)."""

_PATCH_ATTR = "_volta_train_patch"

# kwargs of transformers' attention call whose meaning this implementation does not have yet:
# silently ignoring any of them would compute something else than the model asks for.
_UNSUPPORTED_KWARGS = {
    "softcap": "logit soft-capping",
    "s_aux": "attention sinks",
    "position_bias": "additive position bias (T5-style)",
    "head_mask": "head masks",
    "cache": "paged caches (continuous batching)",
    "block_table": "paged caches (continuous batching)",
}


class UnsupportedModelError(ValueError):
    """patch() was given a model whose family (config.model_type) volta_train does not support."""


class TransformersVersionError(RuntimeError):
    """The installed transformers is too old for this integration (or for one model family)."""


# --------------------------------------------------------------------------------------------------
# Model families: one small function per config.model_type
# --------------------------------------------------------------------------------------------------


Prepare = Callable[[nn.Module], list[nn.Module]]


def _never_cross_attention(module: nn.Module) -> bool:
    return False


@dataclass(frozen=True)
class Family:
    """How volta_train handles one model family."""

    model_type: str
    min_transformers: str  # first release whose modeling code calls the attention + mask interfaces as we expect
    before_min: str  # what goes wrong with older releases, for the error message
    prepare: Prepare  # validates the model, returns its attention modules
    is_cross_attention: Callable[[nn.Module], bool]  # the mask then pads keys only, never queries
    default_scaling: Callable[[nn.Module], float | None] = lambda module: None  # when no `scaling` kwarg comes


FAMILIES: dict[str, Family] = {}

REFUSED: dict[str, str] = {
    "gptj": (
        "GPTJAttention computes attention itself (GPTJAttention._attn, or the GPTJFlashAttention2 class for "
        "'flash_attention_2') and never calls transformers' attention interface (true of every release from 4.48 "
        "to 5.23), so no registered implementation can reach it"
    ),
}
"""model_type values volta_train knows it cannot patch, with the reason (shown in the error)."""

_MODERN_SINCE = "5.0.0"
_MODERN_BEFORE = (
    "volta_train is verified on transformers 5.0 and later only; 4.x builds masks and caches differently "
    "(cache_position) and is not tested"
)
_ENCODER_BEFORE = "{name} of transformers 4.x does not call the attention interface (it picks per-backend classes)"


def _family(
    model_type: str,
    *,
    min_transformers: str,
    before_min: str,
    is_cross_attention: Callable[[nn.Module], bool] = _never_cross_attention,
    default_scaling: Callable[[nn.Module], float | None] = lambda module: None,
) -> Callable[[Prepare], Prepare]:
    def add(prepare: Prepare) -> Prepare:
        FAMILIES[model_type] = Family(
            model_type, min_transformers, before_min, prepare, is_cross_attention, default_scaling
        )
        return prepare

    return add


def _check_head_dim(model_type: str, head_dim: int, source: str) -> None:
    multiple, largest = _validation.HEAD_DIM_MULTIPLE, _validation.MAX_HEAD_DIM
    if head_dim % multiple != 0 or not 0 < head_dim <= largest:
        raise ValueError(
            f"{model_type}: head_dim is {head_dim} ({source}); volta_train accepts a multiple of {multiple} "
            f"from {multiple} to {largest}"
        )


def _modules_of(model: nn.Module, classes: tuple[type, ...]) -> list[nn.Module]:
    return [module for module in model.modules() if isinstance(module, classes)]


def _attention_modules(
    model: nn.Module, model_type: str, classes: tuple[type, ...], head_dim_attr: str
) -> list[nn.Module]:
    """The model's attention modules of these classes, each with a head_dim volta_train accepts."""
    modules = _modules_of(model, classes)
    for module in modules:
        _check_head_dim(model_type, int(getattr(module, head_dim_attr)), f"{type(module).__name__}.{head_dim_attr}")
    return modules


def _check_sliding_window(model_type: str, config: Any) -> None:
    window = getattr(config, "sliding_window", None)
    if window is not None and (isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 1):
        raise ValueError(
            f"{model_type}: config.sliding_window is {window!r}; volta_train accepts None or an int >= 1 "
            "(the tokens a query sees, itself included)"
        )


def _log_window(model_type: str, window: int | None, layers: int) -> None:
    if layers:
        logger.info(
            "volta_train.patch: %s sliding_window=%d on %d attention layers -> window_size=(%d, 0)",
            model_type, window, layers, window - 1,
        )


GPT2_ENCODER_MASK_FIXED = "5.16.0"  # GPT2Model of 5.2.0-5.15.1 sets encoder_attention_mask = None before using it


def _gpt2_scaling(module: nn.Module) -> float:
    # GPT2Attention passes `scaling` from transformers 5.4.0 on; before, only eager applied these two options.
    scale = module.head_dim**-0.5 if module.scale_attn_weights else 1.0
    if module.scale_attn_by_inverse_layer_idx:
        scale /= float(module.layer_idx + 1)
    return scale


@_family(
    "gpt2",
    min_transformers="5.3.0",
    before_min=(
        "older GPT-2 code builds a 4-D encoder mask itself and keeps output_attentions from the attention function "
        "(5.0-5.2), or passes is_causal=False whenever a mask is given (4.x)"
    ),
    is_cross_attention=lambda module: bool(getattr(module, "is_cross_attention", False)),
    default_scaling=_gpt2_scaling,
)
def _gpt2(model: nn.Module) -> list[nn.Module]:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    config = model.config
    _check_head_dim("gpt2", config.n_embd // config.n_head, f"n_embd={config.n_embd} / n_head={config.n_head}")
    installed = _installed_transformers()
    if config.add_cross_attention and _release(installed) < _release(GPT2_ENCODER_MASK_FIXED):
        raise TransformersVersionError(
            f"gpt2 with add_cross_attention=True: transformers {installed} drops encoder_attention_mask before it "
            f"reaches any attention implementation (fixed in {GPT2_ENCODER_MASK_FIXED}), so encoder padding would be "
            f"attended to; pip install -U 'transformers>={GPT2_ENCODER_MASK_FIXED}'"
        )
    return _modules_of(model, (GPT2Attention,))


@_family("gpt_neox", min_transformers=_MODERN_SINCE, before_min=_MODERN_BEFORE)
def _gpt_neox(model: nn.Module) -> list[nn.Module]:
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXAttention

    return _attention_modules(model, "gpt_neox", (GPTNeoXAttention,), "head_size")


@_family("llama", min_transformers=_MODERN_SINCE, before_min=_MODERN_BEFORE)
def _llama(model: nn.Module) -> list[nn.Module]:
    from transformers.models.llama.modeling_llama import LlamaAttention

    return _attention_modules(model, "llama", (LlamaAttention,), "head_dim")


@_family("mistral", min_transformers=_MODERN_SINCE, before_min=_MODERN_BEFORE)
def _mistral(model: nn.Module) -> list[nn.Module]:
    # MistralAttention passes sliding_window=config.sliding_window to every call: window_size=(w - 1, 0).
    from transformers.models.mistral.modeling_mistral import MistralAttention

    _check_sliding_window("mistral", model.config)
    modules = _attention_modules(model, "mistral", (MistralAttention,), "head_dim")
    _log_window("mistral", model.config.sliding_window, len(modules) if model.config.sliding_window else 0)
    return modules


@_family("qwen2", min_transformers=_MODERN_SINCE, before_min=_MODERN_BEFORE)
def _qwen2(model: nn.Module) -> list[nn.Module]:
    # Qwen2Attention passes sliding_window (module.sliding_window) on its "sliding_attention" layers only.
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention

    _check_sliding_window("qwen2", model.config)
    modules = _attention_modules(model, "qwen2", (Qwen2Attention,), "head_dim")
    sliding = sum(getattr(module, "sliding_window", None) is not None for module in modules)
    _log_window("qwen2", model.config.sliding_window, sliding)
    return modules


@_family("phi", min_transformers=_MODERN_SINCE, before_min=_MODERN_BEFORE)
def _phi(model: nn.Module) -> list[nn.Module]:
    from transformers.models.phi.modeling_phi import PhiAttention

    return _attention_modules(model, "phi", (PhiAttention,), "head_dim")


def _bert_is_cross_attention(module: nn.Module) -> bool:
    from transformers.models.bert.modeling_bert import BertCrossAttention

    return isinstance(module, BertCrossAttention)


@_family(
    "bert",
    min_transformers="5.0.0",
    before_min=_ENCODER_BEFORE.format(name="BERT"),
    is_cross_attention=_bert_is_cross_attention,
)
def _bert(model: nn.Module) -> list[nn.Module]:
    from transformers.models.bert.modeling_bert import BertCrossAttention, BertSelfAttention

    config = model.config
    _check_head_dim(
        "bert",
        config.hidden_size // config.num_attention_heads,
        f"hidden_size={config.hidden_size} / num_attention_heads={config.num_attention_heads}",
    )
    return _modules_of(model, (BertSelfAttention, BertCrossAttention))


def _roberta_is_cross_attention(module: nn.Module) -> bool:
    from transformers.models.roberta.modeling_roberta import RobertaCrossAttention

    return isinstance(module, RobertaCrossAttention)


@_family(
    "roberta",
    min_transformers="5.0.0",
    before_min=_ENCODER_BEFORE.format(name="RoBERTa"),
    is_cross_attention=_roberta_is_cross_attention,
)
def _roberta(model: nn.Module) -> list[nn.Module]:
    from transformers.models.roberta.modeling_roberta import RobertaCrossAttention, RobertaSelfAttention

    return _attention_modules(model, "roberta", (RobertaSelfAttention, RobertaCrossAttention), "attention_head_size")


def _electra_is_cross_attention(module: nn.Module) -> bool:
    from transformers.models.electra.modeling_electra import ElectraCrossAttention

    return isinstance(module, ElectraCrossAttention)


@_family(
    "electra",
    min_transformers="5.0.0",
    before_min=_ENCODER_BEFORE.format(name="ELECTRA"),
    is_cross_attention=_electra_is_cross_attention,
)
def _electra(model: nn.Module) -> list[nn.Module]:
    from transformers.models.electra.modeling_electra import ElectraCrossAttention, ElectraSelfAttention

    return _attention_modules(model, "electra", (ElectraSelfAttention, ElectraCrossAttention), "attention_head_size")


@_family("distilbert", min_transformers="5.0.0", before_min=_ENCODER_BEFORE.format(name="DistilBERT"))
def _distilbert(model: nn.Module) -> list[nn.Module]:
    from transformers.models.distilbert.modeling_distilbert import DistilBertSelfAttention

    return _attention_modules(model, "distilbert", (DistilBertSelfAttention,), "attention_head_size")


@_family("albert", min_transformers="5.0.0", before_min=_ENCODER_BEFORE.format(name="ALBERT"))
def _albert(model: nn.Module) -> list[nn.Module]:
    from transformers.models.albert.modeling_albert import AlbertAttention

    return _attention_modules(model, "albert", (AlbertAttention,), "attention_head_size")


def supported_model_types() -> list[str]:
    return sorted(FAMILIES)


def _unsupported(model_type: Any, what: str) -> UnsupportedModelError:
    supported = ", ".join(supported_model_types())
    if model_type in REFUSED:
        return UnsupportedModelError(
            f"{what} has model_type {model_type!r}, which volta_train cannot patch: {REFUSED[model_type]} "
            f"(transformers {_installed_transformers()} installed). Supported model_type values: {supported}. "
            "Its attention implementation was left unchanged."
        )
    return UnsupportedModelError(
        f"{what} has model_type {model_type!r}, which volta_train does not support; supported model_type values: "
        f"{supported}. Its attention implementation was left unchanged."
    )


# --------------------------------------------------------------------------------------------------
# transformers version checks
# --------------------------------------------------------------------------------------------------


def _release(version: str) -> tuple[int, ...]:
    from packaging.version import Version

    return Version(version).release


def _installed_transformers() -> str:
    import transformers

    return transformers.__version__


def _interfaces() -> tuple[type, type]:
    """(AttentionInterface, AttentionMaskInterface), or a TransformersVersionError naming what is needed."""
    minimum = max((family.min_transformers for family in FAMILIES.values()), key=_release)
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as error:
        raise TransformersVersionError(
            f"transformers {_installed_transformers()} has no AttentionMaskInterface (transformers.masking_utils, "
            f"added in {MASK_INTERFACE_SINCE}): a custom attention implementation would receive no padding mask. "
            f"volta_train's HF integration needs transformers>={minimum} (pip install -U 'transformers>={minimum}')"
        ) from error
    return AttentionInterface, AttentionMaskInterface


_VERSIONS_OK: set[tuple[str, str]] = set()  # (model_type, transformers version) pairs already checked


def _check_family_version(model_type: str, installed: str) -> None:
    if (model_type, installed) in _VERSIONS_OK:
        return
    family = FAMILIES[model_type]
    if _release(installed) < _release(family.min_transformers):
        raise TransformersVersionError(
            f"transformers {installed} is installed, but volta_train supports model_type {model_type!r} from "
            f"transformers>={family.min_transformers} ({family.before_min}); "
            f"pip install -U 'transformers>={family.min_transformers}'"
        )
    _VERSIONS_OK.add((model_type, installed))


def _require_family(model_type: Any, what: str) -> Family:
    family = FAMILIES.get(model_type)
    if family is None:
        raise _unsupported(model_type, what)
    _check_family_version(model_type, _installed_transformers())
    return family


# --------------------------------------------------------------------------------------------------
# The mask function (AttentionMaskInterface)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Packing:
    """Sequences packed back to back in the rows of a batch (padding-free training), in flash-attn's terms.

    ``cu_seqlens_q``/``cu_seqlens_k`` (int32) delimit the sequences of the flattened
    ``[batch * seqlen]`` tokens; ``source`` says where the packing was found. The
    mask function returns one when transformers found packed sequences in
    ``position_ids``; :func:`attention_forward` then runs one varlen call in which
    no token sees another sequence.
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    source: str


def _packing_from_starts(starts: torch.Tensor, source: str) -> Packing:
    """starts bool [batch, seqlen], True where a sequence begins (column 0 always) -> its Packing."""
    begin = torch.nonzero(starts.reshape(-1), as_tuple=False).reshape(-1)
    total = torch.tensor([starts.numel()], dtype=begin.dtype, device=begin.device)
    cu_seqlens = torch.cat([begin, total]).to(torch.int32)
    longest = int(cu_seqlens.diff().max())
    return Packing(cu_seqlens, cu_seqlens, longest, longest, source)


def _starts_from_ids(ids: torch.Tensor) -> torch.Tensor:
    """ids [batch, seqlen] (a sequence number per token) -> True where a sequence begins."""
    return F.pad(ids[:, 1:] != ids[:, :-1], (1, 0), value=True)


def _starts_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
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
    if maker == "sliding_window_overlay" and "sliding_window" in cells:
        return [("window", cells["sliding_window"])]
    if maker == "packed_sequence_mask_function" and isinstance(cells.get("packed_sequence_mask"), torch.Tensor):
        return [("packed", cells["packed_sequence_mask"])]
    if maker == "remap_positions_for_packed_sequence" and "mask_function" in cells:
        # positions inside one packed sequence are consecutive: the remapped pattern is the same per sequence
        return [("remapped", None), *_mask_parts(function, cells["mask_function"])]
    raise _unexpressible(function, part)


def _packing_of(mask_function: Callable | None) -> torch.Tensor | None:
    """transformers' packed_sequence_mask inside mask_function, or None; refuses patterns we cannot express."""
    if mask_function is None:
        return None
    parts = _mask_parts(mask_function)
    kinds = [kind for kind, _ in parts]
    bases = [kind for kind in kinds if kind in ("causal", "bidirectional")]
    if len(bases) != 1 or kinds.count("window") > 1 or kinds.count("packed") > 1 or (
        "remapped" in kinds and "packed" not in kinds
    ):
        raise _unexpressible(mask_function, mask_function)
    if "window" in kinds and bases[0] != "causal":
        raise _unexpressible(mask_function, mask_function)
    return next((value for kind, value in parts if kind == "packed"), None)


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
    starts = _starts_from_ids(ids)
    # transformers keeps the packed mask under torch.compile even for one sequence per row: plain attention then
    if not bool(starts[:, 1:].any()):
        return None
    return _packing_from_starts(starts, "position_ids (transformers' packed_sequence_mask)")


def padding_mask(
    batch_size: int,
    kv_length: int,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | Packing | None:
    """transformers mask function: the 2-D [batch, kv_len] bool padding mask, a :class:`Packing`, or None.

    Called by ``create_causal_mask`` / ``create_sliding_window_causal_mask`` /
    ``create_bidirectional_mask``; :func:`attention_forward` receives its result as
    ``attention_mask``. Causality and the sliding window are not in the mask: the
    attention function takes them from the module and its ``sliding_window`` kwarg,
    as transformers' flash_attention_2 does. With a cache that drops old tokens
    (``kv_offset > 0``) the keys are the last ``kv_length`` tokens: the padding mask
    is sliced from the right, like ``flash_attention_mask`` does.
    """
    packed = _packing_of(mask_function)
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


# --------------------------------------------------------------------------------------------------
# The attention function (AttentionInterface)
# --------------------------------------------------------------------------------------------------


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


def _refuse_attention_weights(where: str) -> ValueError:
    return ValueError(
        f"output_attentions=True ({where}): attn_implementation={ATTN_IMPLEMENTATION!r} never builds the "
        "attention probability matrix (flash attention keeps only its log-sum-exp). For attention maps run "
        "volta_train.unpatch(model) and model.set_attn_implementation('eager')"
    )


def _check_kwargs(kwargs: dict[str, Any]) -> None:
    if _attention_weights_requested(kwargs):
        raise _refuse_attention_weights("requested from the attention function")
    for name, feature in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"{name} was passed to the attention function: {feature} are not supported by "
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


def _unpad(x: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """x [b, s, h, d], keep bool [b, s] -> (packed [n, h, d], indices [n], cu_seqlens int32 [b + 1], max_seqlen)."""
    lengths = keep.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(keep.reshape(-1), as_tuple=False).reshape(-1)
    cu_seqlens = F.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))
    packed = x.reshape(-1, *x.shape[2:]).index_select(0, indices)
    return packed, indices, cu_seqlens, int(lengths.max())


def _pad(packed: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """packed [n, h, d] -> [batch, seqlen, h, d] with zeros where no token was kept."""
    out = packed.new_zeros(batch * seqlen, *packed.shape[1:]).index_copy(0, indices, packed)
    return out.view(batch, seqlen, *packed.shape[1:])


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
    if mask.shape[1] < k.shape[1]:  # StaticCache: key slots past the mask are not written yet
        k, v = k[:, : mask.shape[1]], v[:, : mask.shape[1]]
    k_packed, indices_k, cu_seqlens_k, max_seqlen_k = _unpad(k, mask)
    v_packed = v.reshape(-1, *v.shape[2:]).index_select(0, indices_k)
    if cross_attention:  # the mask pads the keys (encoder tokens); every query is a token
        q_packed = q.reshape(batch * seqlen_q, *q.shape[2:])
        cu_seqlens_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32, device=q.device)
        out = volta_train.flash_attn_varlen_func(
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
        q_packed, indices_q, cu_seqlens_q, max_seqlen_q = _unpad(q, mask[:, -seqlen_q:])
    out = volta_train.flash_attn_varlen_func(
        q_packed, k_packed, v_packed, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **options
    )
    return _pad(out, indices_q, batch, seqlen_q)


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
        starts = _starts_from_positions(_as_rows(position_ids, "position_ids", batch, seqlen))
        packing = _packing_from_starts(starts, "position_ids") if bool(starts[:, 1:].any()) else None
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
        starts = _starts_from_ids(_as_rows(seq_idx, "seq_idx", batch, seqlen_q))
        return _packing_from_starts(starts, "seq_idx") if bool(starts[:, 1:].any()) else None
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
    out = volta_train.flash_attn_varlen_func(
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
) -> torch.Tensor:
    """Picks the route (padding, packed rows, dense) and runs it: q [b, h, sq, d] -> out [b, sq, h, d]."""
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if isinstance(attention_mask, torch.Tensor):
        if attention_mask.dim() != 2:
            raise ValueError(
                f"attention_mask is {tuple(attention_mask.shape)}; attn_implementation={ATTN_IMPLEMENTATION!r} "
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
    return volta_train.flash_attn_func(q, k, v, **options)


def attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | Packing | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: q [b, h, sq, d], k/v [b, hkv, sk, d] -> (out [b, sq, h, d], None).

    ``attention_mask`` is what :func:`padding_mask` built (None, 2-D bool, or
    a :class:`Packing`). Causality: the ``is_causal`` kwarg, else
    ``module.is_causal``. Dropout: the ``dropout`` kwarg, in training mode only.
    Scale: the ``scaling`` kwarg, else the family's default. ``sliding_window``:
    flash-attn's ``window_size``. Packed rows: see :func:`_packing`. K/V heads are
    passed as they are (GQA/MQA).
    """
    family = _require_family(getattr(getattr(module, "config", None), "model_type", None), type(module).__name__)
    _check_kwargs(kwargs)
    causal = _causality(module, is_causal)
    options: dict[str, Any] = {
        "dropout_p": float(dropout) if module.training else 0.0,
        "softmax_scale": scaling if scaling is not None else family.default_scaling(module),
        "causal": causal,
        "deterministic": bool(kwargs.get("deterministic") or False),
    }
    window = _window_size(kwargs.get("sliding_window"), causal, key.shape[2])
    if window is not None:
        options["window_size"] = window
    # Under autocast, flash_attn_func / flash_attn_varlen_func cast q/k/v to autocast's dtype themselves.
    # Under torch.compile the dense route traces into the graph; the padding and packing routes read
    # lengths on the host (nonzero, .item()) and break it there.
    return _attend(query, key, value, attention_mask, family.is_cross_attention(module), options, kwargs), None


# --------------------------------------------------------------------------------------------------
# register / patch / unpatch
# --------------------------------------------------------------------------------------------------


def register() -> str:
    """Register :data:`ATTN_IMPLEMENTATION` with transformers (attention + mask function); returns the name.

    Afterwards ``from_pretrained(..., attn_implementation="volta_train")`` and
    ``model.set_attn_implementation("volta_train")`` work. Idempotent.
    """
    attention_interface, mask_interface = _interfaces()
    attention_interface.register(ATTN_IMPLEMENTATION, attention_forward)
    mask_interface.register(ATTN_IMPLEMENTATION, padding_mask)
    logger.debug("volta_train: registered attn_implementation=%r with transformers", ATTN_IMPLEMENTATION)
    return ATTN_IMPLEMENTATION


@dataclass
class PatchRecord:
    """What patch() changed on a model, so that unpatch() can put it back."""

    previous: list[tuple[Any, Any]] = field(default_factory=list)  # (config, its attn implementation before)
    hook: Any = None  # the forward pre-hook refusing output_attentions=True


def _configs_of(model: nn.Module) -> list[Any]:
    from transformers import PretrainedConfig

    configs: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(config, PretrainedConfig):
            configs.setdefault(id(config), config)
    return list(configs.values())


def _set_attn_implementation(config: Any, value: Any) -> None:
    # The internal attribute: the public setter of transformers 5.x also rewrites sub-configs, which we track ourselves.
    if hasattr(config, "_attn_implementation_internal"):
        config._attn_implementation_internal = value
    else:
        config._attn_implementation = value


def _refuse_output_attentions_hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    if kwargs.get("output_attentions"):
        raise _refuse_attention_weights(f"passed to {type(module).__name__}.forward")


def patch(model: nn.Module) -> nn.Module:
    """Route the attention of a HuggingFace model through volta_train; returns the model.

    Idempotent. Raises :class:`UnsupportedModelError` (listing the supported
    model_type values) for other families and :class:`TransformersVersionError`
    when the installed transformers is too old; it never falls back to stock
    attention silently.
    """
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"model is a {type(model).__name__}: volta_train.patch takes a transformers PreTrainedModel")
    name = type(model).__name__
    family = _require_family(getattr(config, "model_type", None), f"model {name}")
    configs = _configs_of(model)
    for other in configs:
        _require_family(getattr(other, "model_type", None), f"a submodel of {name}")
    register()
    attention_modules = family.prepare(model)
    if not attention_modules:
        raise UnsupportedModelError(
            f"model {name} (model_type {family.model_type!r}) has no attention module volta_train knows: "
            "nothing to patch"
        )
    record = model.__dict__.get(_PATCH_ATTR)
    if record is None:
        record = PatchRecord(
            previous=[(c, c._attn_implementation) for c in configs],
            hook=model.register_forward_pre_hook(_refuse_output_attentions_hook, with_kwargs=True),
        )
        model.__dict__[_PATCH_ATTR] = record
        before = ", ".join(sorted({repr(previous) for _, previous in record.previous}))
        logger.info(
            "volta_train.patch: %s (%s): %d attention modules now use attn_implementation=%r (was %s)",
            name, family.model_type, len(attention_modules), ATTN_IMPLEMENTATION, before,
        )
    else:
        logger.info("volta_train.patch: %s is already patched; nothing to do", name)
    for c in configs:
        _set_attn_implementation(c, ATTN_IMPLEMENTATION)
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Undo :func:`patch`: restore each config's previous attention implementation; returns the model.

    A model that patch() never touched is returned unchanged, unless it runs
    volta_train attention (set at load time): then there is no previous
    implementation to restore, and a ValueError says how to choose one.
    """
    record = model.__dict__.pop(_PATCH_ATTR, None)
    name = type(model).__name__
    if record is None:
        if any(c._attn_implementation == ATTN_IMPLEMENTATION for c in _configs_of(model)):
            raise ValueError(
                f"model {name} uses attn_implementation={ATTN_IMPLEMENTATION!r} from load time, not from "
                "volta_train.patch, so there is no previous implementation to restore; call "
                "model.set_attn_implementation('sdpa') (or 'eager')"
            )
        logger.info("volta_train.unpatch: %s was not patched; nothing to do", name)
        return model
    for config, previous in record.previous:
        _set_attn_implementation(config, previous)
    if record.hook is not None:
        record.hook.remove()
    restored = ", ".join(sorted({repr(previous) for _, previous in record.previous}))
    logger.info("volta_train.unpatch: %s uses attn_implementation=%s again", name, restored)
    return model
