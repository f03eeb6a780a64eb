"""The finetune recipe's options (``recipes/finetune.py``): its YAML schema and the checks across keys.

Tasks:

* ``causal_lm``: a decoder (GPT-2, Llama, ...) on jsonl ``text`` documents or ``instruction``
  records (prompt + response; by default only the response is a target);
* ``classification``: an encoder (BERT, RoBERTa, ...) with a sequence-classification head on
  jsonl records with a text (optionally a second text) and a label.

The YAML file has one section per concern (``model``, ``data``, ``train``, ``optimizer``,
``schedule``, ``eval``, ``checkpoint``, ``logging``) and the sections gpt_long has as well
(``memory``, ``parallel``, ``precision``: :mod:`.memory`, :mod:`.parallel`, :mod:`.precision`); every key is
also a flag (``--optimizer.lr 1e-4``). See ``configs/finetune/*.yaml`` and docs/recipes.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from . import memory, parallel, precision
from .config import ConfigError, check_number, check_optimization, field, section
from .data import data_files
from .memory import MemoryConfig
from .optim import OPTIMIZERS, SCHEDULES
from .parallel import ParallelConfig
from .precision import PrecisionConfig

TASKS = ("causal_lm", "classification")
FORMATS = ("text", "instruction", "classification")
DEFAULT_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
DEFAULT_PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"


@dataclass
class ModelSection:
    path: str | None = field(None, "local pretrained model directory (config + safetensors weights)",
                              unset=True)
    config: str | None = field(None, "config.json (or a directory holding one) of a model to build with random "
                                     "weights (when there is no path)", unset=True)
    tokenizer: str | None = field(None, "'bytes', or a local tokenizer directory (auto: the model directory's "
                                        "tokenizer if it has one, else bytes)")
    patch: bool = field(True, "attention through volta_train.patch(model); false: stock PyTorch SDPA")
    config_overrides: dict = field({}, "model config attributes to set before building, e.g. "
                                       "{hidden_dropout_prob: 0.0}")


@dataclass
class DataSection:
    train: str | None = field(None, "training data: a .jsonl file, a directory of them, or a glob", unset=True)
    eval: str | None = field(None, "evaluation data, same forms (none: eval_fraction of train, or no evaluation)",
                             unset=True)
    eval_fraction: float = field(0.0, "share of the training records held out for evaluation when eval is unset")
    format: str | None = field(None, "text, instruction or classification (auto: from the task)", choices=list(FORMATS))
    max_length: int = field(512, "tokens per sequence (longer examples are truncated)")
    packing: bool = field(False, "causal LM: pack examples into max_length rows, position ids restarting per "
                                 "example (no attention across examples); false: one padded example per row")
    text_field: str = field("text", "text / classification: the field holding the text")
    text_pair_field: str | None = field(None, "classification: the field holding a second text (pairs)",
                                        unset=True)
    label_field: str = field("label", "classification: the field holding the label (a name or an int)")
    labels: list[str] = field([], "classification: label names in id order (auto: the sorted labels of train)")
    instruction_field: str = field("instruction", "instruction: the field holding the instruction")
    input_field: str = field("input", "instruction: the optional field holding extra input")
    response_field: str = field("output", "instruction: the field holding the response")
    prompt_template: str = field(DEFAULT_PROMPT, "instruction: prompt text, {instruction} filled in")
    prompt_template_with_input: str = field(DEFAULT_PROMPT_WITH_INPUT, "instruction: prompt text when the record "
                                                                       "has an input ({instruction}, {input})")
    train_on_prompt: bool = field(False, "instruction: also learn to predict the prompt tokens")
    cache_dir: str = field("out/cache", "where tokenised datasets are cached")
    num_workers: int = field(0, "DataLoader worker processes")


@dataclass
class TrainSection:
    steps: int | None = field(None, "optimizer steps (auto: from epochs)")
    epochs: float = field(1.0, "passes over the training data when steps is unset")
    batch_size: int = field(8, "examples (or packed rows) per micro-batch, per process")
    grad_accum: int = field(1, "micro-batches per optimizer step")
    grad_clip: float = field(1.0, "clip the gradient norm to this (0: off)")
    seed: int = field(1337, "random seed (head init, data order, dropout)")
    cpu: bool = field(False, "train on CPU even if a GPU is present")
    cpu_threads: int | None = field(None, "torch threads on CPU (auto: available cores / local processes)")
    time_limit_min: float = field(0.0, "stop with a checkpoint after this many minutes (0: none)")


@dataclass
class OptimizerSection:
    name: str = field("adamw", "adamw or sgd", choices=list(OPTIMIZERS))
    lr: float = field(5e-5, "peak learning rate")
    weight_decay: float = field(0.01, "weight decay (matrices only)")
    beta1: float = field(0.9, "AdamW beta1")
    beta2: float = field(0.999, "AdamW beta2")
    eps: float = field(1e-8, "AdamW epsilon")
    momentum: float = field(0.9, "SGD momentum")


@dataclass
class ScheduleSection:
    name: str = field("linear", "cosine, linear or constant (after the warmup)", choices=list(SCHEDULES))
    warmup_steps: int | None = field(None, "linear warmup steps (auto: warmup_ratio of the steps)")
    warmup_ratio: float = field(0.06, "warmup as a share of the steps when warmup_steps is unset")
    min_lr_ratio: float = field(0.0, "the decay ends at lr * min_lr_ratio")


@dataclass
class EvalSection:
    interval: int = field(0, "optimizer steps between evaluations (0: at the end only)")
    batches: int | None = field(None, "evaluation micro-batches per process (auto: the whole eval set)")
    batch_size: int | None = field(None, "examples per evaluation micro-batch (auto: train.batch_size)")


@dataclass
class CheckpointSection:
    interval: int = field(0, "optimizer steps between resumable checkpoints (0: none)")
    keep: int = field(2, "resumable checkpoints kept")
    resume: str = field("auto", "auto (continue from logging.out_dir's last checkpoint), never, or a checkpoint dir")
    save_final: bool = field(True, "save the final model (safetensors + config + tokenizer)")
    resume_without_rng: bool = field(False, "resume from a checkpoint that lacks this process's random-generator "
                                             "file (dropout and other randomness then differ)")


@dataclass
class LoggingSection:
    out_dir: str = field("out/finetune", "checkpoints, logs, metrics and the final model go here")
    log_interval: int = field(10, "optimizer steps between log lines")
    tensorboard: bool = field(False, "TensorBoard event files in out_dir/tensorboard (pip install tensorboard)")
    progress: bool = field(True, "tqdm progress bar")
    peak_tflops: float | None = field(None, "peak TFLOP/s per device for MFU (auto: by GPU name; V100: 125)")


@dataclass
class FinetuneConfig:
    task: str = field("causal_lm", "causal_lm or classification", choices=list(TASKS))
    model: ModelSection = section(ModelSection, "the model")
    data: DataSection = section(DataSection, "data files and their format")
    train: TrainSection = section(TrainSection, "steps, batches, seed, device")
    optimizer: OptimizerSection = section(OptimizerSection, "optimizer")
    schedule: ScheduleSection = section(ScheduleSection, "learning-rate schedule")
    eval: EvalSection = section(EvalSection, "evaluation")
    checkpoint: CheckpointSection = section(CheckpointSection, "checkpoints and resume")
    logging: LoggingSection = section(LoggingSection, "logs")
    # the components both recipes share (volta_train/training/memory.py, parallel.py, precision.py)
    memory: MemoryConfig = memory.config_section()
    parallel: ParallelConfig = parallel.config_section()
    precision: PrecisionConfig = precision.config_section()

    RECIPE: ClassVar[str] = "finetune"
    # where these options were before they moved into the shared sections (still read)
    ALIASES: ClassVar[dict[str, str]] = {
        **{f"model.{name}": f"memory.{name}" for name in (
            "gradient_checkpointing", "activation_offload", "activation_offload_keep", "tiled_mlp",
            "tiled_mlp_tokens", "lean_norm")},
        **{f"train.{name}": f"memory.{name}" for name in ("chunked_loss", "loss_chunk_tokens")},
        "train.deepspeed": "parallel.deepspeed",
        **{f"train.{name}": f"precision.{name}" for name in (
            "mixed_precision", "loss_scale_init", "loss_scale_window", "max_consecutive_skips")},
    }



def _exists(spec: str) -> bool:
    return bool(data_files(spec, must_exist=False))


def check(cfg: FinetuneConfig) -> FinetuneConfig:
    """Cross-key checks; fills data.format from the task. Raises ConfigError naming the key."""
    m, d, t = cfg.model, cfg.data, cfg.train
    if not m.path and not m.config:
        raise ConfigError("model: set model.path (a pretrained directory) or model.config (random weights)")
    for key, value in (("model.path", m.path), ("model.config", m.config)):
        if value and not Path(value).exists():
            raise ConfigError(f"{key}: {value!r} does not exist")
    if m.tokenizer not in (None, "bytes") and not Path(m.tokenizer).is_dir():
        raise ConfigError(f"model.tokenizer: {m.tokenizer!r} is neither 'bytes' nor a directory")
    fmt = d.format or ("classification" if cfg.task == "classification" else "text")
    if (cfg.task == "classification") != (fmt == "classification"):
        raise ConfigError(f"data.format {fmt!r} does not fit task {cfg.task!r} (classification data for the "
                          "classification task; text or instruction for causal_lm)")
    if not d.train:
        raise ConfigError("data.train: no training data given")
    if not _exists(d.train):
        raise ConfigError(f"data.train: {d.train!r} matches no .jsonl file")
    if d.eval and not _exists(d.eval):
        raise ConfigError(f"data.eval: {d.eval!r} matches no .jsonl file")
    if not 0.0 <= d.eval_fraction < 1.0:
        raise ConfigError(f"data.eval_fraction must lie in [0, 1), got {d.eval_fraction}")
    if d.packing and cfg.task != "causal_lm":
        raise ConfigError("data.packing applies to task causal_lm only")
    if d.max_length < 8:
        raise ConfigError(f"data.max_length must be >= 8, got {d.max_length}")
    for key, value in (("train.batch_size", t.batch_size), ("train.grad_accum", t.grad_accum),
                       ("logging.log_interval", cfg.logging.log_interval), ("checkpoint.keep", cfg.checkpoint.keep)):
        if value <= 0:
            raise ConfigError(f"{key} must be positive, got {value}")
    if t.steps is not None and t.steps <= 0:
        raise ConfigError(f"train.steps must be positive, got {t.steps}")
    if t.steps is None:
        check_number("train.epochs", t.epochs, 0, None, low_open=True)
    for key, value in (("eval.interval", cfg.eval.interval), ("checkpoint.interval", cfg.checkpoint.interval),
                       ("data.num_workers", d.num_workers)):
        if value < 0:
            raise ConfigError(f"{key} must be >= 0, got {value}")
    o, s = cfg.optimizer, cfg.schedule
    check_optimization({
        "lr": ("optimizer.lr", o.lr), "weight_decay": ("optimizer.weight_decay", o.weight_decay),
        "beta1": ("optimizer.beta1", o.beta1), "beta2": ("optimizer.beta2", o.beta2), "eps": ("optimizer.eps", o.eps),
        "momentum": ("optimizer.momentum", o.momentum), "grad_clip": ("train.grad_clip", t.grad_clip),
        "warmup_steps": ("schedule.warmup_steps", s.warmup_steps), "min_lr_ratio": ("schedule.min_lr_ratio",
                                                                                     s.min_lr_ratio),
        "time_limit_min": ("train.time_limit_min", t.time_limit_min),
    })
    if not 0.0 <= cfg.schedule.warmup_ratio < 1.0:
        raise ConfigError(f"schedule.warmup_ratio must lie in [0, 1), got {cfg.schedule.warmup_ratio}")
    if not 0.0 <= cfg.schedule.min_lr_ratio <= 1.0:
        raise ConfigError(f"schedule.min_lr_ratio must lie in [0, 1], got {cfg.schedule.min_lr_ratio}")
    memory.check(cfg.memory)
    precision.check(cfg.precision)
    parallel.check(cfg.parallel)
    sp = cfg.parallel.sequence_parallel_size
    if sp > 1 and not (cfg.task == "causal_lm" and d.packing):
        why = f"task is {cfg.task}" if cfg.task != "causal_lm" else "data.packing is false"
        raise ConfigError(f"parallel.sequence_parallel_size {sp} splits each row over {sp} processes, which needs "
                          f"packed causal-LM rows (DeepSpeed-Ulysses drops attention masks), and {why}: set "
                          "data.packing: true (task causal_lm), or parallel.sequence_parallel_size: 1")
    for key in ("prompt_template", "prompt_template_with_input"):
        template = getattr(d, key)
        if "{instruction}" not in template:
            raise ConfigError(f"data.{key} must contain {{instruction}}")
    return dataclasses.replace(cfg, data=dataclasses.replace(d, format=fmt))


