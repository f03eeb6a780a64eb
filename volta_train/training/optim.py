"""AdamW with GPT-style weight-decay groups, and a linear-warmup cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch


def lr_at(step: int, steps: int, lr: float, warmup_steps: int, min_lr_ratio: float) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup, then cosine down to ``lr * min_lr_ratio``."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    decay_steps = max(1, steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    min_lr = lr * min_lr_ratio
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def build_adamw(model: torch.nn.Module, lr: float, weight_decay: float, betas=(0.9, 0.95), eps: float = 1e-8):
    """AdamW decaying matrices (weights, embeddings) but not biases or LayerNorm parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)
