#!/usr/bin/env bash
# Issue 30's two-GPU long-context figures in one call (2 H100/H200, at most BUDGET_S seconds, default 520: under
# 9 minutes), with lab/gpu_checks/sp_memory_probe.py (DeepSpeed ZeRO-3 + Ulysses sp=2, fp16, activation
# checkpointing, the chunked loss, the Volta kernel within a 256-key local window; each process capped at MEM_GB):
#   1. medium: the GPT-2-medium-shaped Llama of docs/sequence_parallel.md (304 M parameters, ZeRO-3 without
#      offload): steps at 32k, 64k and 128k tokens per GPU, the target = the shorter of the line fitted to them and
#      the memory model's prediction, a step there, shorter steps (10% each) after an out-of-memory error;
#   2. llama8b: Llama-3.1-8B's shape (32 layers, width 4096, 8 key/value heads, MLP 14336, 128,256 words) built
#      inside deepspeed.zero.Init, ZeRO-3 with offload_param and offload_optimizer to the CPU (torch AdamW, fused, on
#      the CPU), tiled MLP, activation offload: steps at 32,768 and 131,072 tokens, then one at the target (memory
#      model; host memory measured at the longer step, grown by the offload's pinned copies; retries 10% shorter
#      while the budget allows). If the process dies without a trained target and
#      at least RELAUNCH_S seconds are left, it is started once more at 90% of that target.
# From the repository root:  OUT=/some/dir bash lab/gpu_checks/long_context_sp2_check.sh
# DeepSpeed is installed from the wheels in .whl/ when missing (lab/gpu_checks/carried_wheels.sh lists them).
# Carry .whl with the run.
# Output in $OUT: report.md, long_context_sp2_check.json (both probes' JSON), long_context_sp2_check.png,
# medium.log, llama8b.log, env.txt. PROBES="llama8b" runs one of the two. CPU_SMOKE=1: the same flow on two CPU processes (gloo, tiny models; no figures).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink SHARP/multicast
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}  # per process: the CPU optimizer step and the host copies use them
export VOLTA_TRAIN_CACHE_DIR=${VOLTA_TRAIN_CACHE_DIR:-/tmp/volta_train_cache}
dest=${OUT:-out/long_context_sp2_check}
mkdir -p "$dest"
log=$dest/check.log
: > "$log"
BUDGET_S=${BUDGET_S:-520}
MEM_GB=${MEM_GB:-32}
WHEELS=${WHEELS:-.whl}
RELAUNCH_S=${RELAUNCH_S:-240}
LOSS_SCALE_POWER=${LOSS_SCALE_POWER:-8}  # fp16 from 2^8: no first step skipped on overflow (a full optimizer step)
DS_PIN_MEMORY=${DS_PIN_MEMORY:-true}    # ZeRO's host buffers page-locked (PyTorch rounds each to a power of two)
OFFLOAD_KEEP=${OFFLOAD_KEEP:-0}          # 8B: the top N blocks keep their checkpointed inputs on the GPU
CPU_OPTIMIZER=${CPU_OPTIMIZER:-fused}    # or deepspeed: DeepSpeed's CPU Adam, built on first use (c++ and ninja)
PY=${PYTHON:-python3}
began=$(date +%s)
left() { echo $(( BUDGET_S - ($(date +%s) - began) )); }
stamp() { echo "[long_context_sp2_check +$(( $(date +%s) - began )) s] $*" | tee -a "$log"; }
smoke=() medium_args=() llama_args=()
if [ "${CPU_SMOKE:-0}" = 1 ]; then
  smoke=(--cpu --window 8)
  medium_args=(--shard-lengths 32,64 --cpu-oom-above 200)
  llama_args=(--shard-lengths 64 --target 512)
  export OMP_NUM_THREADS=1
else
  export DS_ACCELERATOR=${DS_ACCELERATOR:-cuda} VOLTA_TRAIN_BACKEND=${VOLTA_TRAIN_BACKEND:-kernel}
  medium_args=(--shard-lengths 32768,65536,131072)
  llama_args=(--shard-lengths "${LLAMA_SHARDS:-16384,65536}" --tile-tokens "${TILE_TOKENS:-8192}"
              ${LLAMA_TARGET:+--target "$LLAMA_TARGET"})  # LLAMA_TARGET: the 8B step's length instead of predicted
fi

{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader 2>/dev/null \
    || echo "no nvidia-smi"
  grep -E "MemTotal|MemAvailable" /proc/meminfo; echo "cpus $(nproc)"
  echo "c++: $(command -v c++ || echo none); ninja: $(command -v ninja || echo none)"
} > "$dest/env.txt" 2>&1
if ! $PY -c "import deepspeed" 2>/dev/null; then
  echo "deepspeed not installed: installing the wheels in $WHEELS/" | tee -a "$log"
  source lab/gpu_checks/carried_wheels.sh >> "$log" 2>&1
  if ! $PY -c "import deepspeed" 2>/dev/null; then
    stamp "FAIL: deepspeed cannot be imported; put the wheels of lab/gpu_checks/carried_wheels.sh in $WHEELS/"
    exit 1
  fi
fi
$PY -c "import torch, transformers, accelerate, deepspeed; print('torch', torch.__version__, torch.version.cuda,
'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'deepspeed', deepspeed.__version__,
'GPUs', torch.cuda.device_count())" >> "$dest/env.txt" 2>&1
if [ "$CPU_OPTIMIZER" = deepspeed ] && ! { command -v c++ && command -v ninja; } > /dev/null; then
  echo "CPU_OPTIMIZER=deepspeed needs c++ and ninja (DeepSpeed's CPU Adam is built on first use): using fused" \
    | tee -a "$dest/env.txt"
  CPU_OPTIMIZER=fused
fi
cat "$dest/env.txt" | tee -a "$log"
$PY - "$dest/ds_zero3_offload.json" "$LOSS_SCALE_POWER" "$DS_PIN_MEMORY" <<'EOF'
import json, sys
ds = json.load(open("configs/deepspeed/zero3_offload.json"))
ds["fp16"]["initial_scale_power"] = int(sys.argv[2])
for part in ("offload_optimizer", "offload_param"):  # DS_PIN_MEMORY=false: pageable, exact-size host buffers
    ds["zero_optimization"][part]["pin_memory"] = sys.argv[3] == "true"
json.dump(ds, open(sys.argv[1], "w"), indent=2)
EOF

# probe NAME NEED_S MAX_S ARGS...: two processes of sp_memory_probe.py if NEED_S seconds are left, for at most MAX_S
# seconds or what is left (a hard timeout); its retries start only if they end 20 s before that (--time-budget-s)
probe() {
  local name=$1 need=$2 max=$3
  shift 3
  local rest
  rest=$(left)
  [ "$rest" -gt "$max" ] && rest=$max
  if [ "$rest" -lt "$need" ]; then
    stamp "$name: skipped, ${rest} s left (needs ${need})"
    echo "$name" >> "$dest/skipped.txt"
    return 1
  fi
  stamp "$name: start (${rest} s left)"
  timeout --signal=INT --kill-after=15 "$((rest - 5))" \
    $PY -m torch.distributed.run --nproc_per_node 2 --master_port 0 --rdzv_backend c10d \
    --rdzv_endpoint 127.0.0.1:0 lab/gpu_checks/sp_memory_probe.py --sp 2 --memory-gb "$MEM_GB" \
    --time-budget-s "$((rest - 20))" "${smoke[@]}" "$@" >> "$dest/$name.log" 2>&1
  local rc=$?
  stamp "$name: exit $rc"
  grep -E "^\[sp_memory_probe" "$dest/$name.log" | cut -c1-240 | tail -n 12 | tee -a "$log"
  return $rc
}

PROBES=${PROBES:-medium llama8b}  # which of the two to run
[[ " $PROBES " == *" medium "* ]] && probe medium 120 200 --twin-shard-length 0 --warmup-steps 1 --retries 2 "${medium_args[@]}" --out "$dest/medium.json"

LLAMA=(--shape llama3.1-8b --deepspeed "$dest/ds_zero3_offload.json" --zero-init --tiled-mlp on --activation-offload
       --cpu-optimizer "$CPU_OPTIMIZER" --offload-keep "$OFFLOAD_KEEP" --warmup-steps 0 --twin-shard-length 0 --retries 2 --nccl-timeout 240
       "${llama_args[@]}")
[[ " $PROBES " == *" llama8b "* ]] && probe llama8b 200 "$BUDGET_S" "${LLAMA[@]}" --out "$dest/llama8b.json"
retry=$($PY - "$dest/llama8b.json" <<'EOF'
import json, sys
from pathlib import Path
path = Path(sys.argv[1])
r = json.loads(path.read_text()) if path.exists() else {}
target = r.get("prediction", {}).get("target")
steps = r.get("steps", [])
fitted = max((s["length"] for s in steps[:r.get("fitted_steps", 1)]), default=0)
trained = any(s["ok"] and s["length"] > fitted for s in steps)  # the target or a shorter retry above the fitted
print(int(target * 0.9) // 2048 * 2048 if target and not trained else 0)
EOF
)
if [ "${retry:-0}" -gt 0 ]; then
  cp "$dest/llama8b.json" "$dest/llama8b_first.json"
  probe llama8b_relaunch "$RELAUNCH_S" "$BUDGET_S" "${LLAMA[@]}" --target "$retry" --out "$dest/llama8b.json" || true
fi

$PY - "$dest" <<'EOF' 2>&1 | tee -a "$log"
"""report.md, long_context_sp2_check.json and long_context_sp2_check.png from the probes' JSON."""
import json
import sys
from pathlib import Path

dest = Path(sys.argv[1])
runs = {}
for name in ("medium", "llama8b_first", "llama8b"):
    path = dest / f"{name}.json"
    runs[name] = json.loads(path.read_text()) if path.exists() else None
(dest / "long_context_sp2_check.json").write_text(json.dumps(runs, indent=2) + "\n")
skipped = (dest / "skipped.txt").read_text().split() if (dest / "skipped.txt").exists() else []
lines = ["# long_context_sp2_check", ""]
for name, r in runs.items():
    if r is None:
        if name != "llama8b_first":
            lines += [f"## {name}", "", "skipped (time budget)" if name in skipped else
                      "no result (failed or cut off: see the log)", ""]
        continue
    features = ", ".join(k for k in ("tiled_mlp", "activation_offload", "offload_param", "offload_optimizer",
                                     "zero_init") if r.get(k))
    lines += [f"## {name}: {r['model']} ({r['parameters'] / 1e9:.2f} B parameters, {r['vocab']:,} words), "
              f"{r['processes']} x {r['device']}, sp {r['sp']}, cap {r['memory_gb']:g} GiB per GPU", "",
              f"ZeRO-3, fp16, checkpointing, chunked loss, local window {r['window']}; {features or 'no offload'}; "
              f"set up in {r.get('setup_seconds', '?')} s, {r.get('seconds', '?')} s in all; AdamW steps taken: "
              f"{r.get('optimizer_steps', '?')}", ""]
    pred = r.get("prediction", {})
    if pred:
        cands = ", ".join(f"{k} {v:,}" for k, v in pred["candidates"].items())
        lines += [f"target {pred['target']:,} tokens, bound by {pred['bound_by']} (candidates: {cands}); host "
                  f"memory estimated at it {pred['host_gib_at_target']:.0f} GiB of {r['host']['limit_gib']:.0f}", ""]
    if r.get("fit"):
        f = r["fit"]
        lines += [f"line fit: {f['intercept_gib']:.2f} GiB + {f['kib_per_token']:.1f} KiB/token (worst residual "
                  f"{f['worst_residual_gib']:.3f} GiB) -> {f['predicted_length']:,}", ""]
    if r.get("memory_model"):
        m = r["memory_model"]
        lines += [f"memory model: {m['fixed_gib']:.2f} GiB + {m['kib_per_token']:.1f} KiB/token at "
                  f"{m['moment']} -> {m['predicted_length']:,}", ""]
    lines += ["| tokens | per GPU | trained | peak allocated GiB | peak reserved GiB | s | loss |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for s in r["steps"]:
        trained = ("yes" if s["ok"] else "OUT OF MEMORY") + (" (step skipped: fp16 overflow)"
                                                             if s.get("skipped_step") else "")
        lines.append(f"| {s['length']:,} | {s['shard']:,} | {trained} | "
                     f"{s['peak_allocated_gib']:.2f} | {s['peak_reserved_gib']:.2f} | {s['seconds']} | {s['loss']} |")
    longest = r.get("max_length")
    lines += ["", f"**longest trained: {longest:,} tokens**" if longest else "**nothing trained**", ""]
(dest / "report.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    print("no matplotlib: no PNG")
    sys.exit(0)
shown = [(n, r) for n, r in runs.items() if r and n != "llama8b_first"]
if not shown:
    sys.exit(0)
fig, axes = plt.subplots(1, len(shown), figsize=(5.5 * len(shown), 3.8), squeeze=False)
for ax, (name, r) in zip(axes[0], shown):
    ok = [s for s in r["steps"] if s["ok"]]
    bad = [s for s in r["steps"] if not s["ok"]]
    ax.scatter([s["length"] for s in ok], [s["peak_reserved_gib"] for s in ok], color="tab:blue", label="trained")
    for s in bad:
        ax.axvline(s["length"], color="tab:red", linestyle=":", linewidth=1)
    ax.axhline(r["memory_gb"], color="gray", linestyle="--", linewidth=1, label=f"cap {r['memory_gb']:g} GiB")
    for key, color in (("fit", "tab:green"), ("memory_model", "black")):
        if r.get(key):
            if key == "fit":
                f = r["fit"]
                xs = [0, max(s["length"] for s in r["steps"])]
                ax.plot(xs, [f["intercept_gib"] + f["kib_per_token"] * x / 2**20 for x in xs], color=color,
                        linewidth=1, label="line fit")
            else:
                m = r["memory_model"]
                xs = [0, max(s["length"] for s in r["steps"])]
                ax.plot(xs, [m["fixed_gib"] + m["kib_per_token"] * x / 2**20 for x in xs], color=color,
                        linewidth=1, linestyle="-.", label="memory model")
    ax.set_xlabel("tokens per sequence (red: out of memory)")
    ax.set_ylabel("peak reserved GiB (largest process)")
    ax.set_title(f"{r['model']}, sp {r['sp']}: longest {r.get('max_length') or 0:,}", fontsize=9)
    ax.legend(fontsize=7)
fig.suptitle(shown[0][1]["device"], fontsize=9)
fig.tight_layout()
fig.savefig(dest / "long_context_sp2_check.png", dpi=120)
print(f"wrote {dest}/report.md, long_context_sp2_check.json, long_context_sp2_check.png")
EOF
stamp "done"
