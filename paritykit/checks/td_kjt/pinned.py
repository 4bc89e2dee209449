"""Sharded td-kjt cases every run covers before the random draws (a few examples may miss each):

- EBC, weighted, VBE: table-wise on the last rank, column-wise on ranks (last, 0), table-wise on
  rank 0, so the plan reorders the features and the inverse indices must be reordered with them;
  the same plan unweighted with one batch size for every feature (a wrong choice of inverse
  indices then reads valid rows: wrong numbers, not an index error);
- EBC, MEAN and SUM tables together, row-wise and table-row-wise only (torchrec's own MEAN divisor),
  with torchrec's TensorDict route;
- EC with need_indices, VBE with one batch size: table-wise on the last rank and on rank 0 (the
  plan reorders features within one sharding), column-wise on ranks (last, 0) (outputs only where
  torchrec cannot train a VBE EC on the device: sharded_draw.VBE_BROKEN);
- EC with torchrec's TensorDict route: table-wise on the last rank, row-wise;
- EBC with the dense kernel and a data-parallel table (gradients averaged by DDP), weighted.

Each has empty rows and an empty feature, and two steps of batches.
"""

from __future__ import annotations

from dataclasses import replace

from paritykit.checks.td_kjt.sharded_draw import (
    case_names,
    fixed_batch,
    routes_for,
    trains_with_vbe,
    vbe_supported,
)
from paritykit.checks.td_kjt.sharded_spec import RankBatch, ShardedCase
from paritykit.harness.tables import TableSpec

KEYS = ("f0", "f1", "f2", "f3")
BOUND = 6  # every pinned table has at least this many rows

# Per rank parity (even, odd): lengths of each feature's rows, and the VBE forms' inverse indices.
_FIXED = (((2, 0, 1), (0, 0, 0), (1, 3, 0), (2, 1, 1)), ((0, 1, 2), (1, 0, 3), (0, 0, 0), (1, 1, 0)))
# Batch sizes differ per feature (and are not palindromes within a plan's group of features).
_VBE = (
    (((2, 0), (1, 3, 1), (0, 2), (1,)), ((1, 0, 1), (2, 0, 1), (0, 1, 1), (0, 0, 0))),
    (((1,), (2, 0), (3, 1, 0), (0, 1)), ((0, 0, 0), (1, 1, 0), (1, 2, 0), (1, 0, 1))),
)
# One batch size for every feature, each feature repeated by its own inverse indices.
_VBE_ONE_SIZE = (
    (((1, 0, 2), (2, 1, 0), (0, 3, 1), (1, 1, 1)), ((2, 0, 1, 1), (0, 0, 2, 1), (1, 2, 2, 0), (0, 1, 0, 2))),
    (((0, 2, 1), (1, 1, 0), (2, 0, 3), (0, 1, 1)), ((1, 1, 0, 2), (2, 0, 0, 1), (0, 2, 1, 1), (2, 2, 0, 1))),
)


def pinned_steps(world_size: int, weighted: bool, variable_batch: bool, one_size: bool = False,
                 same_shape_on_ranks: bool = False) -> tuple[tuple[RankBatch, ...], ...]:
    """Two steps of batches; ranks alternate between two shapes unless ``same_shape_on_ranks``."""
    vbe = _VBE_ONE_SIZE if one_size else _VBE
    steps = []
    for step in range(2):
        ranks = []
        for rank in range(world_size):
            seed = 100 * step + rank
            shape = (step if same_shape_on_ranks else rank + step) % 2
            if variable_batch:
                lengths, inverse = vbe[shape]
                ranks.append(fixed_batch(KEYS, lengths, BOUND, seed, weighted, inverse))
            else:
                ranks.append(fixed_batch(KEYS, _FIXED[shape], BOUND, seed, weighted))
        steps.append(tuple(ranks))
    return tuple(steps)


def pinned_case(module: str, world_size: int, device: str, tables, plan, kernel: str, *, weighted=False,
                variable_batch=False, one_size=False, need_indices=False, form="from_jagged_offsets", seed=0,
                train: bool | None = None, same_shape_on_ranks: bool = False) -> ShardedCase:
    """A case on the pinned batches; ``train`` None: wherever torchrec trains it on the device."""
    if train is None:
        train = not variable_batch or trains_with_vbe(device, case_names(module, kernel, tables, plan), world_size)
    return ShardedCase(
        module=module, world_size=world_size, tables=tables, plan=plan, kernel=kernel,
        routes=routes_for(weighted, variable_batch, form), form=form,
        steps=pinned_steps(world_size, weighted, variable_batch, one_size, same_shape_on_ranks),
        weighted=weighted, need_indices=need_indices,
        device=device, seed=seed, train=train,
    )


def pinned_cases(world_size: int, device: str) -> tuple[ShardedCase, ...]:
    from paritykit.checks.td_kjt.sharded_draw import kernels_for
    from paritykit.harness.plans import placements_for

    last = world_size - 1
    ebc_kernel = next(k for k in kernels_for("ebc", device) if k != "dense")
    ec_kernel = next(k for k in kernels_for("ec", device) if k != "dense")
    ebc_vbe = (TableSpec("t0", 8, 4, ("f0", "f1")), TableSpec("t1", 6, 8, ("f2",)), TableSpec("t2", 7, 4, ("f3",)))
    mean = (TableSpec("t0", 8, 4, ("f0", "f1"), "MEAN"), TableSpec("t1", 6, 8, ("f2",)), TableSpec("t2", 7, 4, ("f3",), "MEAN"))
    # Only row-sharded tables beside a row-wise MEAN table (sharded_draw.RW_MEAN_BESIDE_OTHERS).
    ec = (TableSpec("t0", 8, 8, ("f0",)), TableSpec("t1", 6, 8, ("f1", "f2")), TableSpec("t2", 7, 8, ("f3",)))
    ec_shared = (TableSpec("t0", 8, 8, ("f0",)), TableSpec("t1", 6, 8, ("f1", "f0")), TableSpec("t2", 7, 8, ("f2", "f3")))
    vbe_plan = {"t0": ("table_wise", last), "t1": ("column_wise", (last, 0)), "t2": ("table_wise", 0)}
    ec_vbe_plan = {"t0": ("table_wise", last), "t1": ("table_wise", 0), "t2": ("column_wise", (last, 0))}
    cases = [
        pinned_case("ebc", world_size, device, ebc_vbe, vbe_plan, ebc_kernel, weighted=True, variable_batch=True, seed=21),
        pinned_case("ebc", world_size, device, ebc_vbe, vbe_plan, ebc_kernel, variable_batch=True, one_size=True,
                    form="nested_tensor", seed=26),
        pinned_case("ebc", world_size, device, mean,
                    {"t0": ("row_wise",), "t1": ("table_row_wise", 0), "t2": ("row_wise",)}, ebc_kernel, seed=22),
        pinned_case("ec", world_size, device, ec, ec_vbe_plan, ec_kernel, variable_batch=True, one_size=True,
                    need_indices=True, seed=23),
        pinned_case("ec", world_size, device, ec,
                    {"t0": ("table_wise", last), "t1": ("row_wise",), "t2": ("table_wise", 0)}, ec_kernel, seed=24),
        # f0 looked up by two tables: the EC names its embeddings f0@t0 and f0@t1, and each sharding's
        # inverse indices are found by the feature's part of that name.
        pinned_case("ec", world_size, device, ec_shared, ec_vbe_plan, ec_kernel, variable_batch=True, one_size=True,
                    need_indices=True, seed=27),
    ]
    if "dense" in kernels_for("ebc", device) and "data_parallel" in placements_for("ebc", device):
        cases.append(pinned_case("ebc", world_size, device, ebc_vbe,
                                 {"t0": ("data_parallel",), "t1": ("column_wise", (0, last)), "t2": ("table_wise", last)},
                                 "dense", weighted=True, seed=25))
    # Only what torchrec computes on this device: a VBE case whose placements it cannot expand is not pinned.
    return tuple(c for c in cases if not c.variable_batch or _vbe_plan_supported(c, device))


def _vbe_plan_supported(case: ShardedCase, device: str) -> bool:
    names = case_names(case.module, case.kernel, case.tables, case.plan)
    return all(vbe_supported(device, name, case.world_size) for name in names)


def _uneven_steps(world_size: int, keys: tuple[str, ...], weighted: bool) -> tuple[tuple[RankBatch, ...], ...]:
    """Two steps where every rank of a host has its own batch size (1 to 3 rows per feature)."""
    steps = []
    for step in range(2):
        ranks = []
        for rank in range(world_size):
            rows = 1 + (rank + step) % 3
            lengths = tuple(tuple((rank + 2 * k + r + step) % 3 for r in range(rows)) for k in range(len(keys)))
            ranks.append(fixed_batch(keys, lengths, BOUND, 300 + 10 * step + rank, weighted))
        steps.append(tuple(ranks))
    return tuple(steps)


def host_cases(world_size: int, ranks_per_host: int, device: str) -> tuple[ShardedCase, ...]:
    """Forward-only cases on ranks standing for several hosts, fed batches whose sizes differ between
    the ranks of a host: the output dists of table-row-wise and grid shards then split the pooled rows
    by each rank's own batch (the rank within its host, the host of a rank), paths that equal batches
    on every rank never take. Forward only: their backward needs an all-gather of uneven sizes, which
    gloo refuses (known issues row-wise-family-uneven-batch, vbe-training-table-row-wise)."""
    from paritykit.checks.td_kjt.sharded_draw import kernels_for

    hosts = world_size // ranks_per_host
    last, far_host = world_size - 1, hosts - 1
    kernel = next(k for k in kernels_for("ebc", device) if k != "dense")
    sum_tables = (TableSpec("t0", 8, 4, ("f0", "f1")), TableSpec("t1", 6, 8, ("f2",)), TableSpec("t2", 7, 4, ("f3",)))
    # A variable batch per feature whose sizes differ between ranks (pinned_steps alternates two shapes).
    vbe = replace(pinned_case("ebc", world_size, device, sum_tables,
                              {"t0": ("table_row_wise", far_host), "t1": ("row_wise",), "t2": ("table_wise", last)},
                              kernel, weighted=True, variable_batch=True, seed=31, train=False),
                  ranks_per_host=ranks_per_host)
    # A fixed batch whose size differs between ranks, through table-row-wise, grid (host blocks in
    # reverse order), row-wise and table-wise tables.
    from torchrec.distributed.planner.constants import MIN_CW_DIM

    grid_hosts = tuple(reversed(range(hosts)))  # grid_shard cuts columns into blocks of MIN_CW_DIM
    uneven_tables = sum_tables + (TableSpec("t3", 9, MIN_CW_DIM * hosts, ("f4",)),)
    uneven_keys = KEYS + ("f4",)
    uneven = ShardedCase(
        module="ebc", world_size=world_size, tables=uneven_tables,
        plan={"t0": ("table_row_wise", 0), "t1": ("row_wise",), "t2": ("table_wise", last), "t3": ("grid_shard", grid_hosts)},
        kernel=kernel, routes=routes_for(False, False, "from_jagged_offsets"), form="from_jagged_offsets",
        steps=_uneven_steps(world_size, uneven_keys, False), device=device, seed=32, train=False,
        ranks_per_host=ranks_per_host,
    )
    return (vbe, uneven)
