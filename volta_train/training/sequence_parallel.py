"""Sequence parallelism: DeepSpeed-Ulysses with volta_train's attention, and the shards and loss around it.

DeepSpeed-Ulysses splits every sequence into ``sp`` shards, one per process of a
sequence-parallel group. Around each attention call, DeepSpeed's
``UlyssesSPAttentionHF`` (``deepspeed.runtime.sequence_parallel.ulysses_sp``, in
DeepSpeed >= 0.18.2) exchanges q/k/v with an all-to-all so that each process holds
the *whole* sequence for ``heads / sp`` of the heads, calls the core attention
implementation on that, and exchanges the output back to sequence shards. Nothing
here reimplements that exchange: this module only makes volta_train the core
attention and checks what DeepSpeed would otherwise check late or not at all.

How volta_train becomes the core attention. DeepSpeed's
``UlyssesSPAttentionHF.register_with_transformers(model, core_attn_implementation,
...)`` accepts any name registered in transformers' ``ALL_ATTENTION_FUNCTIONS`` and
replaces that entry with its wrapper (so every ``config._attn_implementation ==
name`` branch of transformers still runs). volta_train registers itself there as
``"volta_train"`` (:func:`volta_train.integrations.hf.register`), so the name is
accepted as it is. Two things stand in the way and are handled here without
touching DeepSpeed's or Accelerate's files:

* Accelerate's ``DeepSpeedSequenceParallelConfig`` only lets
  ``flash_attention_2``/``flash_attention_3``/``sdpa`` or hub flash-attn kernels
  through its constructor (a check in ``__post_init__``; DeepSpeed itself has no
  such list). :func:`parallelism_config` builds it with a name it accepts and then
  sets ``sp_attn_implementation`` to the model's implementation.
* ``register_with_transformers`` reads ``num_key_value_heads`` from the model
  config, which GPT-2's config does not have. :func:`kv_heads_alias` adds it
  (= the number of heads) for the duration of the registration, then removes it.

Order matters: ``volta_train.patch(model)`` (which calls ``hf.register()``) must
run *before* the registration; calling ``hf.register()`` or ``patch()`` again
afterwards would put the plain volta_train function back in the registry and
silently turn sequence parallelism off. :func:`ensure_installed` detects that.

Causal masks and packed documents. The wrapper drops the attention mask
transformers built for the local shard (it would be the wrong length) and hands the
core attention the *gathered* ``position_ids`` of the whole sequence. volta_train's
attention is causal from the module, and (in integrations that find packed
sequences in ``position_ids``) keeps documents apart through its varlen path;
:func:`keeps_documents_apart` checks that on the function itself. Stock ``sdpa``
does not (it becomes plain causal attention across documents).

Around that attention, what a training loop needs:

* :class:`Layout`: ``sp`` consecutive ranks form a sequence-parallel group (DeepSpeed's
  grouping); the data-parallel degree is ``world / sp`` and the group's index is the
  data-parallel rank. Every process of a group reads the *same* micro-batch (the
  sampler runs with ``dp`` replicas) and keeps its own shard of each sequence, so no
  data is exchanged and micro-batch ``m`` stays a pure function of (seed, m, dp rank).
* :func:`shard_batch`: labels shifted over the *whole* sequence first (the last token of
  a shard predicts the first token of the next one), the sequence padded at its end to
  a multiple of ``sp`` (padding: token 0, its own positions from 0, no targets), then
  the ``sp_rank``-th slice of ``input_ids``, ``position_ids`` (always present: Ulysses
  gathers them to rebuild the whole sequence's positions) and ``shift_labels``.
* :func:`sharded_loss`: the mean token loss of the whole micro-batch. Each process sums
  its shard's token losses; the sums and target counts are all-reduced over the group
  (no gradient flows through that), so the *value* is the full-sequence mean on every
  process, equal to the single-process loss, while the *gradient* is that of the local
  sum divided by the group's target count. DeepSpeed sums gradients over all processes
  and divides by the data-parallel degree (not the world size) when it knows the
  sequence-parallel groups, which gives exactly the single-process gradient for the
  group's micro-batch, averaged over data-parallel groups. (ZeRO-3's default reduce-scatter
  divides by the world size instead; ``grad_factor`` = ``sp`` makes up for it: see
  :func:`gradient_factor`.) The shard's token losses come from
  :mod:`.chunked_loss` (no ``[shard tokens, vocab]`` logits) unless ``chunked`` is False or the
  model does not qualify (:func:`.chunked_loss.supported`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import chunked_loss
from .chunked_loss import shift_labels

logger = logging.getLogger("volta_train")

MIN_DEEPSPEED = "0.18.2"
"""First DeepSpeed release with ``UlyssesSPAttentionHF.register_with_transformers`` (also Accelerate's minimum)."""

OPTION = "sequence_parallel_size"
"""The name of the sequence-parallel degree in the recipes (errors name it)."""


class SequenceParallelError(ValueError):
    """A sequence-parallel setup that cannot work: heads, processes, DeepSpeed version, attention."""


# --------------------------------------------------------------------------------------------------
# Checks on the degree
# --------------------------------------------------------------------------------------------------


def heads_of(config: Any) -> tuple[int, int]:
    """(attention heads, key/value heads) of a transformers config (GPT-2's n_head included; kv = heads if absent)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None) or getattr(text, "n_head", None)
    if not heads:
        raise SequenceParallelError(
            f"{type(config).__name__} has neither num_attention_heads nor n_head: cannot split its heads over "
            "the sequence-parallel group"
        )
    kv = getattr(text, "num_key_value_heads", None) or heads
    return int(heads), int(kv)


def degree_fits_heads(sp: int, heads: int, kv_heads: int) -> bool:
    """What DeepSpeed-Ulysses needs: sp divides the heads, and the kv heads divide by sp or sp by them."""
    return heads % sp == 0 and (kv_heads % sp == 0 or sp % kv_heads == 0)


def accepted_degrees(heads: int, kv_heads: int, processes: int | None = None) -> list[int]:
    """Every sequence-parallel degree the heads allow (and that divides ``processes``, when given)."""
    limit = heads if processes is None else min(heads, processes)
    return [sp for sp in range(1, limit + 1)
            if degree_fits_heads(sp, heads, kv_heads) and (processes is None or processes % sp == 0)]


def check_degree(sp: int, heads: int, kv_heads: int | None = None, processes: int | None = None,
                 option: str = OPTION, heads_name: str = "n_head", kv_name: str = "n_kv_head") -> None:
    """Raise :class:`SequenceParallelError` naming ``option`` and the accepted values when ``sp`` cannot work."""
    kv_heads = heads if kv_heads is None else kv_heads
    if not isinstance(sp, int) or isinstance(sp, bool) or sp < 1:
        raise SequenceParallelError(f"{option} must be an integer >= 1 (1: no sequence parallelism), got {sp!r}")
    problems = []
    if heads % sp:
        problems.append(f"it does not divide the {heads} attention heads ({heads_name})")
    elif not (kv_heads % sp == 0 or sp % kv_heads == 0):
        problems.append(f"the {kv_heads} key/value heads ({kv_name}) are neither a multiple nor a divisor of it")
    if processes is not None and processes % sp:
        problems.append(f"it does not divide the number of processes ({processes}; processes / {option} is the "
                        "data-parallel degree)")
    if problems:
        by_heads = accepted_degrees(heads, kv_heads)
        accepted = f"Accepted {option} values for these heads: {', '.join(map(str, by_heads))}"
        if processes is not None:
            fitting = [d for d in by_heads if processes % d == 0]
            accepted += f"; with {processes} process(es): {', '.join(map(str, fitting))}"
        raise SequenceParallelError(f"{option} is {sp}, but {'; and '.join(problems)}. {accepted}")


def padded_length(seq_len: int, sp: int) -> int:
    """``seq_len`` rounded up to a multiple of ``sp`` (every process gets a shard of the same length)."""
    return -(-seq_len // sp) * sp


# --------------------------------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------------------------------


def _deepspeed_version() -> str:
    import deepspeed

    return deepspeed.__version__


def ulysses_class() -> type:
    """DeepSpeed's ``UlyssesSPAttentionHF``, or a SequenceParallelError naming the DeepSpeed release needed."""
    try:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    except ImportError as error:
        try:
            have = f"DeepSpeed {_deepspeed_version()} is installed"
        except ImportError:
            have = "DeepSpeed is not installed"
        raise SequenceParallelError(
            f"sequence parallelism needs DeepSpeed-Ulysses (UlyssesSPAttentionHF, DeepSpeed >= {MIN_DEEPSPEED}); "
            f"{have} (pip install 'deepspeed>={MIN_DEEPSPEED}')"
        ) from error
    return UlyssesSPAttentionHF


@contextlib.contextmanager
def kv_heads_alias(config: Any) -> Iterator[None]:
    """Give a config without ``num_key_value_heads`` (GPT-2) one equal to its head count, for the block's duration.

    DeepSpeed's ``register_with_transformers`` reads ``num_key_value_heads``; the alias is removed
    afterwards so that it never reaches a saved ``config.json``.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    added = not hasattr(text, "num_key_value_heads")
    if added:
        text.num_key_value_heads = heads_of(text)[0]
    try:
        yield
    finally:
        if added and "num_key_value_heads" in text.__dict__:
            del text.num_key_value_heads


def _attention_functions() -> Any:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS


def _check_core(model: nn.Module, sp: int) -> str:
    """The model's attention implementation, checked for use as Ulysses' core attention."""
    impl = getattr(model.config, "_attn_implementation", None)
    if impl in (None, "eager"):
        raise SequenceParallelError(
            f"the model's attention implementation is {impl!r}: DeepSpeed-Ulysses drops the attention mask, so the "
            "core attention must be causal by itself; use volta_train.patch(model) (or 'sdpa')"
        )
    if impl not in _attention_functions():
        raise SequenceParallelError(f"attention implementation {impl!r} is not registered with transformers")
    heads, kv = heads_of(model.config)
    check_degree(sp, heads, kv)
    return impl


def parallelism_config(sp: int, processes: int, model: nn.Module) -> Any:
    """Accelerate's ``ParallelismConfig`` for DeepSpeed-Ulysses with the model's attention (volta_train) as the core.

    The data-parallel degree is ``processes / sp`` (Accelerate computes DeepSpeed's
    ``train_batch_size`` from it). Sequence lengths may vary between batches; the micro-batch
    size may not (DeepSpeed's wrapper is built for one). Pass the result to
    ``Accelerator(parallelism_config=...)``; ``accelerator.prepare(model, ...)`` then registers
    the wrapper (inside :func:`kv_heads_alias`) and hands DeepSpeed the groups.
    """
    ulysses_class()
    impl = _check_core(model, sp)
    heads, kv = heads_of(model.config)
    check_degree(sp, heads, kv, processes)
    from accelerate.utils import ParallelismConfig
    from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig

    # Accelerate's constructor accepts a fixed list of names (DeepSpeed takes any registered one): build it with
    # one of those, then name the implementation the model really uses.
    handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa")
    handler.sp_attn_implementation = impl
    return ParallelismConfig(sp_backend="deepspeed", sp_size=sp, dp_shard_size=processes // sp, sp_handler=handler)


def register(model: nn.Module, sp: int, micro_batch_size: int, disable_in_eval: bool = False) -> Any:
    """Without Accelerate: wrap the model's attention (volta_train after ``patch``) in DeepSpeed-Ulysses.

    Call after ``torch.distributed`` / ``deepspeed.init_distributed()`` and ``volta_train.patch(model)``;
    returns DeepSpeed's ``parallel_state_sp`` module, to pass as ``deepspeed.initialize(..., mpu=...)``.
    """
    cls = ulysses_class()
    impl = _check_core(model, sp)
    with kv_heads_alias(model.config):
        mpu = cls.register_with_transformers(
            model_name_or_path=model, core_attn_implementation=impl, sequence_parallel_size=sp,
            micro_batch_size=micro_batch_size, seq_length_is_variable=True, disable_in_eval=disable_in_eval,
        )
    install(impl, eval_sharded=not disable_in_eval)
    return mpu


class UlyssesAttention:
    """The transformers attention function under ``impl``: DeepSpeed's Ulysses wrapper, outputs as transformers expects.

    DeepSpeed's wrapper returns ``[batch, seq_shard, heads * head_dim]``, while transformers' attention
    interface returns ``[batch, seq, heads, head_dim]``: Llama reshapes either, GPT-2 (5.x) only the latter
    (``reshape(*shape[:-2], -1)`` on a 3-D output mixes the sequence into the features). This puts the
    head axis back; nothing else changes.
    """

    def __init__(self, inner: Callable[..., Any], ulysses: Any, impl: str):
        self.inner, self.ulysses, self.impl = inner, ulysses, impl
        self.__qualname__ = f"UlyssesAttention({impl})"

    def __call__(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        out, weights = self.inner(module, query, key, value, attention_mask, *args, **kwargs)
        if out.dim() == 3:  # [b, s, h * d] from the wrapper; [b, s, h, d] when it bypassed itself (eval)
            out = out.reshape(out.shape[0], out.shape[1], query.shape[1], query.shape[3])
        return out, weights


def _ulysses_in(function: Any) -> Any:
    """The UlyssesSPAttentionHF instance ``function`` (a registry entry) calls, or None."""
    if isinstance(function, UlyssesAttention):
        return function.ulysses
    cls = ulysses_class()
    for cell in getattr(function, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, cls):
            return value
    return None


def install(impl: str, eval_sharded: bool = True) -> Any:
    """After DeepSpeed registered its wrapper under ``impl`` (``accelerator.prepare`` or :func:`register`): wrap it
    in :class:`UlyssesAttention` and return DeepSpeed's ``UlyssesSPAttentionHF`` instance.

    ``eval_sharded``: keep sequence parallelism in eval mode (Accelerate registers the wrapper with
    ``disable_in_eval=True``, for trainers that evaluate whole sequences on every process; the recipes
    evaluate sharded batches like the training ones). Idempotent.
    """
    functions = _attention_functions()
    current = functions.get(impl)
    if isinstance(current, UlyssesAttention):
        uattn = current.ulysses
    else:
        uattn = _ulysses_in(current)
        if uattn is None:
            raise RuntimeError(
                f"transformers' attention registry maps {impl!r} to "
                f"{getattr(current, '__qualname__', repr(current))}, not DeepSpeed-Ulysses' wrapper: register it first "
                "(accelerator.prepare with ulysses.parallelism_config, or ulysses.register)"
            )
        functions[impl] = UlyssesAttention(current, uattn, impl)
    if eval_sharded:
        uattn.disable_in_eval = False
    logger.info("DeepSpeed-Ulysses: %r is the core attention of %d processes per sequence (%d/%d heads each)",
                impl, uattn.world_size, uattn.local_q_head_count, uattn.attn_head_count)
    return uattn


def installed(impl: str) -> Any:
    """DeepSpeed's ``UlyssesSPAttentionHF`` instance now registered under ``impl`` (through its wrapper), or None."""
    return _ulysses_in(_attention_functions().get(impl))


def ensure_installed(impl: str, expected: Any = None) -> Any:
    """The Ulysses instance registered under ``impl`` (``expected`` when given), or a RuntimeError saying why not."""
    current = _attention_functions().get(impl)
    found = _ulysses_in(current)
    if found is None or (expected is not None and found is not expected) or not isinstance(current, UlyssesAttention):
        raise RuntimeError(
            f"sequence parallelism is not installed: transformers' attention registry maps {impl!r} to "
            f"{getattr(current, '__qualname__', repr(current))}, not volta_train's UlyssesAttention around "
            "DeepSpeed-Ulysses (was volta_train.patch() or hf.register() called after ulysses.install()?); each "
            "process would attend within its own shard only"
        )
    return found


def gradient_factor(ds_config: dict, sp: int) -> float:
    """What each process's loss must be multiplied by (for its gradient only) so that DeepSpeed's reduction gives
    the gradient of the data-parallel mean of the groups' losses.

    With the sequence-parallel groups known, DeepSpeed sums gradients over all ``world`` processes and
    divides by the data-parallel degree ``world / sp`` in ZeRO stages 0-2 and in ZeRO-3's all-reduce
    path (``reduce_scatter: false`` with a bucket that fits ``reduce_bucket_size``). ZeRO-3's
    reduce-scatter path (``reduce_scatter: true``, the default) divides by ``world`` instead (checked in
    DeepSpeed 0.19.8: ``reduce_scatter_coalesced`` pre-divides by the group size, and
    ``__avg_scatter_grads`` applies no sequence-parallel correction), which makes every gradient ``sp``
    times too small: the factor is then ``sp``. ZeRO-3 with ``reduce_scatter: false`` mixes both paths
    (buckets over ``reduce_bucket_size`` take the reduce-scatter one) and is refused.
    tests/training/test_sequence_parallel.py compares the gradients with a single process's under ZeRO-2 and
    ZeRO-3, so a DeepSpeed release that changes this fails there.
    """
    if sp == 1:
        return 1.0
    zero = ds_config.get("zero_optimization", {}) or {}
    if int(zero.get("stage", 0)) != 3:
        return 1.0
    if str(zero.get("reduce_scatter", True)).lower() in ("false", "0"):
        raise SequenceParallelError(
            "zero_optimization.reduce_scatter is false in the DeepSpeed config: under ZeRO-3 with sequence parallelism "
            "DeepSpeed then scales some gradient buckets for the data-parallel degree and others for all processes; "
            "set reduce_scatter to true (the default) or leave it out"
        )
    if zero.get("zero_quantized_gradients"):
        raise SequenceParallelError(
            "zero_optimization.zero_quantized_gradients is set: its reduction under sequence parallelism is not "
            "checked here; leave it out"
        )
    return float(sp)


# --------------------------------------------------------------------------------------------------
# What the core attention sees under Ulysses
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def keeps_documents_apart(attention: Callable[..., Any], module: nn.Module, first: int = 16,
                          second: int = 8) -> tuple[bool, str]:
    """Whether ``attention`` keeps packed documents apart the way DeepSpeed-Ulysses calls it.

    Ulysses passes no attention mask and the whole sequence's ``position_ids``. Runs the function
    on two documents packed into one row (positions restarting at the second) and on the second
    alone, with random q/k/v in fp32 on CPU, in eval mode; (True, "") when the second document's
    outputs agree, else (False, why).
    """
    was_training = module.training
    module.eval()
    try:
        config = module.config
        heads, kv = heads_of(config)
        hidden = getattr(config, "hidden_size", None) or config.n_embd
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        gen = torch.Generator().manual_seed(0)
        n = first + second
        q = torch.randn(1, heads, n, head_dim, generator=gen).to(device)
        k = torch.randn(1, kv, n, head_dim, generator=gen).to(device)
        v = torch.randn(1, kv, n, head_dim, generator=gen).to(device)
        packed_pos = torch.cat([torch.arange(first), torch.arange(second)]).unsqueeze(0).to(device)
        alone_pos = torch.arange(second).unsqueeze(0).to(device)
        try:
            packed, _ = attention(module, q, k, v, None, position_ids=packed_pos)
            alone, _ = attention(module, q[:, :, first:], k[:, :, first:], v[:, :, first:], None,
                                 position_ids=alone_pos)
        except (NotImplementedError, ValueError) as e:
            return False, f"{type(e).__name__}: {str(e).splitlines()[0]}"
        err = (packed[:, first:].float() - alone.float()).abs().max().item()
        if err > 1e-4:
            return False, (f"without a mask and with restarting position_ids, the second document's outputs differ "
                           f"by {err:.3g} from the document alone")
        return True, ""
    finally:
        module.train(was_training)


# ---- the shards of a sequence and the loss over them

IGNORE_INDEX = -100
PAD_TOKEN = 0


@dataclass(frozen=True)
class Layout:
    """Where this process sits: its shard of each sequence and its data-parallel replica."""

    sp: int  # processes per sequence-parallel group
    sp_rank: int  # this process's shard
    dp: int  # data-parallel degree = world / sp
    dp_rank: int  # which group, i.e. which micro-batches this process reads
    group: Any = None  # the sequence-parallel torch.distributed group (None when sp == 1)

    @property
    def enabled(self) -> bool:
        return self.sp > 1


def layout(rank: int, world: int, sp: int) -> Layout:
    """The layout of ``rank`` of ``world`` processes; with ``sp > 1``, DeepSpeed's groups must exist already."""
    if sp == 1:
        return Layout(1, 0, world, rank, None)
    if world % sp:
        raise ValueError(f"sequence_parallel_size {sp} does not divide the {world} processes")
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu

    group = mpu.get_sequence_parallel_group()
    sp_rank, size = mpu.get_sequence_parallel_rank(), mpu.get_sequence_parallel_world_size()
    if size != sp or sp_rank != rank % sp:
        raise RuntimeError(
            f"DeepSpeed's sequence-parallel group of rank {rank} has size {size} and rank {sp_rank}; expected {sp} "
            f"consecutive ranks (rank {rank % sp} in it)"
        )
    return Layout(sp, sp_rank, world // sp, rank // sp, group)


def shard_batch(batch: dict[str, torch.Tensor], sp: int, sp_rank: int) -> dict[str, torch.Tensor]:
    """The ``sp_rank``-th sequence shard of a causal-LM micro-batch (``input_ids``, ``labels``, ``position_ids``).

    Returns ``input_ids``, ``position_ids`` and ``shift_labels``, each ``[batch, padded_len / sp]``.
    """
    if "attention_mask" in batch:
        raise ValueError(
            "attention_mask: padded batches cannot be split over a sequence-parallel group (DeepSpeed-Ulysses drops "
            "attention masks); pack the sequences (position_ids restarting per document) instead"
        )
    if not 0 <= sp_rank < sp:
        raise ValueError(f"sp_rank must lie in [0, {sp}), got {sp_rank}")
    ids = batch["input_ids"]
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq_len], got shape {tuple(ids.shape)}")
    rows, seq_len = ids.shape
    labels = batch.get("labels", ids)
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(seq_len, device=ids.device).expand(rows, seq_len)
    targets = shift_labels(labels)
    pad = -(-seq_len // sp) * sp - seq_len
    if pad:
        ids = F.pad(ids, (0, pad), value=PAD_TOKEN)
        targets = F.pad(targets, (0, pad), value=IGNORE_INDEX)
        # the padding is a document of its own: positions from 0 (valid for learned position embeddings), and
        # causal attention never lets it reach the real tokens before it
        positions = torch.cat([positions, torch.arange(pad, device=ids.device).expand(rows, pad)], dim=1)
    chunk = (seq_len + pad) // sp
    part = slice(sp_rank * chunk, (sp_rank + 1) * chunk)
    return {"input_ids": ids[:, part].contiguous(), "position_ids": positions[:, part].contiguous(),
            "shift_labels": targets[:, part].contiguous()}


def sharded_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], group: Any = None,
                 grad_factor: float = 1.0, chunked: bool | None = None,
                 chunk_tokens: int | None = None) -> torch.Tensor:
    """Mean token loss of the group's micro-batch from this process's shard (see the module doc).

    ``batch`` is a :func:`shard_batch` result on the model's device. With ``group`` None (one
    process per sequence) it is transformers' causal-LM loss of the unsharded batch.
    ``grad_factor`` multiplies the gradient only, not the value: it undoes a reduction that divides
    by more than the data-parallel degree
    (:func:`gradient_factor`: ``sp`` under ZeRO-3).
    ``chunked``: the shard's loss through :func:`.chunked_loss.causal_lm_loss_sum` (None: when the
    model qualifies); ``chunk_tokens``: its chunk size (None: from its memory budget).
    """
    labels = batch["shift_labels"]
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}
    if chunked is None:
        chunked = chunked_loss.supported(model)[0]
    if chunked:
        local_sum, _ = chunked_loss.causal_lm_loss_sum(model, inputs, labels, chunk_tokens=chunk_tokens)
        local_sum = local_sum.float()
    else:
        logits = model(**inputs).logits
        local_sum = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                                    reduction="sum")
    stats = torch.stack([local_sum.detach(), (labels != IGNORE_INDEX).sum().to(local_sum.dtype)])
    if group is not None:
        torch.distributed.all_reduce(stats, group=group)
    count = stats[1].clamp_min(1.0)
    local = local_sum * (grad_factor / count)
    return local + (stats[0] / count - local).detach()  # value: the whole sequence's mean; gradient: this shard's


class ShardedBatches:
    """Micro-batches from ``source`` cut to this process's shard; counts for FLOPs taken on the whole batch.

    ``counts(batch)`` (the trainer's ``flops`` callable) returns the (tokens, FLOPs) of the whole
    micro-batch on the group's first process and zero on the others, so that sums over all
    processes count every token once.
    """

    def __init__(self, source: Iterator[dict[str, torch.Tensor]], layout: Layout,
                 flops: Callable[[dict], tuple[int, float]]):
        self.source, self.layout, self.flops = source, layout, flops
        self._counts: tuple[int, float] = (0, 0.0)

    def __iter__(self) -> ShardedBatches:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        batch = next(self.source)
        tokens, flops = self.flops(batch)
        self._counts = (tokens, flops) if self.layout.sp_rank == 0 else (0, 0.0)
        return shard_batch(batch, self.layout.sp, self.layout.sp_rank)

    def counts(self, batch: dict) -> tuple[int, float]:  # noqa: ARG002 - the trainer passes the shard
        return self._counts


def describe(lay: Layout, seq_len: int) -> str:
    """One line for the log: the layout and the shard length."""
    padded = -(-seq_len // lay.sp) * lay.sp
    pad = f", padded to {padded}" if padded != seq_len else ""
    return (f"sequence parallel: {lay.sp} processes per sequence (DeepSpeed-Ulysses), data parallel {lay.dp}; "
            f"shard {padded // lay.sp} tokens of {seq_len}{pad}; this process: shard {lay.sp_rank}, replica "
            f"{lay.dp_rank}")

