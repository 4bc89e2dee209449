"""Where a sharded td-kjt case first went apart, as data (``paritykit.errors.Divergence``), and the case
as the plain configuration a failure carries (``paritykit.harness.configuration``).

A difference of the KJT route from the unsharded module is torchrec's sharded path ("sharded vs
unsharded"); one of a TensorDict route, where the KJT route agrees with the unsharded module, is the
TensorDict's ("TensorDict vs KJT"). Within a step the KJT route is compared first, so the first
divergence of a case names the sharded path whenever that path is wrong.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from paritykit.checks.td_kjt.sharded_spec import ROUTE_KJT, ShardedCase
from paritykit.engine.divergence import TablePlace, common_traits, element_of, step_detail
from paritykit.errors import Divergence
from paritykit.harness.configuration import RankBatch, ShardedConfiguration

TD_VS_KJT_PATH = "TensorDict vs KJT"
VS_UNSHARDED_PATH = "sharded vs unsharded"


def place_of(case: ShardedCase, table: str) -> TablePlace:
    spec = next(t for t in case.tables if t.name == table)
    kind = case.plan[table][0]
    kernel = "dense" if kind == "data_parallel" else case.kernel
    module = "EmbeddingBagCollection" if case.module == "ebc" else "EmbeddingCollection"
    return TablePlace(module, table, case.module, kind, kernel, spec.pooling if case.module == "ebc" else "", (), case.weighted)


def path_of(route: str, against_unsharded: bool) -> str:
    return VS_UNSHARDED_PATH if against_unsharded and route == ROUTE_KJT else TD_VS_KJT_PATH


def output_divergence(case: ShardedCase, step: int, rank: int, path: str, key: str, difference: Any) -> Divergence:
    place = place_of(case, case.table_of_feature(key).name)
    index = element_of(difference)
    return Divergence("forward", "embedding output", path, step, rank, module=place.module, table=place.table, feature=key,
                      placement=place.placement(), traits=common_traits([place]),
                      element="" if index is None else str(list(index)), detail=str(difference))


def table_divergence(case: ShardedCase, step: int, rank: int, path: str, table: str, difference: Any,
                     tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> Divergence:
    """A table that differs after the step; ``tensors`` are (before, sharded after, reference after)."""
    place = place_of(case, table)
    stage, moved = step_detail(*(t.detach().double().cpu() for t in tensors), sgd=True)
    index = element_of(difference)
    return Divergence(stage, "table gradient or update", path, step, rank, module=place.module, table=table,
                      placement=place.placement(),
                      traits=common_traits([place]), element="" if index is None else str(list(index)),
                      detail=f"{moved}; {difference}")


def first_of(found: list[Divergence], case: ShardedCase) -> Divergence | None:
    """The first divergence of a rank (found in step order, the KJT route first), with the traits every
    table that differs at that step and on that path shares."""
    if not found:
        return None
    first = found[0]
    same = [d for d in found if d.step == first.step and d.path == first.path and d.phase == first.phase]
    traits = common_traits([place_of(case, d.table) for d in same if d.table])
    return replace(first, traits=traits)


def configuration_of(case: ShardedCase, step: int = 0) -> ShardedConfiguration:
    """The case's ``step`` as one training step of the sharding engine's kind: the td-kjt check feeds every
    step from the same initial weights, so each step alone is the configuration that reproduces it."""
    batches = tuple(_rank_batch(rank_batch) for rank_batch in case.steps[min(step, len(case.steps) - 1)])
    kernels = {t.name: ("dense" if case.plan[t.name][0] == "data_parallel" else case.kernel) for t in case.tables}
    return ShardedConfiguration(case.module, case.world_size, case.tables, dict(case.plan), kernels, (batches,),
                                case.weighted, case.need_indices, seed=case.seed, device=case.device, train=case.train,
                                ranks_per_host=case.ranks_per_host, source=f"td-kjt check, step {step} of: {case.describe()}")


def _rank_batch(rank_batch: Any) -> RankBatch:
    batch = rank_batch.batch
    ids, weights = [], []
    for key, rows in zip(batch.keys, batch.lengths):
        values = batch.ids(key).tolist()
        starts = [sum(rows[:i]) for i in range(len(rows))]
        ids.append((key, tuple(tuple(values[s:s + n]) for s, n in zip(starts, rows))))
        if batch.weighted:
            flat = batch.weights(key).tolist()
            weights.append((key, tuple(tuple(flat[s:s + n]) for s, n in zip(starts, rows))))
    inverse = None if rank_batch.inverse is None else tuple(zip(batch.keys, rank_batch.inverse))
    return RankBatch(tuple(ids), tuple(weights) if batch.weighted else None, inverse)
