"""Which attention a recipe's model runs, and whether it keeps packed documents apart.

* :func:`apply_patch`: ``volta_train.patch(model)`` with the recipes' error messages.
* :func:`packed_documents_supported`: runs the model on two documents packed into
  one row (``position_ids`` restarting at the second) and on the second document
  alone; the implementation keeps documents apart when the second document's
  logits agree. This checks the whole route (transformers' mask building, the
  attention function's handling of packed rows) rather than trusting a version
  number: stock ``sdpa``/``eager`` pass through transformers' block-diagonal mask,
  ``volta_train`` needs its integration to detect packed sequences (varlen).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


class AttentionSetupError(RuntimeError):
    """The requested attention cannot be used for this model."""


def apply_patch(model, flag: str = "--no-patch") -> str:
    """Patch ``model``'s attention through volta_train; returns the attention implementation name."""
    try:
        import volta_train

        patch = volta_train.patch
    except ImportError as e:
        raise AttentionSetupError(f"volta_train.patch is unavailable ({e}); run with {flag}") from e
    from volta_train.integrations import hf

    try:
        patch(model)
    except (hf.UnsupportedModelError, hf.TransformersVersionError, ValueError) as e:
        raise AttentionSetupError(
            f"volta_train.patch refused this model: {e} (run with {flag} for stock attention)"
        ) from e
    return model.config._attn_implementation


@torch.no_grad()
def packed_documents_supported(model, vocab_limit: int = 256) -> tuple[bool, str]:
    """(True, "") when ``model`` keeps documents packed into one row apart (see the module doc), else (False, why).

    Runs two forwards of 24 tokens in fp32 on the model's current device, in eval mode.
    """
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        gen = torch.Generator().manual_seed(0)
        first = torch.randint(0, vocab_limit, (1, 16), generator=gen)
        second = torch.randint(0, vocab_limit, (1, 8), generator=gen)
        ids = torch.cat([first, second], 1).to(device)
        positions = torch.cat([torch.arange(16), torch.arange(8)]).unsqueeze(0).to(device)
        try:
            packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits[:, 16:].float()
        except (NotImplementedError, ValueError) as e:
            return False, f"{type(e).__name__}: {str(e).splitlines()[0]}"
        alone = model(input_ids=second.to(device), use_cache=False).logits.float()
        err = (packed - alone).abs().max().item()
        scale = alone.abs().max().item()
        if err > 1e-3 * max(scale, 1.0):
            return False, f"the second document's logits differ by {err:.3g} from the document run alone"
        return True, ""
    finally:
        model.train(was_training)
