"""Planted bugs in torchrec's checkpoint paths, for the checkpoint check's negative controls.

Each stands for a realistic defect in what a resume runs: the fused optimizer's ``load_state_dict``,
the sharded modules' load hook that turns a ShardedTensor back into the local weights, and the
``post_load_state_dict`` call that lets a wrapped optimizer (a warm-up) restore what it derives from
its state. None of them touches training itself, so the run that never reloads and the unsharded
model are unaffected: only a comparison across the reload can see them.
"""

from __future__ import annotations

from typing import Any, ContextManager

from paritykit.harness.patching import replaced, replaced_all
from paritykit.harness.planted_loads import cw_shards_loaded_in_reverse
from paritykit.harness.plants import register

CHECK = "checkpoint"


@register("fused-optimizer-load-drops-momentum", check=CHECK)
def fused_optimizer_load_drops_momentum() -> ContextManager[None]:
    """KeyedOptimizer.load_state_dict copies sharded optimizer state only into shards it had to resize
    (the copy slipped into the resize branch): a reload keeps the fresh momentum of every table."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torchrec.optim.keyed import KeyedOptimizer

    def planted(original: Any) -> Any:
        # torchrec's own parameter names: its load_state_dict passes them by keyword.
        def update(current_param_state_dict: dict[str, Any], param_state_dict_to_load: dict[str, Any],
                   parent_keys: list[Any]) -> None:
            current, to_load = current_param_state_dict, param_state_dict_to_load
            kept = {k: v for k, v in current.items() if not _same_shapes(v, to_load.get(k), ShardedTensor)}
            original(kept, {k: to_load[k] for k in kept}, parent_keys)
            current.update(kept)

        return staticmethod(update)

    return replaced(KeyedOptimizer, "_update_param_state_dict_object", planted)


def _same_shapes(value: Any, new: Any, sharded: type) -> bool:
    if not isinstance(value, sharded) or not isinstance(new, sharded):
        return False
    return all(a.tensor.shape == b.tensor.shape for a, b in zip(value.local_shards(), new.local_shards()))


@register("sharded-load-ignores-shard-offsets", check=CHECK)
def sharded_load_ignores_shard_offsets() -> ContextManager[None]:
    """The sharded EBC/EC load hook merges a rank's column-wise shards of one table in the reverse of
    their order (not by offset): a rank holding two CW shards of a table loads each into the other's columns."""
    return cw_shards_loaded_in_reverse()


@register("post-load-state-dict-not-called", check=CHECK)
def post_load_state_dict_not_called() -> ContextManager[None]:
    """KeyedOptimizer and OptimizerWrapper.load_state_dict no longer call post_load_state_dict: a
    WarmupOptimizer resumes with the learning rate of its construction, not of its loaded iteration."""
    from torchrec.optim.keyed import KeyedOptimizer, OptimizerWrapper

    def planted(original: Any) -> Any:
        def load_state_dict(self: Any, state_dict: Any) -> None:
            self.post_load_state_dict = lambda: None
            try:
                original(self, state_dict)
            finally:
                del self.post_load_state_dict

        return load_state_dict

    return replaced_all((cls, "load_state_dict", planted) for cls in (KeyedOptimizer, OptimizerWrapper))
