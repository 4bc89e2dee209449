"""``assert_sharded_matches_unsharded``: a model sharded any way torchrec offers trains exactly like
the unsharded model, step by step.

    def tutorial_model():                      # module level, so the ranks can build it too
        return MyRanker(...)

    paritykit.assert_sharded_matches_unsharded(
        tutorial_model,
        {"user": table_wise(rank=1), "item": column_wise(ranks=[1, 0, 1]), "ads": row_wise()},
        batches,                               # batches[step][rank]: what the model's forward takes
        pool=rank_pool,                        # optional: a RankPool of len(batches[0]) ranks
    )

Everything that can be decided without ranks is decided first, in the caller: the plan is resolved
into torchrec's ShardingPlan and validated against the model (unknown or missing tables, ranks
outside the world, overlapping shards: HarnessError naming the table), the batches are checked
(one per rank per step, KJT lengths against values, ids inside their tables), and the unsharded
reference is trained (reference.py). Then the ranks train the sharded model from the same initial
state, and every step's outputs and losses, the final tables gathered from the shards, the dense
parameters and the optimizers' state are compared (comparison.py).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from paritykit.engine.comparison import EXACT, Bound, Tolerance, compare_records
from paritykit.engine.reference import train_reference
from paritykit.engine.setup import DEFAULT_LR, build_setup
from paritykit.engine.tolerances import tolerance_for
from paritykit.engine.training import TrainingSetup, assemble_records, train_on_rank
from paritykit.errors import HarnessError
from paritykit.harness.devices import resolve_device
from paritykit.harness.optimizers import OptimizerSpec
from paritykit.harness.sharded import gradient_division

def assert_sharded_matches_unsharded(
    model_fn: Callable[[], torch.nn.Module],
    plan: Any,
    batches: Any,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    pool: Any = None,
    embedding_optimizer: OptimizerSpec | str | None = None,
    dense_optimizer: OptimizerSpec | str | None = None,
    lr: float = DEFAULT_LR,
    seed: int = 0,
    tolerance: Tolerance | Bound | str | None = None,
) -> dict[str, Any]:
    """Train ``model_fn()`` sharded by ``plan`` and unsharded for ``len(batches)`` steps; ParityError
    naming step, rank, table or output and element at the first difference. Returns what was compared.

    ``plan`` maps table names (or module FQNs to tables) to torchrec's ``sharding_plan`` generators, or
    is a torchrec ``ShardingPlan``. ``batches[step][rank]`` is what the model's forward takes (a tuple
    is its positional arguments). Tables train with ``embedding_optimizer`` (fused: "sgd", "adagrad",
    "rowwise_adagrad", "ema_rowwise_adagrad", "rowwise_rmsprop_ar" where fbgemm has it, or an
    OptimizerSpec with hyper-parameters, e.g. ``OptimizerSpec("rowwise_adagrad", lr=0.05, eps=1e-3)``),
    everything else with ``dense_optimizer`` (a torch optimizer: "sgd", "adagrad", "adam", "adamw" or an
    OptimizerSpec with torch's keywords); both at ``lr`` unless an OptimizerSpec says otherwise. ``loss_fn(output, batch)`` defaults to a fixed
    function of every output element. Without ``pool`` a RankPool of the right size is started and
    closed. ``tolerance``: a Tolerance (a Bound per kind of number), one Bound for everything, "exact",
    or None for the stated default (tolerances.py: 64 units of roundoff, norm-wise).
    """
    device = resolve_device(getattr(pool, "device", None) or "cpu")
    setup = build_setup(model_fn, plan, batches, loss_fn=loss_fn, embedding_optimizer=embedding_optimizer,
                        dense_optimizer=dense_optimizer, lr=lr, seed=seed, device=device,
                        ranks_per_host=getattr(pool, "ranks_per_host", None))
    reference = train_reference(setup, division=gradient_division())
    per_rank = run_on_ranks(setup, pool)
    header = f"{getattr(model_fn, '__qualname__', repr(model_fn))} sharded over {setup.world_size} ranks"
    return compare_records(assemble_records(per_rank), reference, tolerance_of(tolerance, setup), header)


def tolerance_of(value: Tolerance | Bound | str | None, setup: TrainingSetup) -> Tolerance:
    if value is None:
        return tolerance_for(setup)
    if isinstance(value, Tolerance):
        return value
    if value == "exact":
        value = EXACT
    if isinstance(value, Bound):
        return Tolerance(value, value, value, value, value, value)
    raise HarnessError(f"tolerance is a Tolerance, a Bound, 'exact' or None; got {value!r}")


def run_on_ranks(setup: TrainingSetup, pool: Any) -> list[dict[str, Any]]:
    if pool is None:
        from paritykit.dist import RankPool

        with RankPool(setup.world_size, device=setup.device) as own_pool:
            return own_pool.call(train_on_rank, (setup,), case="sharded training")
    if pool.world_size != setup.world_size:
        raise HarnessError(f"the batches are for {setup.world_size} ranks (batches[step][rank]); the pool has {pool.world_size}")
    return pool.call(train_on_rank, (setup,), case="sharded training")
