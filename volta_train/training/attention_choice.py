"""Which attention a recipe's model runs, and whether it keeps packed documents apart.

* :func:`apply_patch`: ``volta_train.patch(model)`` with the recipes' error messages.
* :func:`packed_documents_supported`: runs the model on two documents packed into
  one row (``position_ids`` restarting at the second) and on the second document
  alone; the implementation keeps documents apart when the second document's
  logits agree. This checks the whole route (transformers' mask building, the
  attention function's handling of packed rows) rather than trusting a version
  number: stock ``sdpa``/``eager`` pass through transformers' block-diagonal mask,
  ``volta_train`` needs its integration to detect packed sequences (varlen).
  The check always computes in fp32, whatever the model's weights are stored in:
  a model partitioned by ZeRO-3 (built under ``deepspeed.zero.Init``, its weights
  fp16 with fp16 mixed precision) runs with each module's weights gathered and
  copied to fp32 for its own forward only, so that fp16 rounding (packed and single
  rows take different GEMM tilings on a GPU) never decides, and the decision under
  ZeRO-3 is the one without it. Every process takes process 0's decision.
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

    Runs two forwards of 24 tokens in fp32 on the model's current device, in eval mode; under torch.distributed every
    process returns process 0's answer (all of them must call this: ZeRO-3 gathers weights collectively).
    """
    return _agreed(_packed_documents_check(model, vocab_limit))


def _agreed(result: tuple[bool, str]) -> tuple[bool, str]:
    """Process 0's result on every process, so that all of them pack their data the same way."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return result
    shared = [result]
    dist.broadcast_object_list(shared, src=0)
    return tuple(shared[0])


def _packed_documents_check(model, vocab_limit: int) -> tuple[bool, str]:
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
        with _fp32_per_module(model):
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


def attention_module(model):
    """The first attention module of a causal LM (what transformers passes to the attention function)."""
    for module in model.modules():
        if module is not model and hasattr(module, "is_causal") and hasattr(module, "config") \
                and "attention" in type(module).__name__.lower():
            return module
    raise ValueError(f"{type(model).__name__} has no attention module with is_causal and config")


def packed_documents_kept_apart(model, sequence_parallel: bool, vocab_limit: int = 256) -> tuple[bool, str]:
    """What both recipes ask before packing documents into rows: :func:`packed_documents_supported`, and under
    sequence parallelism the route DeepSpeed-Ulysses takes as well (no mask, the whole row's position ids)."""
    ok, why = packed_documents_supported(model, vocab_limit=vocab_limit)
    if ok and sequence_parallel:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        from . import sequence_parallel as ulysses

        function = ALL_ATTENTION_FUNCTIONS[model.config._attn_implementation]
        ok, why = ulysses.keeps_documents_apart(function, attention_module(model))
        if not ok:
            why = f"under sequence parallelism: {why}"
    return ok, why


@contextmanager
def _fp32_per_module(model):
    """Each module's own parameters and buffers in fp32 for the length of its forward, gathered first under ZeRO-3
    partitioning (parameters with ``ds_id``, before prepare()), so that at most a module's weights are whole at once.
    Nothing when every floating parameter and buffer is already an fp32 tensor of its own."""
    tensors = [*model.parameters(), *model.buffers()]
    partitioned = any(hasattr(p, "ds_id") for p in tensors)
    if not partitioned and all(t.dtype == torch.float32 for t in tensors if t.is_floating_point()):
        yield
        return
    if partitioned:
        import deepspeed

    entered = {}  # module -> [(gather context or None, [(tensor, its own data)])], one entry per forward in flight

    def to_fp32(module, args):
        context = None
        if partitioned:
            context = deepspeed.zero.GatheredParameters(list(module.parameters(recurse=False)))
            context.__enter__()
        saved = []
        for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if t.is_floating_point() and t.dtype != torch.float32:
                saved.append((t, t.data))
                t.data = t.data.float()
        entered.setdefault(module, []).append((context, saved))

    def restore(module, args, output):
        _undo(*entered[module].pop())

    handles = []
    for module in model.modules():
        owns = next(module.parameters(recurse=False), None) is not None or \
            next(module.buffers(recurse=False), None) is not None
        if owns:
            handles += [module.register_forward_pre_hook(to_fp32), module.register_forward_hook(restore)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for stack in entered.values():  # a forward that raised: restore and release what it left
            while stack:
                _undo(*stack.pop())


def _undo(context, saved) -> None:
    for t, data in reversed(saved):
        t.data = data
    if context is not None:
        context.__exit__(None, None, None)
