"""The model the optimizer wrappers train: an EmbeddingBagCollection and a dense layer over it.

Dense layers matter here: a ``GradientClippingOptimizer`` over a sharded model clips their
gradients (replicated by DDP) together with those of dense-kernel and data-parallel tables, and a
warm-up schedule drives the dense optimizer and the fused one alike. The pooled embeddings are read
by key (a sharded EBC orders its keys by placement), squashed by tanh (smooth: no kink for roundoff
to cross) and mapped to a few outputs.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
from torch import nn

from paritykit.harness.seeding import generator
from paritykit.harness.tables import TableSpec, build_ebc, feature_names_of

OUTPUTS = 3


class EmbeddingsWithDense(nn.Module):
    def __init__(self, tables: Sequence[TableSpec], seed: int) -> None:
        super().__init__()
        self.features = feature_names_of(tables)
        self.ebc = build_ebc(tables, seed=seed)
        width = sum(t.embedding_dim for t in tables for _ in t.feature_names)
        self.over = nn.Linear(width, OUTPUTS)
        with torch.no_grad():
            self.over.weight.copy_(torch.randn(OUTPUTS, width, generator=generator("over.weight", seed)) / width**0.5)
            self.over.bias.copy_(torch.randn(OUTPUTS, generator=generator("over.bias", seed)))

    def forward(self, features) -> torch.Tensor:
        pooled = self.ebc(features).to_dict()
        return self.over(torch.tanh(torch.cat([pooled[f] for f in self.features], dim=1)))


def build_model(tables: tuple[TableSpec, ...], seed: int) -> EmbeddingsWithDense:
    return EmbeddingsWithDense(tables, seed)


def model_factory(tables: tuple[TableSpec, ...], seed: int):
    """A picklable factory (the ranks call it too)."""
    return functools.partial(build_model, tables, seed)
