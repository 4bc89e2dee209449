"""The same batches with their sparse features as TensorDicts, and whether this torchrec takes them.

torchrec takes a TensorDict of jagged tensors wherever a sharded EmbeddingBagCollection takes a KJT:
its ``input_dist`` converts the TensorDict with ``torchrec.sparse.tensor_dict.maybe_td_to_kjt``,
already in the order its sharding needs. The pipelines never look inside a batch: they move it with
``batch.to``, trace which attribute feeds each sharded module, and hand that attribute to
``input_dist``. So TD batches reach the same conversion on every pipeline, and a pipeline fed TD
batches must compute exactly what it computes from the same data as KJTs.

What torchrec's TD input cannot carry is detected by feature (an import, a signature, one call),
never by version: a torchrec without the conversion, or whose sharded EBC does not accept a
TensorDict, takes no TD batches; ``maybe_td_to_kjt`` reads ``_values``/``_lengths`` of plain jagged
tensors only, so per-id weights (paritykit's weighted TD form) are refused. A batch's weighted
features therefore stay KJTs.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch

from paritykit.convert import kjt_to_td, td_to_kjt
from paritykit.errors import HarnessError, UnsupportedByTorchrec
from paritykit.harness.inputs import feature_bounds, validate_kjt


def td_input_unsupported() -> str:
    """Why this torchrec's sharded EmbeddingBagCollection takes no TensorDict, or "" when it does."""
    try:
        from torchrec.sparse.tensor_dict import maybe_td_to_kjt  # noqa: F401 - its presence is the feature
    except ImportError:
        return "this torchrec has no TensorDict input (torchrec.sparse.tensor_dict.maybe_td_to_kjt is missing)"
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    parameter = inspect.signature(ShardedEmbeddingBagCollection.input_dist).parameters.get("features")
    if parameter is None or "TensorDict" not in str(parameter.annotation):
        return "this torchrec's sharded EmbeddingBagCollection.input_dist does not take a TensorDict"
    return ""


def weighted_td_unsupported() -> str:
    """Why a weighted TensorDict cannot stand in for a weighted KJT, or "" when torchrec keeps the weights."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    reason = td_input_unsupported()
    if reason:
        return reason
    from torchrec.sparse.tensor_dict import maybe_td_to_kjt

    weighted = KeyedJaggedTensor(keys=["f"], values=torch.tensor([1, 2]), lengths=torch.tensor([2]), weights=torch.tensor([0.5, 2.0]))
    try:
        converted = maybe_td_to_kjt(kjt_to_td(weighted))
    except Exception as exc:  # noqa: BLE001 - any refusal is the answer
        return f"torchrec's maybe_td_to_kjt refuses per-id weights ({type(exc).__name__}: {exc})"
    if converted.weights_or_none() is None:
        return "torchrec's maybe_td_to_kjt drops per-id weights"
    return ""


def to_td_batch(batch: Any) -> Any:
    """``batch`` with every unweighted KJT (itself, or a dataclass field such as ModelInput's
    ``idlist_features``) replaced by its TensorDict; weighted KJTs stay (see the module docstring)."""
    if _is_unweighted_kjt(batch):
        return kjt_to_td(batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        changes = {f.name: kjt_to_td(getattr(batch, f.name)) for f in dataclasses.fields(batch) if _is_unweighted_kjt(getattr(batch, f.name))}
        return dataclasses.replace(batch, **changes)
    return batch


def to_td_batches(batches: list[list[Any]]) -> list[list[Any]]:
    """``batches[step][rank]`` with sparse features as TensorDicts; HarnessError if none had any."""
    converted = [[to_td_batch(batch) for batch in per_rank] for per_rank in batches]
    if not any(td_features(batch) for per_rank in converted for batch in per_rank):
        raise HarnessError("the batches have no unweighted KeyedJaggedTensor to give as a TensorDict")
    return converted


def td_features(batch: Any) -> list[tuple[str, Any]]:
    """(path, TensorDict) for every TensorDict in a batch: itself or a dataclass field."""
    if _is_td(batch):
        return [("batch", batch)]
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return [(f"batch.{f.name}", getattr(batch, f.name)) for f in dataclasses.fields(batch) if _is_td(getattr(batch, f.name))]
    return []


def check_td_batches(batches: list[list[Any]], model: torch.nn.Module) -> None:
    """Every TensorDict in the batches as a valid KJT of the model's features, before any rank runs:
    HarnessError naming step, rank and feature; UnsupportedByTorchrec where torchrec takes no such TD."""
    reason = td_input_unsupported()
    if reason:
        raise UnsupportedByTorchrec(reason)
    bounds = feature_bounds(model)
    for step, per_rank in enumerate(batches):
        for rank, batch in enumerate(per_rank):
            for path, td in td_features(batch):
                where = f"step {step}, rank {rank}, {path}"
                try:
                    kjt = td_to_kjt(td)
                except (TypeError, ValueError, KeyError) as exc:
                    raise HarnessError(f"{where}: not a TensorDict of jagged id tensors: {exc}") from exc
                if kjt.weights_or_none() is not None and (why := weighted_td_unsupported()):
                    raise UnsupportedByTorchrec(f"{where}: weighted features as a TensorDict: {why}")
                validate_kjt(kjt, where, bounds)


def _is_unweighted_kjt(value: Any) -> bool:
    return type(value).__name__ == "KeyedJaggedTensor" and value.weights_or_none() is None


def _is_td(value: Any) -> bool:
    from tensordict import TensorDictBase

    return isinstance(value, TensorDictBase)
