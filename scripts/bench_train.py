"""End-to-end training-step benchmark: tokens/s and peak memory of GPT-2 small/medium, patched vs eager vs sdpa.

    python scripts/bench_train.py                                  # GPU: small+medium, 1k-32k, all attentions
    python scripts/bench_train.py --models small --seq-lens 4096,16384 --attention volta_train,sdpa
    python scripts/bench_train.py --memory-gb 32                   # also: longest trainable sequence in 32 GB
    python scripts/bench_train.py --smoke                          # CPU, tiny model, seconds (the test runs this)

One measurement = a full training step as the recipe runs it: fp16 autocast forward and
backward with dynamic loss scaling (GradScaler), gradient clipping and an AdamW step, on a
randomly initialised GPT-2 whose n_positions is the sequence length (fp32 on CPU). Sequences
per step: ``--tokens-per-step`` / seq_len (at least 1). ``--warmup`` steps, then ``--steps`` timed
steps; tokens/s = timed tokens / wall time (CUDA synchronised); peak memory =
``torch.cuda.max_memory_allocated`` over the timed steps (peak RSS on CPU). Out of memory is
recorded as such, not as an error.

``--memory-gb G`` caps this process's CUDA memory at G GiB with
``torch.cuda.set_per_process_memory_fraction`` (a 32 GB V100 on a larger GPU) for every
measurement, and searches the longest sequence (batch 1) that trains one full step within the
cap: doubling from 1024, then bisection to ``--search-granularity`` tokens. ``--gradient-checkpointing``
applies to everything. Attention implementations: ``volta_train`` (``volta_train.patch``; on a
V100 the Volta kernel, on sm_80+ the same kernel emulated: check memory there, not speed),
``sdpa`` (PyTorch; on a V100 its memory-efficient kernel) and ``eager`` (materialised scores).

Writes ``<out>/bench_train.json`` (every run), ``bench_train.md`` (tables) and ``bench_train.png``
(tokens/s and peak memory against sequence length; needs matplotlib).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from volta_train.training import metrics  # noqa: E402
from volta_train.training.gpt import PRESETS  # noqa: E402

ATTENTIONS = ("volta_train", "sdpa", "eager")
VOCAB = 50304  # GPT-2's vocabulary rounded to a multiple of 64: the LM head costs what it does in practice


def build(model_name: str, seq_len: int, attention: str, device: torch.device, checkpointing: bool, vocab: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    shape = PRESETS[model_name]
    config = GPT2Config(vocab_size=vocab, n_positions=seq_len, activation_function="gelu_pytorch_tanh",
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, **shape)
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"
    if attention == "volta_train":
        import volta_train

        volta_train.patch(model)
    else:
        model.set_attn_implementation(attention)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.to(device)


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


def _cleanup(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def train_steps(model_name: str, seq_len: int, attention: str, batch: int, steps: int, warmup: int,
                device: torch.device, checkpointing: bool, vocab: int) -> dict:
    """Run warmup + timed training steps; a dict with tokens/s, peak memory and status ('ok' or 'oom')."""
    fp16 = device.type == "cuda"
    result = {"model": model_name, "attention": attention, "seq_len": seq_len, "batch": batch, "status": "ok"}
    model = optimizer = scaler = None
    try:
        torch.manual_seed(0)
        model = build(model_name, seq_len, attention, device, checkpointing, vocab)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fp16)
        scaler = torch.amp.GradScaler(device.type, enabled=fp16)
        ids = torch.randint(0, min(vocab, 50257), (batch, seq_len), device=device)

        def step():
            with torch.autocast(device.type, dtype=torch.float16, enabled=fp16):
                loss = model(input_ids=ids, labels=ids).loss
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            return loss

        for _ in range(warmup):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        for _ in range(steps):
            loss = step()
        loss = float(loss)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        mem, _ = metrics.peak_memory(device)
        n_params = sum(p.numel() for p in model.parameters())
        counter = metrics.FlopCounter(metrics.matmul_parameters(model), model.config.n_layer, model.config.n_embd)
        _, flops = counter({"input_ids": ids[:, :1].expand(batch, seq_len)})
        result.update(tokens_per_s=batch * seq_len * steps / seconds, step_s=seconds / steps, peak_mem_gib=mem / 2**30,
                      loss=loss, parameters=n_params, tflops=flops * steps / seconds / 1e12)
    except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
        if not _is_oom(e):
            raise
        result.update(status="oom")
    finally:
        del model, optimizer, scaler
        _cleanup(device)
    return result


def max_seq_len(model_name: str, attention: str, device: torch.device, checkpointing: bool, vocab: int,
                start: int, cap: int, granularity: int, log) -> dict:
    """Longest sequence (batch 1) that completes one training step within the memory cap."""
    def fits(n: int) -> bool:
        # one step, no warmup: the first step already holds everything (AdamW allocates its state there)
        r = train_steps(model_name, n, attention, 1, 1, 0, device, checkpointing, vocab)
        log(f"  max-len search {model_name}/{attention}: {n:>7} tokens -> {r['status']}"
            + (f" ({r['peak_mem_gib']:.2f} GiB)" if r["status"] == "ok" else ""))
        return r["status"] == "ok"

    good, bad, n = 0, None, start
    while n <= cap:
        if fits(n):
            good, n = n, n * 2
        else:
            bad = n
            break
    if bad is None:
        return {"model": model_name, "attention": attention, "max_seq_len": good, "limited_by": "cap"}
    while bad - good > granularity:
        mid = (good + bad) // 2 // granularity * granularity
        if mid <= good:
            break
        if fits(mid):
            good = mid
        else:
            bad = mid
    return {"model": model_name, "attention": attention, "max_seq_len": good, "limited_by": "memory"}


def table(runs: list[dict], searches: list[dict], args, device_name: str) -> str:
    lines = [f"# bench_train: {device_name}", "",
             f"{'fp16 autocast + GradScaler' if 'CPU' not in device_name else 'fp32'} + AdamW step, "
             f"{args.tokens_per_step} tokens per step (batch = tokens / seq_len), {args.steps} timed steps after "
             f"{args.warmup}; " + (f"memory cap {args.memory_gb:g} GiB" if args.memory_gb else "no memory cap")
             + ("; gradient checkpointing" if args.gradient_checkpointing else ""), ""]
    for model in dict.fromkeys(r["model"] for r in runs):
        lines += [f"## {model}", "", "| seq_len | batch | " + " | ".join(
            f"{a} tok/s | {a} peak GiB" for a in args.attention) + " |",
            "| --- | --- | " + " | ".join("--- | ---" for _ in args.attention) + " |"]
        for n in dict.fromkeys(r["seq_len"] for r in runs if r["model"] == model):
            cells, batch = [], ""
            for a in args.attention:
                r = next((r for r in runs if r["model"] == model and r["seq_len"] == n and r["attention"] == a), None)
                if r is None:
                    cells += ["", ""]
                elif r["status"] != "ok":
                    cells += [r["status"], r["status"]]
                else:
                    batch = r["batch"]
                    cells += [f"{r['tokens_per_s']:,.0f}", f"{r['peak_mem_gib']:.2f}"]
            lines.append(f"| {n} | {batch} | " + " | ".join(cells) + " |")
        lines.append("")
    if searches:
        lines += ["## longest trainable sequence (batch 1, one full step)", "", "| model | attention | max seq_len |",
                  "| --- | --- | --- |"]
        lines += [f"| {s['model']} | {s['attention']} | {s['max_seq_len']}"
                  f"{' (search cap)' if s['limited_by'] == 'cap' else ''} |" for s in searches]
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    models = list(dict.fromkeys(r["model"] for r in runs))
    fig, axes = plt.subplots(2, len(models), figsize=(6 * len(models), 8), squeeze=False)
    for col, model in enumerate(models):
        for attention in dict.fromkeys(r["attention"] for r in runs):
            ok = [r for r in runs if r["model"] == model and r["attention"] == attention and r["status"] == "ok"]
            if not ok:
                continue
            x = [r["seq_len"] for r in ok]
            axes[0][col].plot(x, [r["tokens_per_s"] for r in ok], marker="o", label=attention)
            axes[1][col].plot(x, [r["peak_mem_gib"] for r in ok], marker="o", label=attention)
        for row, ylabel in enumerate(("tokens/s", "peak memory (GiB)")):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            ax.set_xlabel("sequence length")
            ax.set_ylabel(ylabel)
            ax.set_title(f"GPT-2 {model}")
            ax.grid(True, alpha=0.3)
            ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="small,medium", help="GPT-2 presets (default: small,medium)")
    parser.add_argument("--seq-lens", default="1024,2048,4096,8192,16384,32768")
    parser.add_argument("--attention", default=",".join(ATTENTIONS), help="volta_train,sdpa,eager")
    parser.add_argument("--tokens-per-step", type=int, default=16384, help="tokens per step (batch = this / seq_len)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--memory-gb", type=float, default=None, help="cap CUDA memory (GiB) and search the longest "
                                                                       "sequence that trains within it")
    parser.add_argument("--search-cap", type=int, default=131072,
                        help="longest sequence the search tries (each probe is one full training step: the long ones "
                             "take minutes with an O(n^2) attention)")
    parser.add_argument("--search-granularity", type=int, default=1024)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--cpu", action="store_true", help="run on CPU even with a GPU")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run: nano model, 64/128 tokens, 1+1 steps")
    parser.add_argument("--out", default="out/bench_train")
    args = parser.parse_args(argv)
    vocab = VOCAB
    if args.smoke:
        args.models, args.seq_lens, args.steps, args.warmup, args.tokens_per_step = "nano", "64,128", 1, 1, 256
        args.cpu, args.search_cap, args.search_granularity, vocab = True, 128, 64, 320
        if args.memory_gb is None:
            args.memory_gb = 0.0  # no cap on CPU; the search still runs, up to search_cap
    args.models = args.models.split(",")
    args.attention = args.attention.split(",")
    seq_lens = [int(s) for s in args.seq_lens.split(",")]
    for a in args.attention:
        if a not in ATTENTIONS:
            parser.error(f"--attention {a!r}; accepted: {', '.join(ATTENTIONS)}")
    for m in args.models:
        if m not in PRESETS:
            parser.error(f"--models {m!r}; accepted: {', '.join(PRESETS)}")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() and not args.cpu else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1))
        device_name = f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    else:
        device_name = torch.cuda.get_device_name(device)
        if args.memory_gb:
            total = torch.cuda.get_device_properties(device).total_memory
            fraction = min(1.0, args.memory_gb * 2**30 / total)
            torch.cuda.set_per_process_memory_fraction(fraction, device)
            print(f"memory cap: {args.memory_gb:g} GiB of {total / 2**30:.1f} GiB ({fraction:.3f})", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"bench_train on {device_name}, torch {torch.__version__}", flush=True)

    runs, searches = [], []
    for model in args.models:
        for n in seq_lens:
            batch = max(1, args.tokens_per_step // n)
            for attention in args.attention:
                r = train_steps(model, n, attention, batch, args.steps, args.warmup, device,
                                args.gradient_checkpointing, vocab)
                runs.append(r)
                if r["status"] == "ok":
                    print(f"{model:>6} {attention:>11} seq {n:>6} x {batch:<3} {r['tokens_per_s']:>10,.0f} tokens/s  "
                          f"{r['step_s']:.3f} s/step  peak {r['peak_mem_gib']:.2f} GiB  {r['tflops']:.1f} TFLOP/s",
                          flush=True)
                else:
                    print(f"{model:>6} {attention:>11} seq {n:>6} x {batch:<3} {r['status']}", flush=True)
        if args.memory_gb is not None:
            for attention in args.attention:
                searches.append(max_seq_len(model, attention, device, args.gradient_checkpointing, vocab,
                                            min(1024, seq_lens[0]), args.search_cap, args.search_granularity,
                                            lambda s: print(s, flush=True)))
                print(f"{model:>6} {attention:>11} longest trainable sequence: {searches[-1]['max_seq_len']} "
                      f"({searches[-1]['limited_by']})", flush=True)

    results = {"device": device_name, "torch": torch.__version__, "args": {k: v for k, v in vars(args).items()},
               "runs": runs, "max_seq_len": searches}
    (out / "bench_train.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    md = table(runs, searches, args, device_name)
    (out / "bench_train.md").write_text(md, encoding="utf-8")
    print()
    print(md)
    if plot(runs, out / "bench_train.png", f"training step, {device_name}"):
        print(f"plot: {out / 'bench_train.png'}")
    return results


if __name__ == "__main__":
    main()
