"""Optimizers with GPT-style weight-decay groups, and learning-rate schedules as pure functions of the step.

The schedule is a function of the optimizer step, set on the optimizer before each step
(:func:`set_lr`), rather than a stateful scheduler object: a resumed run needs nothing but
the step number, and under DeepSpeed there is no scheduler state to carry.
"""

from __future__ import annotations

import math

import torch

SCHEDULES = ("cosine", "linear", "constant")
OPTIMIZERS = ("adamw", "sgd")


def lr_at(step: int, steps: int, lr: float, warmup_steps: int, min_lr_ratio: float, schedule: str = "cosine") -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup, then ``schedule`` down to
    ``lr * min_lr_ratio`` (cosine or linear) or flat at ``lr`` (constant)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    decay_steps = max(1, steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    min_lr = lr * min_lr_ratio
    if schedule == "linear":
        return lr - progress * (lr - min_lr)
    if schedule != "cosine":
        raise ValueError(f"schedule {schedule!r}; accepted: {', '.join(SCHEDULES)}")
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices (weights, embeddings), not biases or norm parameters; a ZeRO-3 partition (flat) by its
    parameter's full shape."""
    params = [p for p in model.parameters() if p.requires_grad]
    matrix = [len(getattr(p, "ds_shape", p.shape)) >= 2 for p in params]
    decay = [p for p, m in zip(params, matrix) if m]
    no_decay = [p for p, m in zip(params, matrix) if not m]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_adamw(model: torch.nn.Module, lr: float, weight_decay: float, betas=(0.9, 0.95), eps: float = 1e-8):
    """AdamW decaying matrices (weights, embeddings) but not biases or LayerNorm parameters."""
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps)


def build_optimizer(model: torch.nn.Module, name: str, lr: float, weight_decay: float, betas=(0.9, 0.999),
                    eps: float = 1e-8, momentum: float = 0.9):
    """``adamw`` (PyTorch's, decoupled weight decay) or ``sgd`` (with momentum), with :func:`param_groups`."""
    if name == "adamw":
        return build_adamw(model, lr, weight_decay, betas, eps)
    if name == "sgd":
        return torch.optim.SGD(param_groups(model, weight_decay), lr=lr, momentum=momentum)
    raise ValueError(f"optimizer {name!r}; accepted: {', '.join(OPTIMIZERS)}")


def for_setup(setup, model: torch.nn.Module, name: str, lr: float, weight_decay: float, betas=(0.9, 0.999),
              eps: float = 1e-8, momentum: float = 0.9):
    """The recipes' optimizer (:func:`build_optimizer`), or accelerate's placeholder when the run's DeepSpeed JSON
    names its own "optimizer" (DeepSpeed builds that one)."""
    if setup.deepspeed and "optimizer" in setup.accelerator.state.deepspeed_plugin.deepspeed_config:
        from accelerate.utils import DummyOptim

        return DummyOptim(param_groups(model, weight_decay), lr=lr, weight_decay=weight_decay)
    return build_optimizer(model, name, lr, weight_decay, betas, eps, momentum)
