"""How both recipes spread a run over processes, as one YAML section ``parallel`` (flags ``--parallel.x``).

DeepSpeed ZeRO (stage from a JSON or a shorthand, optimizer/parameter offload) and DeepSpeed-Ulysses sequence
parallelism: their options (:class:`ParallelConfig`), the combinations refused before a run starts (:func:`check`,
and :func:`check_heads` once the model's heads are known), the model built partitioned under ZeRO-3
(:func:`partitioned_build`), and the Accelerator with the process layout (:func:`accelerator`). The machinery lives in
:mod:`.distributed` (Accelerator, DeepSpeed config) and :mod:`.sequence_parallel` (Ulysses, shards, loss).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

from . import distributed, sequence_parallel
from .config import ConfigError, field, section

log = logging.getLogger(__name__)

OFFLOADS = ("optimizer", "all")


@dataclass
class ParallelConfig:
    deepspeed: str | None = field(None, "DeepSpeed JSON (ZeRO), or zero1/zero2/zero3/zero3_offload for "
                                        "configs/deepspeed/<name>.json; also set by an accelerate config with "
                                        "distributed_type DEEPSPEED", unset=True)
    zero_offload: str | None = field(None, "ZeRO offload to host memory: optimizer (its state; ZeRO 1-3), or all "
                                           "(optimizer state and weights; ZeRO-3); unset: as the DeepSpeed JSON says",
                                     choices=list(OFFLOADS), unset=True)
    sequence_parallel_size: int = field(1, "DeepSpeed-Ulysses sequence parallelism: processes that share each "
                                           "sequence (1: off); needs DeepSpeed, must divide the attention heads "
                                           "and the number of processes; sequences are padded to a multiple of it")


def config_section():
    """The `parallel` section as a field of a recipe's configuration (both recipes embed it)."""
    return section(ParallelConfig, "DeepSpeed ZeRO and sequence parallelism")


@dataclass
class Parallelism:
    """What :func:`accelerator` built: accelerate's setup, the sequence-parallel degree, the gradient factor that
    ZeRO-3's reduce-scatter needs under it (:func:`.sequence_parallel.gradient_factor`), and, once :func:`prepare`
    ran, this process's layout and the Ulysses instance behind the attention."""

    setup: Any  # distributed.Setup
    sp: int
    grad_factor: float
    layout: Any = None  # sequence_parallel.Layout
    ulysses: Any = None

    @property
    def replicas(self) -> int:
        """Data-parallel replicas: processes reading different micro-batches."""
        return self.setup.accelerator.num_processes // self.sp

    @property
    def replica(self) -> int:
        return self.setup.accelerator.process_index // self.sp


def uses_deepspeed(p: ParallelConfig) -> bool:
    return bool(p.deepspeed) or distributed.deepspeed_from_env()


def check(p: ParallelConfig, processes: int | None = None) -> None:
    """Refuse what cannot work before anything runs, naming both options and what would be accepted: offload or
    sequence parallelism without DeepSpeed, a degree that does not divide the processes (heads: :func:`check_heads`)."""
    sp = p.sequence_parallel_size
    try:
        sequence_parallel.check_degree(sp, max(sp, 1), max(sp, 1), processes, option="parallel.sequence_parallel_size")
    except sequence_parallel.SequenceParallelError as e:
        raise ConfigError(str(e)) from None
    ds = uses_deepspeed(p)
    if sp > 1 and not ds:
        raise ConfigError(f"parallel.sequence_parallel_size {sp} runs under DeepSpeed-Ulysses, and parallel.deepspeed "
                          "is unset: set parallel.deepspeed (zero1/zero2/zero3/zero3_offload or a JSON file), launch "
                          "with an accelerate config with distributed_type DEEPSPEED, or use "
                          "parallel.sequence_parallel_size 1")
    if p.zero_offload and not ds:
        raise ConfigError(f"parallel.zero_offload {p.zero_offload} is a DeepSpeed ZeRO feature, and "
                          "parallel.deepspeed is unset: set parallel.deepspeed (zero2, or zero3 for zero_offload all), "
                          "launch with a DeepSpeed accelerate config, or leave parallel.zero_offload unset")


def check_heads(p: ParallelConfig, heads: int, kv_heads: int, processes: int | None = None,
                heads_name: str = "num_attention_heads", kv_name: str = "num_key_value_heads") -> None:
    """parallel.sequence_parallel_size against the model's heads (and the processes): a ConfigError naming the
    degrees that would work."""
    try:
        sequence_parallel.check_degree(p.sequence_parallel_size, heads, kv_heads, processes,
                                       option="parallel.sequence_parallel_size", heads_name=heads_name,
                                       kv_name=kv_name)
    except sequence_parallel.SequenceParallelError as e:
        raise ConfigError(str(e)) from None


def zero3_config(p: ParallelConfig, *, mixed_precision: str, grad_accum: int, batch_size: int,
                 grad_clip: float) -> dict | None:
    """The completed DeepSpeed config a ZeRO-3 model is built under, or None when the run is not ZeRO-3."""
    return distributed.zero3_init_config(mixed_precision=mixed_precision, grad_accum=grad_accum,
                                         batch_size=batch_size, grad_clip=grad_clip, deepspeed_spec=p.deepspeed,
                                         zero_offload=p.zero_offload)


@contextlib.contextmanager
def partitioned_build(ds_config: dict | None):
    """Build the model inside this: under ZeRO-3 (``ds_config`` from :func:`zero3_config`) each parameter is
    partitioned as it is created, so that no process ever holds the whole model."""
    with distributed.partitioned_build(ds_config):
        yield


def accelerator(p: ParallelConfig, model, *, cpu: bool, mixed_precision: str, grad_accum: int, batch_size: int,
                grad_clip: float, loss_scale_init: float, loss_scale_window: int) -> Parallelism:
    """The Accelerator (DeepSpeed config completed, Ulysses' groups planned when sequence_parallel_size > 1).
    Call :func:`prepare` next."""
    sp = p.sequence_parallel_size
    try:
        from accelerate import PartialState

        plan = sequence_parallel.parallelism_config(sp, PartialState().num_processes, model) if sp > 1 else None
        setup = distributed.build_accelerator(
            cpu=cpu, mixed_precision=mixed_precision, grad_accum=grad_accum, batch_size=batch_size,
            grad_clip=grad_clip, deepspeed_spec=p.deepspeed, loss_scale_init=loss_scale_init,
            loss_scale_window=loss_scale_window, parallelism_config=plan, zero_offload=p.zero_offload,
        )
        factor = sequence_parallel.gradient_factor(setup.accelerator.state.deepspeed_plugin.deepspeed_config, sp) \
            if sp > 1 else 1.0
    except sequence_parallel.SequenceParallelError as e:
        raise ConfigError(f"parallel.sequence_parallel_size: {e}") from None
    return Parallelism(setup, sp, factor)


def prepare(par: Parallelism, model, optimizer, seq_len: int):
    """``accelerator.prepare`` (Ulysses registered there when sequence-parallel), then this process's layout and,
    under sequence parallelism, the model's attention installed as Ulysses' core (one log line)."""
    acc = par.setup.accelerator
    with sequence_parallel.kv_heads_alias(model.config):  # DeepSpeed reads num_key_value_heads, which GPT-2 lacks
        model, optimizer = acc.prepare(model, optimizer)
    par.layout = sequence_parallel.layout(acc.process_index, acc.num_processes, par.sp)
    if par.layout.enabled:
        par.ulysses = sequence_parallel.install(acc.unwrap_model(model).config._attn_implementation)
        log.info("%s%s", sequence_parallel.describe(par.layout, seq_len),
                 f"; gradients x{par.grad_factor:g} for ZeRO-3's reduce-scatter" if par.grad_factor != 1 else "")
    return model, optimizer
