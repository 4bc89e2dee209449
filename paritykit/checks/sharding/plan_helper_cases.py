"""torchrec's ``sharding_plan`` helpers as users call them (the TorchRec tutorial's way):
``construct_module_sharding_plan(ebc, {"t0": table_wise(rank=1), "t1": column_wise(ranks=[0, 1, 0]),
...}, world_size=W, local_size=L)``. Every ParameterSharding it returns (type, ranks, kernel, each
shard's offsets, sizes and placement) is compared with paritykit's own layout (shard_layout.py), for
drawn table shapes, world sizes, hosts and placements. Caller side only: nothing runs on ranks (the
sharding cases train modules sharded by these same helpers against the unsharded module).

The plan's printout (``print(plan)``, as the tutorial does) must show every table's type, kernel and
ranks and every shard's offsets, sizes and placement, each on a row of its own under the module's path.

Also torchrec's documented refusals: ``calculate_shard_sizes_and_offsets`` raises ValueError for a
sharding type it does not know (never a layout of some other type), and ``column_wise(ranks=...)``
raises ValueError for a table whose columns do not divide evenly among the ranks (never uneven shards);
``construct_module_sharding_plan`` refuses a plan that names a table the module does not have, or
leaves one of its tables out (a typo in a table's name must not be dropped silently), naming it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from paritykit.checks.sharding.shard_layout import expected_layout, layout_differences, layout_of
from paritykit.errors import ParityError
from paritykit.harness.plans import column_widths_supported, describe_plan

# Helpers that take a compute kernel (table_row_wise and grid_shard pick their own; data_parallel is dense).
_KERNEL_ARGUMENT = ("table_wise", "row_wise", "column_wise", "column_wise_sized")
# torchrec's grid cuts columns into blocks of this many (its planner's MIN_CW_DIM).
GRID_BLOCK = 128


@dataclass(frozen=True)
class PlanHelperCase:
    """An EBC's tables (name, rows, columns) placed by torchrec's helpers on ``world_size`` ranks in hosts of ``local_size``."""

    world_size: int
    local_size: int
    tables: tuple[tuple[str, int, int], ...]
    plan: dict[str, tuple] = field(hash=False)
    kernels: dict[str, str] = field(default_factory=dict, hash=False)

    def case_id(self) -> str:
        shapes = ", ".join(f"{n}[{r}x{c}]" for n, r, c in self.tables)
        kernels = f" kernels={self.kernels}" if self.kernels else ""
        return (f"plan-helpers world_size={self.world_size} local_size={self.local_size} "
                f"plan={describe_plan(self.plan)} tables=({shapes}){kernels}")


def helper_of(entry: tuple, kernel: str | None):
    """The user's call for a normalised entry: torchrec's own helper (TWCW has none: paritykit's
    column-wise generator with torchrec's TWCW type, where the stack has no helper of its own)."""
    from torchrec.distributed import sharding_plan as sp

    from paritykit.harness.plans import table_column_wise

    kind, *args = entry
    kw = {"compute_kernel": kernel} if kernel else {}
    calls = {
        "table_wise": lambda: sp.table_wise(rank=args[0], **kw),
        "row_wise": lambda: sp.row_wise(**kw),
        "column_wise": lambda: sp.column_wise(ranks=list(args[0]), **kw),
        "column_wise_sized": lambda: sp.column_wise(size_per_rank=list(args[0]), **kw),
        "table_row_wise": lambda: sp.table_row_wise(host_index=args[0]),
        "grid_shard": lambda: sp.grid_shard(host_indexes=list(args[0])),
        "data_parallel": lambda: sp.data_parallel(),
        "table_column_wise": lambda: (sp.table_column_wise(ranks=list(args[0]), **kw) if hasattr(sp, "table_column_wise")
                                      else table_column_wise(list(args[0]), kernel)),
    }
    return calls[kind]()


def run_plan_helper_case(case: PlanHelperCase) -> dict[str, Any]:
    """ParityError naming the table and what differs; else what was compared."""
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan

    configs = [EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=c, feature_names=[f"f_{n}"]) for n, r, c in case.tables]
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    generators = {name: helper_of(entry, case.kernels.get(name)) for name, entry in case.plan.items()}
    plan = construct_module_sharding_plan(ebc, generators, world_size=case.world_size, local_size=case.local_size, device_type="cpu")
    problems = []
    for name, rows, columns in case.tables:
        expected = expected_layout(case.plan[name], (rows, columns), case.world_size, case.local_size)
        found, placement_problems = layout_of(plan[name], "cpu")
        wrong = layout_differences(expected, found) + placement_problems
        kernel = case.kernels.get(name)
        if kernel and plan[name].compute_kernel != kernel:
            wrong.append(f"compute kernel {plan[name].compute_kernel!r}, asked for {kernel!r}")
        problems += [f"table {name!r} ({case.plan[name][0]}): {w}" for w in wrong]
    problems += printout_problems(plan, MODULE_PATH)
    if problems:
        raise ParityError(f"{case.case_id()}\n  torchrec's sharding_plan helpers against paritykit's shard layout:\n  "
                          + "\n  ".join(problems))
    return {"plan_shape": "plan-helpers", "tables": len(case.tables)}


# The module path the printout is asked for: a nested one, as an EBC inside a model has.
MODULE_PATH = "sparse.ebc"


def _row_holds(line: str, cells: list[str]) -> bool:
    """Whether ``line`` holds ``cells`` in this order (a printed table's row)."""
    at = 0
    for cell in cells:
        at = line.find(cell, at)
        if at < 0:
            return False
        at += len(cell)
    return True


def printout_problems(module_plan: Any, module_path: str) -> list[str]:
    """What ``str(ShardingPlan({module_path: module_plan}))`` leaves out or garbles: the module's path,
    a row per table (name, type, kernel, ranks) and a row per shard (name, offsets, sizes, placement),
    all read from the plan object itself."""
    from torchrec.distributed.types import EnumerableShardingSpec, ShardingPlan

    try:
        text = str(ShardingPlan({module_path: module_plan}))
    except Exception as error:  # noqa: BLE001 - printing a plan must not raise: the finding is the error
        return [f"str(ShardingPlan) raised {type(error).__name__}: {error}"]
    lines = text.splitlines()
    problems = [] if any(module_path in line for line in lines) else [f"the printout never names the module {module_path!r}"]
    for name, sharding in module_plan.items():
        row = [name, str(sharding.sharding_type), str(sharding.compute_kernel), str(sharding.ranks)]
        if not any(_row_holds(line, row) for line in lines):
            problems.append(f"table {name!r}: no row of the printout reads {' | '.join(row)}")
        spec = sharding.sharding_spec
        for shard in (spec.shards or []) if isinstance(spec, EnumerableShardingSpec) else []:
            cells = [name, str(shard.shard_offsets), str(shard.shard_sizes), str(shard.placement)]
            if not any(_row_holds(line, cells) for line in lines):
                problems.append(f"table {name!r}: no row of the printout reads shard {' | '.join(cells)}")
    return problems


def unknown_sharding_type_problem(sharding_type: str) -> str | None:
    """torchrec's calculate_shard_sizes_and_offsets must raise ValueError for a type it does not know."""
    import torch
    from torchrec.distributed.sharding_plan import calculate_shard_sizes_and_offsets

    try:
        sizes, offsets = calculate_shard_sizes_and_offsets(torch.empty(8, 8, device="meta"), 2, 2, sharding_type)
    except ValueError:
        return None
    return (f"calculate_shard_sizes_and_offsets(sharding_type={sharding_type!r}) returned sizes {sizes}, offsets {offsets} "
            "where its docstring promises ValueError for a type that is not a ShardingType")


def run_unknown_types_case(types: tuple[str, ...]) -> dict[str, Any]:
    problems = [p for p in map(unknown_sharding_type_problem, types) if p]
    if problems:
        raise ParityError("\n  ".join(problems))
    return {"plan_shape": "plan-helpers/unknown-type", "types": len(types)}


def uneven_columns_problem(columns: int, ranks: tuple[int, ...]) -> str | None:
    """``column_wise(ranks)`` on a table of ``columns`` that ``len(ranks)`` does not divide: ValueError."""
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan

    if columns % len(ranks) == 0:
        raise ValueError(f"{columns} columns divide evenly among ranks {list(ranks)}: not a case of uneven columns")
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t0", num_embeddings=8, embedding_dim=columns,
                                                            feature_names=["f_t0"])], device=torch.device("meta"))
    world_size = max(ranks) + 1
    try:
        plan = construct_module_sharding_plan(ebc, {"t0": column_wise(ranks=list(ranks))}, world_size=world_size,
                                              local_size=world_size, device_type="cpu")
    except ValueError:
        return None
    shards = plan["t0"].sharding_spec.shards
    return (f"column_wise(ranks={list(ranks)}) on table 't0' of {columns} columns returned shards of sizes "
            f"{[s.shard_sizes for s in shards]} where its docstring promises ValueError (the columns do not divide evenly)")


def run_uneven_columns_case(tables: tuple[tuple[int, tuple[int, ...]], ...]) -> dict[str, Any]:
    problems = [p for p in (uneven_columns_problem(columns, ranks) for columns, ranks in tables) if p]
    if problems:
        raise ParityError("\n  ".join(problems))
    return {"plan_shape": "plan-helpers/uneven-columns", "tables": len(tables)}


def mismatched_plan_problem(plan_tables: tuple[str, ...]) -> str | None:
    """A plan for tables ``plan_tables`` of an EBC holding t0 and t1: refused, naming the odd table."""
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise

    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=n, num_embeddings=8, embedding_dim=4, feature_names=[f"f_{n}"])
                                         for n in ("t0", "t1")], device=torch.device("meta"))
    odd = sorted(set(plan_tables) ^ {"t0", "t1"})
    try:
        plan = construct_module_sharding_plan(ebc, {n: table_wise(rank=0) for n in plan_tables}, world_size=2, local_size=2,
                                              device_type="cpu")
    except Exception as exc:  # noqa: BLE001 - any refusal that names the table
        return None if all(name in str(exc) for name in odd) else f"the refusal of a plan for {list(plan_tables)} does not name {odd}: {exc}"
    return (f"construct_module_sharding_plan for an EBC of t0 and t1 took a plan for {list(plan_tables)} and returned one "
            f"for {sorted(plan)}: the table(s) {odd} were not refused")


def run_mismatched_plans_case(plans: tuple[tuple[str, ...], ...]) -> dict[str, Any]:
    problems = [p for p in map(mismatched_plan_problem, plans) if p]
    if problems:
        raise ParityError("\n  ".join(problems))
    return {"plan_shape": "plan-helpers/mismatched-tables", "plans": len(plans)}


# A table named that the module lacks (beside all of its own, or instead of one); one of its own left out.
MISMATCHED_PLANS = (("t0", "t1", "t2"), ("t0", "t9"), ("t1",))


# -- the draws --------------------------------------------------------------------------------------

def _entry(draw, kind: str, world_size: int, local_size: int) -> tuple[tuple, int]:
    """A placement of ``kind`` and a table width it cuts into shards whose width is a multiple of 4
    (torchrec's column blocks are; see docs/sharding.md)."""
    hosts = world_size // local_size
    if kind == "table_wise":
        return (kind, draw(st.integers(0, world_size - 1))), 4 * draw(st.integers(1, 6))
    if kind in ("column_wise", "table_column_wise"):
        pool = list(range(world_size))
        if kind == "table_column_wise":
            host = draw(st.integers(0, hosts - 1))
            pool = pool[host * local_size:(host + 1) * local_size]
        ranks = tuple(draw(st.lists(st.sampled_from(pool), min_size=1, max_size=4)))
        return (kind, ranks), len(ranks) * 4 * draw(st.integers(1, 3))
    if kind == "column_wise_sized":  # shard i on rank i
        widths = tuple(draw(st.lists(st.sampled_from((4, 8, 12, 16)), min_size=1, max_size=min(4, world_size))))
        return (kind, widths), sum(widths)
    if kind == "table_row_wise":
        return (kind, draw(st.integers(0, hosts - 1))), 4 * draw(st.integers(1, 4))
    if kind == "grid_shard":
        host_indexes = tuple(draw(st.lists(st.integers(0, hosts - 1), min_size=1, max_size=3)))
        return (kind, host_indexes), GRID_BLOCK * len(host_indexes)
    return (kind,), 4 * draw(st.integers(1, 4))


@st.composite
def plan_helper_cases(draw) -> PlanHelperCase:
    kinds = ("table_wise", "row_wise", "column_wise", "table_column_wise", "table_row_wise", "grid_shard", "data_parallel")
    kinds += ("column_wise_sized",) if column_widths_supported() else ()
    local_size = draw(st.sampled_from((1, 2, 3, 4)))
    world_size = local_size * draw(st.integers(1, 3))
    tables, plan, kernels = [], {}, {}
    for index in range(draw(st.integers(1, 4))):
        name = f"t{index}"
        entry, columns = _entry(draw, draw(st.sampled_from(kinds)), world_size, local_size)
        tables.append((name, draw(st.integers(1, 40)), columns))
        plan[name] = entry
        if entry[0] in _KERNEL_ARGUMENT and draw(st.booleans()):
            kernels[name] = draw(st.sampled_from(("dense", "fused")))
    return PlanHelperCase(world_size, local_size, tuple(tables), plan, kernels)


def pinned_plan_helper_cases() -> tuple[PlanHelperCase, ...]:
    """The tutorial's placements on 2 hosts of 2: CW on [0, 1, 0] and a 3-cycle, rows fewer than
    ranks (row-wise leaves a rank none), TWRW on the second host, GRID blocks in reverse host order;
    column shards of unequal widths."""
    tables = (("t0", 10, 12), ("t1", 3, 8), ("t2", 9, 16), ("t3", 7, 2 * GRID_BLOCK), ("t4", 5, 8), ("t5", 6, 24))
    plan = {"t0": ("column_wise", (0, 1, 0)), "t1": ("row_wise",), "t2": ("table_row_wise", 1), "t3": ("grid_shard", (1, 0)),
            "t4": ("table_wise", 3), "t5": ("column_wise", (3, 0, 0))}
    twcw = {"t0": ("table_column_wise", (3, 2, 3)), "t1": ("data_parallel",), "t2": ("row_wise",), "t3": ("grid_shard", (1, 1)),
            "t4": ("table_wise", 0), "t5": ("table_column_wise", (0, 1))}
    cases = [PlanHelperCase(4, 2, tables, plan, {"t0": "dense", "t1": "fused"}), PlanHelperCase(4, 2, tables, twcw)]
    if column_widths_supported():  # shards of 8, 4 and 12 columns on ranks 0, 1, 2 (size_per_rank)
        cases.append(PlanHelperCase(4, 2, tables, {**plan, "t5": ("column_wise_sized", (8, 4, 12))}, {"t5": "fused"}))
    return tuple(cases)


def narrow_column_shards_case() -> PlanHelperCase:
    """12 columns on ranks [0, 1]: shards of 6, not a multiple of 4 (the known issue
    column-wise-shard-width-not-multiple-of-4: torchrec places the whole table on rank 0)."""
    return PlanHelperCase(2, 2, (("t0", 10, 12),), {"t0": ("column_wise", (0, 1))})


# Columns the ranks do not divide: odd on 2 ranks, 10 and 16 on 3 ([0, 1, 0] and [1, 0, 1]), 12 on 5.
UNEVEN_COLUMNS = ((7, (0, 1)), (10, (0, 1, 0)), (16, (1, 0, 1)), (12, (0, 1, 2, 3, 0)))

# Not ShardingType values; both sort after "grid_shard" and before it (a string compare is not a match).
UNKNOWN_SHARDING_TYPES = ("table_wise_v2", "row-wise", "zz_sharding", "column", "")
