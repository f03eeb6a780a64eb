#!/usr/bin/env bash
# flash-attn 2.8.3's own tests/test_flash_attn.py, unmodified, against volta_train on a GPU (see README.md).
#   bash lab/flash_attn_suite/run.sh PATH/TO/test_flash_attn.py [pytest args]
# Env: FA_SUITE_PER_FUNCTION (cases kept per test function, default 120), FA_SUITE_SEED, FA_SUITE_OUT,
# FA_SUITE_BUDGET_S (start no case after this many seconds).
set -uo pipefail
test_file=${1:?path to flash-attn 2.8.3 tests/test_flash_attn.py}; shift
work=$(mktemp -d /tmp/fa_suite.XXXXXX)
cp "$test_file" "$work/test_flash_attn.py"
export PYTHONPATH=$PWD/lab/flash_attn_suite:$PWD${PYTHONPATH:+:$PYTHONPATH}
export FA_SUITE_OUT=${FA_SUITE_OUT:-$PWD/out/flash_attn_suite}
(cd "$work" && python3 -m pytest test_flash_attn.py -p fa_suite_plugin -q -p no:cacheprovider "$@" \
   > "$FA_SUITE_OUT.log" 2>&1); rc=$?
tail -3 "$FA_SUITE_OUT.log"; cat "$FA_SUITE_OUT/summary.md"
exit $rc
