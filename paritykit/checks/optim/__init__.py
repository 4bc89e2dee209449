"""optim: torchrec's optimizer wrappers and python optimizers as users apply them, against torch.

``KeyedOptimizerWrapper``, ``CombinedOptimizer`` (DMP's fused optimizer with the dense ones),
``GradientClippingOptimizer`` (by norm, across ranks, or by value), ``WarmupOptimizer`` (every
policy), ``RowWiseAdagrad``, and the wrappers' ``state_dict``/``load_state_dict`` round trip, on a
sharded model and on plain dense parameters (docs/optim.md). The rank machinery is in the engine
(``optim_wrapping``, ``optim_training``, ``optim_reference``, ``optim_schedule``, ``optim_model``).

cases.py, case_runner.py   a sharded case and its comparison with the unsharded oracle
dense_cases.py             the cases without ranks (row-wise Adagrad, schedules, keyed state)
fused_module_cases.py      FusedEmbeddingBagCollection unsharded (made, trained, its param groups)
fused_sharded_cases.py     FusedEmbeddingBagCollection sharded by DMP
pinned.py, draws.py, known_broken.py, matrix.py (the gate entry)
plants.py                  planted bugs in torchrec/optim/
"""

from paritykit.checks.optim.matrix import NAME, run_matrix
from paritykit.checks.runner import CheckEntry

CHECK = CheckEntry(NAME, plants="paritykit.checks.optim.plants", run=run_matrix,
                   oracle="the unsharded model trained with torch's optimizers, torch's gradient clipping and a "
                          "hand-computed learning-rate schedule; torch's Adagrad or the row-wise rule written out")

__all__ = ["CHECK"]
