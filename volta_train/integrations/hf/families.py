"""Which HuggingFace models volta_train runs, checked by feature rather than from a list of names.

A model qualifies when transformers declares it flash-attention capable (the
``_supports_flash_attn`` class attribute of transformers 5; ``_supports_flash_attn_2``
of older custom code) and its attention modules call transformers' attention
interface (``ALL_ATTENTION_FUNCTIONS``, picked by ``config._attn_implementation``).
What volta_train must then honour is checked per attention module
(:func:`check_model`): head_dim, chunked attention, sliding windows (soft-capping and
attention sinks are passed on). Anything it cannot do is refused naming the model_type
and the feature.

A family-specific :class:`Family` exists only where a family needs one
(:data:`SPECIAL`: GPT-2's default scale and its encoder-mask bug of some releases,
Falcon's ALiBi, GPT-Neo's local windows, PEGASUS-X's decoder causality). Modules that
compute attention themselves run on volta_train where transformers has a
flash-attention class for them (GPT-Neo; Falcon up to transformers 5.24) or volta_train replaces them
(PEGASUS-X's global-local encoder attention): :func:`own_attention_modules`, swapped by
:mod:`.swaps`. Other models whose modeling code computes attention itself are refused
with the reason, found by inspection.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import numbers
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from ... import interface
from . import base
from .base import MIN_TRANSFORMERS, TransformersVersionError, UnsupportedModelError, release

logger = logging.getLogger("volta_train")

INTERFACE_NAME = "ALL_ATTENTION_FUNCTIONS"
"""The global a modeling file's attention module reads to pick its implementation (transformers 5)."""

CROSS_ATTENTION_NAMES = ("crossattention", "cross_attention", "cross_attn", "encoder_attn")
"""Attribute names under which models hold a cross-attention module that does not say so itself (BART's encoder_attn)."""


def _unset(module: nn.Module) -> None:
    """The default of a family's per-module hooks: nothing of the family's own (the generic behaviour)."""
    return None


def _no_check(model: nn.Module, modules: list[nn.Module]) -> None:
    return None


@dataclass(frozen=True)
class Family:
    """How volta_train handles one config.model_type."""

    model_type: str
    min_transformers: str = MIN_TRANSFORMERS
    before_min: str = (
        "volta_train is verified on transformers 5.0 and later only; 4.x builds masks and caches differently "
        "(cache_position) and is not tested"
    )
    check: Callable[[nn.Module, list[nn.Module]], None] = _no_check  # family-specific validation of a model
    default_scaling: Callable[[nn.Module], float | None] = _unset  # when no `scaling` kwarg comes
    own_window: Callable[[nn.Module], int | None] = _unset  # window of a swapped module (own_attention_modules)
    is_causal: Callable[[nn.Module], bool | None] = _unset  # where no is_causal kwarg comes; None: the module's


# ---- the families that need code of their own ---------------------------------------------------------

GPT2_ENCODER_MASK_FIXED = "5.16.0"  # GPT2Model of 5.2.0-5.15.1 sets encoder_attention_mask = None before using it


def _gpt2_scaling(module: nn.Module) -> float:
    # GPT2Attention passes `scaling` from transformers 5.4.0 on; before, only eager applied these two options.
    scale = module.head_dim**-0.5 if module.scale_attn_weights else 1.0
    if module.scale_attn_by_inverse_layer_idx:
        scale /= float(module.layer_idx + 1)
    return scale


def _gpt2_check(model: nn.Module, modules: list[nn.Module]) -> None:
    installed = base.installed_transformers()
    if getattr(model.config, "add_cross_attention", False) and release(installed) < release(GPT2_ENCODER_MASK_FIXED):
        raise TransformersVersionError(
            f"gpt2 with add_cross_attention=True: transformers {installed} drops encoder_attention_mask before it "
            f"reaches any attention implementation (fixed in {GPT2_ENCODER_MASK_FIXED}), so encoder padding would be "
            f"attended to; pip install -U 'transformers>={GPT2_ENCODER_MASK_FIXED}'"
        )


def _falcon_check(model: nn.Module, modules: list[nn.Module]) -> None:
    if getattr(model.config, "alibi", False):
        raise NotImplementedError(
            "falcon: ALiBi position bias (config.alibi=True) is added to the attention mask in eager and sdpa; "
            "transformers' Falcon flash-attention path (its own class up to 5.24, the attention interface from "
            "5.25), which volta_train runs, has no ALiBi. Use attn_implementation='sdpa' or 'eager' for this model"
        )


def _gpt_neo_window(module: nn.Module) -> int | None:
    # GPT-Neo's local layers mask all but the last config.window_size keys (its `bias` buffer); its flash-attention
    # class passes no window (transformers 5.x attends over the whole past there), eager and volta_train do.
    return int(module.config.window_size) if getattr(module, "attention_type", None) == "local" else None


def _pegasus_x_causal(module: nn.Module) -> bool | None:
    # PegasusXDecoderLayer builds its self-attention with is_causal=False and relies on the causal mask that eager and
    # sdpa apply; volta_train takes causality from the module, so here decoder self-attention is causal.
    if not isinstance(getattr(module, "is_decoder", None), bool):
        return None
    return module.is_decoder and not is_cross_attention(module)


SPECIAL: dict[str, Family] = {
    "gpt2": Family(
        "gpt2",
        min_transformers="5.3.0",
        before_min=(
            "older GPT-2 code builds a 4-D encoder mask itself and keeps output_attentions from the attention "
            "function (5.0-5.2), or passes is_causal=False whenever a mask is given (4.x)"
        ),
        check=_gpt2_check,
        default_scaling=_gpt2_scaling,
    ),
    "falcon": Family("falcon", check=_falcon_check),
    "pegasus_x": Family("pegasus_x", is_causal=_pegasus_x_causal),
    "gpt_neo": Family("gpt_neo", own_window=_gpt_neo_window),
}
"""Families with their own checks or defaults; every other qualifying model_type gets the generic :class:`Family`."""

REFUSED: dict[str, str] = {}
"""model_type values volta_train knows it cannot patch, with the reason (shown in the error); the rest is inspection."""


# ---- inspection -------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def routes_through_interface(cls: type) -> bool:
    """True when ``cls.forward`` reads transformers' ``ALL_ATTENTION_FUNCTIONS`` (so it calls the registered function)."""
    forward = vars(cls).get("forward")
    if forward is None:
        return False
    code = getattr(inspect.unwrap(forward), "__code__", None)
    return code is not None and INTERFACE_NAME in code.co_names


def interface_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` whose class's forward calls the attention interface."""
    return [module for module in model.modules() if any(routes_through_interface(c) for c in type(module).__mro__)]


FLASH_FUNCTION = "_flash_attention_forward"
"""What transformers' own flash-attention classes call (transformers.modeling_flash_attention_utils)."""

OWN_ATTENTION_CLASSES = ("PegasusXGlobalLocalAttention",)
"""Attention classes that compute attention themselves in every implementation, which :mod:`.swaps` replaces:
PEGASUS-X's encoder attention (global tokens plus block-local attention)."""

SWAPPED = "_volta_train_swap"
"""Class attribute of the classes :mod:`.swaps` builds: the original class of the module."""


def _calls_flash_function(cls: type) -> bool:
    forward = vars(cls).get("forward")
    code = getattr(inspect.unwrap(forward), "__code__", None) if forward is not None else None
    return code is not None and FLASH_FUNCTION in code.co_names


@functools.lru_cache(maxsize=None)
def flash_class_of(cls: type) -> type | None:
    """transformers' flash-attention class for a module of class ``cls`` that computes attention itself, or None.

    ``cls`` itself when its forward calls ``_flash_attention_forward``, else a direct subclass in its modeling module
    that does: the class a model picks at construction for ``attn_implementation="flash_attention_2"``, with the
    same weights (GPT-Neo's ``GPTNeoFlashAttention2``; Falcon's ``FalconFlashAttention2`` up to transformers 5.24, where
    Falcon's attention calls the interface from 5.25 on).
    """
    if getattr(cls, SWAPPED, None) is not None:
        return None
    if _calls_flash_function(cls):
        return cls
    import sys

    module = sys.modules.get(cls.__module__)
    for obj in vars(module or object).values():
        if isinstance(obj, type) and cls in obj.__bases__ and _calls_flash_function(obj):
            return obj
    return None


def _own_attention_class(cls: type) -> bool:
    return (getattr(cls, SWAPPED, None) is not None or cls.__name__ in OWN_ATTENTION_CLASSES
            or flash_class_of(cls) is not None)


def own_attention_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that compute attention themselves and that patch() swaps for a class running
    volta_train (:mod:`.swaps`), or swapped already."""
    return [module for module in model.modules() if _own_attention_class(type(module))]


def declares_flash_attention(cls: type) -> bool:
    return bool(getattr(cls, "_supports_flash_attn", False) or getattr(cls, "_supports_flash_attn_2", False))


@functools.lru_cache(maxsize=None)
def _model_class(model_type: str) -> type | None:
    """transformers' base model class for a model_type (its auto mapping), or None when it has none."""
    try:
        import transformers
        from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES
    except ImportError:
        return None
    name = MODEL_MAPPING_NAMES.get(model_type)
    if isinstance(name, (tuple, list)):
        name = name[0] if name else None
    if not name:
        return None
    try:
        return getattr(transformers, name)
    except (AttributeError, ImportError):
        return None


def _attention_classes_of(cls: type) -> list[str]:
    """The attention classes of ``cls``'s modeling module volta_train can run: those calling the attention interface,
    and those :mod:`.swaps` replaces."""
    import sys

    module = sys.modules.get(cls.__module__)
    return [
        name for name, obj in vars(module or object).items()
        if isinstance(obj, type) and issubclass(obj, nn.Module)
        and (routes_through_interface(obj) or _own_attention_class(obj))
    ]


def _bypass_reason(model_type: str) -> str:
    return REFUSED.get(model_type) or (
        "none of its modules calls transformers' attention interface (ALL_ATTENTION_FUNCTIONS) or has a "
        "flash-attention class: its modeling code computes attention itself, so no registered implementation can "
        "reach it"
    )


def _no_attention_layer_reason(model: nn.Module, classes: list[str]) -> str:
    return (
        f"this {type(model).__name__} holds no attention module ({', '.join(sorted(classes))} are its attention "
        "classes): its config builds no attention layer (hybrid models place them per layer, e.g. "
        "layers_block_type, attn_layer_indices, block_types), so there is nothing to patch"
    )


_VALIDATED_TYPES: set[str] = set()  # model_types patch() validated on a model instance (custom code included)


@functools.lru_cache(maxsize=None)
def why_not(model_type: Any) -> str | None:
    """None when transformers' model class for ``model_type`` qualifies; otherwise the reason, in words."""
    if model_type in REFUSED:
        return REFUSED[model_type]
    if not isinstance(model_type, str):
        return f"model_type {model_type!r} is not a transformers model type"
    cls = _model_class(model_type)
    if cls is None:
        return (
            "transformers has no model class registered for it (custom code: volta_train.patch(model) inspects the "
            "model itself)"
        )
    if not declares_flash_attention(cls):
        return f"transformers does not declare {cls.__name__} flash-attention capable (_supports_flash_attn is False)"
    if not _attention_classes_of(cls):
        return _bypass_reason(model_type)
    return None


def why_not_model(model: nn.Module, model_type: Any) -> str | None:
    """None when this model instance qualifies; otherwise the reason."""
    if model_type in REFUSED:
        return REFUSED[model_type]
    if not declares_flash_attention(type(model)):
        return (
            f"transformers does not declare {type(model).__name__} flash-attention capable "
            "(_supports_flash_attn is False)"
        )
    if not interface_modules(model) and not own_attention_modules(model):
        classes = _attention_classes_of(type(model))
        return _no_attention_layer_reason(model, classes) if classes else _bypass_reason(model_type)
    return None


def family_of(model_type: str) -> Family:
    return SPECIAL.get(model_type) or Family(model_type)


_VERSIONS_OK: set[tuple[str, str]] = set()  # (model_type, transformers version) pairs already checked


def check_version(family: Family) -> None:
    installed = base.installed_transformers()
    if (family.model_type, installed) in _VERSIONS_OK:
        return
    if release(installed) < release(family.min_transformers):
        raise TransformersVersionError(
            f"transformers {installed} is installed, but volta_train supports model_type {family.model_type!r} from "
            f"transformers>={family.min_transformers} ({family.before_min}); "
            f"pip install -U 'transformers>={family.min_transformers}'"
        )
    _VERSIONS_OK.add((family.model_type, installed))


def unsupported(model_type: Any, what: str, reason: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"{what} has model_type {model_type!r}, which volta_train cannot patch: {reason} (transformers "
        f"{base.installed_transformers()} installed). volta_train runs models that transformers declares "
        "flash-attention capable and whose attention goes through its attention interface. Its attention "
        "implementation was left unchanged."
    )


def require_family(model_type: Any, what: str) -> Family:
    """The Family of a model_type the attention function is called for, or UnsupportedModelError saying why not."""
    if model_type not in _VALIDATED_TYPES:
        reason = why_not(model_type)
        if reason is not None:
            raise unsupported(model_type, what, reason)
    family = family_of(model_type)
    check_version(family)
    return family


class _Families:
    """``model_type in FAMILIES`` says whether volta_train runs a model_type; ``FAMILIES[t]`` is its Family.

    Decided by :func:`why_not` (transformers' model class for the type), not from a list.
    """

    def __contains__(self, model_type: object) -> bool:
        return model_type in _VALIDATED_TYPES or why_not(model_type) is None

    def __getitem__(self, model_type: str) -> Family:
        if model_type not in self:
            raise KeyError(model_type)
        return family_of(model_type)

    def __iter__(self):
        """The model_types resolved so far (special families, and those patch() validated): not a whitelist."""
        return iter(sorted(set(SPECIAL) | _VALIDATED_TYPES))

    def get(self, model_type: str, default: Any = None) -> Any:
        return self[model_type] if model_type in self else default


FAMILIES = _Families()


# ---- per-module features --------------------------------------------------------------------------------


CENSUS_DIR = "census"
"""Beside this module: one table per transformers release, ``<release>.json``, written by tests/support/hf_census.py (every text
model type that release declares flash-attention capable, patched and compared with eager); the one source of what
README, docs/hf_integration.md and ``volta-train env`` say is supported."""


def census_releases() -> list[str]:
    """The transformers releases a census table is recorded for, oldest first."""
    from importlib import resources

    names = [p.name for p in resources.files(__package__).joinpath(CENSUS_DIR).iterdir() if p.name.endswith(".json")]
    return sorted((name.removesuffix(".json") for name in names), key=release)


@functools.lru_cache(maxsize=None)
def census(transformers_release: str | None = None) -> dict[str, Any]:
    """A census table: ``{"transformers": release, "results": {model_type: [status, detail]}}``.

    ``transformers_release`` None: the installed release's table where one is recorded, else the newest recorded
    release older than the installed one (the oldest when all are newer). ``record["transformers"]`` says which.
    """
    from importlib import resources

    recorded = census_releases()
    if transformers_release is None:
        installed = release(base.installed_transformers())
        older = [r for r in recorded if release(r) <= installed]
        transformers_release = older[-1] if older else recorded[0]
    elif transformers_release not in recorded:
        raise ValueError(f"transformers_release={transformers_release!r}: no census table is recorded for it; "
                         f"recorded: {', '.join(recorded)}")
    path = resources.files(__package__).joinpath(CENSUS_DIR, f"{transformers_release}.json")
    return json.loads(path.read_text())


def supported_model_types() -> tuple[str, ...]:
    """The model types the census found patched and equal to eager attention (``ok``), in the table :func:`census`
    picks for the installed release; patch() itself takes any model that passes :func:`why_not_model` and
    :func:`check_model`."""
    return tuple(sorted(t for t, (status, _) in census()["results"].items() if status == "ok"))


def head_dim_of(module: nn.Module) -> tuple[int, str] | None:
    """(head_dim, where it came from) of an attention module, or None when it cannot be told before a call."""
    for attribute in ("head_dim", "head_size", "attention_head_size"):
        value = getattr(module, attribute, None)
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value), f"{type(module).__name__}.{attribute}"
    config = getattr(module, "config", None)
    value = getattr(config, "head_dim", None)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value), "config.head_dim"
    return None


def check_head_dim(model_type: Any, head_dim: int, source: str, value_head_dim: int | None = None) -> int | None:
    """The kernel head_dim the calls of this head_dim run at (None: the reference backend); ValueError naming the
    model_type when the attention API refuses it."""
    try:
        return interface.kernel_head_dim(head_dim, value_head_dim)
    except ValueError as error:
        raise ValueError(f"{model_type}: head_dim {head_dim} ({source}): {error}") from None


def _module_window(module: nn.Module, config: Any) -> Any:
    """The sliding window of one attention module, read as the model reads it: the module's own attribute, else
    config.sliding_window on the layers layer_types marks sliding (Qwen2-MoE keeps sliding_window=0 on a config
    whose layers are all full attention)."""
    if "sliding_window" in vars(module):
        return module.sliding_window
    layer_types, index = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    if layer_types is not None and isinstance(index, int) and index < len(layer_types):
        return getattr(config, "sliding_window", None) if "sliding" in str(layer_types[index]) else None
    return getattr(config, "sliding_window", None)


def _check_window(model_type: Any, window: Any) -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 1):
        raise ValueError(
            f"{model_type}: an attention layer's sliding_window is {window!r}; volta_train accepts None or an int >= 1 "
            "(the tokens a query sees, itself included)"
        )


CROSS_ATTENTION_MARK = "_volta_cross_attention"  # set by check_model on modules found by name: an attribute of the
# module, so that it travels with a model pickled whole or copied


def is_cross_attention(module: nn.Module) -> bool:
    """Whether the keys of this module come from another sequence (its mask pads keys only, never queries)."""
    flag = getattr(module, "is_cross_attention", None)
    if isinstance(flag, bool):
        return flag
    return "CrossAttention" in type(module).__name__ or vars(module).get(CROSS_ATTENTION_MARK, False)


def check_model(model: nn.Module, model_type: Any, family: Family) -> list[nn.Module]:
    """Validate every attention module of ``model`` (those calling the attention interface, then those swaps.py
    replaces); returns them. Raises naming model_type and the feature."""
    interfaced = interface_modules(model)
    own = {id(module) for module in own_attention_modules(model)}
    modules = interfaced + [module for module in model.modules() if id(module) in own]
    names = {id(module): name for name, module in model.named_modules()}
    windows: dict[Any, int] = {}
    reference_dims: dict[int, tuple[Any, int | None]] = {}
    for module in modules:
        config = getattr(module, "config", None) or model.config
        owner = getattr(config, "model_type", None) or model_type
        chunk = getattr(config, "attention_chunk_size", None)
        if chunk is not None:
            raise NotImplementedError(
                f"{owner}: chunked attention (config.attention_chunk_size={chunk}) is not supported by volta_train; "
                "use attn_implementation='sdpa' or 'eager'"
            )
        window = family_of(owner).own_window(module) if id(module) in own else _module_window(module, config)
        _check_window(owner, window)
        if window is not None:
            windows[window] = windows.get(window, 0) + 1
        found = head_dim_of(module)
        if found is not None:
            padded = check_head_dim(owner, *found)
            if padded != found[0]:
                reference_dims[found[0]] = (owner, padded)
        if names.get(id(module), "").rsplit(".", 1)[-1] in CROSS_ATTENTION_NAMES:
            setattr(module, CROSS_ATTENTION_MARK, True)
    family.check(model, modules)
    for window, layers in windows.items():
        logger.info(
            "volta_train.patch: %s sliding_window=%s on %d of %d attention layers -> window_size=(%s, 0) if causal",
            model_type, window, layers, len(modules), int(window) - 1,
        )
    for head_dim, (owner, padded) in reference_dims.items():
        if padded is not None:
            logger.info("volta_train.patch: %s head_dim %d is zero-padded to %d for the Volta kernels", owner,
                        head_dim, padded)
        else:
            logger.info("volta_train.patch: %s head_dim %d runs on the reference backend: beyond the Volta kernels' "
                        "head dims", owner, head_dim)
    return modules


def validated(model_type: Any) -> None:
    """Remember that patch() validated a model of this type on its instance (so the attention function runs it)."""
    if isinstance(model_type, str):
        _VALIDATED_TYPES.add(model_type)
