"""Planted bugs in the torchrec code the feature-processed EBC cases cover (fp_cases.py): the sharded
FP-EBC's row-wise position encoding, its materialisation from the meta device, the position-weight
collection's re-sync after a device move, and the sharded state_dict. Registered for the sharding check
(plants.py imports this module); each is shown by tests/test_fp_plants.py to move torchrec's own numbers
and to be caught. None touches the unsharded reference's own code path except where the comparison is
of the unsharded module's materialisation (position-weights-stale-after-to-empty).
"""

from __future__ import annotations

from typing import ContextManager

from paritykit.harness.patching import replaced
from paritykit.harness.plants import register

CHECK = "sharding"


@register("sharded-fp-positions-after-row-wise-bucketing", check=CHECK)
def sharded_fp_positions_after_row_wise_bucketing() -> ContextManager[None]:
    """The sharded FP-EBC ignores the positions encoded before the input dist and recomputes them from
    the bucketised bags: an id's position among the ids its row-wise shard received, not in its bag."""
    from torchrec.distributed.fp_embeddingbag import ShardedFeatureProcessedEmbeddingBagCollection

    def planted(original):
        def apply_feature_processors_to_kjt_list(self, dist_input):
            for module in self._feature_processors.modules():
                if hasattr(module, "_pre_processed"):
                    module._pre_processed = False
            return original(self, dist_input)

        return apply_feature_processors_to_kjt_list

    return replaced(ShardedFeatureProcessedEmbeddingBagCollection, "apply_feature_processors_to_kjt_list", planted)


@register("sharded-fp-materialised-without-reset", check=CHECK)
def sharded_fp_materialised_without_reset() -> ContextManager[None]:
    """Sharding an FP-EBC built on the meta device allocates its position weights on the device but never
    resets them: they hold whatever memory they got instead of 1.0."""
    from torchrec.distributed import fp_embeddingbag

    def planted(original):
        def init_parameters(module, device):
            if any(param.is_meta for param in module.parameters()):
                module.to_empty(device=device)

        return init_parameters

    return replaced(fp_embeddingbag, "init_parameters", planted)


@register("position-weights-stale-after-to-empty", check=CHECK)
def position_weights_stale_after_to_empty() -> ContextManager[None]:
    """PositionWeightedModuleCollection stops re-pointing its forward's dict at the new parameters after a
    device move (``_apply``): materialised from meta with ``to_empty`` and loaded, it pools with the old ones."""
    from torch import nn
    from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection

    return replaced(PositionWeightedModuleCollection, "_apply", lambda original: nn.Module._apply)


@register("sharded-fp-state-dict-drops-position-weights", check=CHECK)
def sharded_fp_state_dict_drops_position_weights() -> ContextManager[None]:
    """The sharded FP-EBC's state_dict holds its tables only: the position weights are missing from it
    (a checkpoint of the sharded model loses them)."""
    from torchrec.distributed.fp_embeddingbag import ShardedFeatureProcessedEmbeddingBagCollection

    def drop(_module, state, prefix, _local_metadata):
        for key in [key for key in state if key.startswith(f"{prefix}_feature_processors.")]:
            del state[key]
        return state

    def planted(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            self._register_state_dict_hook(drop)

        return __init__

    return replaced(ShardedFeatureProcessedEmbeddingBagCollection, "__init__", planted)
