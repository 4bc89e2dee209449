"""Feature-processed EBCs (fp_models.py, both forms of position weights) sharded by DMP with torchrec's
``FeatureProcessedEmbeddingBagCollectionSharder``, against the unsharded FP-EBC:

- ``train``: every sharding type the FP sharder accepts on the device, trained three steps through the
  sharding engine (``paritykit.engine``): pooled outputs, losses, tables and position weights after
  every step (under SGD a step moves each by the learning rate times its gradient, so the gradients are
  compared), the fused optimizer's state; and the sharded state_dict's keys against the unsharded ones.
  ``meta_model``: the same, the model built on the meta device and materialised by DMP, then loaded;
- ``meta-init``: the FP-EBC built on the meta device as a large model is, sharded by DMP: its state_dict
  keys, its position weights (torchrec's documented 1.0, and a freshly built unsharded FP-EBC's) and its
  tables (shapes, within their config's init range) before any load; after loading the unsharded
  state, its pooled outputs; and the unsharded FP-EBC built on meta, materialised with ``to_empty`` and
  loaded, against the one built on the CPU.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from paritykit.checks.sharding.cases import RankBatch, kjt_of
from paritykit.checks.sharding.fp_models import FORMS, RESET_POSITION_WEIGHT, build_fp_ebc, build_wrapped_fp_ebc, init_range
from paritykit.compare import find_differences, format_differences
from paritykit.engine.comparison import compare_records, where_for
from paritykit.engine.dmp_options import DmpOptions
from paritykit.engine.outputs import forward, to_cpu
from paritykit.engine.reference import train_reference
from paritykit.engine.setup import build_setup
from paritykit.engine.tolerances import default_tolerance
from paritykit.engine.training import assemble_records, train_on_rank
from paritykit.errors import HarnessError, ParityError
from paritykit.harness.dmp import canonical_name, load_full_state, state_pieces
from paritykit.harness.plans import describe_plan, normalize_plan_entry, parameter_sharding_generator
from paritykit.harness.seeding import stable_seed
from paritykit.harness.shards import assemble
from paritykit.harness.tables import TableSpec

KINDS = ("train", "meta-init")
TABLES = (TableSpec("t0", 10, 8, ("f0",)), TableSpec("t1", 8, 8, ("f1",)), TableSpec("t2", 8, 8, ("f2",)))
# Bags of up to 3 ids, most of them across the row blocks of two ranks (rows 0-4 | 5-9, 0-3 | 4-7):
# a row-wise shard must weigh each id by its position in the whole bag, not in the part it received.
_ROWS = (
    (("f0", ((1, 8, 2), (), (9,))), ("f1", ((5, 0), (), (2, 7, 3))), ("f2", ((0, 6), (7, 7), ()))),
    (("f0", ((4,), (5, 6, 0), ())), ("f1", ((1,), (4, 6), ())), ("f2", ((), (1, 5, 2), (5,)))),
    (("f0", ((7,), (0, 9, 1), (2,))), ("f1", ((3, 3), (4,), ())), ("f2", ((1,), (), (6, 3)))),
)


@dataclass(frozen=True)
class FpCase:
    kind: str
    form: str
    world_size: int
    plan: dict[str, tuple] = field(hash=False)
    seed: int = 0
    optimizer: str = "sgd"
    meta_model: bool = False
    # The FP-EBC itself is the model DMP wraps (a known issue), not held in a module.
    root: bool = False

    def describe(self) -> str:
        meta = (" meta_model" if self.meta_model else "") + (" root" if self.root else "")
        return (f"fp {self.kind} [{self.form}{meta}] world_size={self.world_size} optimizer={self.optimizer}/sgd "
                f"plan={describe_plan(self.plan)} seed={self.seed}")

    def case_id(self) -> str:
        return f"{self.describe()} #{stable_seed(repr(self), repr(self.plan)) % 16**8:08x}"

    def model_fn(self, seeded: bool = True):
        return functools.partial(build_fp_ebc if self.root else build_wrapped_fp_ebc, TABLES, self.form, self.seed, seeded=seeded)


def fp_plan(case: FpCase) -> dict[str, Any]:
    """torchrec's generators; the FP sharder's kernel for each type (fused; data-parallel is dense)."""
    return {t: parameter_sharding_generator(normalize_plan_entry(t, e), None if e[0] == "data_parallel" else "fused")
            for t, e in case.plan.items()}


def fp_setup(case: FpCase, device: str = "cpu"):
    if case.kind not in KINDS or case.form not in FORMS:
        raise HarnessError(f"FP case: kind {case.kind!r} must be one of {KINDS}, form {case.form!r} one of {FORMS}")
    batches = [[kjt_of(RankBatch(_ROWS[(rank + step) % len(_ROWS)]), False) for rank in range(case.world_size)]
               for step in range(3)]
    setup = build_setup(case.model_fn(), fp_plan(case), batches, embedding_optimizer=case.optimizer, dense_optimizer="sgd",
                        seed=case.seed, device=device)
    return dataclasses.replace(setup, options=DmpOptions(meta_model=case.meta_model), probes=(state_dict_keys,))


def state_dict_keys(dmp: torch.nn.Module) -> list[str]:
    """A probe: the sharded model's state_dict keys, by their unsharded names."""
    return sorted(canonical_name(key) for key in dmp.state_dict())


def keys_problem(expected: list[str], per_rank: list[list[str]]) -> str | None:
    for rank, keys in enumerate(per_rank):
        if keys != expected:
            return (f"rank {rank}: the sharded FP-EBC's state_dict keys are not the unsharded one's: missing "
                    f"{sorted(set(expected) - set(keys))}, extra {sorted(set(keys) - set(expected))}")
    return None


def run_fp_case(case: FpCase, pool: Any) -> dict[str, Any]:
    """ParityError naming step, rank, feature or state key and element; else what was compared."""
    if pool.world_size != case.world_size:
        raise HarnessError(f"case needs world size {case.world_size}, the pool has {pool.world_size}")
    if case.kind == "meta-init":
        return run_meta_init_case(case, pool)
    setup = fp_setup(case, pool.device)
    reference = train_reference(setup)
    record = assemble_records(pool.call(train_on_rank, (setup,), case=case.case_id()))
    problem = keys_problem(sorted(setup.full_state), [probes[0] for probes in record.probes])
    if problem:
        raise ParityError(f"{case.describe()}\n  {problem}")
    positions = [key for key in reference.state if "_feature_processors" in key]
    if not positions:
        raise HarnessError(f"{case.describe()}: the unsharded FP-EBC has no position weights to compare")
    metrics = compare_records(record, reference, default_tolerance(), case.describe(), where=where_for(setup))
    return {**metrics, "position_weights": len(positions), "plan_shape": plan_shape(case)}


def plan_shape(case: FpCase) -> str:
    kinds = "+".join(sorted(entry[0] for entry in case.plan.values()))
    return f"fp/{case.kind}/{case.form}/ws{case.world_size}/{kinds}"


# -- meta-device construction ---------------------------------------------------------------------


@dataclass(frozen=True)
class MetaJob:
    """What a rank needs to build the FP-EBC on meta, shard it, load the state and run one batch."""

    tables: tuple[TableSpec, ...]
    form: str
    seed: int
    sharding_plan: Any = field(hash=False)
    full_state: dict[str, torch.Tensor] = field(hash=False)
    batches: list[Any] = field(hash=False)  # one per rank
    device: str = "cpu"


def meta_init_on_rank(job: MetaJob) -> dict[str, Any]:
    """On every rank: the FP-EBC built on meta, sharded by DMP (init_parameters, init_data_parallel);
    its state as DMP initialised it, then its pooled output once the unsharded state is loaded."""
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import get_default_sharders
    from torchrec.distributed.types import ShardingEnv

    from paritykit.harness.devices import rank_device

    device = rank_device(job.device)
    model = build_wrapped_fp_ebc(job.tables, job.form, job.seed, device="meta", seeded=False)
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=device,
                                   plan=job.sharding_plan, sharders=get_default_sharders())
    initial = state_pieces(dmp)
    keys = state_dict_keys(dmp)
    load_full_state(dmp, {key: value.to(device) for key, value in job.full_state.items()})
    pooled = to_cpu(forward(dmp, job.batches[dist.get_rank()].to(device)))
    return {"keys": keys, "initial": initial, "pooled": pooled}


def run_meta_init_case(case: FpCase, pool: Any) -> dict[str, Any]:
    setup = fp_setup(case, pool.device)
    unsharded = setup.model_fn()
    fresh = case.model_fn(seeded=False)().state_dict()
    job = MetaJob(TABLES, case.form, case.seed, setup.sharding_plan, setup.full_state, setup.batches[0], pool.device)
    per_rank = pool.call(meta_init_on_rank, (job,), case=case.case_id())
    initial = assemble([record["initial"] for record in per_rank], "the FP-EBC's state as DMP initialised it")
    problems = [keys_problem(sorted(fresh), [record["keys"] for record in per_rank])]
    problems += initial_problems(initial, fresh)
    bound = default_tolerance().outputs
    for rank, record in enumerate(per_rank):
        expected = {key: value.detach() for key, value in unsharded(setup.batches[0][rank]).items()}
        found = bound.differences(record["pooled"], expected, f"rank {rank} pooled")
        problems += [format_differences(found[:3], msg=f"rank {rank}: pooled output after loading the unsharded state "
                                                         f"({bound.describe()})")] if found else []
    problems += [materialised_problem(case, setup)]
    shown = [p for p in problems if p]
    if shown:
        raise ParityError(f"{case.describe()}: the FP-EBC built on meta and sharded is not the unsharded one\n  "
                          + "\n  ".join(shown))
    return {"state_tensors": len(initial), "ranks": case.world_size, "plan_shape": plan_shape(case)}


def initial_problems(initial: dict[str, torch.Tensor], fresh: dict[str, torch.Tensor]) -> list[str]:
    """Position weights: 1.0 (torchrec's reset) and the fresh unsharded module's, exactly. Tables: the
    fresh module's shapes, every element finite and in the table's init range (their draws differ)."""
    problems = []
    ranges = init_range(TABLES)
    for key, expected in fresh.items():
        got = initial.get(key)
        if got is None or got.shape != expected.shape:
            problems.append(f"{key}: DMP initialised {None if got is None else tuple(got.shape)}, unsharded {tuple(expected.shape)}")
        elif "_feature_processors" in key:
            found = find_differences(got, torch.full_like(expected, RESET_POSITION_WEIGHT), exact=True, name=key)
            found += find_differences(got, expected, exact=True, name=f"{key} (fresh unsharded)")
            problems += [format_differences(found[:2], exact=True, msg=f"position weights after DMP's init are not "
                                                                          f"{RESET_POSITION_WEIGHT}")] if found else []
        else:
            low, high = next(r for name, r in ranges.items() if f".{name}." in f".{key}.")
            if not (torch.isfinite(got).all() and got.min() >= low and got.max() <= high):
                problems.append(f"{key}: DMP's initial table leaves [{low:.4g}, {high:.4g}] (min {got.min():.4g}, max {got.max():.4g})")
    return problems


def materialised_problem(case: FpCase, setup: Any) -> str | None:
    """The unsharded FP-EBC built on meta, ``to_empty`` on the CPU and loaded with the state (a user's
    checkpoint restore), pools every rank's batch exactly as the one built on the CPU with that state."""
    model = build_wrapped_fp_ebc(TABLES, case.form, case.seed, device="meta", seeded=False)
    model.to_empty(device="cpu")
    model.load_state_dict(setup.full_state)
    built = setup.model_fn()
    for rank, batch in enumerate(setup.batches[0]):
        try:
            got = {key: value.detach() for key, value in model(batch).items()}
        except Exception as exc:  # noqa: BLE001 - torchrec's forward of a restored model failing is the finding
            return f"the unsharded FP-EBC built on meta, to_empty and loaded raised {type(exc).__name__}: {exc}"
        found = find_differences(got, {key: value.detach() for key, value in built(batch).items()}, exact=True,
                                 name=f"rank {rank} batch")
        if found:
            return format_differences(found[:3], exact=True, msg="the unsharded FP-EBC built on meta, to_empty and loaded "
                                                                 "pools otherwise than the one built on the CPU")
    return None


# -- the pinned cases -----------------------------------------------------------------------------


def fp_plans(world_size: int) -> tuple[dict[str, tuple], ...]:
    """Three plans that together hold every sharding type the FP sharder accepts on the CPU."""
    last = world_size - 1
    return ({"t0": ("table_wise", last), "t1": ("column_wise", (0, last)), "t2": ("row_wise",)},
            {"t0": ("data_parallel",), "t1": ("table_column_wise", (last, 0)), "t2": ("table_row_wise", 0)},
            {"t0": ("grid_shard", (0,)), "t1": ("row_wise",), "t2": ("table_wise", 0)})


def fp_cases(world_size: int, seed: int = 0) -> tuple[FpCase, ...]:
    """Both forms on every plan (Adagrad on the grid plan: a fused optimizer with state), the meta-built
    model trained, and the meta-device construction on its own; the gate's ``seed`` draws other tables
    and position weights."""
    plans, base = fp_plans(world_size), 1000 * seed
    cases = [FpCase("train", form, world_size, plan, seed=base + 60 + 3 * i + j, optimizer="adagrad" if i == 2 else "sgd")
             for i, plan in enumerate(plans) for j, form in enumerate(FORMS)]
    cases += [FpCase("train", form, world_size, plans[1], seed=base + 70 + j, meta_model=True) for j, form in enumerate(FORMS)]
    cases += [FpCase("meta-init", form, world_size, plans[0], seed=base + 80 + j) for j, form in enumerate(FORMS)]
    return tuple(cases)
