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

1. two warm-up steps at the shortest length (optimizer state allocated, kernels compiled);
2. one step at each ``--shard-lengths`` (tokens per GPU; the sequence is that times ``--sp``): peak
   ``max_memory_reserved`` (what the cap limits; largest process, cache emptied before each step)
   against the sequence length, fitted by a line (``max_memory_allocated`` is reported too);
3. the twin check (window vs full attention, same length);
4. the longest length the line allows within ``--memory-gb`` less ``--margin``, rounded down to a
   multiple of 1024 x sp, trained for one step (the verification; OOM on any process is a failure).

Output: one JSON (``--out``) with every step's peaks and seconds, the fit, the prediction and the
verification. ``--cpu``: gloo, a tiny model, no memory figures (a smoke test of the code path).

    python -m torch.distributed.run --nproc_per_node 4 lab/gpu_checks/sp_memory_probe.py --sp 4 --out sp4.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # less fragmentation at the cap
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

import volta_train  # noqa: E402
from volta_train.integrations import hf  # noqa: E402
from volta_train.training import data, distributed, gpt, optim, sequence_parallel, trainer  # noqa: E402

PROBE = "volta_train_probe"
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
    p.add_argument("--shard-lengths", default="16384,32768,65536", help="tokens per GPU of the fitted steps")
    p.add_argument("--twin-shard-length", type=int, default=16384,
                   help="tokens per GPU of the window-vs-full check (0: skip it)")
    p.add_argument("--window", type=int, default=256, help="keys per query in the search steps")
    p.add_argument("--deepspeed", default="zero3", help="DeepSpeed JSON or shorthand (configs/deepspeed/)")
    p.add_argument("--nccl-timeout", type=int, default=180, help="seconds before a stuck collective fails")
    p.add_argument("--vocab", type=int, default=0,
                   help="vocabulary of the model and the random tokens (0: the byte tokenizer's, ~256 words)")
    p.add_argument("--no-chunked-loss", dest="chunked_loss", action="store_false",
                   help="the model's own loss (whole [tokens, vocab] logits) instead of the chunked one")
    p.add_argument("--cpu", action="store_true", help="gloo, tiny shapes, no memory figures: a smoke test")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    args.shard_lengths = sorted(int(x) for x in args.shard_lengths.split(","))
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


def main(argv=None) -> dict:
    args = parse(argv)
    state, cap = start(args)
    rank, world = state.process_index, state.num_processes
    device = torch.device("cpu") if args.cpu else torch.device("cuda", torch.cuda.current_device())
    from accelerate.utils import set_seed

    set_seed(0)
    shape = {"arch": args.arch, "model": args.model}
    if args.cpu:
        shape.update(model="nano", n_layer=2, n_head=4, n_embd=64)
    cfg = gpt.resolve(gpt.GPTTrainConfig(
        **shape, seq_len=args.max_len if args.arch == "gpt2" else 4096, gradient_checkpointing=True,
        deepspeed=args.deepspeed, sequence_parallel_size=args.sp, steps=1, batch_size=1, grad_accum=1, lr=1e-5,
        cpu=args.cpu, mixed_precision="no" if args.cpu else "fp16",
    ), device.type, world)
    gpt.check_sequence_parallel(cfg, world)
    tokenizer = data.ByteTokenizer()
    if args.vocab:  # a vocabulary of that size (the model's embedding and head; tokens drawn from it)
        import types

        tokenizer = types.SimpleNamespace(vocab_size=args.vocab, eos_token_id=tokenizer.eos_token_id,
                                          pad_token_id=getattr(tokenizer, "pad_token_id", None))
    words = args.vocab or 256
    model = gpt.build_model(cfg, tokenizer)
    register_probe()
    model.set_attn_implementation(PROBE)
    parallelism = sequence_parallel.parallelism_config(args.sp, world, model) if args.sp > 1 else None
    setup = distributed.build_accelerator(cpu=args.cpu, mixed_precision=cfg.mixed_precision, grad_accum=1,
                                          batch_size=1, grad_clip=1.0, deepspeed_spec=args.deepspeed,
                                          parallelism_config=parallelism)
    acc = setup.accelerator
    ds_config = acc.state.deepspeed_plugin.deepspeed_config
    factor = sequence_parallel.gradient_factor(ds_config, args.sp)
    optimizer = optim.build_adamw(model, 1e-5, 0.1, (0.9, 0.95))
    n_params = sum(p.numel() for p in model.parameters())
    with sequence_parallel.kv_heads_alias(model.config):
        engine, optimizer = acc.prepare(model, optimizer)
    lay = sequence_parallel.layout(rank, world, args.sp)
    if lay.enabled:
        sequence_parallel.install(PROBE)
    cuda = device.type == "cuda"

    def log(message: str) -> None:
        if rank == 0:
            print(f"[sp_memory_probe sp={args.sp}] {message}", flush=True)

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
        loss = sequence_parallel.sharded_loss(engine, shard, lay.group, factor, chunked=args.chunked_loss)
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if cuda:
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - began
        figures = torch.tensor([
            torch.cuda.max_memory_allocated(device) if cuda else math.nan,
            torch.cuda.max_memory_reserved(device) if cuda else math.nan, seconds,
        ], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(figures, op=torch.distributed.ReduceOp.MAX)
        row = {"length": length, "shard": length // lay.sp, "attention": "full" if left < 0 else f"window {left + 1}",
               "peak_allocated_gib": figures[0].item() / 2**30, "peak_reserved_gib": figures[1].item() / 2**30,
               "seconds": round(figures[2].item(), 3), "loss": round(loss.item(), 4)}
        log(f"{row['attention']:>11} | {length:>9,} tokens ({row['shard']:,} per GPU) | peak allocated "
            f"{row['peak_allocated_gib']:.2f} GiB, reserved {row['peak_reserved_gib']:.2f} GiB | "
            f"{row['seconds']:.1f} s | loss {row['loss']}")
        return row

    window_left = args.window - 1
    log(f"{args.arch} {cfg.model} ({cfg.n_layer} layers, {cfg.n_head} heads, width {cfg.n_embd}): "
        f"{n_params / 1e6:.1f} M parameters, {world} processes, sequence parallel {lay.sp} x data parallel {lay.dp}, "
        f"ZeRO-{ds_config['zero_optimization']['stage']}, {setup.precision}, activation checkpointing, cap "
        f"{args.memory_gb:g} GiB per process" + ("" if cuda else " (CPU smoke: no memory figures)"))
    result = {"sp": lay.sp, "dp": lay.dp, "processes": world, "arch": args.arch, "model": cfg.model,
              "shape": {"n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_embd": cfg.n_embd},
              "parameters": n_params, "memory_gb": args.memory_gb, "margin": args.margin, "window": args.window,
              "vocab": model.config.vocab_size, "chunked_loss": args.chunked_loss,
              "device": torch.cuda.get_device_name(device) if cuda else "cpu", "steps": []}
    first = args.shard_lengths[0] * lay.sp
    for _ in range(2):
        step(first, window_left)
    fitted = [step(s * lay.sp, window_left) for s in args.shard_lengths]
    result["steps"] += fitted
    if args.twin_shard_length:
        twin_len = args.twin_shard_length * lay.sp
        twin = [step(twin_len, window_left), step(twin_len, -1)]
        result["steps"] += twin
        result["twin"] = {"length": twin_len, "window_gib": twin[0]["peak_allocated_gib"],
                          "full_gib": twin[1]["peak_allocated_gib"]}

    xs = [r["length"] for r in fitted]
    ys = [r["peak_reserved_gib"] for r in fitted]  # the cap limits what the allocator reserves
    if cuda and len(xs) >= 2:
        n = len(xs)
        mx, my = sum(xs) / n, sum(ys) / n
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        intercept = my - slope * mx
        worst = max(abs(intercept + slope * x - y) for x, y in zip(xs, ys))
        budget = args.memory_gb * (1.0 - args.margin)
        quantum = 1024 * lay.sp
        predicted = int((budget - intercept) / slope) if slope > 0 else args.max_len
        target = max(quantum, min(args.max_len, predicted) // quantum * quantum)
        result["fit"] = {"intercept_gib": intercept, "kib_per_token": slope * 2**20, "worst_residual_gib": worst,
                         "budget_gib": budget, "predicted_length": predicted}
        log(f"fit: peak reserved = {intercept:.2f} GiB + {slope * 2**20:.1f} KiB x tokens (worst residual "
            f"{worst:.3f} GiB); {budget:.1f} GiB allows {predicted:,} tokens; verifying {target:,}")
    else:
        target = xs[-1] * 2  # CPU smoke: exercise the verification step
    try:
        verified = step(target, window_left)
        result["verified"] = {**verified, "ok": True}
    except torch.OutOfMemoryError as e:  # noqa: F821 - torch >= 2.1
        result["verified"] = {"length": target, "ok": False, "error": str(e).splitlines()[0]}
        log(f"verification at {target:,} tokens ran out of memory: {str(e).splitlines()[0]}")
    result["max_length"] = result["verified"]["length"] if result["verified"]["ok"] else None
    if rank == 0:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    trainer.end_training(acc)  # all processes together (a barrier first)
    return result


if __name__ == "__main__":
    main()
