"""torchrec's fused-optimizer module, unsharded, in the caller (no ranks): FusedEmbeddingBagCollection
takes a torch optimizer type and its keyword arguments and runs fbgemm's version of it inside
backward; built directly, or by ``fuse_embedding_optimizer`` from an EBC or from a model holding one. It is trained a few steps against the plain EBC with the same weights trained by the
optimizer's reference (torch's SGD and Adagrad, paritykit's row-wise Adagrad written out): the
outputs of every step and the final tables must agree within the norm-wise bound.
(FusedEmbeddingCollection asserts a CUDA or meta device: it does not run on a CPU.)

A bug in how torchrec hands the user's optimizer on (a type mapped to another fbgemm rule, the
learning rate or eps lost on the way) changes the numbers from the first update.

Before the plain module's weights are loaded, the fresh fused module's tables must hold what their
configs ask for: every value within the table's ``weight_init_min``..``weight_init_max`` (drawn away from
zero, or torchrec's documented default +-sqrt(1 / rows)), and not one value throughout. Its fused
optimizer must list every table's weight in its param group under the table's key, as a keyed optimizer's
state dict names them; a learning rate a scheduler sets in that group after the first step must train
the next steps (the reference's group is changed alike).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st

from paritykit.engine.tolerances import normwise
from paritykit.errors import ParityError
from paritykit.harness.configuration import RankBatch
from paritykit.harness.optimizers.oracle import begin_step, reference_optimizer, touch
from paritykit.harness.optimizers.spec import OptimizerSpec
from paritykit.harness.seeding import generator, stable_seed
from paritykit.harness.tables import TableSpec, build_ebc, feature_names_of, kjt_from_rows

VIAS = ("constructor", "fuse_embedding_optimizer", "fuse_embedding_optimizer:nested")
# A table's configured (weight_init_min, weight_init_max): away from zero (fbgemm's own initial values) on
# either side; None is torchrec's default, +-sqrt(1 / rows).
INIT_BOUNDS = (None, (0.5, 0.75), (-2.0, -1.5), (2.0, 3.0))
# What a scheduler multiplies the learning rate by after the first step (1.0: left alone).
LR_FACTORS = (1.0, 0.5, 3.0)
# optimizer name -> the type a user hands the fused module ("module:Class")
OPTIMIZER_TYPES = {"sgd": "torch.optim:SGD", "adagrad": "torch.optim:Adagrad", "rowwise_adagrad": "torchrec.optim:RowWiseAdagrad"}


@dataclass(frozen=True)
class FusedModuleCase:
    optimizer: str
    hypers: tuple[tuple[str, float], ...]  # lr, and eps for the Adagrads
    tables: tuple[TableSpec, ...]
    steps: tuple[RankBatch, ...]  # one batch a step
    seed: int = 0
    # How the fused module is made: constructed, or by fuse_embedding_optimizer from the EBC itself or from
    # a model holding it (which the function rewrites in place).
    via: str = "constructor"
    init_bounds: tuple[tuple[float, float] | None, ...] = ()  # per table; () is every table's default
    lr_factor: float = 1.0
    # Whether the fused optimizer's param groups must list every table (known broken for SGD: the
    # draws leave it out where that entry applies; known_broken.py).
    param_groups_checked: bool = True

    def bounds_of(self) -> dict[str, tuple[float, float]]:
        """table -> the bounds its config is given (the tables left to torchrec's default omitted)."""
        return {t.name: bounds for t, bounds in zip(self.tables, self.init_bounds) if bounds is not None}

    def case_id(self) -> str:
        tables = ", ".join(f"{t.name}[{t.num_embeddings}x{t.embedding_dim} {'/'.join(t.feature_names)}"
                           + f" {t.pooling}]" for t in self.tables)
        made = "" if self.via == "constructor" else f" via={self.via}"
        made += f" init={self.bounds_of()}" if self.bounds_of() else ""
        made += f" lr x{self.lr_factor} after step 0" if self.lr_factor != 1.0 else ""
        made += "" if self.param_groups_checked else " param-groups-unchecked"
        return (f"fused ebc{made} optimizer={self.optimizer}{dict(self.hypers)} steps={len(self.steps)} "
                f"tables=({tables}) seed={self.seed} #{stable_seed(repr(self)) % 16**8:08x}")


@st.composite
def fused_module_cases(draw: Any) -> FusedModuleCase:
    optimizer = draw(st.sampled_from(sorted(OPTIMIZER_TYPES)))
    hypers = [("lr", draw(st.sampled_from((0.01, 0.05, 0.2, 0.5))))]
    if optimizer != "sgd":
        hypers.append(("eps", draw(st.sampled_from((1e-8, 1e-4, 1e-2)))))
    tables = tuple(TableSpec(f"t{i}", draw(st.integers(3, 12)), draw(st.sampled_from((4, 8))),
                             tuple(f"f{i}_{k}" for k in range(draw(st.integers(1, 2)))), draw(st.sampled_from(("SUM", "MEAN"))))
                   for i in range(draw(st.integers(1, 2))))
    steps = tuple(RankBatch(tuple((f, tuple(tuple(draw(st.lists(st.integers(0, t.num_embeddings - 1), max_size=3)))
                                            for _ in range(2)))
                                  for t in tables for f in t.feature_names))
                  for _ in range(3))
    return FusedModuleCase(optimizer, tuple(hypers), tables, steps, draw(st.integers(0, 2**16)), draw(st.sampled_from(VIAS)),
                           tuple(draw(st.sampled_from(INIT_BOUNDS)) for _ in tables), draw(st.sampled_from(LR_FACTORS)))


def _fused_module(case: FusedModuleCase, plain: torch.nn.Module) -> torch.nn.Module:
    import copy
    import importlib

    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection, fuse_embedding_optimizer

    module_name, class_name = OPTIMIZER_TYPES[case.optimizer].split(":")
    optimizer_type = getattr(importlib.import_module(module_name), class_name)
    options = {"optimizer_type": optimizer_type, "optimizer_kwargs": dict(case.hypers), "device": torch.device("cpu")}
    if case.via == "constructor":
        fused = FusedEmbeddingBagCollection(tables=plain.embedding_bag_configs(), **options)
    elif case.via == "fuse_embedding_optimizer":
        fused = fuse_embedding_optimizer(copy.deepcopy(plain), **options)
    else:  # a model holding the EBC one level down, rewritten in place
        model = torch.nn.Module()
        model.arch = torch.nn.Module()
        model.arch.ebc = copy.deepcopy(plain)
        if fuse_embedding_optimizer(model, **options) is not model:
            raise ParityError(f"{case.case_id()}: fuse_embedding_optimizer returned another module than the model it rewrites")
        fused = model.arch.ebc
    if not isinstance(fused, FusedEmbeddingBagCollection):
        raise ParityError(f"{case.case_id()}: {case.via} left a {type(fused).__name__}, not a FusedEmbeddingBagCollection")
    _check_fresh_tables(case, fused)
    if case.param_groups_checked:
        _check_param_groups(case, fused)
    # The fused module starts from fresh weights (documented): the plain module's are loaded into it.
    fused.load_state_dict(plain.state_dict())
    return fused


def _check_fresh_tables(case: FusedModuleCase, fused: torch.nn.Module) -> None:
    """Every table as made: within its configured bounds (the case's, or torchrec's documented default
    +-sqrt(1 / rows), a float32 rounding either side), and not one value throughout."""
    import math

    tables, bounds = _tables_by_name(fused), case.bounds_of()
    for table in case.tables:
        if table.name not in tables:
            raise ParityError(f"{case.case_id()}: the fused module has no table {table.name!r} ({sorted(tables)})")
        low, high = bounds.get(table.name, (-math.sqrt(1 / table.num_embeddings), math.sqrt(1 / table.num_embeddings)))
        low, high = (float(torch.nextafter(torch.tensor(v, dtype=torch.float32), torch.tensor(d, dtype=torch.float32)))
                     for v, d in ((low, -math.inf), (high, math.inf)))
        values = tables[table.name].detach().float()
        seen = (float(values.min()), float(values.max()))
        if seen[0] < low or seen[1] > high or (values.numel() > 1 and seen[0] == seen[1]):
            raise ParityError(f"{case.case_id()}: table {table.name!r} as {case.via} made it holds values in "
                              f"[{seen[0]:.6g}, {seen[1]:.6g}], not drawn uniformly from its configured "
                              f"weight_init_min..max [{low:.6g}, {high:.6g}]")


def _check_param_groups(case: FusedModuleCase, fused: torch.nn.Module) -> None:
    """The fused optimizer's param groups (one a batched kernel) list every table's weight once, under
    the key its state dict gives it (``<table>.weight``), each group with the case's learning rate (as
    fbgemm holds it: float32)."""
    optimizer = fused.fused_optimizer()
    optimizer.save_param_groups(True)
    groups = optimizer.state_dict().get("param_groups", [])
    listed = sorted(key for group in groups for key in group["params"])
    expected = sorted(f"{t.name}.weight" for t in case.tables)
    if listed != expected:
        raise ParityError(f"{case.case_id()}: the fused optimizer's param groups list {listed}, not every table's weight "
                          f"{expected} (a keyed optimizer's state dict names its parameters by key)")
    lr = float(torch.tensor(dict(case.hypers)["lr"], dtype=torch.float32))
    if any(group.get("lr") != lr for group in groups):
        raise ParityError(f"{case.case_id()}: the fused optimizer's param groups hold learning rates "
                          f"{[group.get('lr') for group in groups]}, not the {lr} it was given")


def _tables_by_name(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {key.split(".")[-2]: value for key, value in module.state_dict().items() if key.endswith(".weight")}


def run_fused_module_case(case: FusedModuleCase) -> dict[str, Any]:
    """ParityError naming the step or table where the fused module and its reference part."""
    plain = build_ebc(case.tables, seed=case.seed, init_bounds=case.bounds_of())
    fused = _fused_module(case, plain)
    params = {name: weight for name, weight in plain.named_parameters() if name.endswith(".weight")}
    spec = OptimizerSpec(case.optimizer, **dict(case.hypers))
    reference = reference_optimizer(spec, list(params.values()), {id(p): [p.shape[1]] for p in params.values()})
    keys, bound = list(feature_names_of(case.tables)), normwise()
    table_of = {f: t.name for t in case.tables for f in t.feature_names}
    fused_optimizer = fused.fused_optimizer()
    for step, batch in enumerate(case.steps):
        if step == 1 and case.lr_factor != 1.0:
            # A scheduler's change: it reaches fbgemm when the loop next calls zero_grad (or step).
            for group in list(fused_optimizer.param_groups) + list(reference.param_groups):
                group["lr"] *= case.lr_factor
        fused_optimizer.zero_grad()
        kjt = kjt_from_rows(keys, dict(batch.ids))
        got = fused(kjt).values()
        upstream = torch.randn(got.shape, generator=generator("fused-module-upstream", case.seed, step))
        (got * upstream).sum().backward()  # the fused module updates its tables here
        fused_optimizer.step()
        begin_step(reference)
        expected = plain(kjt).values()
        touch(reference, {id(p): torch.tensor(sorted({v for f, rows in batch.ids if table_of[f] == name.split(".")[-2]
                                                         for row in rows for v in row}), dtype=torch.int64)
                          for name, p in params.items()})
        (expected * upstream).sum().backward()
        reference.step()
        reference.zero_grad()
        raise_on_differences(bound.differences(got.detach(), expected.detach(), f"step {step} output"), case, f"step {step}'s output")
    fused_tables, plain_tables = _tables_by_name(fused), _tables_by_name(plain)
    for name in sorted(plain_tables):
        raise_on_differences(bound.differences(fused_tables[name], plain_tables[name].detach(), f"table {name}"), case,
                             f"table {name!r} after {len(case.steps)} steps")
    return {"steps": len(case.steps), "tables": len(case.tables), "plan_shape": f"fused-ebc/{case.optimizer}"}


def raise_on_differences(found: list, case: Any, what: str) -> None:
    """ParityError showing the first differences of ``what`` from the plain module trained by the case's
    optimizer's reference (a fused case, sharded or not: ``case_id()`` and ``optimizer``)."""
    if found:
        from paritykit.compare import format_differences

        raise ParityError(format_differences(found[:3], exact=False,
                                             msg=f"{case.case_id()}: {what} differs from the plain module trained by "
                                                 f"{case.optimizer}'s reference ({normwise().describe()})"))
