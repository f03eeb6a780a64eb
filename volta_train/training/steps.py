"""What the trainer calls per micro-batch, the same in both recipes: this process's micro-batches from a micro-batch
index on (:class:`MicroBatches`), their token and FLOP counts, and the loss of one (:func:`loss_function`). Under
sequence parallelism the processes of a group read the same micro-batches and each keeps its shard of every
sequence (:mod:`.sequence_parallel`); the counts then take each token once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from . import chunked_loss, data, sequence_parallel


class MicroBatches:
    """The trainer's ``batches`` (call it with the first micro-batch index) and ``flops`` (:meth:`count`).

    Raises ValueError when the dataset holds fewer than one micro-batch per data-parallel replica."""

    def __init__(self, dataset, batch_size: int, par, seed: int, flops: Callable[[dict], tuple[int, float]],
                 collate_fn=None, num_workers: int = 0):
        self.dataset, self.batch_size, self.seed, self.flops = dataset, batch_size, seed, flops
        self.collate_fn, self.num_workers, self.layout = collate_fn, num_workers, par.layout
        self.replicas, self.replica = par.layout.dp, par.layout.dp_rank  # processes of a group read the same batches
        probe = data.ShardedBatchSampler(len(dataset), batch_size, self.replicas, self.replica, seed=seed)
        self.batches_per_epoch = probe.batches_per_epoch
        self.pin = par.setup.accelerator.device.type == "cuda"
        self._shards: sequence_parallel.ShardedBatches | None = None

    def __call__(self, start: int) -> Iterator[dict]:
        sampler = data.ShardedBatchSampler(len(self.dataset), self.batch_size, self.replicas, self.replica,
                                           seed=self.seed, start=start)
        loader = data.micro_batches(self.dataset, sampler, collate_fn=self.collate_fn, num_workers=self.num_workers,
                                    pin_memory=self.pin)
        if not self.layout.enabled:
            return loader
        self._shards = sequence_parallel.ShardedBatches(loader, self.layout, self.flops)
        return self._shards

    def count(self, batch: dict) -> tuple[int, float]:
        """(tokens, FLOPs) of a micro-batch; under sequence parallelism the whole one's, on the group's first
        process only."""
        return self._shards.counts(batch) if self.layout.enabled else self.flops(batch)


def loss_function(par, impl: str, chunked: bool, chunk_tokens: int | None) -> Callable[[object, dict], torch.Tensor]:
    """The mean token loss of a causal-LM micro-batch: of this process's shard under sequence parallelism (the
    group's value, this shard's gradient), through the chunked loss when ``chunked``, else the model's own."""
    if par.layout.enabled:
        def sharded(engine, batch: dict) -> torch.Tensor:
            sequence_parallel.ensure_installed(impl, par.ulysses)
            return sequence_parallel.sharded_loss(engine, batch, par.layout.group, par.grad_factor, chunked=chunked,
                                                  chunk_tokens=chunk_tokens)
        return sharded
    if chunked:
        return lambda engine, batch: chunked_loss.causal_lm_loss(engine, batch, chunk_tokens=chunk_tokens)
    return lambda engine, batch: engine(**batch).loss
