"""sync: device->host synchronizations of TorchRec hot paths, counted against exact budgets.

inputs.py        the shared batch (host JaggedTensors, device KJTs, TensorDict) and the backend choice
budgets.py       single-process budgets: KJT ops, EBC forward, the TD paths
dist_budgets.py  budgets per rank: a sharded EBC's input_dist, one step of each training pipeline
matrix.py        the gate entry
plants.py        planted syncs
"""

from paritykit.checks.runner import CheckEntry
from paritykit.checks.sync.matrix import NAME, run_matrix

CHECK = CheckEntry(NAME, plants="paritykit.checks.sync.plants", run=run_matrix)

__all__ = ["CHECK"]
