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

from paritykit.engine.comparison import EXACT, Bound, Tolerance, compare_records, where_for
from paritykit.engine import shrink as shrinking
from paritykit.engine.configuration import configurations_of
from paritykit.engine.shrink import failure_cause
from paritykit.engine.reference import train_reference
from paritykit.engine.setup import DEFAULT_LR, build_setup
from paritykit.engine.tolerances import tolerance_for
from paritykit.engine.training import TrainingSetup, assemble_records, train_on_rank
from paritykit.errors import HarnessError, ParityError
from paritykit.harness.configuration import described_by
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
    shrink: bool = True,
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
    or None for the stated default (tolerances.py: 64 units of roundoff, norm-wise). A failure's message
    ends with where the numbers first went apart and, with ``shrink``, the smallest configuration that
    still fails the same way (shrink.py: a few more runs, bounded in number and time).
    """
    device = resolve_device(getattr(pool, "device", None) or "cpu")
    setup = build_setup(model_fn, plan, batches, loss_fn=loss_fn, embedding_optimizer=embedding_optimizer,
                        dense_optimizer=dense_optimizer, lr=lr, seed=seed, device=device,
                        ranks_per_host=getattr(pool, "ranks_per_host", None))
    header = f"{getattr(model_fn, '__qualname__', repr(model_fn))} sharded over {setup.world_size} ranks"
    bound = tolerance_of(tolerance, setup)
    with described_by(lambda _exc: configurations_of(setup)), _Pools(setup, pool) as pools:
        try:
            return _train_and_compare(setup, pools, bound, header)
        except ParityError as exc:
            if shrink and exc.divergence is not None and not _shrunk_elsewhere():
                _add_smallest(exc, setup, pools, bound)
            raise


def _shrunk_elsewhere() -> bool:
    """Inside a hypothesis test, hypothesis shrinks the inputs itself (calling this again for each try):
    shrinking here too would multiply the runs. Under torchrun every rank runs the assertion: none
    of them starts pools of its own to shrink."""
    from paritykit.dist import launched_by_torchrun

    if launched_by_torchrun():
        return True
    try:
        import hypothesis
    except ImportError:
        return False
    in_context = getattr(hypothesis, "currently_in_test_context", None)
    return bool(in_context()) if in_context is not None else False


def _train_and_compare(setup: TrainingSetup, pools: "_Pools", bound: Tolerance, header: str) -> dict[str, Any]:
    reference = train_reference(setup, division=gradient_division())
    per_rank = pools.get(setup.world_size).call(train_on_rank, (setup,), case="sharded training")
    return compare_records(assemble_records(per_rank), reference, bound, header, where_for(setup))


def _add_smallest(exc: ParityError, setup: TrainingSetup, pools: "_Pools", bound: Tolerance) -> None:
    """Append the smallest configuration that still fails the same way (shrink.py) to the message."""
    def still_fails(candidate: TrainingSetup):
        return failure_cause(lambda: _train_and_compare(candidate, pools, bound, "shrinking"))

    try:
        shrunk = shrinking.shrink(setup, exc.divergence, still_fails)
    except Exception as failed:  # noqa: BLE001 - shrinking is a courtesy: the failure stays what it is
        exc.add_note(f"paritykit could not shrink the configuration: {type(failed).__name__}: {failed}")
        return
    exc.args = (f"{exc.args[0]}\n{shrunk.describe(setup)}", *exc.args[1:])
    exc.shrunk = shrunk.candidate


class _Pools:
    """The caller's pool for the batches' world size (or one started here), and any smaller one shrinking needs."""

    def __init__(self, setup: TrainingSetup, pool: Any) -> None:
        if pool is not None and pool.world_size != setup.world_size:
            raise HarnessError(f"the batches are for {setup.world_size} ranks (batches[step][rank]); the pool has {pool.world_size}")
        self._device, self._given, self._started = setup.device, pool, {}

    def get(self, world_size: int) -> Any:
        if self._given is not None and self._given.world_size == world_size:
            return self._given
        if world_size not in self._started:
            from paritykit.dist import RankPool

            self._started[world_size] = RankPool(world_size, device=self._device).__enter__()
        return self._started[world_size]

    def __enter__(self) -> "_Pools":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for started in self._started.values():
            started.__exit__(None, None, None)


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
    with _Pools(setup, pool) as pools:
        return pools.get(setup.world_size).call(train_on_rank, (setup,), case="sharded training")
