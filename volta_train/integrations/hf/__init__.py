"""HuggingFace transformers models on volta_train attention, through transformers' attention interface.

::

    import volta_train
    model = volta_train.patch(model)     # attention now runs volta_train.flash_attn_func / _varlen_func
    volta_train.unpatch(model)           # back to the previous implementation ("sdpa", "eager", ...)

or at load time::

    from volta_train.integrations import hf
    hf.register()
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="volta_train")

transformers (5.x) looks attention up by name in two registries: ``AttentionInterface``
(the attention function) and ``AttentionMaskInterface`` (the function that builds the
mask the model hands to it). :func:`register` puts one of each under
:data:`ATTN_IMPLEMENTATION`; :func:`patch` checks the model and sets that name on its
config(s). One module per concern:

* :mod:`.families`: which models qualify (declared flash-attention capable by
  transformers, attention through the interface) and the per-module features
  volta_train must honour; family-specific code only for GPT-2.
* :mod:`.masks`: the mask function (:func:`padding_mask`, :class:`Packing`).
* :mod:`.attention`: the attention function (:func:`hf_attention_forward`).
* :mod:`.patching`: :func:`register`, :func:`patch`, :func:`unpatch`.
* :mod:`.base`: the registered name, the errors, transformers version checks.
"""

from __future__ import annotations

from .attention import hf_attention_forward
from .base import (
    ATTN_IMPLEMENTATION,
    MASK_INTERFACE_SINCE,
    MIN_TRANSFORMERS,
    TransformersVersionError,
    UnsupportedModelError,
    installed_transformers,
    release,
)
from .families import FAMILIES, REFUSED, SPECIAL, Family, census, census_releases, supported_model_types
from .masks import Packing, padding_mask
from .patching import PatchRecord, patch, register, unpatch

__all__ = [
    "ATTN_IMPLEMENTATION",
    "FAMILIES",
    "census",
    "census_releases",
    "supported_model_types",
    "Family",
    "MASK_INTERFACE_SINCE",
    "MIN_TRANSFORMERS",
    "Packing",
    "PatchRecord",
    "REFUSED",
    "SPECIAL",
    "TransformersVersionError",
    "UnsupportedModelError",
    "installed_transformers",
    "release",
    "hf_attention_forward",
    "padding_mask",
    "patch",
    "register",
    "unpatch",
]
