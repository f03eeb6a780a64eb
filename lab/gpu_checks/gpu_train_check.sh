#!/usr/bin/env bash
# GPU check of recipes/gpt_long.py under DeepSpeed ZeRO-2 and ZeRO-3, fp16, 2 GPUs, attention through
# volta_train: a few hundred steps each, the loss trajectory and the figures for the issue note.
# About 4-7 minutes; every run is capped (time_limit_min + timeout) so the whole script stays under 8.
#
#   bash lab/gpu_checks/gpu_train_check.sh       # from the repository root, on a machine with 2 GPUs
#   STEPS=200 SEQ_LEN=1024 bash lab/gpu_checks/gpu_train_check.sh
#
# DeepSpeed, when the GPU machine lacks it and has no network, comes from the wheels carried in WHEELS (default
# .whl/, ignored by git), installed by lab/gpu_checks/carried_wheels.sh (its header lists them).
#
# Output: out/gpu_train_check/{zero2,zero3}/ (train.csv, eval.csv, summary.json, train.log, TensorBoard),
# out/gpu_train_check/report.md (the table and trajectories printed at the end), loss.png.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # this checkout's volta_train

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # NCCL without NVLink SHARP/multicast: the checks do not need it
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} TOKENIZERS_PARALLELISM=false DS_ACCELERATOR=${DS_ACCELERATOR:-cuda}
PY=${PYTHON:-python3}
OUT=${OUT_DIR:-out/gpu_train_check}
NPROC=${NPROC:-2}
STEPS=${STEPS:-300}
MODEL=${MODEL:-mini}          # GPT-2 "mini": 6 layers, 6 heads of 64, width 384 (~12 M parameters)
SEQ_LEN=${SEQ_LEN:-2048}
BATCH=${BATCH:-4}
LIMIT_MIN=${LIMIT_MIN:-2.5}   # training minutes per run (then a checkpoint and a clean stop)
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"

echo "== environment"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader || true
if ! $PY -c "import deepspeed" 2>/dev/null; then
  echo "deepspeed not installed: installing the wheels in $WHEELS/"
  source lab/gpu_checks/carried_wheels.sh
  $PY -c "import deepspeed" 2>/dev/null || { echo "FAILED: put the wheels of lab/gpu_checks/carried_wheels.sh in $WHEELS"; exit 1; }
fi
$PY - <<'EOF'
import torch, transformers, accelerate, deepspeed
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, "
      f"accelerate {accelerate.__version__}, deepspeed {deepspeed.__version__}, GPUs {torch.cuda.device_count()}")
EOF
$PY -m volta_train.env 2>&1 | tail -n 12 || true
GPUS=$($PY -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -lt "$NPROC" ]; then echo "FAILED: $NPROC GPUs needed, $GPUS found"; exit 1; fi

COMMON=(--model "$MODEL" --seq-len "$SEQ_LEN" --batch-size "$BATCH" --grad-accum 1 --steps "$STEPS"
        --lr 1e-3 --warmup-steps 30 --mixed-precision fp16 --log-interval 10 --eval-interval 100 --eval-batches 4
        --checkpoint-interval 100 --time-limit-min "$LIMIT_MIN" --resume never --no-progress
        --cache-dir "$OUT/cache")
status=0
for stage in zero2 zero3; do
  echo "== $stage: $MODEL, seq $SEQ_LEN x batch $BATCH x $NPROC GPUs, $STEPS steps, fp16"
  rm -rf "${OUT:?}/$stage"
  start=$(date +%s)
  timeout 210 $PY -m accelerate.commands.launch --num_processes "$NPROC" --num_machines 1 --use_deepspeed \
      --dynamo_backend no recipes/gpt_long.py "${COMMON[@]}" --deepspeed "$stage" --out-dir "$OUT/$stage" \
      > "$OUT/$stage.log" 2>&1
  rc=$?
  echo "   exit $rc after $(( $(date +%s) - start )) s (log: $OUT/$stage.log)"
  grep -E "volta_train attention|packing|DeepSpeed ZeRO|device:|step [0-9]+/|eval step|done:|Error|error" "$OUT/$stage.log" \
      | grep -v "^\[" | sed -n '1,6p;$p' | cut -c1-220
  [ $rc -eq 0 ] || status=1
done

$PY - "$OUT" <<'EOF' | tee "$OUT/report.md"
import csv, json, math, sys
from pathlib import Path

out = Path(sys.argv[1])
runs = {}
for stage in ("zero2", "zero3"):
    d = out / stage
    if not (d / "summary.json").exists():
        print(f"{stage}: no summary (see {out}/{stage}.log)")
        continue
    rows = list(csv.DictReader((d / "train.csv").open()))
    runs[stage] = (json.loads((d / "summary.json").read_text()), rows)

print("\n## gpt_long.py on 2 GPUs, DeepSpeed, fp16 (volta_train attention)\n")
print("| run | steps | final loss | val loss | tok/s (2 GPUs) | TFLOP/s per GPU | peak mem (GiB) | loss scale | "
      "skipped | attention | packing |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for stage, (s, rows) in runs.items():
    last = rows[-1] if rows else {}
    print(f"| {stage} | {s['steps']}/{s['planned_steps']} | {s['train_loss']:.4f} | {s['val_loss']:.4f} | "
          f"{s['tokens_per_second']:,.0f} | {s['model_tflops_per_device']:.2f} | "
          f"{s['peak_memory_bytes'] / 2**30:.2f} | {last.get('loss_scale', '')} | {s['skipped_steps']} | "
          f"{s['attention']} | {s['packing']} |")
ok = True
print("\nloss trajectory (every 10 steps' mean):\n")
steps = sorted({int(r['step']) for _, rows in runs.values() for r in rows})
names = list(runs)
print("| step | " + " | ".join(names) + " |")
print("| --- | " + " | ".join("---" for _ in names) + " |")
for step in sorted(set(steps[:: max(1, len(steps) // 15)] + steps[-1:])):
    cells = []
    for n in names:
        row = next((r for r in runs[n][1] if int(r["step"]) == step), None)
        cells.append(f"{float(row['loss']):.4f}" if row else "")
    print(f"| {step} | " + " | ".join(cells) + " |")
for n, (s, rows) in runs.items():
    losses = [float(r["loss"]) for r in rows]
    finite = all(math.isfinite(x) for x in losses)
    dropped = len(losses) >= 4 and sum(losses[-3:]) / 3 < losses[0] - 1.0
    print(f"\n{n}: loss {losses[0]:.3f} -> {losses[-1]:.3f}; finite: {finite}; decreased by > 1 nat: {dropped}")
    ok &= finite and dropped and s["steps"] >= 100
if len(runs) == 2:
    a, b = (runs[n][1] for n in names)
    common = {r["step"]: float(r["loss"]) for r in a}
    diffs = [abs(common[r["step"]] - float(r["loss"])) for r in b if r["step"] in common]
    if diffs:
        print(f"\nzero2 vs zero3: max |loss difference| over {len(diffs)} logged steps = {max(diffs):.4f} "
              "(same seed and data; fp16 reductions differ in order)")
from volta_train.training.plots import plot_loss_curves
if plot_loss_curves({f"{n} ({s['attention']})": rows for n, (s, rows) in runs.items()},
                    "gpt_long.py, 2 GPUs, DeepSpeed fp16", out / "loss.png"):
    print(f"\nplot: {out / 'loss.png'}")
print("\nRESULT:", "PASS" if ok and len(runs) == 2 else "FAIL")
sys.exit(0 if ok and len(runs) == 2 else 1)
EOF
report=$?
[ $status -eq 0 ] && [ $report -eq 0 ] && exit 0 || exit 1
