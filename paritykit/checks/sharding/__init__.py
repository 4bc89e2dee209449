"""sharding: an EBC or EC sharded any way torchrec offers trains exactly like the unsharded module.

The engine it runs on (training the sharded model, the unsharded reference, the comparison) is
``paritykit.engine``, below the checks. The check itself:
assertion.py   the public assertion (the engine's, plus the built-in case form)
cases.py, draws.py, pinned.py, known_broken.py, case_runner.py, matrix.py (the gate entry),
stitching.py   paritykit's own column-wise shard-order math, the oracle for torchrec's permutation
plants.py      planted bugs in torchrec's sharded training
"""

from paritykit.checks.runner import CheckEntry
from paritykit.checks.sharding.matrix import NAME, run_matrix

CHECK = CheckEntry(NAME, plants="paritykit.checks.sharding.plants", run=run_matrix,
                   oracle="the unsharded module trained with torchrec's gradient semantics and torch optimizers",
                   known_configurations="paritykit.checks.sharding.known_broken")

__all__ = ["CHECK"]
