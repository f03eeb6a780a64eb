#!/usr/bin/env bash
# Launch a recipe on the GPUs of this machine: accelerate launch with one of configs/accelerate/.
#
#   scripts/launch_node.sh CONFIG RECIPE [recipe options...]
#   scripts/launch_node.sh ddp gpt_long --config configs/gpt_long/v100_gpt2_small_4k.yaml
#   NUM_PROCESSES=4 scripts/launch_node.sh zero2 finetune --config configs/finetune/...
#
# CONFIG: one_process, single_gpu, ddp, zero2, zero3 or zero3_offload (configs/README.md says which for which cluster).
# RECIPE: gpt_long, finetune (recipes/<name>.py) or the path of a script. NUM_PROCESSES: processes (default: one per
# GPU nvidia-smi lists, 1 without one; one_process and single_gpu always 1). Run from anywhere: paths are the repository's.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
configs="one_process single_gpu ddp zero2 zero3 zero3_offload"
usage() {
    echo "usage: $0 CONFIG RECIPE [recipe options...]; CONFIG one of: $configs; RECIPE gpt_long, finetune or a script" >&2
    exit 2
}
[ $# -ge 2 ] || usage
config="$1" recipe="$2"
shift 2
case " $configs " in
    *" $config "*) ;;
    *) echo "$0: no single-machine accelerate config '$config'; accepted: $configs (several machines: scripts/launch_multi_node.sh)" >&2; exit 2 ;;
esac
case "$recipe" in
    gpt_long | finetune) recipe="$root/recipes/$recipe.py" ;;
esac
[ -f "$recipe" ] || { echo "$0: recipe '$recipe' not found; accepted: gpt_long, finetune or the path of a script" >&2; exit 2; }
if [ "$config" = one_process ] || [ "$config" = single_gpu ]; then
    processes=1
else
    processes="${NUM_PROCESSES:-$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)}"
    [ "${processes:-0}" -ge 1 ] || processes=1
fi
exec accelerate launch --config_file "$root/configs/accelerate/$config.yaml" --num_processes "$processes" "$recipe" "$@"
