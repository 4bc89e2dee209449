#!/usr/bin/env bash
# Download the GPU machine's wheels (gpu/wheels.txt) on a machine that reaches PyPI.
#   gpu/fetch_wheels.sh [DEST] [TIERS]   default DEST: .whl/gpu (ignored by git), TIERS: "1 2"
# Writes DEST/tier1/*.whl (small: carried in one call) and DEST/tier2/*.whl, with the CUDA fbgemm
# wheel split into 60 MiB pieces under DEST/tier2-pieces (carried one piece per call).
# GPU_PYTHON (default 3.12) and GPU_PLATFORM (default manylinux_2_28_x86_64) describe the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST="${1:-.whl/gpu}"
TIERS="${2:-1 2}"
PYVER="${GPU_PYTHON:-3.12}"
PLATFORMS=(--platform "${GPU_PLATFORM:-manylinux_2_28_x86_64}" --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
PY="${PYTHON:-python3}"
for tier in $TIERS; do
    mkdir -p "$DEST/tier$tier"
    mapfile -t wanted < <(awk -v t="$tier" '$1 == t {print $2}' gpu/wheels.txt)
    "$PY" -m pip download --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
        "${PLATFORMS[@]}" -d "$DEST/tier$tier" "${wanted[@]}"
done
if [ -d "$DEST/tier2" ]; then
    for big in "$DEST"/tier2/fbgemm_gpu-*.whl; do
        [ -e "$big" ] || continue
        "$PY" gpu/pieces.py split "$big" "$DEST/tier2-pieces" --mib 60
        rm "$big"
    done
fi
ls -l "$DEST"/*
