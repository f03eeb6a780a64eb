"""The finetune recipe's evaluation: loss (and accuracy) over the eval set, a share per process."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import chunked_loss, sequence_parallel

class Evaluator:
    """Loss (and accuracy) over the eval set, for the trainer's ``evaluate``; every data-parallel replica scores its
    share of each group of ``batch_size * replicas`` items, at most ``max_batches`` groups (None: all of them). Under
    sequence parallelism (``layout`` enabled) the processes of a replica score one shard each of the same rows."""

    def __init__(self, model, accelerator, eval_set, collate, batch_size: int, max_batches: int | None, causal: bool,
                 chunked: bool, chunk_tokens: int | None, layout=None):
        self.model, self.accelerator, self.eval_set, self.collate = model, accelerator, eval_set, collate
        self.batch_size, self.causal, self.chunked, self.chunk_tokens = batch_size, causal, chunked, chunk_tokens
        self.layout = layout if layout is not None and layout.enabled else None
        replicas = self.layout.dp if self.layout else accelerator.num_processes
        self.rank = self.layout.dp_rank if self.layout else accelerator.process_index
        self.group = batch_size * replicas
        self.n_groups = math.ceil(len(eval_set) / self.group)
        if max_batches:
            self.n_groups = min(self.n_groups, max_batches)

    @torch.no_grad()
    def __call__(self) -> dict[str, float]:
        """The last group wraps around with zero weight, so that every process runs the same number of forwards
        (ZeRO-3 gathers weights collectively)."""
        model, device, eval_set, causal = self.model, self.accelerator.device, self.eval_set, self.causal
        model.eval()
        sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, weight, correct
        for g in range(self.n_groups):
            idx = [g * self.group + self.rank * self.batch_size + j for j in range(self.batch_size)]
            weight = torch.tensor([1.0 if i < len(eval_set) else 0.0 for i in idx], device=device)
            batch = self.collate([eval_set[i % len(eval_set)] for i in idx])
            if self.layout:  # this process's shard of the rows, targets shifted over the whole row first
                labels = batch["labels"].clone()
                labels[weight.cpu() == 0] = -100
                shard = sequence_parallel.shard_batch({**batch, "labels": labels}, self.layout.sp,
                                                      self.layout.sp_rank)
                targets = shard.pop("shift_labels").to(device)
                sums += self._shifted_sums({k: v.to(device) for k, v in shard.items()}, targets)
                continue
            labels = batch.pop("labels").to(device)
            batch = {k: v.to(device) for k, v in batch.items()}
            if self.chunked:  # loss and argmax hits chunk by chunk, no [tokens, vocab] logits
                targets = chunked_loss.shift_labels(labels)
                targets[weight == 0] = -100
                sums += self._shifted_sums(batch, targets)
                continue
            logits = model(**batch).logits.float()
            if causal:
                shift_logits, shift_labels = logits[:, :-1], labels[:, 1:]
                loss = F.cross_entropy(shift_logits.transpose(1, 2), shift_labels, ignore_index=-100,
                                       reduction="none")
                valid = (shift_labels != -100).float() * weight[:, None]
                sums[0] += (loss * valid).sum()
                sums[1] += valid.sum()
                sums[2] += ((shift_logits.argmax(-1) == shift_labels).float() * valid).sum()
            else:
                loss = F.cross_entropy(logits, labels, reduction="none")
                sums[0] += (loss * weight).sum()
                sums[1] += weight.sum()
                sums[2] += ((logits.argmax(-1) == labels).float() * weight).sum()
        model.train()
        total = self.accelerator.reduce(sums, "sum").tolist()
        if total[1] == 0:  # nothing to score (no target token): no loss rather than 0
            return {"loss": None, **({"perplexity": None, "token_accuracy": None} if causal else {"accuracy": None})}
        mean = total[0] / total[1]
        if causal:
            accuracy = total[2] / max(total[1], 1e-9)
            return {"loss": mean, "perplexity": math.exp(min(mean, 50.0)), "token_accuracy": accuracy}
        return {"loss": mean, "accuracy": total[2] / max(total[1], 1e-9)}

    def _shifted_sums(self, inputs: dict, targets: torch.Tensor) -> torch.Tensor:
        """(loss sum, targets, argmax hits) of the causal LM on ``inputs`` against already shifted ``targets``."""
        if self.chunked:  # loss and argmax hits chunk by chunk, no [tokens, vocab] logits
            loss_sum, count, correct = chunked_loss.causal_lm_eval_sums(self.model, inputs, targets,
                                                                        chunk_tokens=self.chunk_tokens)
            return torch.stack([loss_sum.double(), count.double(), correct.double()])
        logits = self.model(**inputs).logits.float()
        valid = targets != -100
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
        correct = ((logits.argmax(-1) == targets) & valid).sum()
        return torch.stack([loss.double(), valid.sum().double(), correct.double()])
