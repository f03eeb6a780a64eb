#!/usr/bin/env bash
# The backward's figures in one device call (an H200, everything on: 9.3 min; without the workload: ~5 min), in order:
#   1. correctness, optional: BWD_CHECK_TESTS="<test files>" (gpu-marked tests; BWD_CHECK_K: a -k expression) beside
#      BWD_CHECK_SANITIZE="<head dims>" (lab/sanitize_kernels.py, both tile tables, those head dims only);
#   2. the CUTLASS Sm70 peer (lab/bench_cutlass_sm70.py; prebuilt harness .cutlass_build/harness: carry it) and
#      volta_train (scripts/bench_attention.py, both accumulations), forward and backward, head_dim 64/128, N 1k/4k,
#      full and causal, in the same lease, with their ratio (lab/peer_ratio.py);
#   3. BWD_CHECK_WORKLOAD=1: the Llama-3-8B workload rows (volta-train bench --workload llama3-8b) and the peer on the
#      same documents (bench_cutlass_sm70.py --suite workload), with the ratio;
#   4. BWD_CHECK_NCU=1: Nsight Compute's scheduler, warp-state and instruction sections of one emulated backward launch
#      per head_dim 64 and 128 (lab/gpu_checks/bwd_profile.py);
#   5. BWD_CHECK_SWEEP="<lab/tile_sweep.py arguments>": a tile sweep.
# From the repository root:  OUT=/some/dir bash lab/gpu_checks/bwd_check.sh ; everything lands in $OUT/bwd_check.tgz.
set -uo pipefail
dest=${OUT:-bwd_check_out}; mkdir -p "$dest"
out=${BWD_CHECK_WORK:-$(mktemp -d /tmp/bwd_check.XXXXXX)}; mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export VOLTA_TRAIN_CACHE_DIR=${VOLTA_TRAIN_CACHE_DIR:-/tmp/volta_train_cache}
began=$(date +%s)
stamp() { echo "[bwd_check +$(( $(date +%s) - began )) s] $*"; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$out/env.txt"
if [ -n "${BWD_CHECK_TESTS:-}" ]; then
  stamp "gpu tests: $BWD_CHECK_TESTS"
  timeout 400 python3 -m pytest $BWD_CHECK_TESTS ${BWD_CHECK_K:+-k "$BWD_CHECK_K"} -m gpu -q -rfE -p no:cacheprovider > "$out/pytest.log" 2>&1 &
  tests_pid=$!
fi
if [ -n "${BWD_CHECK_SANITIZE:-}" ]; then
  stamp "sanitizer: head dims $BWD_CHECK_SANITIZE"
  python3 lab/sanitize_kernels.py --head-dims $BWD_CHECK_SANITIZE --out "$out/sanitizer" --tool-timeout 300 \
    > "$out/sanitizer.log" 2>&1
  stamp "sanitizer exit $?: $(tail -1 "$out/sanitizer.log")"
fi
if [ -n "${tests_pid:-}" ]; then
  wait $tests_pid; stamp "tests exit $?: $(tail -1 "$out/pytest.log")"
  grep -E "^(FAILED|ERROR)" "$out/pytest.log" | head -20
fi
shapes=(--head-dims 64 128 --seqlens 1024 4096 --causal false true)
harness=${CUTLASS_HARNESS:-.cutlass_build/harness}
if [ -x "$harness" ]; then
  stamp "CUTLASS Sm70 peer"
  python3 lab/bench_cutlass_sm70.py --binary "$harness" --suite train "${shapes[@]}" --splits 1-8 --timeout 400 \
    --out "$out/cutlass" > "$out/cutlass.log" 2>&1
  stamp "exit $?"
fi
stamp "volta_train"
python3 scripts/bench_attention.py --passes fwd bwd "${shapes[@]}" --accum fp32 fp16 --baselines --out "$out/volta" \
  > "$out/volta.log" 2>&1
stamp "exit $?"
[ -f "$out/cutlass/cutlass_sm70.json" ] && python3 lab/peer_ratio.py --volta "$out/volta/bench_fwd_bwd.json" \
  --cutlass "$out/cutlass/cutlass_sm70.json" --out "$out/ratio" > "$out/ratio.log" 2>&1
if [ "${BWD_CHECK_WORKLOAD:-0}" = 1 ]; then
  stamp "workload llama3-8b: volta_train"
  python3 -m volta_train.cli bench --workload llama3-8b --accum fp32 fp16 --baselines --out "$out/workload" \
    > "$out/workload.log" 2>&1
  stamp "exit $?"
  if [ -x "$harness" ]; then
    stamp "workload llama3-8b: CUTLASS Sm70"
    python3 lab/bench_cutlass_sm70.py --binary "$harness" --suite workload --warmup 1 --repeats 3 --bwd-warmup 1 \
      --bwd-repeats 3 --verify-heads 1 --volta-json "$out/workload/bench.json" --timeout 300 \
      --out "$out/workload_cutlass" > "$out/workload_cutlass.log" 2>&1
    stamp "exit $?"
  fi
fi
if [ "${BWD_CHECK_NCU:-0}" = 1 ]; then
  for d in 64 128; do
    stamp "ncu d$d"
    ncu --kernel-name regex:flash_bwd_dkdv --launch-skip 1 --launch-count 1 --section WarpStateStats \
      --section InstructionStats --section SchedulerStats --section LaunchStats --section Occupancy \
      --section SpeedOfLight python3 lab/gpu_checks/bwd_profile.py $d > "$out/ncu_d$d.txt" 2>&1
    stamp "exit $?"
  done
fi
if [ -n "${BWD_CHECK_SWEEP:-}" ]; then
  stamp "tile sweep: $BWD_CHECK_SWEEP"
  python3 lab/tile_sweep.py $BWD_CHECK_SWEEP --out "$out/sweep" > "$out/sweep.log" 2>&1
  stamp "exit $?"
fi
tar -czf "$dest/bwd_check.tgz" -C "$out" .
stamp "done"
