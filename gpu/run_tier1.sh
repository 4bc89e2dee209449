#!/usr/bin/env bash
# Tier 1 on the GPU machine (after gpu/install_offline.sh 1): the sync corpus on both backends
# (a Markdown table of CPU-proxy vs CUDA counts per budget), eager TD/KJT parity on CUDA, the
# gate's sync and td-kjt checks on CUDA at world size 1, and the tests marked gpu.
#   gpu/run_tier1.sh [RESULTS]        default RESULTS: $OUT if set, else /tmp/paritykit-gpu-results
# Every step runs; the exit code is the number of steps that failed.
set -uo pipefail
cd "$(dirname "$0")/.."
source gpu/steps.sh 1 "${1:-}"
step "$PY" -m paritykit info
step "$PY" gpu/sync_table.py --left cpu --right cuda --markdown "$RESULTS/sync-table.md"
step "$PY" gpu/eager_td_kjt.py --device cuda --examples 200
step "$PY" -m paritykit gate --check sync --check td-kjt --device cuda --world-size 1 --report "$RESULTS/gate-tier1"
step "$PY" -m pytest -q -p no:cacheprovider "${PLUGIN[@]}" --paritykit-device cuda -m gpu tests/
echo "== tier 1: $failed step(s) failed"
exit "$failed"
