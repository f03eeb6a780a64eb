"""The GPT recipe's configuration, its per-device defaults and its model.

Models: GPT-2 (learned positions, LayerNorm, GELU MLP) or Llama-style (RoPE,
RMSNorm, SwiGLU, optional grouped-query attention), randomly initialised from a
size preset, from a ``config.json`` (``model_config``), or loaded with their
weights from a local pretrained directory (``model_path``, e.g. a previous
run's ``final/``). Nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from . import memory, parallel, precision
from .config import ConfigError, check_number, check_optimization, field, resolve_auto
from .memory import MemoryConfig
from .models import layers_and_hidden, load_causal_lm, padded_vocab, tokenizer_spec
from .parallel import ParallelConfig
from .precision import PrecisionConfig

# Model shapes (n_layer, n_head, n_embd); head_dim is 64 from "tiny" up. The GPT-2 names are GPT-2's sizes;
# arch "llama" uses the same shapes with RoPE, RMSNorm and a SwiGLU MLP of ~8/3 n_embd.
PRESETS: dict[str, dict[str, int]] = {
    "nano": {"n_layer": 2, "n_head": 2, "n_embd": 64},
    "tiny": {"n_layer": 4, "n_head": 2, "n_embd": 128},
    "mini": {"n_layer": 6, "n_head": 6, "n_embd": 384},
    "small": {"n_layer": 12, "n_head": 12, "n_embd": 768},  # GPT-2 small
    "medium": {"n_layer": 24, "n_head": 16, "n_embd": 1024},  # GPT-2 medium
    "large": {"n_layer": 36, "n_head": 20, "n_embd": 1280},  # GPT-2 large
    "xl": {"n_layer": 48, "n_head": 25, "n_embd": 1600},  # GPT-2 XL
}
ARCHS = ("gpt2", "llama")

# What "auto" (a field left at None) becomes, by the device the run lands on. CPU: a ~1 M-parameter
# model on 256-token sequences, done in a minute or two on two cores. GPU (a V100 in mind): GPT-2 small
# on 4096-token sequences, 64 Ki tokens per step (precision auto: fp16 with dynamic loss scaling, precision.py).
AUTO: dict[str, dict] = {
    "cpu": dict(model="tiny", seq_len=256, steps=200, batch_size=8, grad_accum=1, lr=2e-3,
                log_interval=10, checkpoint_interval=100),
    "cuda": dict(model="small", seq_len=4096, steps=1000, batch_size=4, grad_accum=4, lr=6e-4,
                 log_interval=10, checkpoint_interval=250),
}
WARMUP_CAP = {"cpu": 20, "cuda": 100}  # auto warmup: 10% of the steps, at most this many
MAX_SYNTHETIC_MB = 256
SHAPE_FIELDS = ("n_layer", "n_head", "n_embd", "n_kv_head", "intermediate_size")


@dataclass
class GPTTrainConfig:
    # model
    arch: str = field("gpt2", "architecture of a model built from a preset: gpt2 or llama (RoPE, RMSNorm, SwiGLU)",
                      choices=list(ARCHS))
    model: str | None = field(None, "model size preset (n_layer/n_head/n_embd override it)", choices=list(PRESETS))
    n_layer: int | None = field(None, "transformer blocks")
    n_head: int | None = field(None, "attention heads")
    n_embd: int | None = field(None, "hidden size")
    n_kv_head: int | None = field(None, "llama: key/value heads (grouped-query attention; auto: n_head)")
    intermediate_size: int | None = field(None, "llama: MLP width (auto: 8/3 n_embd rounded up to 64)")
    rope_theta: float = field(10000.0, "llama: RoPE base")
    model_config: str | None = field(None, "config.json (or a directory holding one) of a model to build with "
                                           "random weights, instead of a preset", unset=True)
    model_path: str | None = field(None, "local pretrained model directory (config + safetensors weights) to "
                                         "continue training, e.g. a previous run's final/", unset=True)
    tokenizer: str | None = field(None, "'bytes', or a local tokenizer directory (auto: model_path's tokenizer "
                                        "if it has one, else bytes)")
    seq_len: int | None = field(None, "tokens per training sequence (GPT-2 built here: also n_positions)")
    attn_pdrop: float = field(0.0, "attention-probability dropout")
    dropout: float = field(0.0, "residual and embedding dropout")
    patch: bool = field(True, "run attention through volta_train.patch(model); --no-patch: stock PyTorch SDPA")
    # data
    data: str = field("synthetic", "'synthetic', or a .txt/.jsonl file or a directory of them")
    synthetic_mb: float | None = field(None, "size of the synthetic corpus in MB (auto: enough for the run)")
    cache_dir: str = field("out/cache", "where tokenised corpora are cached")
    val_fraction: float = field(0.01, "share of the token stream held out for validation")
    packing: str = field("auto", "documents: position ids restart at each document, no attention across documents; "
                                 "stream: GPT-2 style, attention across EOS; auto: documents where the attention "
                                 "supports it, else stream (logged)", choices=["auto", "documents", "stream"])
    num_workers: int = field(0, "DataLoader worker processes")
    # optimisation
    steps: int | None = field(None, "optimizer steps")
    batch_size: int | None = field(None, "sequences per micro-batch, per process")
    grad_accum: int | None = field(None, "micro-batches per optimizer step")
    lr: float | None = field(None, "peak learning rate")
    warmup_steps: int | None = field(None, "linear warmup steps (auto: 10% of steps, capped)")
    min_lr_ratio: float = field(0.1, "cosine decay ends at lr * min_lr_ratio")
    weight_decay: float = field(0.1, "AdamW weight decay (matrices only)")
    beta1: float = field(0.9, "AdamW beta1")
    beta2: float = field(0.95, "AdamW beta2")
    grad_clip: float = field(1.0, "clip the gradient norm to this (0: off)")
    # run
    out_dir: str = field("out/gpt_long", "checkpoints, logs and config go here")
    log_interval: int | None = field(None, "optimizer steps between log lines")
    eval_interval: int = field(0, "optimizer steps between validation passes (0: at the end only)")
    eval_batches: int = field(4, "validation micro-batches per pass, per process (0: no validation)")
    checkpoint_interval: int | None = field(None, "optimizer steps between resumable checkpoints (0: none)")
    keep_checkpoints: int = field(2, "resumable checkpoints kept (older ones are deleted)")
    resume: str = field("auto", "auto: continue from out_dir's last checkpoint if there is one; never; or a "
                                "checkpoint directory")
    resume_without_rng: bool = field(False, "resume from a checkpoint that lacks this process's random-generator "
                                             "file (dropout and data-independent randomness then differ)")
    time_limit_min: float = field(0.0, "stop (with a checkpoint) after this many minutes of training (0: none)")
    seed: int = field(1337, "random seed (model init, data order)")
    cpu: bool = field(False, "train on CPU even if a GPU is present")
    cpu_threads: int | None = field(None, "torch threads on CPU (auto: the available cores / local processes)")
    progress: bool = field(True, "tqdm progress bar on the main process")
    tensorboard: bool = field(False, "TensorBoard event files in out_dir/tensorboard (pip install tensorboard)")
    peak_tflops: float | None = field(None, "peak TFLOP/s per device for MFU (auto: V100 125, A100 312, "
                                            "H100/H200 989; none elsewhere)")
    save: bool = field(True, "save the final model")
    # the components both recipes share (volta_train/training/memory.py, parallel.py, precision.py)
    memory: MemoryConfig = memory.config_section()
    parallel: ParallelConfig = parallel.config_section()
    precision: PrecisionConfig = precision.config_section()

    RECIPE: ClassVar[str] = "gpt_long"
    # the flat names these options had before they moved into their sections (still read)
    ALIASES: ClassVar[dict[str, str]] = {
        **{name: f"memory.{name}" for name in (
            "gradient_checkpointing", "activation_offload", "activation_offload_keep", "tiled_mlp",
            "tiled_mlp_tokens", "lean_norm", "chunked_loss", "loss_chunk_tokens")},
        **{name: f"parallel.{name}" for name in ("deepspeed", "sequence_parallel_size")},
        **{name: f"precision.{name}" for name in (
            "mixed_precision", "loss_scale_init", "loss_scale_window", "max_consecutive_skips")},
    }


def resolve(cfg: GPTTrainConfig, device_type: str, num_processes: int = 1) -> GPTTrainConfig:
    """Fill every auto field for ``device_type`` ('cuda' or anything else = CPU table) and check the result."""
    kind = "cuda" if device_type == "cuda" else "cpu"
    table = dict(AUTO[kind])
    cfg = dataclasses.replace(cfg, precision=precision.resolve(cfg.precision, kind))
    external = cfg.model_path or cfg.model_config
    if external:
        given = [k for k in ("model", *SHAPE_FIELDS) if getattr(cfg, k) is not None]
        if given:
            which = "model_path" if cfg.model_path else "model_config"
            raise ConfigError(f"{given[0]} is set together with {which}: the model's shape comes from its config")
        table.pop("model")
    elif cfg.model is None and any(getattr(cfg, k) is not None for k in ("n_layer", "n_head", "n_embd")):
        table.pop("model")  # explicit shapes without a preset: fill the rest from the auto preset below
        cfg = dataclasses.replace(cfg, model=AUTO[kind]["model"])
    cfg = resolve_auto(cfg, table)
    if not external:
        cfg = resolve_auto(cfg, PRESETS[cfg.model])
        if cfg.arch == "llama":
            cfg = resolve_auto(cfg, {"n_kv_head": cfg.n_head, "intermediate_size": _swiglu_width(cfg.n_embd)})
    if cfg.warmup_steps is None:
        cfg = dataclasses.replace(cfg, warmup_steps=min(WARMUP_CAP[kind], cfg.steps // 10))
    if cfg.cpu_threads is None and kind == "cpu":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", num_processes))
        cfg = dataclasses.replace(cfg, cpu_threads=max(1, cores // max(1, local)))
    if cfg.synthetic_mb is None:
        # enough bytes that the run sees no sequence twice, rounded up to a power of two (stable cache keys);
        # the processes of a sequence-parallel group read the same sequences
        replicas = max(1, num_processes // max(1, cfg.parallel.sequence_parallel_size))
        tokens = cfg.steps * cfg.batch_size * cfg.grad_accum * cfg.seq_len * replicas
        tokens = tokens / (1.0 - cfg.val_fraction) * 1.02
        mb = 2 ** max(0, math.ceil(math.log2(max(tokens / 1e6, 1.0))))
        cfg = dataclasses.replace(cfg, synthetic_mb=float(min(mb, MAX_SYNTHETIC_MB)))
    check(cfg)
    return cfg


def _swiglu_width(n_embd: int) -> int:
    return (8 * n_embd // 3 + 63) // 64 * 64


def check(cfg: GPTTrainConfig, processes: int | None = None) -> None:
    positive = ("seq_len", "steps", "batch_size", "grad_accum", "log_interval")
    if not (cfg.model_path or cfg.model_config):
        positive += ("n_layer", "n_head", "n_embd")
    for name in positive:
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"{name} must be positive, got {getattr(cfg, name)}")
    if not (cfg.model_path or cfg.model_config):
        if cfg.n_embd % cfg.n_head:
            raise ConfigError(f"n_embd ({cfg.n_embd}) must be a multiple of n_head ({cfg.n_head})")
        if cfg.arch == "llama":
            if cfg.n_kv_head <= 0 or cfg.n_head % cfg.n_kv_head:
                raise ConfigError(f"n_kv_head ({cfg.n_kv_head}) must divide n_head ({cfg.n_head})")
            if cfg.intermediate_size <= 0:
                raise ConfigError(f"intermediate_size must be positive, got {cfg.intermediate_size}")
        else:
            for name in ("n_kv_head", "intermediate_size"):
                if getattr(cfg, name) is not None:
                    raise ConfigError(f"{name} applies to arch llama, not {cfg.arch}")
    for name in ("attn_pdrop", "dropout", "val_fraction"):
        if not 0.0 <= getattr(cfg, name) < 1.0:
            raise ConfigError(f"{name} must lie in [0, 1), got {getattr(cfg, name)}")
    if not 0.0 <= cfg.min_lr_ratio <= 1.0:
        raise ConfigError(f"min_lr_ratio must lie in [0, 1], got {cfg.min_lr_ratio}")
    for name in ("warmup_steps", "eval_interval", "eval_batches", "grad_clip", "weight_decay", "synthetic_mb",
                 "checkpoint_interval", "time_limit_min", "num_workers"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"{name} must be >= 0, got {getattr(cfg, name)}")
    memory.check(cfg.memory)
    precision.check(cfg.precision)
    check_sequence_parallel(cfg, processes)
    if cfg.keep_checkpoints < 1:
        raise ConfigError(f"keep_checkpoints must be >= 1, got {cfg.keep_checkpoints}")
    check_optimization({kind: (kind, getattr(cfg, kind)) for kind in (
        "lr", "weight_decay", "beta1", "beta2", "grad_clip", "warmup_steps", "min_lr_ratio", "time_limit_min")})
    for name in ("rope_theta", "peak_tflops", "synthetic_mb"):
        if getattr(cfg, name) is not None:
            check_number(name, getattr(cfg, name), 0, None, low_open=name != "synthetic_mb")
    for name in ("model_path", "model_config"):
        path = getattr(cfg, name)
        if path is not None and not Path(path).exists():
            raise ConfigError(f"{name} {path!r} does not exist")


def check_sequence_parallel(cfg: GPTTrainConfig, processes: int | None = None) -> None:
    """The parallel section (:func:`.parallel.check`), and the sequence-parallel degree against a preset's heads
    (a model from model_config/model_path is checked once built)."""
    parallel.check(cfg.parallel, processes)
    if not (cfg.model_path or cfg.model_config):
        kv = cfg.n_kv_head if cfg.arch == "llama" else cfg.n_head
        parallel.check_heads(cfg.parallel, cfg.n_head, kv, processes, heads_name="n_head", kv_name="n_kv_head")


def default_tokenizer(cfg: GPTTrainConfig) -> str:
    """The tokenizer spec for ``cfg``: its own, else model_path's tokenizer files if any, else bytes."""
    return tokenizer_spec(cfg.tokenizer, cfg.model_path)


def _preset_config(cfg: GPTTrainConfig, tokenizer):
    from transformers import GPT2Config, LlamaConfig

    vocab = padded_vocab(tokenizer.vocab_size)
    if cfg.arch == "llama":
        return LlamaConfig(
            vocab_size=vocab, hidden_size=cfg.n_embd, intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head,
            max_position_embeddings=cfg.seq_len, rope_theta=cfg.rope_theta, attention_dropout=cfg.attn_pdrop,
            bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=getattr(tokenizer, "pad_token_id", None), tie_word_embeddings=True, use_cache=False,
        )
    return GPT2Config(
        vocab_size=vocab,
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


def build_model(cfg: GPTTrainConfig, tokenizer):
    """The causal LM with stock SDPA attention (the recipe patches it and applies the memory section afterwards).

    Preset or ``model_config``: random weights (seeded by the caller). ``model_path``: the saved weights
    (:func:`.models.load_causal_lm`, as finetune loads them).
    Raises ConfigError when the model cannot hold the run's sequences or tokens.
    """
    from transformers import AutoModelForCausalLM

    if cfg.model_path or cfg.model_config:
        model = load_causal_lm(AutoModelForCausalLM, cfg.model_path, cfg.model_config, option="model_path")
    else:
        model = load_causal_lm(AutoModelForCausalLM, None, None, config=_preset_config(cfg, tokenizer))
    config = model.config
    config.use_cache = False
    if getattr(config, "model_type", None) == "llama" and cfg.attn_pdrop and not cfg.model_path:
        config.attention_dropout = cfg.attn_pdrop
    if config.vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"the model's vocabulary ({config.vocab_size}) is smaller than the tokenizer's "
                          f"({tokenizer.vocab_size})")
    positions = getattr(config, "n_positions", None)
    if positions is not None and cfg.seq_len > positions:
        raise ConfigError(f"seq_len {cfg.seq_len} exceeds the model's n_positions ({positions}): GPT-2 learns one "
                          "embedding per position")
    model.loss_type = "ForCausalLM"  # what these models use anyway; saying so silences transformers' warning
    return model


def describe(model) -> dict:
    """Shape figures of a causal LM's config (any family): for log lines and FLOP counts."""
    c = model.config
    n_layer, hidden = layers_and_hidden(c)
    n_head = getattr(c, "num_attention_heads", None) or getattr(c, "n_head")
    head_dim = getattr(c, "head_dim", None) or hidden // n_head
    kv = getattr(c, "num_key_value_heads", None) or n_head
    return {"model_type": c.model_type, "n_layer": n_layer, "n_head": n_head, "n_kv_head": kv, "hidden": hidden,
            "head_dim": head_dim}
