"""Model helpers shared by the recipes (gpt_long, finetune): precision "auto", the padded vocabulary, a local
model config, a config's depth and width."""

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
