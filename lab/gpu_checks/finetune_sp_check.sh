#!/usr/bin/env bash
# finetune with sequence parallelism on GPUs, through the recipes users run (2 GPUs, about 6 minutes):
#   1. gpt_long trains a small Llama-shaped model for a few steps and saves it (out/final: weights + config);
#   2. finetune loads that directory (model.path) and trains on packed rows of SHORT tokens on one GPU, then on two
#      GPUs sharing each row (parallel.sequence_parallel_size 2, ZeRO-3): the losses of both must agree (fp32);
#   3. finetune with sequence parallelism 2 at LONG tokens per row (default 65,536), fp16, every memory feature on:
#      it must finish its steps; summary.json gives tokens/s and peak memory.
# From the repository root:  OUT=/some/dir bash lab/gpu_checks/finetune_sp_check.sh
# Output in $OUT: report.txt (PASS/FAIL lines), the three runs' directories (train.log, train.csv, summary.json).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink SHARP/multicast
dest=${OUT:-out/finetune_sp_check}
SHORT=${SHORT:-8192}
LONG=${LONG:-65536}
STEPS=${STEPS:-6}
PY=${PYTHON:-python3}
mkdir -p "$dest"
report=$dest/report.txt
: > "$report"
launch() { $PY -m accelerate.commands.launch --num_machines 1 --dynamo_backend no --use_deepspeed "$@"; }

# a corpus long enough for STEPS packed rows of LONG tokens (bytes tokenizer: one token per byte)
$PY - "$dest/corpus.jsonl" "$LONG" "$STEPS" <<'EOF'
import json, sys
from volta_train.training.corpus import synthetic_documents
path, length, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with open(path, "w", encoding="utf-8") as f:
    for doc in synthetic_documents(length * (steps + 2) * 2, seed=1):
        f.write(json.dumps({"text": doc}) + "\n")
EOF

$PY recipes/gpt_long.py --arch llama --model mini --n-kv-head 2 --seq-len 4096 --steps 20 --batch-size 2 \
  --grad-accum 1 --out-dir "$dest/pretrained" --no-progress --checkpoint-interval 0 > "$dest/pretrained.log" 2>&1 \
  || { echo "FAIL gpt_long pretraining (see pretrained.log)" | tee -a "$report"; exit 1; }

common=(--config configs/finetune/llama_text_packed.yaml --model.path "$dest/pretrained/final" --data.train
        "$dest/corpus.jsonl" --data.eval-fraction 0 --train.steps "$STEPS" --train.batch-size 1
        --logging.log-interval 1 --logging.no-progress --checkpoint.interval 0 --parallel.deepspeed zero3)
launch --num_processes 1 recipes/finetune.py "${common[@]}" --data.max-length "$SHORT" --precision.mixed-precision no \
  --logging.out-dir "$dest/sp1" > "$dest/sp1.log" 2>&1 || echo "FAIL sp1 run (see sp1.log)" | tee -a "$report"
launch --num_processes 2 recipes/finetune.py "${common[@]}" --data.max-length "$SHORT" --precision.mixed-precision no \
  --parallel.sequence-parallel-size 2 --logging.out-dir "$dest/sp2" > "$dest/sp2.log" 2>&1 \
  || echo "FAIL sp2 run (see sp2.log)" | tee -a "$report"
$PY - "$dest" <<'EOF' | tee -a "$report"
import csv, math, sys
from pathlib import Path
d = Path(sys.argv[1])
rows = [[(int(r["step"]), float(r["loss"])) for r in csv.DictReader((d / run / "train.csv").open())]
        for run in ("sp1", "sp2")]
worst = max(abs(a - b) / abs(a) for (_, a), (_, b) in zip(*rows))
ok = len(rows[0]) == len(rows[1]) > 0 and worst < 1e-3
print(f"{'PASS' if ok else 'FAIL'} finetune sp2 vs sp1 losses: largest relative difference {worst:.2e} over "
      f"{len(rows[0])} steps (accepted: < 1e-3)")
EOF
launch --num_processes 2 recipes/finetune.py "${common[@]}" --data.max-length "$LONG" --precision.mixed-precision fp16 \
  --parallel.sequence-parallel-size 2 --memory.gradient-checkpointing --memory.tiled-mlp on \
  --logging.out-dir "$dest/long" > "$dest/long.log" 2>&1 && \
  $PY -c "import json,sys; s=json.load(open(sys.argv[1])); print(f\"PASS finetune sp2 at $LONG tokens per row: \
{s['steps']} steps, {s['tokens_per_second']:,.0f} tok/s, peak {s['peak_memory_bytes']/2**30:.1f} GiB\")" \
  "$dest/long/summary.json" | tee -a "$report" || echo "FAIL finetune sp2 at $LONG tokens (see long.log)" | tee -a "$report"
cat "$report"
! grep -q FAIL "$report"
