"""sync: device->host synchronizations of TorchRec hot paths, counted against exact budgets.

inputs.py            the shared batch (host JaggedTensors, device KJTs, TensorDict, per-rank batches)
features.py          what the installed torchrec offers (TD input, regroup_as_dict), by feature
budget.py            a single-process budget and how its region is counted
kjt_budgets.py       KJT ops, EBC forward, the TD paths into EBC
ec_budgets.py        EmbeddingCollection eager forward, the TD paths into EC
td_paths.py          the TD paths into a module (torchrec's TD input, paritykit's td_to_kjt) as regions
vbe_budgets.py       KJT ops on a variable-batch (VBE) KJT
regroup_budgets.py   KeyedTensor.regroup / regroup_as_dict
dist_budget.py       a rank-pool budget, how it is measured, the KJT all-to-all sites it shares
ebc_dist_budgets.py  per rank: a sharded EBC's input_dist, one step of each training pipeline
ec_dist_budgets.py   per rank: a sharded EC's input_dist (KJT and TD) and forward
budgets.py           the corpus, in gate order
matrix.py            the gate entry
plants.py            planted syncs
"""

from paritykit.checks.runner import CheckEntry
from paritykit.checks.sync.matrix import NAME, run_matrix

CHECK = CheckEntry(NAME, plants="paritykit.checks.sync.plants", run=run_matrix)

__all__ = ["CHECK"]
