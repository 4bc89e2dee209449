"""td-kjt: the same sparse batch as a TensorDict and as a KeyedJaggedTensor gives the same outputs
and gradients through EBC/EC, eager and sharded; sharded, both also equal the unsharded module.

assertion.py     the public ``assert_td_kjt_parity`` (any module, any batch form)
cases.py         the gate entry ``run_matrix``: eager, sharded (pinned + drawn), known-broken
eager.py         eager cases and their strategy
sharded_spec.py  ShardedCase / RankBatch (a plan sharded once, fed several batches; VBE)
sharded_draw.py  the strategy of sharded cases, and where torchrec takes VBE
pinned.py        sharded cases every run covers
batches.py       a rank's batch in each route's form, and the oracle's (VBE expanded) input
reference.py     the unsharded oracle: outputs, and tables after one step with torchrec's gradient scaling
tolerances.py    bounds derived from each case (compare/bounds.py)
rank.py          what every rank runs: three-way comparison, problems by kind
known_broken.py  configurations that fail inside torchrec, run on purpose
plants.py        planted bugs: the TD -> KJT conversion, sharded VBE, weights in the sharded input dist
"""

from paritykit.checks.runner import CheckEntry
from paritykit.checks.td_kjt.assertion import assert_td_kjt_parity
from paritykit.checks.td_kjt.cases import NAME, run_matrix

CHECK = CheckEntry(NAME, plants="paritykit.checks.td_kjt.plants", run=run_matrix,
                   oracle="the unsharded module (sharded cases), the KeyedJaggedTensor path (eager cases)",
                   known_configurations="paritykit.checks.td_kjt.known_broken")

__all__ = ["CHECK", "assert_td_kjt_parity"]
