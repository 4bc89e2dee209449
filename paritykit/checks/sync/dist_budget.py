"""What a rank-pool sync budget is, how it is measured, and the input-distribution sites it shares.

A rank-pool budget is an exact count *per rank* at world size 2, broken down by call site
("<file> in <function>", line numbers left out so a reformatted torchrec file does not move them).
Its region runs on every rank through a module-level rank function (so the pool can send it).

Both sharded modules (ShardedEmbeddingBagCollection and ShardedEmbeddingCollection) distribute
their input with the same KJT all-to-all (torchrec/distributed/dist_data.py, via
TwSparseFeaturesDist and RwSparseFeaturesDist), so ``input_dist(ctx, kjt)`` then ``.wait().wait()``
makes the same syncs for either, for one sharding type:
  * ``features.split(self._feature_splits)`` -> KJT.split -> length_per_key ->
    ``_maybe_compute_length_per_key``: one ``_safe_tolist`` of the device lengths, unless the KJT
    carries length_per_key already (built from host JaggedTensors and moved). Row-wise sharding
    then bucketizes into a new KJT without metadata, so ``dist_splits`` -> length_per_key reads it
    again: the metadata of the input saves the split's read but not this one.
  * KJTAllToAllSplitsAwaitable.__init__: ``torch.tensor(splits, device=device)`` for every entry
    of ``dist_splits`` (lengths, values, and weights for a weighted KJT) in a list comprehension,
    and ``torch.tensor([stride] * world_size, device=device)`` in ``__init__``: each a blocking
    host->device copy of a Python list.
  * SplitsAllToAllAwaitable._wait_impl: ``_safe_tolist_2d(self._output_tensor ...)`` reads the
    received splits, which size the tensors all-to-all (inherent to the two-phase KJT all-to-all);
    ``_safe_tolist_2d(self._input_tensor ...)`` reads back the splits it sent, only for an int32
    overflow check (not needed for the data).
  * KJTAllToAllTensorsAwaitable.__init__ -> ``_get_recat``: ``torch.tensor(recat, device=device)``,
    a host->device copy; for a rank that receives no feature ``local_split`` is 0 and no recat
    tensor is made.
  * KJTAllToAllTensorsAwaitable._wait_impl -> ``KeyedJaggedTensor.dist_init`` -> ``kjt.sync()`` ->
    length_per_key of the received KJT: one read, none when the rank received no feature (no keys).

The CPU proxy counts a ``torch.tensor(list, device=torch.device(...))`` as a blocking host->device
copy (see paritykit.sync.cpu). The budgets were established with the CPU proxy (backend "cpu"); on
"cuda" the same regions are counted by torch's sync debug mode.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from paritykit.checks.sync.inputs import backend_for
from paritykit.errors import ParityError
from paritykit.sync import check_budget

WORLD_SIZE = 2

# Call sites, as ``function_site`` writes them.
JT = "torchrec/sparse/jagged_tensor.py"
DD = "torchrec/distributed/dist_data.py"
# Python 3.12 inlines list comprehensions (PEP 709): their syncs then count in the enclosing function.
LISTCOMP_INLINED = sys.version_info >= (3, 12)
LENGTH_PER_KEY = f"{JT} in _maybe_compute_length_per_key"
STRIDE_TENSOR = f"{DD} in __init__"  # torch.tensor([stride] * world_size, device)
SPLIT_TENSORS = STRIDE_TENSOR if LISTCOMP_INLINED else f"{DD} in <listcomp>"  # torch.tensor(splits, device) each
SPLITS_READS = f"{DD} in _wait_impl"  # _safe_tolist_2d of received and of sent splits
RECAT_TENSOR = f"{DD} in _get_recat"

# The batch of inputs.py (lengths per key, batch of 4). Table t0 serves f0, table t1 serves f1 and f2.
# Table-wise: t0 on rank 0, t1 on rank 1, so each rank receives at least one feature.
PLANS = {
    "table_wise": {"t0": ("table_wise", 0), "t1": ("table_wise", 1)},
    "row_wise": {"t0": ("row_wise",), "t1": ("row_wise",)},
}
INPUT_KINDS = {True: "kjt_moved_with_metadata", False: "kjt_without_metadata"}

_LINE = re.compile(r":\d+ in ")


def function_site(site: str) -> str:
    """``torchrec/x.py:123 in f`` -> ``torchrec/x.py in f``."""
    return _LINE.sub(" in ", site, count=1)


def sites_of(record: Any) -> dict[str, int]:
    """A SyncRecord's events counted by function-level call site."""
    counts: dict[str, int] = {}
    for event in record.events:
        key = function_site(event.site)
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def merge_sites(*counts: tuple[str, int]) -> dict[str, int]:
    """Call site -> count, summing sites that coincide (see LISTCOMP_INLINED); zero counts left out."""
    merged: dict[str, int] = {}
    for site, count in counts:
        if count:
            merged[site] = merged.get(site, 0) + count
    return dict(sorted(merged.items()))


def input_dist_sites(plan: str, with_metadata: bool) -> dict[str, int]:
    """The syncs of one input_dist (both waits) of the tables of PLANS: one sharding type, an
    unweighted KJT (lengths, values: 2 split tensors), every rank receiving features (so a recat
    tensor and a dist_init read on each)."""
    reads_of_input_lengths = 0 if with_metadata else 1  # KJT.split
    if plan == "row_wise":
        reads_of_input_lengths += 1  # dist_splits of the bucketized KJT, never has metadata
    return merge_sites(
        (LENGTH_PER_KEY, reads_of_input_lengths + 1),  # + dist_init's sync() of the received KJT
        (SPLIT_TENSORS, 2),
        (STRIDE_TENSOR, 1),
        (SPLITS_READS, 2),
        (RECAT_TENSOR, 1),
    )


@dataclass(frozen=True)
class DistSyncBudget:
    """A region run on every rank of a world-size-2 pool, and its exact syncs per rank and call site.

    rank_function(*args, device, backend) runs on each rank and returns a dict whose "records" are
    the counted SyncRecords of that rank (one per counted call). kind names the region.
    sites[rank]: call site -> count; the rank's budget is their sum.
    requires: run in the caller before any rank runs; raises UnsupportedByTorchrec when the
    installed torchrec lacks what the region exercises.
    """

    name: str
    kind: str
    rank_function: Callable[..., dict[str, Any]]
    args: tuple
    sites: tuple[Mapping[str, int], ...]
    requires: Callable[[], None] | None = None

    @property
    def budgets(self) -> tuple[int, ...]:
        return tuple(sum(per_rank.values()) for per_rank in self.sites)


def measure_dist(budget: DistSyncBudget, pool: Any, device: str = "cpu") -> tuple[list[list[Any]], list[dict[str, Any]]]:
    """Run the budget's region on every rank: (per rank, the counted SyncRecords; the raw per-rank results)."""
    backend = backend_for(device)
    if budget.requires is not None:
        budget.requires()
    results = pool.call(budget.rank_function, (*budget.args, device, backend), case=budget.name)
    return [result["records"] for result in results], results


def check_dist_budget(budget: DistSyncBudget, records_per_rank: list[list[Any]]) -> None:
    """ParityError naming every rank (and counted call) over its budget, with the call sites."""
    if len(records_per_rank) != len(budget.sites):
        raise ParityError(f"{budget.name}: budgeted for {len(budget.sites)} ranks, ran on {len(records_per_rank)}")
    failures = []
    for rank, (records, limit) in enumerate(zip(records_per_rank, budget.budgets)):
        for index, record in enumerate(records):
            what = f"{budget.name} on rank {rank}" + (f", counted call {index + 1} of {len(records)}" if len(records) > 1 else "")
            try:
                check_budget(record, limit, what=what)
            except ParityError as exc:
                failures.append(exc)
    if failures:
        raise ParityError("\n".join(str(f) for f in failures), divergence=failures[0].divergence)
