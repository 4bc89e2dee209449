"""Planted bugs in torchrec's tower sharding, which the tower cases (tower_cases.py) cover. Registered for
the sharding check (plants.py imports this module); tests/test_towers.py shows each to move torchrec's own
numbers and to be caught."""

from __future__ import annotations

from typing import ContextManager

from paritykit.harness.patching import replaced
from paritykit.harness.plants import register

CHECK = "sharding"


@register("tower-features-not-permuted", check=CHECK)
def tower_features_not_permuted() -> ContextManager[None]:
    """The sharded tower collection no longer puts the batch's features in its towers' order before sending
    them to the towers' hosts: a batch whose keys come in another order feeds each table another feature."""
    from torchrec.distributed.embedding_tower_sharding import ShardedEmbeddingTowerCollection

    def planted(original):
        def _create_input_dist(self, kjt_feature_names, wkjt_feature_names):
            original(self, kjt_feature_names, wkjt_feature_names)
            self._has_kjt_features_permute = self._has_wkjt_features_permute = False

        return _create_input_dist

    return replaced(ShardedEmbeddingTowerCollection, "_create_input_dist", planted)


@register("tower-interaction-not-synced", check=CHECK)
def tower_interaction_not_synced() -> ContextManager[None]:
    """Each tower's interaction is no longer wrapped in DDP over the host's ranks: every replica steps with
    its own ranks' gradients alone and the replicas drift apart (one rank a host cannot show it)."""
    import torch
    from torchrec.distributed import embedding_tower_sharding

    class Unsynced(torch.nn.Module):
        def __init__(self, module: torch.nn.Module, **_ignored: object) -> None:
            super().__init__()
            self.module = module

        def forward(self, *args: object, **kwargs: object) -> object:
            return self.module(*args, **kwargs)

    return replaced(embedding_tower_sharding, "DistributedDataParallel", lambda original: Unsynced)
