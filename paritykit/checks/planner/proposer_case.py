"""torchrec's proposers, each against what its docstring says it proposes from a search space (the
options torchrec's enumerator estimates for four tables of different sizes on two GPU ranks; planning
only, the model on the meta device). A proposal is a list of options, one a table, each of the search
space; and per proposer:

- ``GreedyProposer`` sorts each table's options by perf (the largest shard's total) and starts from
  every table's best; each feedback moves the table whose current option uses the most storage (HBM
  then DDR, largest shard then sum), among the tables with options left, to its next option, until
  none is left: 1 + the sum over tables of (options - 1) proposals, each one table's move from the last;
- ``UniformProposer`` proposes, for each sharding type every table offers, every table's best option
  of that type (plans of one sharding type);
- ``GridSearchProposer`` proposes every combination of the tables' options, each once, while there are
  at most its ``max_proposals``, else none (searched over each table's three best options);
- ``DynamicProgrammingProposer`` first proposes every table's option of the least HBM; after the
  feedback (the topology), plans of at most the topology's HBM that minimize the perf summed over the
  tables for their HBM: one of them is the plan of every table's best option when that fits;

and the planner given the grid chooses the plan rated best (its perf model: the largest rank's summed
perf) of every combination's, each partitioned here as the planner partitions.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from paritykit.errors import HarnessError, ParityError

CASE_ID = ("planner proposers: greedy, uniform, grid search and dynamic programming over 4 tables on 2 GPU ranks, as documented; "
           "the planner's choice the best rated")
TABLES = ((2048, 64), (512, 32), (8192, 16), (256, 128))  # rows, columns
WORLD_SIZE = 2
MOST_PROPOSALS = 5000
GRID_OPTIONS = 3


def module() -> Any:
    """The case's EBC of TABLES on the meta device."""
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    return EmbeddingBagCollection([EmbeddingBagConfig(name=f"t{i}", num_embeddings=rows, embedding_dim=columns, feature_names=[f"f{i}"])
                                   for i, (rows, columns) in enumerate(TABLES)], device=torch.device("meta"))


def search_space(constraints: dict[str, Any] | None = None) -> tuple[list[Any], Any]:
    """The options torchrec's enumerator estimates for the case's tables on two GPU ranks (under
    ``constraints``), and that topology."""
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from torchrec.distributed.planner.shard_estimators import EmbeddingPerfEstimator, EmbeddingStorageEstimator
    from torchrec.distributed.sharding_plan import get_default_sharders

    from paritykit.checks.planner.planning import topology_of
    from paritykit.harness.noise import quiet_planner

    with quiet_planner():
        topology = topology_of(WORLD_SIZE, WORLD_SIZE, "cuda")
        estimators = [EmbeddingPerfEstimator(topology=topology, constraints=constraints),
                      EmbeddingStorageEstimator(topology=topology, constraints=constraints)]
        options = EmbeddingEnumerator(topology=topology, batch_size=512, estimator=estimators,
                                      constraints=constraints).enumerate(module(), get_default_sharders())
    return options, topology


def proposals_of(proposer: Any, options: list[Any], topology: Any) -> list[list[Any]]:
    """Every proposal, each followed by the feedback the planner gives (partitionable, with the topology)."""
    proposer.load(search_space=options)
    proposals = []
    proposal = proposer.propose()
    while proposal is not None:
        proposals.append(list(proposal))
        if len(proposals) > MOST_PROPOSALS:
            raise ParityError(f"{type(proposer).__name__} proposed more than {MOST_PROPOSALS} plans of {len(options)} options")
        proposer.feedback(partitionable=True, plan=proposal, perf_rating=1.0, storage_constraint=topology)
        proposal = proposer.propose()
    return proposals


def score(option: Any) -> float:
    """The greedy and uniform proposers' order: the largest shard's total perf (``use_depth``, the default)."""
    return max(shard.perf.total for shard in option.shards)


def storage_key(option: Any) -> tuple:
    hbm, ddr = [shard.storage.hbm for shard in option.shards], [shard.storage.ddr for shard in option.shards]
    return (max(hbm), sum(hbm), max(ddr), sum(ddr))


def _by_table(options: list[Any]) -> dict[str, list[Any]]:
    tables: dict[str, list[Any]] = {}
    for option in options:
        tables.setdefault(option.fqn, []).append(option)
    return tables


def _shape_problems(name: str, proposals: list[list[Any]], tables: dict[str, list[Any]]) -> list[str]:
    problems = []
    for index, proposal in enumerate(proposals):
        fqns = [option.fqn for option in proposal]
        foreign = [option.fqn for option in proposal if not any(option is o for o in tables.get(option.fqn, []))]
        if sorted(fqns) != sorted(tables) or foreign:
            problems.append(f"{name} proposal {index} holds options of {sorted(fqns)} ({len(foreign)} not of the search space); "
                            f"expected one option of each of {sorted(tables)}")
    return problems[:3]


def _key(proposal: list[Any]) -> tuple:
    return tuple(sorted(id(option) for option in proposal))


def greedy_problems(proposals: list[list[Any]], tables: dict[str, list[Any]]) -> list[str]:
    want = 1 + sum(len(options) - 1 for options in tables.values())
    problems = [] if len(proposals) == want else [f"GreedyProposer made {len(proposals)} proposals, expected {want} (every table "
                                                  "moved through each of its options in turn)"]
    if not proposals:
        return problems
    first = {option.fqn: option for option in proposals[0]}
    for fqn, options in tables.items():
        if score(first[fqn]) > min(score(o) for o in options):
            problems.append(f"GreedyProposer's first proposal takes {fqn}'s option of perf {score(first[fqn])}, not its best "
                            f"({min(score(o) for o in options)})")
    used = {fqn: 1 for fqn in tables}
    for index, (before, after) in enumerate(zip(proposals, proposals[1:])):
        was, now = {o.fqn: o for o in before}, {o.fqn: o for o in after}
        moved = [fqn for fqn in tables if was[fqn] is not now[fqn]]
        left = [fqn for fqn in tables if used[fqn] < len(tables[fqn])]
        if len(moved) != 1 or not left:
            problems.append(f"GreedyProposer's proposal {index + 1} moves {moved} from the one before (expected one table)")
            break
        largest = max(storage_key(was[fqn]) for fqn in left)
        (fqn,) = moved
        if storage_key(was[fqn]) != largest or score(now[fqn]) < score(was[fqn]):
            problems.append(f"GreedyProposer's proposal {index + 1} moves {fqn} (storage {storage_key(was[fqn])}, perf "
                            f"{score(was[fqn])} -> {score(now[fqn])}); expected the table of the most storage {largest} among "
                            f"those with options left, to its next option by perf")
            break
        used[fqn] += 1
    return problems


def uniform_problems(proposals: list[list[Any]], tables: dict[str, list[Any]]) -> list[str]:
    offered = [t for t in dict.fromkeys(o.sharding_type for options in tables.values() for o in options)
               if all(any(o.sharding_type == t for o in options) for options in tables.values())]
    found = [proposal[0].sharding_type for proposal in proposals]
    problems = []
    if sorted(found) != sorted(offered):
        problems.append(f"UniformProposer proposed plans of {found}, expected one of each sharding type every table offers {offered}")
    for proposal in proposals:
        kind = proposal[0].sharding_type
        for option in proposal:
            best = min(score(o) for o in tables[option.fqn] if o.sharding_type == kind)
            if option.sharding_type != kind or score(option) > best:
                problems.append(f"UniformProposer's {kind} plan takes {option.fqn}'s {option.sharding_type} option of perf {score(option)} "
                                f"(expected its best {kind} option, {best})")
    return problems[:3]


def grid_problems(proposals: list[list[Any]], tables: dict[str, list[Any]]) -> list[str]:
    want = math.prod(len(options) for options in tables.values())
    keys = {_key(proposal) for proposal in proposals}
    if len(proposals) != want or len(keys) != want:
        return [f"GridSearchProposer made {len(proposals)} proposals ({len(keys)} distinct), expected each of the {want} combinations once"]
    return []


def dynamic_problems(proposals: list[list[Any]], tables: dict[str, list[Any]], topology: Any) -> list[str]:
    problems = []
    if not proposals:
        return ["DynamicProgrammingProposer proposed nothing"]
    for option in proposals[0]:
        least = min(o.total_storage.hbm for o in tables[option.fqn])
        if option.total_storage.hbm != least:
            problems.append(f"DynamicProgrammingProposer's first proposal takes {option.fqn}'s option of {option.total_storage.hbm} "
                            f"bytes of HBM, not its least ({least})")
    hbm = sum(device.storage.hbm for device in topology.devices)
    for index, proposal in enumerate(proposals[1:], 1):
        used = sum(option.total_storage.hbm for option in proposal)
        if used > hbm:
            problems.append(f"DynamicProgrammingProposer's proposal {index} needs {used} bytes of HBM, more than the topology's {hbm}")
            break
    best = {fqn: min(options, key=lambda o: o.total_perf) for fqn, options in tables.items()}
    best_perf = sum(option.total_perf for option in best.values())
    if sum(option.total_storage.hbm for option in best.values()) < hbm * 0.99:  # fits, away from the bins' rounding
        found = min((sum(option.total_perf for option in proposal) for proposal in proposals[1:]), default=math.inf)
        if not math.isclose(found, best_perf, rel_tol=1e-9):
            problems.append(f"DynamicProgrammingProposer's plans reach a total perf of {found} at best; every table's best option "
                            f"({best_perf}) fits the topology's HBM")
    return problems


def rating(plan: list[Any], world_size: int) -> float:
    """The planner's perf model (NoopPerfModel): the largest rank's summed shard perf."""
    perf = [0.0] * world_size
    for option in plan:
        for shard in option.shards:
            perf[shard.rank] += shard.perf.total
    return max(perf)


def planner_choice_problems() -> list[str]:
    """The planner given GridSearchProposer over each table's table-, row- and column-wise options (fused):
    its plan is rated the least of every combination's plan, each partitioned here by the planner's
    default partitioner (GreedyPerfPartitioner) and rated by its perf model."""
    import copy
    import itertools

    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.partitioners import GreedyPerfPartitioner
    from torchrec.distributed.planner.proposers import GridSearchProposer
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.sharding_plan import get_default_sharders

    from paritykit.checks.planner.planning import topology_of
    from paritykit.checks.planner.report_rules import recorder
    from paritykit.harness.noise import quiet_planner

    constraints = {f"t{i}": ParameterConstraints(sharding_types=["table_wise", "row_wise", "column_wise"], compute_kernels=["fused"])
                   for i in range(len(TABLES))}
    options, topology = search_space(constraints)
    with quiet_planner():
        ratings = [rating(GreedyPerfPartitioner().partition(copy.deepcopy(list(combination)), topology), WORLD_SIZE)
                   for combination in itertools.product(*_by_table(options).values())]
        chosen = recorder()
        # A topology of its own: the planner reserves storage on the one it is given.
        EmbeddingShardingPlanner(topology=topology_of(WORLD_SIZE, WORLD_SIZE, "cuda"), constraints=constraints, proposer=GridSearchProposer(),
                                 stats=[chosen]).plan(module(), get_default_sharders())
    if chosen.best_plan is None:
        return ["the planner with GridSearchProposer never handed its plan to the Stats it was given"]
    got = rating(chosen.best_plan, WORLD_SIZE)
    if not math.isclose(got, min(ratings), rel_tol=1e-9):
        return [f"the planner with GridSearchProposer chose a plan rated {got}; the best of the {len(ratings)} combinations is rated "
                f"{min(ratings)} (the worst {max(ratings)})"]
    return []


def run_proposer_case() -> dict[str, Any]:
    from torchrec.distributed.planner import proposers

    options, topology = search_space()
    tables = _by_table(options)
    if len(tables) != len(TABLES) or min(len(o) for o in tables.values()) < 2:
        raise HarnessError(f"{CASE_ID}: the enumerator offered {[(fqn, len(o)) for fqn, o in tables.items()]}: each table needs "
                           "two options at least")
    # The grid over each table's GRID_OPTIONS best options (all of them are too many combinations to search).
    few = [option for fqn_options in tables.values() for option in sorted(fqn_options, key=score)[:GRID_OPTIONS]]
    few_tables = _by_table(few)
    rules: dict[str, tuple[Callable[[], Any], list[Any], dict[str, list[Any]], Callable[[list[list[Any]]], list[str]]]] = {
        "GreedyProposer": (proposers.GreedyProposer, options, tables, lambda found: greedy_problems(found, tables)),
        "UniformProposer": (proposers.UniformProposer, options, tables, lambda found: uniform_problems(found, tables)),
        "GridSearchProposer": (lambda: proposers.GridSearchProposer(max_proposals=MOST_PROPOSALS), few, few_tables,
                               lambda found: grid_problems(found, few_tables)),
        "DynamicProgrammingProposer": (proposers.DynamicProgrammingProposer, options, tables,
                                       lambda found: dynamic_problems(found, tables, topology)),
    }
    problems, counts = [], {}
    for name, (make, space, space_tables, rule) in rules.items():
        if not hasattr(proposers, name):  # a stack without it
            continue
        found = proposals_of(make(), space, topology)
        counts[name] = len(found)
        problems += _shape_problems(name, found, space_tables) + rule(found)
    # Beyond its max_proposals, the grid proposes nothing (it logs that it skips the search).
    beyond = proposals_of(proposers.GridSearchProposer(max_proposals=len(few_tables) and math.prod(map(len, few_tables.values())) - 1),
                          few, topology)
    if beyond:
        problems.append(f"GridSearchProposer with max_proposals one short of the {math.prod(map(len, few_tables.values()))} combinations "
                        f"proposed {len(beyond)} plans, expected none")
    problems += planner_choice_problems()
    if problems:
        raise ParityError(f"{CASE_ID}\n  torchrec's proposers broke what they document:\n    " + "\n    ".join(problems))
    return {"options": len(options), "proposals": sum(counts.values()), "plan_shape": "planner/proposers"}
