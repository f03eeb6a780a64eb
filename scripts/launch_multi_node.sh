#!/usr/bin/env bash
# Launch a recipe on several machines: run it once on every machine, with that machine's rank.
# accelerate launch with configs/accelerate/multi_node.yaml (DeepSpeed ZeRO-2; CONFIG=FILE for another).
#
#   NUM_MACHINES=2 MAIN_PROCESS_IP=10.0.0.1 MACHINE_RANK=0 scripts/launch_multi_node.sh gpt_long \
#       --config configs/gpt_long/v100_gpt2_small_16k.yaml --out-dir /shared/runs/x
#   srun --ntasks-per-node=1 scripts/launch_multi_node.sh gpt_long ...     # Slurm fills in the three
#
# NUM_MACHINES, MAIN_PROCESS_IP (machine 0's address, reachable from all), MACHINE_RANK (0 .. NUM_MACHINES - 1);
# under Slurm they default to $SLURM_JOB_NUM_NODES, the first host of $SLURM_JOB_NODELIST and $SLURM_NODEID.
# GPUS_PER_NODE (default: those nvidia-smi lists), MAIN_PROCESS_PORT (29500). out_dir must be on storage every
# machine sees (checkpoints are written by every rank, committed by rank 0); configs/README.md, "Several nodes".
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
[ $# -ge 1 ] || { echo "usage: $0 RECIPE [recipe options...]; RECIPE gpt_long, finetune or a script" >&2; exit 2; }
recipe="$1"
shift
case "$recipe" in
    gpt_long | finetune) recipe="$root/recipes/$recipe.py" ;;
esac
[ -f "$recipe" ] || { echo "$0: recipe '$recipe' not found; accepted: gpt_long, finetune or the path of a script" >&2; exit 2; }
machines="${NUM_MACHINES:-${SLURM_JOB_NUM_NODES:-}}"
rank="${MACHINE_RANK:-${SLURM_NODEID:-}}"
address="${MAIN_PROCESS_IP:-}"
if [ -z "$address" ] && [ -n "${SLURM_JOB_NODELIST:-}" ]; then
    address="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
fi
for pair in "NUM_MACHINES:$machines" "MACHINE_RANK:$rank" "MAIN_PROCESS_IP:$address"; do
    [ -n "${pair#*:}" ] || { echo "$0: ${pair%%:*} is not set (and no Slurm job gives it)" >&2; exit 2; }
done
gpus="${GPUS_PER_NODE:-$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)}"
[ "${gpus:-0}" -ge 1 ] || { echo "$0: no GPU listed by nvidia-smi; set GPUS_PER_NODE" >&2; exit 2; }
exec accelerate launch --config_file "${CONFIG:-$root/configs/accelerate/multi_node.yaml}" \
    --num_machines "$machines" --num_processes "$((machines * gpus))" --machine_rank "$rank" \
    --main_process_ip "$address" --main_process_port "${MAIN_PROCESS_PORT:-29500}" "$recipe" "$@"
