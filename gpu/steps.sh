# Sourced by run_tier1.sh and run_tier2.sh: `source gpu/steps.sh TIER [RESULTS]` loads the tier's
# environment (written by install_offline.sh), makes RESULTS (default $OUT if set, else
# /tmp/paritykit-gpu-results) and defines `step`, which runs a command, reports it, and counts
# it in $failed when it fails, so that every step runs.
source "/tmp/paritykit-env-tier$1.sh"
RESULTS="${2:-${OUT:-/tmp/paritykit-gpu-results}}"
mkdir -p "$RESULTS"
PY="${PYTHON:-python3}"
failed=0
step() { echo "== $*"; "$@" || { echo "== FAILED ($?): $*"; failed=$((failed + 1)); }; }
# paritykit runs from this repository (PYTHONPATH), so pytest finds its plugin only when named,
# unless paritykit is also installed there (then naming it again would register it twice).
PLUGIN=(-p paritykit.plugin)
"$PY" -c "import sys; from importlib.metadata import entry_points
sys.exit(any(e.value == 'paritykit.plugin' for e in entry_points(group='pytest11')))" || PLUGIN=()
