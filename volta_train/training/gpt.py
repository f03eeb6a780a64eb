"""The GPT recipe's configuration, its per-device defaults and its model (GPT-2 architecture, random init)."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from .config import ConfigError, field, resolve_auto

# GPT-2 family shapes (n_layer, n_head, n_embd); head_dim is 64 from "tiny" up.
PRESETS: dict[str, dict[str, int]] = {
    "nano": {"n_layer": 2, "n_head": 2, "n_embd": 64},
    "tiny": {"n_layer": 4, "n_head": 2, "n_embd": 128},
    "mini": {"n_layer": 6, "n_head": 6, "n_embd": 384},
    "small": {"n_layer": 12, "n_head": 12, "n_embd": 768},  # GPT-2 small
    "medium": {"n_layer": 24, "n_head": 16, "n_embd": 1024},  # GPT-2 medium
    "large": {"n_layer": 36, "n_head": 20, "n_embd": 1280},  # GPT-2 large
    "xl": {"n_layer": 48, "n_head": 25, "n_embd": 1600},  # GPT-2 XL
}

# What "auto" (a field left at None) becomes, by the device the run lands on. CPU: a ~1 M-parameter
# model on 256-token sequences, done in a minute or two on two cores. GPU (a V100 in mind): GPT-2 small
# on 4096-token sequences in fp16 with dynamic loss scaling (V100 has no bf16), 64 Ki tokens per step.
AUTO: dict[str, dict] = {
    "cpu": dict(model="tiny", seq_len=256, steps=200, batch_size=8, grad_accum=1, lr=2e-3,
                mixed_precision="no", log_interval=10),
    "cuda": dict(model="small", seq_len=4096, steps=1000, batch_size=4, grad_accum=4, lr=6e-4,
                 mixed_precision="fp16", log_interval=10),
}
WARMUP_CAP = {"cpu": 20, "cuda": 100}  # auto warmup: 10% of the steps, at most this many
MAX_SYNTHETIC_MB = 256


@dataclass
class GPTTrainConfig:
    # model
    model: str | None = field(None, "model size preset (n_layer/n_head/n_embd override it)", choices=list(PRESETS))
    n_layer: int | None = field(None, "transformer blocks")
    n_head: int | None = field(None, "attention heads")
    n_embd: int | None = field(None, "hidden size")
    seq_len: int | None = field(None, "tokens per training sequence (also the model's n_positions)")
    attn_pdrop: float = field(0.0, "attention-probability dropout")
    dropout: float = field(0.0, "residual and embedding dropout")
    patch: bool = field(True, "run attention through volta_train.patch(model); --no-patch: stock PyTorch SDPA")
    gradient_checkpointing: bool = field(False, "recompute block activations in the backward (long sequences)")
    # data
    data: str = field("synthetic", "'synthetic', or a .txt/.jsonl file or a directory of them")
    synthetic_mb: float | None = field(None, "size of the synthetic corpus in MB (auto: enough for the run)")
    cache_dir: str = field("out/cache", "where tokenised corpora are cached")
    val_fraction: float = field(0.01, "share of the token stream held out for validation")
    # optimisation
    steps: int | None = field(None, "optimizer steps")
    batch_size: int | None = field(None, "sequences per micro-batch, per process")
    grad_accum: int | None = field(None, "micro-batches per optimizer step")
    lr: float | None = field(None, "peak learning rate")
    warmup_steps: int | None = field(None, "linear warmup steps (auto: 10%% of steps, capped)")
    min_lr_ratio: float = field(0.1, "cosine decay ends at lr * min_lr_ratio")
    weight_decay: float = field(0.1, "AdamW weight decay (matrices only)")
    beta1: float = field(0.9, "AdamW beta1")
    beta2: float = field(0.95, "AdamW beta2")
    grad_clip: float = field(1.0, "clip the gradient norm to this (0: off)")
    mixed_precision: str | None = field(None, "accelerate mixed precision (auto: fp16 on GPU, no on CPU)",
                                        choices=["no", "fp16", "bf16"])
    # run
    out_dir: str = field("out/gpt_long", "checkpoint, logs and config go here")
    log_interval: int | None = field(None, "optimizer steps between log lines")
    eval_interval: int = field(0, "optimizer steps between validation passes (0: at the end only)")
    eval_batches: int = field(4, "validation micro-batches per pass, per process (0: no validation)")
    seed: int = field(1337, "random seed (model init, data order)")
    cpu: bool = field(False, "train on CPU even if a GPU is present")
    cpu_threads: int | None = field(None, "torch threads on CPU (auto: the available cores / local processes)")
    progress: bool = field(True, "tqdm progress bar on the main process")
    save: bool = field(True, "save the final checkpoint")


def resolve(cfg: GPTTrainConfig, device_type: str, num_processes: int = 1) -> GPTTrainConfig:
    """Fill every auto field for ``device_type`` ('cuda' or anything else = CPU table) and check the result."""
    kind = "cuda" if device_type == "cuda" else "cpu"
    table = dict(AUTO[kind])
    if cfg.mixed_precision is None:
        # a precision chosen through `accelerate config` wins over the device default
        env = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
        if env != "no":
            table["mixed_precision"] = env
    if cfg.model is None and any(getattr(cfg, k) is not None for k in ("n_layer", "n_head", "n_embd")):
        table.pop("model")  # explicit shapes without a preset: fill the rest from the auto preset below
        cfg = dataclasses.replace(cfg, model=AUTO[kind]["model"])
    cfg = resolve_auto(cfg, table)
    cfg = resolve_auto(cfg, PRESETS[cfg.model])
    if cfg.warmup_steps is None:
        cfg = dataclasses.replace(cfg, warmup_steps=min(WARMUP_CAP[kind], cfg.steps // 10))
    if cfg.cpu_threads is None and kind == "cpu":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", num_processes))
        cfg = dataclasses.replace(cfg, cpu_threads=max(1, cores // max(1, local)))
    if cfg.synthetic_mb is None:
        # enough bytes that the run sees no sequence twice, rounded up to a power of two (stable cache keys)
        tokens = cfg.steps * cfg.batch_size * cfg.grad_accum * cfg.seq_len * num_processes
        tokens = tokens / (1.0 - cfg.val_fraction) * 1.02
        mb = 2 ** max(0, math.ceil(math.log2(max(tokens / 1e6, 1.0))))
        cfg = dataclasses.replace(cfg, synthetic_mb=float(min(mb, MAX_SYNTHETIC_MB)))
    check(cfg)
    return cfg


def check(cfg: GPTTrainConfig) -> None:
    positive = ("n_layer", "n_head", "n_embd", "seq_len", "steps", "batch_size", "grad_accum", "log_interval")
    for name in positive:
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"{name} must be positive, got {getattr(cfg, name)}")
    if cfg.n_embd % cfg.n_head:
        raise ConfigError(f"n_embd ({cfg.n_embd}) must be a multiple of n_head ({cfg.n_head})")
    for name in ("attn_pdrop", "dropout", "val_fraction"):
        if not 0.0 <= getattr(cfg, name) < 1.0:
            raise ConfigError(f"{name} must lie in [0, 1), got {getattr(cfg, name)}")
    if not 0.0 <= cfg.min_lr_ratio <= 1.0:
        raise ConfigError(f"min_lr_ratio must lie in [0, 1], got {cfg.min_lr_ratio}")
    for name in ("warmup_steps", "eval_interval", "eval_batches", "grad_clip", "weight_decay", "synthetic_mb"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"{name} must be >= 0, got {getattr(cfg, name)}")
    if cfg.lr <= 0:
        raise ConfigError(f"lr must be positive, got {cfg.lr}")


def padded_vocab(vocab_size: int, multiple: int = 64) -> int:
    """Round the embedding up to a multiple of 64 rows (tensor-core friendly; the extra ids are never seen)."""
    return (vocab_size + multiple - 1) // multiple * multiple


def build_model(cfg: GPTTrainConfig, tokenizer):
    """A randomly initialised GPT2LMHeadModel with stock SDPA attention; the recipe patches it afterwards."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=padded_vocab(tokenizer.vocab_size),
        n_positions=cfg.seq_len,
        n_embd=cfg.n_embd,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        activation_function="gelu_pytorch_tanh",  # GPT-2's tanh GELU as one fused op (less activation memory)
        attn_pdrop=cfg.attn_pdrop,
        resid_pdrop=cfg.dropout,
        embd_pdrop=cfg.dropout,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        use_cache=False,
    )
    config._attn_implementation = "sdpa"
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # what GPT-2 uses anyway; saying so silences transformers' warning
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model
