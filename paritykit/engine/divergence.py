"""Where a training run first went apart from its reference, as data (``paritykit.errors.Divergence``).

Walked in the order the numbers are made: per step, what each embedding module returned (by key), the
model's output and the loss (forward), then the state after the step where both runs recorded it
(``TrainingRecord.step_states``: the tables after the backward and the optimizer's update); after the
last step, the state, the fused and the dense optimizer state. The first place that differs is the
divergence; every table that differs there names the placement traits they share (``sharding=row_wise``,
``pooling=MEAN``, ...), which is what the gate groups failures by.

A table that first differs after a step moved differently in that step. Against the step the
reference took (``after - before``) the sharded step can be a multiple of it (a gradient or a
learning rate scaled: the two cannot be told apart from the numbers under SGD), reach other rows
(the gradient went elsewhere: backward), or differ otherwise (backward under SGD; under adaptive
optimizers the update and the gradient mix, so it stays "backward or update").
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from paritykit.errors import Divergence

_FIRST_AT = re.compile(r"first at .*?(\[[-\d, ]*\]):")
# A sharded step this close to a multiple of the reference's step is called a multiple of it.
MULTIPLE_RESIDUAL = 1e-3


@dataclass(frozen=True)
class TablePlace:
    """One table of a sharded module: where it sits and how it is sharded."""

    module: str
    table: str
    kind: str  # "ebc", "ec", or a plain "embedding_bag" / "embedding"
    sharding: str
    kernel: str
    pooling: str = ""  # EBC tables only
    shards: tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...] = ()  # (offsets, sizes, rank)
    weighted: bool = False  # the module pools per-id weights

    def placement(self) -> str:
        return f"{self.sharding}{' ' + self.pooling if self.pooling else ''} {self.kernel}"

    def traits(self) -> frozenset[str]:
        base = {f"module={self.kind}", f"sharding={self.sharding}", f"kernel={self.kernel}", f"weighted={self.weighted}"}
        return frozenset(base | ({f"pooling={self.pooling}"} if self.pooling else set()))

    def shard_at(self, index: tuple[int, ...]) -> str:
        """The shard holding element ``index`` of the table: "rows 5-9, columns 0-3 on rank 1"."""
        if self.sharding == "data_parallel":
            return "the replica on every rank"
        for offsets, sizes, rank in self.shards:
            if len(index) == len(offsets) and all(o <= i < o + s for i, o, s in zip(index, offsets, sizes)):
                return (f"rows {offsets[0]}-{offsets[0] + sizes[0] - 1}, columns {offsets[1]}-{offsets[1] + sizes[1] - 1} "
                        f"on rank {rank}")
        return ""


@dataclass
class Placements:
    """The tables of a model's sharded modules, by state key and by output key."""

    by_state_key: dict[str, TablePlace] = field(default_factory=dict)
    by_output_key: dict[tuple[str, str], TablePlace] = field(default_factory=dict)

    @classmethod
    def of(cls, model: torch.nn.Module, sharding_plan: Any) -> "Placements":
        from paritykit.harness.inputs import table_configs
        from paritykit.harness.plan_resolution import embedding_modules, sharder_of

        names = {id(param): name for name, param in model.named_parameters()}
        found = cls()
        for fqn, module in embedding_modules(model).items():
            # A feature-processed EBC is an EBC with its inner EBC's tables.
            kind = "ebc" if hasattr(getattr(module, "_embedding_bag_collection", module), "embedding_bag_configs") else "ec"
            configs = table_configs(module)
            keys_by_table = _output_keys(module, configs)
            for table, param in sharder_of(module).shardable_parameters(module).items():
                sharding = sharding_plan.plan[fqn][table]
                config = next(c for c in configs if c.name == table)
                place = TablePlace(fqn or type(module).__name__, table, kind, sharding.sharding_type, sharding.compute_kernel,
                                   config.pooling.name if kind == "ebc" else "", _shards(sharding),
                                   bool(getattr(module, "is_weighted", lambda: False)()))
                found.by_state_key[names.get(id(param), table)] = place
                for key in keys_by_table.get(table, ()):
                    found.by_output_key[(fqn, key)] = place
        for fqn, module in model.named_modules():  # plain modules DMP shards with its own sharders
            if isinstance(module, (torch.nn.EmbeddingBag, torch.nn.Embedding)) and fqn in sharding_plan.plan:
                found._add_plain(fqn, module, sharding_plan.plan[fqn]["weight"], names)
        return found

    def _add_plain(self, fqn: str, module: torch.nn.Module, sharding: Any, names: dict[int, str]) -> None:
        """A plain nn.EmbeddingBag / nn.Embedding sharded as one table ("weight"); its output is one tensor."""
        bag = isinstance(module, torch.nn.EmbeddingBag)
        place = TablePlace(fqn, "weight", "embedding_bag" if bag else "embedding", sharding.sharding_type,
                           sharding.compute_kernel, module.mode.upper() if bag else "", _shards(sharding))
        self.by_state_key[names.get(id(module.weight), f"{fqn}.weight")] = place
        self.by_output_key[(fqn, "")] = place

    def for_state(self, key: str) -> TablePlace | None:
        return self.by_state_key.get(key.partition("/")[0])

    def for_output(self, module: str, key: str) -> TablePlace | None:
        return self.by_output_key.get((module, key))


def _output_keys(module: torch.nn.Module, configs: list) -> dict[str, list[str]]:
    """Table -> the keys of its outputs: torchrec names a feature that several tables read "feature@table"."""
    by_table = getattr(module, "embedding_names_by_table", None)
    if callable(by_table):
        names = by_table()
    else:
        from torchrec.modules import embedding_modules

        naming = getattr(embedding_modules, "get_embedding_names_by_table", None)
        names = naming(configs) if naming is not None else [list(c.feature_names) for c in configs]
    return {config.name: list(keys) for config, keys in zip(configs, names)}


def _shards(sharding: Any) -> tuple:
    spec = getattr(sharding, "sharding_spec", None)
    if spec is None:
        return ()
    return tuple((tuple(s.shard_offsets), tuple(s.shard_sizes), s.placement.rank() if s.placement else -1) for s in spec.shards)


def element_of(difference: Any) -> tuple[int, ...] | None:
    """The first differing element a difference names ("first at name[1, 2]"), if it names one."""
    match = _FIRST_AT.search(getattr(difference, "detail", ""))
    if not match:
        return None
    inner = match.group(1).strip("[]").strip()
    return tuple(int(part) for part in inner.split(",") if part.strip()) if inner else ()


def common_traits(places: list[TablePlace | None]) -> tuple[str, ...]:
    """The traits every differing table shares (none when a table is unknown)."""
    if not places or any(place is None for place in places):
        return ()
    shared = frozenset.intersection(*(place.traits() for place in places))
    return tuple(sorted(shared))


def step_detail(before: torch.Tensor, actual_after: torch.Tensor, expected_after: torch.Tensor, sgd: bool) -> tuple[str, str]:
    """(stage, what the sharded step did) for a table that first differs after a step."""
    expected_step = (expected_after - before).double()
    actual_step = (actual_after - before).double()
    norm = expected_step.norm().item()
    if norm == 0.0:
        return "backward or update", "the unsharded step leaves the table unchanged; the sharded step moves it"
    scale = (actual_step * expected_step).sum().item() / norm**2
    residual = (actual_step - scale * expected_step).norm().item() / norm
    if residual <= MULTIPLE_RESIDUAL:
        return "backward or update", (f"the sharded step is {scale:.4g} x the unsharded step on every element "
                                      "(a gradient or a learning rate scaled by that factor)")
    if expected_step.dim() == 2:
        moved_a = set(torch.nonzero(actual_step.abs().sum(1)).flatten().tolist())
        moved_e = set(torch.nonzero(expected_step.abs().sum(1)).flatten().tolist())
        if moved_a != moved_e:
            rows = sorted(moved_a ^ moved_e)[:8]
            return "backward", f"the sharded step moves other rows than the unsharded one (rows {rows} differ in whether they move)"
    stage = "backward" if sgd else "backward or update"
    return stage, f"the sharded step is not a multiple of the unsharded one (best factor {scale:.4g}, residual {residual:.2g})"
