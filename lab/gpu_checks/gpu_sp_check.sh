#!/usr/bin/env bash
# GPU check of DeepSpeed-Ulysses sequence parallelism with volta_train's attention (docs/sequence_parallel.md),
# on 2 or 4 GPUs of one machine. Two phases, each with PASS/FAIL lines, and report.md in the output directory:
#
#   loss    recipes/gpt_long.py under ZeRO-3 and fp16 with sequence_parallel_size 1, 2 (and 4 with 4 GPUs), the
#           same global batch (GLOBAL_BATCH sequences per step) and data: STEPS steps each; the loss trajectories
#           of sp>1 must match sp=1 within TOL_MEAN (mean |difference| over the logged steps) and TOL_MAX (largest).
#   memory  lab/gpu_checks/sp_memory_probe.py with sp=1 and sp=PROBE_SP (default: all GPUs), the same GPUs, ZeRO-3, fp16,
#           activation checkpointing, a GPT-2-medium-shaped model (24 layers, 16 heads, width 1024; Llama-style so
#           no position table grows with the sequence), each process capped at MEM_GB GiB: the longest sequence
#           that trains (the shorter of a line fitted on three lengths and the memory model's prediction, verified
#           by a step, retried 10% shorter after an out-of-memory error), and the ratio sp=N / sp=1, which must be
#           at least RATIO_MIN (default 0.875 x N: 3.5 for sp=4). The search runs the Volta kernel with a local
#           window (its memory does not depend on the window; full attention over 1M tokens would take hours on
#           an emulating GPU); a window-vs-full step at TWIN_SHARD tokens per GPU checks that premise (TOL_TWIN).
#
#   bash lab/gpu_checks/gpu_sp_check.sh                        # from the repository root; about 7 minutes on 4 H200
#   PHASES=loss bash lab/gpu_checks/gpu_sp_check.sh            # one phase per call (each well under 8 minutes)
#   NPROC=2 STEPS=150 MEM_GB=32 bash lab/gpu_checks/gpu_sp_check.sh
#   MODEL_ARGS="--model small" SEQ_LEN=4096 PHASES=loss bash lab/gpu_checks/gpu_sp_check.sh
#
# Every launch has a timeout (RUN_TIMEOUT, PROBE_TIMEOUT), cut to what is left of the check's time limit, BUDGET_S
# seconds (default 450); what no longer fits is skipped and listed in the report. Expected: ~3 min for the loss phase, ~3 min for memory.
# DeepSpeed is installed from the wheels in .whl/ when missing (lab/gpu_checks/carried_wheels.sh).
# Output: $OUT_DIR (default out/gpu_sp_check): report.md, loss_sp{1,2,4}/ (train.csv, summary.json, ...), *.log,
# probe_sp*.json, loss.png.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # this checkout's volta_train

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # NCCL without NVLink SHARP/multicast: the checks do not need it
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1 VOLTA_TRAIN_CACHE_DIR=${VOLTA_TRAIN_CACHE_DIR:-/tmp/volta_train_cache}
PY=${PYTHON:-python3}
CPU_SMOKE=${CPU_SMOKE:-0}  # 1: the whole flow on CPU processes (gloo, fp32, tiny shapes): tests this script, no figures
if [ "$CPU_SMOKE" = 1 ]; then
  : "${STEPS:=6}" "${SEQ_LEN:=128}" "${MODEL_ARGS:=--model nano}" "${SHARD_LENGTHS:=32,64}" "${TWIN_SHARD:=48}"
  : "${WINDOW:=8}" "${NPROC:=2}" "${OUT_DIR:=out/gpu_sp_check_cpu_smoke}"
  export OMP_NUM_THREADS=1
else
  export DS_ACCELERATOR=${DS_ACCELERATOR:-cuda}
fi
OUT=${OUT_DIR:-out/gpu_sp_check}
PHASES=${PHASES:-loss memory}
BUDGET_S=${BUDGET_S:-450}
WHEELS=${WHEELS:-.whl}
# loss phase
STEPS=${STEPS:-200}
MODEL_ARGS=${MODEL_ARGS:---model mini --n-embd 512 --n-head 8}  # GPT-2: 6 layers, 8 heads of 64 (sp 1/2/4/8)
SEQ_LEN=${SEQ_LEN:-2048}
GLOBAL_BATCH=${GLOBAL_BATCH:-4}   # sequences per optimizer step, in every run
LIMIT_MIN=${LIMIT_MIN:-1.5}       # training minutes per run at most
RUN_TIMEOUT=${RUN_TIMEOUT:-170}
TOL_MEAN=${TOL_MEAN:-0.03}
TOL_MAX=${TOL_MAX:-0.15}
# fp16 runs start at a loss scale of 2^LOSS_SCALE_POWER, low enough that no run skips its first steps on overflow:
# with configs/deepspeed/zero3.json's 2^16 both layouts skip 2 steps but not the same ones (their gradients are
# summed in a different order), which shifts their early losses by up to 0.35 (measured on 2 H200s)
LOSS_SCALE_POWER=${LOSS_SCALE_POWER:-12}
# memory phase
MEM_GB=${MEM_GB:-32}
PROBE_ARCH=${PROBE_ARCH:-llama}
PROBE_MODEL=${PROBE_MODEL:-medium}
SHARD_LENGTHS=${SHARD_LENGTHS:-32768,65536,131072}
TWIN_SHARD=${TWIN_SHARD:-16384}
WINDOW=${WINDOW:-256}
PROBE_TIMEOUT=${PROBE_TIMEOUT:-240}
TOL_TWIN=${TOL_TWIN:-0.05}
START=$(date +%s)
mkdir -p "$OUT"
elapsed() { echo $(( $(date +%s) - START )); }
# seconds the next launch may take: its own limit $1, or what is left of BUDGET_S; 0 when under MIN_LAUNCH_S are left
allowed() {
  local left=$(( BUDGET_S - $(elapsed) ))
  if [ "$left" -lt "${MIN_LAUNCH_S:-45}" ]; then echo 0; else echo $(( left < $1 ? left : $1 )); fi
}

echo "== environment"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader || true
if ! $PY -c "import deepspeed" 2>/dev/null; then
  echo "deepspeed not installed: installing the wheels in $WHEELS/"
  source lab/gpu_checks/carried_wheels.sh
  if ! $PY -c "import deepspeed" 2>/dev/null; then
    echo "FAIL: deepspeed cannot be imported; put the wheels of lab/gpu_checks/carried_wheels.sh in $WHEELS/"; exit 1
  fi
fi
$PY - <<'EOF'
import torch, transformers, accelerate, deepspeed
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, "
      f"accelerate {accelerate.__version__}, deepspeed {deepspeed.__version__}, GPUs {torch.cuda.device_count()}")
EOF
GPUS=$($PY -c "import torch; print(torch.cuda.device_count())")
PRECISION=fp16 PROBE_CPU=()
if [ "$CPU_SMOKE" = 1 ]; then GPUS=$NPROC PRECISION=no PROBE_CPU=(--cpu); fi
NPROC=${NPROC:-$(( GPUS >= 4 ? 4 : GPUS ))}
if [ "$NPROC" -lt 2 ] || [ "$GPUS" -lt "$NPROC" ]; then
  echo "FAIL: 2 or more GPUs needed (NPROC=$NPROC, $GPUS found)"; exit 1
fi
SP_LIST=${SP_LIST:-$( [ "$NPROC" -ge 4 ] && echo "1 2 4" || echo "1 2" )}
PROBE_SP=${PROBE_SP:-$NPROC}
RATIO_MIN=${RATIO_MIN:-$($PY -c "print(0.875 * $PROBE_SP)")}
echo "NPROC=$NPROC SP_LIST='$SP_LIST' PROBE_SP=$PROBE_SP PHASES='$PHASES' BUDGET_S=$BUDGET_S"
cat > "$OUT/settings.json" <<EOF
{"nproc": $NPROC, "sp_list": "$SP_LIST", "steps": $STEPS, "model": "$MODEL_ARGS", "seq_len": $SEQ_LEN,
 "global_batch": $GLOBAL_BATCH, "tol_mean": $TOL_MEAN, "tol_max": $TOL_MAX, "mem_gb": $MEM_GB,
 "probe_sp": $PROBE_SP, "probe_arch": "$PROBE_ARCH", "probe_model": "$PROBE_MODEL", "ratio_min": $RATIO_MIN,
 "tol_twin": $TOL_TWIN, "window": $WINDOW, "loss_scale_power": $LOSS_SCALE_POWER}
EOF
: > "$OUT/skipped.txt"

if [[ " $PHASES " == *" loss "* ]]; then
  $PY - "$OUT/ds_zero3_loss.json" "$LOSS_SCALE_POWER" <<'EOF'
import json, sys
ds = json.load(open("configs/deepspeed/zero3.json"))
ds["fp16"]["initial_scale_power"] = int(sys.argv[2])
json.dump(ds, open(sys.argv[1], "w"), indent=2)
EOF
  for sp in $SP_LIST; do
    dp=$(( NPROC / sp )); batch=$(( GLOBAL_BATCH / dp ))
    if [ $(( batch * dp )) -ne "$GLOBAL_BATCH" ] || [ "$batch" -lt 1 ]; then
      echo "loss sp=$sp: GLOBAL_BATCH $GLOBAL_BATCH is not a multiple of the data-parallel degree $dp" \
          | tee -a "$OUT/skipped.txt"
      continue
    fi
    limit=$(allowed "$RUN_TIMEOUT")
    if [ "$limit" -eq 0 ]; then
      echo "loss sp=$sp: skipped, the time limit (BUDGET_S=${BUDGET_S} s) is reached" | tee -a "$OUT/skipped.txt"
      continue
    fi
    echo "== loss sp=$sp: GPT-2 $MODEL_ARGS, $SEQ_LEN tokens, $NPROC GPUs = sp $sp x dp $dp," \
         "batch $batch per replica, $STEPS steps, ZeRO-3 $PRECISION"
    rm -rf "${OUT:?}/loss_sp$sp"
    began=$(date +%s)
    timeout "$limit" $PY -m accelerate.commands.launch --num_processes "$NPROC" --num_machines 1 --use_deepspeed \
        --dynamo_backend no recipes/gpt_long.py $MODEL_ARGS --seq-len "$SEQ_LEN" --batch-size "$batch" \
        --grad-accum 1 --steps "$STEPS" --lr 1e-3 --warmup-steps 20 --mixed-precision "$PRECISION" --packing stream \
        --log-interval 5 --eval-interval 0 --eval-batches 2 --checkpoint-interval 0 --time-limit-min "$LIMIT_MIN" \
        --resume never --no-progress --no-save --deepspeed "$OUT/ds_zero3_loss.json" --sequence-parallel-size "$sp" \
        --cache-dir "$OUT/cache" --out-dir "$OUT/loss_sp$sp" > "$OUT/loss_sp$sp.log" 2>&1
    rc=$?; echo "   exit $rc after $(( $(date +%s) - began )) s (limit $limit s; log: $OUT/loss_sp$sp.log)"
    [ $rc -eq 124 ] && echo "loss sp=$sp: stopped at its time limit ($limit s)" >> "$OUT/skipped.txt"
    grep -E "volta_train attention|DeepSpeed-Ulysses|sequence parallel:|DeepSpeed ZeRO|step [0-9]+/|done:|Error" \
        "$OUT/loss_sp$sp.log" | grep -v "^\[" | sed -n '1,6p;$p' | cut -c1-200
  done
fi

if [[ " $PHASES " == *" memory "* ]]; then
  [ "$CPU_SMOKE" = 1 ] || export VOLTA_TRAIN_BACKEND=kernel  # the Volta kernel's memory, or an error saying why not
  for sp in 1 "$PROBE_SP"; do
    limit=$(allowed "$PROBE_TIMEOUT")
    if [ "$limit" -eq 0 ]; then
      echo "memory sp=$sp: skipped, the time limit (BUDGET_S=${BUDGET_S} s) is reached" | tee -a "$OUT/skipped.txt"
      continue
    fi
    echo "== memory sp=$sp: $PROBE_ARCH $PROBE_MODEL, $NPROC GPUs, ZeRO-3, activation checkpointing," \
         "${MEM_GB} GiB per GPU"
    began=$(date +%s)
    timeout "$limit" $PY -m torch.distributed.run --nproc_per_node "$NPROC" lab/gpu_checks/sp_memory_probe.py \
        --sp "$sp" --memory-gb "$MEM_GB" --arch "$PROBE_ARCH" --model "$PROBE_MODEL" --shard-lengths "$SHARD_LENGTHS" \
        --twin-shard-length "$TWIN_SHARD" --window "$WINDOW" "${PROBE_CPU[@]}" --out "$OUT/probe_sp$sp.json" \
        > "$OUT/probe_sp$sp.log" 2>&1
    rc=$?; echo "   exit $rc after $(( $(date +%s) - began )) s (limit $limit s; log: $OUT/probe_sp$sp.log)"
    [ $rc -eq 124 ] && echo "memory sp=$sp: stopped at its time limit ($limit s)" >> "$OUT/skipped.txt"
    grep -E "sp_memory_probe|Error|error" "$OUT/probe_sp$sp.log" | grep -v "^\[rank" | cut -c1-220 | tail -12
  done
fi

$PY lab/gpu_checks/sp_check_report.py "$OUT" | tee "$OUT/report.md"
report=${PIPESTATUS[0]}
echo "report: $OUT/report.md ($(elapsed) s in all)"
exit $report
