"""The Accelerator of a recipe: one process, DDP, or DeepSpeed ZeRO 1-3, with fp16 dynamic loss scaling.

Where DeepSpeed comes from, in order:

1. the recipe's ``deepspeed`` option: a JSON file, or a shorthand (``zero1``, ``zero2``,
   ``zero3``, ``zero3_offload``) for ``configs/deepspeed/<name>.json``;
2. an accelerate config with ``distributed_type: DEEPSPEED`` (``accelerate launch
   --config_file configs/accelerate/zero2.yaml``), which sets ``ACCELERATE_USE_DEEPSPEED``.

The JSON's ``"auto"`` values are filled from the recipe (micro-batch size,
gradient accumulation, clipping, fp16 on/off); a number that disagrees with the
recipe is an error naming both, never a silent override. Under ZeRO-3 the recipes build
the model partitioned (:func:`partitioned_build`), and gather the full weights when the
final model is saved.

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
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import versions
from .config import ConfigError

logger = logging.getLogger(__name__)

from ..resources import configs_dir, shipped_config


ALLOC_CONF_NAMES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # PyTorch reads either (the second from 2.9)
EXPANDABLE = "expandable_segments:True"


def cuda_allocator_env() -> str:
    """PyTorch's CUDA allocator set to expandable segments (one growing mapping per stream rather than fixed blocks
    that fragment: at long lengths a step ran out of memory with 3.7 GiB reserved but unallocated), unless the user
    set PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF. The allocator reads it once, when CUDA initialises, so the
    recipes call this first; where CUDA is already up the setting is applied to it directly. Returns the log line."""
    for name in ALLOC_CONF_NAMES:
        if name in os.environ:
            return f"CUDA allocator: {name}={os.environ[name]} (your setting, kept)"
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE
    if torch.cuda.is_initialized():
        torch.cuda.memory._set_allocator_settings(EXPANDABLE)
    return (f"CUDA allocator: PYTORCH_CUDA_ALLOC_CONF={EXPANDABLE} (set by the recipe: long sequences fragment fixed "
            "segments; set the variable yourself to choose otherwise)")


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


def _plugin(deepspeed_spec: str | None):
    """accelerate's DeepSpeedPlugin for the recipe's ``deepspeed`` option, or None (DeepSpeed from the environment, or
    none)."""
    from accelerate.utils import DeepSpeedPlugin

    path = resolve_deepspeed_spec(deepspeed_spec)
    if path is None:
        return None
    try:
        ds = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"DeepSpeed config {path}: not valid JSON ({e})") from None
    ds.setdefault("gradient_accumulation_steps", "auto")
    return DeepSpeedPlugin(hf_ds_config=ds, zero3_init_flag=False)


def _complete(ds: dict, batch_size: int, grad_accum: int, grad_clip: float, zero_offload: str | None = None) -> int:
    """Fill the recipe's values into a DeepSpeed config's "auto" entries and apply ``zero_offload`` (optimizer: its
    state in host memory; all: the weights as well, ZeRO-3 only); returns the ZeRO stage."""
    _fill(ds, "train_micro_batch_size_per_gpu", batch_size, "batch_size")
    _fill(ds, "gradient_accumulation_steps", grad_accum, "grad_accum")
    _fill(ds, "gradient_clipping", float(grad_clip), "grad_clip")
    zero = ds.setdefault("zero_optimization", {})
    stage = int(zero.get("stage", 0))
    if zero_offload:
        needed = "3" if zero_offload == "all" else "1-3"
        if stage == 0 or (zero_offload == "all" and stage != 3):
            raise ConfigError(f"parallel.zero_offload {zero_offload} needs ZeRO stage {needed}, and the DeepSpeed "
                              f"config (parallel.deepspeed) has stage {stage}: use parallel.deepspeed "
                              f"{'zero3' if zero_offload == 'all' else 'zero2 or zero3'}, or parallel.zero_offload "
                              f"{'optimizer' if stage else 'unset'}")
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if zero_offload == "all":
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if stage == 3 and zero.get("stage3_gather_16bit_weights_on_model_save", "auto") == "auto":
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    return stage


def zero3_init_config(*, mixed_precision: str, grad_accum: int, batch_size: int, grad_clip: float,
                      deepspeed_spec: str | None, zero_offload: str | None = None) -> dict | None:
    """The completed DeepSpeed config a ZeRO-3 model is built under (:func:`partitioned_build`), or None when the run
    is not ZeRO-3. The entries accelerate fills from the model at prepare() (bucket sizes, persistence threshold) and
    the global batch are left to DeepSpeed's defaults here: building the model reads only the partitioning, the
    offload of the weights and their dtype."""
    if not (deepspeed_spec or deepspeed_from_env()):
        return None
    from accelerate.utils import DeepSpeedPlugin

    plugin = _plugin(deepspeed_spec) or DeepSpeedPlugin(zero3_init_flag=False)
    ds = plugin.deepspeed_config
    if int(ds.get("zero_optimization", {}).get("stage", 0)) != 3:
        return None
    _check_zero3_backend()
    plugin.set_mixed_precision(mixed_precision)
    _complete(ds, batch_size, grad_accum, grad_clip, zero_offload)
    ds = json.loads(json.dumps(ds))
    if ds.get("train_batch_size") == "auto":
        del ds["train_batch_size"]
    zero = ds["zero_optimization"]
    for key in [k for k, v in zero.items() if v == "auto"]:
        del zero[key]
    return ds


def _check_zero3_backend() -> None:
    """ZeRO-3 over several gloo (CPU) processes needs DeepSpeed versions.ZERO3_ON_GLOO: older ones can start from
    garbage weights there. A ConfigError naming what would be accepted."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1 \
            or dist.get_backend() != "gloo":
        return
    installed = versions.installed("deepspeed")
    if installed and versions.older(installed, versions.ZERO3_ON_GLOO):
        raise ConfigError(
            f"parallel.deepspeed: ZeRO-3 over {dist.get_world_size()} CPU (gloo) processes needs DeepSpeed "
            f"{versions.ZERO3_ON_GLOO} or newer; DeepSpeed {installed} gathers partitioned parameters without waiting "
            "for every gloo transfer, so the model can start from garbage weights. Accepted: pip install -U "
            f"'deepspeed>={versions.ZERO3_ON_GLOO}', ZeRO-2 (parallel.deepspeed zero2), or CUDA GPUs (NCCL is not "
            "affected)")


@contextmanager
def partitioned_build(ds_config: dict | None):
    """Build the model inside this under ZeRO-3 (``ds_config`` from :func:`zero3_init_config`; None: a plain build).

    transformers' ``from_config`` / ``from_pretrained`` then create the model inside ``deepspeed.zero.Init``: each
    parameter is partitioned over the processes as its module is created (in host memory with offload_param), its
    initialisation or checkpoint values written on gathered copies by process 0, so that no process holds the whole
    model. Only process 0 draws the initial weights; the random generators of the others are then set to its state,
    as they would be after an unpartitioned build from the same seed.
    """
    if ds_config is None:
        yield
        return
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    hf_config = HfDeepSpeedConfig(ds_config)  # transformers holds only a weak reference to it
    try:
        yield
    finally:
        unset_hf_deepspeed_config()
        del hf_config
    _share_rng_of_rank0()


def _share_rng_of_rank0() -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    states = [torch.get_rng_state()]
    if torch.cuda.is_available():
        states.append(torch.cuda.get_rng_state())
    dist.broadcast_object_list(states, src=0)
    torch.set_rng_state(states[0])
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(states[1])


def check_mixed_precision(precision: str, device: torch.device, option: str) -> None:
    """Refuse bf16 mixed precision on a GPU without bfloat16 arithmetic (V100, sm_70), naming ``option`` and what
    would be accepted (at start, before the model is built or a file written)."""
    if precision != "bf16" or device.type != "cuda":
        return
    if not torch.cuda.is_bf16_supported(including_emulation=False):
        major, minor = torch.cuda.get_device_capability(device)
        raise ConfigError(
            f"{option} bf16: {torch.cuda.get_device_name(device)} (sm_{major}{minor}) has no bfloat16 arithmetic; use "
            f"fp16 (fp32 master weights, dynamic loss scaling; what a bfloat16 model config or checkpoint trains in "
            f"here) or no (fp32)")


def param_numel(p: torch.Tensor) -> int:
    """The number of elements of a parameter, its full count where ZeRO-3 partitioned it."""
    return getattr(p, "ds_numel", None) or p.numel()


def build_accelerator(*, cpu: bool, mixed_precision: str, grad_accum: int, batch_size: int, grad_clip: float,
                      deepspeed_spec: str | None, loss_scale_init: float = 65536.0,
                      loss_scale_window: int = 1000, parallelism_config=None, zero_offload: str | None = None) -> Setup:
    """The Accelerator for a recipe (call :func:`init_state` first); DeepSpeed's config is completed here.

    ``parallelism_config``: Accelerate's ``ParallelismConfig`` for DeepSpeed-Ulysses sequence parallelism
    (:func:`volta_train.training.sequence_parallel.parallelism_config`); DeepSpeed only. ``zero_offload``: see
    :func:`_complete`.
    """
    from accelerate import Accelerator
    from accelerate.utils import GradientAccumulationPlugin, GradScalerKwargs

    plugin = _plugin(deepspeed_spec)
    use_ds = plugin is not None or deepspeed_from_env()
    if parallelism_config is not None and not use_ds:
        raise ConfigError("sequence parallelism runs under DeepSpeed only: set parallel.deepspeed (e.g. zero3) or "
                          "launch with a DeepSpeed accelerate config")
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
        ds_plugin.zero3_init_flag = False  # the recipes build a ZeRO-3 model in partitioned_build, not accelerate
        ds = ds_plugin.deepspeed_config
        stage = _complete(ds, batch_size, grad_accum, grad_clip, zero_offload)
        zero = ds["zero_optimization"]
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
