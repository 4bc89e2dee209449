"""Whole DMP-wrapped models for the pipeline check, and their deterministic per-rank data.

Two models take the same batch type (torchrec's ``ModelInput``):
- ``dlrm``: a small DLRM-style model written here: a sharded EmbeddingBagCollection over the
  unweighted features (optionally with a position-weighted feature processor), a sharded weighted
  EmbeddingBagCollection over the scored features, a dense MLP and an over-arch to one logit.
- ``test-sparse-nn``: torchrec's own ``torchrec.distributed.test_utils.test_model.TestSparseNN``.

Everything here runs on a rank with a process group already initialised. Construction is
deterministic: dense parameters come from ``torch.manual_seed(seed)``, embedding tables and fused
optimizer state are overwritten from a seeded generator after sharding, so every pipeline starts
from bit-identical state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from paritykit.harness.seeding import generator
from paritykit.harness.shards import local_pieces, scatter
from paritykit.harness.tables import table_of_key

SHARDING_TYPES = ("table_wise", "row_wise", "column_wise")
FUSED_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")
DENSE_OPTIMIZERS = ("sgd", "adam")
MODEL_KINDS = ("dlrm", "test-sparse-nn")


@dataclass(frozen=True)
class ModelSpec:
    """What to build. Picklable, so it travels to ranks."""

    kind: str = "dlrm"
    num_tables: int = 2
    num_weighted_tables: int = 1
    num_embeddings: int = 24
    embedding_dim: int = 8
    num_float_features: int = 4
    # One sharding type per table (unweighted tables first, then weighted); cycled if shorter.
    sharding_types: tuple[str, ...] = ("table_wise",)
    fused_optimizer: str = "sgd"
    dense_optimizer: str = "sgd"
    lr: float = 0.1
    # A position-weighted feature processor on the unweighted tables (dlrm only).
    feature_processor: bool = False
    max_feature_length: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in MODEL_KINDS:
            raise ValueError(f"ModelSpec.kind must be one of {MODEL_KINDS}, got {self.kind!r}")
        bad = [s for s in self.sharding_types if s not in SHARDING_TYPES]
        if bad or not self.sharding_types:
            raise ValueError(f"ModelSpec.sharding_types must be non-empty, from {SHARDING_TYPES}; got {self.sharding_types}")
        if self.fused_optimizer not in FUSED_OPTIMIZERS:
            raise ValueError(f"ModelSpec.fused_optimizer must be one of {FUSED_OPTIMIZERS}, got {self.fused_optimizer!r}")
        if self.dense_optimizer not in DENSE_OPTIMIZERS:
            raise ValueError(f"ModelSpec.dense_optimizer must be one of {DENSE_OPTIMIZERS}, got {self.dense_optimizer!r}")
        if self.num_tables < 1 or self.num_weighted_tables < 0:
            raise ValueError("ModelSpec needs at least one unweighted table and a non-negative number of weighted tables")
        if self.embedding_dim % 4:
            raise ValueError("ModelSpec.embedding_dim must be a multiple of 4 (column-wise shards are 4 wide)")
        if self.feature_processor and self.kind != "dlrm":
            raise ValueError("feature_processor is only supported on the dlrm model")

    def table_names(self) -> list[str]:
        return [f"t{i}" for i in range(self.num_tables)]

    def weighted_table_names(self) -> list[str]:
        return [f"w{i}" for i in range(self.num_weighted_tables)]

    def sharding_type_of(self, index: int) -> str:
        return self.sharding_types[index % len(self.sharding_types)]


@dataclass(frozen=True)
class DataSpec:
    """A deterministic per-rank dataloader: ``num_batches`` batches of ``batch_size`` on every rank."""

    batch_size: int = 4
    num_batches: int = 5
    seed: int = 0
    max_ids_per_feature: int = 3

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.num_batches < 0:
            raise ValueError(f"DataSpec needs batch_size >= 1 and num_batches >= 0, got {self}")


def _feature(table: str) -> str:
    return f"f_{table}"


def table_configs(spec: ModelSpec) -> tuple[list[Any], list[Any]]:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    def config(name: str) -> EmbeddingBagConfig:
        return EmbeddingBagConfig(
            name=name,
            embedding_dim=spec.embedding_dim,
            num_embeddings=spec.num_embeddings,
            feature_names=[_feature(name)],
        )

    return [config(n) for n in spec.table_names()], [config(n) for n in spec.weighted_table_names()]


class SmallDLRM(nn.Module):
    """DLRM-style: sparse EBC (+ optional feature processor), weighted EBC, dense MLP, over-arch.

    ``forward(batch)`` returns ``(loss, prediction)`` as torchrec's train pipelines expect.
    The sparse modules read only attributes of the batch, which the pipelines' tracer needs.
    """

    def __init__(self, spec: ModelSpec, device: torch.device) -> None:
        super().__init__()
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        tables, weighted = table_configs(spec)
        if spec.feature_processor:
            from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
            from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

            processor = PositionWeightedModuleCollection(
                {_feature(t.name): spec.max_feature_length for t in tables}, device=device
            )
            self.sparse = FeatureProcessedEmbeddingBagCollection(
                EmbeddingBagCollection(tables, is_weighted=True, device=device), processor
            )
        else:
            self.sparse = EmbeddingBagCollection(tables, device=device)
        self.weighted = EmbeddingBagCollection(weighted, is_weighted=True, device=device) if weighted else None
        hidden = 8
        self.dense = nn.Sequential(nn.Linear(spec.num_float_features, hidden), nn.ReLU()).to(device)
        sparse_width = spec.embedding_dim * (len(tables) + len(weighted))
        self.over = nn.Sequential(nn.Linear(hidden + sparse_width, hidden), nn.ReLU(), nn.Linear(hidden, 1)).to(device)

    def forward(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = [self.dense(batch.float_features), self.sparse(batch.idlist_features).values()]
        if self.weighted is not None:
            pooled.append(self.weighted(batch.idscore_features).values())
        logit = self.over(torch.cat(pooled, dim=1)).squeeze(-1)
        loss = nn.functional.binary_cross_entropy_with_logits(logit, batch.label)
        return loss, torch.sigmoid(logit)


def build_unsharded(spec: ModelSpec, device: torch.device) -> nn.Module:
    """The model before sharding, with dense parameters drawn from ``spec.seed``."""
    torch.manual_seed(spec.seed)
    if spec.kind == "dlrm":
        return SmallDLRM(spec, device)
    from torchrec.distributed.test_utils.test_model import TestSparseNN

    tables, weighted = table_configs(spec)
    return TestSparseNN(
        tables=tables,
        weighted_tables=weighted,
        num_float_features=spec.num_float_features,
        dense_device=device,
        sparse_device=device,
    )


def _fused_optimizer(spec: ModelSpec) -> tuple[type, dict[str, Any]]:
    if spec.fused_optimizer == "sgd":
        return torch.optim.SGD, {"lr": spec.lr}
    if spec.fused_optimizer == "adagrad":
        return torch.optim.Adagrad, {"lr": spec.lr, "eps": 1e-8}
    from torchrec.optim import RowWiseAdagrad

    return RowWiseAdagrad, {"lr": spec.lr, "eps": 1e-8}


def embedding_modules(model: nn.Module) -> dict[str, nn.Module]:
    """FQN -> every EmbeddingBagCollection-like module the sharder will replace."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

    found: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if isinstance(module, FeatureProcessedEmbeddingBagCollection):
            found[name] = module
        elif isinstance(module, EmbeddingBagCollection) and not any(name.startswith(p + ".") for p in found):
            found[name] = module
    return found


def _sharding_generator(sharding_type: str, table_index: int, world_size: int) -> Any:
    from torchrec.distributed import sharding_plan as sp

    if sharding_type == "table_wise":
        return sp.table_wise(rank=table_index % world_size)
    if sharding_type == "row_wise":
        return sp.row_wise()
    # Two 4-wide column shards, placed on ranks in reverse order so the stitching is not trivial.
    return sp.column_wise(ranks=[(table_index + 1) % world_size, table_index % world_size])


def sharding_plan(spec: ModelSpec, model: nn.Module, world_size: int, device_type: str) -> Any:
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingPlan

    order = spec.table_names() + spec.weighted_table_names()
    plan = {}
    for fqn, module in embedding_modules(model).items():
        tables = _table_names_of(module)
        per_param = {}
        for name in tables:
            index = order.index(name)
            per_param[name] = _sharding_generator(spec.sharding_type_of(index), index, world_size)
        plan[fqn] = construct_module_sharding_plan(
            module, per_param, world_size=world_size, local_size=world_size, device_type=device_type
        )
    return ShardingPlan(plan)


def _table_names_of(module: nn.Module) -> list[str]:
    ebc = getattr(module, "_embedding_bag_collection", module)
    return [config.name for config in ebc.embedding_bag_configs()]


def build_sharded(spec: ModelSpec, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    """(DMP-wrapped model, dense optimizer). Fused optimizers run inside backward (fused TBE)."""
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    world_size = dist.get_world_size()
    model = build_unsharded(spec, device)
    optim_cls, optim_kwargs = _fused_optimizer(spec)
    for module in embedding_modules(model).values():
        ebc = getattr(module, "_embedding_bag_collection", module)
        apply_optimizer_in_backward(optim_cls, ebc.parameters(), optim_kwargs)
    plan = sharding_plan(spec, model, world_size, device.type)
    dmp = DistributedModelParallel(model, device=device, plan=plan, sharders=_sharders())
    load_deterministic_tables(dmp, spec)

    dense_params = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    if spec.dense_optimizer == "sgd":
        dense = KeyedOptimizerWrapper(dense_params, lambda ps: torch.optim.SGD(ps, lr=spec.lr))
    else:
        dense = KeyedOptimizerWrapper(dense_params, lambda ps: torch.optim.Adam(ps, lr=spec.lr / 10))
    return dmp, dense


def _sharders() -> list[Any]:
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder

    return [EmbeddingBagCollectionSharder(), FeatureProcessedEmbeddingBagCollectionSharder()]


def full_table(spec: ModelSpec, name: str) -> torch.Tensor:
    """The full initial weight of one table, the same on every rank."""
    weights = torch.rand(spec.num_embeddings, spec.embedding_dim, generator=generator("pipeline-table", spec.seed, name))
    return weights * 0.2 - 0.1


def load_deterministic_tables(dmp: nn.Module, spec: ModelSpec) -> None:
    """Overwrite every local shard of every table with its slice of ``full_table``."""
    tables = spec.table_names() + spec.weighted_table_names()
    pieces = local_pieces(dmp.state_dict(), lambda key: name if (name := table_of_key(key)) in tables else None)
    scatter(pieces, {name: full_table(spec, name) for name in {p.name for p in pieces}})


def make_batches(model: ModelSpec, data: DataSpec, rank: int, device: torch.device) -> list[Any]:
    """This rank's batches. Depends only on (data.seed, rank, step), never on the pipeline."""
    from torchrec.distributed.test_utils.test_model import ModelInput

    batches = []
    for step in range(data.num_batches):
        batch_generator = generator("pipeline-batch", data.seed, rank, step)
        batches.append(
            ModelInput(
                float_features=torch.randn(data.batch_size, model.num_float_features, generator=batch_generator),
                idlist_features=_random_kjt(model.table_names(), model, data, batch_generator, weighted=False),
                idscore_features=(
                    _random_kjt(model.weighted_table_names(), model, data, batch_generator, weighted=True)
                    if model.num_weighted_tables
                    else None
                ),
                label=torch.randint(0, 2, (data.batch_size,), generator=batch_generator).float(),
            ).to(device)
        )
    return batches


def _random_kjt(tables: list[str], model: ModelSpec, data: DataSpec, source: torch.Generator, weighted: bool) -> Any:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    lengths = torch.randint(0, data.max_ids_per_feature + 1, (len(tables) * data.batch_size,), generator=source)
    total = int(lengths.sum())
    values = torch.randint(0, model.num_embeddings, (total,), generator=source)
    weights = torch.rand(total, generator=source) if weighted else None
    return KeyedJaggedTensor(
        keys=[_feature(t) for t in tables], values=values, lengths=lengths, weights=weights
    )
