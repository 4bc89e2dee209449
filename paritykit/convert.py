"""TensorDict <-> KeyedJaggedTensor, complete and without reading device data.

The TensorDict form (the one torchrec's ``maybe_td_to_kjt`` reads, extended):

- one entry per feature, in KJT key order; the TensorDict's own batch size is ``[]`` because
  features may have different batch sizes;
- an unweighted feature is a jagged-layout nested tensor of ids, shape ``(B_f, j)``;
- a weighted feature is a sub-TensorDict with exactly two entries, ``"values"`` (the ids) and
  ``"weights"``, both jagged with the same rows (``kjt_to_td`` builds both on one offsets tensor,
  so they share their ragged dimension). A KJT has weights for all keys or for none, so a
  TensorDict must be weighted for every feature or for none;
- variable batch size per feature is simply a different ``B_f`` per feature; the KJT gets
  ``stride_per_key_per_rank = [[B_f], ...]`` (one rank) exactly when the batch sizes differ.

Every KJT from ``td_to_kjt`` carries ``stride``, ``stride_per_key``, ``length_per_key``,
``offset_per_key``, ``lengths_offset_per_key`` and ``index_per_key``, all taken from shapes: a
contiguous jagged tensor's values span exactly its rows (torch's own ``unbind`` relies on it), so
``values().size(0)`` is a feature's total length and ``size(0)`` its batch size. Only a
non-contiguous jagged tensor (built with both offsets and lengths, or by ``torch.nested.narrow``)
needs one read of its lengths, batched into a single read for all such features.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Iterable

import torch
from tensordict import TensorDict, TensorDictBase
from torch.nested._internal.nested_tensor import NestedTensor
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

VALUES_KEY = "values"
WEIGHTS_KEY = "weights"


@dataclass
class _Feature:
    """One feature's jagged pieces, already compacted when the input was non-contiguous."""

    key: str
    values: torch.Tensor
    offsets: torch.Tensor
    lengths: torch.Tensor | None  # only set for a non-contiguous input
    weights: torch.Tensor | None
    batch_size: int
    total_length: int | None  # None until a non-contiguous feature is compacted


def td_to_kjt(td: TensorDictBase, keys: Iterable[str] | None = None) -> KeyedJaggedTensor:
    """Build the KJT of ``td``'s features, in the order of ``keys`` (default: ``td``'s key order).

    ``keys`` may name any subset of the features, in any order. Raises KeyError for a key that is
    not in ``td``, TypeError/ValueError naming the feature at fault for anything that is not one
    id per position of a jagged-layout nested tensor, or that does not fit one KJT (mixed id dtypes,
    devices, weighted and unweighted features together).
    """
    if not isinstance(td, TensorDictBase):
        raise TypeError(f"td_to_kjt expects a TensorDict, got {type(td).__name__}")
    key_list = list(td.keys()) if keys is None else _checked_keys(td, keys)
    if not key_list:
        return KeyedJaggedTensor.empty(device=td.device)
    features = [_read_feature(key, td.get(key)) for key in key_list]
    _check_consistent(features)
    _compact_noncontiguous(features)
    return _assemble(key_list, features)


def kjt_to_td(kjt: KeyedJaggedTensor) -> TensorDict:
    """The TensorDict form of ``kjt`` (see the module docstring), one jagged tensor per key.

    Uses the KJT's own ``length_per_key`` (cached on a KJT from ``td_to_kjt``; a KJT built from
    lengths alone computes it the way every KJT consumer does). A KJT with more than one rank per
    key in ``stride_per_key_per_rank`` (the output of an input all-to-all) has no TensorDict form:
    its rank split would be lost, so it raises ValueError.
    """
    if not isinstance(kjt, KeyedJaggedTensor):
        raise TypeError(f"kjt_to_td expects a KeyedJaggedTensor, got {type(kjt).__name__}")
    keys = kjt.keys()
    if not keys:
        return TensorDict({}, batch_size=[], device=kjt.device())
    if kjt.variable_stride_per_key():
        ranks = kjt._stride_per_key_per_rank.size(1)  # host metadata, rectangular: keys x ranks
        if ranks != 1:
            raise ValueError(
                f"kjt_to_td: keys {keys} have batch sizes from {ranks} ranks each in stride_per_key_per_rank "
                f"({kjt.stride_per_key_per_rank()}); a TensorDict holds one batch per feature"
            )
    strides = kjt.stride_per_key()
    lengths = kjt.lengths()
    offsets_per_key = _offsets_per_key(lengths, strides, len(keys), kjt.variable_stride_per_key())
    values_per_key = torch.split(kjt.values(), kjt.length_per_key())
    weights = kjt.weights_or_none()
    weights_per_key = torch.split(weights, kjt.length_per_key()) if weights is not None else None
    entries: dict[str, torch.Tensor | TensorDict] = {}
    for i, key in enumerate(keys):
        ids = torch.nested.nested_tensor_from_jagged(values_per_key[i], offsets=offsets_per_key[i])
        if weights_per_key is None:
            entries[key] = ids
        else:
            # The same offsets tensor gives both the same ragged dimension.
            w = torch.nested.nested_tensor_from_jagged(weights_per_key[i], offsets=offsets_per_key[i])
            entries[key] = TensorDict({VALUES_KEY: ids, WEIGHTS_KEY: w}, batch_size=[])
    return TensorDict(entries, batch_size=[], device=kjt.device())


# ---------------------------------------------------------------- reading the TensorDict


def _checked_keys(td: TensorDictBase, keys: Iterable[str]) -> list[str]:
    key_list = list(keys)
    present = set(td.keys())
    missing = [key for key in key_list if key not in present]
    if missing:
        raise KeyError(f"td_to_kjt: keys {missing} are not in the TensorDict (it has {list(td.keys())})")
    if len(set(key_list)) != len(key_list):
        repeated = sorted({key for key in key_list if key_list.count(key) > 1})
        raise ValueError(f"td_to_kjt: keys {repeated} are asked for more than once")
    return key_list


def _read_feature(key: str, entry: object) -> _Feature:
    weights = None
    if isinstance(entry, TensorDictBase):
        names = set(entry.keys())
        if names != {VALUES_KEY, WEIGHTS_KEY}:
            raise ValueError(
                f"td_to_kjt: feature {key!r} is a sub-TensorDict with entries {sorted(names)}; a weighted "
                f"feature has exactly {VALUES_KEY!r} and {WEIGHTS_KEY!r}"
            )
        ids = _jagged(key, entry.get(VALUES_KEY), VALUES_KEY)
        weights = _jagged(key, entry.get(WEIGHTS_KEY), WEIGHTS_KEY)
        _check_weights_match(key, ids, weights)
    else:
        ids = _jagged(key, entry, None)
    # The inner tensors are read as attributes (as torchrec does): values()/offsets() are ops that
    # go through the nested tensor's dispatch and cost more than the whole conversion otherwise.
    values = ids._values
    if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
        raise TypeError(f"td_to_kjt: feature {key!r} has ids of dtype {values.dtype}; ids must be integers")
    lengths = ids._lengths
    return _Feature(
        key=key,
        values=values,
        offsets=ids._offsets,
        lengths=lengths,
        weights=None if weights is None else weights._values,
        batch_size=ids._offsets.size(0) - 1,
        total_length=values.size(0) if lengths is None else None,
    )


def _jagged(key: str, tensor: object, part: str | None) -> torch.Tensor:
    # Only jagged-layout nested tensors are NestedTensor instances; checking the type is far
    # cheaper than asking is_nested/layout, which dispatch through the nested tensor.
    if isinstance(tensor, NestedTensor) and tensor._values.dim() == 1 and tensor._ragged_idx == 1:
        return tensor
    where = f"feature {key!r}" if part is None else f"feature {key!r} ({part})"
    if not isinstance(tensor, torch.Tensor) or not tensor.is_nested:
        raise TypeError(
            f"td_to_kjt: {where} is a {type(tensor).__name__}"
            f"{'' if not isinstance(tensor, torch.Tensor) else ' (not nested)'}; "
            "expected a nested tensor with layout=torch.jagged"
        )
    if tensor.layout != torch.jagged:
        raise TypeError(
            f"td_to_kjt: {where} is a nested tensor with layout {tensor.layout}; expected torch.jagged "
            "(e.g. torch.nested.nested_tensor(list(t.unbind()), layout=torch.jagged))"
        )
    if tensor._values.dim() != 1 or tensor._ragged_idx != 1:
        raise ValueError(
            f"td_to_kjt: {where} has shape {tuple(tensor.shape)} (ragged dim {tensor._ragged_idx}); "
            "expected (batch, jagged) with one scalar per position"
        )
    return tensor


def _check_weights_match(key: str, ids: torch.Tensor, weights: torch.Tensor) -> None:
    if weights.size(0) != ids.size(0):
        raise ValueError(f"td_to_kjt: feature {key!r}: weights have batch size {weights.size(0)}, ids {ids.size(0)}")
    if not weights.values().is_floating_point():
        raise TypeError(f"td_to_kjt: feature {key!r}: weights have dtype {weights.values().dtype}; expected floating point")
    if weights.offsets() is ids.offsets() and weights._lengths is ids._lengths:
        return
    if weights._lengths is not None or ids._lengths is not None:
        raise ValueError(
            f"td_to_kjt: feature {key!r}: a non-contiguous weighted feature needs weights built on the ids' "
            "own offsets and lengths tensors"
        )
    if weights.values().size(0) != ids.values().size(0):
        raise ValueError(
            f"td_to_kjt: feature {key!r}: weights hold {weights.values().size(0)} values, ids {ids.values().size(0)}"
        )
    # Distinct but equal offsets are fine; comparing them is only free when they live on the host.
    if ids.offsets().device.type == "cpu" and not torch.equal(weights.offsets(), ids.offsets()):
        raise ValueError(f"td_to_kjt: feature {key!r}: weights and ids have different row lengths")


def _check_consistent(features: list[_Feature]) -> None:
    first = features[0]
    for feature in features[1:]:
        if feature.values.dtype != first.values.dtype:
            raise TypeError(
                f"td_to_kjt: feature {feature.key!r} has ids of dtype {feature.values.dtype} but "
                f"{first.key!r} has {first.values.dtype}; one KJT holds one ids dtype"
            )
        if feature.values.device != first.values.device:
            raise ValueError(
                f"td_to_kjt: feature {feature.key!r} is on {feature.values.device} but {first.key!r} is on "
                f"{first.values.device}"
            )
    weighted = [f.key for f in features if f.weights is not None]
    if weighted and len(weighted) != len(features):
        unweighted = [f.key for f in features if f.weights is None]
        raise ValueError(
            f"td_to_kjt: features {unweighted} have no weights but {weighted} do; a KJT is weighted for "
            "every key or for none"
        )
    if weighted:
        dtypes = {f.weights.dtype for f in features}
        if len(dtypes) > 1:
            odd = next(f.key for f in features if f.weights.dtype != first.weights.dtype)
            raise TypeError(
                f"td_to_kjt: feature {odd!r} has weights of another dtype than {first.key!r} ({sorted(map(str, dtypes))})"
            )


def _compact_noncontiguous(features: list[_Feature]) -> None:
    """Gather the rows of non-contiguous features into contiguous values, with one host read in all."""
    ragged = [f for f in features if f.lengths is not None]
    if not ragged:
        return
    totals = torch.stack([f.lengths.sum() for f in ragged]).tolist()
    for feature, total in zip(ragged, totals):
        starts = feature.offsets[:-1]
        lengths = feature.lengths
        # Position p of row r comes from starts[r] + (p - first position of row r).
        new_starts = torch.cumsum(lengths, 0) - lengths
        shift = torch.repeat_interleave(starts - new_starts, lengths, output_size=total)
        index = torch.arange(total, device=lengths.device, dtype=shift.dtype) + shift
        feature.values = feature.values.index_select(0, index)
        if feature.weights is not None:
            feature.weights = feature.weights.index_select(0, index)
        feature.offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0).to(lengths.dtype)])
        feature.lengths = None
        feature.total_length = total


# ---------------------------------------------------------------- building the KJT


def _assemble(keys: list[str], features: list[_Feature]) -> KeyedJaggedTensor:
    batch_sizes = [f.batch_size for f in features]
    length_per_key = [f.total_length for f in features]
    variable_batch = len(set(batch_sizes)) > 1
    values = torch.cat([f.values for f in features]) if len(features) > 1 else features[0].values
    weights = None
    if features[0].weights is not None:
        weights = torch.cat([f.weights for f in features]) if len(features) > 1 else features[0].weights
    lengths = _lengths_from_offsets([f.offsets for f in features], batch_sizes, variable_batch)
    return KeyedJaggedTensor(
        keys=keys,
        values=values,
        weights=weights,
        lengths=lengths,
        stride=max(batch_sizes),
        stride_per_key_per_rank=[[b] for b in batch_sizes] if variable_batch else None,
        stride_per_key=batch_sizes,
        length_per_key=length_per_key,
        offset_per_key=[0, *accumulate(length_per_key)],
        lengths_offset_per_key=[0, *accumulate(batch_sizes)],
        index_per_key={key: i for i, key in enumerate(keys)},
    )


def _lengths_from_offsets(offsets: list[torch.Tensor], batch_sizes: list[int], variable_batch: bool) -> torch.Tensor:
    dtype = offsets[0].dtype
    if any(o.dtype != dtype for o in offsets):
        dtype = torch.int64
        offsets = [o.to(dtype) for o in offsets]
    if not variable_batch:
        # One diff over all keys: row k of the (K, B+1) matrix is key k's offsets.
        return torch.cat(offsets).view(len(offsets), batch_sizes[0] + 1).diff(dim=1).reshape(-1)
    return torch.cat([o.diff() for o in offsets])


def _offsets_per_key(lengths: torch.Tensor, strides: list[int], num_keys: int, variable_batch: bool) -> list[torch.Tensor]:
    if not variable_batch:
        per_key = lengths.view(num_keys, strides[0])
        zeros = per_key.new_zeros((num_keys, 1))
        return list(torch.cat([zeros, torch.cumsum(per_key, dim=1).to(lengths.dtype)], dim=1).unbind(0))
    return [
        torch.cat([chunk.new_zeros(1), torch.cumsum(chunk, 0).to(lengths.dtype)]) for chunk in torch.split(lengths, strides)
    ]
