"""Longest sequence that trains within a per-GPU memory budget, with and without sequence parallelism.

One process per GPU (``torch.distributed.run``), the recipes' own pieces: a GPT of the shape asked
for (default: GPT-2 medium's 24 layers, 16 heads, width 1024, Llama-style so that no position table
grows with the sequence), DeepSpeed ZeRO-3 in fp16, activation checkpointing, and, with ``--sp N``,
DeepSpeed-Ulysses with volta_train's attention as the core (``volta_train.training.sequence_parallel``).
Every process is capped at ``--memory-gb`` with ``torch.cuda.set_per_process_memory_fraction``.

Full causal attention over a million tokens takes hours with the Volta kernel emulated on a Hopper
GPU, while its memory does not depend on how many keys a query sees: the kernel allocates its
output, log-sum-exp, and in the backward dK, dV, the fp32 dQ accumulator and rowsum(dO * O) from
the shapes alone. So the search runs the *same kernel* with a local window (``--window`` keys per
query, causal), which skips the masked key blocks and costs O(length x window), and the run checks
that premise: at ``--twin-shard-length`` it trains one step with the window and one with full causal
attention and reports both peaks.

Steps, all processes together, one micro-batch of one sequence per data-parallel replica:

1. ``--warmup-steps`` (default two) steps at the shortest length (optimizer state allocated, kernels compiled);
2. one step at each ``--shard-lengths`` (tokens per GPU; the sequence is that times ``--sp``): peak
   ``max_memory_reserved`` (what the cap limits; largest process, cache emptied before each step)
   against the sequence length, fitted by a line when there are two or more (``max_memory_allocated`` is
   reported too);
3. the twin check (window vs full attention, same length);
4. the target: the shortest of the line's prediction, the memory model's (``lab/long_context_probe.py``'s
   ``memory_moments`` for this shape, GPU count, ZeRO-3 state and features, with Ulysses' all-to-all buffers),
   the host-memory limit (below) and ``--max-len``, each within ``--memory-gb`` less ``--margin``, rounded down
   to a multiple of 1024 x sp; ``--target`` names it instead;
5. one step at the target (the verification). A step that runs out of memory is followed by one at a length
   ``--backoff`` shorter, up to ``--retries`` times and while ``--time-budget-s`` allows, so the run ends with a
   verified length: the longest step that trained (a fitted one if every retry failed).

A line through short steps alone was optimistic here (its slope misses what grows late); the fitted steps'
default lengths are therefore longer, and the memory model bounds the prediction from an inventory of the
step rather than from the steps' trend.

Llama-3.1-8B (``--shape llama3.1-8b``: 32 layers, width 4096, 32 heads, 8 key/value heads, MLP 14336, 128,256
words) does not fit one GPU in fp32 or fp16 next to anything else, so ``--zero-init`` builds it as the recipes do
under ZeRO-3 (``distributed.partitioned_build``, inside ``deepspeed.zero.Init``): each module's weights are
partitioned over the processes as they are created, in host memory under ``offload_param`` (``--deepspeed
zero3_offload``). With ``offload_optimizer`` the fp32 master
weights, gradients and AdamW moments live in host memory and the step runs on the CPU: torch's AdamW with
``fused=True`` (one pass, no temporaries; ``zero_force_ds_cpu_optimizer: false`` lets DeepSpeed take it) or,
with ``--cpu-optimizer deepspeed``, DeepSpeed's CPU Adam (a C++ extension built on first use: needs a compiler
and ninja). ``--tiled-mlp on``, ``--activation-offload`` turn on the recipes' long-context features. Host memory:
ZeRO's offload keeps ~18 bytes per parameter per process (fp16 weights; fp32 weights, gradients and AdamW
moments), and the activation offload one exact-size page-locked copy of each offloaded layer's checkpointed
input; ``--host-memory-gb`` (default: the machine's) caps the target so that both fit.

Output: one JSON (``--out``, rewritten after every step) with every step's peaks and seconds, the fit, the
predictions, the target and the verification. ``--cpu``: gloo, a tiny model, no memory figures (a smoke test of
the code path; ``--shape`` gives the tiny model its head layout).

    python -m torch.distributed.run --nproc_per_node 4 lab/gpu_checks/sp_memory_probe.py --sp 4 --out sp4.json
    python -m torch.distributed.run --nproc_per_node 2 lab/gpu_checks/sp_memory_probe.py --sp 2 \
        --shape llama3.1-8b --deepspeed zero3_offload --zero-init --tiled-mlp on --activation-offload \
        --warmup-steps 0 --shard-lengths 16384 --twin-shard-length 0 --out llama8b_sp2.json
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import datetime
import gc
import importlib.util
import json
import math
import os
import threading
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # less fragmentation at the cap
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

import volta_train  # noqa: E402
from volta_train.integrations import hf  # noqa: E402
from volta_train.training import (  # noqa: E402
    data, distributed, gpt, memory, optim, parallel, precision, rms_norm, sequence_parallel, tiled_mlp, trainer)

PROBE = "volta_train_probe"
ROOT = Path(__file__).resolve().parents[2]
# Model shapes beyond gpt.PRESETS (Llama-style; vocab: words of the model and the random tokens)
SHAPES = {
    "llama3.1-8b": {"arch": "llama", "n_layer": 32, "n_head": 32, "n_kv_head": 8, "n_embd": 4096,
                    "intermediate_size": 14336, "rope_theta": 500000.0, "vocab": 128256},
}
# --cpu: a tiny model (with --shape: its ratio of heads to key/value heads)
CPU_SHAPE = {"n_layer": 2, "n_head": 4, "n_embd": 64}
CPU_SHAPE_HEADS = 8
_WINDOW = {"left": -1}  # keys before the diagonal each query sees; -1: full causal attention


def probe_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers attention function: causal volta_train attention, optionally within a local window."""
    if attention_mask is not None:
        raise ValueError("the memory probe runs whole rows: attention_mask must be None")
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    out = volta_train.flash_attn_func(q, k, v, softmax_scale=scaling, causal=True, window_size=(_WINDOW["left"], 0))
    return out, None


def register_probe() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PROBE, probe_attention)
    AttentionMaskInterface.register(PROBE, hf.padding_mask)  # None for unpadded rows: no O(n^2) mask


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sp", type=int, default=1, help="sequence_parallel_size (1: none)")
    p.add_argument("--memory-gb", type=float, default=32.0, help="GiB per GPU (set_per_process_memory_fraction)")
    p.add_argument("--margin", type=float, default=0.06, help="share of the budget kept free by the prediction")
    p.add_argument("--arch", default="llama", choices=list(gpt.ARCHS))
    p.add_argument("--model", default="medium", choices=list(gpt.PRESETS))
    p.add_argument("--max-len", type=int, default=4 * 1024 * 1024,
                   help="longest sequence tried (GPT-2: also its n_positions, so keep it small there)")
    p.add_argument("--shape", default=None, choices=list(SHAPES),
                   help="a model shape of its own (overrides --arch, --model and --vocab)")
    p.add_argument("--shard-lengths", default="32768,65536,131072", help="tokens per GPU of the fitted steps")
    p.add_argument("--warmup-steps", type=int, default=2, help="steps at the shortest length before the others")
    p.add_argument("--twin-shard-length", type=int, default=16384,
                   help="tokens per GPU of the window-vs-full check (0: skip it)")
    p.add_argument("--window", type=int, default=256, help="keys per query in the search steps")
    p.add_argument("--deepspeed", default="zero3", help="DeepSpeed JSON or shorthand (configs/deepspeed/)")
    p.add_argument("--nccl-timeout", type=int, default=180, help="seconds before a stuck collective fails")
    p.add_argument("--vocab", type=int, default=0,
                   help="vocabulary of the model and the random tokens (0: the byte tokenizer's, ~256 words)")
    p.add_argument("--no-chunked-loss", dest="chunked_loss", action="store_false",
                   help="the model's own loss (whole [tokens, vocab] logits) instead of the chunked one")
    p.add_argument("--tiled-mlp", default="off", choices=["auto", "on", "off"],
                   help="the recipes' tiled MLP (auto: by the tokens per GPU of the longest fitted step)")
    p.add_argument("--tile-tokens", type=int, default=None,
                   help="tiled MLP: tokens per tile (auto: ~256 MiB of activations; under ZeRO-3 every tile gathers "
                        "the MLP's weights again, so fewer, longer tiles cost less there)")
    p.add_argument("--activation-offload", action="store_true",
                   help="checkpointed hidden states in pinned host memory between forward and backward")
    p.add_argument("--offload-keep", default="0",
                   help="activation offload: the top N blocks keep their inputs on the GPU (host memory for spare "
                        "GPU memory); auto: none in the fitted steps, then the fewest that let the target's host "
                        "memory fit while the GPU (line fit and memory model) has room for them")
    p.add_argument("--zero-init", action="store_true",
                   help="build the model inside deepspeed.zero.Init (partitioned as created; in host memory with "
                        "offload_param): no process ever holds the whole model")
    p.add_argument("--cpu-optimizer", default="fused", choices=["fused", "deepspeed"],
                   help="with offload_optimizer: torch AdamW with fused=True, or DeepSpeed's CPU Adam (JIT-built)")
    p.add_argument("--target", type=int, default=0, help="tokens of the verification step (0: predicted)")
    p.add_argument("--backoff", type=float, default=0.1,
                   help="after a step that runs out of memory, try one this share shorter")
    p.add_argument("--retries", type=int, default=3, help="shorter steps tried after the target fails")
    p.add_argument("--time-budget-s", type=float, default=0.0,
                   help="start no retry that would end past this many seconds after the start (0: no limit)")
    p.add_argument("--host-memory-gb", type=float, default=0.0,
                   help="host memory the processes of this machine may use (0: 92%% of MemTotal)")
    p.add_argument("--cpu", action="store_true", help="gloo, tiny shapes, no memory figures: a smoke test")
    p.add_argument("--cpu-oom-above", type=int, default=0,
                   help="--cpu: steps longer than this raise torch.OutOfMemoryError as their backward starts (tests "
                        "the retries)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    args.shard_lengths = sorted(int(x) for x in args.shard_lengths.split(","))
    if not 0 < args.backoff < 1:
        p.error(f"--backoff must be between 0 and 1 (a share of the length), got {args.backoff}")
    if args.shape:
        args.arch, args.vocab = SHAPES[args.shape]["arch"], SHAPES[args.shape]["vocab"]
    return args


def start(args):
    """The process group (NCCL, or gloo with --cpu) with a short collective timeout, and the memory cap."""
    from accelerate import PartialState

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    timeout = datetime.timedelta(seconds=args.nccl_timeout)
    if args.cpu:
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # as the recipes do on CPU (no C++ build)
        return PartialState(backend="gloo", timeout=timeout), None
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    state = PartialState(timeout=timeout)
    device = torch.device("cuda", local)  # with its index: set_per_process_memory_fraction refuses plain 'cuda'
    total = torch.cuda.get_device_properties(device).total_memory
    cap = int(args.memory_gb * 2**30)
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
    return state, cap


def _simulated_oom(grad):
    raise torch.OutOfMemoryError("simulated out-of-memory error (--cpu-oom-above)")


def _memory_model():
    """lab/long_context_probe.py as a module (its memory model)."""
    spec = importlib.util.spec_from_file_location("long_context_probe", ROOT / "lab" / "long_context_probe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def offloads(ds_config: dict) -> tuple[bool, bool]:
    """(offload_param, offload_optimizer) to the CPU in a DeepSpeed config."""
    zero = ds_config.get("zero_optimization", {})
    return tuple(str(zero.get(k, {}).get("device", "none")) == "cpu" for k in ("offload_param", "offload_optimizer"))


def gpu_state_bytes(stage: int, offload_param: bool, offload_optimizer: bool) -> float:
    """GPU bytes per parameter (before ZeRO-3's division over the processes) at the end of a fp16 DeepSpeed backward:
    16-bit weights (in host memory with offload_param); the 16-bit gradient partition, fp32 master weights and
    AdamW's two moments (all in host memory with offload_optimizer: DeepSpeed's ZeRO-3 puts its gradient buffer on
    the optimizer's device)."""
    if stage != 3:
        raise ValueError(f"the memory model here covers ZeRO-3 only, got stage {stage}")
    return (0.0 if offload_param else 2.0) + (0.0 if offload_optimizer else 14.0)


def model_prediction(config, processes: int, sp: int, ds_config: dict, tiled: bool, offload: bool,
                     budget_gib: float, keep: int = 0, lean_norm: bool = False) -> dict:
    """The memory model's longest sequence for this run within budget_gib per GPU, and the moment that binds
    (``keep``: blocks whose 16-bit checkpointed input stays on the GPU under the offload)."""
    lcp = _memory_model()
    heads = config.num_attention_heads
    shape = lcp.llama_shape(config.num_hidden_layers, config.hidden_size, heads,
                            getattr(config, "num_key_value_heads", None) or heads, config.intermediate_size,
                            config.vocab_size)
    state = gpu_state_bytes(int(ds_config["zero_optimization"]["stage"]), *offloads(ds_config))
    moments = lcp.memory_moments(shape, tiled, offload, gpus=processes, state_bytes_per_parameter=state,
                                 hidden_bytes=2, all_to_all=sp > 1, lean_norm=lean_norm)
    for m in moments.values():
        m["bytes_per_token"] += keep * config.hidden_size * 2
    local = {k: (budget_gib * 2**30 - m["fixed"]) / m["bytes_per_token"] for k, m in moments.items()}
    binding = min(local, key=local.get)
    return {"predicted_length": max(0, int(local[binding] * sp)), "moment": binding,
            "fixed_gib": moments[binding]["fixed"] / 2**30,
            "kib_per_token": moments[binding]["bytes_per_token"] / sp / 1024,
            "state_bytes_per_parameter": state}


def host_bytes(length: int, sp: int, processes: int, parameters: int, layers: int, hidden: int,
               offload_param: bool, offload_optimizer: bool, activation_offload: bool) -> float:
    """Host memory the processes of one machine hold at ``length`` tokens: ZeRO's offloaded share of the model per
    process (fp16 weights 2, fp32 weights, gradients and AdamW moments 16 bytes per parameter; x1.15 for the
    pinned allocator's rounding of each tensor to a power of two), one exact-size fp16 copy of each offloaded
    layer's checkpointed input (the offload's pool), 6 GiB per process for the rest (CUDA context, libraries)."""
    share = parameters / processes
    zero = 1.15 * share * ((2 if offload_param else 0) + (16 if offload_optimizer else 0))
    pinned = layers * pinned_layer_bytes(length, sp, hidden) if activation_offload else 0  # offloaded layers
    return processes * (zero + pinned + 6 * 2**30)


def host_limit(args, quantum: int, limit_bytes: float, **kw) -> int:
    """The longest multiple of ``quantum`` tokens (up to --max-len) whose host_bytes fit in limit_bytes."""
    n = args.max_len // quantum * quantum
    while n > quantum and host_bytes(n, **kw) > limit_bytes:
        n -= quantum
    return n


class HostPeak:
    """The most host memory in use on this machine (MemTotal - MemAvailable) while the block runs, sampled every
    ``period`` seconds by a thread: ZeRO's offload and the activation offload live there, and a machine that runs
    out of it kills a process instead of raising."""

    def __init__(self, period: float = 0.1):
        self.period, self.peak = period, 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def in_use() -> float:
        fields = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                fields[key] = float(value.split()[0]) * 1024
        return fields.get("MemTotal", 0.0) - fields.get("MemAvailable", 0.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.in_use())
            self._stop.wait(self.period)

    def __enter__(self) -> "HostPeak":
        self.peak = self.in_use()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.in_use())


def trim_host_heap() -> None:
    """Return glibc's free heap memory to the system (what the model build and the steps freed), where glibc is."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def pinned_layer_bytes(length: int, sp: int, hidden: int) -> int:
    """One layer's checkpointed fp16 input in page-locked host memory (the offload's pool holds exact sizes)."""
    return math.ceil(length / sp) * hidden * 2


def measured_host_limit(args, quantum: int, limit_bytes: float, measured: dict, sp: int, processes: int,
                        layers: int, hidden: int, activation_offload: bool) -> int:
    """The longest multiple of ``quantum`` tokens whose host memory, extrapolated from a step's measured peak (its
    transient host buffers included) by the activation offload's pinned copies alone (ZeRO's offload does not grow
    with the sequence), stays within limit_bytes."""
    def need(n: int) -> float:
        grow = pinned_layer_bytes(n, sp, hidden) - pinned_layer_bytes(measured["length"], sp, hidden)
        return measured["host_peak_bytes"] + (processes * layers * grow if activation_offload else 0)

    n = args.max_len // quantum * quantum
    while n > quantum and need(n) > limit_bytes:
        n -= quantum
    return n


def longest_with_kept_blocks(lengths, layers: int, host_fits, gpu_fits) -> tuple[int, int] | None:
    """The first of ``lengths`` (longest first) where some number of blocks kept on the GPU fits both, with as many
    kept as the GPU has room for: host memory falls and GPU memory rises with each kept block, and running out of
    host memory kills a process where the GPU's raises an error. Returns (length, blocks kept) or None."""
    for n in lengths:
        k = next((k for k in range(layers - 1, -1, -1) if gpu_fits(n, k)), None)
        if k is not None and host_fits(n, k):
            return n, k
    return None


def mem_total_bytes() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    return math.inf


def build_model(cfg, tokenizer, args):
    """gpt.build_model and the memory section, as the recipe does; with --zero-init the way the recipes build under
    ZeRO-3 (``distributed.partitioned_build``: partitioned as created, in host memory with offload_param, initialised
    on gathered copies)."""
    zero3 = None
    if args.zero_init:
        zero3 = distributed.zero3_init_config(mixed_precision=cfg.precision.mixed_precision,
                                              grad_accum=cfg.grad_accum, batch_size=cfg.batch_size,
                                              grad_clip=cfg.grad_clip, deepspeed_spec=cfg.parallel.deepspeed)
        if zero3 is None:
            raise SystemExit(f"--zero-init needs a ZeRO-3 DeepSpeed config; {args.deepspeed!r} is not one")
    with distributed.partitioned_build(zero3):
        model = gpt.build_model(cfg, tokenizer)
        memory.apply(model, cfg.memory, memory.tokens_per_process(cfg.batch_size, cfg.seq_len,
                                                                  cfg.parallel.sequence_parallel_size))
    return model


def adamw(model, cpu_optimizer: str, offload_optimizer: bool):
    """AdamW over the model's parameters, matrices decayed (by their full shape: ZeRO-3 partitions are flat);
    DeepSpeed's CPU Adam when asked for with offload_optimizer."""
    groups = optim.param_groups(model, 0.1)
    if offload_optimizer and cpu_optimizer == "deepspeed":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=1e-5, betas=(0.9, 0.95), adamw_mode=True)
    return torch.optim.AdamW(groups, lr=1e-5, betas=(0.9, 0.95))


def main(argv=None) -> dict:
    args = parse(argv)
    began_run = time.perf_counter()
    state, cap = start(args)
    rank, world = state.process_index, state.num_processes
    device = torch.device("cpu") if args.cpu else torch.device("cuda", torch.cuda.current_device())
    from accelerate.utils import set_seed

    set_seed(0)
    shape = {"arch": args.arch, "model": args.model}
    if args.shape:
        shape.update({k: v for k, v in SHAPES[args.shape].items() if k not in ("arch", "vocab")}, model=None)
    if args.cpu:
        kv = shape.get("n_kv_head")
        shape.update(model="nano", **CPU_SHAPE)
        if kv:  # the shape's grouping of query heads per key/value head
            shape.update(n_head=CPU_SHAPE_HEADS, n_kv_head=CPU_SHAPE_HEADS * kv // SHAPES[args.shape]["n_head"],
                         intermediate_size=96)
    cfg = gpt.resolve(gpt.GPTTrainConfig(
        **shape, seq_len=args.max_len if args.arch == "gpt2" else 4096, steps=1, batch_size=1, grad_accum=1, lr=1e-5,
        cpu=args.cpu,
        memory=memory.MemoryConfig(gradient_checkpointing=True, tiled_mlp=args.tiled_mlp,
                                   tiled_mlp_tokens=64 if args.cpu and args.tiled_mlp != "off" else args.tile_tokens,
                                   activation_offload=args.activation_offload),
        parallel=parallel.ParallelConfig(deepspeed=args.deepspeed, sequence_parallel_size=args.sp),
        precision=precision.PrecisionConfig(mixed_precision="no" if args.cpu else "fp16"),
    ), device.type, world)
    if args.tiled_mlp == "auto":  # the recipes' rule at the longest fitted step (cfg.seq_len is the probe's 4096)
        cfg.seq_len = args.shard_lengths[-1] * args.sp
    gpt.check_sequence_parallel(cfg, world)
    tokenizer = data.ByteTokenizer()
    if args.vocab or args.zero_init:  # a vocabulary of that size (the model's embedding and head; tokens drawn
        # from it); under zero.Init no padding row (transformers zeroes it by indexing the weight, empty there)
        import types

        tokenizer = types.SimpleNamespace(vocab_size=args.vocab or tokenizer.vocab_size,
                                          eos_token_id=tokenizer.eos_token_id,
                                          pad_token_id=None if args.zero_init else getattr(tokenizer, "pad_token_id",
                                                                                           None))
    words = args.vocab or 256
    ds_file = distributed.resolve_deepspeed_spec(args.deepspeed)
    ds_json = json.loads(ds_file.read_text()) if ds_file else {}
    offload_param, offload_optimizer = offloads(ds_json)
    if args.activation_offload and args.cpu:
        from volta_train.training import activation_offload

        activation_offload.MIN_BYTES = 1  # the tiny model's hidden states are below the GPU threshold
    model = build_model(cfg, tokenizer, args)
    keep_auto = args.offload_keep == "auto"
    try:
        keep = 0 if keep_auto else int(args.offload_keep)
    except ValueError:
        raise SystemExit(f"--offload-keep takes a block count or auto, got {args.offload_keep!r}") from None

    def set_keep(n: int) -> None:
        from volta_train.training import activation_offload

        activation_offload.enable(model, min_bytes=1 if args.cpu else None, keep_last=n)

    if args.activation_offload and keep:
        set_keep(keep)
    register_probe()
    model.set_attn_implementation(PROBE)
    parallelism = sequence_parallel.parallelism_config(args.sp, world, model) if args.sp > 1 else None
    setup = distributed.build_accelerator(cpu=args.cpu, mixed_precision=cfg.precision.mixed_precision, grad_accum=1,
                                          batch_size=1, grad_clip=1.0, deepspeed_spec=args.deepspeed,
                                          parallelism_config=parallelism)
    acc = setup.accelerator
    ds_config = acc.state.deepspeed_plugin.deepspeed_config
    factor = sequence_parallel.gradient_factor(ds_config, args.sp)
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    base_optimizer = adamw(model, args.cpu_optimizer, offload_optimizer)
    with sequence_parallel.kv_heads_alias(model.config):
        engine, optimizer = acc.prepare(model, base_optimizer)
    if offload_optimizer and isinstance(base_optimizer, torch.optim.AdamW):
        for group in base_optimizer.param_groups:  # one pass over DeepSpeed's flat fp32 partitions on the CPU
            group.update(fused=True, foreach=False)
    lay = sequence_parallel.layout(rank, world, args.sp)
    if lay.enabled:
        sequence_parallel.install(PROBE)
    cuda = device.type == "cuda"
    tiled_on = any(hasattr(m, tiled_mlp._ATTR) for m in model.modules())
    lean_on = any(hasattr(m, rms_norm._ATTR) for m in model.modules())

    def log(message: str) -> None:
        if rank == 0:
            print(f"[sp_memory_probe sp={args.sp}] {message}", flush=True)

    def agreed(value: float, op=torch.distributed.ReduceOp.MAX) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(t, op=op)
        return t.item()

    def recover() -> None:
        """After an out-of-memory error: gathered ZeRO-3 weights released, gradients dropped, caches emptied."""
        try:
            optimizer.zero_grad()
        except Exception as e:  # noqa: BLE001 - reported, the next step tells whether the engine still works
            log(f"zero_grad after out-of-memory: {type(e).__name__}: {e}")
        if hasattr(engine, "empty_partition_cache"):
            engine.empty_partition_cache()
        gc.collect()
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()

    def step(length: int, left: int) -> dict:
        _WINDOW["left"] = left
        gen = torch.Generator().manual_seed(length + 7 * lay.dp_rank)
        batch = {"input_ids": torch.randint(0, words, (1, length), generator=gen)}
        shard = {k: v.to(device) for k, v in sequence_parallel.shard_batch(batch, lay.sp, lay.sp_rank).items()}
        if cuda:  # cached blocks of earlier, longer steps would otherwise count as this step's reserved memory
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        began = time.perf_counter()
        error, loss_value, phases = None, math.nan, []
        skipped_before = getattr(engine, "skipped_steps", 0)
        with HostPeak() as host:
            try:
                loss = sequence_parallel.sharded_loss(engine, shard, lay.group, factor, chunked=args.chunked_loss)
                phases = [HostPeak.in_use()]
                if args.cpu and args.cpu_oom_above and length > args.cpu_oom_above:
                    loss.register_hook(_simulated_oom)
                acc.backward(loss)
                phases.append(HostPeak.in_use())
                optimizer.step()
                phases.append(HostPeak.in_use())
                optimizer.zero_grad()
                loss_value = loss.item()
                del loss
                if cuda:
                    torch.cuda.synchronize(device)
            except torch.OutOfMemoryError as e:  # noqa: F821 - torch >= 2.1
                error = str(e).splitlines()[0]
            seconds = time.perf_counter() - began
        if cuda:
            trim_host_heap()
        if error is not None:
            recover()
        figures = torch.tensor([
            torch.cuda.max_memory_allocated(device) if cuda else math.nan,
            torch.cuda.max_memory_reserved(device) if cuda else math.nan, seconds, float(error is not None),
            host.peak,
        ], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(figures, op=torch.distributed.ReduceOp.MAX)
        row = {"length": length, "shard": length // lay.sp, "attention": "full" if left < 0 else f"window {left + 1}",
               "ok": figures[3].item() == 0, "peak_allocated_gib": figures[0].item() / 2**30,
               "peak_reserved_gib": figures[1].item() / 2**30, "seconds": round(figures[2].item(), 3),
               "loss": round(loss_value, 4), "host_peak_gib": figures[4].item() / 2**30}
        row["host_after_forward_backward_step_gib"] = [round(h / 2**30, 2) for h in phases]  # this machine's
        if cuda:  # this process's share: its resident memory and the pinned allocator's blocks (rank 0's)
            import psutil  # DeepSpeed's dependency

            row["rank0_rss_gib"] = psutil.Process().memory_info().rss / 2**30
            row["rank0_pinned_gib"] = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) / 2**30
        if error is None and getattr(engine, "skipped_steps", 0) != skipped_before:
            row["skipped_step"] = True  # fp16 overflow: DeepSpeed skipped the optimizer step
        if error is not None:
            row["error"] = error
        result["steps"].append(row)
        log(f"{row['attention']:>11} | {length:>9,} tokens ({row['shard']:,} per GPU) | "
            + (f"peak allocated {row['peak_allocated_gib']:.2f} GiB, reserved {row['peak_reserved_gib']:.2f} GiB"
               if row["ok"] else "OUT OF MEMORY" + (f" ({error})" if error else " (another process)"))
            + f" | host {row['host_peak_gib']:.1f} GiB"
            + (f" (rank 0: resident {row['rank0_rss_gib']:.1f}, pinned {row['rank0_pinned_gib']:.1f})" if cuda else "")
            + " (after forward, backward, step: " + ", ".join(f"{h:.1f}" for h in
                                                            row["host_after_forward_backward_step_gib"]) + ")"
            + f" | {row['seconds']:.1f} s | loss {row['loss']}"
            + (" | optimizer step SKIPPED (fp16 overflow)" if row.get("skipped_step") else ""))
        save()
        return row

    def save() -> None:
        if rank == 0:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")

    window_left = args.window - 1
    kv_heads = getattr(model.config, "num_key_value_heads", cfg.n_head)
    mlp = getattr(model.config, "intermediate_size", None) or 4 * cfg.n_embd
    log(f"{args.arch} {args.shape or cfg.model} ({cfg.n_layer} layers, {cfg.n_head} heads, {kv_heads} key/value "
        f"heads, width {cfg.n_embd}, MLP {mlp}, {model.config.vocab_size} words): {n_params / 1e6:.1f} M parameters, "
        f"{world} processes, sequence parallel {lay.sp} x data parallel {lay.dp}, "
        f"ZeRO-{ds_config['zero_optimization']['stage']}"
        + "".join(f", {k} to CPU" for k, on in (("offload_param", offload_param), ("offload_optimizer",
                                                                                   offload_optimizer)) if on)
        + (f" ({type(base_optimizer).__name__}{' fused' if isinstance(base_optimizer, torch.optim.AdamW) else ''} "
           "on the CPU)" if offload_optimizer else "")
        + f", {setup.precision}, activation checkpointing"
        + (", tiled MLP" if tiled_on else "") + (", lean RMSNorm" if lean_on else "")
        + (", activation offload" if args.activation_offload else "")
        + (", zero.Init" if args.zero_init else "") + f", cap {args.memory_gb:g} GiB per process"
        + ("" if cuda else " (CPU smoke: no memory figures)") + f"; set up in {time.perf_counter() - began_run:.0f} s")
    result = {"sp": lay.sp, "dp": lay.dp, "processes": world, "arch": args.arch, "model": args.shape or cfg.model,
              "shape": {"n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_embd": cfg.n_embd,
                        "n_kv_head": getattr(model.config, "num_key_value_heads", cfg.n_head),
                        "intermediate": getattr(model.config, "intermediate_size", None)},
              "parameters": n_params, "memory_gb": args.memory_gb, "margin": args.margin, "window": args.window,
              "vocab": model.config.vocab_size, "chunked_loss": args.chunked_loss, "tiled_mlp": tiled_on,
              "lean_norm": lean_on,
              "activation_offload": args.activation_offload, "zero_init": args.zero_init,
              "offload_param": offload_param, "offload_optimizer": offload_optimizer,
              "cpu_optimizer": type(base_optimizer).__name__ if offload_optimizer else None,
              "setup_seconds": round(time.perf_counter() - began_run, 1),
              "device": torch.cuda.get_device_name(device) if cuda else "cpu", "steps": []}
    if cuda:
        before = HostPeak.in_use()
        trim_host_heap()
        log(f"host memory after set-up: {before / 2**30:.1f} GiB in use, {HostPeak.in_use() / 2**30:.1f} after "
            "malloc_trim")
    first = args.shard_lengths[0] * lay.sp
    for _ in range(args.warmup_steps):
        step(first, window_left)
    result["fitted_steps"] = len(args.shard_lengths)
    fitted = [step(s * lay.sp, window_left) for s in args.shard_lengths]
    fitted = [r for r in fitted if r["ok"]]
    if args.twin_shard_length:
        twin_len = args.twin_shard_length * lay.sp
        twin = [step(twin_len, window_left), step(twin_len, -1)]
        result["twin"] = {"length": twin_len, "window_gib": twin[0]["peak_allocated_gib"],
                          "full_gib": twin[1]["peak_allocated_gib"]}

    quantum = (1024 if cuda else 16) * lay.sp
    budget = args.memory_gb * (1.0 - args.margin)
    candidates = {"max_len": args.max_len}
    xs = [r["length"] for r in fitted]
    ys = [r["peak_reserved_gib"] for r in fitted]  # the cap limits what the allocator reserves
    if cuda and len(xs) >= 2:
        n = len(xs)
        mx, my = sum(xs) / n, sum(ys) / n
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        intercept = my - slope * mx
        worst = max(abs(intercept + slope * x - y) for x, y in zip(xs, ys))
        predicted = int((budget - intercept) / slope) if slope > 0 else args.max_len
        candidates["fit"] = predicted
        result["fit"] = {"intercept_gib": intercept, "kib_per_token": slope * 2**20, "worst_residual_gib": worst,
                         "budget_gib": budget, "predicted_length": predicted}
        log(f"fit: peak reserved = {intercept:.2f} GiB + {slope * 2**20:.1f} KiB x tokens (worst residual "
            f"{worst:.3f} GiB); {budget:.1f} GiB allows {predicted:,} tokens")
    if args.arch == "llama" and ds_config["zero_optimization"].get("stage") == 3:
        m = model_prediction(model.config, world, lay.sp, ds_config, tiled_on, args.activation_offload, budget,
                             keep=keep if args.activation_offload else 0, lean_norm=lean_on)
        result["memory_model"] = m
        if cuda:
            candidates["model"] = m["predicted_length"]
        log(f"memory model: {m['fixed_gib']:.2f} GiB + {m['kib_per_token']:.1f} KiB x tokens at {m['moment']}; "
            f"{budget:.1f} GiB allows {m['predicted_length']:,} tokens")
    limit = args.host_memory_gb * 2**30 if args.host_memory_gb else 0.92 * mem_total_bytes()
    host_kw = dict(sp=lay.sp, processes=world, parameters=n_params, layers=cfg.n_layer - keep,
                   hidden=cfg.n_embd,
                   offload_param=offload_param, offload_optimizer=offload_optimizer,
                   activation_offload=args.activation_offload and cuda)
    candidates["host"] = host_limit(args, quantum, limit, **host_kw)
    result["host"] = {"limit_gib": limit / 2**30, "longest_fitting": candidates["host"],
                      "formula_gib_at_longest_fitted": host_bytes(xs[-1], **host_kw) / 2**30 if xs else None}
    anchor = max(fitted, key=lambda r: r["length"]) if fitted and cuda else None
    # a measured peak beats the formula (whose 92% leaves room for what it does not count): extrapolate it by the
    # offload's pinned copies within 95% of the machine's memory
    measured_limit = args.host_memory_gb * 2**30 if args.host_memory_gb else 0.95 * mem_total_bytes()
    if anchor is not None:
        measured = {"length": anchor["length"], "host_peak_bytes": anchor["host_peak_gib"] * 2**30}
        host_growth = dict(sp=lay.sp, processes=world, layers=cfg.n_layer - keep, hidden=cfg.n_embd,
                           activation_offload=args.activation_offload)
        candidates["host"] = measured_host_limit(args, quantum, measured_limit, measured, **host_growth)
        result["host"].update(longest_fitting=candidates["host"], measured_at=anchor["length"],
                              measured_peak_gib=anchor["host_peak_gib"], limit_gib=measured_limit / 2**30)
        log(f"host memory: {anchor['host_peak_gib']:.1f} GiB in use at {anchor['length']:,} tokens (the formula "
            f"says {result['host']['formula_gib_at_longest_fitted']:.1f}); within {measured_limit / 2**30:.0f} GiB "
            f"that allows {candidates['host']:,} tokens")
    def host_at(n: int, kept: int = keep) -> float:
        if anchor is None:
            return host_bytes(n, **host_kw)
        if not args.activation_offload:
            return anchor["host_peak_gib"] * 2**30
        layer = functools.partial(pinned_layer_bytes, sp=lay.sp, hidden=cfg.n_embd)
        return (anchor["host_peak_gib"] * 2**30 + world * (cfg.n_layer - kept) * layer(n)
                - world * (cfg.n_layer - keep) * layer(anchor["length"]))

    def gpu_room(n: int, kept: int) -> bool:
        """Whether the line fit and the memory model both leave room at n tokens for `kept` more blocks' inputs."""
        extra = (kept - keep) * pinned_layer_bytes(n, lay.sp, cfg.n_embd)
        if "fit" in result and (result["fit"]["intercept_gib"] + result["fit"]["kib_per_token"] * n / 2**20) * 2**30 \
                + extra > budget * 2**30:
            return False
        m = result.get("memory_model")
        return m is None or (m["fixed_gib"] * 2**30 + m["kib_per_token"] * 1024 * n + extra <= budget * 2**30)

    chosen_keep = keep
    if keep_auto and args.activation_offload and anchor is not None:
        # the longest length (GPU-bound candidates first) where some number of kept blocks fits host and GPU
        gpu_bound = min(v for k, v in candidates.items() if k != "host")
        lengths = [args.target] if args.target else range(gpu_bound // quantum * quantum, quantum - 1, -quantum)
        found = longest_with_kept_blocks(lengths, cfg.n_layer, lambda n, k: host_at(n, k) <= measured_limit,
                                         gpu_room)
        if found is not None:
            candidates["host"], chosen_keep = found
        log(f"offload keep auto: {chosen_keep} blocks on the GPU allow {candidates['host']:,} tokens within host "
            f"and GPU memory")
    result["offload_keep"] = chosen_keep

    if args.target:
        target, bound = args.target, "--target"
    elif cuda:
        bound = min(candidates, key=candidates.get)
        target = max(quantum, candidates[bound] // quantum * quantum)
    else:  # CPU smoke: exercise the verification step
        target, bound = xs[-1] * 2 if xs else first * 2, "cpu smoke"
    if chosen_keep != keep:
        set_keep(chosen_keep)
    result["prediction"] = {"candidates": candidates, "bound_by": bound, "target": target,
                            "offload_keep": chosen_keep, "host_gib_at_target": host_at(target, chosen_keep) / 2**30}
    log(f"target {target:,} tokens (bound by {bound}; candidates "
        + ", ".join(f"{k} {v:,}" for k, v in candidates.items()) + f"); host memory at it "
        f"~{result['prediction']['host_gib_at_target']:.0f} of {limit / 2**30:.0f} GiB")
    save()  # the target is known before its step: a process killed in it (host memory) leaves it for a relaunch

    tries = []
    length = target
    for attempt in range(args.retries + 1):
        row = step(length, window_left)
        tries.append(row)
        if row["ok"]:
            break
        shorter = int(length * (1.0 - args.backoff)) // quantum * quantum
        best = max((r["length"] for r in result["steps"] if r["ok"] and r["attention"] != "full"), default=0)
        elapsed = agreed(time.perf_counter() - began_run)
        # a shorter step takes about as long as the failed one (which ran out of memory at some point of its step)
        need = max(r["seconds"] for r in tries) * 1.2
        if shorter <= best or attempt == args.retries:
            break
        if args.time_budget_s and elapsed + need > args.time_budget_s:
            log(f"no retry at {shorter:,} tokens: {elapsed:.0f} s spent, ~{need:.0f} s more exceeds "
                f"--time-budget-s {args.time_budget_s:g}")
            result["stopped_by_time"] = True
            break
        length = shorter
    result["verified"] = {**tries[-1]}
    trained = [r for r in result["steps"] if r["ok"] and r["attention"] != "full"]
    result["max_length"] = max((r["length"] for r in trained), default=None)
    at = next((r for r in trained if r["length"] == result["max_length"]), None)
    log(f"longest trained: {result['max_length']:,} tokens"
        + (f" ({at['peak_reserved_gib']:.2f} GiB reserved, {at['seconds']:.1f} s)" if at and cuda else "")
        + f"; target {target:,} " + ("trained" if tries[0]["ok"] else "ran out of memory")
        if result["max_length"] else "nothing trained")
    steps = [float(st["step"]) for st in base_optimizer.state.values() if "step" in st]
    result["optimizer_steps"] = max(steps, default=0.0)  # AdamW steps taken (skipped fp16 steps do not count)
    result["seconds"] = round(time.perf_counter() - began_run, 1)
    save()
    trainer.end_training(acc)  # all processes together (a barrier first)
    return result


if __name__ == "__main__":
    main()
