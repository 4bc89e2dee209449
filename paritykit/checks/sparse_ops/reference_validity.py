"""When a KeyedJaggedTensor a user hands to torchrec means something, in plain Python (no torch,
torchrec or fbgemm): the reference of torchrec's KJT validator (``validate_keyed_jagged_tensor``).

A ``RawKJT`` is what a user gives the KJT constructor, as lists: keys, the ids per key, lengths
and/or offsets, weights, an explicit batch size or (variable batch) samples per key per rank. It
means a batch when every rule below holds; ``kjt_problems`` lists the rules it breaks. The validator
judges user input before the input distribution, where a variable-batch KJT is one rank's: one
column of samples per key (torchrec's validator documents this scope, so the reference keeps it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RawKJT:
    keys: tuple[str, ...]
    values: tuple[int, ...]  # the ids, every key's one after the other
    lengths: tuple[int, ...] | None
    offsets: tuple[int, ...] | None
    weights: int | None  # how many weights (None: unweighted)
    stride: int | None  # the batch size given explicitly (fixed batch)
    strides: tuple[tuple[int, ...], ...] | None  # stride_per_key_per_rank (variable batch)


def rows(kjt: RawKJT) -> int:
    """How many rows (samples of all keys) the KJT claims: its lengths, else its offsets less one."""
    if kjt.lengths is not None:
        return len(kjt.lengths)
    return max(len(kjt.offsets or ()) - 1, 0)


def _length_problems(lengths: tuple[int, ...], values: int) -> list[str]:
    out = [f"lengths[{i}] = {n} is negative" for i, n in enumerate(lengths) if n < 0][:1]
    if sum(lengths) != values:
        out.append(f"the lengths sum to {sum(lengths)}, not the {values} values")
    return out


def _offset_problems(offsets: tuple[int, ...], values: int) -> list[str]:
    if not offsets:
        return ["offsets are empty (a batch of no rows has offsets [0])"]
    out = [] if offsets[0] == 0 else [f"offsets start at {offsets[0]}, not 0"]
    out += [f"offsets decrease at {i + 1} ({offsets[i]} -> {offsets[i + 1]})" for i in range(len(offsets) - 1)
            if offsets[i + 1] < offsets[i]][:1]
    if offsets[-1] != values:
        out.append(f"offsets end at {offsets[-1]}, not at the {values} values")
    return out


def _jagged_problems(kjt: RawKJT) -> list[str]:
    values = len(kjt.values)
    if kjt.lengths is None and kjt.offsets is None:
        return ["neither lengths nor offsets"]
    out = [] if kjt.lengths is None else _length_problems(kjt.lengths, values)
    out += [] if kjt.offsets is None else _offset_problems(kjt.offsets, values)
    if kjt.lengths is not None and kjt.offsets is not None:
        if len(kjt.offsets) != len(kjt.lengths) + 1:
            out.append(f"{len(kjt.offsets)} offsets for {len(kjt.lengths)} lengths")
        elif [b - a for a, b in zip(kjt.offsets, kjt.offsets[1:])] != list(kjt.lengths):
            out.append("the offsets are not the cumulative sum of the lengths")
    return out


def _batch_problems(kjt: RawKJT) -> list[str]:
    count, keys = rows(kjt), len(kjt.keys)
    if not keys:
        return [f"no keys but {count} rows"] if count else []
    if kjt.strides is None:
        if count % keys:
            return [f"{count} rows do not divide among {keys} keys"]
        if kjt.stride is not None and count != kjt.stride * keys:
            return [f"{count} rows are not {keys} keys of the batch size {kjt.stride}"]
        return []
    if len(kjt.strides) != keys:
        return [f"samples given for {len(kjt.strides)} keys, not the {keys} keys"]
    if any(len(per_rank) != 1 for per_rank in kjt.strides):
        return ["samples per key for several ranks (user input is one rank's)"]
    if any(n < 0 for per_rank in kjt.strides for n in per_rank):
        return ["a negative number of samples"]
    total = sum(n for per_rank in kjt.strides for n in per_rank)
    return [] if total == count else [f"samples per key sum to {total}, not the {count} rows"]


def kjt_problems(kjt: RawKJT) -> list[str]:
    """Every rule ``kjt`` breaks (empty: it means a batch)."""
    out = _jagged_problems(kjt)
    if len(set(kjt.keys)) != len(kjt.keys):
        out.append(f"keys repeat: {list(kjt.keys)}")
    out += _batch_problems(kjt)
    if kjt.weights is not None and kjt.weights != len(kjt.values):
        out.append(f"{kjt.weights} weights for {len(kjt.values)} values")
    return out


def ids_per_key(kjt: RawKJT) -> dict[str, tuple[int, ...]]:
    """Each key's ids (``kjt`` must mean a batch): its rows are consecutive, keys in order."""
    lengths = kjt.lengths if kjt.lengths is not None else tuple(b - a for a, b in zip(kjt.offsets, kjt.offsets[1:]))
    samples = [sum(s) for s in kjt.strides] if kjt.strides is not None else [len(lengths) // max(len(kjt.keys), 1)] * len(kjt.keys)
    out, row, start = {}, 0, 0
    for key, count in zip(kjt.keys, samples):
        size = sum(lengths[row : row + count])
        out[key] = kjt.values[start : start + size]
        row, start = row + count, start + size
    return out


def out_of_range(kjt: RawKJT, num_embeddings: dict[str, int]) -> list[str]:
    """The keys (of those a table serves) holding an id outside [0, num_embeddings)."""
    return [f"{key}: ids {min(ids)}..{max(ids)} outside [0, {num_embeddings[key]})"
            for key, ids in ids_per_key(kjt).items() if key in num_embeddings and ids and (min(ids) < 0 or max(ids) >= num_embeddings[key])]
