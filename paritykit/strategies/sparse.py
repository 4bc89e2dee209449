"""Hypothesis strategies for sparse batches, as KJTs and as TensorDicts of jagged tensors.

A ``SparseBatch`` is drawn as structure (keys, batch size per key, length of every row, dtypes,
weighted or not) plus a seed for the ids and weights, so its repr is short enough to replay and
hypothesis shrinks the structure. It builds its KJT and its TensorDict independently of
``paritykit.convert``, which makes each an oracle for the conversion of the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from hypothesis import strategies as st
from tensordict import TensorDict
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from paritykit.convert import VALUES_KEY, WEIGHTS_KEY

# Every way torch.nested builds a jagged-layout tensor of ids. The last two are non-contiguous.
JAGGED_FORMS = (
    "from_jagged_offsets",  # nested_tensor_from_jagged(values, offsets=...)
    "from_jagged_lengths",  # nested_tensor_from_jagged(values, lengths=...): contiguous, offsets derived
    "nested_tensor",  # torch.nested.nested_tensor(list of rows, layout=torch.jagged)
    "as_nested_tensor",  # torch.nested.as_nested_tensor(list of rows, layout=torch.jagged)
    "from_jagged_offsets_lengths",  # rows inside a larger buffer, with gaps: offsets and lengths
    "narrow",  # torch.nested.narrow of a padded dense tensor
)
CONTIGUOUS_FORMS = JAGGED_FORMS[:4]
# Forms whose offsets dtype torch fixes at int64 whatever the batch asks for.
INT64_OFFSETS_FORMS = frozenset({"from_jagged_lengths", "nested_tensor", "as_nested_tensor"})
# Padding slots a non-contiguous form leaves before each row (so gaps are real).
_GAP = 2


@dataclass(frozen=True)
class SparseBatch:
    """One sparse batch: ``lengths[k][r]`` ids in row ``r`` of feature ``keys[k]``.

    Ids of feature k lie in ``[0, id_bounds[k])``; ids and weights come from ``seed``.
    """

    keys: tuple[str, ...]
    lengths: tuple[tuple[int, ...], ...]
    id_bounds: tuple[int, ...]
    seed: int
    weighted: bool = False
    id_dtype: torch.dtype = torch.int64
    offsets_dtype: torch.dtype = torch.int64

    # ------------------------------------------------------------ shape facts

    @property
    def batch_sizes(self) -> list[int]:
        return [len(rows) for rows in self.lengths]

    @property
    def variable_batch(self) -> bool:
        return len(set(self.batch_sizes)) > 1

    @property
    def length_per_key(self) -> list[int]:
        return [sum(rows) for rows in self.lengths]

    # ------------------------------------------------------------ contents

    @cached_property
    def _contents(self) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        generator = torch.Generator().manual_seed(self.seed)
        ids = [
            torch.randint(0, bound, (total,), generator=generator, dtype=torch.int64).to(self.id_dtype)
            for bound, total in zip(self.id_bounds, self.length_per_key)
        ]
        weights = None
        if self.weighted:
            weights = [torch.rand(total, generator=generator) for total in self.length_per_key]
        return ids, weights

    def ids(self, key: str) -> torch.Tensor:
        return self._contents[0][self.keys.index(key)]

    def weights(self, key: str) -> torch.Tensor:
        if self._contents[1] is None:
            raise ValueError("this batch is not weighted")
        return self._contents[1][self.keys.index(key)]

    # ------------------------------------------------------------ the two forms

    def to_kjt(
        self,
        device: str | torch.device = "cpu",
        lengths_dtype: torch.dtype | None = None,
        keys: list[str] | tuple[str, ...] | None = None,
    ) -> KeyedJaggedTensor:
        """The KJT of ``keys`` (default: all, in order), built directly from the drawn rows.

        Variable batch size per key (one rank) exactly when the chosen keys' batch sizes differ.
        """
        chosen = [self.keys.index(key) for key in (self.keys if keys is None else keys)]
        ids, weights = self._contents
        dtype = lengths_dtype or self.offsets_dtype
        lengths = torch.tensor([n for k in chosen for n in self.lengths[k]], dtype=dtype)
        values = torch.cat([ids[k] for k in chosen]) if chosen else torch.empty(0, dtype=self.id_dtype)
        sizes = [self.batch_sizes[k] for k in chosen]
        variable = len(set(sizes)) > 1
        return KeyedJaggedTensor(
            keys=[self.keys[k] for k in chosen],
            values=values.to(device),
            weights=torch.cat([weights[k] for k in chosen]).to(device) if weights is not None else None,
            lengths=lengths.to(device),
            stride=None if variable else sizes[0],
            stride_per_key_per_rank=[[b] for b in sizes] if variable else None,
        )

    def kjt_lengths_dtype(self, form: str) -> torch.dtype:
        """The lengths dtype of the KJT that ``form``'s TensorDict converts to."""
        return torch.int64 if form in INT64_OFFSETS_FORMS else self.offsets_dtype

    def to_td(self, form: str = "from_jagged_offsets", device: str | torch.device = "cpu") -> TensorDict:
        """The TensorDict form (see paritykit.convert), each feature built the way ``form`` says."""
        if form not in JAGGED_FORMS:
            raise ValueError(f"unknown jagged form {form!r}; known: {JAGGED_FORMS}")
        ids, weights = self._contents
        entries = {}
        for k, key in enumerate(self.keys):
            rows = self.lengths[k]
            w = None if weights is None else weights[k].to(device)
            entries[key] = _build_feature(form, ids[k].to(device), w, rows, self.offsets_dtype, device)
        return TensorDict(entries, batch_size=[])


def _build_feature(
    form: str, ids: torch.Tensor, weights: torch.Tensor | None, rows: tuple[int, ...], offsets_dtype: torch.dtype, device
) -> torch.Tensor | TensorDict:
    lengths = torch.tensor(rows, dtype=offsets_dtype, device=device)
    offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0).to(offsets_dtype)])
    njt_weights = None
    if form == "from_jagged_offsets":
        njt = torch.nested.nested_tensor_from_jagged(ids, offsets=offsets)
    elif form == "from_jagged_lengths":
        njt = torch.nested.nested_tensor_from_jagged(ids, lengths=lengths)
    elif form in ("nested_tensor", "as_nested_tensor"):
        build = torch.nested.nested_tensor if form == "nested_tensor" else torch.nested.as_nested_tensor
        njt = build(list(torch.split(ids, list(rows))), layout=torch.jagged)
    elif form == "from_jagged_offsets_lengths":
        # Row r starts _GAP slots after row r-1 ends; the gaps hold junk ids (-1) that must not leak.
        starts = offsets[:-1] + _GAP * torch.arange(1, len(rows) + 1, dtype=offsets_dtype, device=device)
        buffer = _scatter_rows(ids, rows, starts, len(ids) + _GAP * (len(rows) + 1), fill=-1)
        njt = torch.nested.nested_tensor_from_jagged(
            buffer, offsets=torch.cat([starts, starts.new_full((1,), buffer.numel())]), lengths=lengths
        )
        if weights is not None:
            wbuffer = _scatter_rows(weights, rows, starts, buffer.numel(), fill=float("nan"))
            njt_weights = torch.nested.nested_tensor_from_jagged(wbuffer, offsets=njt._offsets, lengths=njt._lengths)
    elif form == "narrow":
        width = max(rows, default=0) + _GAP
        starts = torch.tensor([r % (_GAP + 1) for r in range(len(rows))], dtype=offsets_dtype, device=device)
        dense = torch.full((len(rows), width), -1, dtype=ids.dtype, device=device)
        flat_starts = starts + width * torch.arange(len(rows), dtype=offsets_dtype, device=device)
        dense.view(-1).copy_(_scatter_rows(ids, rows, flat_starts, dense.numel(), fill=-1))
        njt = torch.nested.narrow(dense, 1, starts, lengths, layout=torch.jagged)
        if weights is not None:
            wbuffer = _scatter_rows(weights, rows, flat_starts, dense.numel(), fill=float("nan"))
            njt_weights = torch.nested.nested_tensor_from_jagged(wbuffer, offsets=njt._offsets, lengths=njt._lengths)
    else:  # pragma: no cover - guarded by to_td
        raise ValueError(form)
    if weights is None:
        return njt
    if njt_weights is None:
        njt_weights = torch.nested.nested_tensor_from_jagged(weights, offsets=njt.offsets())
    return TensorDict({VALUES_KEY: njt, WEIGHTS_KEY: njt_weights}, batch_size=[])


def _scatter_rows(data: torch.Tensor, rows: tuple[int, ...], starts: torch.Tensor, size: int, fill) -> torch.Tensor:
    buffer = torch.full((size,), fill, dtype=data.dtype, device=data.device)
    position = 0
    for r, n in enumerate(rows):
        start = int(starts[r])
        buffer[start : start + n] = data[position : position + n]
        position += n
    return buffer


# ---------------------------------------------------------------- strategies


@st.composite
def sparse_batches(
    draw: st.DrawFn,
    *,
    keys: list[str] | None = None,
    min_keys: int = 1,
    max_keys: int = 6,
    min_batch_size: int = 1,
    max_batch_size: int = 6,
    max_length: int = 4,
    id_bounds: int | dict[str, int] = 100,
    weighted: bool | None = None,
    variable_batch: bool | None = None,
    id_dtypes: tuple[torch.dtype, ...] = (torch.int32, torch.int64),
    offsets_dtypes: tuple[torch.dtype, ...] = (torch.int32, torch.int64),
) -> SparseBatch:
    """Draw a SparseBatch. ``None`` for ``weighted``/``variable_batch`` lets hypothesis choose.

    Rows are empty often, and whole features are empty sometimes. With ``variable_batch`` the
    batch sizes differ per feature (at least two distinct ones when there are two or more keys).
    """
    if keys is None:
        count = draw(st.integers(min_keys, max_keys))
        keys = [f"f{i}" for i in range(count)]
    is_weighted = draw(st.booleans()) if weighted is None else weighted
    vbe = (draw(st.booleans()) if variable_batch is None else variable_batch) and len(keys) > 1
    batch_size = st.integers(min_batch_size, max_batch_size)
    if vbe:
        sizes = draw(st.lists(batch_size, min_size=len(keys), max_size=len(keys)).filter(lambda s: len(set(s)) > 1))
    else:
        sizes = [draw(batch_size)] * len(keys)
    row_length = st.one_of(st.just(0), st.integers(0, max_length))
    lengths = []
    for size in sizes:
        empty_feature = draw(st.integers(0, 9)) == 0
        rows = [0] * size if empty_feature else draw(st.lists(row_length, min_size=size, max_size=size))
        lengths.append(tuple(rows))
    bounds = tuple(id_bounds[k] if isinstance(id_bounds, dict) else id_bounds for k in keys)
    return SparseBatch(
        keys=tuple(keys),
        lengths=tuple(lengths),
        id_bounds=bounds,
        seed=draw(st.integers(0, 2**31 - 1)),
        weighted=is_weighted,
        id_dtype=draw(st.sampled_from(id_dtypes)),
        offsets_dtype=draw(st.sampled_from(offsets_dtypes)),
    )


def jagged_forms(contiguous_only: bool = False) -> st.SearchStrategy[str]:
    """One of the ways torch.nested builds a jagged tensor (see JAGGED_FORMS)."""
    return st.sampled_from(CONTIGUOUS_FORMS if contiguous_only else JAGGED_FORMS)


def kjts(device: str = "cpu", **batch_kwargs) -> st.SearchStrategy[KeyedJaggedTensor]:
    """KJTs (weighted or not, fixed or variable batch size per feature, int32/int64)."""
    return sparse_batches(**batch_kwargs).map(lambda batch: batch.to_kjt(device))


def tensordicts(device: str = "cpu", contiguous_only: bool = False, **batch_kwargs) -> st.SearchStrategy[TensorDict]:
    """TensorDicts of jagged tensors, in every form torch.nested builds (see JAGGED_FORMS)."""
    return st.tuples(sparse_batches(**batch_kwargs), jagged_forms(contiguous_only)).map(
        lambda pair: pair[0].to_td(pair[1], device)
    )


def key_selections(all_keys: list[str] | tuple[str, ...]) -> st.SearchStrategy[list[str]]:
    """A non-empty subset of ``all_keys`` in any order (the ``keys`` argument of td_to_kjt)."""
    return st.lists(st.sampled_from(list(all_keys)), min_size=1, max_size=len(all_keys), unique=True)
