#!/usr/bin/env python3
"""Decoding benchmark: flash_attn_with_kvcache on the Volta split-KV kernel against PyTorch SDPA and volta_train's
reference backend (needs a CUDA GPU).

    python scripts/bench_decode.py                  # N 1k-32k, batch 1 and 8, 32 heads on 8 and 32 KV heads, d 64/128
    python scripts/bench_decode.py --seqlens 4096 --batches 1 --kv-heads 8 --head-dims 128 --backends volta-kernel

One query token per sequence (seqlen_q 1), ``--heads`` query heads, a KV cache of exactly N keys per sequence (every
sequence N long, cache_seqlens = N), attention over the cache only (``--append`` also appends one token per call, as a
decoding step does). Backends:

* ``volta-kernel``: ``volta_train.flash_attn_with_kvcache`` with VOLTA_TRAIN_BACKEND=kernel (the split-KV kernel,
  volta_train/kernels/decode.py; the split count it picks is in the ``splits`` column);
* ``volta-kernel-device-checks``: the same with VOLTA_TRAIN_KVCACHE_CHECK=device: the argument checks run on the GPU
  and nothing is read to the host (no wait for the GPU; the split planned for the whole cache);
* ``volta-reference``: the same call on the reference backend (VOLTA_TRAIN_BACKEND=reference);
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` on [B, H, 1, D] queries and [B, H_kv, N, D] caches
  (``enable_gqa=True`` when H_kv < H), PyTorch's own backend choice;
* ``sdpa-efficient``: the memory-efficient (CUTLASS) backend, the one SDPA runs on a V100, on caches expanded to H
  heads before timing (what ``repeat_kv`` gives a model; it reads H / H_kv times the bytes of the GQA cache).

Paged caches (``--page-sizes 256 512``): the same cache contents in shuffled pages of that many keys
(``block_table``); ``volta-kernel-paged`` times flash_attn_with_kvcache on them (``page`` column), next to the
contiguous ``volta-kernel`` rows. ``--varlen-paged`` adds flash_attn_varlen_func on those pages with ``--varlen-q``
queries per sequence (``seqlen_q`` column, causal, no gradient): ``varlen-paged-kernel``, the decoding kernel reading
the pages through the table, against ``varlen-paged-gather``, the pages gathered into packed k/v
(``kvcache.gather_paged_varlen``, timed with the call) and the varlen forward kernel, which is what the API runs when
gradients are needed. Their TFLOP/s count ``seqlen_q`` times the decoding FLOPs (the causal mask's few skipped keys
included).

Metrics: TFLOP/s = 4 * B * H * N * D / time (Q K^T and P V, 2 FLOPs per multiply-add); GB/s = 2 * B * H_kv * N * D * 2
bytes / time: K and V of the cache in fp16, read once, the least any decoding kernel moves (q, the output and the split
partials are not counted; the same byte count for every backend, so ``sdpa-efficient``'s figure is of the GQA cache
too). Times are medians of ``--repeats`` CUDA-event timings after ``--warmup`` calls, cycling through enough input sets
to exceed ``--l2-mb`` so the L2 cache does not hold the caches: ``ms`` times one call alone (the host's work and any
wait for the GPU included), ``ms_stream`` a burst of ``--burst`` calls queued back to back, per call (as in a decoding
loop, where the host runs ahead of the GPU unless a call waits for it). ``max_abs``: error of the output of batch entry 0
against float64 attention. Writes bench_decode.md, bench_decode.json and bench_decode.png to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

BACKENDS = ("volta-kernel", "volta-kernel-device-checks", "volta-reference", "sdpa", "sdpa-efficient")
VARLEN_BACKENDS = ("varlen-paged-kernel", "varlen-paged-gather")


def decode_flops(batch: int, heads: int, seqlen_k: int, head_dim: int) -> float:
    """Q K^T and P V of one query token per head: 4 * B * H * N * D."""
    return 4.0 * batch * heads * seqlen_k * head_dim


def kv_bytes(batch: int, kv_heads: int, seqlen_k: int, head_dim: int, element_bytes: int = 2) -> float:
    """K and V of the cache, read once: 2 * B * H_kv * N * D * element_bytes."""
    return 2.0 * batch * kv_heads * seqlen_k * head_dim * element_bytes


def input_sets_for(set_bytes: float, l2_mb: float, most: int = 64) -> int:
    """Input sets to cycle through so that together they exceed the L2 cache (l2_mb), at most ``most``."""
    return max(1, min(most, math.ceil(l2_mb * 2**20 / max(set_bytes, 1.0))))


def make_case(batch, heads, kv_heads, seqlen_k, head_dim, sets, backends, device="cuda"):
    cases = []
    for _ in range(sets):
        q = torch.randn(batch, 1, heads, head_dim, device=device, dtype=torch.float16)
        k_cache = torch.randn(batch, seqlen_k + 1, kv_heads, head_dim, device=device, dtype=torch.float16)
        v_cache = torch.randn_like(k_cache)
        case = dict(q=q, k_cache=k_cache, v_cache=v_cache,
                    seqlens=torch.full((batch,), seqlen_k, dtype=torch.int32, device=device),
                    k_new=torch.randn(batch, 1, kv_heads, head_dim, device=device, dtype=torch.float16))
        if "sdpa" in backends or "sdpa-efficient" in backends:  # the [B, H_kv, N, D] layout SDPA caches use
            case["k_bhnd"] = k_cache[:, :seqlen_k].transpose(1, 2).contiguous()
            case["v_bhnd"] = v_cache[:, :seqlen_k].transpose(1, 2).contiguous()
        if "sdpa-efficient" in backends:
            group = heads // kv_heads
            case["k_rep"] = case["k_bhnd"].repeat_interleave(group, 1) if group > 1 else case["k_bhnd"]
            case["v_rep"] = case["v_bhnd"].repeat_interleave(group, 1) if group > 1 else case["v_bhnd"]
        cases.append(case)
    return cases


def paged(case: dict, page_size: int, generator: torch.Generator) -> dict:
    """The case's caches as shuffled pages of ``page_size`` keys: pools [B * pages, page_size, H_kv, D] holding the
    same keys at the same logical positions, and the int32 block table [B, pages]."""
    k_cache = case["k_cache"]
    batch, length = k_cache.shape[:2]
    pages = -(-length // page_size)
    order = torch.randperm(batch * pages, generator=generator).to(k_cache.device)
    table = order.view(batch, pages).to(torch.int32)
    pools = []
    for cache in (k_cache, case["v_cache"]):
        padded = torch.zeros(batch, pages * page_size, *cache.shape[2:], dtype=cache.dtype, device=cache.device)
        padded[:, :length] = cache
        pool = torch.empty(batch * pages, page_size, *cache.shape[2:], dtype=cache.dtype, device=cache.device)
        pool[order] = padded.view(batch * pages, page_size, *cache.shape[2:])
        pools.append(pool)
    return dict(case, k_cache=pools[0], v_cache=pools[1], block_table=table)


def varlen_case(case: dict, seqlen_q: int, seqlen_k: int) -> dict:
    """A paged case with ``seqlen_q`` packed queries per sequence for flash_attn_varlen_func (keys: the first
    ``seqlen_k`` of each sequence's pages)."""
    batch, heads, head_dim = case["q"].shape[0], case["q"].shape[2], case["q"].shape[3]
    device = case["q"].device
    steps = torch.arange(batch + 1, dtype=torch.int32, device=device)
    return dict(case, q_packed=torch.randn(batch * seqlen_q, heads, head_dim, device=device, dtype=torch.float16),
                cu_q=steps * seqlen_q, cu_k=steps * seqlen_k, seqlen_q=seqlen_q, seqlen_k=seqlen_k)


def backend_fn(name: str, append: bool):
    import volta_train

    if name.startswith("varlen-paged"):
        from volta_train import kvcache

        def run(c):
            os.environ["VOLTA_TRAIN_BACKEND"] = "kernel"
            lengths = [c["seqlen_k"]] * (c["cu_k"].numel() - 1)
            args = (c["cu_q"], c["cu_k"], c["seqlen_q"], c["seqlen_k"])
            with torch.no_grad():
                if name == "varlen-paged-kernel":
                    return volta_train.flash_attn_varlen_func(c["q_packed"], c["k_cache"], c["v_cache"], *args,
                                                              causal=True, block_table=c["block_table"])
                k, v = kvcache.gather_paged_varlen(c["k_cache"], c["v_cache"], c["block_table"], lengths)
                return volta_train.flash_attn_varlen_func(c["q_packed"], k, v, *args, causal=True)
        return run
    if name.startswith("volta"):
        policy = "reference" if name == "volta-reference" else "kernel"
        checks = "device" if name == "volta-kernel-device-checks" else "host"

        def run(c):
            os.environ["VOLTA_TRAIN_BACKEND"] = policy
            os.environ["VOLTA_TRAIN_KVCACHE_CHECK"] = checks
            extra = dict(k=c["k_new"], v=c["k_new"]) if append else {}
            return volta_train.flash_attn_with_kvcache(c["q"], c["k_cache"], c["v_cache"], cache_seqlens=c["seqlens"],
                                                       block_table=c.get("block_table"), **extra)
        return run
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(c):
        q = c["q"].transpose(1, 2)
        if name == "sdpa":
            gqa = c["k_bhnd"].shape[1] != q.shape[1]
            out = F.scaled_dot_product_attention(q, c["k_bhnd"], c["v_bhnd"], enable_gqa=gqa)
        else:
            with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
                out = F.scaled_dot_product_attention(q, c["k_rep"], c["v_rep"])
        return out.transpose(1, 2)
    return run


def time_ms(fn, cases, warmup: int, repeats: int, burst: int = 1) -> float:
    from volta_train.bench import time_ms as bench_time_ms

    return bench_time_ms(fn, [(c,) for c in cases], warmup, repeats, burst)


def max_abs_error(out: torch.Tensor, case: dict, seqlen_k: int) -> float:
    """Output of batch entry 0 against float64 attention over its N cache keys (the reference backend)."""
    import volta_train

    q, k, v = (t[:1, :seqlen_k].double() if name != "q" else t[:1].double()
               for name, t in (("q", case["q"]), ("k", case["k_cache"]), ("v", case["v_cache"])))
    policy = os.environ.pop("VOLTA_TRAIN_BACKEND", None)  # the timed call set "kernel", which refuses float64
    try:
        want = volta_train.flash_attn_func(q, k, v)
    finally:
        if policy is not None:
            os.environ["VOLTA_TRAIN_BACKEND"] = policy
    return (out[:1].double() - want).abs().max().item()


def run(args) -> list[dict]:
    from volta_train.kernels import decode, tiles

    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    arch = 10 * torch.cuda.get_device_capability()[0] + torch.cuda.get_device_capability()[1]
    cases = [(b, hk, d, n) for d in args.head_dims for b in args.batches for hk in args.kv_heads for n in args.seqlens]
    for batch, kv_heads, d, n in cases:
        fl, nbytes = decode_flops(batch, args.heads, n, d), kv_bytes(batch, kv_heads, n, d)
        tile = tiles.decode_tile(d, arch)
        packed = decode.pack_gqa(1, args.heads, kv_heads, False, -1)
        heads_k = kv_heads if packed else args.heads
        ctas = batch * heads_k * -(-(args.heads // kv_heads if packed else 1) // tile.block_m)
        keys = n + 1 if args.append else n
        splits, _ = decode.split_plan(ctas, -(-keys // tile.block_n), sms)
        torch.cuda.empty_cache()
        sets = input_sets_for(nbytes, args.l2_mb)
        try:
            inputs = make_case(batch, args.heads, kv_heads, n, d, sets, args.backends)
        except torch.OutOfMemoryError as error:
            rows.append(dict(batch=batch, heads=args.heads, kv_heads=kv_heads, head_dim=d, seqlen_k=n,
                             backend="all", note=f"inputs: {str(error).splitlines()[0][:80]}"))
            continue
        runs = [(name, inputs, 1, None) for name in args.backends]  # (backend, input sets, seqlen_q, page size)
        generator = torch.Generator().manual_seed(0)
        try:
            for page in args.page_sizes:
                pages = [paged(c, page, generator) for c in inputs]
                if "volta-kernel" in args.backends:
                    runs.append(("volta-kernel-paged", pages, 1, page))
                if args.varlen_paged:
                    for sq in args.varlen_q:
                        sets = [varlen_case(c, sq, keys) for c in pages]
                        runs += [(name, sets, sq, page) for name in VARLEN_BACKENDS]
        except torch.OutOfMemoryError as error:
            rows.append(dict(batch=batch, heads=args.heads, kv_heads=kv_heads, head_dim=d, seqlen_k=n,
                             backend="paged", note=f"inputs: {str(error).splitlines()[0][:80]}"))
        for name, sets, sq, page in runs:
            decoding = not name.startswith("varlen")
            row = dict(batch=batch, heads=args.heads, kv_heads=kv_heads, head_dim=d, seqlen_q=sq, seqlen_k=n,
                       page=page, backend=name, splits=splits if name.startswith("volta-kernel") else None, ms=None,
                       ms_stream=None, tflops=None, gbps=None, max_abs=None, note="")
            fn = backend_fn(name, args.append and decoding)
            try:
                ms = time_ms(fn, sets, args.warmup, args.repeats)
                row.update(ms=ms, tflops=sq * fl / ms / 1e9, gbps=nbytes / ms / 1e6)
                if args.burst > 1:
                    row["ms_stream"] = time_ms(fn, sets, args.warmup, args.repeats, args.burst)
                if args.accuracy and decoding:
                    row["max_abs"] = max_abs_error(fn(inputs[0] if page is None else sets[0]), inputs[0], keys)
            except (RuntimeError, NotImplementedError) as error:  # backend unavailable here, out of memory
                row["note"] = str(error).splitlines()[0][:100]
            rows.append(row)
            print(_line(row), flush=True)
        del inputs, runs
    return rows


COLUMNS = ("batch", "heads", "kv_heads", "head_dim", "seqlen_q", "seqlen_k", "page", "backend", "splits", "ms",
           "ms_stream", "tflops", "gbps", "max_abs", "note")


def _cell(row: dict, column: str) -> str:
    value = row.get(column)
    if value is None:
        return ""
    if column in ("ms", "ms_stream"):
        return f"{value:.4f}"
    if column in ("tflops", "gbps"):
        return f"{value:.2f}" if column == "tflops" else f"{value:.0f}"
    if column == "max_abs":
        return f"{value:.1e}"
    return str(value)


def _line(row: dict) -> str:
    return "| " + " | ".join(_cell(row, c) for c in COLUMNS) + " |"


def markdown(rows: list[dict], args, env: dict[str, str]) -> str:
    lines = ["environment: " + "; ".join(f"{k} {v}" for k, v in env.items() if v), "",
             f"decoding: seqlen_q 1, {args.heads} query heads, every sequence's cache exactly seqlen_k keys"
             f"{', one token appended per call' if args.append else ''}; TFLOP/s = 4*B*H*N*D / time; GB/s = "
             f"2*B*H_kv*N*D*2 bytes (K and V in fp16, read once) / time; median of {args.repeats} CUDA-event timings "
             f"after {args.warmup} warm-up calls; max_abs: batch entry 0 against float64; splits: the split-KV "
             "kernel's key splits (volta_train/kernels/decode.py split_plan); page: keys per page of a paged cache "
             "(block_table; empty: contiguous); varlen-paged rows: flash_attn_varlen_func with seqlen_q queries per "
             "sequence, causal, TFLOP/s counting seqlen_q times the decoding FLOPs", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    return "\n".join(lines + [_line(r) for r in rows])


def plot(rows: list[dict], path: Path, title: str) -> Path | None:
    """GB/s against N, one panel per (batch, kv_heads, head_dim), one line per backend."""
    from volta_train.bench import plot_panels

    heads = rows[0]["heads"] if rows else 0
    panel = lambda r: (r["batch"], r["kv_heads"], r["head_dim"])  # noqa: E731
    return plot_panels(rows, path, title, sorted({panel(r) for r in rows if r.get("gbps")}), panel, "seqlen_k", "gbps",
                       lambda k: f"batch {k[0]}, {heads}/{k[1]} heads, d {k[2]}", "cache length N", "GB/s of K/V")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--append", action="store_true", help="append one token per call (a decoding step)")
    parser.add_argument("--page-sizes", type=int, nargs="*", default=[],
                        help="also time the decoding kernel on the same caches in pages of these many keys")
    parser.add_argument("--varlen-paged", action="store_true",
                        help="also time flash_attn_varlen_func on the paged caches: kernel path vs gather path "
                             "(page sizes: --page-sizes, default 256)")
    parser.add_argument("--varlen-q", type=int, nargs="+", default=[1, 16], help="queries per sequence (--varlen-paged)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--burst", type=int, default=20, help="calls per ms_stream timing (1: no ms_stream)")
    parser.add_argument("--l2-mb", type=float, default=100.0, help="cycle input sets until they exceed this (MiB)")
    parser.add_argument("--no-accuracy", dest="accuracy", action="store_false")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.varlen_paged and not args.page_sizes:
        args.page_sizes = [256]
    for kv in args.kv_heads:
        if args.heads % kv:
            print(f"--kv-heads {kv} must divide --heads {args.heads}", file=sys.stderr)
            return 2
    from volta_train.bench import environment

    policy = os.environ.get("VOLTA_TRAIN_BACKEND")
    print("| " + " | ".join(COLUMNS) + " |")
    try:
        rows = run(args)
    finally:
        if policy is None:
            os.environ.pop("VOLTA_TRAIN_BACKEND", None)
        else:
            os.environ["VOLTA_TRAIN_BACKEND"] = policy
    env = environment()
    args.out.mkdir(parents=True, exist_ok=True)
    table = markdown(rows, args, env)
    (args.out / "bench_decode.md").write_text(table + "\n", encoding="utf-8")
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    (args.out / "bench_decode.json").write_text(json.dumps({"environment": env, "settings": settings, "rows": rows},
                                                           indent=1) + "\n", encoding="utf-8")
    plot(rows, args.out / "bench_decode.png", f"decoding on {env.get('gpu', 'GPU')}")
    print(table)
    print(f"wrote {args.out / 'bench_decode.md'}, .json, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
