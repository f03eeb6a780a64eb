#!/usr/bin/env python3
"""Attention benchmark: the Volta kernel against PyTorch's attention backends, and packed (varlen) against padded.

    python scripts/bench_attention.py                          # = volta-train bench --passes fwd (volta_train/bench.py)
    python scripts/bench_attention.py --passes bwd             # backward
    python scripts/bench_attention.py --varlen-max 512 2048    # packed (varlen) against padded, fwd + bwd

The benchmark itself (FLOP count, timing, accuracy, environment, table/JSON/PNG) is volta_train/bench.py, what
`volta-train bench` runs; this script adds the varlen comparison. Writes to --out. (The developer's tile sweeps are
lab/tile_sweep.py.)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

import volta_train
from volta_train import bench
from volta_train.bench import make_inputs, time_ms, with_backward
from volta_train.dispatch import BACKEND_ENV

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover
    tqdm = lambda x, **_: x  # noqa: E731


def run_varlen(args) -> list[dict]:
    """Packed (varlen) against padded attention, forward + backward, lengths uniform in [1, max]."""
    rows = []
    gen = torch.Generator().manual_seed(0)
    cases = [(d, m, c) for d in args.head_dims for m in args.varlen_max for c in args.causal]
    for d, max_len, causal in tqdm(cases, desc="varlen"):
        heads = args.hidden // d
        batch = max(2, args.tokens // max_len)
        lengths = torch.randint(1, max_len + 1, (batch,), generator=gen).tolist()
        total = sum(lengths)
        cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32).cuda()
        ideal = sum(n * n for n in lengths) / (batch * max_len * max_len)

        def packed_inputs():
            return [tuple(torch.randn(total, heads, d, device="cuda", dtype=torch.float16).requires_grad_()
                          for _ in range(3)) for _ in range(args.input_sets)]

        def padded_inputs():
            return make_inputs(batch, max_len, heads, d, args.input_sets, True)

        varlen_fn = with_backward(lambda q, k, v: volta_train.flash_attn_varlen_func(
            q, k, v, cu, cu, max_len, max_len, causal=causal))
        padded_fn = with_backward(lambda q, k, v: volta_train.flash_attn_func(q, k, v, causal=causal))
        results = {}
        for name, fn, make in (("varlen", varlen_fn, packed_inputs), ("padded", padded_fn, padded_inputs)):
            torch.cuda.empty_cache()
            results[name] = time_ms(fn, make(), args.warmup, args.repeats)
        rows.append(dict(backend="volta fwd+bwd", head_dim=d, seqlen=max_len, causal=causal, batch=batch,
                         tokens=total, ms=results["varlen"], padded_ms=results["padded"],
                         speedup=results["padded"] / results["varlen"], ideal_speedup=1.0 / ideal))
    return rows


def plot_speedup(rows: list[dict], path: Path, title: str) -> None:
    """Speedup of packed over padded against the longest length, one line per head_dim and mask."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for d, causal in sorted({(r["head_dim"], r["causal"]) for r in rows}):
        pts = sorted((r["seqlen"], r["speedup"]) for r in rows if r["head_dim"] == d and r["causal"] == causal)
        ax.plot(*zip(*pts), marker="o", label=f"head_dim {d}, {'causal' if causal else 'full'}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("max seqlen")
    ax.set_ylabel("speedup over padded")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = bench.build_parser()
    parser.description = __doc__
    parser.add_argument("--varlen-max", type=int, nargs="*", default=[],
                        help="varlen benchmark: maximum lengths (e.g. 512 2048 8192); lengths uniform in [1, max]")
    parser.set_defaults(seqlens=[1024, 2048, 4096, 8192], passes=["fwd"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_attention.py needs a CUDA GPU")
    os.environ.setdefault(BACKEND_ENV, "kernel")
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.varlen_max:
        print(bench.write_results(bench.run_benchmark(args), args, f"bench_{'_'.join(args.passes)}"))
        return
    rows = run_varlen(args)
    stem = "bench_varlen"
    lines = [f"varlen vs padded, forward + backward; lengths uniform in [1, max]; batch = max(2, {args.tokens} / max);"
             f" heads = {args.hidden}/head_dim; ideal speedup = batch * max^2 / sum(len^2); "
             f"device: {torch.cuda.get_device_name()}", "",
             "| head_dim | max seqlen | causal | batch | tokens | varlen ms | padded ms | speedup | ideal |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['head_dim']} | {r['seqlen']} | {r['causal']} | {r['batch']} | {r['tokens']} | {r['ms']:.2f} | "
              f"{r['padded_ms']:.2f} | {r['speedup']:.2f} | {r['ideal_speedup']:.2f} |" for r in rows]
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (args.out / f"{stem}.json").write_text(json.dumps(rows, indent=1))
    plot_speedup(rows, args.out / f"{stem}.png", f"varlen speedup over padded on {torch.cuda.get_device_name()}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
