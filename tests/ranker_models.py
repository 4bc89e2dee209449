"""Models the way a downstream user writes them (the TorchRec tutorial's shape), at module level so
that the ranks can build them too."""

from __future__ import annotations

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

FEATURES = ("user_id", "item_id", "history", "ad_id")


def tables() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name="user", embedding_dim=8, num_embeddings=20, feature_names=["user_id"], pooling=PoolingType.MEAN),
        EmbeddingBagConfig(name="item", embedding_dim=12, num_embeddings=16, feature_names=["item_id", "history"], pooling=PoolingType.MEAN),
        EmbeddingBagConfig(name="ads", embedding_dim=8, num_embeddings=24, feature_names=["ad_id"], pooling=PoolingType.SUM),
    ]


class Ranker(nn.Module):
    """EBC + MLP; reads the pooled embeddings by key, as torchrec's own models do."""

    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=tables())
        self.mlp = nn.Sequential(nn.Linear(8 + 24 + 8, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, features):
        pooled = self.ebc(features).to_dict()
        return self.mlp(torch.cat([pooled[name] for name in FEATURES], dim=1)).squeeze(-1)


class PositionalRanker(Ranker):
    """The same model reading KeyedTensor.values() by position: right unsharded, wrong once sharded."""

    def forward(self, features):
        return self.mlp(self.ebc(features).values()).squeeze(-1)


class SequenceModel(nn.Module):
    """An EmbeddingCollection whose sequences are summed and scored."""

    def __init__(self) -> None:
        super().__init__()
        self.ec = EmbeddingCollection(tables=[
            EmbeddingConfig(name="words", embedding_dim=8, num_embeddings=30, feature_names=["query", "title"]),
            EmbeddingConfig(name="tags", embedding_dim=8, num_embeddings=12, feature_names=["tag"]),
        ])
        self.head = nn.Linear(8, 1)

    def forward(self, features):
        sequences = self.ec(features)
        return torch.stack([self.head(sequences[name].values()).sum() for name in ("query", "title", "tag")])


def ranker() -> nn.Module:
    torch.manual_seed(0)
    return Ranker()


def positional_ranker() -> nn.Module:
    torch.manual_seed(0)
    return PositionalRanker()


def sequence_model() -> nn.Module:
    torch.manual_seed(0)
    return SequenceModel()
