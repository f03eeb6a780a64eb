"""Model helpers shared by the recipes (gpt_long, finetune): precision "auto", the padded vocabulary, a local
model config, loading a model (pretrained weights or random), a config's depth and width."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .config import ConfigError


def auto_precision(default: str, kind: str) -> str:
    """``mixed_precision`` "auto": a precision chosen through ``accelerate config`` (ACCELERATE_MIXED_PRECISION) wins
    over the device default, except fp16 on CPU (a GPU config launched on a CPU machine): that stays fp32, since
    CPU fp16 is an emulation for tests, asked for explicitly."""
    env = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if env == "no" or (env == "fp16" and kind == "cpu"):
        return default
    return env


def padded_vocab(vocab_size: int, multiple: int = 64) -> int:
    """Round the embedding up to a multiple of 64 rows (tensor-core friendly; the extra ids are never seen)."""
    return (vocab_size + multiple - 1) // multiple * multiple


def read_model_config(path: str | Path):
    """A transformers config from a config.json file or a directory holding one (no download)."""
    from transformers import AutoConfig

    path = Path(path)
    if path.is_dir():
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"model config {str(path)!r}: cannot read it as JSON ({e})") from None
    model_type = values.pop("model_type", None)
    if model_type is None:
        raise ConfigError(f"model config {str(path)!r} has no model_type (e.g. \"gpt2\" or \"llama\")")
    return AutoConfig.for_model(model_type, **values)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt")


def tokenizer_spec(tokenizer: str | None, *model_paths: str | None) -> str:
    """The tokenizer both recipes load: ``tokenizer`` when given, else the first model directory (or the directory
    of a config.json) among ``model_paths`` that holds tokenizer files, else "bytes"."""
    if tokenizer:
        return tokenizer
    for candidate in model_paths:
        if candidate:
            directory = Path(candidate) if Path(candidate).is_dir() else Path(candidate).parent
            if any((directory / name).exists() for name in TOKENIZER_FILES):
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


def load_causal_lm(cls, path: str | None, config_path: str | None = None, config=None, option: str = "model.path"):
    """A model of ``cls`` (a transformers Auto class) with stock SDPA attention and fp32 weights, the one way both
    recipes load one: the pretrained directory ``path`` (safetensors only: pickled weights are refused naming
    ``option``; local files only; ``config`` replaces its config.json), or random weights from ``config`` or the
    config.json at ``config_path`` (seeded by the caller). fp32 whatever the config's dtype says (Llama-3 configs
    say bfloat16): mixed precision computes in fp16/bf16 and keeps these as the master weights; under ZeRO-3
    DeepSpeed stores its own copy."""
    import torch

    if path:
        check_safetensors_weights(path, option)
        return cls.from_pretrained(path, config=config, attn_implementation="sdpa", dtype=torch.float32,
                                   local_files_only=True)
    if config is None:
        config = read_model_config(config_path)
    config._attn_implementation = "sdpa"
    return cls.from_config(config, attn_implementation="sdpa", dtype=torch.float32)


def layers_and_hidden(model_config) -> tuple[int, int]:
    """(layers, hidden size) of a transformers config of any family: ``num_hidden_layers``/``hidden_size``, or
    GPT-2's ``n_layer``/``n_embd``."""
    c = model_config
    return getattr(c, "num_hidden_layers", None) or c.n_layer, getattr(c, "hidden_size", None) or c.n_embd


PICKLED_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt")  # torch.save files: unpickling one can run code


def check_safetensors_weights(path: str | Path, option: str) -> None:
    """ConfigError naming the file when the model directory ``path`` holds its weights only as pickles
    (``pytorch_model.bin`` & co.), which are never loaded, with the one-line command that converts them."""
    path = Path(path)
    if not path.is_dir() or any(path.glob("*.safetensors")):
        return
    pickled = sorted({f for pattern in PICKLED_WEIGHTS for f in path.glob(pattern) if f.is_file()})
    if not pickled:
        return
    files = ", ".join(str(f) for f in pickled)
    names = [str(f) for f in pickled]
    convert = (f"import torch; from safetensors.torch import save_file; sd = {{k: v for f in {names!r} for k, v in "
               "torch.load(f, weights_only=True).items()}; save_file({k: v.clone().contiguous() for k, v in "
               f"sd.items()}}, {str(path / 'model.safetensors')!r})")
    raise ConfigError(f"{option} {path}: its weights are pickled ({files}), and pickled weights are not loaded (a "
                      f"pickle can run code); convert them to safetensors once, where you trust the file: "
                      f"python -c \"{convert}\"")
