"""Saving what a run produced: HuggingFace weights (safetensors) + model config + the training config.

A checkpoint directory loads back with ``AutoModelForCausalLM.from_pretrained(path)``
(or the model class's ``from_pretrained``), with or without volta_train installed:
which attention implementation ran is not part of the saved model config.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from .config import save_yaml

logger = logging.getLogger(__name__)

TRAIN_CONFIG = "train_config.yaml"


def save_model(accelerator, model, path: str | Path, train_cfg=None, extra: dict | None = None) -> Path:
    """Write ``model.safetensors`` + ``config.json`` (+ ``train_config.yaml``, ``extra`` as ``run.json``) to ``path``.

    Every process must call this (gathering a sharded state dict is collective); only the main process writes.
    """
    path = Path(path)
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)
    unwrapped = accelerator.unwrap_model(model)
    if accelerator.is_main_process:
        path.mkdir(parents=True, exist_ok=True)
    unwrapped.save_pretrained(
        path,
        is_main_process=accelerator.is_main_process,
        state_dict=state_dict,
    )
    if accelerator.is_main_process:
        if train_cfg is not None:
            save_yaml(train_cfg, path / TRAIN_CONFIG)
        if extra is not None:
            (path / "run.json").write_text(json.dumps(extra, indent=2) + "\n", encoding="utf-8")
        logger.info("saved checkpoint to %s", path)
    accelerator.wait_for_everyone()
    return path
