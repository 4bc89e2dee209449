"""``assert_checkpoint_roundtrip``: a sharded model and its optimizers saved the way torchrec users do
it, reloaded into a freshly sharded model (the same plan, another plan, another world size), and
trained on, against the unsharded model and the run that never reloaded.

    paritykit.assert_checkpoint_roundtrip(
        make_model,                                   # module level: the ranks build it too
        {"user": table_wise(rank=1), "item": column_wise(ranks=[0, 1, 0])},
        batches,                                      # batches[step][rank]
        save_after=2,                                 # checkpoint after two steps
        reload_plan={"user": row_wise(), "item": row_wise()},
        pool=rank_pool,
        embedding_optimizer="adagrad", dense_optimizer="adam",
    )

Everything is decided in the caller first (engine/checkpoint_setup.py: plans against the model, the
batches, that every table keeps how it trains across the reload); then the unsharded references,
then the ranks. ``docs/checkpoint.md`` says what is compared and what torchrec supports.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from paritykit.engine.assertion import tolerance_of
from paritykit.engine.checkpoint import CheckpointRecipe
from paritykit.engine.checkpoint_roundtrip import run_roundtrip
from paritykit.engine.checkpoint_setup import build_checkpoint_setup
from paritykit.engine.comparison import Bound, Tolerance
from paritykit.engine.setup import DEFAULT_LR
from paritykit.errors import HarnessError
from paritykit.harness.devices import resolve_device
from paritykit.harness.optimizers import OptimizerSpec


def assert_checkpoint_roundtrip(
    model_fn: Callable[[], torch.nn.Module],
    plan: Any,
    batches: Any,
    *,
    save_after: int,
    reload_plan: Any = None,
    reload_batches: Any = None,
    method: str = "dcp",
    combined_optimizer: bool = False,
    warmup: tuple[tuple[str, int, float], ...] = (),
    save_param_groups: bool = False,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    pool: Any = None,
    reload_pool: Any = None,
    embedding_optimizer: OptimizerSpec | str | None = None,
    dense_optimizer: OptimizerSpec | str | None = None,
    lr: float = DEFAULT_LR,
    seed: int = 0,
    tolerance: Tolerance | Bound | str | None = None,
    pool_for: Callable[[int], Any] | None = None,
    ranks_per_host: int | None = None,
) -> dict[str, Any]:
    """Train ``model_fn()`` sharded by ``plan`` on ``batches``, checkpoint after ``save_after`` steps and
    carry on; reload the checkpoint into the model sharded by ``reload_plan`` (default ``plan``) and train
    ``reload_batches`` (default: the batches after the save; give them for another world size). ParityError
    naming phase, step, rank, state key and element at every difference; else what was compared.

    ``method``: "dcp" (torch.distributed.checkpoint, reshards) or "per_rank" (torch.save on every rank,
    same world size). ``combined_optimizer``: save one torchrec CombinedOptimizer of the fused and dense
    optimizers instead of two. ``warmup``: torchrec WarmupOptimizer stages as (policy, max_iters, value)
    around the dense (or combined) optimizer; the unsharded model is then no oracle (constant learning
    rates), so the reload is held to the saved state and the resumed run to the run that carried on.
    ``save_param_groups``: the optimizers save their param groups (hyper-parameters) too, torchrec's
    ``save_param_groups(True)``.
    ``pool`` runs the saving world size, ``reload_pool`` the other one (started and closed here when not
    given); ``pool_for(world_size)`` replaces both. ``ranks_per_host``: the hosts both runs' ranks stand
    for (default: the given pools', else one host); the plans are resolved for them and a pool that
    stands for other hosts is a HarnessError. Optimizers, ``lr``, ``loss_fn`` and ``tolerance`` as in
    ``assert_sharded_matches_unsharded``.
    """
    device = resolve_device(getattr(pool, "device", None) or getattr(reload_pool, "device", None) or "cpu")
    if ranks_per_host is None:
        ranks_per_host = _given_ranks_per_host(pool, reload_pool)
    recipe = CheckpointRecipe(method=method, combined=combined_optimizer, warmup=tuple(tuple(stage) for stage in warmup),
                              param_groups=save_param_groups)
    setup = build_checkpoint_setup(model_fn, plan, batches, save_after=save_after, reload_plan=reload_plan,
                                   reload_batches=reload_batches, recipe=recipe, loss_fn=loss_fn,
                                   embedding_optimizer=embedding_optimizer, dense_optimizer=dense_optimizer, lr=lr,
                                   seed=seed, device=device, ranks_per_host=ranks_per_host)
    header = _name_of(model_fn)
    tolerance = tolerance_of(tolerance, setup.before)
    if pool_for is not None:
        return run_roundtrip(setup, pool_for, tolerance, header)
    with contextlib.ExitStack() as stack:
        return run_roundtrip(setup, _pools(stack, pool, reload_pool, device, setup), tolerance, header)


def _name_of(model_fn: Any) -> str:
    function = getattr(model_fn, "func", model_fn)  # a functools.partial names its function
    return getattr(function, "__qualname__", repr(model_fn))


def _given_ranks_per_host(*pools: Any) -> int | None:
    """The ranks per host the given pools stand for (None: one host each, or none given)."""
    given = {p.ranks_per_host for p in pools if p is not None and getattr(p, "ranks_per_host", p.world_size) != p.world_size}
    if len(given) > 1:
        raise HarnessError(f"pool and reload_pool stand for hosts of {sorted(given)} ranks: a round trip runs both on one host shape")
    return given.pop() if given else None


def _pools(stack: contextlib.ExitStack, pool: Any, reload_pool: Any, device: str, setup: Any) -> Callable[[int], Any]:
    """world size -> the given pool of that size, or one started here (closed with ``stack``)."""
    for given, needed, what in ((pool, setup.before.world_size, "batches"), (reload_pool, setup.after.world_size, "reload batches")):
        if given is not None and given.world_size != needed:
            raise HarnessError(f"the {what} are for {needed} ranks (batches[step][rank]); the pool given for them has {given.world_size}")
    pools = {p.world_size: p for p in (reload_pool, pool) if p is not None}

    def pool_for(world_size: int) -> Any:
        if world_size not in pools:
            from paritykit.dist import RankPool

            pools[world_size] = stack.enter_context(RankPool(world_size, device=device, ranks_per_host=setup.ranks_per_host))
        return pools[world_size]

    return pool_for
