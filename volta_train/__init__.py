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

import importlib
from typing import Any

__version__ = "0.1.0"

# The public names and the module each comes from, loaded on first use: the API imports torch (so `volta-train` and
# the recipes can set OpenMP's environment before it loads), patch/unpatch import transformers, which is slow.
_PUBLIC = {
    "flash_attn_func": "interface",
    "flash_attn_varlen_func": "interface",
    "flash_attn_qkvpacked_func": "interface",
    "flash_attn_kvpacked_func": "interface",
    "flash_attn_varlen_qkvpacked_func": "interface",
    "flash_attn_varlen_kvpacked_func": "interface",
    "flash_attn_with_kvcache": "interface",
    "kernel_head_dim": "interface",
    "unpad_input": "bert_padding",
    "pad_input": "bert_padding",
    "index_first_axis": "bert_padding",
    "index_put_first_axis": "bert_padding",
    "patch": "integrations.hf",
    "unpatch": "integrations.hf",
    "install_flash_attn": "flash_attn_compat",
}

__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'volta_train' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
