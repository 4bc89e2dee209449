"""modules: torchrec.modules beyond the embedding modules, against each module's documented formula.

formulas.py          each dense module's formula in plain torch ops (no torchrec, no nn.Linear/LayerNorm)
dense_modules.py     the specs; torchrec's module built from one, with seeded parameters and inputs
dense_reference.py   the formula applied to copies of torchrec's parameters, by state-dict name
dense_cases.py       a dense case: output and every gradient, torchrec vs the formula
tolerance.py         the bounds, and why
draws.py             the drawn and pinned dense specs
mc_reference.py      what MCHManagedCollisionModule with LFU eviction keeps (a pure-Python model)
mc_cases.py          the remapper against the model; MC-EC/EBC against the remap plus a hand lookup
mc_sharded_cases.py  an MC-EBC sharded row-wise: each shard's remapper against the model, a hand lookup
pool_reference.py    what TensorPool and KeyedJaggedTensorPool keep (a pure-Python model)
pool_cases.py        the pools, unsharded and sharded row-wise, updated and looked up against the model
position_cases.py    the position-weighted feature processors against their weights by hand
config_cases.py      the embedding configs and the modules' construction against what they mean
known_broken.py      inputs torchrec gets wrong, run on purpose
matrix.py            the gate entry
plants.py            planted bugs
"""

from paritykit.checks.modules.matrix import NAME, run_matrix
from paritykit.checks.runner import CheckEntry

CHECK = CheckEntry(NAME, plants="paritykit.checks.modules.plants", run=run_matrix,
                   oracle="a hand computation of each module's documented formula in plain torch ops")

__all__ = ["CHECK"]
