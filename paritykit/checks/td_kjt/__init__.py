"""td-kjt: the same sparse batch as a TensorDict and as a KeyedJaggedTensor gives the same outputs
and gradients through EBC/EC, eager and sharded.

assertion.py  the public ``assert_td_kjt_parity`` (any module, any batch form)
cases.py      the gate's matrix: eager and sharded cases, their strategies, pinned cases
plants.py     planted bugs in the TD -> KJT conversion
"""

from paritykit.checks.runner import CheckEntry
from paritykit.checks.td_kjt.assertion import assert_td_kjt_parity
from paritykit.checks.td_kjt.cases import NAME, run_matrix

CHECK = CheckEntry(NAME, plants="paritykit.checks.td_kjt.plants", run=run_matrix)

__all__ = ["CHECK", "assert_td_kjt_parity"]
