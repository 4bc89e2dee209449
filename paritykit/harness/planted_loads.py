"""A planted bug in torchrec's sharded load that two checks aim at (the checkpoint round trip and the
sharding check's state surface): one body, so both catch the same defect."""

from __future__ import annotations

from typing import Any, ContextManager

from paritykit.harness.patching import replaced_all


def cw_shards_loaded_in_reverse() -> ContextManager[None]:
    """The sharded EBC/EC load hook merges a rank's column-wise shards of one table in reverse order:
    a rank holding two shards of a table loads each into the other's columns."""
    from torchrec.distributed.embedding import ShardedEmbeddingCollection
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    return replaced_all((cls, "_pre_load_state_dict_hook", _reversed_local_shards)
                        for cls in (ShardedEmbeddingBagCollection, ShardedEmbeddingCollection))


def _reversed_local_shards(original: Any) -> Any:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    def hook(self: Any, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        for value in state_dict.values():
            if isinstance(value, ShardedTensor) and len(value.local_shards()) > 1:
                shards = list(reversed(value.local_shards()))
                value.local_shards = lambda shards=shards: shards
        original(self, state_dict, prefix, *args)

    return staticmethod(hook)
