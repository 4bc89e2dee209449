"""Feature-processed EBCs as users build them: torchrec's ``FeatureProcessedEmbeddingBagCollection`` over a
weighted EBC, its position weights held by a ``PositionWeightedModuleCollection`` ("collection") or by a
dict of ``PositionWeightedModule``, one per feature ("dict"). Built on the CPU with seeded tables and
seeded position weights (so a wrong position shows), or on the meta device as a large model is, where
torchrec's sharder must materialise the feature processors and reset them to 1.0.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from paritykit.harness.seeding import generator
from paritykit.harness.tables import TableSpec, load_full_weights, seeded_full_weights

FORMS = ("collection", "dict")
# torchrec's documented start of every position weight (PositionWeightedModule*.reset_parameters).
RESET_POSITION_WEIGHT = 1.0


def max_lengths(tables: Sequence[TableSpec], longest_bag: int) -> dict[str, int]:
    """Per feature, the number of position weights: the longest bag and one more on every other
    feature (positions past a bag's length are never read: their gradient must stay zero)."""
    features = [f for t in tables for f in t.feature_names]
    return {feature: longest_bag + index % 2 for index, feature in enumerate(features)}


def _processors(lengths: dict[str, int], form: str, device: torch.device) -> nn.Module | dict[str, nn.Module]:
    from torchrec.modules.feature_processor_ import PositionWeightedModule, PositionWeightedModuleCollection

    if form == "collection":
        return PositionWeightedModuleCollection(dict(lengths), device=device)
    return {feature: PositionWeightedModule(length, device=device) for feature, length in lengths.items()}


def seeded_position_weights(lengths: dict[str, int], seed: int) -> dict[str, torch.Tensor]:
    """Position weights far from 1.0 and from each other, a deterministic function of (seed, feature)."""
    return {feature: 0.5 + torch.rand(length, generator=generator("fp-position-weights", seed, feature))
            for feature, length in lengths.items()}


def position_weight_key(form: str, feature: str) -> str:
    """The state-dict key of ``feature``'s position weights in an unsharded FP-EBC of ``form``."""
    if form == "collection":
        return f"_feature_processors.position_weights.{feature}"
    return f"_feature_processors.{feature}.position_weight"


def build_fp_ebc(tables: tuple[TableSpec, ...], form: str, seed: int, longest_bag: int = 3, device: str = "cpu",
                 seeded: bool = True) -> nn.Module:
    """The unsharded FP-EBC on ``device``. ``seeded``: tables and position weights from ``seed`` (on the
    CPU only); else as torchrec initialises them (tables uniform in the config's range, positions 1.0)."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

    if form not in FORMS:
        raise ValueError(f"feature processor form {form!r} is not one of {FORMS}")
    where = torch.device(device)
    configs = [EmbeddingBagConfig(name=t.name, num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim,
                                  feature_names=list(t.feature_names), pooling=PoolingType[t.pooling]) for t in tables]
    lengths = max_lengths(tables, longest_bag)
    ebc = EmbeddingBagCollection(tables=configs, is_weighted=True, device=where)
    module = FeatureProcessedEmbeddingBagCollection(ebc, _processors(lengths, form, where))
    if seeded and where.type != "meta":
        load_full_weights(ebc, seeded_full_weights(tables, seed))
        with torch.no_grad():
            state = module.state_dict()
            for feature, value in seeded_position_weights(lengths, seed).items():
                state[position_weight_key(form, feature)].copy_(value)
    return module


def init_range(tables: tuple[TableSpec, ...]) -> dict[str, tuple[float, float]]:
    """Per table, the interval torchrec draws a fresh table from (its config's weight_init_min/max)."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    ranges = {}
    for t in tables:
        config = EmbeddingBagConfig(name=t.name, num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim,
                                    feature_names=list(t.feature_names))
        ranges[t.name] = (config.get_weight_init_min(), config.get_weight_init_max())
    return ranges


class PooledByKey(nn.Module):
    """A model around the FP-EBC, as users hold one: its pooled embeddings by key (tensors, which DDP
    over the position weights sees as the model's output)."""

    def __init__(self, fp_ebc: nn.Module) -> None:
        super().__init__()
        self.fp = fp_ebc

    def forward(self, kjt):
        return self.fp(kjt).to_dict()


def build_wrapped_fp_ebc(tables: tuple[TableSpec, ...], form: str, seed: int, longest_bag: int = 3, device: str = "cpu",
                         seeded: bool = True) -> nn.Module:
    return PooledByKey(build_fp_ebc(tables, form, seed, longest_bag, device, seeded))
