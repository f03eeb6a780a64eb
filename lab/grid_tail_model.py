"""Tail of the dK/dV kernel's grid under causal attention: a list-scheduling model of CTAs dispatched in grid order.

Each CTA is one key block of one (batch, kv head); under causal attention key block j sees the queries from its first
key on, so its cost is taken as that many query rows (rounded up to the tile's query block). CTAs go, in the order the
hardware walks the grid (x fastest), to whichever SM frees first (``ctas_per_sm`` slots per SM). The table gives each
order's makespan over the ideal (total cost / slots). No GPU needed; it models scheduling only, not memory.

    python lab/grid_tail_model.py [--sms 132] [--block-n 96] [--block-m 32] [--tokens 16384] [--head-dim 128]
"""

from __future__ import annotations

import argparse
import heapq


def makespan(costs: list[int], slots: int) -> int:
    """Greedy list scheduling in the given order onto ``slots`` identical slots."""
    free = [0] * slots
    heapq.heapify(free)
    for c in costs:
        heapq.heappush(free, heapq.heappop(free) + c)
    return max(free)


def grid_costs(seqlen: int, block_n: int, block_m: int, bh: int, keys_fastest: bool) -> list[int]:
    blocks = -(-seqlen // block_n)
    cost = [-(-(seqlen - j * block_n) // block_m) * block_m for j in range(blocks)]
    if keys_fastest:
        return [cost[j] for _ in range(bh) for j in range(blocks)]
    return [cost[j] for j in range(blocks) for _ in range(bh)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sms", type=int, default=132, help="SMs (H100 SXM: 132, V100: 80)")
    parser.add_argument("--ctas-per-sm", type=int, default=1)
    parser.add_argument("--block-n", type=int, default=96, help="keys per CTA (the d128 tiles: 96)")
    parser.add_argument("--block-m", type=int, default=32, help="queries per iteration")
    parser.add_argument("--tokens", type=int, default=16384, help="batch x seqlen, as in bwd_check.sh")
    parser.add_argument("--head-dim", type=int, default=128, help="heads = 2048 / head_dim, as in bwd_check.sh")
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096])
    args = parser.parse_args(argv)
    slots = args.sms * args.ctas_per_sm
    print("| N | batch x heads | key blocks | key blocks fastest | heads fastest |")
    print("| --- | --- | --- | --- | --- |")
    for n in args.seqlens:
        bh = args.tokens // n * (2048 // args.head_dim)
        row = []
        for keys_fastest in (True, False):
            costs = grid_costs(n, args.block_n, args.block_m, bh, keys_fastest)
            ideal = sum(costs) / slots
            row.append(f"{makespan(costs, slots) / ideal - 1:+.1%}")
        print(f"| {n} | {bh} | {-(-n // args.block_n)} | {row[0]} | {row[1]} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
