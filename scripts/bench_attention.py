#!/usr/bin/env python3
"""Attention benchmark: the Volta kernel against PyTorch eager attention and every SDPA backend available.

    python scripts/bench_attention.py                       # forward, head_dim 64/128, seqlen 1k-8k
    python scripts/bench_attention.py --pass bwd            # backward (needs the backward kernel)
    python scripts/bench_attention.py --sweep               # forward tile-shape sweep of the Volta kernel

FLOPs counted (and written in the table header): forward 4*B*H*Nq*Nk*D, half of it under causal;
backward 2.5x the forward. Times are medians of --repeats CUDA-event timings after --warmup runs,
cycling through several input sets so the L2 cache does not hold them. Batch x seqlen is kept at
--tokens (16384) and heads = --hidden / head_dim (2048), as in shared/VOLTA_NOTES.md's baselines.
Writes a markdown table and a PNG plot to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import volta_train  # noqa: E402
from volta_train._reference import AttentionParams  # noqa: E402
from volta_train.kernels import configs, launch  # noqa: E402

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover
    tqdm = lambda x, **_: x  # noqa: E731


def flops(pass_name: str, batch: int, heads: int, sq: int, sk: int, d: int, causal: bool) -> float:
    forward = 4.0 * batch * heads * sq * sk * d * (0.5 if causal else 1.0)
    return {"fwd": forward, "bwd": 2.5 * forward, "fwdbwd": 3.5 * forward}[pass_name]


def time_ms(fn, input_sets, warmup: int, repeats: int) -> float:
    for i in range(warmup):
        fn(*input_sets[i % len(input_sets)])
    torch.cuda.synchronize()
    times = []
    for i in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        args = input_sets[i % len(input_sets)]
        start.record()
        fn(*args)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def make_inputs(batch, seqlen, heads, d, sets, requires_grad):
    out = []
    for _ in range(sets):
        q, k, v = (torch.randn(batch, seqlen, heads, d, device="cuda", dtype=torch.float16) for _ in range(3))
        out.append(tuple(t.requires_grad_(requires_grad) for t in (q, k, v)))
    return out


def volta_fn(pass_name, causal, accum, tile=None):
    """Forward: accum is the forward accumulation; backward passes: the backward's (bwd_accum)."""
    if pass_name == "fwd" and tile is not None:
        def run(q, k, v):
            params = AttentionParams(softmax_scale=q.shape[-1] ** -0.5, causal=causal)
            return launch.forward(q, k, v, None, None, q.shape[1], k.shape[1], params, None, accum, tile=tile)
        return run

    def run(q, k, v):
        if pass_name == "fwd":
            return volta_train.flash_attn_func(q, k, v, causal=causal, accum=accum)
        return volta_train.flash_attn_func(q, k, v, causal=causal, bwd_accum=accum)
    return run


def backward_only(forward):
    """Times only the backward: the forward runs once per input set, its graph is kept and differentiated."""
    graphs = {}

    def run(q, k, v):
        if id(q) not in graphs:
            out = forward(q, k, v)
            graphs[id(q)] = (out, torch.randn_like(out))
        out, grad = graphs[id(q)]
        return torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
    return run


def with_backward(forward):
    def run(q, k, v):
        out = forward(q, k, v)
        return torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    return run


def sdpa_fn(pass_name, causal, backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
              "sdpa-math": SDPBackend.MATH, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}[backend]

    def run(q, k, v):
        with sdpa_kernel([chosen]):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=causal)
    return run


def eager_fn(pass_name, causal):
    def run(q, k, v):
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        s = qt @ kt.transpose(-1, -2) * qt.shape[-1] ** -0.5
        if causal:
            n = s.shape[-1]
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        return torch.softmax(s.float(), dim=-1).half() @ vt
    return run


def measure(fn, batch, seqlen, heads, d, pass_name, args):
    torch.cuda.empty_cache()
    inputs = make_inputs(batch, seqlen, heads, d, args.input_sets, pass_name != "fwd")
    if pass_name == "bwd":  # build each input set's graph before the memory baseline
        for q, k, v in inputs:
            fn(q, k, v)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    try:
        ms = time_ms(fn, inputs, args.warmup, args.repeats)
    except (RuntimeError, NotImplementedError) as error:  # unsupported backend / out of memory
        return None, None, str(error).splitlines()[0][:80]
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return ms, peak, ""


def run_benchmark(args) -> list[dict]:
    rows = []
    cases = [(d, n, c) for d in args.head_dims for n in args.seqlens for c in args.causal]
    for d, n, causal in tqdm(cases, desc="benchmark"):
        heads = args.hidden // d
        batch = max(1, args.tokens // n)
        fl = flops(args.pass_name, batch, heads, n, n, d, causal)
        backends = []
        for accum in args.accum:
            backends.append((f"volta-{accum}acc", volta_fn(args.pass_name, causal, accum)))
        for b in args.baselines:
            backends.append((b, eager_fn(args.pass_name, causal) if b == "eager" else sdpa_fn(args.pass_name, causal, b)))
        wrap = {"fwd": lambda f: f, "bwd": backward_only, "fwdbwd": with_backward}[args.pass_name]
        backends = [(name, wrap(fn)) for name, fn in backends]
        for name, fn in backends:
            if name == "eager" and batch * heads * n * n * 6 > args.eager_limit_gb * 2**30:
                continue
            ms, peak, note = measure(fn, batch, n, heads, d, args.pass_name, args)
            rows.append(dict(backend=name, head_dim=d, seqlen=n, causal=causal, batch=batch, heads=heads,
                             ms=ms, tflops=(fl / ms / 1e9) if ms else None, peak_mib=peak, note=note))
    return rows


def run_bwd_sweep(args) -> list[dict]:
    B = configs.BwdTile
    candidates = [B(1, 4, 32), B(1, 8, 64), B(1, 4, 64), B(2, 4, 32), B(1, 4, 32, kv_in_smem=True),
                  B(1, 8, 64, kv_in_smem=True), B(1, 4, 64, kv_in_smem=True), B(2, 4, 32, kv_in_smem=True)]
    if args.tiles:  # qp_rows,warps,block_m[,kv_in_smem[,min_blocks_sm70[,min_blocks_emulated[,lean]]]]
        candidates = [B(*t[:3], bool(t[3]) if len(t) > 3 else False, *t[4:6], lean=len(t) > 6 and bool(t[6]))
                      for t in args.tiles]
    rows = []
    cases = [(d, n, c, t, a) for d in args.head_dims for n in args.seqlens for c in args.causal
             for t in candidates for a in args.accum]
    for d, n, causal, tile, accum in tqdm(cases, desc="bwd sweep"):
        heads, batch = args.hidden // d, max(1, args.tokens // n)
        try:
            configs.bwd_variant(d, tile, accum == "fp16", False, True).compile(torch.cuda.get_device_capability()[0] * 10)
        except Exception:  # no such shape for this head_dim (static_assert) or out of shared memory
            continue
        params = AttentionParams(softmax_scale=d**-0.5, causal=causal)

        def bwd(q, k, v, _cache={}):
            key = id(q)
            if key not in _cache:
                out, lse = launch.forward(q, k, v, None, None, n, n, params, None, "fp32")
                _cache[key] = (out, lse, torch.randn_like(out))
            out, lse, dout = _cache[key]
            return launch.backward(dout, q, k, v, out, lse, None, None, n, n, params, None, accum, False, tile=tile)

        ms, peak, note = measure(bwd, batch, n, heads, d, "fwd", args)
        rows.append(dict(backend=f"volta-bwd-{accum}acc", tile=f"qp{tile.quad_pair_rows}x{4 // tile.quad_pair_rows} "
                         f"n{tile.block_n} m{tile.block_m} w{tile.warps}{' kvsmem' if tile.kv_in_smem else ''} "
                         f"occ{tile.min_blocks_per_sm}.{tile.min_blocks_emulated}{' lean' if tile.lean else ''}",
                         head_dim=d, seqlen=n, causal=causal, ms=ms,
                         tflops=(flops("bwd", batch, heads, n, n, d, causal) / ms / 1e9) if ms else None,
                         peak_mib=peak, note=note))
    return rows


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


def run_sweep(args) -> list[dict]:
    T = configs.FwdTile
    if args.tiles:
        candidates = [T(*t[:6], q_in_smem=bool(t[6]) if len(t) > 6 else False,
                        split_masked=bool(t[7]) if len(t) > 7 else False) for t in args.tiles]
    else:
        candidates = [
            T(2, 1, 4, 32, q_in_smem=True), T(2, 1, 4, 16, q_in_smem=True), T(1, 1, 4, 32, q_in_smem=True),
            T(2, 1, 4, 32, q_in_smem=True, split_masked=True), T(2, 1, 4, 16, q_in_smem=True, split_masked=True),
            T(1, 1, 4, 32, q_in_smem=True, split_masked=True), T(2, 1, 8, 16, q_in_smem=True, split_masked=True),
            T(2, 1, 4, 32), T(4, 1, 4, 32),
        ]
    rows = []
    cases = [(d, n, c, t, a) for d in args.head_dims for n in args.seqlens for c in args.causal
             for t in candidates for a in args.accum]
    for d, n, causal, tile, accum in tqdm(cases, desc="sweep"):
        heads, batch = args.hidden // d, max(1, args.tokens // n)
        try:
            configs.fwd_variant(d, tile, accum == "fp16", False)
        except Exception as error:  # invalid shape for this head_dim
            continue
        ms, peak, note = measure(volta_fn("fwd", causal, accum, tile), batch, n, heads, d, "fwd", args)
        fl = flops("fwd", batch, heads, n, n, d, causal)
        rows.append(dict(backend=f"volta-{accum}acc", tile=f"qp{tile.quad_pair_rows}x{4 // tile.quad_pair_rows} "
                         f"m{tile.block_m} n{tile.block_n} w{tile.warps} mt{tile.m_tiles} "
                         f"occ{tile.min_blocks_per_sm}.{tile.min_blocks_emulated}{' qsmem' if tile.q_in_smem else ''}"
                         f"{' split' if tile.split_masked else ''}",
                         head_dim=d, seqlen=n,
                         causal=causal, ms=ms, tflops=(fl / ms / 1e9) if ms else None, peak_mib=peak, note=note))
    return rows


def markdown(rows: list[dict], args) -> str:
    columns = ["backend"] + (["tile"] if args.sweep else []) + ["head_dim", "seqlen", "causal", "ms", "tflops",
                                                                 "peak_mib", "note"]
    lines = [
        f"pass: {args.pass_name}; FLOPs = {'4*B*H*N^2*D' if args.pass_name == 'fwd' else '2.5 * 4*B*H*N^2*D'}"
        f" (half under causal); B*N = {args.tokens}, H = {args.hidden}/head_dim; median of {args.repeats} after "
        f"{args.warmup} warm-up runs; device: {torch.cuda.get_device_name()}",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
    for r in rows:
        cell = lambda c: ("%.3f" % r[c] if c == "ms" else "%.2f" % r[c] if c == "tflops" else "%.0f" % r[c]) \
            if isinstance(r.get(c), float) else str(r.get(c, ""))
        lines.append("| " + " | ".join(cell(c) for c in columns) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    keys = sorted({(r["head_dim"], r["causal"]) for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.8), squeeze=False)
    for ax, (d, causal) in zip(axes[0], keys):
        label_key = "tile" if "tile" in rows[0] else "backend"
        for label in sorted({r[label_key] + ("" if label_key == "backend" else " " + r["backend"]) for r in rows}):
            pts = [(r["seqlen"], r["tflops"]) for r in rows if r["head_dim"] == d and r["causal"] == causal
                   and (r[label_key] + ("" if label_key == "backend" else " " + r["backend"])) == label and r["tflops"]]
            if pts:
                ax.plot(*zip(*sorted(pts)), marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_title(f"head_dim {d}, {'causal' if causal else 'full'}")
        ax.set_xlabel("seqlen")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pass", dest="pass_name", choices=["fwd", "bwd", "fwdbwd"], default="fwd")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--causal", type=lambda s: s.lower() in ("1", "true", "yes"), nargs="+", default=[False, True])
    parser.add_argument("--accum", nargs="+", default=["fp32", "fp16"], choices=["fp32", "fp16"])
    parser.add_argument("--baselines", nargs="*", default=["sdpa-flash", "sdpa-efficient", "eager"])
    parser.add_argument("--tokens", type=int, default=16384, help="batch * seqlen")
    parser.add_argument("--hidden", type=int, default=2048, help="heads * head_dim")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--input-sets", type=int, default=3)
    parser.add_argument("--eager-limit-gb", type=float, default=24.0)
    parser.add_argument("--sweep", action="store_true", help="sweep the Volta tile shapes (--pass fwd or bwd)")
    parser.add_argument("--tiles", type=lambda s: tuple(int(x) for x in s.split(",")), nargs="*",
                        help="sweep candidates: forward qp_rows,m_tiles,warps,block_n[,min_blocks_sm70,min_blocks_emulated"
                             "[,q_in_smem[,split]]]; backward qp_rows,warps,block_m[,kv_in_smem[,min_blocks_sm70"
                             "[,min_blocks_emulated[,lean]]]]")
    parser.add_argument("--varlen-max", type=int, nargs="*", default=[],
                        help="varlen benchmark: maximum lengths (e.g. 512 2048 8192); lengths uniform in [1, max]")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_attention.py needs a CUDA GPU")
    os.environ.setdefault("VOLTA_TRAIN_BACKEND", "kernel")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.varlen_max:
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
        plot([dict(r, tflops=r["speedup"], backend="speedup over padded") for r in rows], args.out / f"{stem}.png",
             f"varlen speedup over padded on {torch.cuda.get_device_name()}")
        print("\n".join(lines))
        return
    if args.sweep:
        rows = run_bwd_sweep(args) if args.pass_name == "bwd" else run_sweep(args)
    else:
        rows = run_benchmark(args)
    stem = f"{'sweep' if args.sweep else 'bench'}_{args.pass_name}"
    table = markdown(rows, args)
    (args.out / f"{stem}.md").write_text(table + "\n")
    (args.out / f"{stem}.json").write_text(json.dumps(rows, indent=1))
    plot(rows, args.out / f"{stem}.png", f"{stem} on {torch.cuda.get_device_name()}")
    print(table)


if __name__ == "__main__":
    main()
