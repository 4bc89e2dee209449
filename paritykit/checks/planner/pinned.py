"""Planner cases that always run: constraints that leave the planner one choice per table, so a
planner that drops a constraint or its min_partition has nowhere to hide."""

from __future__ import annotations

from paritykit.checks.planner.cases import PlannerCase, TableConstraint
from paritykit.harness.configuration import RankBatch
from paritykit.harness.tables import TableSpec


def _steps(tables: tuple[TableSpec, ...], world_size: int) -> tuple:
    def rows(table: TableSpec, rank: int, step: int) -> tuple:
        n = table.num_embeddings
        return ((rank + step) % n, (3 * rank + 1) % n), ((5 * step + rank + 2) % n,)

    return tuple(tuple(RankBatch(tuple((f, rows(t, rank, step)) for t in tables for f in t.feature_names))
                       for rank in range(world_size)) for step in range(2))


def pinned_cases(world_size: int, ranks_per_host: int) -> tuple[PlannerCase, ...]:
    ebc = (TableSpec("t0", 12, 16, ("f0",)), TableSpec("t1", 10, 24, ("f1", "f2"), "MEAN"), TableSpec("t2", 8, 8, ("f3",)))
    ebc_constraints = (("t0", TableConstraint(("column_wise",), 4)), ("t1", TableConstraint(("table_column_wise",), 8)),
                       ("t2", TableConstraint(("table_wise",))))
    ec = (TableSpec("t0", 4 * world_size, 8, ("f0",)), TableSpec("t1", 6 * world_size, 8, ("f1",)))
    ec_constraints = (("t0", TableConstraint(("row_wise",))), ("t1", TableConstraint(("column_wise",), 4)))
    return (
        PlannerCase("ebc", world_size, ranks_per_host, ebc, ebc_constraints, _steps(ebc, world_size), "rowwise_adagrad", seed=1),
        PlannerCase("ec", world_size, ranks_per_host, ec, ec_constraints, _steps(ec, world_size), "adagrad", seed=2),
    )


def gpu_only_cases(world_size: int, ranks_per_host: int) -> tuple[PlannerCase, ...]:
    """Placements torchrec's EBC sharder offers GPU ranks only, across the hosts: table-row-wise, grid
    (column blocks of 8) and row-wise, one choice per table (run_gpu_plan_case)."""
    tables = (TableSpec("t0", 10, 16, ("f0",)), TableSpec("t1", 9, 16, ("f1",)), TableSpec("t2", 11, 8, ("f2",)))
    constraints = (("t0", TableConstraint(("table_row_wise",))), ("t1", TableConstraint(("grid_shard",), 8)),
                   ("t2", TableConstraint(("row_wise",))))
    return (PlannerCase("ebc", world_size, ranks_per_host, tables, constraints, _steps(tables, world_size), "rowwise_adagrad", seed=3),)
