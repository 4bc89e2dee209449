"""EmbeddingTowerCollection sharded by torchrec's EmbeddingTowerCollectionSharder, trained against the
unsharded collection trained alike (tower_models.py builds both).

torchrec places each tower on the host its tables' ranks are on: the features travel to that host
(a KJT all-to-all over the cross-host group), the tables are sharded row-wise or column-wise over the
host's ranks, the interaction runs under DDP over the host's ranks, and the outputs travel back (an
all-to-all over the cross-host group). The oracle is the unsharded collection: every rank's outputs are
the collection's outputs on that rank's batch, the towers' columns in the collection's order; a step
of SGD on the loss averaged over the ranks (torchrec divides gradients by the world size in its
all-to-alls, DDP averages over the host: the mean over all ranks either way) moves every table and
interaction as the same step on the unsharded collection does. Compared: every rank's outputs at
every step, the tables gathered from their shards and every replica of each interaction after the
last step.

On CPU torchrec's own entry points (DistributedModelParallel, ``shard``) cannot shard a tower: they hand
the tower sharder a CPU device, which it passes to DDP as ``device_ids`` (a known torchrec defect,
``tower-sharding-cpu-ddp-device-ids``). The cases call the sharder with no device, as the CPU placement
then is; the known-broken case runs DistributedModelParallel itself.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import torch
from hypothesis import strategies as st

from paritykit.checks.sharding.tower_models import (
    PLACEMENTS, TowerCase, TowerShape, batch, build_collection, collection_inputs, interactions_of, table_name, tables_of,
    upstream,
)
from paritykit.compare.bounds import normwise_bound
from paritykit.engine.tolerances import normwise
from paritykit.errors import HarnessError, ParityError


def _sharder(case: TowerCase) -> Any:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embedding_tower_sharding import EmbeddingTowerCollectionSharder, EmbeddingTowerSharder

    sharder = EmbeddingTowerSharder if case.single else EmbeddingTowerCollectionSharder
    return sharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": case.learning_rate})


def tower_plan(case: TowerCase, collection: torch.nn.Module, sharder: Any) -> Any:
    """torchrec's module plan for the case: table_row_wise(host_index=host), or column shards on the
    host's ranks (paritykit's TWCW generator: torchrec's sharding_plan has none)."""
    from torchrec.distributed import sharding_plan as sp

    from paritykit.harness.plans import table_column_wise

    generators = {}
    for t, tower in enumerate(case.towers):
        for i in range(len(tower.rows)):
            if tower.placement == "table_row_wise":
                generators[table_name(t, i)] = sp.table_row_wise(host_index=tower.host)
            else:
                ranks = [tower.host * case.ranks_per_host + r for r in tower.columns]
                generators[table_name(t, i)] = table_column_wise(ranks, "fused")
    return sp.construct_module_sharding_plan(collection, generators, world_size=case.world_size,
                                             local_size=case.ranks_per_host, device_type="cpu", sharder=sharder)


def _waited(output: Any) -> torch.Tensor:
    return output.wait() if hasattr(output, "wait") else output


def _sgd_step(sharded: torch.nn.Module, learning_rate: float) -> None:
    """Plain SGD on what carries a gradient (the interactions; fused tables stepped in backward). Every
    gradient is read before any is cleared: a table's slices share one gradient tensor."""
    stepped = [(param, param.grad) for _, param in sharded.named_parameters() if param.grad is not None]
    with torch.no_grad():
        for param, grad in stepped:
            param.add_(grad, alpha=-learning_rate)
        for param, _ in stepped:
            param.grad = None


def _process_groups_created() -> int:
    """How many process groups this process has created: the count the pool compares after every call."""
    from paritykit.dist.worker import dist_state

    return dist_state()[0]


def _groups_brought_level(count: int) -> list[int]:
    """Every rank's count of process groups created; a rank behind the others then creates the groups it
    missed as a non-member (torch only numbers them), so that the pool's next process group pairs up
    on every rank instead of hanging."""
    import torch.distributed as dist

    counts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(counts, count)
    ahead = counts.index(max(counts))
    for _ in range(max(counts) - count):
        dist.new_group(ranks=[ahead])
    return counts


def tower_on_rank(case: TowerCase, via_dmp: bool = False) -> dict[str, Any]:
    """This rank's outputs at every step, the tables gathered after the last one, its interactions, and
    how many process groups sharding created on it (every rank must create the same: torch pairs groups
    up by their number)."""
    import torch.distributed as dist
    from torchrec.distributed.types import ShardingEnv

    from paritykit.harness.sharded import copy_full_weights_into, gather_full_weights, gradient_division

    if not gradient_division():
        raise HarnessError("the tower cases' reference mirrors torchrec's default gradient division, which is off")
    rank = dist.get_rank()
    groups_before = _process_groups_created()
    collection = build_collection(case)
    sharder = _sharder(case)
    plan = tower_plan(case, collection, sharder)
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    if via_dmp:
        from torchrec.distributed.model_parallel import DistributedModelParallel
        from torchrec.distributed.types import ShardingPlan

        holder = torch.nn.Module()
        holder.towers = collection
        model = DistributedModelParallel(holder, env=env, device=torch.device("cpu"), plan=ShardingPlan({"towers": plan}),
                                         sharders=[sharder])
        sharded = model.module.towers
    else:
        sharded = sharder.shard(collection, plan, env, None)
    copy_full_weights_into(sharded, tables_of(collection))
    outputs = []
    for step in range(case.steps):
        output = _waited(sharded(*collection_inputs(case, *batch(case, step, rank))))
        outputs.append(output.detach().clone())
        (output * upstream(case, step, rank)).sum().backward()
        _sgd_step(sharded, case.learning_rate)
    # A single tower's keys are the collection's tower 0's (``interaction.linear.weight``).
    interactions = {("towers.0." if case.single else "") + name: value.detach().clone()
                    for name, value in sharded.state_dict().items() if name.startswith("interaction.") or ".interaction." in name}
    groups = _groups_brought_level(_process_groups_created() - groups_before)
    return {"outputs": outputs, "tables": gather_full_weights(sharded), "interactions": interactions, "groups_created": groups}


def _magnitudes(collection: torch.nn.Module, inputs: tuple[Any, ...]) -> torch.Tensor:
    """The collection's outputs with every parameter by its absolute value (the per-id weights are positive):
    per output element the sum of its terms' magnitudes, which bounds the rounding of any summation order."""
    absolute = copy.deepcopy(collection)
    with torch.no_grad():
        for param in absolute.parameters():
            param.abs_()
        return absolute(*inputs)


def reference_run(case: TowerCase) -> dict[str, Any]:
    """The unsharded collection trained alike: every rank's outputs (and their terms' magnitudes) at
    every step, then the weights."""
    collection = build_collection(case)
    outputs: list[list[torch.Tensor]] = []
    magnitudes: list[list[torch.Tensor]] = []
    for step in range(case.steps):
        inputs = [collection_inputs(case, *batch(case, step, rank)) for rank in range(case.world_size)]
        magnitudes.append([_magnitudes(collection, rank_inputs) for rank_inputs in inputs])
        step_outputs = [collection(*rank_inputs) for rank_inputs in inputs]
        loss = sum((output * upstream(case, step, rank)).sum() for rank, output in enumerate(step_outputs)) / case.world_size
        collection.zero_grad()
        loss.backward()
        with torch.no_grad():
            for param in collection.parameters():
                param.add_(param.grad, alpha=-case.learning_rate)
        outputs.append([output.detach() for output in step_outputs])
    return {"outputs": outputs, "magnitudes": magnitudes, "tables": tables_of(collection),
            "interactions": interactions_of(collection)}


def _differences(got: torch.Tensor, want: torch.Tensor, what: str) -> list[str]:
    """Norm-wise: within 64 units of roundoff of the tensor's largest element."""
    if got.shape != want.shape:
        return [f"{what}: shape {tuple(got.shape)}, the unsharded collection's {tuple(want.shape)}"]
    return [f"{d.path}: {d.detail}" for d in normwise(want.dtype).differences(got, want, what)]


def _output_differences(got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor, what: str) -> list[str]:
    """Within 64 units of roundoff of (the element's terms' magnitudes + the largest of them): an output
    can cancel far below its terms (a 1x1 output of -0.0029 from terms of 0.5), its rounding cannot."""
    if got.shape != want.shape:
        return [f"{what}: shape {tuple(got.shape)}, the unsharded collection's {tuple(want.shape)}"]
    units, _ = normwise_bound(want.dtype)
    bad = ~((got - want).abs() <= units * (magnitude + magnitude.max()))
    if not bool(bad.any()):
        return []
    index = tuple(int(i) for i in bad.nonzero()[0])
    return [f"{what}: {int(bad.sum())} of {bad.numel()} elements differ beyond {units:.3g} x (their terms' magnitudes "
            f"+ the largest); first at {list(index)}: {got[index].item():.6g} vs {want[index].item():.6g}"]


def _per_tower(interactions: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tower's interaction parameters as one flat tensor (so a bias that cancels to near zero is held
    to the scale of its tower's weights, which its rounding follows)."""
    towers: dict[str, list[torch.Tensor]] = {}
    for name in sorted(interactions):
        towers.setdefault(name.split(".interaction.")[0], []).append(interactions[name].flatten())
    return {tower: torch.cat(values) for tower, values in towers.items()}


def _host_order_note(case: TowerCase, got: torch.Tensor, want: torch.Tensor) -> str:
    """What the outputs are when they are the collection's with the towers' columns in host order."""
    if case.hosts_in_order() or got.shape != want.shape:
        return ""
    starts = [sum(tower.width for tower in case.towers[:t]) for t in range(len(case.towers))]
    by_host = sorted(range(len(case.towers)), key=lambda t: case.towers[t].host)
    permuted = torch.cat([want[:, starts[t]:starts[t] + case.towers[t].width] for t in by_host], dim=1)
    if _differences(got, permuted, "outputs"):
        return ""
    return f"; they are its towers' columns in host order (towers {by_host}), not in the collection's order"


def compare_tower_run(case: TowerCase, per_rank: list[dict[str, Any]], reference: dict[str, Any],
                      same_group_count: bool = True) -> dict[str, Any]:
    """Raise ParityError at the first step whose outputs differ, else on the weights after the last step,
    else (``same_group_count``) when the ranks created different numbers of process groups."""
    compared = 0
    for step in range(case.steps):
        for rank, result in enumerate(per_rank):
            found = _output_differences(result["outputs"][step], reference["outputs"][step][rank],
                                        reference["magnitudes"][step][rank], f"rank {rank} outputs")
            if found:
                raise ParityError(f"step {step}: the sharded tower collection's outputs are not the unsharded collection's "
                                  f"{'; '.join(found[:2])}{_host_order_note(case, result['outputs'][step], reference['outputs'][step][rank])} "
                                  f"[{case.case_id()}]")
            compared += result["outputs"][step].numel()
    for rank, result in enumerate(per_rank):
        for table, want in reference["tables"].items():
            found = _differences(result["tables"].get(table, torch.empty(0)), want, f"table {table} gathered on rank {rank}")
            if found:
                raise ParityError(f"after {case.steps} step(s): {'; '.join(found[:2])} [{case.case_id()}]")
    held = {name for result in per_rank for name in result["interactions"]}
    if held != set(reference["interactions"]):
        raise ParityError(f"the ranks hold interactions {sorted(held)}, the collection has {sorted(reference['interactions'])} [{case.case_id()}]")
    expected = _per_tower(reference["interactions"])
    for rank, result in enumerate(per_rank):
        for tower, value in _per_tower(result["interactions"]).items():
            found = _differences(value, expected[tower], f"{tower}'s interaction on rank {rank}")
            if found:
                raise ParityError(f"after {case.steps} step(s): {'; '.join(found[:2])} [{case.case_id()}]")
    created = per_rank[0]["groups_created"]
    if same_group_count and len(set(created)) > 1:
        raise ParityError(f"sharding created {created} process groups on ranks 0-{case.world_size - 1}: torch numbers process "
                          "groups in creation order on every rank, so the next group created on every rank pairs ranks "
                          f"that number it differently and hangs [{case.case_id()}]")
    return {"output_elements": compared, "tables": len(reference["tables"]), "ranks": case.world_size,
            "plan_shape": f"towers {case.hosts}x{case.ranks_per_host}"}


def run_tower_case(case: TowerCase, pool: Any, via_dmp: bool = False, same_group_count: bool = True) -> dict[str, Any]:
    """``via_dmp``: sharded by DistributedModelParallel on CPU (the known-broken case) rather than the sharder;
    ``same_group_count`` False: the numbers alone (a host without a tower, whose group count is its known-broken case's)."""
    if pool.world_size != case.world_size:
        raise HarnessError(f"tower case needs {case.world_size} ranks, the pool has {pool.world_size}")
    per_rank = pool.call(tower_on_rank, (case, via_dmp), case=case.case_id())
    return compare_tower_run(case, per_rank, reference_run(case), same_group_count)


@st.composite
def tower_cases(draw: st.DrawFn, hosts: int, ranks_per_host: int) -> TowerCase:
    """One to three towers (at least one a host) on hosts in the collection's order, each row-wise over
    its host or column-wise on ranks of it in any order; weighted or not. A host without a tower and
    towers out of host order are known torchrec defects (idle_host_case, out_of_order_case)."""
    extra = draw(st.integers(max(0, 1 - hosts), max(0, 3 - hosts)))
    tower_hosts = sorted(list(range(hosts)) + [draw(st.integers(0, hosts - 1)) for _ in range(extra)])
    towers = []
    for host in tower_hosts:
        placement = draw(st.sampled_from(PLACEMENTS))
        columns = tuple(draw(st.lists(st.integers(0, ranks_per_host - 1), min_size=1, max_size=3))) if placement == "table_column_wise" else ()
        rows = tuple(draw(st.lists(st.integers(max(2, ranks_per_host), 9), min_size=1, max_size=2)))
        towers.append(TowerShape(rows, draw(st.integers(1, 3)), placement, host, columns, draw(st.booleans())))
    features = sum(len(tower.rows) for tower in towers)
    # One tower on one host may be sharded alone (EmbeddingTowerSharder); across hosts it leaves hosts idle.
    single = len(towers) == 1 and hosts == 1 and draw(st.booleans())
    return TowerCase(hosts, ranks_per_host, tuple(towers), draw(st.integers(1, 3)), 2,
                     tuple(draw(st.permutations(range(features)))), draw(st.integers(0, 2**16)), single=single)


def pinned_tower_cases(hosts: int, ranks_per_host: int) -> tuple[TowerCase, ...]:
    """Every placement on every host, a weighted tower beside unweighted ones, column shards out of
    rank order with a repeat, and the features fed in reverse order (the sharded module permutes them)."""
    last = hosts - 1
    columns = tuple(reversed(range(ranks_per_host))) + (ranks_per_host - 1,)
    towers = (
        TowerShape((max(5, ranks_per_host), 7), 2, "table_row_wise", 0),
        TowerShape((6,), 3, "table_column_wise", 0, columns, weighted=True),
        TowerShape((8, max(4, ranks_per_host)), 1, "table_column_wise", last, columns[:2]),
        TowerShape((max(6, ranks_per_host),), 2, "table_row_wise", last, weighted=True),
    )
    features = sum(len(tower.rows) for tower in towers)
    collection = TowerCase(hosts, ranks_per_host, towers, 2, 3, tuple(reversed(range(features))), seed=11)
    if hosts > 1:
        return (collection,)
    # A single EmbeddingTower (weighted, column shards out of rank order): its own sharder.
    return collection, TowerCase(hosts, ranks_per_host, (towers[1],), 2, 3, (0,), seed=13, single=True)


def out_of_order_case(hosts: int, ranks_per_host: int) -> TowerCase:
    """Two towers, the first on the last host: the sharded outputs come back in host order."""
    towers = (TowerShape((max(4, ranks_per_host),), 3, "table_row_wise", hosts - 1), TowerShape((5,), 2, "table_row_wise", 0))
    return TowerCase(hosts, ranks_per_host, towers, 2, 1, (0, 1), seed=5)


def idle_host_case(hosts: int, ranks_per_host: int, single: bool = False) -> TowerCase:
    """One tower, on host 0 (in a collection, or alone): the other hosts' ranks build no intra-host
    sharding environment."""
    return TowerCase(hosts, ranks_per_host, (TowerShape((max(4, ranks_per_host),), 2, "table_row_wise", 0),), 2, 1, (0,),
                     seed=7, single=single)


def dmp_case(world_size: int) -> TowerCase:
    """One tower on one host: what DistributedModelParallel refuses to shard on CPU."""
    return replace(out_of_order_case(1, world_size), towers=(TowerShape((max(4, world_size),), 2, "table_row_wise", 0),), key_order=(0,))
