#!/usr/bin/env python3
"""Tile-shape sweeps of the Volta kernels on a CUDA GPU: forward or backward TFLOP/s of candidate tiles, the
measurements behind the sm_80+ tile tables (volta_train/kernels/tiles.py; docs/performance.md).

    python lab/tile_sweep.py                                  # forward tile candidates, head_dim 64/128, N 1k-8k
    python lab/tile_sweep.py --pass bwd                       # backward tile candidates
    python lab/tile_sweep.py --tiles 2,1,4,32,1,4,1 --head-dims 64 --causal true

The shapes, timing and FLOP count are volta_train/bench.py's (the user benchmark, scripts/bench_attention.py).
Writes sweep_<pass>.md, .json and .png to --out.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import torch

from volta_train import bench
from volta_train.bench import flops, measure
from volta_train.dispatch import BACKEND_ENV
from volta_train.kernels import launch, tiles
from volta_train.options import AttentionOptions

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover
    tqdm = lambda x, **_: x  # noqa: E731


def forward_on_tile(causal: bool, accum: str, tile: tiles.FwdTile):
    """The Volta forward run on a given tile (a sweep candidate) through the launcher's tile override."""
    def run(q, k, v):
        params = AttentionOptions(softmax_scale=q.shape[-1] ** -0.5, causal=causal, accum=accum)
        return launch.forward(q, k, v, None, None, q.shape[1], k.shape[1], params, None, tile=tile)
    return run


def run_bwd_sweep(args) -> list[dict]:
    def B(qp_rows, warps, block_m, kv_in_smem=False, min_blocks_sm70=1, min_blocks_emulated=1, **more):
        return tiles.BwdTile(quad_pair_rows=qp_rows, warps=warps, block_m=block_m, kv_in_smem=bool(kv_in_smem),
                             min_blocks_per_sm=min_blocks_sm70, min_blocks_emulated=min_blocks_emulated, **more)

    candidates = [B(1, 4, 32), B(1, 8, 64), B(1, 4, 64), B(2, 4, 32), B(1, 4, 32, kv_in_smem=True),
                  B(1, 8, 64, kv_in_smem=True), B(1, 4, 64, kv_in_smem=True), B(2, 4, 32, kv_in_smem=True)]
    if args.tiles:  # qp_rows,warps,block_m[,kv_in_smem[,min_blocks_sm70[,min_blocks_emulated[,lean[,out_split
        # [,dq_from_k[,dkdv_row_b]]]]]]]
        candidates = [B(*t[:6], lean=len(t) > 6 and bool(t[6]), out_split=t[7] if len(t) > 7 else 1,
                        dq_atomic=len(t) <= 7 or t[7] == 1, dq_from_k=len(t) > 8 and bool(t[8]),
                        dkdv_row_b=len(t) > 9 and bool(t[9]))
                      for t in args.tiles]
    rows = []
    cases = [(d, n, c, t, a) for d in args.head_dims for n in args.seqlens for c in args.causal
             for t in candidates for a in args.accum]
    for d, n, causal, tile, accum in tqdm(cases, desc="bwd sweep"):
        heads, batch = args.hidden // d, max(1, args.tokens // n)
        try:
            tiles.bwd_variant(d, tile, accum == "fp16", False, tiles.dq_by_atomics(tile, False)).compile(
                torch.cuda.get_device_capability()[0] * 10)
        except Exception:  # no such shape for this head_dim (static_assert) or out of shared memory
            continue
        params = AttentionOptions(softmax_scale=d**-0.5, causal=causal)

        def bwd(q, k, v, _cache={}):
            key = id(q)
            if key not in _cache:
                out, lse = launch.forward(q, k, v, None, None, n, n, dataclasses.replace(params, accum="fp32"), None)
                _cache[key] = (out, lse, torch.randn_like(out))
            out, lse, dout = _cache[key]
            return launch.backward(dout, q, k, v, out, lse, None, None, n, n, dataclasses.replace(params, bwd_accum=accum), None,
                                   tile=tile)

        ms, peak, note = measure(bwd, batch, n, heads, d, "fwd", args)
        rows.append(dict(backend=f"volta-bwd-{accum}acc", tile=f"qp{tile.quad_pair_rows}x{4 // tile.quad_pair_rows} "
                         f"n{tile.block_n} m{tile.block_m} w{tile.warps}{' kvsmem' if tile.kv_in_smem else ''} "
                         f"occ{tile.min_blocks_per_sm}.{tile.min_blocks_emulated}{' lean' if tile.lean else ''}"
                         f"{f' split{tile.out_split}' if tile.out_split > 1 else ''}{' dqk' if tile.dq_from_k else ''}"
                         f"{' rowb' if tile.dkdv_row_b else ''}",
                         head_dim=d, seqlen=n, causal=causal, ms=ms,
                         tflops=(flops("bwd", batch, heads, n, n, d, causal) / ms / 1e9) if ms else None,
                         peak_mib=peak, note=note))
    return rows


def run_sweep(args) -> list[dict]:
    T = tiles.FwdTile
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
            tiles.fwd_variant(d, tile, accum == "fp16", False)
        except Exception:  # invalid shape for this head_dim
            continue
        ms, peak, note = measure(forward_on_tile(causal, accum, tile), batch, n, heads, d, "fwd", args)
        fl = flops("fwd", batch, heads, n, n, d, causal)
        rows.append(dict(backend=f"volta-{accum}acc", tile=f"qp{tile.quad_pair_rows}x{4 // tile.quad_pair_rows} "
                         f"m{tile.block_m} n{tile.block_n} w{tile.warps} mt{tile.m_tiles} "
                         f"occ{tile.min_blocks_per_sm}.{tile.min_blocks_emulated}{' qsmem' if tile.q_in_smem else ''}"
                         f"{' split' if tile.split_masked else ''}",
                         head_dim=d, seqlen=n,
                         causal=causal, ms=ms, tflops=(fl / ms / 1e9) if ms else None, peak_mib=peak, note=note))
    return rows


def markdown(rows: list[dict], args) -> str:
    columns = ["backend", "tile", "head_dim", "seqlen", "causal", "ms", "tflops", "peak_mib", "note"]
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
    parser = bench.build_parser()
    parser.description = __doc__
    parser.add_argument("--pass", dest="pass_name", choices=["fwd", "bwd"], default="fwd", help="the pass to sweep")
    parser.add_argument("--tiles", type=lambda s: tuple(int(x) for x in s.split(",")), nargs="*",
                        help="candidates: forward qp_rows,m_tiles,warps,block_n[,min_blocks_sm70,min_blocks_emulated"
                             "[,q_in_smem[,split]]]; backward qp_rows,warps,block_m[,kv_in_smem[,min_blocks_sm70"
                             "[,min_blocks_emulated[,lean[,out_split[,dq_from_k[,dkdv_row_b]]]]]]]] (out_split > 1: dQ by "
                             "the dQ kernel)")
    parser.set_defaults(seqlens=[1024, 2048, 4096, 8192], passes=["fwd"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("tile_sweep.py needs a CUDA GPU")
    os.environ.setdefault(BACKEND_ENV, "kernel")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = run_bwd_sweep(args) if args.pass_name == "bwd" else run_sweep(args)
    stem = f"sweep_{args.pass_name}"
    table = markdown(rows, args)
    (args.out / f"{stem}.md").write_text(table + "\n")
    (args.out / f"{stem}.json").write_text(json.dumps(rows, indent=1))
    plot(rows, args.out / f"{stem}.png", f"{stem} on {torch.cuda.get_device_name()}")
    print(table)


if __name__ == "__main__":
    main()
