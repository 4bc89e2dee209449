"""sharding: an EBC or EC sharded any way torchrec offers trains exactly like the unsharded module.

The one engine (also behind ``paritykit.assert_sharded_matches_unsharded`` for users' own models):
assertion.py   the public assertion: resolve the plan and check the batches in the caller, train
               the unsharded reference, train the sharded model on the ranks, compare
training.py    the rank side: DMP from the same initial state, N steps, everything recorded
reference.py   the oracle: the unsharded model trained with torchrec's gradient semantics
comparison.py  per step embeddings, outputs and losses, then state and optimizer state
tolerances.py  the stated bounds (norm-wise, per dtype; exact for gathers)
probes.py, outputs.py, losses.py, inputs.py   recording embedding outputs, outputs, the default loss,
               the batches' checks
The built-in check:
cases.py, draws.py, pinned.py, known_broken.py, case_runner.py, matrix.py (the gate entry),
stitching.py   paritykit's own column-wise shard-order math, the oracle for torchrec's permutation
plants.py      planted bugs in torchrec's sharded training
"""

from paritykit.checks.runner import CheckEntry
from paritykit.checks.sharding.matrix import NAME, run_matrix

CHECK = CheckEntry(NAME, plants="paritykit.checks.sharding.plants", run=run_matrix)

__all__ = ["CHECK"]
