"""DistributedModelParallel's surface and torchrec's collectives under the same oracle as every sharding
case: the unsharded model trained alike (``paritykit.engine``), with torchrec asked to run the sharded
one another way. Each option must leave the numbers where the unsharded model puts them:

- torchrec's synchronous collectives (``set_use_sync_collectives``: the ``*_sync`` functions of
  comm_ops, pooled, sequence, variable-batch, reduce-scatter and reduce-scatter-v), with and without
  gradient division (``set_gradient_division(False)``: model-parallel gradients summed, and the
  reference sums them too);
- a hyper-parameter schedule on DMP's fused optimizer (``param_groups[i]["lr"]`` then ``zero_grad``,
  and ``update_hyper_parameters``), the reference's torch optimizer given the same schedule;
- quantized communication (FP16 codecs, a backward loss scale), held to the codec's own roundoff;
- a model built on the meta device (DMP's ``init_parameters``), DDP wrapped later
  (``init_data_parallel=False``), the dense optimizer over ``bare_named_parameters``;
- ``DMP.reshard`` to another placement between two steps (tables and optimizer state move);
- a plain ``nn.EmbeddingBag`` sharded by torchrec's ``EmbeddingBagSharder``, against torch's own module;
- torchrec's debug checks (``TORCHREC_VALIDATE_COLLECTIVES=1``: each splits all-to-all carries a tag of
  what it exchanges, stripped on arrival; ``TORCHREC_OVERFLOW_DEBUG=1``);
- DMP given no plan, as the tutorial builds it: it plans itself (``collective_plan``: rank 0 plans, the
  plan is broadcast), which must be the plan ``EmbeddingShardingPlanner.plan`` makes in the caller for
  the same topology and sharders, and must train like the unsharded model.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from paritykit.checks.sharding.case_runner import case_setup, permutation_problem
from paritykit.checks.sharding.codec_oracle import codec_applies, codec_problem
from paritykit.checks.sharding.cases import RankBatch, ShardingCase, batches_of, build_module, torchrec_plan
from paritykit.checks.sharding.dmp_models import (BAG_ROWS, BAG_WIDTH, OPTIMIZER_STEP, bag_batches, bag_setup, build_ebc_under_dense,
                                                   build_gather_select_ec, kernels_and_tables, optimizer_steps, unsharded_buffers)
from paritykit.compare import find_differences, format_differences
from paritykit.engine.comparison import compare_records, where_for
from paritykit.engine.dmp_options import CODEC_PRECISIONS, DmpOptions, QComm, Reshard, dmp_planned
from paritykit.engine.reference import train_reference
from paritykit.engine.setup import build_setup
from paritykit.engine.tolerances import codec_tolerance, default_tolerance
from paritykit.engine.training import TrainingSetup, assemble_records, train_on_rank
from paritykit.errors import HarnessError, ParityError
from paritykit.harness.plans import describe_plan, local_world_size
from paritykit.harness.seeding import stable_seed
from paritykit.harness.sharded import gradient_division
from paritykit.harness.tables import TableSpec

# What a case shards: the base's own EBC/EC; that EBC built unweighted but fed the base's weighted
# batches; the EBC under a dense layer; a plain nn.EmbeddingBag fed offsets with their end (torchrec's
# convention) or without it (torch's default).
MODELS = ("module", "unweighted-module", "ebc-under-dense", "embedding-bag", "embedding-bag-torch-offsets", "ec-gather-select")


@dataclass(frozen=True)
class DmpCase:
    """One DMP option (or a few) on one model. ``base`` gives the tables, plan, optimizers and batches;
    ``model`` says what is sharded: the base's own EBC/EC, the EBC under a dense layer, or a plain
    nn.EmbeddingBag (its one table is ``base.tables[0]``, placed by ``base.plan``). ``reshard_to``: the
    placements DMP.reshard moves the tables to before step ``reshard_before``."""

    name: str
    base: ShardingCase
    options: DmpOptions
    model: str = "module"
    reshard_to: dict[str, tuple] | None = field(default=None, hash=False)
    reshard_before: int = 2

    def describe(self) -> str:
        moved = f" reshard_to={describe_plan(self.reshard_to)}" if self.reshard_to else ""
        base = self.base.describe()
        if self.options.plan_by_dmp:  # the base's plan only names the tables: DMP's planner places them
            base = base.replace(describe_plan(self.base.plan), "<placed by DMP's planner>")
        return f"dmp {self.name} [{self.model}; {self.options.describe()}{moved}] {base}"

    def case_id(self) -> str:
        return f"{self.describe()} #{stable_seed(repr(self), repr(self.base.step_batches())) % 16**8:08x}"


def dmp_setup(case: DmpCase, device: str = "cpu") -> TrainingSetup:
    """The case's TrainingSetup, its options checked (HarnessError) before any rank runs."""
    if case.model not in MODELS:
        raise HarnessError(f"DMP case {case.name!r}: model {case.model!r} is not one of {MODELS}")
    base = case.base
    if case.model == "module":
        setup = case_setup(base, device)
    elif case.model == "unweighted-module":
        setup = build_setup(functools.partial(build_module, base.module, base.tables, False, base.need_indices, base.seed),
                            torchrec_plan(base), batches_of(base), embedding_optimizer=base.optimizer,
                            dense_optimizer=base.dense_optimizer, seed=base.seed, device=device)
    elif case.model == "ec-gather-select":
        setup = build_setup(functools.partial(build_gather_select_ec, base.tables, base.seed, base.need_indices),
                            torchrec_plan(base), batches_of(base), embedding_optimizer=base.optimizer,
                            dense_optimizer=base.dense_optimizer, seed=base.seed, device=device)
    elif case.model == "ebc-under-dense":
        make = functools.partial(build_ebc_under_dense, base.tables, base.seed)
        # DMP planning itself: the run's plan is the one its planner makes (the base's plan is not used).
        plan = dmp_planned(make(), base.world_size, local_world_size(base.world_size), device) if case.options.plan_by_dmp \
            else torchrec_plan(base)
        setup = build_setup(make, plan, batches_of(base), embedding_optimizer=base.optimizer, dense_optimizer=base.dense_optimizer,
                            seed=base.seed, device=device)
    else:
        setup = bag_setup(base, device, include_last_offset=case.model == "embedding-bag")
    options = case.options
    if options.plan_by_dmp and case.model != "ebc-under-dense":
        raise HarnessError(f"DMP case {case.name!r}: plan_by_dmp runs on the model 'ebc-under-dense', not {case.model!r}")
    if case.reshard_to is not None:
        moved = dmp_setup(dataclasses.replace(case, base=dataclasses.replace(base, plan=case.reshard_to), reshard_to=None), device)
        options = dataclasses.replace(options, reshard=Reshard(case.reshard_before, moved.sharding_plan))
    if case.model.startswith("embedding-bag"):
        options = dataclasses.replace(options, embedding_bag_fused_params=setup.options.embedding_bag_fused_params)
    options.check(len(setup.batches), setup.embedding_optimizer.name)
    return dataclasses.replace(setup, options=options)


def tolerance_of(case: DmpCase):
    qcomm = case.options.qcomm
    if qcomm is not None:
        coarsest = max((CODEC_PRECISIONS[qcomm.forward], CODEC_PRECISIONS[qcomm.backward]), key=lambda d: torch.finfo(d).eps)
        return codec_tolerance(coarsest, case.base.world_size)
    return default_tolerance(exact_first_lookups=case.base.module == "ec" and case.model == "module")


def run_dmp_case(case: DmpCase, pool: Any) -> dict[str, Any]:
    """ParityError naming step, rank, module/feature or state key and element; else what was compared."""
    if pool.world_size != case.base.world_size:
        raise HarnessError(f"case needs world size {case.base.world_size}, the pool has {pool.world_size}")
    setup = dmp_setup(case, pool.device)
    if case.model == "ebc-under-dense":
        setup = dataclasses.replace(setup, probes=setup.probes + (unsharded_buffers,))
    if case.name in COUNTED:
        setup = dataclasses.replace(setup, probes=setup.probes + (kernels_and_tables,))
    if case.options.hyper_parameters:
        setup = dataclasses.replace(setup, probes=setup.probes + (optimizer_steps,))
    reference = train_reference(setup, division=gradient_division())
    record = assemble_records(pool.call(train_on_rank, (setup,), case=case.case_id()))
    problem = permutation_problem(case.base, setup, record) if case.model == "module" else buffers_problem(case, setup, record)
    problem = problem or kernels_problem(case, setup, record) or steps_problem(setup, record)
    if problem:
        raise ParityError(f"{case.describe()}\n  {problem}")
    metrics = compare_records(record, reference, tolerance_of(case), case.describe(), where=where_for(setup))
    qcomm, base = case.options.qcomm, case.base
    if qcomm is not None and case.model == "module" and codec_applies(base.module, base.tables, base.plan, qcomm.forward):
        wire, checked = codec_problem(record.embeddings)
        if wire or not checked:
            raise ParityError(f"{case.describe()}\n  {wire or 'no embedding was recorded to check the FP16 wire against'}")
        metrics = {**metrics, "fp16_wire_values": checked}
    return {**metrics, "plan_shape": f"dmp/{case.name}"}


# The cases whose lookups' kernels are counted: one kernel per table, or (torchrec's default, group_tables'
# docstring) one per data type, pooling and kernel, which the "grouped-tables" case's tables all share.
COUNTED = ("one-tbe-per-table", "grouped-tables")


def kernels_problem(case: DmpCase, setup: TrainingSetup, record: Any) -> str | None:
    """A lookup on a rank holding other than one kernel per table (one_tbe_per_table) or, by default,
    one kernel for its tables of one data type, pooling and kernel."""
    if case.name not in COUNTED:
        return None
    probe = setup.probes.index(kernels_and_tables)
    for rank, probes in enumerate(record.probes):
        counts = probes[probe]
        if not counts:
            return f"rank {rank}: no batched lookup found to count its kernels"
        per_table = case.options.one_tbe_per_table
        wrong = [(kernels, tables) for kernels, tables in counts if kernels != (tables if per_table else min(tables, 1))]
        if wrong:
            said = "use_one_tbe_per_table, yet" if per_table else "tables of one data type, pooling and kernel, yet"
            return f"rank {rank}: {said} lookups hold {', '.join(f'{t} tables in {k} kernel(s)' for k, t in wrong)}"
    return None


def steps_problem(setup: TrainingSetup, record: Any) -> str | None:
    """Every batched kernel on every rank at the step set_optimizer_step gave DMP's fused optimizer."""
    if optimizer_steps not in setup.probes:
        return None
    for rank, probes in enumerate(record.probes):
        steps = probes[setup.probes.index(optimizer_steps)]
        if not steps or set(steps) != {OPTIMIZER_STEP}:
            return (f"rank {rank}: after fused_optimizer.set_optimizer_step({OPTIMIZER_STEP}) its batched kernels' steps are "
                    f"{steps or 'none found'}")
    return None


def buffers_problem(case: DmpCase, setup: TrainingSetup, record: Any) -> str | None:
    """DMP's named_buffers outside the sharded modules against the unsharded model's own buffers."""
    if case.model != "ebc-under-dense":
        return None
    expected = dict(setup.model_fn().named_buffers())
    for rank, probes in enumerate(record.probes):
        found = find_differences(probes[setup.probes.index(unsharded_buffers)], expected, exact=True, name="named_buffers")
        if found:
            return f"rank {rank}: DMP.named_buffers() outside the sharded modules is not the unsharded model's:\n" + \
                format_differences(found[:3], exact=True, msg="named_buffers")
    return None


# -- the pinned cases -------------------------------------------------------------------------------

_ROWS = (
    (("f0", ((1, 2), (), (3,))), ("f1", ((5,), (), (2, 3))), ("f2", ((0,), (7, 7), ()))),
    (("f0", ((4,), (5, 6), ())), ("f1", ((1,), (4,), ())), ("f2", ((), (1,), (5,)))),
    (("f0", ((7,), (0, 0, 1), (2,))), ("f1", ((3, 3), (4,), ())), ("f2", ((1,), (), (6,)))),
)


def _steps(world_size: int, steps: int = 3) -> tuple[tuple[RankBatch, ...], ...]:
    return tuple(tuple(RankBatch(_ROWS[(rank + step) % len(_ROWS)]) for rank in range(world_size)) for step in range(steps))


def _vbe_steps(world_size: int, steps: int = 3) -> tuple[tuple[RankBatch, ...], ...]:
    def batch(index: int) -> RankBatch:
        ids = (("f0", ((1,), (2, 3))), ("f1", ((4, 5, 6), ())), ("f2", ((), (7, index % 8))))
        return RankBatch(ids, None, (("f0", (1, 0, 1)), ("f1", (0, 0, 1)), ("f2", ((index % 2), 1, 1))))

    return tuple(tuple(batch(rank + step) for rank in range(world_size)) for step in range(steps))


def _uneven_steps(world_size: int, steps: int = 3) -> tuple[tuple[RankBatch, ...], ...]:
    """Rank r's batch has r + 1 rows (the last rank's at most three)."""
    return tuple(tuple(RankBatch(tuple((key, rows[: min(rank + 1, 3)]) for key, rows in _ROWS[(rank + step) % len(_ROWS)]))
                       for rank in range(world_size)) for step in range(steps))


def _tables(width: int = 8, pooling: str = "SUM") -> tuple[TableSpec, ...]:
    return (TableSpec("t0", 10, width, ("f0",), pooling), TableSpec("t1", 8, width, ("f1",), pooling),
            TableSpec("t2", 8, width, ("f2",), pooling))


_PLANNED_TABLES = (TableSpec("t0", 1000, 16, ("f0",)), TableSpec("t1", 500, 16, ("f1",)), TableSpec("t2", 2000, 16, ("f2",)))


def _ebc(world_size: int, plan: dict[str, tuple], seed: int, optimizer: str = "sgd", **kwargs: Any) -> ShardingCase:
    kwargs.setdefault("steps", _steps(world_size))
    return ShardingCase("ebc", world_size, kwargs.pop("tables", _tables()), plan, optimizer=optimizer, seed=seed, **kwargs)


def dmp_cases(world_size: int) -> tuple[DmpCase, ...]:
    """The DMP and collectives cases at ``world_size`` (2 or more: one rank has nothing to communicate)."""
    last = world_size - 1
    mixed = {"t0": ("table_wise", last), "t1": ("column_wise", (0, last)), "t2": ("row_wise",)}
    grid = {"t0": ("grid_shard", (0,)), "t1": ("table_row_wise", 0), "t2": ("table_column_wise", (last, 0))}
    ec = ShardingCase("ec", world_size, _tables(12), {"t0": ("column_wise", (0, last, 0)), "t1": ("row_wise",),
                      "t2": ("column_wise", (last, 0, last))}, need_indices=True, steps=_steps(world_size), seed=41)
    sync = DmpOptions(sync_collectives=True)
    schedule = ({"lr": 0.1}, {"lr": 0.03, "eps": 1e-2}, {"lr": 0.25, "eps": 1e-5})
    qcomm = DmpOptions(qcomm=QComm("fp16", "fp16", backward_loss_scale=128.0))
    moved = {"t0": ("table_wise", 0), "t1": ("column_wise", (last, 0)), "t2": ("table_wise", last)}
    return (
        # The *_sync collectives: pooled (TW/CW), reduce-scatter (RW), TWRW and GRID, variable batch, sequence (EC).
    # SGD wherever a lost gradient division must show (Adagrad is blind to a constant gradient scale).
        DmpCase("sync-collectives", _ebc(world_size, mixed, 31, kernels={"t2": "dense"}), sync),
        DmpCase("sync-collectives", _ebc(world_size, grid, 32, "adagrad"), sync),
        DmpCase("sync-collectives", _ebc(world_size, mixed, 33, steps=_vbe_steps(world_size)), sync),
        DmpCase("sync-collectives", ec, sync),
        # Ranks with different batch sizes on a row-wise table: the sync reduce-scatter-v goes through an
        # all-to-all, where the asynchronous one all-gathers uneven gradients (gloo refuses: a known issue).
        DmpCase("sync-collectives", _ebc(world_size, {"t0": ("row_wise",), "t1": ("table_wise", 0), "t2": ("table_wise", last)}, 40,
                                         steps=_uneven_steps(world_size)), sync),
        # Gradient division off: the gradients of model-parallel tables are summed (SGD sees the scale).
        DmpCase("no-gradient-division", _ebc(world_size, mixed, 34), DmpOptions(gradient_division=False)),
        DmpCase("no-gradient-division", _ebc(world_size, grid, 35), DmpOptions(sync_collectives=True, gradient_division=False)),
        DmpCase("no-gradient-division", dataclasses.replace(ec, seed=42), DmpOptions(sync_collectives=True, gradient_division=False)),
        # A learning-rate and eps schedule on DMP's fused optimizer (several fused optimizers in it).
        DmpCase("hyper-parameter-schedule", _ebc(world_size, {**mixed, "t1": ("table_column_wise", (last, 0))}, 36, "adagrad"),
                DmpOptions(hyper_parameters=schedule)),
        DmpCase("hyper-parameter-schedule", dataclasses.replace(ec, optimizer="rowwise_adagrad", need_indices=False, seed=43),
                DmpOptions(hyper_parameters=schedule)),
        # FP16 codecs on every pooled, reduce-scatter and sequence communication, async and sync.
        DmpCase("qcomm-fp16", _ebc(world_size, {**mixed, "t1": ("table_row_wise", 0)}, 37, "adagrad"), qcomm),
        # Only pooled all-to-alls (TW, CW, TWCW): nothing float32 joins their output, so a decode skipped shows.
        DmpCase("qcomm-fp16", _ebc(world_size, {"t0": ("table_wise", last), "t1": ("column_wise", (0, last)),
                                                "t2": ("table_column_wise", (last, 0))}, 47, "adagrad"),
                dataclasses.replace(qcomm, sync_collectives=True)),
        DmpCase("qcomm-fp16", _ebc(world_size, mixed, 48, steps=_vbe_steps(world_size)), dataclasses.replace(qcomm, sync_collectives=True)),
        DmpCase("qcomm-fp16", dataclasses.replace(ec, seed=44), dataclasses.replace(qcomm, sync_collectives=True)),
        # GRID, TWRW and TWCW through the codecs, synchronous; a BF16 backward (sent as FP16 on CPU: gloo has no BF16).
        DmpCase("qcomm-fp16-bf16", _ebc(world_size, grid, 49, "adagrad"),
                DmpOptions(sync_collectives=True, qcomm=QComm("fp16", "bf16", backward_loss_scale=128.0))),
        # Built on the meta device, DDP wrapped after construction, the dense optimizer over bare_named_parameters.
        DmpCase("meta-init", _ebc(world_size, mixed, 38, "adagrad"), DmpOptions(meta_model=True, init_data_parallel=False,
                dense_from_bare=True), model="ebc-under-dense"),
        # DMP.reshard between steps: tables and their Adagrad state move to other ranks.
        DmpCase("reshard", _ebc(world_size, {"t0": ("table_wise", last), "t1": ("column_wise", (0, last)), "t2": ("table_wise", last)},
                39, "adagrad"), DmpOptions(), model="ebc-under-dense", reshard_to=moved),
        # DMP given no plan (the tutorial's way): its planner's plan, broadcast from rank 0 (the base plan is not used).
        # Tables large enough that the planner mixes table-wise on both ranks with data-parallel.
        DmpCase("dmp-plans", _ebc(world_size, {t.name: ("row_wise",) for t in _tables()}, 50, "adagrad", tables=_PLANNED_TABLES),
                DmpOptions(plan_by_dmp=True),
                model="ebc-under-dense"),
        *_lookup_options(world_size, mixed, ec),
        *_debug_checks(world_size, mixed, grid, ec),
        # torchrec's EmbeddingBagSharder on a plain nn.EmbeddingBag (row-wise: fused and dense kernels).
        DmpCase("embedding-bag", _bag_base(world_size, 45, "fused"), DmpOptions(), model="embedding-bag"),
        DmpCase("embedding-bag", _bag_base(world_size, 46, "dense"), DmpOptions(sync_collectives=True), model="embedding-bag"),
    )


def _lookup_options(world_size: int, mixed: dict[str, tuple], ec: ShardingCase) -> tuple[DmpCase, ...]:
    """How a rank looks its tables up. By default one kernel for its tables of one configuration;
    torchrec's use_one_tbe_per_table: several kernels, their outputs joined (a variable batch there is
    the known issue ebc-variable-batch-mixed-pooling's refusal). An EC whose outputs are selected by
    torch.gather, overridden for its row-wise tables (GATHER_SELECT)."""
    last = world_size - 1
    one_tbe = DmpOptions(one_tbe_per_table=True)
    row_wise = {"t0": ("row_wise",), "t1": ("row_wise",), "t2": ("table_wise", 0)}
    gathered_tw = {"t0": ("column_wise", (0, last, 0)), "t1": ("table_wise", 0), "t2": ("table_wise", last)}
    return (DmpCase("one-tbe-per-table", _ebc(world_size, row_wise, 51, "adagrad"), one_tbe),
            DmpCase("grouped-tables", _ebc(world_size, row_wise, 56, "adagrad"), DmpOptions()),
            DmpCase("one-tbe-per-table", _ebc(world_size, {**mixed, "t0": ("table_wise", 0), "t1": ("table_wise", 0)}, 52), one_tbe),
            DmpCase("one-tbe-per-table", dataclasses.replace(ec, seed=53), one_tbe),
            DmpCase("gather-select", dataclasses.replace(ec, seed=54), DmpOptions(), model="ec-gather-select"),
            DmpCase("gather-select", dataclasses.replace(ec, seed=55, need_indices=False, plan=gathered_tw), DmpOptions(),
                    model="ec-gather-select"))


def _debug_checks(world_size: int, mixed: dict[str, tuple], grid: dict[str, tuple], ec: ShardingCase) -> tuple[DmpCase, ...]:
    """torchrec's debug checks on (collective validation's tags on every splits all-to-all, the overflow
    checks): a variable batch (its strides travel with the splits), TWRW and GRID, an EC, synchronous too."""
    debug = DmpOptions(debug_checks=True)
    return (DmpCase("debug-checks", _ebc(world_size, mixed, 57, steps=_vbe_steps(world_size)), debug),
            DmpCase("debug-checks", _ebc(world_size, grid, 58, "adagrad"), dataclasses.replace(debug, sync_collectives=True)),
            DmpCase("debug-checks", dataclasses.replace(ec, seed=59), debug))


def _bag_base(world_size: int, seed: int, kernel: str) -> ShardingCase:
    table = TableSpec("weight", BAG_ROWS, BAG_WIDTH, ("bag",))
    return ShardingCase("ebc", world_size, (table,), {"weight": ("row_wise",)}, kernel=kernel, weighted=True,
                        steps=bag_batches(world_size, seed), seed=seed)
