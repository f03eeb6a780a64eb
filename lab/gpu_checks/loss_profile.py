"""Where the time of the causal-LM loss goes on a GPU: the unchunked loss (logits, fp32 upcast, cross-entropy,
autograd) against volta_train's chunked linear + cross-entropy in each of its matmul modes, alone (no model).

    python lab/gpu_checks/loss_profile.py [--shapes 4096x768x50304,4096x2048x128256] [--out DIR]

Per shape (tokens x hidden x vocab; hidden states and head fp32 Parameters under fp16 autocast, as in the recipes):
the median forward + backward time of each variant over --repeats runs after warm-up, and the top GPU kernels of
one run (torch.profiler). Writes loss_profile.md and loss_profile.json to --out when given.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from volta_train.training import chunked_loss


def _unchunked(h, w, t):
    with torch.autocast("cuda", dtype=torch.float16):
        logits = F.linear(h, w)
    return F.cross_entropy(logits.float(), t, ignore_index=-100)


def _chunked(mode, chunk_mib):
    def run(h, w, t):
        with torch.autocast("cuda", dtype=torch.float16):
            return chunked_loss.linear_cross_entropy(h, w, t, matmul=mode, budget_mib=chunk_mib)
    return run


def _time(fn, h, w, t, repeats: int) -> list[float]:
    times = []
    for i in range(repeats + 3):
        h.grad = w.grad = None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(h, w, t).backward()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return times


def _top_kernels(fn, h, w, t, n: int = 10) -> list[tuple[str, float, int]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        h.grad = w.grad = None
        fn(h, w, t).backward()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if us > 0:
            rows.append((e.key[:90], us / 1000.0, e.count))
    rows.sort(key=lambda r: -r[1])
    return rows[:n]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="4096x768x50304,4096x1024x50304,4096x2048x128256")
    parser.add_argument("--variants", default="unchunked,out_dtype,scaled,out_dtype@1024")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    results = []
    lines = [f"# Loss profile ({torch.cuda.get_device_name()}, torch {torch.__version__})", ""]
    for shape in args.shapes.split(","):
        n, d, v = (int(x) for x in shape.split("x"))
        gen = torch.Generator(device="cuda").manual_seed(0)
        h = (torch.randn(n, d, device="cuda", generator=gen)).requires_grad_()
        w = (torch.randn(v, d, device="cuda", generator=gen) * d ** -0.5).requires_grad_()
        t = torch.randint(0, v, (n,), device="cuda", generator=gen)
        t[::7] = -100
        lines += [f"## {n} tokens x {d} hidden x {v} words", "", "| variant | median ms | min ms | peak MiB |",
                  "| --- | --- | --- | --- |"]
        profiles = {}
        for name in args.variants.split(","):
            mode, _, mib = name.partition("@")
            fn = _unchunked if mode == "unchunked" else _chunked(mode, float(mib or chunked_loss.DEFAULT_CHUNK_MIB))
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            times = _time(fn, h, w, t, args.repeats)
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            med = statistics.median(times)
            lines.append(f"| {name} | {med:.2f} | {min(times):.2f} | {peak:.0f} |")
            profiles[name] = _top_kernels(fn, h, w, t)
            results.append({"shape": shape, "variant": name, "median_ms": med, "min_ms": min(times), "peak_mib": peak,
                            "top_kernels": profiles[name]})
        lines.append("")
        for name, rows in profiles.items():
            lines += [f"top kernels, {name}:", "", "| kernel | ms | calls |", "| --- | --- | --- |"]
            lines += [f"| `{k}` | {ms:.3f} | {c} |" for k, ms, c in rows]
            lines.append("")
        del h, w, t
        torch.cuda.empty_cache()
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "loss_profile.md").write_text(text + "\n")
        (args.out / "loss_profile.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
