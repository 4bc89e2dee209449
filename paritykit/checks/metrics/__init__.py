"""metrics: torchrec.metrics' metric classes against each metric's weighted formula.

reference.py     each metric's formula in float64 over plain lists, and what a window holds
specs.py         a case: a metric, one or two tasks, fused or not, a stream of batches; drawn and pinned
cases.py         a case: the metric class fed the stream, every reported value against the formula
known_broken.py  metric behaviour torchrec gets wrong, run on purpose
matrix.py        the gate entry
plants.py        planted bugs
"""

from paritykit.checks.metrics.matrix import NAME, run_matrix
from paritykit.checks.runner import CheckEntry

CHECK = CheckEntry(NAME, plants="paritykit.checks.metrics.plants", run=run_matrix,
                   oracle="each metric's weighted formula in float64 over the samples its lifetime or window holds")

__all__ = ["CHECK"]
