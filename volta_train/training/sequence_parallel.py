"""Sequence parallelism (DeepSpeed-Ulysses) in the recipes: process layout, sequence shards, the loss over shards.

The attention side (DeepSpeed's ``UlyssesSPAttentionHF`` around volta_train's attention)
is :mod:`volta_train.integrations.ulysses`; this module is what a training loop needs
around it:

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
  :func:`volta_train.integrations.ulysses.gradient_factor`.) The shard's token losses come from
  :mod:`.chunked_loss` (no ``[shard tokens, vocab]`` logits) unless ``chunked`` is False or the
  model does not qualify (:func:`.chunked_loss.supported`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from . import chunked_loss
from .chunked_loss import shift_labels  # noqa: F401 - part of this module's API (shard_batch uses it)

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
    (:func:`volta_train.integrations.ulysses.gradient_factor`: ``sp`` under ZeRO-3).
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

