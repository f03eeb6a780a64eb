#!/usr/bin/env bash
# Long-context figures of docs/long_context.md in one call on one GPU (H100/H200), at most BUDGET_S seconds
# (default 530, under 9 minutes), with lab/long_context_probe.py (Llama-3.2-1B shape, 128,256 words, causal SDPA within
# 4096-token blocks; needs torch and transformers, not DeepSpeed):
#   0. tests/training/test_tiled_mlp.py's CUDA dropout test (the tiles' recomputes restore the CUDA RNG state), with pytest;
#   1. step time at 16,384 tokens, no memory cap: baseline, tiled, offload, tiled+offload (median of 5 steps after 2);
#   2. the longest sequence that trains two full steps under a 32 GiB cap: baseline (from 32,768 tokens, bisection
#      to 8,192), then tiled+offload+optim_offload (from 262,144, bisection to 16,384) in the time left.
# From the repository root:  OUT=/some/dir bash lab/gpu_checks/long_context_check.sh
# Output in $OUT: report.md (the three tables), long_context_check.json (every probe of the three runs),
# long_context_check.png (longest sequence per variant, step time per variant), long_context_check.log, env.txt.
# A phase that no longer fits in the budget is skipped and named in report.md.
# CPU_SMOKE=1: the same flow on the CPU with the probe's --smoke model and 256-token steps (tests this script, no
# figures).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
dest=${OUT:-out/long_context_check}
mkdir -p "$dest"
work=$(mktemp -d /tmp/long_context_check.XXXXXX)
log=$dest/long_context_check.log
: > "$log"
BUDGET_S=${BUDGET_S:-530}
PY=${PYTHON:-python3}
began=$(date +%s)
left() { echo $(( BUDGET_S - ($(date +%s) - began) )); }
stamp() { echo "[long_context_check +$(( $(date +%s) - began )) s] $*" | tee -a "$log"; }
STEP_TOKENS=${STEP_TOKENS:-16384}
smoke=()
if [ "${CPU_SMOKE:-0}" = 1 ]; then
  smoke=(--smoke)
  STEP_TOKENS=256
  export OMP_NUM_THREADS=1
fi

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  $PY -c "import torch, transformers as t; print('torch', torch.__version__, torch.version.cuda, 'transformers', t.__version__)"
} > "$dest/env.txt" 2>&1
cat "$dest/env.txt" | tee -a "$log"

# run NAME NEED_S MAX_MIN ARGS...: the probe if NEED_S seconds are left, with a hard timeout of what is left; its search
# starts no probe after MAX_MIN minutes, nor later than 75 s before the end (a probe near the limit takes ~1 minute)
run() {
  local name=$1 need=$2 max_min=$3
  shift 3
  local rest minutes
  rest=$(left)
  if [ "$rest" -lt "$need" ]; then
    stamp "$name: skipped, ${rest} s left (needs ${need})"
    echo "$name" >> "$work/skipped"
    return
  fi
  minutes=$(awk -v r="$rest" -v m="$max_min" 'BEGIN { t = (r - 75) / 60; if (t > m) t = m; printf "%.2f", t }')
  stamp "$name: start (${rest} s left, search budget ${minutes} min)"
  timeout --signal=INT --kill-after=15 "$((rest - 5))" \
    $PY lab/long_context_probe.py "$@" --time-budget-min "$minutes" --out "$work/$name" "${smoke[@]}" \
    >> "$log" 2>&1
  stamp "$name: exit $?"
}

# 0. the tiled MLP's CUDA-only path: each tile's recompute restores the CUDA RNG state (dropout masks agree)
if [ "${CPU_SMOKE:-0}" != 1 ] && $PY -c "import pytest" 2>/dev/null; then
  stamp "gpu test: tiled MLP dropout masks on CUDA"
  timeout 90 $PY -m pytest -q -p no:cacheprovider tests/training/test_tiled_mlp.py -k "dropout and cuda" \
    > "$work/gpu_test.txt" 2>&1
  stamp "gpu test: exit $? ($(tail -n 1 "$work/gpu_test.txt"))"
fi

run step_time 120 99 --no-search --step-time "$STEP_TOKENS" --memory-gb 0 \
  --variants baseline,tiled,offload,tiled+offload
run search_baseline 150 1.5 --variants baseline --memory-gb 32 --start 32768 --granularity 8192 --max-len 131072
run search_optim_offload 150 99 --variants tiled+offload+optim_offload --memory-gb 32 --start 262144 \
  --granularity 16384 --max-len 1048576

$PY - "$work" "$dest" <<'EOF' 2>&1 | tee -a "$log"
"""Merge the three runs: report.md, long_context_check.json, long_context_check.png."""
import json
import sys
from pathlib import Path

work, dest = Path(sys.argv[1]), Path(sys.argv[2])
runs = {}
for name in ("step_time", "search_baseline", "search_optim_offload"):
    path = work / name / "long_context_probe.json"
    runs[name] = json.loads(path.read_text()) if path.exists() else None
skipped = (work / "skipped").read_text().split() if (work / "skipped").exists() else []
(dest / "long_context_check.json").write_text(json.dumps(runs, indent=2) + "\n")
lines = ["# long_context_check", ""]
gpu_test = work / "gpu_test.txt"
if gpu_test.exists():
    text = gpu_test.read_text().strip().splitlines()
    lines += ["tests/training/test_tiled_mlp.py -k 'dropout and cuda' (tile recomputes restore the CUDA RNG state): "
              + (text[-1] if text else "no output"), ""]
for name, summary in runs.items():
    lines.append(f"## {name}")
    lines.append("")
    md = work / name / "long_context_probe.md"
    if md.exists():
        lines.append(md.read_text())
    else:
        lines.append("skipped (time budget)" if name in skipped else "no result (failed or cut off: see the log)")
        lines.append("")
(dest / "report.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    print("no matplotlib: no PNG")
    sys.exit(0)
fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
searched = [r for n in ("search_baseline", "search_optim_offload") if runs[n] for r in runs[n]["results"]]
if searched:
    names = [r["variant"].replace("+", "+\n") for r in searched]
    axes[0].bar(names, [r["longest"] for r in searched], color="tab:blue", label="longest trained")
    axes[0].scatter(names, [r["predicted"] or 0 for r in searched], color="black", marker="_", s=600, zorder=3,
                    label="memory model")
    cap = next(runs[n]["memory_gb"] for n in ("search_baseline", "search_optim_offload") if runs[n])
    axes[0].set_ylabel("tokens")
    axes[0].set_title(f"longest sequence, {cap:g} GiB cap")
    axes[0].legend(fontsize=8)
if runs["step_time"]:
    rows = runs["step_time"]["results"]
    first = rows[0]["step_seconds"]
    axes[1].bar([r["variant"].replace("+", "+\n") for r in rows], [r["step_seconds"] / first for r in rows],
                color="tab:orange")
    axes[1].axhline(1.05, color="gray", linestyle="--", linewidth=1)
    axes[1].set_ylabel("s/step against baseline")
    axes[1].set_title(f"step time at {runs['step_time']['args']['step_time']:,} tokens")
fig.suptitle(next((r["device"] for r in runs.values() if r), "?"), fontsize=9)
fig.tight_layout()
fig.savefig(dest / "long_context_check.png", dpi=120)
print(f"wrote {dest}/report.md, long_context_check.json, long_context_check.png")
EOF
stamp "done"
rm -rf "$work"
