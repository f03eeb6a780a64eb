"""Config-driven fine-tuning (``recipes/finetune.py``): the YAML schema, data formats, batching, the model and its
evaluation.

Tasks:

* ``causal_lm``: a decoder (GPT-2, Llama, ...) on jsonl ``text`` documents or ``instruction``
  records (prompt + response; by default only the response is a target);
* ``classification``: an encoder (BERT, RoBERTa, ...) with a sequence-classification head on
  jsonl records with a text (optionally a second text) and a label.

The YAML file has one section per concern (``model``, ``data``, ``train``, ``optimizer``,
``schedule``, ``eval``, ``checkpoint``, ``logging``); every key is also a flag
(``--optimizer.lr 1e-4``). See ``configs/finetune/*.yaml`` and docs/recipes.md.

Data are tokenised once and cached (``data.cache_dir``) as ``.npz`` arrays read with
``allow_pickle=False``. Batches are padded to their longest row with an
``attention_mask`` (the patched attention then runs the varlen kernel), or, with
``data.packing: true`` (causal LM), examples are packed into ``max_length`` rows with
``position_ids`` restarting at each example, so none attends to another.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from . import activation_offload, chunked_loss, data, rms_norm, tiled_mlp
from .config import ConfigError, check_number, check_optimization, field, section
from .data import ByteTokenizer
from .models import check_safetensors_weights, padded_vocab, read_model_config
from .optim import OPTIMIZERS, SCHEDULES

logger = logging.getLogger(__name__)

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
    gradient_checkpointing: bool = field(False, "recompute activations in the backward (less memory)")
    tiled_mlp: str = field("auto", "MLP over tiles of the sequence, recomputed per tile in the backward "
                                   "(volta_train/training/tiled_mlp.py); auto: on from the length where a batch's "
                                   "MLP activations reach 2 GiB (quote on/off in YAML)", choices=["auto", "on", "off"])
    tiled_mlp_tokens: int | None = field(None, "tokens per tile of the tiled MLP (auto: ~256 MiB of activations)")
    activation_offload: bool = field(False, "keep the hidden states kept by gradient checkpointing in host memory "
                                            "between forward and backward (needs gradient_checkpointing)")
    activation_offload_keep: int = field(0, "with activation_offload: the top N blocks keep their checkpointed inputs "
                                            "on the GPU (less host memory for spare GPU memory)")
    lean_norm: str = field("auto", "RMSNorm that saves only its input and per-row scale and runs its backward over "
                                   "chunks of rows (volta_train/training/rms_norm.py); auto: on where the tiled MLP is "
                                   "(quote on/off in YAML)", choices=["auto", "on", "off"])
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
    mixed_precision: str = field("auto", "no, fp16, bf16, or auto (fp16 on a GPU, no on CPU)",
                                 choices=["auto", "no", "fp16", "bf16"])
    loss_scale_init: float = field(65536.0, "fp16: initial dynamic loss scale (GradScaler)")
    loss_scale_window: int = field(1000, "fp16: overflow-free steps before the loss scale doubles (GradScaler)")
    max_consecutive_skips: int = field(32, "fp16: stop the run (non-zero exit) after this many optimizer steps in a "
                                           "row skipped for non-finite gradients")
    deepspeed: str | None = field(None, "DeepSpeed JSON, or zero1/zero2/zero3/zero3_offload", unset=True)
    seed: int = field(1337, "random seed (head init, data order, dropout)")
    cpu: bool = field(False, "train on CPU even if a GPU is present")
    cpu_threads: int | None = field(None, "torch threads on CPU (auto: available cores / local processes)")
    time_limit_min: float = field(0.0, "stop with a checkpoint after this many minutes (0: none)")
    chunked_loss: bool = field(True, "causal_lm: loss over chunks of tokens, never the whole [tokens, vocab] logits "
                                     "(volta_train/training/chunked_loss.py); false: the model's own loss")
    loss_chunk_tokens: int | None = field(None, "causal_lm: tokens per chunk of the chunked loss (auto: 1 GiB of "
                                                "fp32 logits)")


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
    train: TrainSection = section(TrainSection, "steps, batches, precision, distribution")
    optimizer: OptimizerSection = section(OptimizerSection, "optimizer")
    schedule: ScheduleSection = section(ScheduleSection, "learning-rate schedule")
    eval: EvalSection = section(EvalSection, "evaluation")
    checkpoint: CheckpointSection = section(CheckpointSection, "checkpoints and resume")
    logging: LoggingSection = section(LoggingSection, "logs")


# --------------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------------


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
    if m.activation_offload and not m.gradient_checkpointing:
        raise ConfigError("model.activation_offload moves what gradient checkpointing keeps: set "
                          "model.gradient_checkpointing too")
    if m.activation_offload_keep < 0:
        raise ConfigError(f"model.activation_offload_keep must be >= 0 (blocks kept on the GPU), got "
                          f"{m.activation_offload_keep}")
    if m.tiled_mlp_tokens is not None and m.tiled_mlp_tokens <= 0:
        raise ConfigError(f"model.tiled_mlp_tokens must be positive (or unset: auto), got {m.tiled_mlp_tokens}")
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
        "loss_scale_init": ("train.loss_scale_init", t.loss_scale_init),
        "loss_scale_window": ("train.loss_scale_window", t.loss_scale_window),
        "max_consecutive_skips": ("train.max_consecutive_skips", t.max_consecutive_skips),
        "time_limit_min": ("train.time_limit_min", t.time_limit_min),
    })
    if not 0.0 <= cfg.schedule.warmup_ratio < 1.0:
        raise ConfigError(f"schedule.warmup_ratio must lie in [0, 1), got {cfg.schedule.warmup_ratio}")
    if not 0.0 <= cfg.schedule.min_lr_ratio <= 1.0:
        raise ConfigError(f"schedule.min_lr_ratio must lie in [0, 1], got {cfg.schedule.min_lr_ratio}")
    for key in ("prompt_template", "prompt_template_with_input"):
        template = getattr(d, key)
        if "{instruction}" not in template:
            raise ConfigError(f"data.{key} must contain {{instruction}}")
    return dataclasses.replace(cfg, data=dataclasses.replace(d, format=fmt))


# --------------------------------------------------------------------------------------------------
# records and tokenisation
# --------------------------------------------------------------------------------------------------


def data_files(spec: str, must_exist: bool = True) -> list[Path]:
    """A .jsonl file, every .jsonl file under a directory (sorted), or the files a glob matches (sorted)."""
    path = Path(spec)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*.jsonl") if p.is_file())
    else:
        files = sorted(Path(p) for p in glob.glob(spec) if Path(p).is_file())
    if not files and must_exist:
        raise FileNotFoundError(f"{spec!r} matches no .jsonl file")
    return files


def _decode_line(raw: bytes, f: Path, n: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{f}:{n}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                         "data files must be UTF-8 text, one JSON object per line") from None


def read_records(spec: str) -> list[dict]:
    """The JSON objects of every file ``spec`` names, each tagged with ``_where`` (``file:line``).

    Refused with ``file:line``: lines that are not UTF-8 or not a JSON object; files with no record.
    """
    records = []
    for f in data_files(spec):
        before = len(records)
        with f.open("rb") as lines:
            for n, raw in enumerate(lines, 1):
                line = _decode_line(raw, f, n)
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{f}:{n}: not valid JSON ({e})") from None
                if not isinstance(record, dict):
                    raise ValueError(f"{f}:{n}: expected a JSON object, got {type(record).__name__}")
                record["_where"] = f"{f}:{n}"
                records.append(record)
        if len(records) == before:
            raise ValueError(f"{f}: no records (the file is empty); expected one JSON object per line")
    return records


def _field(record: dict, name: str, key: str, required: bool = True):
    if name not in record:
        if required:
            raise ValueError(f"{record['_where']}: no field {name!r} (set {key} to the field's name)")
        return None
    return record[name]


def _text(record: dict, name: str, key: str, required: bool = True) -> str | None:
    """A text field: a string (an optional field may also be absent or null; then None)."""
    value = _field(record, name, key, required)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        shown = "null" if value is None else f"{type(value).__name__} {json.dumps(value)[:60]}"
        raise ValueError(f"{record['_where']}: field {name!r} is {shown}; expected a string")
    data.check_encodable(value, record["_where"], f"field {name!r}")
    return value


def _label_kind(value) -> str:
    if isinstance(value, bool) or value is None or not isinstance(value, (int, str)):
        return "bad"
    return "int" if isinstance(value, int) else "str"


def _check_label_types(records: list[dict], d: DataSection) -> str | None:
    """'int' or 'str': the one type every record's label has (refused: mixed types, null, floats, lists...)."""
    first: dict[str, dict] = {}
    for r in records:
        value = _field(r, d.label_field, "data.label_field")
        kind = _label_kind(value)
        if kind == "bad":
            raise ValueError(f"{r['_where']}: label {json.dumps(value)} ({'null' if value is None else type(value).__name__}"
                             "); expected a label name (string) or a class index (integer >= 0)")
        if kind == "int" and value < 0:
            raise ValueError(f"{r['_where']}: label {value} is negative; class indices start at 0")
        first.setdefault(kind, r)
        if len(first) > 1:
            a, b = first["int"], first["str"]
            raise ValueError(f"labels mix integers and strings: {a['_where']} has {a[d.label_field]!r}, "
                             f"{b['_where']} has {b[d.label_field]!r}; use one type throughout (names, or indices "
                             "into data.labels)")
    return next(iter(first), None)


def label_names(records: list[dict], d: DataSection) -> list[str]:
    """data.labels, or the labels of ``records``: indices 0..max when they are integers, sorted names otherwise."""
    if d.labels:
        return list(d.labels)
    if not records:
        raise ValueError("no records to infer the labels from; set data.labels")
    kind = _check_label_types(records, d)
    values = {r[d.label_field] for r in records}
    if kind == "int":
        return [str(i) for i in range(max(values) + 1)]
    return sorted(values)


def _label_id(record: dict, d: DataSection, names: list[str]) -> int:
    value = _field(record, d.label_field, "data.label_field")
    source = "data.labels" if d.labels else "the labels of data.train"
    if isinstance(value, int) and not isinstance(value, bool):
        if not 0 <= value < len(names):
            raise ValueError(f"{record['_where']}: label {value} outside 0..{len(names) - 1} (indices into {source} "
                             f"{names})")
        if str(value) in names and names.index(str(value)) != value:
            raise ValueError(f"{record['_where']}: label {value} is ambiguous: index {value} of {source} is "
                             f"{names[value]!r} but {str(value)!r} is also a name; write the name as a string")
        return value
    if value not in names:
        raise ValueError(f"{record['_where']}: label {value!r} is not one of {source} {names}")
    return names.index(value)


def _encode_classification(tokenizer, text: str, pair: str | None, max_length: int) -> tuple[list[int], int]:
    """(ids with the model's special tokens, index where the second segment starts or 0)."""
    if isinstance(tokenizer, ByteTokenizer):
        first = tokenizer.encode(text).tolist()
        second = tokenizer.encode(pair).tolist() if pair is not None else []
        budget = max_length - (3 if pair is not None else 2)
        if pair is not None:
            while len(first) + len(second) > budget:
                (first if len(first) >= len(second) else second).pop()
        else:
            first = first[:budget]
        ids = [tokenizer.cls_token_id, *first, tokenizer.sep_token_id]
        split = len(ids) if pair is not None else 0
        if pair is not None:
            ids += [*second, tokenizer.sep_token_id]
        return ids, split
    enc = tokenizer.tokenizer(text, pair, truncation=True, max_length=max_length, return_token_type_ids=True)
    ids = enc["input_ids"]
    types = enc.get("token_type_ids") or [0] * len(ids)
    split = types.index(1) if 1 in types else 0
    if pair is not None and split == 0:  # tokenizers without token types (RoBERTa): after the first </s></s>
        sep = tokenizer.sep_token_id
        positions = [i for i, t in enumerate(ids) if t == sep]
        split = positions[1] + 1 if len(positions) >= 2 else 0
    return ids, split


def _encode_text(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text).tolist()


def tokenize(records: list[dict], cfg: FinetuneConfig, tokenizer, names: list[str]) -> dict[str, np.ndarray]:
    """Arrays of the tokenised examples: ``ids`` (all examples concatenated), ``offsets``, ``prompt`` (tokens
    that are not targets at the start of each example), ``split`` (second segment start), ``label``."""
    d = cfg.data
    eos = tokenizer.eos_token_id
    ids, offsets, prompt, split, label = [], [0], [], [], []
    if d.format == "classification":
        _check_label_types(records, d)
    for r in records:
        p, s, y = 0, 0, -100
        if d.format == "text":
            text = _text(r, d.text_field, "data.text_field")
            example = _encode_text(tokenizer, text) + [eos]
        elif d.format == "instruction":
            inst = _text(r, d.instruction_field, "data.instruction_field")
            extra = _text(r, d.input_field, "data.input_field", required=False)
            response = _text(r, d.response_field, "data.response_field")
            template = d.prompt_template_with_input if extra else d.prompt_template
            try:
                head = template.format(instruction=inst, input=extra or "")
            except (KeyError, IndexError) as e:
                raise ValueError(f"data prompt template: unknown placeholder {e} (use {{instruction}}, {{input}})")
            head_ids = _encode_text(tokenizer, head)
            example = head_ids + _encode_text(tokenizer, response) + [eos]
            p = 0 if d.train_on_prompt else len(head_ids)
        else:
            text = _text(r, d.text_field, "data.text_field")
            pair = _text(r, d.text_pair_field, "data.text_pair_field") if d.text_pair_field else None
            example, s = _encode_classification(tokenizer, text, pair, d.max_length)
            y = _label_id(r, d, names)
        example = example[: d.max_length]
        ids += example
        offsets.append(len(ids))
        prompt.append(min(p, len(example)))
        split.append(s)
        label.append(y)
    dtype = np.uint32 if tokenizer.vocab_size > 65535 else np.uint16
    return {"ids": np.asarray(ids, dtype=dtype), "offsets": np.asarray(offsets, dtype=np.int64),
            "prompt": np.asarray(prompt, dtype=np.int32), "split": np.asarray(split, dtype=np.int32),
            "label": np.asarray(label, dtype=np.int64)}


def _cache_key(spec: str, cfg: FinetuneConfig, tokenizer, names: list[str]) -> str:
    d = cfg.data
    # v2: records checked strictly (null / non-string text, label types); caches of v1 are rebuilt
    h = hashlib.sha256(f"v2|{tokenizer.name}|{tokenizer.eos_token_id}|{cfg.task}|{names}".encode())
    for key in ("format", "max_length", "text_field", "text_pair_field", "label_field", "instruction_field",
                "input_field", "response_field", "prompt_template", "prompt_template_with_input", "train_on_prompt"):
        h.update(f"|{key}={getattr(d, key)!r}".encode())
    for f in data_files(spec):  # contents, not mtimes: an edit that keeps the mtime (cp -p, rsync -t) is seen
        h.update(f"|{f.resolve()}|{data.sha256_file(f)}".encode())
    return h.hexdigest()[:16]


def load_examples(spec: str, cfg: FinetuneConfig, tokenizer, names: list[str]) -> dict[str, np.ndarray]:
    """:func:`tokenize` of the records ``spec`` names, cached as an .npz (atomic write, read without pickle)."""
    key = _cache_key(spec, cfg, tokenizer, names)
    path = Path(cfg.data.cache_dir) / f"finetune-{Path(spec).stem or 'data'}-{key}.npz"

    def build() -> dict[str, np.ndarray]:
        arrays = tokenize(read_records(spec), cfg, tokenizer, names)
        logger.info("tokenised %s: %d examples, %s tokens -> %s", spec, arrays["offsets"].size - 1,
                    f"{arrays['ids'].size:,}", path)
        return arrays

    def read(p: Path) -> dict[str, np.ndarray]:
        with np.load(p, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}

    arrays = data.cached(path, build, lambda value, f: np.savez(f, **value), read, "tokenised dataset")
    return drop_targetless(arrays, cfg, spec)


def target_counts(arrays: dict[str, np.ndarray]) -> np.ndarray:
    """Tokens each causal-LM example is trained to predict: after its first token and its prompt."""
    lengths = np.diff(arrays["offsets"])
    return lengths - np.maximum(arrays["prompt"].astype(np.int64), 1)


def drop_targetless(arrays: dict[str, np.ndarray], cfg: FinetuneConfig, spec: str) -> dict[str, np.ndarray]:
    """Causal LM: the examples with at least one target token; the others are counted and reported (a batch of
    them only would have a loss of 0/0). None left is an error naming the cause."""
    if cfg.task != "causal_lm":
        return arrays
    n = arrays["offsets"].size - 1
    keep = np.flatnonzero(target_counts(arrays) > 0)
    if keep.size == n:
        return arrays
    why = (f"the prompt fills data.max_length {cfg.data.max_length}" if cfg.data.format == "instruction" and
           not cfg.data.train_on_prompt else "the text is empty")
    if keep.size == 0:
        raise ValueError(f"{spec}: none of its {n} examples has a token to learn ({why}); raise data.max_length, "
                         "shorten the prompts, or set data.train_on_prompt")
    logger.warning("%s: %d of %d examples have no token to learn (%s) and are left out", spec, n - keep.size, n, why)
    return select(arrays, keep.tolist())


def select(arrays: dict[str, np.ndarray], indices) -> dict[str, np.ndarray]:
    """The examples at ``indices``, as arrays of the same layout."""
    starts, ends = arrays["offsets"][:-1], arrays["offsets"][1:]
    pieces = [arrays["ids"][starts[i]:ends[i]] for i in indices]
    lengths = [p.size for p in pieces]
    return {"ids": np.concatenate(pieces) if pieces else arrays["ids"][:0],
            "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            **{k: arrays[k][list(indices)] for k in ("prompt", "split", "label")}}


# --------------------------------------------------------------------------------------------------
# datasets and batching
# --------------------------------------------------------------------------------------------------


class ExampleDataset(torch.utils.data.Dataset):
    """One tokenised example per item: ``input_ids``, ``labels`` (targets or -100, or the class), ``split``."""

    def __init__(self, arrays: dict[str, np.ndarray], task: str):
        self.a, self.task = arrays, task

    def __len__(self) -> int:
        return self.a["offsets"].size - 1

    def __getitem__(self, i: int) -> dict:
        a = self.a
        ids = torch.from_numpy(a["ids"][a["offsets"][i]:a["offsets"][i + 1]].astype(np.int64))
        if self.task == "classification":
            return {"input_ids": ids, "labels": int(a["label"][i]), "split": int(a["split"][i])}
        labels = ids.clone()
        labels[: int(a["prompt"][i])] = -100
        return {"input_ids": ids, "labels": labels}


class PackedExamples(torch.utils.data.Dataset):
    """Causal-LM examples packed in order into rows of ``max_length`` tokens (first fit of the next example).

    Each row's ``position_ids`` restart at 0 at every example; the tail of a row that no example
    fills is padding, given positions of its own and no targets, so no token attends across
    examples and no attention mask is needed.
    """

    def __init__(self, arrays: dict[str, np.ndarray], max_length: int, pad_token_id: int):
        self.a, self.max_length, self.pad = arrays, max_length, pad_token_id
        lengths = np.diff(arrays["offsets"])
        self.rows, row, used = [], [], 0
        for i, n in enumerate(lengths.tolist()):
            if used + n > max_length and row:
                self.rows.append(row)
                row, used = [], 0
            row.append(i)
            used += n
        if row:
            self.rows.append(row)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, r: int) -> dict:
        a = self.a
        ids, labels, positions = [], [], []
        for i in self.rows[r]:
            x = a["ids"][a["offsets"][i]:a["offsets"][i + 1]].astype(np.int64).tolist()
            y = list(x)
            y[0] = -100  # the previous example's last token does not predict this one's first
            for j in range(min(int(a["prompt"][i]), len(y))):
                y[j] = -100
            ids += x
            labels += y
            positions += list(range(len(x)))
        pad = self.max_length - len(ids)
        ids += [self.pad] * pad
        labels += [-100] * pad
        positions += list(range(pad))
        return {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels), "position_ids": torch.tensor(positions)}


class Collator:
    """Pads a list of :class:`ExampleDataset` items to the longest (right padding, ``attention_mask``)."""

    def __init__(self, pad_token_id: int, task: str, token_types: bool):
        self.pad, self.task, self.token_types = pad_token_id, task, token_types

    def __call__(self, items: list[dict]) -> dict[str, torch.Tensor]:
        if "position_ids" in items[0]:  # packed rows: all of max_length already
            return torch.utils.data.default_collate(items)
        length = max(item["input_ids"].numel() for item in items)
        n = len(items)
        ids = torch.full((n, length), self.pad, dtype=torch.long)
        mask = torch.zeros((n, length), dtype=torch.long)
        out = {"input_ids": ids, "attention_mask": mask}
        if self.task == "classification":
            out["labels"] = torch.tensor([item["labels"] for item in items], dtype=torch.long)
            if self.token_types:
                out["token_type_ids"] = torch.zeros((n, length), dtype=torch.long)
        else:
            out["labels"] = torch.full((n, length), -100, dtype=torch.long)
        for row, item in enumerate(items):
            k = item["input_ids"].numel()
            ids[row, :k] = item["input_ids"]
            mask[row, :k] = 1
            if self.task != "classification":
                out["labels"][row, :k] = item["labels"]
            elif self.token_types and item["split"]:
                out["token_type_ids"][row, item["split"]:k] = 1
        return out


# --------------------------------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------------------------------


def tokenizer_spec(cfg: FinetuneConfig) -> str:
    if cfg.model.tokenizer:
        return cfg.model.tokenizer
    for candidate in (cfg.model.path, cfg.model.config):
        if candidate:
            directory = Path(candidate) if Path(candidate).is_dir() else Path(candidate).parent
            if any((directory / n).exists() for n in ("tokenizer.json", "tokenizer_config.json", "vocab.txt",
                                                      "vocab.json")):
                return str(directory)
    return "bytes"


def max_positions(model_config) -> int | None:
    """Longest input the model's position embeddings allow (RoBERTa-style offsets subtracted), or None."""
    limit = getattr(model_config, "n_positions", None)
    if limit is None and getattr(model_config, "position_embedding_type", "absolute") == "absolute" and \
            model_config.model_type in ("bert", "roberta", "xlm-roberta", "electra", "camembert", "distilbert",
                                        "albert"):
        limit = getattr(model_config, "max_position_embeddings", None)
        if limit is not None and model_config.model_type in ("roberta", "xlm-roberta", "camembert"):
            limit -= (model_config.pad_token_id or 0) + 1
    return limit


def build_model(cfg: FinetuneConfig, tokenizer, names: list[str]):
    """The model for ``cfg.task`` (weights from model.path, or random from model.config), attention still stock."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    m = cfg.model
    if m.path:
        check_safetensors_weights(m.path, "model.path")
        model_config = AutoConfig.from_pretrained(m.path, local_files_only=True)
    else:
        model_config = read_model_config(m.config)
    for key, value in m.config_overrides.items():
        if not hasattr(model_config, key):
            raise ConfigError(f"model.config_overrides: the {model_config.model_type} config has no {key!r}")
        setattr(model_config, key, value)
    model_config.use_cache = False
    if cfg.task == "classification":
        model_config.num_labels = len(names)
        model_config.id2label = dict(enumerate(names))
        model_config.label2id = {n: i for i, n in enumerate(names)}
        if getattr(model_config, "pad_token_id", None) is None:
            model_config.pad_token_id = tokenizer.pad_token_id
        cls = AutoModelForSequenceClassification
    else:
        cls = AutoModelForCausalLM
    if model_config.vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"model: the vocabulary ({model_config.vocab_size}) is smaller than the tokenizer's "
                          f"({tokenizer.vocab_size}); with the byte tokenizer use vocab_size >= "
                          f"{padded_vocab(tokenizer.vocab_size)}")
    limit = max_positions(model_config)
    if limit is not None and cfg.data.max_length > limit:
        raise ConfigError(f"data.max_length {cfg.data.max_length} exceeds the model's {limit} positions")
    if m.path:
        model = cls.from_pretrained(m.path, config=model_config, attn_implementation="sdpa", dtype="float32",
                                    local_files_only=True)
    else:
        model = cls.from_config(model_config, attn_implementation="sdpa", dtype=torch.float32)  # see gpt.build_model
    if cfg.task == "causal_lm":
        model.loss_type = "ForCausalLM"
    if m.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    tiled = tiled_mlp.configure(model, m.tiled_mlp, cfg.train.batch_size * cfg.data.max_length, m.tiled_mlp_tokens)
    rms_norm.configure(model, m.lean_norm, bool(tiled))
    if m.activation_offload:
        try:
            activation_offload.enable(model, keep_last=m.activation_offload_keep)
        except activation_offload.ActivationOffloadError as e:
            raise ConfigError(f"model.activation_offload_keep: {e}") from None
    return model


def steps_for(cfg: FinetuneConfig, n_train_items: int, num_processes: int) -> int:
    if cfg.train.steps:
        return cfg.train.steps
    per_epoch = n_train_items // (cfg.train.batch_size * num_processes)
    return max(1, math.ceil(cfg.train.epochs * per_epoch / cfg.train.grad_accum))


# --------------------------------------------------------------------------------------------------
# evaluation
# --------------------------------------------------------------------------------------------------


class Evaluator:
    """Loss (and accuracy) over the eval set, for the trainer's ``evaluate``; every process scores its share of
    each group of ``batch_size * processes`` items, at most ``max_batches`` groups (None: all of them)."""

    def __init__(self, model, accelerator, eval_set, collate, batch_size: int, max_batches: int | None, causal: bool,
                 chunked: bool, chunk_tokens: int | None):
        self.model, self.accelerator, self.eval_set, self.collate = model, accelerator, eval_set, collate
        self.batch_size, self.causal, self.chunked, self.chunk_tokens = batch_size, causal, chunked, chunk_tokens
        self.rank = accelerator.process_index
        self.group = batch_size * accelerator.num_processes
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
            labels = batch.pop("labels").to(device)
            batch = {k: v.to(device) for k, v in batch.items()}
            if self.chunked:  # loss and argmax hits chunk by chunk, no [tokens, vocab] logits
                targets = chunked_loss.shift_labels(labels)
                targets[weight == 0] = -100
                loss_sum, count, correct = chunked_loss.causal_lm_eval_sums(
                    model, batch, targets, chunk_tokens=self.chunk_tokens)
                sums += torch.stack([loss_sum.double(), count.double(), correct.double()])
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
