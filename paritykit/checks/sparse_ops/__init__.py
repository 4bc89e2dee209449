"""sparse-ops: the public ops of KeyedJaggedTensor, JaggedTensor and KeyedTensor against a small
pure-Python reference of their meaning, their gradients, and a sync budget per op.

values.py            numbers exactly representable in their dtype; dyadic upstream gradients
reference.py         what a JT and a KJT mean, and their ops (lists only: no torch, torchrec, fbgemm)
reference_keyed.py   what a KeyedTensor means, and regrouping
specs.py             drawn inputs (structure plus a seed) and their reference objects
build.py             torchrec's objects built from the reference's lists
expect.py            torchrec's results against the reference's, bit for bit
cases.py             what an op case is
kjt_cases.py         KJT constructors and accessors
kjt_op_cases.py      KJT split, permute, to_dict, __getitem__, flatten_lengths, concat, to, copy_, pytree
kjt_dist_cases.py    dist_labels, dist_splits, dist_tensors, dist_init
jt_cases.py          JT constructors, to_dense, to_padded_dense, from_dense(_lengths), to, copy_, pytree
kt_cases.py          KeyedTensor, regroup, regroup_as_dict, KTRegroupAsDict, permute_multi_embedding, regroup_kts
gradients.py         the reference's vector-Jacobian products (tags and scatter-add)
grad_cases.py        the differentiable ops' gradients
budget.py            what a sync budget is, how it is counted and judged
op_budgets.py        the budgets (those the sync check does not keep)
rules.py             inputs torchrec gets wrong, by name (kept out of the draws where listed)
known_broken.py      their minimal reproductions
matrix.py            the gate entry
plants.py            planted bugs
"""

from paritykit.checks.runner import CheckEntry
from paritykit.checks.sparse_ops.matrix import NAME, run_matrix

CHECK = CheckEntry(NAME, plants="paritykit.checks.sparse_ops.plants", run=run_matrix,
                   oracle="a pure-Python reference of each op's meaning")

__all__ = ["CHECK"]
