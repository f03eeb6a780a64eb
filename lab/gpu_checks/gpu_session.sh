#!/usr/bin/env bash
# One GPU check session: environment, the gpu-marked tests, then optional benchmark arguments.
#   bash lab/gpu_checks/gpu_session.sh "<pytest selection>" "<bench_attention.py args or empty>"
# From the repository root on a GPU machine; logs go to the output directory $OUT (default ./gpu_out).
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export VOLTA_TRAIN_CACHE_DIR=${VOLTA_TRAIN_CACHE_DIR:-/tmp/volta_train_cache}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/env.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)" | tee -a "$out/env.txt"
tests=${1:-"tests -m gpu"}
python3 -m pytest $tests -q -rfE -x --maxfail=10 -p no:cacheprovider 2>&1 | tee "$out/pytest.log" | grep -vE "^(PASSED|SKIPPED)" | tail -60
if [ -n "${2:-}" ]; then
  python3 scripts/bench_attention.py --out "$out" $2 2>&1 | tee "$out/bench.log" | tail -40
fi
