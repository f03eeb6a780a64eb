#!/usr/bin/env bash
# Everything a kernel change must pass on a GPU, in one device call of under 10 minutes (an H100: ~6-7 min):
#   1. compile every shipped variant of both tile tables once (the kernel cache the later steps share);
#   2. at the same time on the GPU: the gpu-marked tests, and compute-sanitizer (memcheck, racecheck, initcheck,
#      synccheck) over every variant of both tables (lab/sanitize_kernels.py);
#   3. optionally, Nsight Compute's bank-conflict table of the sm_70 tiles (KERNEL_CHECK_NCU=1, ~1 min more).
# From the repository root:  OUT=/some/dir bash lab/gpu_checks/kernel_check.sh ["<pytest selection>"]
# Logs, the sanitizer report and the ncu table are written under a work directory and packed into
# $OUT/kernel_check.tgz, beside a copy of the test log (two files: easy to bring back from a remote GPU machine).
# Exit status: 0 when the tests and the sanitizer passed.
set -uo pipefail
dest=${OUT:-kernel_check_out}; mkdir -p "$dest"
# KERNEL_CHECK_WORK puts the work directory where a timed-out device call still brings it back (e.g. "$OUT/work").
out=${KERNEL_CHECK_WORK:-$(mktemp -d /tmp/kernel_check.XXXXXX)}; mkdir -p "$out/logs"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export VOLTA_TRAIN_CACHE_DIR=${VOLTA_TRAIN_CACHE_DIR:-/tmp/volta_train_cache}
tests=${1:-"tests lab/tests -m gpu"}
began=$(date +%s)
stamp() { echo "[kernel_check +$(( $(date +%s) - began )) s] $*"; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/logs/env.txt"
git log -1 --format='%H %s' 2>/dev/null | tee -a "$out/logs/env.txt"
stamp "compiling both tile tables"
python3 lab/sanitize_kernels.py --precompile-only > "$out/logs/precompile.log" 2>&1 || { tail -30 "$out/logs/precompile.log"; exit 1; }

stamp "gpu tests and sanitizer, side by side"
python3 -m pytest $tests -q -rfE -p no:cacheprovider > "$out/logs/pytest.log" 2>&1 &
tests_pid=$!
python3 lab/sanitize_kernels.py --out "$out/sanitizer" --tool-timeout 240 > "$out/logs/sanitizer.log" 2>&1 &
sanitizer_pid=$!
wait $tests_pid; tests_rc=$?
stamp "tests exit $tests_rc: $(tail -1 "$out/logs/pytest.log")"
wait $sanitizer_pid; sanitizer_rc=$?
stamp "sanitizer exit $sanitizer_rc: $(tail -1 "$out/logs/sanitizer.log")"

if [ "${KERNEL_CHECK_NCU:-0}" = 1 ]; then
  stamp "Nsight Compute bank conflicts"
  python3 lab/smem_conflicts.py --out "$out/ncu" > "$out/logs/ncu.log" 2>&1
  stamp "ncu exit $?"
fi
grep -E "^(FAILED|ERROR)" "$out/logs/pytest.log" | head -40
tar -czf "$dest/kernel_check.tgz" -C "$out" . && cp "$out/logs/pytest.log" "$dest/pytest.log"
stamp "done"
[ $tests_rc = 0 ] && [ $sanitizer_rc = 0 ]
