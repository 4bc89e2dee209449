#!/usr/bin/env bash
# On the GPU machine, once per call: move the carried piece(s) of the CUDA fbgemm wheel (and its
# .sha256 manifest) out of the repository copy into $PIECES, where they wait for the next calls.
#   gpu/keep_piece.sh [DEST]     DEST as given to fetch_wheels.sh (default .whl/gpu)
set -euo pipefail
cd "$(dirname "$0")/.."
PIECES="${PIECES:-/tmp/paritykit-pieces}"
mkdir -p "$PIECES"
cp -v "${1:-.whl/gpu}"/tier2-pieces/* "$PIECES"/
ls "$PIECES" | wc -l
