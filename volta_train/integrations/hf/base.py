"""Names, errors and transformers version checks shared by the modules of :mod:`volta_train.integrations.hf`."""

from __future__ import annotations

ATTN_IMPLEMENTATION = "volta_train"
"""The name registered with transformers: ``attn_implementation="volta_train"``.

Not "volta_flash": transformers treats every implementation whose name contains "flash" as a flash-attn build
and tries to import one at load time.
"""

MIN_TRANSFORMERS = "5.0.0"
"""First transformers release the integration supports (4.x builds masks and caches differently)."""

MASK_INTERFACE_SINCE = "4.53.0"
"""First transformers release with ``AttentionMaskInterface`` (transformers.masking_utils)."""


class UnsupportedModelError(ValueError):
    """patch() was given a model (config.model_type) whose attention volta_train cannot run, with the reason."""


class TransformersVersionError(RuntimeError):
    """The installed transformers is too old for this integration (or for one model family)."""


def release(version: str) -> tuple[int, ...]:
    from packaging.version import Version

    return Version(version).release


def installed_transformers() -> str:
    import transformers

    return transformers.__version__


def interfaces() -> tuple[type, type]:
    """(AttentionInterface, AttentionMaskInterface), or a TransformersVersionError naming what is needed."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as error:
        raise TransformersVersionError(
            f"transformers {installed_transformers()} has no AttentionMaskInterface (transformers.masking_utils, "
            f"added in {MASK_INTERFACE_SINCE}): a custom attention implementation would receive no padding mask. "
            f"volta_train's HF integration needs transformers>={MIN_TRANSFORMERS} "
            f"(pip install -U 'transformers>={MIN_TRANSFORMERS}')"
        ) from error
    return AttentionInterface, AttentionMaskInterface
