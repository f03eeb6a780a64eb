"""volta_train: FlashAttention-2 for V100 (sm_70) training, behind flash-attn's API.

Public API::

    volta_train.flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, ...)
    volta_train.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)
    volta_train.flash_attn_qkvpacked_func / flash_attn_kvpacked_func
    volta_train.flash_attn_varlen_qkvpacked_func / flash_attn_varlen_kvpacked_func
    volta_train.flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, ...)
    volta_train.unpad_input / pad_input / index_first_axis   # flash_attn.bert_padding's helpers
    volta_train.kernel_head_dim(head_dim, value_head_dim=None) # the head_dim the kernels run it at, or None
    volta_train.patch(model) / volta_train.unpatch(model)      # HuggingFace transformers models
    volta_train.install_flash_attn()                            # `import flash_attn` resolves to volta_train
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .bert_padding import index_first_axis, index_put_first_axis, pad_input, unpad_input
    from .flash_attn_compat import install_flash_attn
    from .integrations.hf import patch, unpatch
    from .interface import (
        flash_attn_func,
        flash_attn_kvpacked_func,
        flash_attn_qkvpacked_func,
        flash_attn_varlen_func,
        flash_attn_varlen_kvpacked_func,
        flash_attn_varlen_qkvpacked_func,
        flash_attn_with_kvcache,
        kernel_head_dim,
    )

_INTERFACE = ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
              "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache",
              "kernel_head_dim")
_PADDING = ("unpad_input", "pad_input", "index_first_axis", "index_put_first_axis")

__version__ = "0.1.0"

__all__ = [
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
    "kernel_head_dim",
    "unpad_input",
    "pad_input",
    "index_first_axis",
    "index_put_first_axis",
    "patch",
    "unpatch",
    "install_flash_attn",
    "__version__",
]


def __getattr__(name: str):
    # Loaded on first use: the API imports torch (so `volta-train` and the recipes can set OpenMP's environment
    # before it loads), patch/unpatch import transformers, which is slow.
    if name in _INTERFACE:
        from . import interface

        return getattr(interface, name)
    if name in _PADDING:
        from . import bert_padding

        return getattr(bert_padding, name)
    if name in ("patch", "unpatch"):
        from .integrations import hf

        return getattr(hf, name)
    if name == "install_flash_attn":
        from .flash_attn_compat import install_flash_attn

        return install_flash_attn
    raise AttributeError(f"module 'volta_train' has no attribute {name!r}")
