"""What a run writes: the final model, and resumable checkpoints written atomically and read without pickle code.

Final model (:func:`save_model`): HuggingFace weights (safetensors) + model config + the
training config; it loads back with ``AutoModelForCausalLM.from_pretrained(path)`` (or the
model class's ``from_pretrained``), with or without volta_train installed: which attention
implementation ran is not part of the saved model config.

Resumable checkpoints (:func:`save_checkpoint`, :func:`load_checkpoint`), under
``<out_dir>/checkpoints/``::

    step-00000200/
      model/model.safetensors, config.json   the weights (every checkpoint; gathered under ZeRO-3)
      optimizer.pt                           optimizer state (no DeepSpeed)
      scaler.pt                              fp16 GradScaler state (no DeepSpeed)
      deepspeed/state/...                    DeepSpeed's own files (ZeRO partitions, loss scaler), instead
      rng-rank0000.pt ...                    each process's Python/NumPy/torch/CUDA generator states
      trainer_state.json                     step, micro-batches and tokens consumed, run settings
      COMPLETE
    latest                                   the newest step directory's name (for people and scripts)

Atomicity: every process writes into ``.tmp-step-N/``; once all are done, the main process
flushes the files to disk, writes ``COMPLETE`` and renames the directory to ``step-N``
(one ``rename``), then updates ``latest`` (write + rename) and deletes the oldest
checkpoints beyond ``keep``. A kill at any point leaves either the new checkpoint
complete or a ``.tmp-*`` directory that is ignored (and removed by the next save):
the last good checkpoint is never touched before the new one is in place. Resuming
picks the complete ``step-*`` directory with the highest step. With several nodes,
``out_dir`` must be on a filesystem all nodes share.

Safety: the ``.pt`` files are read with ``torch.load(weights_only=True)``, which rebuilds
tensors and plain containers only and runs no code from the file. DeepSpeed's loader
(``engine.load_checkpoint``) asks for ``weights_only=False``; :func:`weights_only_loading`
overrides that for the duration of a load, allowing exactly four plain-data DeepSpeed
classes (loss scalers, the ZeRO stage enum, a fragment address). Weights are safetensors.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from .config import save_yaml

logger = logging.getLogger(__name__)

TRAIN_CONFIG = "train_config.yaml"
CHECKPOINTS = "checkpoints"
LATEST = "latest"
COMPLETE = "COMPLETE"
STATE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


def save_model(accelerator, model, path: str | Path, train_cfg=None, extra: dict | None = None,
               tokenizer=None) -> Path:
    """Write ``model.safetensors`` + ``config.json`` (+ ``train_config.yaml``, ``extra`` as ``run.json``) to ``path``.

    Every process must call this (gathering a sharded state dict is collective); only the main process writes.
    ``tokenizer``: a HuggingFace tokenizer to save alongside (so the directory is self-contained).
    """
    path = Path(path)
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)
    unwrapped = accelerator.unwrap_model(model)
    if accelerator.is_main_process:
        path.mkdir(parents=True, exist_ok=True)
        unwrapped.save_pretrained(path, is_main_process=True, state_dict=state_dict, max_shard_size="1000GB")
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
        if train_cfg is not None:
            save_yaml(train_cfg, path / TRAIN_CONFIG)
        if extra is not None:
            (path / "run.json").write_text(json.dumps(extra, indent=2) + "\n", encoding="utf-8")
        logger.info("saved model to %s", path)
    accelerator.wait_for_everyone()
    return path


# --------------------------------------------------------------------------------------------------
# Loading without running pickled code
# --------------------------------------------------------------------------------------------------


def _deepspeed_safe_globals() -> list:
    """The plain-data classes DeepSpeed pickles into its checkpoints (none of them runs code when rebuilt)."""
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address
    except ImportError:
        return []
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


@contextlib.contextmanager
def weights_only_loading():
    """Within the block, every ``torch.load`` runs with ``weights_only=True`` (whatever its caller asked)."""
    original = torch.load

    def load(*args, **kwargs):
        kwargs["weights_only"] = True
        return original(*args, **kwargs)

    with torch.serialization.safe_globals(_deepspeed_safe_globals()):
        torch.load = load
        try:
            yield
        finally:
            torch.load = original


def safe_load(path: str | Path):
    return torch.load(path, map_location="cpu", weights_only=True)


# --------------------------------------------------------------------------------------------------
# Random number generators
# --------------------------------------------------------------------------------------------------


def rng_state() -> dict:
    """This process's generator states as tensors and plain values (loadable with weights_only=True)."""
    version, mt, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
        "numpy": {"name": np_name, "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "gauss": float(np_gauss)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --------------------------------------------------------------------------------------------------
# Resumable checkpoints
# --------------------------------------------------------------------------------------------------


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """(step, directory) of every complete checkpoint under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and (p / COMPLETE).is_file() and (p / STATE).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def find_latest(root: str | Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def _fsync(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for dirpath, _, files in os.walk(path):
        for name in files:
            _fsync(Path(dirpath) / name)
        _fsync(Path(dirpath))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync(path.parent)


def _engine(model):
    return model if hasattr(model, "save_checkpoint") and hasattr(model, "load_checkpoint") else None


def save_checkpoint(accelerator, model, optimizer, root: str | Path, step: int, state: dict, keep: int = 2,
                    tokenizer=None) -> Path:
    """Write the checkpoint of optimizer step ``step`` (see the module doc); every process must call it."""
    root = Path(root)
    final, tmp = root / step_dir_name(step), root / f".tmp-{step_dir_name(step)}"
    main = accelerator.is_main_process
    if main:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-step-*"):  # left by a save that was killed
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    accelerator.wait_for_everyone()

    state_dict = accelerator.get_state_dict(model)  # collective under ZeRO-3
    if main:
        accelerator.unwrap_model(model).save_pretrained(tmp / "model", state_dict=state_dict,
                                                        max_shard_size="1000GB")
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / "model")
    del state_dict
    engine = _engine(model)
    if engine is not None:
        engine.save_checkpoint(str(tmp / "deepspeed"), tag="state", save_latest=False)
    elif main:
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        if accelerator.scaler is not None:
            torch.save(accelerator.scaler.state_dict(), tmp / "scaler.pt")
    torch.save(rng_state(), tmp / f"rng-rank{accelerator.process_index:04d}.pt")
    accelerator.wait_for_everyone()

    if main:
        state = dict(state, step=step, world_size=accelerator.num_processes)
        (tmp / STATE).write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")
        _fsync_tree(tmp)
        _write_atomic(tmp / COMPLETE, f"{step}\n")
        if final.exists():  # an explicit resume from an older checkpoint saving this step again
            old = root / f".tmp-old-{final.name}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync(root)
        _write_atomic(root / LATEST, final.name + "\n")
        for _, old in complete_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        logger.info("saved checkpoint %s", final)
    accelerator.wait_for_everyone()
    return final


def _load_weights(unwrapped, model_dir: Path) -> None:
    from safetensors.torch import load_model

    files = sorted(model_dir.glob("*.safetensors"))
    if len(files) != 1:
        raise FileNotFoundError(f"{model_dir}: expected one .safetensors file, found {len(files)}")
    missing, unexpected = load_model(unwrapped, files[0], strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight") or "decoder.weight" in k}
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"{files[0]}: weights do not match the model (missing {sorted(set(missing) - tied)[:5]}, "
                           f"unexpected {sorted(unexpected)[:5]})")


def load_checkpoint(accelerator, model, optimizer, path: str | Path) -> dict:
    """Restore weights, optimizer (and loss scaler) state from ``path``; returns its trainer state.

    The generator states are returned under ``"rng"`` (this process's, or None if the
    checkpoint has none for it), for the caller to apply right before training resumes.
    """
    path = Path(path)
    if not (path / COMPLETE).is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {COMPLETE} file)")
    state = json.loads((path / STATE).read_text(encoding="utf-8"))
    engine = _engine(model)
    with weights_only_loading():
        if engine is not None:
            if not (path / "deepspeed").is_dir():
                raise FileNotFoundError(f"{path} was written without DeepSpeed; this run uses DeepSpeed")
            loaded, _ = engine.load_checkpoint(str(path / "deepspeed"), tag="state", load_optimizer_states=True,
                                               load_lr_scheduler_states=False)
            if loaded is None:
                raise RuntimeError(f"DeepSpeed could not load {path / 'deepspeed'}")
        else:
            if (path / "deepspeed").is_dir():
                raise FileNotFoundError(f"{path} was written by a DeepSpeed run; resume it with the same DeepSpeed "
                                        "config")
            _load_weights(accelerator.unwrap_model(model), path / "model")
            optimizer.load_state_dict(safe_load(path / "optimizer.pt"))
            scaler_file = path / "scaler.pt"
            if accelerator.scaler is not None:
                if scaler_file.is_file():
                    accelerator.scaler.load_state_dict(safe_load(scaler_file))
                else:
                    logger.warning("%s has no loss-scaler state (written without fp16): the scale starts afresh", path)
        rng_file = path / f"rng-rank{accelerator.process_index:04d}.pt"
        state["rng"] = safe_load(rng_file) if rng_file.is_file() else None
    return state
