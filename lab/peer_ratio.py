#!/usr/bin/env python3
"""volta_train against the CUTLASS Sm70 peer, measured in one lease: the ratio table the backward issue asks for.

    python lab/peer_ratio.py --volta DIR/bench.json --cutlass DIR/cutlass_sm70.json --out DIR

Reads ``scripts/bench_attention.py``'s bench.json (volta_train rows) and ``lab/bench_cutlass_sm70.py``'s
cutlass_sm70.json (training-shape cases), pairs them by (pass, head_dim, N, causal) and writes peer_ratio.md and
peer_ratio.png: TFLOP/s of each volta_train backend, the peer's (backward: best key split, and PyTorch's own split)
and their ratio. FLOPs are both tools' (forward 4*B*H*N^2*D, half under causal, backward 2.5x).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def pairs(volta_rows: list[dict], peer_cases: list[dict]) -> list[dict]:
    peer = {(c["pass"], c["head_dim"], c["seqlen_q"], bool(c["causal"])): c for c in peer_cases
            if c.get("tag") == "train" and c.get("tflops")}
    out = []
    for r in volta_rows:
        if not r["backend"].startswith("volta-") or not r.get("tflops"):
            continue
        c = peer.get((r["pass_name"], r["head_dim"], r["seqlen"], bool(r["causal"])))
        if c is None:
            continue
        out.append(dict(pass_name=r["pass_name"], backend=r["backend"], head_dim=r["head_dim"], seqlen=r["seqlen"],
                        causal=bool(r["causal"]), tflops=r["tflops"], peer_tflops=c["tflops"],
                        peer_pytorch_split=c.get("tflops_pytorch_split"), ratio=r["tflops"] / c["tflops"]))
    return out


def markdown(rows: list[dict], volta_env: dict, peer_env: dict) -> str:
    lines = [f"volta_train against the CUTLASS Sm70 kernels in one lease on {volta_env.get('gpu', '?')} "
             f"(volta_train {volta_env.get('volta_train', '?')}, torch {volta_env.get('torch', '?')}; peer: CUTLASS "
             f"{peer_env.get('cutlass_version', '?')}, CUDA runtime {peer_env.get('runtime_version', '?')}). FLOPs: forward 4*B*H*N^2*D, half under "
             "causal, backward 2.5x; B*N = 16384, H = 2048 / head_dim. Peer backward: best key split of 1-8 "
             "(PyTorch's own split in brackets).", "",
             "| pass | backend | head_dim | N | causal | TFLOP/s | peer TFLOP/s | ratio |", "|" + "---|" * 8]
    for r in sorted(rows, key=lambda r: (r["pass_name"] != "fwd", r["backend"], r["head_dim"], r["causal"],
                                         r["seqlen"])):
        pt = f" ({r['peer_pytorch_split']:.2f})" if r.get("peer_pytorch_split") else ""
        lines.append(f"| {r['pass_name']} | {r['backend']} | {r['head_dim']} | {r['seqlen']} | "
                     f"{'yes' if r['causal'] else 'no'} | {r['tflops']:.2f} | {r['peer_tflops']:.2f}{pt} | "
                     f"{r['ratio']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--volta", type=Path, required=True, help="bench.json of scripts/bench_attention.py")
    p.add_argument("--cutlass", type=Path, required=True, help="cutlass_sm70.json of lab/bench_cutlass_sm70.py")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    for f in (args.volta, args.cutlass):
        if not f.is_file():
            print(f"error: {f}: no such file", file=sys.stderr)
            return 2
    volta, peer = json.loads(args.volta.read_text()), json.loads(args.cutlass.read_text())
    rows = pairs(volta["rows"], peer["cases"])
    if not rows:
        print("error: no (pass, head_dim, N, causal) measured by both", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    table = markdown(rows, volta.get("environment", {}), peer.get("environment", {}))
    (args.out / "peer_ratio.md").write_text(table, encoding="utf-8")
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from volta_train.bench import plot_panels
    panel = lambda r: (r["pass_name"], r["head_dim"], r["causal"])  # noqa: E731
    plot_panels([dict(r, tflops=r["ratio"]) for r in rows], args.out / "peer_ratio.png",
                "volta_train / CUTLASS Sm70 (same lease)", sorted({panel(r) for r in rows}), panel, "seqlen", "tflops",
                lambda k: f"{k[0]}, head_dim {k[1]}, {'causal' if k[2] else 'full'}", "N (seqlen)", "speed ratio")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
