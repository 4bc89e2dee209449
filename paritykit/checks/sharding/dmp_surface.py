"""The sharded model's state surface against the unsharded module's (the oracle: the module before
sharding, its names and its seeded weights):

- ``DMP.named_parameters()``, ``bare_named_parameters()``, ``named_buffers(remove_duplicate=False)`` and
  ``state_dict()`` keys: the unsharded module's names, each once (DMP strips its and DDP's wrappers);
- ``state_dict()`` saved and loaded into a freshly sharded model holding other weights: every table
  and dense tensor gathered from the fresh model's shards equals the unsharded weights bit for bit,
  on plans where a rank holds no shard of a table (table-wise on the last rank) and a rank holds two
  shards of one table (column-wise ``[0, W-1, 0]``);
- ``DMP.load_state_dict(..., strict=False)`` with a key missing and one unexpected: no error, as the
  unsharded module; with the default (strict) it must raise as the unsharded module does, which
  torchrec does not do for keys outside its sharded modules (the known issue
  ``dmp-load-state-dict-not-strict``, run by ``strict_problem`` in a known-broken case);
- the printout (``print(model)``, as the tutorial does): it must not raise, must name each of the
  unsharded module's submodules, and each sharded module's lookups (its documented extra_repr);
- with ``output_dtensor`` (torchrec's ShardingEnv option), EBC and EC: the state dict's tables are
  DTensors whose local shards put together equal the unsharded weights, and the round trip above;
  every DTensor of the model's and the fused optimizer's state holds a local tensor
  (``LocalShardsWrapper``) exactly as large as its local shards together (row-wise optimizer state
  of two column shards on one rank included), and every rank's DTensor of a table, on a rank holding
  none of it too, has the unsharded weight's global shape and contiguous stride.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from paritykit.checks.sharding.case_runner import case_setup
from paritykit.checks.sharding.cases import ShardingCase
from paritykit.checks.sharding.dmp_models import DENSE_OUT, EbcUnderDense
from paritykit.compare import find_differences, format_differences
from paritykit.engine.setup import build_setup
from paritykit.engine.training import TrainingSetup, build_model
from paritykit.errors import HarnessError, ParityError
from paritykit.harness.shards import Piece, assemble, detached, local_pieces

MISSING, UNEXPECTED = "missing", "unexpected"


class _Scale(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("factor", torch.linspace(0.5, 1.5, DENSE_OUT))


class EbcUnderNestedDense(EbcUnderDense):
    """EbcUnderDense with a buffer two plain modules down (``head.0.factor``, as a norm layer's running
    statistics in a dense tower): DMP must list it once, under its name."""

    def __init__(self, tables: Any, seed: int) -> None:
        super().__init__(tables, seed)
        self.head = torch.nn.Sequential(_Scale())

    def forward(self, kjt):
        out = super().forward(kjt)
        return {**out, "dense": out["dense"] * self.head[0].factor}


def build_ebc_under_nested_dense(tables: Any, seed: int) -> torch.nn.Module:
    return EbcUnderNestedDense(tables, seed)


@dataclass(frozen=True)
class SurfaceCase:
    """``base`` gives the tables, plan and seed; ``model`` is "ebc-under-dense" (the base's EBC under a
    dense layer, buffers beside it and two modules down: EbcUnderNestedDense) or "module" (the base's own EBC/EC)."""

    base: ShardingCase
    model: str = "ebc-under-dense"
    output_dtensor: bool = False

    def describe(self) -> str:
        return f"dmp state-surface [{self.model}{'; output_dtensor' if self.output_dtensor else ''}] {self.base.describe()}"

    def case_id(self) -> str:
        from paritykit.harness.seeding import stable_seed

        return f"{self.describe()} #{stable_seed(repr(self)) % 16**8:08x}"


def surface_setup(case: SurfaceCase, device: str = "cpu") -> TrainingSetup:
    import functools

    from paritykit.checks.sharding.cases import batches_of, torchrec_plan

    base = case.base
    if case.model == "module":
        return case_setup(base, device)
    if case.model != "ebc-under-dense" or base.module != "ebc":
        raise HarnessError(f"state-surface case: model {case.model!r} on {base.module!r} is not one this case builds")
    return build_setup(functools.partial(build_ebc_under_nested_dense, base.tables, base.seed), torchrec_plan(base), batches_of(base),
                       embedding_optimizer=base.optimizer, dense_optimizer=base.dense_optimizer, seed=base.seed, device=device)


def sharded(setup: TrainingSetup, output_dtensor: bool, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The model in DMP (``output_dtensor`` as asked), its state loaded from ``weights`` by DMP's own
    load_state_dict from plain tensors (torchrec cuts each table at its shards' offsets)."""
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import get_default_sharders
    from torchrec.distributed.types import ShardingEnv

    env = ShardingEnv(dist.get_world_size(), dist.get_rank(), dist.group.WORLD, output_dtensor=output_dtensor)
    dmp = DistributedModelParallel(build_model(setup), env=env, device=torch.device("cpu"), plan=setup.sharding_plan,
                                   sharders=get_default_sharders())
    dmp.load_state_dict({key: value.clone() for key, value in weights.items()})
    return dmp


def pieces_of(state: dict[str, Any]) -> list[Piece]:
    """This rank's pieces of a state dict whose tables are ShardedTensors or DTensors (torchrec's
    LocalShardsWrapper: local shards at their global offsets)."""
    pieces, rest = [], {}
    for key, value in state.items():
        if type(value).__name__ == "DTensor":
            local = value.to_local()
            shards, offsets = (local.local_shards(), local.local_offsets()) if hasattr(local, "local_shards") else ([local], [None])
            for shard, offset in zip(shards, offsets):
                if offset is None:
                    raise HarnessError(f"{key!r}: a DTensor whose local tensor carries no offsets")
                pieces.append(Piece(key, tuple(value.size()), tuple(offset), shard))
        else:
            rest[key] = value
    return detached(pieces + local_pieces(rest))


def surface_on_rank(setup: TrainingSetup, output_dtensor: bool) -> dict[str, Any]:
    """Runs on every rank: the names, the state's pieces and its kinds, a state_dict round trip into a
    model sharded with other weights, and what load_state_dict(strict=False) does with bad keys."""
    dmp = sharded(setup, output_dtensor, setup.full_state)
    saved = dmp.state_dict()
    other = {key: torch.full_like(value, -7.0) for key, value in setup.full_state.items()}
    fresh = sharded(setup, output_dtensor, other)
    # DMP.load_state_dict renames the keys of the dict it is given (it adds DDP's prefix in place): a copy.
    fresh.load_state_dict(dict(saved))
    return {
        "parameters": [name for name, _ in dmp.named_parameters()],
        # What a dense optimizer is built over (dmp_cases.py): every parameter once, by default into submodules.
        **({"bare parameters": [name for name, _ in dmp.bare_named_parameters()]} if hasattr(dmp, "bare_named_parameters") else {}),
        "buffers": [name for name, _ in dmp.named_buffers(remove_duplicate=False)],
        "keys": list(saved),
        "kinds": sorted({type(value).__name__ for value in saved.values()}),
        "pieces": pieces_of(saved),
        "reloaded": pieces_of(fresh.state_dict()),
        "missing_key": missing_key(saved),
        "loose": {bad: _load_outcome(fresh, state, False) for bad, state in spoiled_states(saved, missing_key(saved)).items()},
        "strict": {bad: _load_outcome(fresh, state, None) for bad, state in spoiled_states(saved, missing_key(saved)).items()},
        "printout": printout_of(dmp),
        "wrappers": wrapper_sizes(saved) + wrapper_sizes(dmp.fused_optimizer.state_dict()["state"], "optimizer "),
        "geometry": [(key, tuple(value.size()), tuple(value.stride())) for key, value in saved.items()
                     if type(value).__name__ == "DTensor"],
    }


def wrapper_sizes(state: Any, prefix: str = "") -> list[tuple[str, tuple[int, ...], list[tuple[int, ...]]]]:
    """(key, the DTensor's local tensor's shape, its local shards' shapes) of every DTensor in a
    nested state dict whose local tensor holds shards."""
    found = []
    for key, value in state.items():
        if isinstance(value, dict):
            found += wrapper_sizes(value, f"{prefix}{key}/")
        elif type(value).__name__ == "DTensor" and hasattr(value.to_local(), "local_shards"):
            local = value.to_local()
            found.append((f"{prefix}{key}", tuple(local.shape), [tuple(shard.shape) for shard in local.local_shards()]))
    return found


def geometry_problems(setup: TrainingSetup, per_rank: list[dict[str, Any]]) -> list[str]:
    """Every rank's DTensor of a table, a rank holding no shard of it included, has the unsharded
    weight's global shape and its contiguous stride."""
    problems = []
    for rank, record in enumerate(per_rank):
        for key, size, stride in record["geometry"]:
            weight = setup.full_state.get(key)
            if weight is None:
                problems.append(f"rank {rank}: the DTensor {key!r} is no tensor of the unsharded module")
            elif (size, stride) != (tuple(weight.shape), weight.contiguous().stride()):
                problems.append(f"rank {rank}: the DTensor {key!r} has global shape {size} and stride {stride}, the unsharded "
                                f"weight {tuple(weight.shape)} and {weight.contiguous().stride()}")
    return problems


def wrapper_problems(per_rank: list[dict[str, Any]]) -> list[str]:
    """A local tensor must be as large as its shards together (whichever dimension they are stacked on)."""
    problems = []
    for rank, record in enumerate(per_rank):
        for key, shape, shards in record["wrappers"]:
            held = sum(math.prod(s) for s in shards)
            if math.prod(shape) != held or any(len(s) != len(shape) for s in shards):
                problems.append(f"rank {rank}: {key!r}: the DTensor's local tensor has shape {shape}, its local shards "
                                f"{shards} ({held} elements)")
    return problems


def printout_of(dmp: torch.nn.Module) -> dict[str, Any]:
    """``repr(dmp)`` (or the error it raised) and the class names of its sharded modules' lookups."""
    lookups = [type(lookup).__name__ for module in dmp.modules() for lookup in getattr(module, "_lookups", None) or []]
    try:
        return {"text": repr(dmp), "lookups": lookups}
    except Exception as error:  # noqa: BLE001 - printing a model must not raise: the finding is the error
        return {"error": f"{type(error).__name__}: {error}", "lookups": lookups}


def printout_problems(setup: TrainingSetup, per_rank: list[dict[str, Any]]) -> list[str]:
    """What the sharded model's printout leaves out: a submodule of the unsharded module (by its name)
    or a lookup of a sharded module; or the error printing raised."""
    names = sorted({name.rsplit(".", 1)[-1] for name, _ in setup.model_fn().named_modules() if name})
    problems = []
    for rank, record in enumerate(per_rank):
        printout = record["printout"]
        if "error" in printout:
            problems.append(f"rank {rank}: repr(DMP) raised {printout['error']}")
            continue
        absent = [name for name in names if f"({name}): " not in printout["text"]]
        absent += [f"lookup {cls}" for cls in sorted(set(printout["lookups"])) if cls not in printout["text"]]
        if absent:
            problems.append(f"rank {rank}: repr(DMP) never names {absent[:4]}")
    return problems


def missing_key(state: dict[str, Any]) -> str | None:
    """The key left out: one outside the sharded modules (a dense parameter or buffer), where there is one."""
    plain = dense_keys(state)
    return plain[-1] if plain else None


def spoiled_states(state: dict[str, Any], missing: str | None) -> dict[str, dict[str, Any]]:
    """``state`` with the key ``missing`` left out (where given) and with one unexpected key."""
    spoiled = {UNEXPECTED: {**state, "paritykit_unexpected.weight": torch.zeros(1)}}
    if missing is not None:
        spoiled[MISSING] = {key: value for key, value in state.items() if key != missing}
    return spoiled


def dense_keys(state: dict[str, Any]) -> list[str]:
    """The keys outside the sharded modules (dense parameters and buffers: plain tensors)."""
    return [key for key, value in state.items() if type(value).__name__ in ("Tensor", "Parameter")]


def _load_outcome(dmp: torch.nn.Module, state: dict[str, Any], strict: bool | None) -> str:
    try:
        dmp.load_state_dict(state) if strict is None else dmp.load_state_dict(state, strict=strict)
    except Exception as error:  # what the unsharded module does is raise: record, compare in the caller
        return f"raised {type(error).__name__}"
    return "loaded"


def unsharded_outcomes(setup: TrainingSetup, strict: bool, missing: str | None) -> dict[str, str]:
    """What the unsharded module does with the same key left out (by its canonical name) or added."""
    from paritykit.harness.dmp import canonical_name

    model = setup.model_fn()
    spoiled = spoiled_states(dict(model.state_dict()), None if missing is None else canonical_name(missing))
    return {bad: _load_outcome(model, state, strict) for bad, state in spoiled.items()}


def run_surface_case(case: SurfaceCase, pool: Any) -> dict[str, Any]:
    """ParityError naming the rank, the name or the tensor element at fault; else what was compared."""
    setup = surface_setup(case, pool.device)
    per_rank = pool.call(surface_on_rank, (setup, case.output_dtensor), case=case.case_id())
    problems = (names_problems(setup, per_rank) + state_problems(case, setup, per_rank) + printout_problems(setup, per_rank)
                + wrapper_problems(per_rank) + geometry_problems(setup, per_rank))
    expected_loose = unsharded_outcomes(setup, False, per_rank[0]["missing_key"])
    problems += [f"rank {rank}: load_state_dict(strict=False) {record['loose']} where the unsharded module {expected_loose}"
                 for rank, record in enumerate(per_rank) if record["loose"] != expected_loose]
    if problems:
        raise ParityError(f"{case.describe()}\n  " + "\n  ".join(problems[:4]))
    return {"ranks": len(per_rank), "state_tensors": len(setup.full_state), "plan_shape": "dmp/state-surface"}


def names_problems(setup: TrainingSetup, per_rank: list[dict[str, Any]]) -> list[str]:
    from paritykit.harness.dmp import canonical_name

    model = setup.model_fn()
    expected = {"parameters": [n for n, _ in model.named_parameters()], "bare parameters": [n for n, _ in model.named_parameters()],
                "buffers": [n for n, _ in model.named_buffers(remove_duplicate=False)], "keys": list(model.state_dict())}
    problems = []
    for rank, record in enumerate(per_rank):
        for what, names in expected.items():
            if what not in record:  # a stack without the method
                continue
            found = [canonical_name(name) for name in record[what]]
            if sorted(found) != sorted(names):
                extra, lacking = sorted(set(found) - set(names)), sorted(set(names) - set(found))
                twice = sorted({name for name in found if found.count(name) > 1})
                problems.append(f"rank {rank}: DMP's {what} are not the unsharded module's: extra {extra[:4]}, "
                                f"missing {lacking[:4]}, listed twice {twice[:4]}")
    return problems


def state_problems(case: SurfaceCase, setup: TrainingSetup, per_rank: list[dict[str, Any]]) -> list[str]:
    problems = []
    for rank, record in enumerate(per_rank):
        if case.output_dtensor and "DTensor" not in record["kinds"]:
            problems.append(f"rank {rank}: output_dtensor asked, the state dict holds {record['kinds']}, no DTensor")
    for what in ("pieces", "reloaded"):
        full = assemble([record[what] for record in per_rank], f"state_dict ({what})")
        found = find_differences(full, dict(setup.full_state), exact=True, name=what)
        if found:
            label = "the sharded model's state_dict" if what == "pieces" else "the state_dict loaded into a fresh sharded model"
            problems.append(f"{label} is not the unsharded weights:\n" + format_differences(found[:3], exact=True, msg=what))
    return problems


def strict_problem(case: SurfaceCase, pool: Any) -> dict[str, Any]:
    """The known-broken body: DMP.load_state_dict with its default (strict) against the unsharded module's."""
    setup = surface_setup(case, pool.device)
    per_rank = pool.call(surface_on_rank, (setup, case.output_dtensor), case=case.case_id())
    expected = unsharded_outcomes(setup, True, per_rank[0]["missing_key"])
    for rank, record in enumerate(per_rank):
        if record["strict"] != expected:
            raise ParityError(f"{case.describe()}\n  rank {rank}: DMP.load_state_dict(state) with a key outside the sharded "
                              f"modules {MISSING}/{UNEXPECTED}: {record['strict']}; the unsharded module: {expected}")
    return {"ranks": len(per_rank)}


def surface_cases(world_size: int) -> tuple[SurfaceCase, ...]:
    from paritykit.checks.sharding.dmp_cases import _ebc, _steps, _tables

    last = world_size - 1
    # Rank 0 holds no shard of t0 and two of t1; t2 is cut by rows over every rank.
    plan = {"t0": ("table_wise", last), "t1": ("column_wise", (0, last, 0)), "t2": ("row_wise",)}
    ebc = _ebc(world_size, plan, 70, "adagrad", tables=_tables(12))
    ec = ShardingCase("ec", world_size, _tables(12), plan, need_indices=True, seed=71, steps=_steps(world_size, 1))
    # Dense kernels (one TBE per sharding type holding every table's slices as parameters): rank 0's
    # column-wise TBE holds t1's two shards, then t2's, so t2's parameter comes after a table seen twice.
    dense_plan = {"t0": ("table_wise", last), "t1": ("column_wise", (0, last, 0)), "t2": ("column_wise", (0, last))}
    dense = _ebc(world_size, dense_plan, 72, "sgd", tables=_tables(12), kernel="dense")
    # Row-wise Adagrad: one accumulator row per table row and column shard, 1-D, so rank 0's state of
    # t1 is two 1-D shards in one local tensor.
    rowwise = _ebc(world_size, plan, 73, "rowwise_adagrad", tables=_tables(12))
    return (SurfaceCase(ebc), SurfaceCase(ebc, output_dtensor=True), SurfaceCase(ec, model="module", output_dtensor=True),
            SurfaceCase(dense), SurfaceCase(rowwise, output_dtensor=True))
