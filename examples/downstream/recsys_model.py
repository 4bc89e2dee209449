"""The downstream project's own model: two sparse features pooled by an EBC, then an MLP."""

from __future__ import annotations

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

FEATURES = ("user_history", "item_tags")
VOCAB = {"user_history": 50, "item_tags": 20}
EMBEDDING_DIM = 8


def embedding_tables() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name="history", embedding_dim=EMBEDDING_DIM, num_embeddings=VOCAB["user_history"],
                           feature_names=["user_history"], pooling=PoolingType.MEAN),
        EmbeddingBagConfig(name="tags", embedding_dim=EMBEDDING_DIM, num_embeddings=VOCAB["item_tags"],
                           feature_names=["item_tags"], pooling=PoolingType.SUM),
    ]


class RankingModel(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.sparse = EmbeddingBagCollection(tables=embedding_tables())
        self.head = nn.Sequential(nn.Linear(2 * EMBEDDING_DIM, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return self.head(self.sparse(features).values()).squeeze(-1)
