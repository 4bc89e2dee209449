"""torchrec's fused-optimizer module, unsharded, in the caller (no ranks): FusedEmbeddingBagCollection
takes a torch optimizer type and its keyword arguments and runs fbgemm's version of it inside
backward; built directly, or by ``fuse_embedding_optimizer`` from an EBC or from a model holding one. It is trained a few steps against the plain EBC with the same weights trained by the
optimizer's reference (torch's SGD and Adagrad, paritykit's row-wise Adagrad written out): the
outputs of every step and the final tables must agree within the norm-wise bound.
(FusedEmbeddingCollection asserts a CUDA or meta device: it does not run on a CPU.)

A bug in how torchrec hands the user's optimizer on (a type mapped to another fbgemm rule, the
learning rate or eps lost on the way) changes the numbers from the first update.
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

    def case_id(self) -> str:
        tables = ", ".join(f"{t.name}[{t.num_embeddings}x{t.embedding_dim} {'/'.join(t.feature_names)}"
                           + f" {t.pooling}]" for t in self.tables)
        made = "" if self.via == "constructor" else f" via={self.via}"
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
    return FusedModuleCase(optimizer, tuple(hypers), tables, steps, draw(st.integers(0, 2**16)), draw(st.sampled_from(VIAS)))


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
    # The fused module starts from fresh weights (documented): the plain module's are loaded into it.
    fused.load_state_dict(plain.state_dict())
    return fused


def _tables_by_name(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {key.split(".")[-2]: value for key, value in module.state_dict().items() if key.endswith(".weight")}


def run_fused_module_case(case: FusedModuleCase) -> dict[str, Any]:
    """ParityError naming the step or table where the fused module and its reference part."""
    plain = build_ebc(case.tables, seed=case.seed)
    fused = _fused_module(case, plain)
    params = {name: weight for name, weight in plain.named_parameters() if name.endswith(".weight")}
    spec = OptimizerSpec(case.optimizer, **dict(case.hypers))
    reference = reference_optimizer(spec, list(params.values()), {id(p): [p.shape[1]] for p in params.values()})
    keys, bound = list(feature_names_of(case.tables)), normwise()
    table_of = {f: t.name for t in case.tables for f in t.feature_names}
    for step, batch in enumerate(case.steps):
        kjt = kjt_from_rows(keys, dict(batch.ids))
        got = fused(kjt).values()
        upstream = torch.randn(got.shape, generator=generator("fused-module-upstream", case.seed, step))
        (got * upstream).sum().backward()  # the fused module updates its tables here
        begin_step(reference)
        expected = plain(kjt).values()
        touch(reference, {id(p): torch.tensor(sorted({v for f, rows in batch.ids if table_of[f] == name.split(".")[-2]
                                                         for row in rows for v in row}), dtype=torch.int64)
                          for name, p in params.items()})
        (expected * upstream).sum().backward()
        reference.step()
        reference.zero_grad()
        _raise_on(bound.differences(got.detach(), expected.detach(), f"step {step} output"), case, f"step {step}'s output")
    fused_tables, plain_tables = _tables_by_name(fused), _tables_by_name(plain)
    for name in sorted(plain_tables):
        _raise_on(bound.differences(fused_tables[name], plain_tables[name].detach(), f"table {name}"), case,
                  f"table {name!r} after {len(case.steps)} steps")
    return {"steps": len(case.steps), "tables": len(case.tables), "plan_shape": f"fused-ebc/{case.optimizer}"}


def _raise_on(found: list, case: FusedModuleCase, what: str) -> None:
    if found:
        from paritykit.compare import format_differences

        raise ParityError(format_differences(found[:3], exact=False,
                                             msg=f"{case.case_id()}: {what} differs from the plain module trained by "
                                                 f"{case.optimizer}'s reference ({normwise().describe()})"))
