"""How close a sharded result must be to the unsharded one, derived from the case.

- EC outputs are gathers of table rows: exact (``None`` below means bit-exact).
- An EBC output is a pooled sum of at most ``terms`` = the longest bag of that feature in this
  rank's batch, each term at most ``magnitude`` = max |table weight| x max per-id weight:
  ``summation_tolerance(dtype, terms, magnitude)`` (paritykit/compare/bounds.py).
- A table after one SGD step is W - lr * scale * G, G summed over every occurrence of an id in
  every rank's batch: ``terms`` = the most occurrences of one id of the table (after the VBE
  expansion), ``magnitude`` = UPSTREAM_BOUND x max per-id weight (MEAN's 1/L only shrinks a term).
  Its bound is lr * scale * (the sum's bound + 4u * terms * magnitude): the sum, plus a few
  roundings of G itself (the gradient division, DDP's average, the product with lr).
- Once an EBC has a row-wise/table-row-wise MEAN table, torchrec divides the outputs of its
  row-sharded tables by (length + MEAN_DIVISOR_EPS), SUM ones by (1 + MEAN_DIVISOR_EPS)
  (``embeddingbag._create_mean_pooling_divisor``): a relative change of at most that eps for a bag
  of length >= 1, added to rtol for those outputs and to the tables' bound.

All of these are far below a consistent 1e-3 relative drift of values of order one.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from paritykit.checks.td_kjt.sharded_spec import RankBatch, ShardedCase
from paritykit.compare.bounds import summation_tolerance, unit_roundoff
from paritykit.harness.plans import ROW_WISE_KINDS

# The upstream gradient of every output element lies in [-1, 1) (see reference.upstream_gradient).
UPSTREAM_BOUND = 1.0
# torchrec's guard against a zero divisor in RW/TWRW mean pooling.
MEAN_DIVISOR_EPS = 1e-6


@dataclass(frozen=True)
class Tolerance:
    """rtol/atol for one compared tensor, with the terms and magnitude they were derived from."""

    rtol: float
    atol: float
    terms: int
    magnitude: float

    def __str__(self) -> str:
        return f"rtol {self.rtol:.3g}, atol {self.atol:.3g} (terms {self.terms}, magnitude {self.magnitude:.4g})"


def _max_weight(rank_batch: RankBatch, key: str) -> float:
    batch = rank_batch.batch
    if not batch.weighted or batch.weights(key).numel() == 0:
        return 1.0
    return float(batch.weights(key).abs().max())


def _mean_eps(case: ShardedCase, table_name: str) -> float:
    divides = case.module == "ebc" and any(
        t.pooling == "MEAN" and case.plan[t.name][0] in ROW_WISE_KINDS for t in case.tables
    )
    return MEAN_DIVISOR_EPS if divides and case.plan[table_name][0] in ROW_WISE_KINDS else 0.0


def output_tolerances(
    case: ShardedCase, rank_batch: RankBatch, full_weights: dict[str, torch.Tensor]
) -> dict[str, Tolerance | None]:
    """Per output key: None (bit-exact: EC) or the derived bound for this rank's pooled values."""
    if case.module == "ec":
        return {key: None for key in case.keys}
    out: dict[str, Tolerance | None] = {}
    for k, key in enumerate(rank_batch.batch.keys):
        table = case.table_of_feature(key)
        weight = full_weights[table.name]
        terms = max(rank_batch.batch.lengths[k], default=0)
        magnitude = float(weight.abs().max()) * _max_weight(rank_batch, key)
        rtol, atol = summation_tolerance(weight.dtype, terms, magnitude)
        out[key] = Tolerance(rtol + _mean_eps(case, table.name), atol, terms, magnitude)
    return out


def id_occurrences(case: ShardedCase, step: int, table_name: str) -> Counter:
    """How often each id of a table is looked up in one step, over every rank and feature, after
    the VBE expansion (each occurrence adds one term to that row's gradient)."""
    table = next(t for t in case.tables if t.name == table_name)
    counts: Counter = Counter()
    for rank_batch in case.steps[step]:
        batch = rank_batch.batch
        for k, key in enumerate(batch.keys):
            if key not in table.feature_names:
                continue
            rows, ids = batch.lengths[k], batch.ids(key).tolist()
            starts = [sum(rows[:r]) for r in range(len(rows))]
            repeats = Counter(rank_batch.inverse[k]) if rank_batch.inverse is not None else Counter(range(len(rows)))
            for r, times in repeats.items():
                for i in ids[starts[r] : starts[r] + rows[r]]:
                    counts[i] += times
    return counts


def gradient_scale(case: ShardedCase, table_name: str, gradient_division: bool) -> float:
    """What torchrec multiplies a table's summed gradient by: DDP averages data-parallel replicas;
    model-parallel gradients are divided by the world size while gradient division is on."""
    if case.plan[table_name][0] == "data_parallel" or gradient_division:
        return 1.0 / case.world_size
    return 1.0


def table_tolerances(case: ShardedCase, step: int, learning_rate: float, gradient_division: bool) -> dict[str, Tolerance]:
    """Per table: the bound on one SGD step's difference from the unsharded module."""
    out = {}
    for table in case.tables:
        counts = id_occurrences(case, step, table.name)
        terms = max(counts.values(), default=0)
        per_id = max(
            (_max_weight(rb, key) for rb in case.steps[step] for key in table.feature_names),
            default=1.0,
        )
        magnitude = UPSTREAM_BOUND * per_id
        dtype = torch.float32
        _, sum_atol = summation_tolerance(dtype, terms, magnitude)
        u = unit_roundoff(dtype)
        scale = learning_rate * gradient_scale(case, table.name, gradient_division)
        largest_gradient = terms * magnitude
        atol = scale * (sum_atol + 4 * u * largest_gradient + _mean_eps(case, table.name) * largest_gradient)
        out[table.name] = Tolerance(4 * u, atol, terms, magnitude)
    return out
