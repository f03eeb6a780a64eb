"""register / patch / unpatch: put volta_train's attention and mask functions under a model's configs."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .attention import hf_attention_forward, refuse_attention_weights
from .base import ATTN_IMPLEMENTATION, UnsupportedModelError, interfaces
from .families import (CROSS_ATTENTION_MARK, check_model, check_version, family_of, unsupported, validated,
                       why_not_model)
from .masks import padding_mask
from . import swaps

logger = logging.getLogger("volta_train")

_PATCH_ATTR = "_volta_train_patch"


def register() -> str:
    """Register :data:`ATTN_IMPLEMENTATION` with transformers (attention + mask function); returns the name.

    Afterwards ``from_pretrained(..., attn_implementation="volta_train")`` and
    ``model.set_attn_implementation("volta_train")`` work. Idempotent.
    """
    attention_interface, mask_interface = interfaces()
    attention_interface.register(ATTN_IMPLEMENTATION, hf_attention_forward)
    mask_interface.register(ATTN_IMPLEMENTATION, padding_mask)
    logger.debug("volta_train: registered attn_implementation=%r with transformers", ATTN_IMPLEMENTATION)
    return ATTN_IMPLEMENTATION


@dataclass
class PatchRecord:
    """What patch() changed on a model, so that unpatch() can put it back."""

    previous: list[tuple[Any, Any]] = field(default_factory=list)  # (config, its attn implementation before)
    hook: Any = None  # the forward pre-hook refusing output_attentions=True
    swapped: list[tuple[Any, ...]] = field(default_factory=list)  # modules given a volta_train class (swaps.py)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # a patched model loaded whole (torch.load) in a process that has not registered volta_train's attention yet
        self.__dict__.update(state)
        register()


def _configs_of(model: nn.Module) -> list[Any]:
    from transformers import PretrainedConfig

    configs: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(config, PretrainedConfig):
            configs.setdefault(id(config), config)
    return list(configs.values())


def _submodels(model: nn.Module) -> list[nn.Module]:
    from transformers import PreTrainedModel

    return [module for module in model.modules() if isinstance(module, PreTrainedModel)] or [model]


def _set_attn_implementation(config: Any, value: Any) -> None:
    # The internal attribute: the public setter of transformers 5.x also rewrites sub-configs, which we track ourselves.
    if hasattr(config, "_attn_implementation_internal"):
        config._attn_implementation_internal = value
    else:
        config._attn_implementation = value


def _refuse_output_attentions_hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    if kwargs.get("output_attentions"):
        raise refuse_attention_weights(f"passed to {type(module).__name__}.forward")


def _validate(model: nn.Module) -> list[nn.Module]:
    """Checks every (sub)model; returns the attention modules. Raises naming model_type and what is missing."""
    name = type(model).__name__
    for index, submodel in enumerate(_submodels(model)):
        model_type = getattr(getattr(submodel, "config", None), "model_type", None)
        what = f"model {name}" if index == 0 else f"{type(submodel).__name__} (a submodel of {name})"
        reason = why_not_model(submodel, model_type)
        if reason is not None:
            raise unsupported(model_type, what, reason)
        check_version(family_of(model_type))
    model_type = model.config.model_type
    modules = check_model(model, model_type, family_of(model_type))
    for submodel in _submodels(model):
        validated(getattr(submodel.config, "model_type", None))
    return modules


def patch(model: nn.Module) -> nn.Module:
    """Route the attention of a HuggingFace model through volta_train; returns the model.

    Idempotent. Raises :class:`UnsupportedModelError` saying why for models whose
    attention volta_train cannot reach (not declared flash-attention capable by
    transformers, or attention computed outside the attention interface by modules
    without a flash-attention class; see :mod:`.swaps` for those that have one),
    NotImplementedError/ValueError naming the model_type and the feature it cannot
    honour, and :class:`TransformersVersionError` when the installed transformers is
    too old; it never falls back to stock attention silently.
    """
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"model is a {type(model).__name__}: volta_train.patch takes a transformers PreTrainedModel")
    name = type(model).__name__
    register()
    attention_modules = _validate(model)
    if not attention_modules:
        raise UnsupportedModelError(
            f"model {name} (model_type {config.model_type!r}) has no module that calls transformers' attention "
            "interface: nothing to patch"
        )
    configs = _configs_of(model)
    record = model.__dict__.get(_PATCH_ATTR)
    if record is None:
        swapped = swaps.swap(model, config.model_type)
        record = PatchRecord(
            previous=[(c, c._attn_implementation) for c in configs],
            hook=model.register_forward_pre_hook(_refuse_output_attentions_hook, with_kwargs=True),
            swapped=swapped,
        )
        model.__dict__[_PATCH_ATTR] = record
        before = ", ".join(sorted({repr(previous) for _, previous in record.previous}))
        logger.info(
            "volta_train.patch: %s (%s): %d attention modules now use attn_implementation=%r (was %s)",
            name, config.model_type, len(attention_modules), ATTN_IMPLEMENTATION, before,
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
    swaps.restore(record.swapped)
    for module in model.modules():
        vars(module).pop(CROSS_ATTENTION_MARK, None)
    restored = ", ".join(sorted({repr(previous) for _, previous in record.previous}))
    logger.info("volta_train.unpatch: %s uses attn_implementation=%s again", name, restored)
    return model
