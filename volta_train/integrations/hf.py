"""HuggingFace transformers models on volta_train attention, through transformers' attention interface.

::

    import volta_train
    model = volta_train.patch(model)     # attention now runs volta_train.flash_attn_func / _varlen_func
    volta_train.unpatch(model)           # back to the previous implementation ("sdpa", "eager", ...)

or at load time::

    from volta_train.integrations import hf
    hf.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="volta_train")

How it works. transformers (BERT: >= 5.0.0, GPT-2: >= 5.3.0) looks attention up by
name in two registries: ``AttentionInterface`` (the attention function) and
``AttentionMaskInterface`` (the function that builds the mask the model hands
to it). :func:`register` puts one of each under :data:`ATTN_IMPLEMENTATION`;
:func:`patch` checks the model's family and sets that name on its config(s).

* The mask function returns, like transformers' ``flash_attention_mask``, the 2-D
  ``[batch, kv_len]`` boolean padding mask, or ``None`` when nothing is padded.
  It refuses any mask pattern a padding mask cannot express (sliding windows,
  packed sequences found from ``position_ids``, extra or/and mask functions)
  instead of dropping it.
* The attention function runs :func:`volta_train.flash_attn_func` when there is
  no mask, otherwise unpads q/k/v, runs :func:`volta_train.flash_attn_varlen_func`
  and pads the output back (zeros at padded query positions). Causal masks are
  bottom-right aligned, so KV-cache decoding (``seqlen_q < seqlen_k``) is right;
  query lengths come from the last ``seqlen_q`` columns of the mask.

Model families are a registry keyed by ``config.model_type``: one small function
per family (see :func:`_gpt2`, :func:`_bert`) that validates a model and returns
its attention modules. Adding a family is adding one such function.

Why the name is not "volta_flash": transformers treats every implementation
whose name contains "flash" as a flash-attn build and tries to import one at
load time (``from_pretrained(attn_implementation=...)`` then fails).
"""

from __future__ import annotations

import functools
import logging
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
    "sliding_window": "sliding-window attention",
    "s_aux": "attention sinks",
    "position_bias": "additive position bias (T5-style)",
    "head_mask": "head masks",
    "cu_seq_lens_q": "padding-free packed batches",
    "cu_seq_lens_k": "padding-free packed batches",
    "seq_idx": "padding-free packed batches",
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


def _family(
    model_type: str,
    *,
    min_transformers: str,
    before_min: str,
    is_cross_attention: Callable[[nn.Module], bool],
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


def _bert_is_cross_attention(module: nn.Module) -> bool:
    from transformers.models.bert.modeling_bert import BertCrossAttention

    return isinstance(module, BertCrossAttention)


@_family(
    "bert",
    min_transformers="5.0.0",
    before_min="BERT of transformers 4.x does not call the attention interface (it picks BertSdpaSelfAttention & co.)",
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


def supported_model_types() -> list[str]:
    return sorted(FAMILIES)


def _unsupported(model_type: Any, what: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"{what} has model_type {model_type!r}, which volta_train does not support; supported model_type values: "
        f"{', '.join(supported_model_types())}. Its attention implementation was left unchanged."
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


@functools.lru_cache(maxsize=None)
def _check_family_version(model_type: str, installed: str) -> None:
    family = FAMILIES[model_type]
    if _release(installed) < _release(family.min_transformers):
        raise TransformersVersionError(
            f"transformers {installed} is installed, but volta_train supports model_type {model_type!r} from "
            f"transformers>={family.min_transformers} ({family.before_min}); "
            f"pip install -U 'transformers>={family.min_transformers}'"
        )


def _require_family(model_type: Any, what: str) -> Family:
    family = FAMILIES.get(model_type)
    if family is None:
        raise _unsupported(model_type, what)
    _check_family_version(model_type, _installed_transformers())
    return family


# --------------------------------------------------------------------------------------------------
# The mask function (AttentionMaskInterface)
# --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _plain_mask_functions() -> tuple[Callable, ...]:
    from transformers import masking_utils

    names = ("causal_mask_function", "bidirectional_mask_function")
    return tuple(getattr(masking_utils, name) for name in names if hasattr(masking_utils, name))


def _tokens_seen(kv_length: int, kwargs: dict[str, Any]) -> tuple[int, torch.device | None] | None:
    """(tokens written so far, device) when the keys may hold unwritten slots (static caches), else None."""
    if "q_length" in kwargs:  # transformers >= 5.x: q_length / q_offset
        q_length, q_offset = int(kwargs["q_length"]), kwargs.get("q_offset", 0)
        if kv_length <= q_length:
            return None
        device = q_offset.device if isinstance(q_offset, torch.Tensor) else None
        return int(q_offset) + q_length, device
    cache_position = kwargs.get("cache_position")  # older releases: cache_position
    if not isinstance(cache_position, torch.Tensor) or cache_position.numel() == 0:
        return None
    if kv_length <= cache_position.numel():
        return None
    return int(cache_position[-1]) + 1, cache_position.device


def padding_mask(
    batch_size: int,
    kv_length: int,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """transformers mask function: the 2-D [batch, kv_len] bool padding mask, or None when nothing is padded.

    Called by ``create_causal_mask`` / ``create_bidirectional_mask``; :func:`attention_forward`
    receives its result as ``attention_mask``. Causality is not in the mask: the
    attention function takes it from the module.
    """
    if mask_function is not None and mask_function not in _plain_mask_functions():
        name = getattr(mask_function, "__qualname__", repr(mask_function))
        raise NotImplementedError(
            f"mask_function is {name}: attn_implementation={ATTN_IMPLEMENTATION!r} expresses plain causal or "
            "bidirectional attention plus padding only (not sliding windows, packed sequences detected from "
            "position_ids, or extra or/and mask functions); pass an attention_mask, or use 'sdpa' or 'eager'"
        )
    if kv_offset:
        raise NotImplementedError(
            f"kv_offset is {kv_offset}: attn_implementation={ATTN_IMPLEMENTATION!r} does not support caches that "
            "drop old tokens (sliding-window caches); use a DynamicCache or StaticCache"
        )
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
    seen = _tokens_seen(kv_length, kwargs)
    if seen is None or seen[0] >= kv_length:
        return None
    # No padding, but a StaticCache with kv_length slots of which only `seen` are written (transformers drops an
    # all-ones mask during generate): a mask of that length makes the attention ignore the unwritten slots.
    device = kwargs.get("device") or seen[1]
    if device is None:
        raise RuntimeError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r}: the cache holds {kv_length} key slots but only {seen[0]} "
            "are written, and no device was given to build their mask; pass an attention_mask"
        )
    return torch.ones(batch_size, seen[0], dtype=torch.bool, device=device)


# --------------------------------------------------------------------------------------------------
# The attention function (AttentionInterface)
# --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _output_collector() -> Any:
    """transformers' context variable of outputs being captured (output_attentions=...), if this version has it."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return None
    return _active_collector


def _attention_weights_requested(kwargs: dict[str, Any]) -> bool:
    if kwargs.get("output_attentions"):
        return True
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


def attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: q [b, h, sq, d], k/v [b, hkv, sk, d] -> (out [b, sq, h, d], None).

    ``attention_mask`` is what :func:`padding_mask` built (None or 2-D bool).
    Causality: the ``is_causal`` kwarg, else ``module.is_causal``. Dropout: the
    ``dropout`` kwarg, in training mode only. Scale: the ``scaling`` kwarg, else
    the family's default. K/V heads are passed as they are (GQA/MQA).
    """
    family = _require_family(getattr(getattr(module, "config", None), "model_type", None), type(module).__name__)
    _check_kwargs(kwargs)
    if is_causal is None:
        is_causal = getattr(module, "is_causal", None)
        if is_causal is None:
            raise ValueError(
                f"{type(module).__name__} has no is_causal attribute and no is_causal kwarg was passed: "
                "volta_train cannot tell causal from bidirectional attention"
            )
    options = {
        "dropout_p": float(dropout) if module.training else 0.0,
        "softmax_scale": scaling if scaling is not None else family.default_scaling(module),
        "causal": bool(is_causal),
        "deterministic": bool(kwargs.get("deterministic") or False),
    }
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if attention_mask is None:
        return volta_train.flash_attn_func(q, k, v, **options), None
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        shape = tuple(attention_mask.shape) if hasattr(attention_mask, "shape") else type(attention_mask).__name__
        raise ValueError(
            f"attention_mask is {shape}; attn_implementation={ATTN_IMPLEMENTATION!r} accepts None or the 2-D "
            "[batch, seqlen_k] padding mask its mask function builds (a custom 4-D mask needs 'sdpa' or 'eager')"
        )
    out = _varlen_attention(q, k, v, attention_mask.to(torch.bool), family.is_cross_attention(module), options)
    return out, None


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
