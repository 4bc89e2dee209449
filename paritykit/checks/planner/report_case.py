"""The planner's report on a plan of many tables (planning only: the model lives on the meta device): eight
tables of different sizes, column-wise on two GPU ranks and on two CPU ranks, each with its own pooling
factor and number of poolings, beside a dense layer. Every table has a shard on every rank, so all eight
may be named as causing the maximum perf and HBM, and the report names five (report_summary.py); each
table's parameter row sums its pooling factors and poolings and counts its indices as the case's
constraints give them (a pooling factor times the poolings, per input); the storage reserved for the
dense layer is on the ranks' own memory (HBM on GPUs, DDR on CPUs); and the rest of the table keeps
report_rules.py's rules.
"""

from __future__ import annotations

import re
from typing import Any

from paritykit.checks.planner.report_rules import captured_stats_table, sub_table, recorder, report_problems
from paritykit.checks.planner.report_summary import TOP_TABLES, top_tables
from paritykit.errors import HarnessError, ParityError

WORLD_SIZE, TABLES, RESERVED = 2, 8, 0.15
REPORTED_FOR = ("cuda", "cpu")
# A dense layer beside the tables (in, out features): 8 MiB of float32 weights, 48 MiB reserved.
DENSE = (1024, 2048)
PARAMETER_MULTIPLIER = 6.0
GB = 1024**3


def case_id(device: str) -> str:
    return (f"planner report: 8 column-wise tables and a dense layer on 2 {device} ranks, their pooling factors and poolings, "
            "the top tables, the dense storage")
# Per table i: (rows, columns, pooling factor, num poolings).
SHAPES = tuple((4096 * (i + 1), 128 * (1 + i % 2), 1.5 + i, 1.0 + (i % 3)) for i in range(TABLES))


def index_count_problems(rows: list[str], traffic: dict[str, tuple[float, float]]) -> list[str]:
    """Each table's 'Sum Pooling Factor', 'Sum Num Poolings' and 'Num Indices' (3 decimals) against its
    constraints: the pooling factor, the poolings, and their product (one input a table here)."""
    problems, seen = [], set()
    for row in sub_table(rows, "FQN"):
        name = row.get("FQN", "").split(".")[-1]
        if name not in traffic:
            continue
        seen.add(name)
        pooling, poolings = traffic[name]
        for cell, want in (("Sum Pooling Factor", pooling), ("Sum Num Poolings", poolings), ("Num Indices", pooling * poolings)):
            if cell in row and abs(float(row[cell]) - want) > 0.5e-3:
                problems.append(f"the stats table's row of {name} gives {cell} {row[cell]}, its constraints give {want:g} "
                                f"(pooling factor {pooling:g}, num poolings {poolings:g})")
    if rows and not seen:
        problems.append("the stats table has no parameter row of the plan's tables")
    return problems


def traffic() -> dict[str, tuple[float, float]]:
    """{table: (pooling factor, num poolings)} the constraints give."""
    return {f"t{i}": (pooling, poolings) for i, (_, _, pooling, poolings) in enumerate(SHAPES)}


def dense_storage_problems(rows: list[str], dense_bytes: int, device: str) -> list[str]:
    """The 'Dense Storage (per rank)' row: the storage reservation's dense part, its parameter multiplier
    (torchrec's documented default, 6) times the bytes of the parameters outside the sharded modules, on
    the ranks' own memory (HBM on GPU ranks, DDR on CPU ranks), none on the other."""
    start = next((i for i, row in enumerate(rows) if "Dense Storage (per rank):" in row), None)
    if start is None or start + 1 >= len(rows):
        return []
    found = re.search(r"HBM: ([0-9.]+) GB, DDR: ([0-9.]+) GB", rows[start + 1])
    want = PARAMETER_MULTIPLIER * dense_bytes / GB
    expected = {"HBM": want if device == "cuda" else 0.0, "DDR": want if device == "cpu" else 0.0}
    if found is None or any(abs(float(got) - expected[kind]) > 0.5e-3 + 1e-9 for got, kind in zip(found.groups(), ("HBM", "DDR"))):
        return [f"the stats table's dense storage {rows[start + 1].strip('# ')!r}: {PARAMETER_MULTIPLIER:g} x the {dense_bytes} bytes of the "
                f"dense parameters on {device} ranks give " + ", ".join(f"{k}: {v:.3f} GB" for k, v in expected.items())]
    return []


def planned_report(device: str = "cuda") -> tuple[list[str], list[Any], Any]:
    """The stats table's rows, the plan the planner chose and its topology, for ``device`` ranks."""
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.stats import EmbeddingStats
    from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.sharding_plan import get_default_sharders

    from paritykit.checks.planner.planning import topology_of
    from paritykit.harness.noise import quiet_planner

    module = torch.nn.Module()
    module.ebc = EmbeddingBagCollection([EmbeddingBagConfig(name=f"t{i}", num_embeddings=rows, embedding_dim=columns,
                                                            feature_names=[f"f{i}"])
                                         for i, (rows, columns, _, _) in enumerate(SHAPES)], device=torch.device("meta"))
    module.dense = torch.nn.Linear(*DENSE, device=torch.device("meta"))
    constraints = {name: ParameterConstraints(sharding_types=["column_wise"], min_partition=64, pooling_factors=[pooling],
                                              num_poolings=[poolings]) for name, (pooling, poolings) in traffic().items()}
    chosen = recorder()
    with quiet_planner(), captured_stats_table() as rows:
        topology = topology_of(WORLD_SIZE, WORLD_SIZE, device)
        planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints, stats=[EmbeddingStats(), chosen],
                                           storage_reservation=HeuristicalStorageReservation(percentage=RESERVED))
        planner.plan(module, get_default_sharders())
    if chosen.best_plan is None:
        raise ParityError(f"{case_id(device)}\n  torchrec's planner never handed its plan to the Stats it was given")
    return list(rows), chosen.best_plan, topology


def report_case_problems(rows: list[str], best_plan: list[Any], topology: Any) -> list[str]:
    device = topology.compute_device
    dense_bytes = (DENSE[0] + 1) * DENSE[1] * 4  # the float32 weight and bias
    return (report_problems(rows, best_plan, device, WORLD_SIZE, topology, RESERVED) + index_count_problems(rows, traffic())
            + dense_storage_problems(rows, dense_bytes, device))


def run_report_case(device: str) -> dict[str, Any]:
    rows, best_plan, topology = planned_report(device)
    for key in ("perf", "hbm"):
        eligible = top_tables(best_plan, key)[0]
        if len(eligible) <= TOP_TABLES:
            raise HarnessError(f"{case_id(device)}: only {len(eligible)} tables may be named for the maximum {key} (the case needs more "
                               f"than {TOP_TABLES}): " + ", ".join(f"{o.name}:{o.sharding_type}:{[s.rank for s in o.shards]}"
                                                                   for o in best_plan))
    problems = report_case_problems(rows, best_plan, topology)
    if problems:
        raise ParityError(f"{case_id(device)}\n  torchrec's planner misreported its plan:\n    " + "\n    ".join(problems))
    return {"tables": TABLES, "rows_compared": len(rows), "plan_shape": "planner/report"}
