"""The Accelerator of a recipe: one process, DDP, or DeepSpeed ZeRO 1-3, with fp16 dynamic loss scaling.

Where DeepSpeed comes from, in order:

1. the recipe's ``deepspeed`` option: a JSON file, or a shorthand (``zero1``, ``zero2``,
   ``zero3``, ``zero3_offload``) for ``configs/deepspeed/<name>.json``;
2. an accelerate config with ``distributed_type: DEEPSPEED`` (``accelerate launch
   --config_file configs/accelerate/zero2.yaml``), which sets ``ACCELERATE_USE_DEEPSPEED``.

The JSON's ``"auto"`` values are filled from the recipe (micro-batch size,
gradient accumulation, clipping, fp16 on/off); a number that disagrees with the
recipe is an error naming both, never a silent override. ZeRO-3 runs gather the
full weights when the final model is saved.

DeepSpeed also runs on CPU (gloo), for tests: :func:`init_state` then starts the
process group itself and turns off DeepSpeed's shared-memory all-reduce, a C++
extension compiled at first use (~90 s on two cores), which gloo makes unnecessary.

fp16 on CPU (no DeepSpeed): accelerate has no fp16 there, so :func:`build_accelerator`
installs PyTorch's CPU autocast and ``GradScaler`` itself. It is slow and meant to
exercise the fp16 path (loss scaling, skipped steps, scaler state in checkpoints)
without a GPU.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import ConfigError

logger = logging.getLogger(__name__)

from ..resources import configs_dir, shipped_config


def deepspeed_from_env() -> bool:
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def resolve_deepspeed_spec(spec: str | None) -> Path | None:
    """The JSON file a ``deepspeed`` option names (a path, or a shorthand for configs/deepspeed/<name>.json)."""
    if not spec:
        return None
    path = Path(spec)
    if path.is_file():
        return path
    shipped = shipped_config(f"deepspeed/{spec}.json")
    if shipped is not None:
        return shipped
    try:
        directory = configs_dir() / "deepspeed"
        names = sorted(p.stem for p in directory.glob("*.json"))
    except FileNotFoundError as e:
        raise ConfigError(f"deepspeed {spec!r} is not a file, and the shipped shorthands are missing: {e}") from e
    raise ConfigError(f"deepspeed {spec!r} is neither a file nor one of {', '.join(names)} ({directory})")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_state(cpu: bool, deepspeed_spec: str | None):
    """The process's PartialState, started so that a later DeepSpeed Accelerator finds what it needs."""
    from accelerate import PartialState

    use_ds = bool(deepspeed_spec) or deepspeed_from_env()
    if not use_ds:
        if not cpu and int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available():
            cpu = True  # several processes launched on a machine without a GPU (accelerate launch --multi_gpu): gloo
        return PartialState(cpu=cpu)
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    env_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if env_file != "none" and not Path(env_file).is_file() and shipped_config(env_file) is not None:
        # configs/accelerate/*.yaml name the JSON as configs/deepspeed/<name>.json: find it from anywhere
        os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = str(shipped_config(env_file))
    if "LOCAL_RANK" not in os.environ:  # plain `python recipe.py --deepspeed ...`: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if torch.cuda.is_available():
        if cpu:
            raise ConfigError("cpu is true together with DeepSpeed on a machine with a GPU: DeepSpeed runs on the "
                              "CPU only where there is no GPU")
        return PartialState()
    import deepspeed.ops

    if os.environ.get("VOLTA_TRAIN_DS_SHM_COMM", "0") != "1":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return PartialState(backend="gloo")


@dataclass
class Setup:
    accelerator: object
    deepspeed: bool
    zero_stage: int  # 0 without DeepSpeed
    precision: str  # what runs, in words


def _fill(ds: dict, key: str, value, what: str) -> None:
    current = ds.get(key, "auto")
    if current == "auto":
        ds[key] = value
    elif current != value:
        raise ConfigError(f"the DeepSpeed config has {key}: {current!r} but the recipe's {what} is {value!r}: "
                          "make them agree, or write \"auto\" in the JSON")


def build_accelerator(*, cpu: bool, mixed_precision: str, grad_accum: int, batch_size: int, grad_clip: float,
                      deepspeed_spec: str | None, loss_scale_init: float = 65536.0,
                      loss_scale_window: int = 1000, parallelism_config=None) -> Setup:
    """The Accelerator for a recipe (call :func:`init_state` first); DeepSpeed's config is completed here.

    ``parallelism_config``: Accelerate's ``ParallelismConfig`` for DeepSpeed-Ulysses sequence parallelism
    (:func:`volta_train.training.sequence_parallel.parallelism_config`); DeepSpeed only.
    """
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, GradientAccumulationPlugin, GradScalerKwargs

    plugin = None
    path = resolve_deepspeed_spec(deepspeed_spec)
    if path is not None:
        try:
            ds = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ConfigError(f"DeepSpeed config {path}: not valid JSON ({e})") from None
        ds.setdefault("gradient_accumulation_steps", "auto")
        plugin = DeepSpeedPlugin(hf_ds_config=ds, zero3_init_flag=False)
    use_ds = plugin is not None or deepspeed_from_env()
    if parallelism_config is not None and not use_ds:
        raise ConfigError("sequence parallelism runs under DeepSpeed only: set deepspeed (e.g. zero3) or launch with "
                          "a DeepSpeed accelerate config")
    kwargs = [] if use_ds else [GradScalerKwargs(init_scale=loss_scale_init, growth_interval=loss_scale_window)]
    accelerator = Accelerator(
        cpu=cpu and not use_ds,
        mixed_precision=mixed_precision,
        deepspeed_plugin=plugin,
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=grad_accum, sync_with_dataloader=False),
        kwargs_handlers=kwargs,
        parallelism_config=parallelism_config,
    )
    if use_ds:
        ds_plugin = accelerator.state.deepspeed_plugin
        ds_plugin.zero3_init_flag = False  # the recipe builds the model before prepare(); ZeRO partitions it there
        ds = ds_plugin.deepspeed_config
        _fill(ds, "train_micro_batch_size_per_gpu", batch_size, "batch_size")
        _fill(ds, "gradient_accumulation_steps", grad_accum, "grad_accum")
        _fill(ds, "gradient_clipping", float(grad_clip), "grad_clip")
        zero = ds.setdefault("zero_optimization", {})
        stage = int(zero.get("stage", 0))
        if stage == 3 and zero.get("stage3_gather_16bit_weights_on_model_save", "auto") == "auto":
            zero["stage3_gather_16bit_weights_on_model_save"] = True
        fp16 = ds.get("fp16", {})
        if str(fp16.get("enabled", False)).lower() == "true":
            power = fp16.get("initial_scale_power", 16)
            precision = f"fp16 (DeepSpeed dynamic loss scaling from 2^{power})"
        elif str(ds.get("bf16", {}).get("enabled", False)).lower() == "true":
            precision = "bf16 (DeepSpeed)"
        else:
            precision = "fp32"
        offload = [k for k in ("offload_optimizer", "offload_param")
                   if str(zero.get(k, {}).get("device", "none")) not in ("none", "None")]
        logger.info("DeepSpeed ZeRO stage %d%s, %s", stage, f" ({', '.join(offload)} to CPU)" if offload else "",
                    precision)
        return Setup(accelerator, True, stage, precision)

    if mixed_precision == "fp16" and accelerator.device.type == "cpu":
        # accelerate leaves fp16 off on CPU; PyTorch's CPU autocast + GradScaler run the same loop (slowly)
        logger.warning("mixed_precision fp16 on CPU: PyTorch CPU autocast + GradScaler (slow; for testing the fp16 "
                       "path without a GPU)")
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=loss_scale_init, growth_interval=loss_scale_window)
        accelerator.native_amp = True
    if accelerator.scaler is not None:
        precision = f"fp16 autocast, dynamic loss scaling from {loss_scale_init:g}"
    elif accelerator.mixed_precision == "bf16":
        precision = "bf16 autocast"
    else:
        precision = "fp32"
    return Setup(accelerator, False, 0, precision)


def unwrap_engine(model):
    """The DeepSpeedEngine behind a prepared model, or None."""
    return model if hasattr(model, "save_checkpoint") and hasattr(model, "load_checkpoint") else None


def loss_scale(setup: Setup, model) -> float | None:
    """The current dynamic loss scale (fp16), or None."""
    if setup.deepspeed:
        engine = unwrap_engine(model)
        opt = getattr(engine, "optimizer", None)
        fp16 = engine is not None and engine.fp16_enabled()
        if not fp16 or opt is None:
            return None
        for attr in ("cur_scale", "loss_scale"):
            value = getattr(opt, attr, None)
            if isinstance(value, (int, float, torch.Tensor)):
                return float(value)
        return None
    scaler = setup.accelerator.scaler
    return float(scaler.get_scale()) if scaler is not None else None
