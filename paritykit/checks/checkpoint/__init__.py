"""checkpoint: a sharded model and its optimizers saved the way torchrec users do it, reloaded into a
freshly sharded model (the same plan, another plan, another world size) and trained on, equal the
unsharded model trained straight through and the run that never reloaded.

The rank-side machinery is in the engine (``paritykit/engine/checkpoint*.py``). The check itself:
assertion.py    the public assertion (``assert_checkpoint_roundtrip``)
cases.py, draws.py, pinned.py, known_broken.py, matrix.py (the gate entry)
plants.py       planted bugs in torchrec's checkpoint paths
"""

from paritykit.checks.checkpoint.matrix import NAME, run_matrix
from paritykit.checks.runner import CheckEntry

CHECK = CheckEntry(NAME, plants="paritykit.checks.checkpoint.plants", run=run_matrix,
                   oracle="the unsharded model trained straight through, and the sharded run that never reloaded")

__all__ = ["CHECK"]
