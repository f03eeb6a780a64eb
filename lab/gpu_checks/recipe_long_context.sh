#!/usr/bin/env bash
# Long context through the recipes users run (issue 36, item 4): each run is `accelerate launch ... recipes/<recipe>.py
# --config <shipped config>`, a few steps, every process capped at MEM_GB GiB (default 32) by memory_cap/sitecustomize.py
# (torch.cuda.set_per_process_memory_fraction right after CUDA starts; the recipes are not changed). Runs (RUNS, any
# of them, comma-separated; each fits one 10-minute device call, so a call may run one or two):
#   gpt_long_1b      configs/gpt_long/llama3_2_1b_393k_zero3_offload.yaml: Llama-3.2-1B shape, 1 GPU, ZeRO-3 with
#                    CPU offload, every memory feature, 393,216 tokens per step;
#   gpt_long_8b_sp2  configs/gpt_long/llama3_1_8b_262k_sp2_zero3_offload.yaml under configs/accelerate/zero3_offload.yaml,
#                    2 GPUs, Ulysses sp=2, 262,144 tokens per step (needs 2 GPUs: say so otherwise);
#   finetune_sp2     gpt_long saves a Llama-3.2-1B-shaped checkpoint (2 steps at 4,096 tokens), then finetune loads its
#                    directory with configs/finetune/long_context/llama3_2_1b_64k_sp2.yaml: sp=2 at 65,536 tokens
#                    (2 GPUs), and the same at SHORT tokens (default 8,192) in fp32 on 1 GPU and on 2 (sp=2), whose
#                    losses must agree;
#   plain_163k       gpt_long, Llama-3.2-1B shape, 1 GPU without DeepSpeed, every memory feature, 163,840 tokens (with
#                    fixed allocator segments it ran out of memory with 3.7 GiB reserved but unallocated; the recipes now
#                    set expandable segments: it must fit, or the report shows why not);
#   features_32k     gpt_long, Llama-3.2-1B shape, 1 GPU without DeepSpeed, 32,768 tokens: the step time with no memory
#                    feature (checkpointing and the chunked loss only), then tiled MLP, lean RMSNorm, activation
#                    offload, each alone, and all three.
# Per run it collects tokens/step, tokens/s and MFU (median over the steps after the first), peak memory (largest
# process), the attention backends the volta_train log names, and whether packed documents were kept apart
# (summary.json's packing); then writes $OUT/report.md, $OUT/recipe_long_context.json and $OUT/recipe_long_context.png
# (lab/gpu_checks/recipe_long_context_report.py, which also merges the directories of several calls:
# python3 lab/gpu_checks/recipe_long_context_report.py OUT1 OUT2 ... --out DIR).
# From the repository root:  RUNS=gpt_long_1b,features_32k OUT=/some/dir bash lab/gpu_checks/recipe_long_context.sh
# STEPS (default 3; features_32k: FEATURE_STEPS, default 5, and FEATURES, default none,tiled_mlp,lean_norm,
# activation_offload,all), MEM_GB, BUDGET_S (default 570: the call's whole budget;
# a run that would start with less than its need is skipped and named), CPU_SMOKE=1: the same flow on the CPU with
# tiny shapes (tests this script; no figures).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD/lab/gpu_checks/memory_cap:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink SHARP/multicast
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}  # per process: ZeRO-Offload's CPU optimizer step and host copies
export VOLTA_TRAIN_CACHE_DIR=${VOLTA_TRAIN_CACHE_DIR:-/tmp/volta_train_cache}
dest=${OUT:-out/recipe_long_context}
RUNS=${RUNS:-gpt_long_1b,features_32k}
STEPS=${STEPS:-3}
FEATURE_STEPS=${FEATURE_STEPS:-5}
FEATURES=${FEATURES:-none,tiled_mlp,lean_norm,activation_offload,all}
SHORT=${SHORT:-8192}
BUDGET_S=${BUDGET_S:-570}
PY=${PYTHON:-python3}
export VOLTA_LAB_MEM_GB=${MEM_GB:-32}
mkdir -p "$dest"
work=$(mktemp -d /tmp/recipe_long_context.XXXXXX)
log=$dest/recipe_long_context.log
: > "$log"
began=$(date +%s)
left() { echo $(( BUDGET_S - ($(date +%s) - began) )); }
stamp() { echo "[recipe_long_context +$(( $(date +%s) - began )) s] $*" | tee -a "$log"; }
gpus=$($PY -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
smoke=${CPU_SMOKE:-0}
if [ "$smoke" = 1 ]; then
  unset VOLTA_LAB_MEM_GB
  export OMP_NUM_THREADS=1
  gpus=2  # two gloo processes stand in for two GPUs
fi

{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  $PY -c "import torch, transformers, accelerate; print('torch', torch.__version__, torch.version.cuda, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__)"
  $PY -c "import deepspeed; print('deepspeed', deepspeed.__version__)" 2>&1 | tail -n 1
  grep -E "MemTotal|MemAvailable" /proc/meminfo; echo "cpus $(nproc); gpus $gpus; RUNS=$RUNS STEPS=$STEPS MEM_GB=${MEM_GB:-32}"
} > "$dest/env.txt" 2>&1
cat "$dest/env.txt" | tee -a "$log"

launch=($PY -m accelerate.commands.launch --num_machines 1 --dynamo_backend no)  # what `accelerate launch` runs
# what every gpt_long run adds to its config: a few steps, no evaluation, no files beyond the logs
gpt_quick=(--warmup-steps 1 --eval-batches 0 --checkpoint-interval 0 --no-save --resume never --no-progress
           --log-interval 1 --cache-dir "$work/cache")
if [ "$smoke" = 1 ]; then  # tiny shapes and lengths on the CPU; the model configs stay the shipped ones otherwise
  gpt_quick+=(--cpu --cpu-threads 1 --mixed-precision no)
fi

# run NAME NEED_S MIN_GPUS COMMAND...: COMMAND if NEED_S seconds and MIN_GPUS GPUs are left, cut off at what is left;
# its files go to $dest/NAME (the command writes them there), its output to $dest/NAME.log
run() {
  local name=$1 need=$2 min_gpus=$3
  shift 3
  local rest
  rest=$(left)
  if [ "$gpus" -lt "$min_gpus" ]; then
    stamp "$name: skipped, $gpus GPU(s) here (needs $min_gpus)"
    echo "$name: not run: needs $min_gpus GPUs, $gpus here" >> "$dest/skipped.txt"
    return 1
  fi
  if [ "$rest" -lt "$need" ]; then
    stamp "$name: skipped, ${rest} s left (needs ${need})"
    echo "$name: not run: ${rest} s left of the budget (needs ${need})" >> "$dest/skipped.txt"
    return 1
  fi
  stamp "$name: start (${rest} s left): $*"
  timeout --signal=INT --kill-after=20 "$((rest - 10))" "$@" > "$dest/$name.log" 2>&1
  local status=$?
  stamp "$name: exit $status ($(grep -E "done:|error:|Error" "$dest/$name.log" | tail -n 1 | cut -c1-300))"
  return $status
}

M1B=configs/finetune/models/llama3_2_1b
C1B=configs/gpt_long/llama3_2_1b_393k_zero3_offload.yaml
C8B=configs/gpt_long/llama3_1_8b_262k_sp2_zero3_offload.yaml
CFT=configs/finetune/long_context/llama3_2_1b_64k_sp2.yaml
ACC=configs/accelerate/zero3_offload.yaml  # the accelerate config of the multi-process runs (DeepSpeed, as they name)
shape1b=() shape8b=() ftlen=() featlen=(--seq-len 32768) pretrain=(--model-config "$M1B")
if [ "$smoke" = 1 ]; then
  small=(--model-config configs/finetune/models/tiny_llama --seq-len 1024)
  shape1b=("${small[@]}") shape8b=("${small[@]}" --activation-offload-keep 0) featlen=(--seq-len 512) pretrain=(--model-config
    configs/finetune/models/tiny_llama) ftlen=(--data.max-length 1024 --train.cpu --train.cpu-threads 1
    --precision.mixed-precision no)
  SHORT=256
  M1B=configs/finetune/models/tiny_llama
fi

for name in ${RUNS//,/ }; do
  case $name in
    gpt_long_1b)
      run gpt_long_1b 200 1 "${launch[@]}" --num_processes 1 recipes/gpt_long.py --config "$C1B" "${shape1b[@]}" \
        --steps "$STEPS" "${gpt_quick[@]}" --out-dir "$dest/gpt_long_1b" ;;
    gpt_long_8b_sp2)
      run gpt_long_8b_sp2 300 2 "${launch[@]}" --config_file "$ACC" --num_processes 2 \
        recipes/gpt_long.py --config "$C8B" "${shape8b[@]}" --steps "$STEPS" "${gpt_quick[@]}" \
        --out-dir "$dest/gpt_long_8b_sp2" ;;
    finetune_sp2)
      # a corpus long enough for the steps' packed rows (the bytes tokenizer: one token per byte)
      $PY data/make_corpus.py --mb 4 --seed 1 --out "$work/corpus.jsonl" >> "$log" 2>&1
      run finetune_pretrain 120 1 "${launch[@]}" --num_processes 1 recipes/gpt_long.py "${pretrain[@]}" --seq-len 4096 \
          --batch-size 1 --grad-accum 1 --steps 2 --packing documents --gradient-checkpointing --warmup-steps 1 \
          --eval-batches 0 --checkpoint-interval 0 --resume never --no-progress --cache-dir "$work/cache" \
          $([ "$smoke" = 1 ] && echo "--cpu --cpu-threads 1 --seq-len 256") --out-dir "$work/pretrained" || continue
      mkdir -p "$dest/finetune_pretrain"  # its logs for the report; the checkpoint stays out of $OUT (~5 GB)
      cp "$work/pretrained"/{train.log,train.csv,summary.json,config.yaml} "$dest/finetune_pretrain/" 2>/dev/null
      ft=(recipes/finetune.py --config "$CFT" --model.path "$work/pretrained/final" --data.train "$work/corpus.jsonl"
          --data.eval-fraction 0 --data.cache-dir "$work/cache" --train.steps "$STEPS" --checkpoint.interval 0
          --checkpoint.no-save-final --checkpoint.resume never --logging.no-progress)
      run finetune_sp2 220 2 "${launch[@]}" --config_file "$ACC" --num_processes 2 "${ft[@]}" "${ftlen[@]}" \
        --logging.out-dir "$dest/finetune_sp2"
      short=(--data.max-length "$SHORT" --precision.mixed-precision no --train.steps 2
             $([ "$smoke" = 1 ] && echo "--train.cpu --train.cpu-threads 1"))
      run finetune_short_sp1 100 1 "${launch[@]}" --config_file "$ACC" --num_processes 1 "${ft[@]}" "${short[@]}" --parallel.sequence-parallel-size 1 \
        --logging.out-dir "$dest/finetune_short_sp1"
      run finetune_short_sp2 100 2 "${launch[@]}" --config_file "$ACC" --num_processes 2 "${ft[@]}" "${short[@]}" \
        --logging.out-dir "$dest/finetune_short_sp2" ;;
    plain_163k)
      run plain_163k 200 1 "${launch[@]}" --num_processes 1 recipes/gpt_long.py --model-config "$M1B" \
        $([ "$smoke" = 1 ] && echo "--seq-len 1024" || echo "--seq-len 163840") --batch-size 1 --grad-accum 1 \
        --mixed-precision fp16 --packing documents --gradient-checkpointing --activation-offload --tiled-mlp on \
        --lean-norm on --chunked-loss --steps "$STEPS" "${gpt_quick[@]}" --out-dir "$dest/plain_163k" ;;
    features_32k)
      base=(--model-config "$M1B" "${featlen[@]}" --batch-size 1 --grad-accum 1 --mixed-precision fp16
            --packing documents --gradient-checkpointing --chunked-loss --tiled-mlp off --lean-norm off
            --steps "$FEATURE_STEPS" "${gpt_quick[@]}")
      for variant in ${FEATURES//,/ }; do
        case $variant in
          none) extra=() ;;
          tiled_mlp) extra=(--tiled-mlp on) ;;
          lean_norm) extra=(--lean-norm on) ;;
          activation_offload) extra=(--activation-offload) ;;
          all) extra=(--tiled-mlp on --lean-norm on --activation-offload) ;;
          *) stamp "unknown feature $variant (accepted: none, tiled_mlp, lean_norm, activation_offload, all)"; continue ;;
        esac
        run "features_32k_$variant" 80 1 "${launch[@]}" --num_processes 1 recipes/gpt_long.py "${base[@]}" "${extra[@]}" \
          --out-dir "$dest/features_32k_$variant"
      done ;;
    *) stamp "unknown run $name (accepted: gpt_long_1b, gpt_long_8b_sp2, finetune_sp2, plain_163k, features_32k)" ;;
  esac
done

$PY lab/gpu_checks/recipe_long_context_report.py "$dest" --out "$dest" 2>&1 | tee -a "$log"
stamp "done"
rm -rf "$work"
