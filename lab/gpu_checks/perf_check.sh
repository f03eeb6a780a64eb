#!/usr/bin/env bash
# The speed figures the open issues ask for, in one device call (an H100: ~4-6 min):
#   1. the Volta kernels, forward and backward, head_dim 64 / 128 / 256, N 1k and 4k, full and causal (bench_attention);
#   2. the same run on an older checkout when OLD_TREE names one (a directory holding its volta_train/ and csrc/, e.g.
#      made with `git archive <commit> volta_train csrc | tar -x -C _old`), so a change is timed against its baseline
#      on the same GPU in the same call;
#   3. decoding (bench_decode): batch 1 / 8, 32 query heads on 8 KV heads, d128, 4k / 32k keys, host and device checks;
#   4. the CUTLASS Sm70 kernels on the same shapes (lab/bench_cutlass_sm70.py) with the prebuilt harness
#      CUTLASS_HARNESS (default .cutlass_build/harness; carry it: it is git-ignored), skipped when it is absent.
# From the repository root:  OUT=/some/dir [OLD_TREE=_old] bash lab/gpu_checks/perf_check.sh
# Everything is packed into $OUT/perf_check.tgz, with the markdown tables also copied to $OUT.
set -uo pipefail
dest=${OUT:-perf_check_out}; mkdir -p "$dest"
out=$(mktemp -d /tmp/perf_check.XXXXXX)
export PYTHONUNBUFFERED=1 VOLTA_TRAIN_CACHE_DIR=${VOLTA_TRAIN_CACHE_DIR:-/tmp/volta_train_cache}
began=$(date +%s)
stamp() { echo "[perf_check +$(( $(date +%s) - began )) s] $*"; }
attention=(--passes fwd bwd --head-dims 64 128 256 --seqlens 1024 4096 --causal false true --accum fp32)

nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$out/env.txt"
stamp "attention, this tree"
PYTHONPATH=$PWD python3 scripts/bench_attention.py "${attention[@]}" --out "$out/attention_new" > "$out/attention_new.log" 2>&1
stamp "exit $?"
if [ -n "${OLD_TREE:-}" ]; then
  stamp "attention, $OLD_TREE"
  PYTHONPATH=$PWD/$OLD_TREE VOLTA_TRAIN_CSRC=$PWD/$OLD_TREE/csrc VOLTA_TRAIN_CACHE_DIR=/tmp/volta_train_cache_old \
    python3 scripts/bench_attention.py "${attention[@]}" --out "$out/attention_old" > "$out/attention_old.log" 2>&1
  stamp "exit $?"
fi
stamp "decoding"
PYTHONPATH=$PWD python3 scripts/bench_decode.py --seqlens 4096 32768 --batches 1 8 --kv-heads 8 --head-dims 128 \
  --backends volta-kernel volta-kernel-device-checks sdpa-efficient --out "$out/decode" > "$out/decode.log" 2>&1
stamp "exit $?"
harness=${CUTLASS_HARNESS:-.cutlass_build/harness}
if [ -x "$harness" ]; then
  stamp "CUTLASS Sm70"
  PYTHONPATH=$PWD python3 lab/bench_cutlass_sm70.py --binary "$harness" --suite all --timeout 300 \
    --out "$out/cutlass" > "$out/cutlass.log" 2>&1
  stamp "exit $?"
else
  stamp "no CUTLASS harness at $harness: skipped"
fi
tar -czf "$dest/perf_check.tgz" -C "$out" .
for f in "$out"/*/*.md; do [ -f "$f" ] && cp "$f" "$dest/$(basename "$(dirname "$f")")_$(basename "$f")"; done
ls "$dest" | head -8
stamp "done"
