"""What the embedding modules of a model returned at each forward, keyed so that two runs compare.

A forward hook on every shardable module (EBC, EC, ...) records its output by key: a KeyedTensor
as {key: tensor} plus its key order, an EmbeddingCollection's {feature: JaggedTensor} as it is.
Comparing by key separates a wrong number (torchrec's sharded lookup) from a different key order
(harmless to a model that indexes by key, fatal to one that reads ``KeyedTensor.values()`` by
position: a sharded EBC orders its keys by placement, not by table).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paritykit.engine.outputs import to_cpu


class EmbeddingProbe:
    """Records, per forward, {module fqn: {"by_key": ..., "key_order": [...]}} of the given modules."""

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        self.calls: list[dict[str, Any]] = []
        self._current: dict[str, Any] = {}
        self._handles = [module.register_forward_hook(self._hook(fqn)) for fqn, module in modules.items()]

    def _hook(self, fqn: str):
        def record(_module: nn.Module, _args: Any, output: Any) -> None:
            self._current[fqn] = output

        return record

    def take(self) -> dict[str, Any]:
        """What the last forward recorded (resolved to CPU), then start afresh."""
        taken = {fqn: by_key(output) for fqn, output in self._current.items()}
        self._current = {}
        return taken

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def by_key(output: Any) -> dict[str, Any]:
    output = to_cpu(output)
    if type(output).__name__ == "KeyedTensor":
        return {"by_key": dict(output.to_dict()), "key_order": list(output.keys())}
    if isinstance(output, dict):
        return {"by_key": dict(output), "key_order": list(output.keys())}
    if isinstance(output, torch.Tensor):
        return {"by_key": {"": output}, "key_order": [""]}
    return {"by_key": {"": output}, "key_order": [""]}
