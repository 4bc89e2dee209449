"""Which rows of each table a step's lookups read, recorded on the unsharded model.

fbgemm's fused optimizers step only the rows a batch looked up: weight decay, counters and moving
averages leave every other row alone. The reference learns those rows the way the sharded kernels
do, from the ids: a forward pre-hook on each embedding module reads its KeyedJaggedTensor (a
TensorDict through torchrec's own conversion, as the module does) and adds,
for every table, the ids of the features that table reads (a feature shared by two tables touches
both). ``take()`` returns {id(table parameter): sorted rows} for the step and starts afresh.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paritykit.errors import HarnessError
from paritykit.harness.inputs import table_configs
from paritykit.harness.plan_resolution import sharder_of


def _tables_by_feature(module: nn.Module) -> dict[str, list[torch.nn.Parameter]]:
    configs = table_configs(module)  # a feature-processed EBC's are its inner EBC's
    params = sharder_of(module).shardable_parameters(module)
    found: dict[str, list[torch.nn.Parameter]] = {}
    for config in configs:
        for feature in config.feature_names:
            found.setdefault(feature, []).append(params[config.name])
    return found


class TouchedRows:
    """Records the ids every embedding module of ``modules`` ({fqn: module}) looks up."""

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        self._rows: dict[int, list[torch.Tensor]] = {}
        self._handles = []
        for fqn, module in modules.items():
            if isinstance(module, (nn.EmbeddingBag, nn.Embedding)):
                # torch's own modules (sharded by torchrec's EmbeddingBagSharder) read ids as a tensor.
                self._handles.append(module.register_forward_pre_hook(self._torch_hook(module), with_kwargs=True))
                continue
            tables = _tables_by_feature(module)
            self._handles.append(module.register_forward_pre_hook(self._hook(fqn, tables), with_kwargs=True))

    def _torch_hook(self, module: nn.Module):
        def record(_module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
            ids = args[0] if args else kwargs["input"]
            self._rows.setdefault(id(module.weight), []).append(ids.detach().reshape(-1).to("cpu", torch.int64))

        return record

    def _hook(self, fqn: str, tables: dict[str, list[torch.nn.Parameter]]):
        def record(_module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
            features = args[0] if args else kwargs.get("features")
            if features is not None and not hasattr(features, "length_per_key"):
                from torchrec.sparse.tensor_dict import maybe_td_to_kjt

                features = maybe_td_to_kjt(features, None)  # a TensorDict, as the module itself reads it
            if features is None or not hasattr(features, "length_per_key"):
                raise HarnessError(f"embedding module {fqn!r} was called without a KeyedJaggedTensor; "
                                   "the reference cannot tell which rows its fused optimizer steps")
            values = features.values().split(features.length_per_key())
            for key, ids in zip(features.keys(), values):
                for param in tables.get(key, ()):
                    self._rows.setdefault(id(param), []).append(ids.detach().to("cpu", torch.int64))

        return record

    def take(self) -> dict[int, torch.Tensor]:
        taken = {key: torch.unique(torch.cat(ids)) for key, ids in self._rows.items()}
        self._rows = {}
        return taken

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
