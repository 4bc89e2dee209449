"""A built-in model whose sparse inputs the pipelines must find inside containers and behind a
post-processing module: torchrec's input tracing (``tracing.py``) and ``PipelinedPostproc``.

``NestedBatch`` keeps its KeyedJaggedTensors in a dict and a list. ``NestedRanker`` reads them as
``batch.sparse["user"]`` (getattr, getitem by key), ``batch.scored[1]`` (getitem by index; entry 0
is a decoy with the same key that only a wrong index reads) and
``batch.sparse.get("item")`` (a ``get`` call); its dense tower branches on a shape (``GuardedDense``,
which torch.fx cannot trace: a leaf to torchrec's tracer); and the item features pass through ``IdFold``, a
module without parameters called with a scalar, a list and a dict constant, before their
EmbeddingBagCollection. A pipeline built with ``pipeline_postproc=True`` runs that module in its
sparse-data-dist stage (``PipelinedPostproc``) and feeds its cached result to the model's forward;
without it the item EBC is not pipelined (torchrec assumes the module changes the KJT). Either way the
numbers must be the plain loop's, and the plain loop the unsharded model's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torchrec.streamable import Pipelineable

from paritykit.engine.builtin_models import DataSpec, ModelSpec, optimizers_of, random_kjt, sharding_plan_of, table_configs
from paritykit.engine.pipeline_contract import model_loss
from paritykit.engine.setup import build_setup
from paritykit.engine.training import TrainingSetup
from paritykit.harness.seeding import generator

# IdFold's constants: ids are shifted by FOLD_OFFSET and folded into the item table's rows.
FOLD_OFFSET = 5


@dataclass
class NestedBatch(Pipelineable):
    float_features: torch.Tensor
    sparse: dict[str, Any]  # {"user": KJT, "item": KJT}
    scored: list[Any]  # [decoy weighted KJT, weighted KJT]
    label: torch.Tensor

    def to(self, device: torch.device, non_blocking: bool = False) -> "NestedBatch":
        return NestedBatch(
            float_features=self.float_features.to(device, non_blocking=non_blocking),
            sparse={key: kjt.to(device, non_blocking=non_blocking) for key, kjt in self.sparse.items()},
            scored=[kjt.to(device, non_blocking=non_blocking) for kjt in self.scored],
            label=self.label.to(device, non_blocking=non_blocking),
        )

    def record_stream(self, stream: Any) -> None:
        self.float_features.record_stream(stream)
        for kjt in [*self.sparse.values(), *self.scored]:
            kjt.record_stream(stream)
        self.label.record_stream(stream)


class IdFold(nn.Module):
    """Post-processing without parameters: ids times the ``stride`` buffer, shifted by ``offset`` and
    folded into ``options["rows"]`` rows, the features renamed to ``keys``. The buffer (state that a
    hashing module would hold) must stay in the model's state dict once the pipeline wraps the module."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("stride", torch.tensor(1, dtype=torch.int64))

    def forward(self, features: Any, offset: int, keys: list[str], options: dict[str, int]) -> Any:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        return KeyedJaggedTensor(keys=list(keys), values=(features.values() * self.stride + offset) % options["rows"],
                                 lengths=features.lengths(), weights=features.weights_or_none())


class GuardedDense(nn.Sequential):
    """A dense tower that returns early on an empty batch, as users' towers do: a branch on a shape,
    which torch.fx cannot trace, so torchrec's tracer must keep it a leaf module (never traced into)
    for the pipelines to find the sparse inputs at all. The parameters keep Sequential's names."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(nn.Linear(in_features, out_features), nn.ReLU())
        self.out_features = out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return torch.zeros(0, self.out_features, dtype=x.dtype, device=x.device)
        for layer in self:
            x = layer(x)
        return x


class NestedRanker(nn.Module):
    """user, item (through IdFold) and scored EmbeddingBagCollections, a dense MLP and an over-arch."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        (user, item), (scored,) = table_configs(spec)
        self.user_ebc = EmbeddingBagCollection([user])
        self.item_ebc = EmbeddingBagCollection([item])
        self.scored_ebc = EmbeddingBagCollection([scored], is_weighted=True)
        self.fold = IdFold()
        self.keys = (user.feature_names[0], item.feature_names[0], scored.feature_names[0])
        self.rows = spec.num_embeddings
        self.dense = GuardedDense(spec.num_float_features, spec.hidden_dim)
        self.over = nn.Sequential(nn.Linear(spec.hidden_dim + 3 * spec.embedding_dim, spec.hidden_dim), nn.ReLU(),
                                  nn.Linear(spec.hidden_dim, 1))

    @staticmethod
    def pipelined_modules(pipeline_postproc: bool) -> tuple[str, ...]:
        """The EBCs a sparse-dist pipeline must pipeline: each reads the batch directly, the item EBC
        through ``fold`` (a parameter-free module with args from the batch and constants), which only
        ``pipeline_postproc=True`` may run in the data-dist stage, swapped for a PipelinedPostproc
        (pipeline_promises.py checks it)."""
        return ("user_ebc", "scored_ebc") + (("item_ebc", "fold") if pipeline_postproc else ())

    def forward(self, batch: NestedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        user = self.user_ebc(batch.sparse["user"]).to_dict()
        folded = self.fold(batch.sparse.get("item"), FOLD_OFFSET, [self.keys[1]], {"rows": self.rows})
        item = self.item_ebc(folded).to_dict()
        scored = self.scored_ebc(batch.scored[1]).to_dict()
        pooled = [self.dense(batch.float_features), user[self.keys[0]], item[self.keys[1]], scored[self.keys[2]]]
        logit = self.over(torch.cat(pooled, dim=1)).squeeze(-1)
        return nn.functional.binary_cross_entropy_with_logits(logit, batch.label), torch.sigmoid(logit)


NESTED_SPEC = ModelSpec(num_tables=2, num_weighted_tables=1, sharding_types=("table_wise", "row_wise", "column_wise"),
                        fused_optimizer="rowwise_adagrad")


@dataclass(frozen=True)
class NestedFactory:
    """``model_fn`` for the nested model (picklable)."""

    spec: ModelSpec = NESTED_SPEC

    def __call__(self) -> nn.Module:
        torch.manual_seed(self.spec.seed)
        return NestedRanker(self.spec)


def nested_batches(spec: ModelSpec, data: DataSpec, world_size: int) -> list[list[NestedBatch]]:
    """``batches[step][rank]``, a function of (data.seed, rank, step) only."""
    (user, item), (scored,) = (spec.table_names(), spec.weighted_table_names())
    steps = []
    for step in range(data.num_batches):
        per_rank = []
        for rank in range(world_size):
            source = generator("pipeline-nested-batch", data.seed, rank, step)
            per_rank.append(NestedBatch(
                float_features=torch.randn(data.batch_size, spec.num_float_features, generator=source),
                sparse={"user": random_kjt([user], spec, data, source, weighted=False),
                        "item": random_kjt([item], spec, data, source, weighted=False)},
                scored=[random_kjt([scored], spec, data, source, weighted=True) for _ in range(2)],
                label=torch.randint(0, 2, (data.batch_size,), generator=source).float(),
            ))
        steps.append(per_rank)
    return steps


def nested_setup(data: DataSpec, world_size: int, spec: ModelSpec = NESTED_SPEC, device: str = "cpu") -> TrainingSetup:
    """The sharding engine's setup for the nested model: the same path as a user's model."""
    embedding, dense = optimizers_of(spec)
    return build_setup(NestedFactory(spec), sharding_plan_of(spec, world_size), nested_batches(spec, data, world_size),
                       loss_fn=model_loss, embedding_optimizer=embedding, dense_optimizer=dense, seed=spec.seed, device=device)
