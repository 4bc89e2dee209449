"""The embedding towers a tower case shards: what a case is, the model it builds and the batches it feeds.

An ``EmbeddingTowerCollection`` of towers, each an ``EmbeddingBagCollection`` of one-feature tables (sum
pooling; weighted or not) followed by a linear interaction on its pooled embeddings. Every tower's tables
live on one host (torchrec's tower sharder places a tower on the host its tables' ranks are on):
table-row-wise (row shards over the host's ranks) or table-column-wise (column shards on ranks of the
host, in any order, repeats included). The same seed builds the same weights in the caller and on every
rank; each rank feeds its own batch a step, its features in a drawn key order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from paritykit.errors import HarnessError
from paritykit.harness.seeding import generator

PLACEMENTS = ("table_row_wise", "table_column_wise")
COLUMN_WIDTH = 4  # the fused kernel's column shards are multiples of 4 wide
MAX_IDS_PER_SAMPLE = 3


@dataclass(frozen=True)
class TowerShape:
    """One tower: ``rows`` of each of its tables (a feature each), its embedding ``dim``, the interaction's
    output ``width``, where it lives (``host``; TWCW: ``columns``, the local ranks of that host holding
    each column shard in order) and whether its EBC is weighted."""

    rows: tuple[int, ...]
    width: int
    placement: str
    host: int
    columns: tuple[int, ...] = ()
    weighted: bool = False

    @property
    def dim(self) -> int:
        return COLUMN_WIDTH * max(1, len(self.columns))

    def describe(self) -> str:
        where = f"host{self.host}" + (f" columns={list(self.columns)}" if self.columns else "")
        return f"{'w' if self.weighted else ''}{list(self.rows)}x{self.dim}->{self.width} {self.placement}@{where}"


@dataclass(frozen=True)
class TowerCase:
    """``towers`` sharded on ``hosts`` x ``ranks_per_host`` ranks, trained ``steps`` steps of SGD at
    ``learning_rate`` on batches of ``batch_size`` samples a rank; ``key_order``: the order of the
    features in every batch (a permutation of their indexes)."""

    hosts: int
    ranks_per_host: int
    towers: tuple[TowerShape, ...]
    batch_size: int
    steps: int
    key_order: tuple[int, ...]
    seed: int = 0
    learning_rate: float = 0.1
    single: bool = False  # the one tower's EmbeddingTower itself (EmbeddingTowerSharder), not a collection

    def __post_init__(self) -> None:
        for index, tower in enumerate(self.towers):
            if tower.placement not in PLACEMENTS:
                raise HarnessError(f"tower {index}: placement {tower.placement!r}, the tower sharder offers {PLACEMENTS}")
            if not 0 <= tower.host < self.hosts:
                raise HarnessError(f"tower {index}: host {tower.host} outside the case's {self.hosts} host(s)")
            if (tower.placement == "table_column_wise") != bool(tower.columns):
                raise HarnessError(f"tower {index}: column ranks {list(tower.columns)} with placement {tower.placement}")
            if any(not 0 <= r < self.ranks_per_host for r in tower.columns):
                raise HarnessError(f"tower {index}: column ranks {list(tower.columns)} outside the host's {self.ranks_per_host}")
            if tower.placement == "table_row_wise" and min(tower.rows) < self.ranks_per_host:
                raise HarnessError(f"tower {index}: a table of {min(tower.rows)} rows leaves one of the host's "
                                   f"{self.ranks_per_host} ranks no rows (a known torchrec refusal on CPU)")
        if self.single and len(self.towers) != 1:
            raise HarnessError(f"a single EmbeddingTower case has one tower, not {len(self.towers)}")
        if sorted(self.key_order) != list(range(len(self.features()))):
            raise HarnessError(f"key order {list(self.key_order)} is not a permutation of the {len(self.features())} features")

    @property
    def world_size(self) -> int:
        return self.hosts * self.ranks_per_host

    def features(self) -> list[tuple[int, int]]:
        """(tower, table) of every feature, towers in order."""
        return [(t, i) for t, tower in enumerate(self.towers) for i in range(len(tower.rows))]

    def hosts_in_order(self) -> bool:
        """Whether the towers' hosts never decrease along the collection's order."""
        hosts = [tower.host for tower in self.towers]
        return hosts == sorted(hosts)

    def case_id(self) -> str:
        towers = " ".join(tower.describe() for tower in self.towers)
        return (f"{'tower' if self.single else 'towers'} {self.hosts}x{self.ranks_per_host} [{towers}] batch={self.batch_size} steps={self.steps} "
                f"keys={list(self.key_order)} seed={self.seed}")


def table_name(tower: int, table: int) -> str:
    return f"t{tower}_{table}"


def feature_name(tower: int, table: int) -> str:
    return f"f{tower}_{table}"


class LinearInteraction(torch.nn.Module):
    """A tower's interaction: a linear layer on the tower's pooled embeddings (a KeyedTensor)."""

    def __init__(self, inputs: int, outputs: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(inputs, outputs)

    def forward(self, pooled: Any) -> torch.Tensor:
        return self.linear(pooled.values())


def build_collection(case: TowerCase) -> torch.nn.Module:
    """The unsharded EmbeddingTowerCollection, its weights drawn from the case's seed (identical everywhere)."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.modules.embedding_tower import EmbeddingTower, EmbeddingTowerCollection

    draw = generator("tower weights", case.seed)
    cpu = torch.device("cpu")
    towers = []
    for t, tower in enumerate(case.towers):
        configs = [EmbeddingBagConfig(name=table_name(t, i), embedding_dim=tower.dim, num_embeddings=rows,
                                      feature_names=[feature_name(t, i)]) for i, rows in enumerate(tower.rows)]
        ebc = EmbeddingBagCollection(tables=configs, is_weighted=tower.weighted, device=cpu)
        interaction = LinearInteraction(tower.dim * len(tower.rows), tower.width)
        with torch.no_grad():
            for param in list(ebc.parameters()) + list(interaction.parameters()):
                param.copy_(torch.rand(param.shape, generator=draw) * 2 - 1)
        towers.append(EmbeddingTower(ebc, interaction))
    return towers[0] if case.single else EmbeddingTowerCollection(towers, device=cpu)


def towers_of(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The towers of a collection, or the single EmbeddingTower itself."""
    return list(module.towers) if hasattr(module, "towers") else [module]


def tables_of(collection: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each table's weight of an unsharded collection (or tower), by table name."""
    return {name: bag.weight.detach().clone() for tower in towers_of(collection)
            for name, bag in tower.embedding.embedding_bags.items()}


def interactions_of(collection: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each interaction parameter of an unsharded collection (or tower), named as a sharded collection's
    state_dict names it (``towers.<t>.interaction.<name>``)."""
    return {f"towers.{t}.interaction.{name}": param.detach().clone()
            for t, tower in enumerate(towers_of(collection)) for name, param in tower.interaction.named_parameters()}


def batch(case: TowerCase, step: int, rank: int) -> tuple[Any, Any]:
    """(features, weighted features) rank ``rank`` feeds at ``step``: KJTs of the unweighted and the
    weighted towers' features (None where the collection has no such tower), keys in the case's order."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    draw = generator("tower batch", case.seed, step, rank)
    columns: dict[tuple[int, int], tuple[list[int], list[int], list[float]]] = {}
    for t, i in case.features():
        lengths = torch.randint(0, MAX_IDS_PER_SAMPLE + 1, (case.batch_size,), generator=draw).tolist()
        ids = torch.randint(0, case.towers[t].rows[i], (sum(lengths),), generator=draw).tolist()
        weights = (torch.rand(sum(lengths), generator=draw) + 0.5).tolist()
        columns[(t, i)] = (lengths, ids, weights)
    ordered = [case.features()[k] for k in case.key_order]
    made = []
    for weighted in (False, True):
        keys = [f for f in ordered if case.towers[f[0]].weighted == weighted]
        if not keys:
            made.append(None)
            continue
        made.append(KeyedJaggedTensor(
            keys=[feature_name(*f) for f in keys],
            values=torch.tensor([v for f in keys for v in columns[f][1]], dtype=torch.int64),
            lengths=torch.tensor([n for f in keys for n in columns[f][0]], dtype=torch.int64),
            weights=torch.tensor([w for f in keys for w in columns[f][2]]) if weighted else None,
        ))
    return made[0], made[1]


def upstream(case: TowerCase, step: int, rank: int) -> torch.Tensor:
    """The gradient of the loss with respect to rank ``rank``'s outputs at ``step``."""
    width = sum(tower.width for tower in case.towers)
    return torch.rand((case.batch_size, width), generator=generator("tower upstream", case.seed, step, rank)) * 2 - 1


def collection_inputs(case: TowerCase, features: Any, weighted: Any) -> tuple[Any, ...]:
    """The positional arguments of the module's forward: a collection's (features, weighted features),
    (features,) alone when no tower is weighted; a single tower's EBC its one KJT, weighted or not."""
    if case.single:
        return (weighted if features is None else features,)
    return (features,) if weighted is None else (features, weighted)
