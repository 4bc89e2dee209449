"""The downstream project's own model: three sparse features pooled by an EBC, then an MLP.

The MLP reads the pooled embeddings by feature name (``to_dict()``): a sharded EBC returns its
KeyedTensor keys in the order of the plan's placements, so ``.values()`` read by position would mix
features up once the model is sharded (paritykit says so when it sees it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

FEATURES = ("user_history", "item_tags", "ad_id")
VOCAB = {"user_history": 50, "item_tags": 20, "ad_id": 30}
TABLES = {"history": "user_history", "tags": "item_tags", "ads": "ad_id"}
EMBEDDING_DIM = 8
DENSE_FEATURES = 2


def embedding_tables() -> list[EmbeddingBagConfig]:
    pooling = {"history": PoolingType.MEAN, "tags": PoolingType.SUM, "ads": PoolingType.SUM}
    return [
        EmbeddingBagConfig(name=table, embedding_dim=EMBEDDING_DIM, num_embeddings=VOCAB[feature],
                           feature_names=[feature], pooling=pooling[table])
        for table, feature in TABLES.items()
    ]


class RankingModel(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.sparse = EmbeddingBagCollection(tables=embedding_tables())
        self.head = nn.Sequential(nn.Linear(len(FEATURES) * EMBEDDING_DIM, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.sparse(features).to_dict()
        return self.head(torch.cat([pooled[name] for name in FEATURES], dim=1)).squeeze(-1)


SEQUENCE_FEATURES = ("query_words", "title_words")
SEQUENCE_VOCAB = {"query_words": 40, "title_words": 30}


class SequenceModel(nn.Module):
    """Our search model: an EmbeddingCollection looks up every word of the query and the title
    (unpooled), and a linear layer scores each word."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        tables = {"words": "query_words", "titles": "title_words"}
        self.sequence = EmbeddingCollection(tables=[
            EmbeddingConfig(name=table, embedding_dim=EMBEDDING_DIM, num_embeddings=SEQUENCE_VOCAB[feature], feature_names=[feature])
            for table, feature in tables.items()
        ])
        self.score = nn.Linear(EMBEDDING_DIM, 1)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        words = self.sequence(features)
        return torch.cat([self.score(words[name].values()).squeeze(-1) for name in SEQUENCE_FEATURES])


@dataclass
class Batch(Pipelineable):
    """What the data loader yields: torchrec's training pipelines move it with ``to``."""

    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    label: torch.Tensor

    def to(self, device: torch.device, non_blocking: bool = False) -> "Batch":
        return Batch(self.dense.to(device, non_blocking=non_blocking), self.sparse.to(device, non_blocking=non_blocking),
                     self.label.to(device, non_blocking=non_blocking))

    def record_stream(self, stream: torch.Stream) -> None:
        for tensor in (self.dense, self.label):
            tensor.record_stream(stream)
        self.sparse.record_stream(stream)

    def pin_memory(self) -> "Batch":
        return Batch(self.dense.pin_memory(), self.sparse.pin_memory(), self.label.pin_memory())


class TrainingModel(nn.Module):
    """The model as our trainer runs it: dense features beside the sparse ones, forward returns
    (loss, prediction) as torchrec's pipelines require."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.sparse = EmbeddingBagCollection(tables=embedding_tables())
        self.head = nn.Sequential(nn.Linear(len(FEATURES) * EMBEDDING_DIM + DENSE_FEATURES, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = self.sparse(batch.sparse).to_dict()
        logit = self.head(torch.cat([batch.dense] + [pooled[name] for name in FEATURES], dim=1)).squeeze(-1)
        return nn.functional.binary_cross_entropy_with_logits(logit, batch.label), torch.sigmoid(logit)
