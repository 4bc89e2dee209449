"""The KJT all-to-all's ops, in one process: what a KJT sends and how a rank rebuilds what it received.

- ``kjt.dist_labels+dist_splits+dist_tensors``: the tensors a KJT sends, their names, and how
  much of each goes to each destination when destination i takes ``key_splits[i]`` keys.
- ``kjt.dist_init``: the KJT built from the tensors every rank sent (rank-major, as the all-to-all
  delivers them) and the recat that reorders them key-major. paritykit lays the received tensors
  out and computes the recat itself (segment-level, or per sample when the ranks' batch sizes
  differ, as torchrec's ``_get_recat`` does); the reference joins the ranks' rows key by key.
  With a stagger s (TWRW passes the number of hosts) the ranks are joined host-interleaved:
  ``x + W/s * y`` for x in range(W/s), y in range(s); a VBE KJT's strides must follow that order.
  A stagger of 1 is also left to dist_init's default.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from hypothesis import strategies as st

from paritykit.checks.sparse_ops.build import build_kjt, flat_tensor
from paritykit.checks.sparse_ops.cases import OpCase
from paritykit.checks.sparse_ops.expect import expect_array, expect_kjt, expect_value
from paritykit.checks.sparse_ops.kjt_cases import PINNED_FIXED, PINNED_KJTS, PINNED_VBE
from paritykit.checks.sparse_ops.kjt_op_cases import vbe_permute_takes
from paritykit.checks.sparse_ops.reference import Array, RefKJT, kjt_dist_labels, kjt_dist_splits, kjt_join_ranks
from paritykit.checks.sparse_ops.rules import kjt_drawable
from paritykit.checks.sparse_ops.specs import KJTSpec, kjt_specs
from paritykit.checks.sparse_ops.values import FLOAT_DTYPES, INT_DTYPES

# dist_init permutes with fbgemm's permute kernels: no float64 values, no float16 VBE weights on CPU
# (see kjt.permute).
RECEIVED_VALUE_DTYPES = INT_DTYPES + ("float16", "float32")


@dataclass(frozen=True)
class DistSplits:
    kjt: KJTSpec
    key_splits: tuple[int, ...]


@st.composite
def _dist_splits_specs(draw: st.DrawFn) -> DistSplits:
    spec = draw(kjt_specs(value_dtypes=INT_DTYPES + FLOAT_DTYPES).filter(kjt_drawable))
    cuts = sorted(draw(st.lists(st.integers(0, len(spec.keys)), max_size=3)))
    bounds = [0] + cuts + [len(spec.keys)]
    return DistSplits(spec, tuple(bounds[i + 1] - bounds[i] for i in range(len(bounds) - 1)))


def _dist_splits(spec: DistSplits) -> None:
    ref = spec.kjt.reference()
    kjt = build_kjt(ref, spec.kjt.form, spec.kjt.metadata)
    expect_value(kjt.dist_labels(), kjt_dist_labels(ref), "kjt.dist_labels()")
    expect_value(kjt.dist_splits(list(spec.key_splits)), kjt_dist_splits(ref, list(spec.key_splits)),
                 f"kjt.dist_splits({list(spec.key_splits)})")
    tensors = kjt.dist_tensors()
    expected = [
        Array((len(ref.flat_lengths()),), ref.flat_lengths(), ref.lengths_dtype),
        Array((len(ref.flat_values()),), ref.flat_values(), ref.value_dtype),
    ]
    if ref.variable:
        expected.append(Array((len(ref.keys),), tuple(ref.stride_per_key()), None))
    if ref.weights is not None:
        expected.append(Array((len(ref.flat_weights()),), ref.flat_weights(), ref.weight_dtype))
    expect_value(len(tensors), len(expected), "len(kjt.dist_tensors())")
    for label, tensor, want in zip(kjt_dist_labels(ref), tensors, expected):
        expect_array(tensor, want, f"kjt.dist_tensors()[{label}]")


@dataclass(frozen=True)
class DistInit:
    ranks: tuple[KJTSpec, ...]  # what each rank sent: the same keys; VBE specs have one rank each
    recat: bool  # without a recat (one rank only) the received order is kept
    stagger: int = 1  # divides the number of ranks


def staggered_order(world: int, stagger: int) -> list[int]:
    """The order in which a staggered recat joins the ranks (the hosts' i-th ranks together)."""
    return [x + world // stagger * y for x in range(world // stagger) for y in range(stagger)]


@st.composite
def _dist_init_specs(draw: st.DrawFn) -> DistInit:
    first = draw(kjt_specs(ranks=1, value_dtypes=RECEIVED_VALUE_DTYPES, inverse=False).filter(vbe_permute_takes))
    same = dict(min_keys=len(first.keys), max_keys=len(first.keys), variable=first.strides is not None, ranks=1,
                weighted=first.weighted, value_dtypes=(first.value_dtype,), weight_dtypes=(first.weight_dtype,),
                lengths_dtypes=(first.lengths_dtype,), inverse=False)
    if draw(st.booleans()) and first.strides is None:
        same["batch"] = first.batch_size  # every rank the same batch size (else one per rank)
    others = draw(st.lists(kjt_specs(**same), max_size=3))
    ranks = (first,) + tuple(replace(spec, keys=first.keys) for spec in others)
    recat = len(ranks) > 1 or draw(st.booleans())
    staggers = [s for s in range(1, len(ranks) + 1) if len(ranks) % s == 0] if recat else [1]
    return DistInit(ranks, recat, draw(st.sampled_from(staggers)))


def _received(refs: list[RefKJT], stagger: int) -> tuple[list[torch.Tensor], torch.Tensor | None, list[int] | None]:
    """The tensors as the all-to-all delivers them (rank-major), the recat, the batch size per rank."""
    first, world, keys = refs[0], len(refs), len(refs[0].keys)
    order = staggered_order(world, stagger)
    lengths = [n for ref in refs for n in ref.flat_lengths()]
    tensors = [flat_tensor(lengths, first.lengths_dtype), flat_tensor([v for ref in refs for v in ref.flat_values()], first.value_dtype)]
    if first.variable:
        tensors.append(torch.tensor([ref.strides[k][0] for ref in refs for k in range(keys)], dtype=torch.int64))
    if first.weights is not None:
        tensors.append(flat_tensor([w for ref in refs for w in ref.flat_weights()], first.weight_dtype))
    batches = None if first.variable else [ref.batch_size for ref in refs]
    if first.variable or len(set(batches)) == 1:
        recat = [r * keys + k for k in range(keys) for r in order]  # (rank, key) segments, key-major
    else:  # batch size differs per rank: one index per sample
        starts = [0]
        for ref in refs:
            starts.append(starts[-1] + keys * ref.batch_size)
        recat = [starts[r] + k * refs[r].batch_size + i for k in range(keys) for r in order for i in range(refs[r].batch_size)]
    return tensors, torch.tensor(recat, dtype=torch.int32), batches


def _dist_init(spec: DistInit) -> None:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    refs = [rank.reference() for rank in spec.ranks]
    tensors, recat, batches = _received(refs, spec.stagger)
    args = (list(refs[0].keys), tensors, refs[0].variable, len(refs), recat if spec.recat else None, batches)
    # a stagger of 1 is left to the default (torchrec's own callers always pass it)
    kjt = KeyedJaggedTensor.dist_init(*args, stagger=spec.stagger) if spec.stagger > 1 else KeyedJaggedTensor.dist_init(*args)
    joined = kjt_join_ranks([refs[r] for r in staggered_order(len(refs), spec.stagger)])
    expect_kjt(kjt, joined, f"KeyedJaggedTensor.dist_init(... {len(refs)} ranks, recat={spec.recat}, stagger={spec.stagger})",
               inverse=False)


def _vbe_rank(spec: KJTSpec, samples: tuple[int, ...], seed: int) -> KJTSpec:
    lengths = tuple(tuple((i + k) % 3 for i in range(n)) for k, n in enumerate(samples))
    return replace(spec, strides=tuple((n,) for n in samples), lengths=lengths, seed=seed, inverse_batch=None)


def kjt_dist_cases() -> list[OpCase]:
    fixed_rank = replace(PINNED_FIXED, batch_size=2, lengths=((1, 2), (0, 0), (3, 0)))
    other_rank = replace(fixed_rank, batch_size=1, lengths=((2,), (1,), (0,)), seed=5)
    vbe = _vbe_rank(PINNED_VBE, (2, 0, 1), 6)
    pinned_inits = (
        DistInit((fixed_rank, replace(fixed_rank, seed=7)), True),
        DistInit((fixed_rank, other_rank), True),
        DistInit((vbe, _vbe_rank(PINNED_VBE, (1, 3, 0), 8), _vbe_rank(PINNED_VBE, (0, 2, 2), 9)), True),
        DistInit(tuple(_vbe_rank(PINNED_VBE, n, 10 + i) for i, n in enumerate(((2, 0, 1), (1, 3, 0), (0, 2, 2), (3, 1, 1)))), True),
        DistInit(tuple(_vbe_rank(PINNED_VBE, n, 20 + i) for i, n in enumerate(((1, 2, 0), (2, 1, 3), (0, 1, 1), (2, 2, 1)))), True, 2),
        DistInit((fixed_rank, other_rank, replace(other_rank, seed=11), replace(fixed_rank, seed=12)), True, 2),
    )
    pinned_splits = tuple(DistSplits(s, (1, 0, len(s.keys) - 1)) for s in PINNED_KJTS)
    return [
        OpCase("kjt.dist_labels+dist_splits+dist_tensors", _dist_splits_specs(), _dist_splits, pinned_splits),
        OpCase("kjt.dist_init", _dist_init_specs(), _dist_init, pinned_inits),
    ]



