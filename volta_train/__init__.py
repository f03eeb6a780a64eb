"""volta_train: FlashAttention-2 for V100 (sm_70) training, behind flash-attn's API.

Public API::

    volta_train.flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, ...)
    volta_train.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)
    volta_train.flash_attn_qkvpacked_func / flash_attn_kvpacked_func
    volta_train.patch(model) / volta_train.unpatch(model)      # HuggingFace transformers models
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .integrations.hf import patch, unpatch
    from .interface import (
        flash_attn_func,
        flash_attn_kvpacked_func,
        flash_attn_qkvpacked_func,
        flash_attn_varlen_func,
    )

_INTERFACE = ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func")

__version__ = "0.1.0"

__all__ = [
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "patch",
    "unpatch",
    "__version__",
]


def __getattr__(name: str):
    # Loaded on first use: the API imports torch (so `volta-train` and the recipes can set OpenMP's environment
    # before it loads), patch/unpatch import transformers, which is slow.
    if name in _INTERFACE:
        from . import interface

        return getattr(interface, name)
    if name in ("patch", "unpatch"):
        from .integrations import hf

        return getattr(hf, name)
    raise AttributeError(f"module 'volta_train' has no attribute {name!r}")
