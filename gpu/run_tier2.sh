#!/usr/bin/env bash
# Tier 2 on the GPU machine (after the pieces are kept and gpu/install_offline.sh 2): the gate on
# CUDA with nccl (one GPU: world size 1; cw-stitch needs two GPUs and is left out here), the
# pipelines with real CUDA streams (the pipeline check runs every pipeline, the fused ones and the
# feature-processor divergence control included, on --device), and the CUDA-only tests.
#   gpu/run_tier2.sh [RESULTS]        default RESULTS: $OUT if set, else /tmp/paritykit-gpu-results
set -uo pipefail
cd "$(dirname "$0")/.."
source gpu/steps.sh 2 "${1:-}"
GPUS="$("$PY" -c 'import torch; print(torch.cuda.device_count())')"
step "$PY" -m paritykit info
step "$PY" gpu/sync_table.py --left cpu --right cuda --markdown "$RESULTS/sync-table-tier2.md"
checks=(--check td-kjt --check pipeline --check sync --check fixtures)
sizes=1
if [ "$GPUS" -ge 2 ]; then checks+=(--check cw-stitch); sizes=1,2; fi
step "$PY" -m paritykit gate "${checks[@]}" --device cuda --world-size "$sizes" --report "$RESULTS/gate-tier2"
step "$PY" -m pytest -q -p no:cacheprovider "${PLUGIN[@]}" --paritykit-device cuda -m gpu tests/
echo "== tier 2: $failed step(s) failed"
exit "$failed"
