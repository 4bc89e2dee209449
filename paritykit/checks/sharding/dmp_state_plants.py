"""Planted bugs in the torchrec code the resharding and state-surface cases cover
(dmp_reshard_cases.py, dmp_surface.py): dynamic resharding's row-wise optimizer state, DMP's
buffer listing, a sharded state dict's load and the EC's DTensor state dict. Registered for the sharding
check (plants.py imports this module); each is shown by tests/test_dmp_state_plants.py to move
torchrec's own state and to be caught. None touches the unsharded module. The split of a column block
(three ranks) has its planted bug in tests/test_dmp_state_plants.py, applied on the ranks by the test:
``paritykit selftest`` runs the catalog on two ranks, where no reshard splits a block.
"""

from __future__ import annotations

from typing import Any, ContextManager

from paritykit.harness.patching import replaced
from paritykit.harness.planted_loads import cw_shards_loaded_in_reverse
from paritykit.harness.plants import register

CHECK = "sharding"


@register("reshard-row-wise-state-not-copied", check=CHECK)
def reshard_row_wise_state_not_copied() -> ContextManager[None]:
    """A resharded table's 1-D optimizer state (row-wise Adagrad's accumulator) is reset after the transfer:
    the moved tables restart row-wise Adagrad from zero; 2-D state (Adagrad) still moves."""
    from torchrec.distributed import embeddingbag

    def planted(original: Any) -> Any:
        def update(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            changed = kwargs.get("changed_sharding_params", {})
            state = (kwargs.get("new_optimizer_state") or {}).get("state", {})
            for key, entries in state.items():
                if key.split(".")[-2] in changed:
                    for value in entries.values():
                        for shard in getattr(value, "local_shards", lambda: [])():
                            if shard.tensor.dim() == 1:
                                shard.tensor.zero_()
            return result

        return update

    # The sharded EBC calls the name it imported from dynamic_sharding.
    return replaced(embeddingbag, "update_state_dictionaries", planted)


@register("dmp-named-buffers-recurse-into-sharded", check=CHECK)
def dmp_named_buffers_recurse_into_sharded() -> ContextManager[None]:
    """DMP.named_buffers lists every plain module's buffers recursively, so the internal buffers of the
    sharded modules' kernels appear under their internal names."""
    from torchrec.distributed.model_parallel import DistributedModelParallel

    def planted(original: Any) -> Any:
        def named_buffers(self, module, prefix="", recurse=True):
            yield from original(self, module, prefix, recurse)
            yield from module.named_buffers(prefix)

        return named_buffers

    return replaced(DistributedModelParallel, "_named_buffers", planted)


@register("sharded-state-load-reverses-cw-shards", check=CHECK)
def sharded_state_load_reverses_cw_shards() -> ContextManager[None]:
    """The sharded EBC/EC load hook merges a rank's column-wise shards of one table in reverse order: a
    rank holding two shards of a table (column-wise [0, 1, 0]) loads each into the other's columns."""
    return cw_shards_loaded_in_reverse()


@register("ec-dtensor-state-dict-drops-tables", check=CHECK)
def ec_dtensor_state_dict_drops_tables() -> ContextManager[None]:
    """A sharded EmbeddingCollection built with output_dtensor forgets its tables' DTensors: its state
    dict no longer holds them."""
    from torchrec.distributed.embedding import ShardedEmbeddingCollection

    def planted(original: Any) -> Any:
        def initialize(self, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            self._model_parallel_name_to_dtensor = {}
            return result

        return initialize

    return replaced(ShardedEmbeddingCollection, "_initialize_torch_state", planted)
