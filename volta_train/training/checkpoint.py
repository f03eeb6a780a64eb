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
      MANIFEST.json                          size and sha256 of every file above
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

Integrity: once every file is written, the main process records their sizes and SHA-256 in
``MANIFEST.json`` (then ``COMPLETE``). Resuming verifies the manifest (:func:`verify_checkpoint`);
``resume: auto`` takes the newest checkpoint that verifies, warns about each newer one it skips
(naming the file and what is wrong with it) and renames those to ``step-N.corrupt`` so that they
are neither picked nor rotated; when none verifies the run stops with the problems listed (it never
restarts from scratch silently). Checkpoints written before manifests existed are checked
structurally (every file parses, tensors have the sizes their headers promise), with a warning that
their contents cannot be verified. A read error names the file (:class:`CheckpointError`).

Safety: the ``.pt`` files are read with ``torch.load(weights_only=True)``, which rebuilds
tensors and plain containers only and runs no code from the file. DeepSpeed's loader
(``engine.load_checkpoint``) asks for ``weights_only=False``; :func:`weights_only_loading`
overrides that for the duration of a load, allowing exactly four plain-data DeepSpeed
classes (loss scalers, the ZeRO stage enum, a fragment address). Weights are safetensors.
"""

from __future__ import annotations

import contextlib
import hashlib
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
from .fsio import strict_json, write_text_atomic, writing

logger = logging.getLogger(__name__)

TRAIN_CONFIG = "train_config.yaml"
CHECKPOINTS = "checkpoints"
LATEST = "latest"
COMPLETE = "COMPLETE"
STATE = "trainer_state.json"
MANIFEST = "MANIFEST.json"
CORRUPT_SUFFIX = ".corrupt"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the checkpoint file and what is wrong."""
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


def save_model(accelerator, model, path: str | Path, train_cfg=None, extra: dict | None = None,
               tokenizer=None) -> Path:
    """Write ``model.safetensors`` + ``config.json`` (+ ``train_config.yaml``, ``extra`` as ``run.json``) to ``path``.

    Every process must call this (gathering a sharded state dict is collective); only the main process writes.
    ``tokenizer``: a HuggingFace tokenizer to save alongside (so the directory is self-contained).
    The files go to ``.tmp-<name>`` beside ``path`` with a ``MANIFEST.json``, which is renamed to ``path`` once
    complete: ``path`` holds either the previous model or the whole new one (:func:`verify_model` checks it).
    """
    path = Path(path)
    tmp, old = path.with_name(f".tmp-{path.name}"), path.with_name(f".old-{path.name}")
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)
    unwrapped = accelerator.unwrap_model(model)
    if accelerator.is_main_process:
        with writing(path, "the model"):
            for stale in (tmp, old):  # left by a save that was killed
                if stale.exists():
                    shutil.rmtree(stale)
            tmp.mkdir(parents=True)
            try:
                unwrapped.save_pretrained(tmp, is_main_process=True, state_dict=state_dict, max_shard_size="1000GB")
                if tokenizer is not None:
                    tokenizer.save_pretrained(tmp)
                if train_cfg is not None:
                    save_yaml(train_cfg, tmp / TRAIN_CONFIG)
                if extra is not None:
                    write_text_atomic(tmp / "run.json", strict_json(extra), fsync=False)
                _fsync_tree(tmp)
                write_manifest(tmp, int((extra or {}).get("steps", 0) or 0))
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)  # a full disk gets its space back
                raise
            if path.exists():
                os.replace(path, old)
            os.replace(tmp, path)
            _fsync(path.parent)
            shutil.rmtree(old, ignore_errors=True)
        logger.info("saved model to %s", path)
    accelerator.wait_for_everyone()
    return path


def verify_model(path: str | Path) -> list[str]:
    """Problems of a final model directory written by :func:`save_model` (empty: it is whole and loads).

    Its ``MANIFEST.json`` must list every file with its size and sha256, and the weights must open; a directory
    without a manifest (a save that was interrupted, or one written before manifests) counts as incomplete.
    """
    path = Path(path)
    if not path.is_dir():
        return [f"{path}: missing"]
    if not (path / MANIFEST).is_file():
        return [f"{path / MANIFEST}: missing (the save did not finish)"]
    problems = _verify_manifest(path)
    if not problems:
        problems = _check_structure(path, weights_dir=path) + ([] if (path / "config.json").is_file() else
                                                                [f"{path / 'config.json'}: missing"])
    return problems


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
    write_text_atomic(path, text)
    _fsync(path.parent)


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _manifest_files(directory: Path) -> list[str]:
    names = []
    for dirpath, _, files in os.walk(directory):
        for name in files:
            rel = (Path(dirpath) / name).relative_to(directory).as_posix()
            if rel not in (MANIFEST, COMPLETE):
                names.append(rel)
    return sorted(names)


def write_manifest(directory: Path, step: int) -> None:
    """``MANIFEST.json``: size and sha256 of every file under ``directory`` (written atomically)."""
    files = {}
    for rel in _manifest_files(directory):
        f = directory / rel
        files[rel] = {"size": f.stat().st_size, "sha256": file_digest(f)}
    _write_atomic(directory / MANIFEST, json.dumps({"version": 1, "step": step, "files": files}, indent=1) + "\n")


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
        with writing(tmp / "model", "the checkpoint's weights"):
            accelerator.unwrap_model(model).save_pretrained(tmp / "model", state_dict=state_dict,
                                                            max_shard_size="1000GB")
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp / "model")
    del state_dict
    engine = _engine(model)
    if engine is not None:
        with writing(tmp / "deepspeed", "DeepSpeed's checkpoint"):
            engine.save_checkpoint(str(tmp / "deepspeed"), tag="state", save_latest=False)
    elif main:
        with writing(tmp / "optimizer.pt"):
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        if accelerator.scaler is not None:
            with writing(tmp / "scaler.pt"):
                torch.save(accelerator.scaler.state_dict(), tmp / "scaler.pt")
    rng_file = tmp / f"rng-rank{accelerator.process_index:04d}.pt"
    with writing(rng_file):
        torch.save(rng_state(), rng_file)
    accelerator.wait_for_everyone()

    if main:
        state = dict(state, step=step, world_size=accelerator.num_processes)
        write_text_atomic(tmp / STATE, json.dumps(state, indent=2) + "\n", fsync=False)
        _fsync_tree(tmp)
        with writing(tmp / MANIFEST):
            write_manifest(tmp, step)
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


def _check_structure(path: Path, weights_dir: Path | None = None) -> list[str]:
    """A checkpoint without a manifest: every file must parse (state JSON, safetensors, .pt), sizes must agree."""
    from safetensors import safe_open

    problems = []
    weights = sorted((weights_dir or path / "model").glob("*.safetensors"))
    if weights_dir is not None and not weights:
        problems.append(f"{weights_dir}: no .safetensors weights")
    for f in weights:
        try:
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():
                    st.get_tensor(key)
        except Exception as e:  # noqa: BLE001 - reported with the file
            problems.append(f"{f}: unreadable ({type(e).__name__}: {e})")
    for f in sorted(path.glob("*.pt")):
        try:
            safe_load(f)
        except Exception as e:  # noqa: BLE001
            problems.append(f"{f}: unreadable ({type(e).__name__}: {str(e)[:200]})")
    return problems


def _verify_manifest(path: Path) -> list[str]:
    """Every file ``path/MANIFEST.json`` lists exists with its size and sha256."""
    problems = []
    manifest_file = path / MANIFEST
    try:
        files = json.loads(manifest_file.read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"{manifest_file}: unreadable ({type(e).__name__}: {e})"]
    for rel, expected in files.items():
        f = path / rel
        if not f.is_file():
            rank = re.fullmatch(r"rng-rank(\d+)\.pt", rel)
            problems.append(f"{f}: missing" + (f" (the random-generator state of process {int(rank.group(1))})"
                                               if rank else ""))
            continue
        size = f.stat().st_size
        if size != expected["size"]:
            problems.append(f"{f}: {size:,} bytes, the manifest says {expected['size']:,} (truncated or "
                            "overwritten)")
        elif file_digest(f) != expected["sha256"]:
            problems.append(f"{f}: contents differ from the manifest's sha256 (corrupted)")
    return problems


def verify_checkpoint(path: str | Path) -> tuple[list[str], list[str]]:
    """(problems, notes) of checkpoint ``path``: an empty problem list means it can be resumed from.

    With ``MANIFEST.json``: every file listed must exist with its size and sha256. Without (written
    before manifests): :func:`_check_structure`, and a note that the contents are unverified. Both:
    ``trainer_state.json`` must parse, and each process's generator file must be there.
    """
    path = Path(path)
    problems, notes = [], []
    if not (path / COMPLETE).is_file():
        return [f"{path / COMPLETE}: missing (the checkpoint was not finished)"], notes
    state = None
    try:
        state = json.loads((path / STATE).read_text(encoding="utf-8"))
        if not isinstance(state, dict) or not isinstance(state.get("step"), int):
            raise ValueError("no integer 'step'")
    except (OSError, ValueError) as e:
        problems.append(f"{path / STATE}: unreadable ({type(e).__name__}: {e})")
        state = None
    if (path / MANIFEST).is_file():
        problems += _verify_manifest(path)
    else:
        notes.append(f"{path} has no {MANIFEST} (written before manifests): its files were checked to parse, their "
                     "contents cannot be verified")
        problems += _check_structure(path)
    if state is not None:
        for rank in range(int(state.get("world_size", 1))):
            rng_file = path / f"rng-rank{rank:04d}.pt"
            if not rng_file.is_file() and not any(p.startswith(f"{rng_file}: missing") for p in problems):
                problems.append(f"{rng_file}: missing (the random-generator state of process {rank})")
    return problems, notes


def _quarantine(path: Path) -> Path:
    target = path.with_name(path.name + CORRUPT_SUFFIX)
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}{CORRUPT_SUFFIX}{n}")
    os.replace(path, target)
    return target


def select_resume(root: str | Path, quarantine: bool = True, allow_missing_rng: bool = False) -> Path | None:
    """The newest checkpoint under ``root`` that verifies (None if ``root`` holds none at all).

    Newer checkpoints that fail :func:`verify_checkpoint` are skipped with a warning naming the file
    and the problem, and (``quarantine``) renamed ``step-N.corrupt``. If checkpoints exist but none
    verifies, :class:`CheckpointError` lists every problem and nothing is renamed. A checkpoint whose only
    problem is a missing generator file is used when ``allow_missing_rng``.
    """
    root = Path(root)
    candidates = []
    if root.is_dir():
        for p in root.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and p.is_dir():
                candidates.append((int(m.group(1)), p))
    candidates.sort(reverse=True)
    skipped: list[tuple[Path, list[str]]] = []
    for _, path in candidates:
        problems, notes = verify_checkpoint(path)
        if allow_missing_rng:
            problems = [p for p in problems if "random-generator state" not in p]
        if problems:
            skipped.append((path, problems))
            continue
        for note in notes:
            logger.warning("%s", note)
        for bad, bad_problems in skipped:
            moved = _quarantine(bad) if quarantine else bad
            logger.warning("checkpoint %s cannot be resumed from: %s; resuming from the older %s instead%s", bad,
                           "; ".join(bad_problems), path.name, f" ({bad.name} renamed {moved.name})"
                           if moved != bad else "")
        return path
    if skipped:
        listed = " | ".join(f"{p.name}: {'; '.join(probs)}" for p, probs in skipped)
        raise CheckpointError(f"no checkpoint under {root} can be resumed from: {listed}. Repair or remove them, or "
                              "set resume to never to start from scratch")
    return None


@contextlib.contextmanager
def _reading(path: Path, what: str = ""):
    try:
        yield
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised naming the file
        raise CheckpointError(f"checkpoint file {path}{' (' + what + ')' if what else ''} cannot be loaded: "
                              f"{type(e).__name__}: {str(e)[:300]}") from e


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


def load_checkpoint(accelerator, model, optimizer, path: str | Path, allow_missing_rng: bool = False) -> dict:
    """Restore weights, optimizer (and loss scaler) state from ``path``; returns its trainer state.

    The generator states are returned under ``"rng"``, for the caller to apply right before
    training resumes. This process's generator file missing is a :class:`CheckpointError` unless
    ``allow_missing_rng`` (or the checkpoint was written by fewer processes than run now); ``"rng"`` is
    then None. Any file that cannot be read is a :class:`CheckpointError` naming it.
    """
    path = Path(path)
    if not (path / COMPLETE).is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {COMPLETE} file)")
    with _reading(path / STATE):
        state = json.loads((path / STATE).read_text(encoding="utf-8"))
    engine = _engine(model)
    with weights_only_loading():
        if engine is not None:
            if not (path / "deepspeed").is_dir():
                raise FileNotFoundError(f"{path} was written without DeepSpeed; this run uses DeepSpeed")
            with _reading(path / "deepspeed", "DeepSpeed state"):
                loaded, _ = engine.load_checkpoint(str(path / "deepspeed"), tag="state", load_optimizer_states=True,
                                                   load_lr_scheduler_states=False)
            if loaded is None:
                raise CheckpointError(f"DeepSpeed could not load checkpoint {path / 'deepspeed'}")
        else:
            if (path / "deepspeed").is_dir():
                raise FileNotFoundError(f"{path} was written by a DeepSpeed run; resume it with the same DeepSpeed "
                                        "config")
            with _reading(path / "model", "weights"):
                _load_weights(accelerator.unwrap_model(model), path / "model")
            with _reading(path / "optimizer.pt"):
                optimizer.load_state_dict(safe_load(path / "optimizer.pt"))
            scaler_file = path / "scaler.pt"
            if accelerator.scaler is not None:
                if scaler_file.is_file():
                    with _reading(scaler_file):
                        accelerator.scaler.load_state_dict(safe_load(scaler_file))
                else:
                    logger.warning("%s has no loss-scaler state (written without fp16): the scale starts afresh", path)
        rank = accelerator.process_index
        rng_file = path / f"rng-rank{rank:04d}.pt"
        if rng_file.is_file():
            with _reading(rng_file, "random-generator state"):
                state["rng"] = safe_load(rng_file)
        else:
            state["rng"] = None
            written_by = int(state.get("world_size", 1))
            if rank < written_by and not allow_missing_rng:
                raise CheckpointError(f"checkpoint file {rng_file} (process {rank}'s random-generator state) is "
                                      "missing: resuming without it changes dropout and other random draws; set "
                                      "resume_without_rng to resume anyway, or resume from another checkpoint")
            logger.warning("%s: no random-generator state for process %d (%s): its generators are not restored", path,
                           rank, "resume_without_rng" if rank < written_by else
                           f"the checkpoint was written by {written_by} process(es)")
    return state
