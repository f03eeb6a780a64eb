"""Which attention a recipe's model runs, and whether it keeps packed documents apart.

* :func:`apply_patch`: ``volta_train.patch(model)`` with the recipes' error messages.
* :func:`packed_documents_supported`: runs the model on two documents packed into
  one row (``position_ids`` restarting at the second) and on the second document
  alone; the implementation keeps documents apart when the second document's
  logits agree. This checks the whole route (transformers' mask building, the
  attention function's handling of packed rows) rather than trusting a version
  number: stock ``sdpa``/``eager`` pass through transformers' block-diagonal mask,
  ``volta_train`` needs its integration to detect packed sequences (varlen).
  A model partitioned by ZeRO-3 (built under ``deepspeed.zero.Init``) runs with
  each module's weights gathered for its own forward only.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch

import volta_train

logger = logging.getLogger(__name__)


class AttentionSetupError(RuntimeError):
    """The requested attention cannot be used for this model."""


def apply_patch(model, flag: str = "--no-patch") -> str:
    """Patch ``model``'s attention through volta_train; returns the attention implementation name."""
    try:
        patch = volta_train.patch
    except ImportError as e:
        raise AttentionSetupError(f"volta_train.patch is unavailable ({e}); run with {flag}") from e
    from volta_train.integrations import hf  # (imports transformers, which importing training/ does not)

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
        if hasattr(next(model.parameters()), "ds_id"):  # partitioned: gathered onto DeepSpeed's device
            from deepspeed.accelerator import get_accelerator

            device = torch.device(get_accelerator().current_device_name())
        gen = torch.Generator().manual_seed(0)
        first = torch.randint(0, vocab_limit, (1, 16), generator=gen)
        second = torch.randint(0, vocab_limit, (1, 8), generator=gen)
        ids = torch.cat([first, second], 1).to(device)
        positions = torch.cat([torch.arange(16), torch.arange(8)]).unsqueeze(0).to(device)
        with _gathered_per_module(model):
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


@contextmanager
def _gathered_per_module(model):
    """Under ZeRO-3 partitioning (parameters with ``ds_id``, before prepare()): each module's own parameters gathered
    for the length of its forward, so that at most a module's weights are whole at once. Otherwise nothing."""
    if not any(hasattr(p, "ds_id") for p in model.parameters()):
        yield
        return
    import deepspeed

    gathered = {}

    def gather(module, args):
        context = deepspeed.zero.GatheredParameters(list(module.parameters(recurse=False)))
        context.__enter__()
        gathered.setdefault(module, []).append(context)

    def release(module, args, output):
        gathered[module].pop().__exit__(None, None, None)

    handles = []
    for module in model.modules():
        if next(module.parameters(recurse=False), None) is not None:
            handles += [module.register_forward_pre_hook(gather), module.register_forward_hook(release)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for contexts in gathered.values():  # a forward that raised: release what it left gathered
            while contexts:
                contexts.pop().__exit__(None, None, None)
