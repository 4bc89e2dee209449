"""cw-stitch (the sharding check): a sharded EC/EBC, column-wise tables on ranks in any order mixed
with the other placements, against the same module unsharded.

stitching.py  paritykit's own column-wise shard-order math (the oracle for torchrec's permutation)
cases.py      the case type, the drawn plans, pinned placements, known-broken combinations
assertion.py  the rank function and ``assert_sharded_matches_unsharded``
matrix.py     the gate entry
plants.py     planted bugs in torchrec's CW stitching and sharded pooling
"""

from paritykit.checks.runner import CheckEntry
from paritykit.checks.sharding.matrix import NAME, run_matrix

CHECK = CheckEntry(NAME, plants="paritykit.checks.sharding.plants", run=run_matrix)

__all__ = ["CHECK"]
