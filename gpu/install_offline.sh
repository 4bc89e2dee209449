#!/usr/bin/env bash
# On the GPU machine, without a network: install one tier's wheels into a directory of their own
# (the machine's torch and packages stay as they are), then check that the stack imports.
#   gpu/install_offline.sh 1|2 [DEST]     DEST as given to fetch_wheels.sh (default .whl/gpu)
# Tier 2 first joins the CUDA fbgemm wheel from the pieces gathered by gpu/keep_piece.sh.
# Writes /tmp/paritykit-env-tier<N>.sh (source it: PYTHONPATH = that directory + this repository).
set -euo pipefail
cd "$(dirname "$0")/.."
tier="${1:?usage: gpu/install_offline.sh 1|2 [DEST]}"
DEST="${2:-.whl/gpu}"
PY="${PYTHON:-python3}"
SITE="/tmp/paritykit-site-tier$tier"
PIECES="${PIECES:-/tmp/paritykit-pieces}"
case "$tier" in 1|2) ;; *) echo "tier must be 1 or 2, got $tier" >&2; exit 2 ;; esac
"$PY" -c "import torch; assert torch.cuda.is_available(), 'torch sees no GPU'; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name(0))"
wheels=()
for wheel in "$DEST/tier$tier"/*.whl; do
    module="$(basename "$wheel" | cut -d- -f1)"
    case "$module" in
        # Needs the image may already have: installed only where import does not find them.
        tensordict|pyvers|iopath) "$PY" -c "import $module" 2>/dev/null && { echo "have $module"; continue; } ;;
    esac
    wheels+=("$wheel")
done
if [ "$tier" = 2 ]; then
    wheels+=("$("$PY" gpu/pieces.py join "$PIECES" /tmp/paritykit-joined)")
fi
rm -rf "$SITE"
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "${wheels[@]}"
echo "export PYTHONPATH=$SITE:$PWD" > "/tmp/paritykit-env-tier$tier.sh"
PYTHONPATH="$SITE:$PWD" "$PY" -c "
import torch, fbgemm_gpu, torchrec, tensordict, paritykit
from importlib.metadata import version
print('imports ok:', ', '.join(f'{n} {version(n)}' for n in ('torchrec', 'tensordict')), 'fbgemm_gpu from', fbgemm_gpu.__file__)
"
echo "source /tmp/paritykit-env-tier$tier.sh"
