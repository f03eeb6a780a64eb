"""End-to-end training-step benchmark: tokens/s, peak memory and the longest trainable sequence.

    python scripts/bench_train.py                                  # GPU: small+medium, 1k-32k, all attentions
    python scripts/bench_train.py --models small --seq-lens 4096,16384 --attention volta_train,sdpa
    python scripts/bench_train.py --memory-gb 32                   # also: longest trainable sequence in 32 GB
    python scripts/bench_train.py --smoke                          # CPU, tiny models, seconds (the test runs this)
    # the loss study (issue 15): chunked vs unchunked loss, real vocabularies, 32 and 16 GiB
    python scripts/bench_train.py --models medium:50304,llama1b:128256 --attention sdpa --loss unchunked,chunked \
        --seq-lens 4096 --tokens-per-step 4096 --memory-gb 32,16 --gradient-checkpointing-search
    # the fair step-time comparison of the two losses: one model, steps alternating, plus GPU kernel time
    python scripts/bench_train.py --models small:50304,llama1b:128256 --attention sdpa --seq-lens 4096 \
        --tokens-per-step 4096 --steps 20 --warmup 4 --interleave-losses

One measurement = a full training step as the recipe runs it: fp16 autocast forward and
backward with dynamic loss scaling (GradScaler), gradient clipping and an AdamW step, on a
randomly initialised model (fp32 on CPU): a GPT-2 preset (``small``, ``medium``, ...; n_positions
= the sequence length) or ``llama1b`` (Llama-3.2-1B's shape: 16 layers, width 2048, 32 heads,
8 key/value heads, MLP 8192, tied embeddings; ~1.0B parameters at 32k words, 1.24B at 128k).
``--models name:vocab`` sets the vocabulary per model (default ``--vocab``, 50304). ``--loss``:
``unchunked`` (transformers' loss: whole fp32 logits) and/or ``chunked``
(:mod:`volta_train.training.chunked_loss`, what the recipes run by default).
Sequences per step: ``--tokens-per-step`` / seq_len (at least 1). ``--warmup`` steps, then
``--steps`` timed steps, each synchronised and timed alone; s/step is their *median*, tokens/s
follows from it; peak memory = ``torch.cuda.max_memory_allocated`` over the timed steps (peak
RSS on CPU). Out of memory is recorded as such, not as an error.

``--memory-gb G[,G2...]`` caps this process's CUDA memory at each G GiB in turn with
``torch.cuda.set_per_process_memory_fraction`` (a 32 or 16 GB V100 on a larger GPU) and searches
the longest sequence (batch 1) that trains one full step within the cap: doubling from
``--search-start``, then bisection until the bracket is within ``--search-granularity`` tokens or
``--search-precision`` of the length. Lengths are multiples of the granularity. Known bounds are
reused (a smaller cap's longest sequence is below the larger cap's first failure; the chunked
search starts at the unchunked result, after checking it still fits). ``--gradient-checkpointing``
applies to everything, ``--gradient-checkpointing-search`` to the searches only.
``--time-budget-min`` stops starting searches after that many minutes (the rest is recorded as
skipped), so a GPU session ends on time with its files written. The timed runs happen before
any cap. Attention implementations: ``volta_train`` (``volta_train.patch``; on a V100 the Volta
kernel, on sm_80+ the same kernel emulated: check memory there, not speed), ``sdpa`` (PyTorch; on
a V100 its memory-efficient kernel, on sm_80+ flash: O(n) memory like volta_train, and fast enough
for 100k-token searches) and ``eager`` (materialised scores). Sequence parallelism (sp=2, two
GPUs): ``lab/gpu_checks/sp_memory_probe.py --sp 2 --vocab V [--no-chunked-loss]``.

Writes ``<out>/bench_train.json`` (every run and search), ``bench_train.md`` (tables) and
``bench_train.png`` (tokens/s and peak memory against sequence length, and the longest sequences;
needs matplotlib).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # less fragmentation at the cap

import torch  # noqa: E402

from volta_train.training import chunked_loss, metrics  # noqa: E402
from volta_train.training.gpt import PRESETS, describe  # noqa: E402

ATTENTIONS = ("volta_train", "sdpa", "eager")
LOSSES = ("unchunked", "chunked")
VOCAB = 50304  # GPT-2's vocabulary rounded to a multiple of 64: the LM head costs what it does in practice
# Llama-style shapes: llama1b is Llama-3.2-1B's (tied embeddings); llama-nano is for the CPU smoke run
LLAMA = {
    "llama1b": {"n_layer": 16, "n_embd": 2048, "n_head": 32, "n_kv_head": 8, "intermediate": 8192},
    "llama-nano": {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_kv_head": 2, "intermediate": 128},
}


def parse_model(spec: str, default_vocab: int) -> tuple[str, int]:
    """``name`` or ``name:vocab`` -> (name, vocab)."""
    name, _, vocab = spec.partition(":")
    if name not in PRESETS and name not in LLAMA:
        raise ValueError(f"--models {spec!r}: unknown model {name!r}; accepted: {', '.join([*PRESETS, *LLAMA])} "
                         "(optionally :vocab, e.g. llama1b:128256)")
    try:
        size = int(vocab) if vocab else default_vocab
    except ValueError:
        raise ValueError(f"--models {spec!r}: the vocabulary after ':' must be an integer") from None
    if size < 2:
        raise ValueError(f"--models {spec!r}: the vocabulary must be >= 2")
    return name, size


def build(model_name: str, seq_len: int, attention: str, device: torch.device, checkpointing: bool, vocab: int):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if model_name in LLAMA:
        shape = LLAMA[model_name]
        config = LlamaConfig(vocab_size=vocab, hidden_size=shape["n_embd"], intermediate_size=shape["intermediate"],
                             num_hidden_layers=shape["n_layer"], num_attention_heads=shape["n_head"],
                             num_key_value_heads=shape["n_kv_head"], max_position_embeddings=seq_len,
                             tie_word_embeddings=True, use_cache=False, bos_token_id=0, eos_token_id=0)
        cls = LlamaForCausalLM
    else:
        config = GPT2Config(vocab_size=vocab, n_positions=seq_len, activation_function="gelu_pytorch_tanh",
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0,
                            eos_token_id=0, **PRESETS[model_name])
        cls = GPT2LMHeadModel
    with torch.device(device):  # initialised where it runs (a 1B model takes seconds to initialise on a CPU)
        model = cls(config)
    model.loss_type = "ForCausalLM"
    if attention == "volta_train":
        import volta_train

        volta_train.patch(model)
    else:
        model.set_attn_implementation(attention)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


def _cleanup(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def profile_step(step, device: torch.device, top: int = 8) -> dict:
    """One step under torch.profiler: host wall time, GPU kernel time and count, host-device synchronisations (what
    stalls the host's launch queue), and the kernels that take the most GPU time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        began = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - began
    kernels, syncs, rows = 0, {}, []
    for e in prof.key_averages():
        gpu_us = getattr(e, "device_time_total", 0.0) or 0.0
        if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync",
                     "aten::_local_scalar_dense", "aten::is_nonzero", "aten::item"):
            syncs[e.key] = syncs.get(e.key, 0) + e.count
        if gpu_us > 0 and getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type):
            kernels += e.count
            rows.append((e.key[:100], round(gpu_us / 1000, 3), e.count))
    rows.sort(key=lambda r: -r[1])
    gpu_ms = sum(r[1] for r in rows)
    return {"wall_ms": round(wall * 1000, 3), "gpu_kernel_ms": round(gpu_ms, 3), "kernels": kernels,
            "host_syncs": syncs, "top_kernels": rows[:top]}


def training_step(model, batch: int, seq_len: int, vocab: int, device: torch.device,
                  chunk_mib: float = chunked_loss.DEFAULT_CHUNK_MIB):
    """(optimizer, scaler, step): ``step(loss_impl)`` runs one fp16-autocast training step of ``model`` on random
    tokens (GradScaler, clipping, AdamW) with the unchunked or the chunked loss and returns the loss."""
    fp16 = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fp16)
    scaler = torch.amp.GradScaler(device.type, enabled=fp16)
    ids = torch.randint(0, vocab, (batch, seq_len), device=device)

    def step(loss_impl: str):
        with torch.autocast(device.type, dtype=torch.float16, enabled=fp16):
            if loss_impl == "chunked":
                loss = chunked_loss.causal_lm_loss(model, {"input_ids": ids, "labels": ids}, budget_mib=chunk_mib)
            else:
                loss = model(input_ids=ids, labels=ids).loss
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return optimizer, scaler, step


def interleaved_losses(model_name: str, seq_len: int, attention: str, batch: int, steps: int, warmup: int,
                       device: torch.device, checkpointing: bool, vocab: int,
                       chunk_mib: float = chunked_loss.DEFAULT_CHUNK_MIB) -> dict:
    """Step time of the unchunked and the chunked loss on ONE model, steps alternating (AB, BA, AB...), so that
    machine drift and the model's build cancel out; medians, their ratio, and each loss's GPU kernel time (one
    profiled step each: what decides on a GPU-bound machine such as a V100)."""
    torch.manual_seed(0)
    model = build(model_name, seq_len, attention, device, checkpointing, vocab)
    optimizer, scaler, train_step = training_step(model, batch, seq_len, vocab, device, chunk_mib)

    def step(loss_impl: str):
        train_step(loss_impl)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times: dict[str, list[float]] = {name: [] for name in LOSSES}
    for i in range(warmup + steps):
        order = LOSSES if i % 2 == 0 else LOSSES[::-1]
        for name in order:
            began = time.perf_counter()
            step(name)
            if i >= warmup:
                times[name].append(time.perf_counter() - began)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    gpu = {name: profile_step(lambda n=name: step(n), device)["gpu_kernel_ms"] for name in LOSSES} \
        if device.type == "cuda" else {}
    result = {"model": model_name, "vocab": vocab, "attention": attention, "seq_len": seq_len, "batch": batch,
              "steps": steps, "median_s": medians, "ratio": medians["chunked"] / medians["unchunked"],
              "gpu_kernel_ms": gpu, "gpu_ratio": gpu["chunked"] / gpu["unchunked"] if gpu else None,
              "step_times": {k: [round(x, 5) for x in v] for k, v in times.items()}}
    del model, optimizer, scaler
    _cleanup(device)
    return result


def interleaved_table(results: list[dict]) -> str:
    lines = ["## step time, losses interleaved on one model (median s/step; GPU kernel time of one profiled step)", "",
             "| model | vocab | seq_len x batch | unchunked s | chunked s | chunked / unchunked | unchunked GPU ms | "
             "chunked GPU ms | GPU chunked / unchunked |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        g = r["gpu_kernel_ms"]
        lines.append(f"| {r['model']} | {r['vocab']} | {r['seq_len']} x {r['batch']} | {r['median_s']['unchunked']:.4f} | "
                     f"{r['median_s']['chunked']:.4f} | {r['ratio']:.3f} | {g.get('unchunked', float('nan')):.1f} | "
                     f"{g.get('chunked', float('nan')):.1f} | "
                     f"{'n/a' if r['gpu_ratio'] is None else format(r['gpu_ratio'], '.3f')} |")
    return "\n".join(lines) + "\n"


def train_steps(model_name: str, seq_len: int, attention: str, batch: int, steps: int, warmup: int,
                device: torch.device, checkpointing: bool, vocab: int, loss_impl: str = "chunked",
                profile: bool = False, chunk_mib: float = chunked_loss.DEFAULT_CHUNK_MIB) -> dict:
    """Run warmup + timed training steps; a dict with s/step (median), tokens/s, peak memory, status ('ok'/'oom')."""
    result = {"model": model_name, "vocab": vocab, "attention": attention, "loss_impl": loss_impl, "seq_len": seq_len,
              "batch": batch, "checkpointing": checkpointing, "status": "ok"}
    model = optimizer = scaler = None
    try:
        torch.manual_seed(0)
        model = build(model_name, seq_len, attention, device, checkpointing, vocab)
        optimizer, scaler, train_step = training_step(model, batch, seq_len, vocab, device, chunk_mib)

        def step():
            return train_step(loss_impl)

        def sync():
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        for _ in range(warmup):
            step()
        sync()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            loss = step()
            sync()
            times.append(time.perf_counter() - start)
        loss = float(loss)
        if profile:
            result["profile"] = profile_step(step, device)
            print(f"  profile {model_name}:{vocab} {loss_impl} {seq_len}x{batch}: {result['profile']}", flush=True)
        median = statistics.median(times)
        mem, _ = metrics.peak_memory(device)
        n_params = sum(p.numel() for p in model.parameters())
        shape = describe(model)
        counter = metrics.FlopCounter(metrics.matmul_parameters(model), shape["n_layer"],
                                      shape["n_head"] * shape["head_dim"])
        _, flops = counter({"input_ids": torch.zeros(batch, seq_len, dtype=torch.long)})
        result.update(tokens_per_s=batch * seq_len / median, step_s=median, step_times=[round(t, 5) for t in times],
                      peak_mem_gib=mem / 2**30, loss=loss, parameters=n_params, tflops=flops / median / 1e12)
    except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
        if not _is_oom(e):
            raise
        result.update(status="oom")
    finally:
        del model, optimizer, scaler
        _cleanup(device)
    return result


def _round(n: int, granularity: int) -> int:
    return max(granularity, n // granularity * granularity)


def max_seq_len(model_name: str, attention: str, device: torch.device, checkpointing: bool, vocab: int,
                start: int, cap: int, granularity: int, log, loss_impl: str = "chunked", precision: float = 0.0,
                known_fit: int = 0, known_fail: int | None = None) -> dict:
    """Longest sequence (batch 1) that completes one training step within the memory cap.

    ``known_fit``: a length expected to fit (checked first; ignored if it does not); ``known_fail``: a length known
    not to fit (not tried again). Returns the length, the first failing length found, the probes and their seconds.
    """
    probes = []

    def fits(n: int) -> bool:
        # one step, no warmup: the first step already holds everything (AdamW allocates its state there)
        began = time.perf_counter()
        r = train_steps(model_name, n, attention, 1, 1, 0, device, checkpointing, vocab, loss_impl)
        probes.append({"seq_len": n, "status": r["status"], "peak_mem_gib": r.get("peak_mem_gib"),
                       "seconds": round(time.perf_counter() - began, 2)})
        log(f"  max-len search {model_name}:{vocab}/{attention}/{loss_impl}: {n:>7} tokens -> {r['status']}"
            + (f" ({r['peak_mem_gib']:.2f} GiB)" if r["status"] == "ok" else "") + f" [{probes[-1]['seconds']} s]")
        return r["status"] == "ok"

    good, bad = 0, known_fail
    if known_fit and (bad is None or known_fit < bad) and fits(known_fit):
        good = known_fit
    if bad is None and good < cap:  # doubling, the last try at the cap itself
        n = min(_round(max(start, 2 * good), granularity), cap)
        while True:
            if not fits(n):
                bad = n
                break
            good = n
            if n >= cap:
                break
            n = min(_round(2 * n, granularity), cap)
    result = {"model": model_name, "vocab": vocab, "attention": attention, "loss_impl": loss_impl,
              "checkpointing": checkpointing, "probes": probes}
    if bad is None:
        return {**result, "max_seq_len": good, "first_fail": None, "limited_by": "cap"}
    while bad - good > max(granularity, precision * good):
        mid = _round((good + bad) // 2, granularity)
        if mid <= good or mid >= bad:
            break
        if fits(mid):
            good = mid
        else:
            bad = mid
    return {**result, "max_seq_len": good, "first_fail": bad, "limited_by": "memory"}


def _variant(r: dict, losses: list[str]) -> str:
    return r["attention"] if len(losses) == 1 else f"{r['attention']} {r['loss_impl']}"


def table(runs: list[dict], searches: list[dict], args, device_name: str) -> str:
    caps = ", ".join(f"{c:g}" for c in args.memory_gb) if args.memory_gb else ""
    lines = [f"# bench_train: {device_name}", "",
             f"{'fp16 autocast + GradScaler' if 'CPU' not in device_name else 'fp32'} + AdamW step, "
             f"{args.tokens_per_step} tokens per step (batch = tokens / seq_len), median of {args.steps} timed steps "
             f"after {args.warmup}; loss {', '.join(args.loss)}; "
             + (f"searches under memory caps of {caps} GiB" if caps else "no memory cap")
             + ("; gradient checkpointing" if args.gradient_checkpointing else "")
             + ("; gradient checkpointing in the searches" if args.gradient_checkpointing_search else ""), ""]
    variants = [(a, lo) for a in args.attention for lo in args.loss]
    names = [f"{a} {lo}" if len(args.loss) > 1 else a for a, lo in variants]
    for model, vocab in dict.fromkeys((r["model"], r["vocab"]) for r in runs):
        lines += [f"## {model}, {vocab} words", "", "| seq_len | batch | " + " | ".join(
            f"{n} tok/s | {n} s/step | {n} peak GiB" for n in names) + " |",
            "| --- | --- | " + " | ".join("--- | --- | ---" for _ in variants) + " |"]
        mine = [r for r in runs if r["model"] == model and r["vocab"] == vocab]
        for n in dict.fromkeys(r["seq_len"] for r in mine):
            cells, batch = [], ""
            for a, lo in variants:
                r = next((r for r in mine if r["seq_len"] == n and r["attention"] == a and r["loss_impl"] == lo),
                         None)
                if r is None:
                    cells += ["", "", ""]
                elif r["status"] != "ok":
                    cells += [r["status"]] * 3
                else:
                    batch = r["batch"]
                    cells += [f"{r['tokens_per_s']:,.0f}", f"{r['step_s']:.4f}", f"{r['peak_mem_gib']:.2f}"]
            lines.append(f"| {n} | {batch} | " + " | ".join(cells) + " |")
        lines.append("")
    pairs = []
    for r in runs:
        if r["loss_impl"] == "chunked" and r["status"] == "ok":
            u = next((x for x in runs if x["loss_impl"] == "unchunked" and x["status"] == "ok" and all(
                x[k] == r[k] for k in ("model", "vocab", "attention", "seq_len", "batch"))), None)
            if u is not None:
                pairs.append((u, r))
    if pairs:
        lines += ["## step time, chunked vs unchunked loss (median s/step)", "",
                  "| model | vocab | attention | seq_len x batch | unchunked s | chunked s | chunked / unchunked | "
                  "unchunked peak GiB | chunked peak GiB |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {u['model']} | {u['vocab']} | {u['attention']} | {u['seq_len']} x {u['batch']} | "
                  f"{u['step_s']:.4f} | {c['step_s']:.4f} | {c['step_s'] / u['step_s']:.3f} | "
                  f"{u['peak_mem_gib']:.2f} | {c['peak_mem_gib']:.2f} |" for u, c in pairs]
        lines.append("")
    if searches:
        lines += ["## longest trainable sequence (batch 1, one full step)", "",
                  "| model | vocab | cap GiB | attention | checkpointing | " + " | ".join(args.loss)
                  + (" | chunked / unchunked" if set(args.loss) == set(LOSSES) else "") + " |",
                  "| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in args.loss)
                  + (" | ---" if set(args.loss) == set(LOSSES) else "") + " |"]
        keys = dict.fromkeys((s["model"], s["vocab"], s["cap_gib"], s["attention"], s["checkpointing"])
                             for s in searches)
        for key in keys:
            cells, found = [], {}
            for lo in args.loss:
                s = next((s for s in searches if (s["model"], s["vocab"], s["cap_gib"], s["attention"],
                                                  s["checkpointing"]) == key and s["loss_impl"] == lo), None)
                found[lo] = s
                cells.append(_length_cell(s))
            if set(args.loss) == set(LOSSES):
                u, c = found["unchunked"], found["chunked"]
                ok = u and c and u.get("max_seq_len") and c.get("max_seq_len") is not None
                cells.append(f"{c['max_seq_len'] / u['max_seq_len']:.2f}x" if ok else "")
            model, vocab, cap, attention, ckpt = key
            lines.append(f"| {model} | {vocab} | {cap:g} | {attention} | {'yes' if ckpt else 'no'} | "
                         + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _length_cell(s: dict | None) -> str:
    if s is None:
        return ""
    if s.get("skipped"):
        return f"skipped ({s['skipped']})"
    if s["max_seq_len"] == 0:
        return f"none (< {s['first_fail']})"
    return f"{s['max_seq_len']}" + (" (search cap)" if s["limited_by"] == "cap" else "")


def plot(runs: list[dict], searches: list[dict], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    models = list(dict.fromkeys((r["model"], r["vocab"]) for r in runs))
    done = [s for s in searches if not s.get("skipped")]
    cols = max(1, len(models)) + (1 if done else 0)
    fig, axes = plt.subplots(2, cols, figsize=(6 * cols, 8), squeeze=False)
    for col, (model, vocab) in enumerate(models):
        for variant in dict.fromkeys((r["attention"], r["loss_impl"]) for r in runs):
            ok = [r for r in runs if (r["model"], r["vocab"]) == (model, vocab)
                  and (r["attention"], r["loss_impl"]) == variant and r["status"] == "ok"]
            if not ok:
                continue
            x = [r["seq_len"] for r in ok]
            axes[0][col].plot(x, [r["tokens_per_s"] for r in ok], marker="o", label=" ".join(variant))
            axes[1][col].plot(x, [r["peak_mem_gib"] for r in ok], marker="o", label=" ".join(variant))
        for row, ylabel in enumerate(("tokens/s", "peak memory (GiB)")):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            ax.set_xlabel("sequence length")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{model}, {vocab} words")
            ax.grid(True, alpha=0.3)
            ax.legend()
    if done:
        for row, cap in enumerate(sorted({s["cap_gib"] for s in done}, reverse=True)[:2]):
            ax = axes[row][cols - 1]
            mine = [s for s in done if s["cap_gib"] == cap]
            labels = list(dict.fromkeys(f"{s['model']}\n{s['vocab']}" for s in mine))
            losses = list(dict.fromkeys(s["loss_impl"] for s in mine))
            width = 0.8 / max(1, len(losses))
            for i, lo in enumerate(losses):
                heights = [next((s["max_seq_len"] for s in mine if f"{s['model']}\n{s['vocab']}" == lab
                                 and s["loss_impl"] == lo), 0) for lab in labels]
                ax.bar([j + i * width for j in range(len(labels))], heights, width, label=lo)
            ax.set_xticks([j + width * (len(losses) - 1) / 2 for j in range(len(labels))], labels, fontsize=8)
            ax.set_ylabel("longest trainable sequence (tokens)")
            ax.set_title(f"memory cap {cap:g} GiB")
            ax.grid(True, axis="y", alpha=0.3)
            ax.legend()
        if len({s["cap_gib"] for s in done}) < 2:
            axes[1][cols - 1].axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _set_cap(device: torch.device, gib: float) -> None:
    if device.type != "cuda":
        return
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = min(1.0, gib * 2**30 / total) if gib else 1.0
    _cleanup(device)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    print(f"memory cap: {gib:g} GiB of {total / 2**30:.1f} GiB ({fraction:.3f})", flush=True)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="small,medium",
                        help="GPT-2 presets and/or llama1b, each optionally :vocab (default: small,medium)")
    parser.add_argument("--vocab", type=int, default=VOCAB, help="vocabulary of a model given without :vocab")
    parser.add_argument("--seq-lens", default="1024,2048,4096,8192,16384,32768",
                        help="lengths of the timed runs ('none': searches only)")
    parser.add_argument("--attention", default=",".join(ATTENTIONS), help="volta_train,sdpa,eager")
    parser.add_argument("--loss", default="chunked", help="unchunked and/or chunked (default: chunked, the recipes')")
    parser.add_argument("--tokens-per-step", type=int, default=16384, help="tokens per step (batch = this / seq_len)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (their median is reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--memory-gb", default=None,
                        help="memory caps in GiB, comma-separated (e.g. 32,16): search the longest sequence that "
                             "trains within each")
    parser.add_argument("--search-start", type=int, default=1024, help="first length the search tries")
    parser.add_argument("--search-cap", type=int, default=131072,
                        help="longest sequence the search tries (each probe is one full training step: the long ones "
                             "take minutes with an O(n^2) attention)")
    parser.add_argument("--search-granularity", type=int, default=1024, help="lengths are multiples of this")
    parser.add_argument("--search-precision", type=float, default=0.0,
                        help="stop bisecting when the bracket is within this share of the length (e.g. 0.1)")
    parser.add_argument("--time-budget-min", type=float, default=0.0,
                        help="start no search after this many minutes (0: no limit); skipped ones are recorded")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="everywhere")
    parser.add_argument("--gradient-checkpointing-search", action="store_true", help="in the searches only")
    parser.add_argument("--cpu", action="store_true", help="run on CPU even with a GPU")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny CPU run: nano GPT-2 and Llama, 64/128 tokens, 1+1 steps, both losses, a search")
    parser.add_argument("--loss-chunk-mib", type=float, default=chunked_loss.DEFAULT_CHUNK_MIB,
                        help="the chunked loss's budget: MiB of fp32 logits per chunk (default: the recipes')")
    parser.add_argument("--interleave-losses", action="store_true",
                        help="instead of separate runs: both losses on one model, steps alternating (the fair "
                             "step-time comparison); writes bench_train_interleaved.md/.json")
    parser.add_argument("--profile", action="store_true",
                        help="profile one extra step of each timed run (GPU kernel time, host syncs, top kernels)")
    parser.add_argument("--out", default="out/bench_train")
    args = parser.parse_args(argv)
    default_vocab = args.vocab
    if args.smoke:
        args.models, args.seq_lens, args.steps, args.warmup, args.tokens_per_step = \
            "nano:320,llama-nano:1000", "64,128", 1, 1, 256
        args.cpu, args.search_cap, args.search_granularity, args.search_start = True, 128, 64, 64
        args.loss = ",".join(LOSSES)
        if args.memory_gb is None:
            args.memory_gb = "0"  # no cap on CPU; the search still runs, up to search_cap
    try:
        models = [parse_model(m, default_vocab) for m in args.models.split(",")]
        caps = [float(c) for c in args.memory_gb.split(",")] if args.memory_gb is not None else []
    except ValueError as e:
        parser.error(str(e))
    if any(c < 0 for c in caps):
        parser.error(f"--memory-gb {args.memory_gb!r}: caps must be >= 0 GiB (0: no cap)")
    args.memory_gb = caps
    args.attention = args.attention.split(",")
    args.loss = args.loss.split(",")
    seq_lens = [] if args.seq_lens in ("", "none") else [int(s) for s in args.seq_lens.split(",")]
    for a in args.attention:
        if a not in ATTENTIONS:
            parser.error(f"--attention {a!r}; accepted: {', '.join(ATTENTIONS)}")
    for lo in args.loss:
        if lo not in LOSSES:
            parser.error(f"--loss {lo!r}; accepted: {', '.join(LOSSES)}")
    for name in ("search_start", "search_granularity", "tokens_per_step", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() and not args.cpu \
        else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1))
        device_name = f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    else:
        device_name = torch.cuda.get_device_name(device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"bench_train on {device_name}, torch {torch.__version__}", flush=True)
    began = time.perf_counter()

    if args.interleave_losses:
        results = []
        for model, vocab in models:
            for n in seq_lens:
                for attention in args.attention:
                    r = interleaved_losses(model, n, attention, max(1, args.tokens_per_step // n), args.steps,
                                           args.warmup, device, args.gradient_checkpointing, vocab,
                                           args.loss_chunk_mib)
                    results.append(r)
                    print(f"{model}:{vocab} {attention} seq {n}: unchunked {r['median_s']['unchunked']:.4f} s, "
                          f"chunked {r['median_s']['chunked']:.4f} s, ratio {r['ratio']:.3f}, GPU ratio "
                          f"{r['gpu_ratio'] if r['gpu_ratio'] is None else round(r['gpu_ratio'], 3)}", flush=True)
        text = (f"# bench_train, losses interleaved: {device_name}\n\nfp16 autocast + GradScaler + AdamW step, "
                f"{args.tokens_per_step} tokens per step, {args.steps} timed steps of each loss after {args.warmup}, "
                f"alternating; chunk budget {args.loss_chunk_mib:g} MiB\n\n" + interleaved_table(results))
        (out / "bench_train_interleaved.md").write_text(text)
        (out / "bench_train_interleaved.json").write_text(json.dumps(results, indent=1))
        print(text)
        return {"interleaved": results}

    runs, searches = [], []
    for model, vocab in models:  # timed runs first, without a cap
        for n in seq_lens:
            batch = max(1, args.tokens_per_step // n)
            for attention in args.attention:
                for loss_impl in args.loss:
                    r = train_steps(model, n, attention, batch, args.steps, args.warmup, device,
                                    args.gradient_checkpointing, vocab, loss_impl, args.profile, args.loss_chunk_mib)
                    runs.append(r)
                    label = f"{model}:{vocab} {attention} {loss_impl}"
                    if r["status"] == "ok":
                        print(f"{label:>34} seq {n:>6} x {batch:<3} {r['tokens_per_s']:>10,.0f} tokens/s  "
                              f"{r['step_s']:.4f} s/step  peak {r['peak_mem_gib']:.2f} GiB  {r['tflops']:.1f} "
                              "TFLOP/s", flush=True)
                    else:
                        print(f"{label:>34} seq {n:>6} x {batch:<3} {r['status']}", flush=True)
    checkpointing = args.gradient_checkpointing or args.gradient_checkpointing_search
    found: dict[tuple, dict] = {}
    for cap in sorted(caps, reverse=True):  # larger caps first: their failures bound the smaller caps' searches
        _set_cap(device, cap)
        for model, vocab in models:
            for attention in args.attention:
                for loss_impl in sorted(args.loss, key=LOSSES.index):  # unchunked first: a lower bound for chunked
                    base = {"model": model, "vocab": vocab, "attention": attention, "loss_impl": loss_impl,
                            "checkpointing": checkpointing, "cap_gib": cap}
                    minutes = (time.perf_counter() - began) / 60
                    if args.time_budget_min and minutes > args.time_budget_min:
                        searches.append({**base, "skipped": f"time budget {args.time_budget_min:g} min",
                                         "max_seq_len": None})
                        print(f"{model}:{vocab} {attention} {loss_impl} cap {cap:g}: skipped (time budget)", flush=True)
                        continue
                    larger = [found[k] for k in found if k[:4] == (model, vocab, attention, loss_impl) and k[4] > cap]
                    fails = [s["first_fail"] for s in larger if s.get("first_fail")]
                    lower = found.get((model, vocab, attention, "unchunked", cap)) if loss_impl == "chunked" else None
                    started = time.perf_counter()
                    s = max_seq_len(model, attention, device, checkpointing, vocab, args.search_start,
                                    args.search_cap, args.search_granularity, lambda m: print(m, flush=True),
                                    loss_impl, args.search_precision,
                                    known_fit=lower["max_seq_len"] if lower else 0,
                                    known_fail=min(fails) if fails else None)
                    s.update(cap_gib=cap, seconds=round(time.perf_counter() - started, 1))
                    found[(model, vocab, attention, loss_impl, cap)] = s
                    searches.append(s)
                    print(f"{model}:{vocab} {attention} {loss_impl} cap {cap:g} GiB: longest trainable sequence "
                          f"{s['max_seq_len']} ({s['limited_by']}; {s['seconds']} s)", flush=True)

    results = {"device": device_name, "torch": torch.__version__, "args": {k: v for k, v in vars(args).items()},
               "seconds": round(time.perf_counter() - began, 1), "runs": runs, "max_seq_len": searches}
    (out / "bench_train.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    md = table(runs, searches, args, device_name)
    (out / "bench_train.md").write_text(md, encoding="utf-8")
    print()
    print(md)
    if plot(runs, searches, out / "bench_train.png", f"training step, {device_name}"):
        print(f"plot: {out / 'bench_train.png'}")
    print(f"total {results['seconds']} s", flush=True)
    return results


if __name__ == "__main__":
    main()
