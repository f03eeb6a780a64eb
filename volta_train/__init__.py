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

import ast
import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

# The public names, each written once: imported here for type checkers and IDEs, and at run time loaded on first use
# (the API imports torch, so `volta-train` and the recipes can set OpenMP's environment before it loads;
# patch/unpatch import transformers, which is slow). _PUBLIC reads this block back: name -> module.
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

__version__ = "0.1.0"


def _public_names() -> dict[str, str]:
    tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
    block = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    return {alias.name: node.module for node in block.body if isinstance(node, ast.ImportFrom)
            for alias in node.names}


_PUBLIC = _public_names()

__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'volta_train' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
