"""Where one flash_attn_with_kvcache call spends its time on a GPU: host (Python, checks, launches) or device
(the split-KV kernel, the combine's ops), for the decoding shapes of scripts/bench_decode.py.

    PYTHONPATH=$PWD python3 lab/gpu_checks/decode_profile.py --out DIR

Per case and check mode: the host time per call (50 calls queued, clock read before the synchronisation), the
wall time per call (after it), and the GPU time per call summed over the kernels torch.profiler saw; then the
profiler's tables (by GPU time and by CPU time) in DIR/decode_profile.txt. A call is host-bound when its host time
is about its wall time and its GPU time is well below.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch


def make_case(batch: int, heads: int, kv_heads: int, seqlen_k: int, head_dim: int) -> dict:
    q = torch.randn(batch, 1, heads, head_dim, device="cuda", dtype=torch.float16)
    k_cache = torch.randn(batch, seqlen_k + 1, kv_heads, head_dim, device="cuda", dtype=torch.float16)
    return dict(q=q, k_cache=k_cache, v_cache=torch.randn_like(k_cache),
                seqlens=torch.full((batch,), seqlen_k, dtype=torch.int32, device="cuda"))


def call(c: dict) -> torch.Tensor:
    import volta_train
    return volta_train.flash_attn_with_kvcache(c["q"], c["k_cache"], c["v_cache"], cache_seqlens=c["seqlens"])


def per_call_ms(c: dict, calls: int) -> tuple[float, float]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call(c)
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    return 1e3 * host / calls, 1e3 * wall / calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("decode_profile.py needs a CUDA GPU")
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    os.environ["VOLTA_TRAIN_BACKEND"] = "kernel"
    args.out.mkdir(parents=True, exist_ok=True)
    report = []
    for batch, seqlen_k in ((1, 4096), (1, 32768), (8, 4096)):
        c = make_case(batch, 32, 8, seqlen_k, 128)
        for checks in ("host", "device"):
            os.environ["VOLTA_TRAIN_KVCACHE_CHECK"] = checks
            for _ in range(5):
                call(c)
            host_ms, wall_ms = per_call_ms(c, args.calls)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    call(c)
                torch.cuda.synchronize()
            events = prof.key_averages()
            # kernels only: an operator's row repeats its kernels' time (summing every row counted it twice)
            gpu_ms = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / 1e3 / 20
            line = (f"batch {batch}, {seqlen_k} keys, checks {checks}: host {host_ms:.3f} ms/call, wall {wall_ms:.3f} "
                    f"ms/call, GPU (kernels) {gpu_ms:.3f} ms/call")
            print(line, flush=True)
            report += [line, events.table(sort_by="self_device_time_total", row_limit=15),
                       events.table(sort_by="cpu_time_total", row_limit=25), ""]
    (args.out / "decode_profile.txt").write_text("\n".join(report) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
