"""The built-in training models (the pipeline and sync checks run them): their plans, optimizers, data.

Two models take the same batch type (torchrec's ``ModelInput``):
- ``dlrm``: a small DLRM-style model written here: an EmbeddingBagCollection over the unweighted
  features (optionally with a position-weighted feature processor), a weighted EmbeddingBagCollection
  over the scored features, a dense MLP and an over-arch to one logit.
- ``test-sparse-nn``: torchrec's own ``torchrec.distributed.test_utils.test_model.TestSparseNN``.

A built-in model goes through exactly the path of a user's model: ``builtin_setup`` gives the
sharding engine's ``build_setup`` a model factory, torchrec's own ``sharding_plan`` generators and
``batches[step][rank]``; the initial state is the factory's model at ``torch.manual_seed(seed)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paritykit.engine.pipeline_contract import model_loss
from paritykit.engine.pipeline_setup import sharded_for_training
from paritykit.engine.setup import build_setup
from paritykit.engine.training import TrainingSetup
from paritykit.harness.optimizers import OptimizerSpec
from paritykit.harness.seeding import generator

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
    # Width of the dense MLP and of the over-arch (dlrm only).
    hidden_dim: int = 8
    # The weighted EBC is looked up but its output left out of the prediction (dlrm only): a sharded
    # module whose embeddings get no gradient, as an auxiliary lookup a model computes and ignores.
    unused_weighted: bool = False

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
        if self.unused_weighted and (self.kind != "dlrm" or self.num_weighted_tables < 1):
            raise ValueError("unused_weighted needs the dlrm model with at least one weighted table")

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
        self.sparse_keys = [_feature(t.name) for t in tables]
        self.weighted_keys = [] if spec.unused_weighted else [_feature(t.name) for t in weighted]
        hidden = spec.hidden_dim
        self.dense = nn.Sequential(nn.Linear(spec.num_float_features, hidden), nn.ReLU()).to(device)
        sparse_width = spec.embedding_dim * (len(self.sparse_keys) + len(self.weighted_keys))
        self.over = nn.Sequential(nn.Linear(hidden + sparse_width, hidden), nn.ReLU(), nn.Linear(hidden, 1)).to(device)

    def forward(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        # By key: a sharded EBC orders its output keys by placement, not by table.
        sparse = self.sparse(batch.idlist_features).to_dict()
        pooled = [self.dense(batch.float_features)] + [sparse[key] for key in self.sparse_keys]
        if self.weighted is not None:
            weighted = self.weighted(batch.idscore_features).to_dict()
            pooled += [weighted[key] for key in self.weighted_keys]
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


@dataclass(frozen=True)
class ModelFactory:
    """``model_fn`` for a ModelSpec: a picklable callable returning the fresh unsharded model."""

    spec: ModelSpec

    def __call__(self) -> nn.Module:
        return build_unsharded(self.spec, torch.device("cpu"))


def _sharding_generator(sharding_type: str, table_index: int, world_size: int) -> Any:
    from torchrec.distributed import sharding_plan as sp

    if sharding_type == "table_wise":
        return sp.table_wise(rank=table_index % world_size)
    if sharding_type == "row_wise":
        return sp.row_wise()
    # Two 4-wide column shards, placed on ranks in reverse order so the stitching is not trivial.
    return sp.column_wise(ranks=[(table_index + 1) % world_size, table_index % world_size])


def sharding_plan_of(spec: ModelSpec, world_size: int) -> dict[str, Any]:
    """{table: torchrec ParameterShardingGenerator}: table i gets ``spec.sharding_type_of(i)``."""
    order = spec.table_names() + spec.weighted_table_names()
    return {name: _sharding_generator(spec.sharding_type_of(i), i, world_size) for i, name in enumerate(order)}


def optimizers_of(spec: ModelSpec) -> tuple[OptimizerSpec, OptimizerSpec]:
    """(fused embedding optimizer, dense optimizer); Adam steps at a tenth of the learning rate."""
    dense_lr = spec.lr / 10 if spec.dense_optimizer == "adam" else spec.lr
    return OptimizerSpec(spec.fused_optimizer, spec.lr), OptimizerSpec(spec.dense_optimizer, dense_lr)


def batches_of(spec: ModelSpec, data: DataSpec, world_size: int) -> list[list[Any]]:
    """``batches[step][rank]`` on the CPU: every rank's ``make_batches``."""
    per_rank = [make_batches(spec, data, rank, torch.device("cpu")) for rank in range(world_size)]
    return [[per_rank[rank][step] for rank in range(world_size)] for step in range(data.num_batches)]


def builtin_setup(spec: ModelSpec, batches: list[list[Any]], device: str = "cpu") -> TrainingSetup:
    """The sharding engine's TrainingSetup for a built-in model: the same path as a user's model."""
    embedding, dense = optimizers_of(spec)
    return build_setup(
        ModelFactory(spec), sharding_plan_of(spec, len(batches[0])) if batches else {}, batches, loss_fn=model_loss,
        embedding_optimizer=embedding, dense_optimizer=dense, seed=spec.seed, device=device,
    )


def build_sharded(spec: ModelSpec, device: torch.device) -> tuple[nn.Module, Any]:
    """(DMP-wrapped model, dense optimizer) on a rank. Fused optimizers run inside backward (fused TBE)."""
    import torch.distributed as dist

    world_size = dist.get_world_size()
    setup = builtin_setup(spec, batches_of(spec, DataSpec(num_batches=1), world_size), device.type)
    return sharded_for_training(setup, device)


def make_batches(model: ModelSpec, data: DataSpec, rank: int, device: torch.device) -> list[Any]:
    """This rank's batches. Depends only on (data.seed, rank, step), never on the pipeline."""
    from torchrec.distributed.test_utils.test_model import ModelInput

    batches = []
    for step in range(data.num_batches):
        batch_generator = generator("pipeline-batch", data.seed, rank, step)
        batches.append(
            ModelInput(
                float_features=torch.randn(data.batch_size, model.num_float_features, generator=batch_generator),
                idlist_features=random_kjt(model.table_names(), model, data, batch_generator, weighted=False),
                idscore_features=(
                    random_kjt(model.weighted_table_names(), model, data, batch_generator, weighted=True)
                    if model.num_weighted_tables
                    else None
                ),
                label=torch.randint(0, 2, (data.batch_size,), generator=batch_generator).float(),
            ).to(device)
        )
    return batches


def random_kjt(tables: list[str], model: ModelSpec, data: DataSpec, source: torch.Generator, weighted: bool) -> Any:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    lengths = torch.randint(0, data.max_ids_per_feature + 1, (len(tables) * data.batch_size,), generator=source)
    total = int(lengths.sum())
    values = torch.randint(0, model.num_embeddings, (total,), generator=source)
    weights = torch.rand(total, generator=source) if weighted else None
    return KeyedJaggedTensor(
        keys=[_feature(t) for t in tables], values=values, lengths=lengths, weights=weights
    )
