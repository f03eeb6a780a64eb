"""``volta_train.install_flash_attn()``: serve volta_train as the ``flash_attn`` package where flash-attn is absent.

After it, ``import flash_attn``, ``flash_attn.flash_attn_interface`` (with ``_get_block_size_n``, which
flash-attn's tests read), ``flash_attn.bert_padding`` and ``flash_attn.layers.rotary`` (``apply_rotary_emb``)
resolve to volta_train's functions, so code written for
flash-attn 2 runs unchanged, and transformers' ``attn_implementation="flash_attention_2"``
loads them: transformers asks ``importlib.util.find_spec("flash_attn")`` and the
``flash-attn`` distribution's version (``importlib.metadata``), so a distribution
finder on ``sys.meta_path`` answers for it with :data:`FLASH_ATTN_VERSION`. Nothing
is written to disk. transformers still requires a CUDA device for flash_attention_2.

Where the real flash-attn is installed, it refuses (it would shadow it).
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import logging
import sys
import types
from typing import Any


from . import attn_probs, bert_padding, interface, rotary

logger = logging.getLogger("volta_train")

FLASH_ATTN_VERSION = "2.6.3"
"""The flash-attn release whose API volta_train follows (window_size, alibi_slopes, deterministic, softcap keyword)."""

_MODULES = ("flash_attn", "flash_attn.flash_attn_interface", "flash_attn.bert_padding", "flash_attn.layers",
            "flash_attn.layers.rotary")
_MARK = "__volta_train__"


def _normalized(name: str | None) -> str | None:
    return None if name is None else name.replace("-", "_").replace(".", "_").lower()


class _Distribution(importlib.metadata.Distribution):
    """The metadata transformers reads: Name flash-attn, the version, top-level package flash_attn."""

    _TEXT = {
        "METADATA": (
            f"Metadata-Version: 2.1\nName: flash-attn\nVersion: {FLASH_ATTN_VERSION}\n"
            "Summary: flash-attn's API served by volta_train (volta_train.install_flash_attn)\n"
        ),
        "top_level.txt": "flash_attn\n",
    }

    def read_text(self, filename: str) -> str | None:
        return self._TEXT.get(filename)

    def locate_file(self, path: Any) -> Any:
        return path


class _Finder:
    """A meta path entry that finds no modules, only the flash-attn distribution's metadata."""

    def find_spec(self, *args: Any, **kwargs: Any) -> None:
        return None

    def find_distributions(self, context: Any = importlib.metadata.DistributionFinder.Context()):
        name = _normalized(getattr(context, "name", None))
        if name is None or name == "flash_attn":
            yield _Distribution()


_FINDER = _Finder()


def _module(name: str, attributes: dict[str, Any], package: bool = False) -> types.ModuleType:
    module = types.ModuleType(name, f"flash-attn's {name} served by volta_train (volta_train.install_flash_attn)")
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        module.__path__ = []
    module.__dict__.update(attributes)
    setattr(module, _MARK, True)
    return module


def _real_flash_attn() -> str | None:
    """Where the real flash-attn is installed, or None."""
    existing = sys.modules.get("flash_attn")
    if existing is not None:
        return None if getattr(existing, _MARK, False) else getattr(existing, "__file__", "an imported module")
    if _FINDER in sys.meta_path:
        return None
    try:
        spec = importlib.util.find_spec("flash_attn")
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        return str(spec.origin or spec.submodule_search_locations)
    try:
        return f"distribution flash-attn {importlib.metadata.version('flash-attn')}"
    except importlib.metadata.PackageNotFoundError:
        return None


def _clear_transformers_caches() -> None:
    """transformers caches its availability probes; they must see the change.

    Releases before the cached ``_package_distribution_mapping()`` (5.17 and earlier, e.g.) keep a module-level
    ``PACKAGE_DISTRIBUTION_MAPPING`` dict taken at import time: its flash_attn entry follows :func:`is_installed`.
    """
    utils = sys.modules.get("transformers.utils.import_utils")
    if utils is None:
        return
    mapping = getattr(utils, "PACKAGE_DISTRIBUTION_MAPPING", None)
    if isinstance(mapping, dict):
        if is_installed():
            mapping.setdefault("flash_attn", ["flash-attn"])
        elif mapping.get("flash_attn") == ["flash-attn"]:
            del mapping["flash_attn"]
    for name in ("_package_distribution_mapping", "is_flash_attn_2_available", "is_flash_attn_greater_or_equal",
                 "is_flash_attn_3_available", "is_flash_attn_4_available"):
        cache_clear = getattr(getattr(utils, name, None), "cache_clear", None)
        if cache_clear is not None:
            cache_clear()


def is_installed() -> bool:
    """Whether ``flash_attn`` is currently volta_train's."""
    return getattr(sys.modules.get("flash_attn"), _MARK, False)


def install_flash_attn() -> types.ModuleType:
    """Make ``import flash_attn`` (and its ``flash_attn_interface``, ``bert_padding`` and ``layers.rotary``) resolve to
    volta_train.

    Returns the ``flash_attn`` module. Idempotent. Raises RuntimeError where the real
    flash-attn is installed: volta_train would shadow it.
    """
    if is_installed():
        return sys.modules["flash_attn"]
    real = _real_flash_attn()
    if real is not None:
        raise RuntimeError(
            f"flash-attn is installed ({real}): volta_train.install_flash_attn() serves volta_train as flash_attn only "
            "where flash-attn is absent; pip uninstall flash-attn, or call volta_train.flash_attn_func directly"
        )
    functions = {
        "flash_attn_func": interface.flash_attn_func,
        "flash_attn_varlen_func": interface.flash_attn_varlen_func,
        "flash_attn_qkvpacked_func": interface.flash_attn_qkvpacked_func,
        "flash_attn_kvpacked_func": interface.flash_attn_kvpacked_func,
        "flash_attn_varlen_qkvpacked_func": interface.flash_attn_varlen_qkvpacked_func,
        "flash_attn_varlen_kvpacked_func": interface.flash_attn_varlen_kvpacked_func,
        "flash_attn_with_kvcache": interface.flash_attn_with_kvcache,
    }
    padding = _module("flash_attn.bert_padding", {name: getattr(bert_padding, name) for name in bert_padding.__all__})
    # _get_block_size_n: the key-block width of S_dmask's running maximum (volta_train.attn_probs)
    api = _module("flash_attn.flash_attn_interface", {**functions, "_get_block_size_n": attn_probs.get_block_size_n})
    rotary_module = _module("flash_attn.layers.rotary", {"apply_rotary_emb": rotary.apply_rotary_emb,
                                                          "apply_rotary_emb_func": rotary.apply_rotary_emb_func})
    layers = _module("flash_attn.layers", {"rotary": rotary_module}, package=True)
    package = _module("flash_attn", {**functions, "__version__": FLASH_ATTN_VERSION, "flash_attn_interface": api,
                                     "bert_padding": padding, "layers": layers}, package=True)
    sys.modules.update({"flash_attn": package, "flash_attn.flash_attn_interface": api, "flash_attn.bert_padding": padding,
                        "flash_attn.layers": layers, "flash_attn.layers.rotary": rotary_module})
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)
    _clear_transformers_caches()
    logger.info("volta_train.install_flash_attn: flash_attn %s now resolves to volta_train", FLASH_ATTN_VERSION)
    return package


def uninstall_flash_attn() -> None:
    """Undo :func:`install_flash_attn` (for tests); a no-op where it was not installed."""
    if not is_installed():
        return
    for name in _MODULES:
        sys.modules.pop(name, None)
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    _clear_transformers_caches()
    fa_utils = sys.modules.get("transformers.modeling_flash_attention_utils")
    if fa_utils is not None and getattr(fa_utils, "_loaded_implementation", None) == "flash_attention_2":
        fa_utils._loaded_implementation = None  # transformers would keep calling the functions it loaded


__all__ = ["FLASH_ATTN_VERSION", "install_flash_attn", "uninstall_flash_attn", "is_installed"]
