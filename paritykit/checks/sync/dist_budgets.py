"""Sync budgets that need the rank pool: a sharded EBC's input_dist, and one training step per pipeline.

Each budget is an exact count *per rank* at world size 2, broken down by call site
("<file> in <function>", line numbers left out so a reformatted torchrec file does not move them).
The totals are today's behaviour of torchrec 1.8: a change that adds a sync on these paths fails the
`sync` check, and the tests assert the counts exactly, so a change that removes one shows up too.

How the counts arise (read in torchrec/distributed/dist_data.py, embeddingbag.py,
embedding_sharding.py, train_pipeline/runtime_forwards.py and sparse/jagged_tensor.py):

ShardedEmbeddingBagCollection.input_dist(ctx, kjt), then .wait().wait(), for one sharding type:
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

The training pipelines (TrainPipelineSparseDist and its subclasses) replace each KJTAllToAll with
``runtime_forwards.KJTAllToAllForward`` and fuse the splits all-to-alls of all sharded modules
into one ``FusedKJTListSplitsAwaitable``: the split tensors are made in ``__call__`` (a list
comprehension and the stride tensor), one fused splits all-to-all is read twice as above, and
``FusedKJTListSplitsAwaitable.__init__`` reads *every* split tensor back with ``_safe_tolist`` only
to log an int overflow check: one read per split tensor of every module, a cost the base pipeline
and the plain loop do not pay.

The pipeline budgets use the batches of paritykit.checks.pipeline.models.make_batches, as the `pipeline`
check does: made on the rank's device, KJTs without metadata, so the pipelines' copy to the device
moves nothing and each module's split reads its lengths. No sync of a step comes from the loop
itself (paritykit's plain loop has no loss.item()), from backward or from the optimizers: every
one is in torchrec's input distribution. Of those, the read of the received splits is inherent to
the two-phase KJT all-to-all, and dist_init's read of the received lengths is how torchrec gives
the lookup its length_per_key; the rest are avoidable: the host->device copies of Python lists
(split, stride and recat tensors), the int32-overflow reads of splits the rank itself sent, and
the split's read of an input without metadata.

The CPU proxy counts a ``torch.tensor(list, device=torch.device(...))`` as a blocking
host->device copy (see paritykit.sync.cpu), as the single-process corpus does for KJT.permute.
The budgets were established with the CPU proxy (backend "cpu"); on "cuda" the same regions are
counted by torch's sync debug mode.

The rank functions are module-level so that the rank pool can send them to its ranks.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from paritykit.checks.pipeline.models import DataSpec, ModelSpec, build_sharded, make_batches
from paritykit.checks.pipeline.runs import RunSpec, make_pipeline, plain_step
from paritykit.checks.sync.inputs import KEYS, LENGTHS, NUM_EMBEDDINGS, backend_for
from paritykit.errors import ParityError
from paritykit.harness.cpu_shim import stream_shim
from paritykit.harness.devices import rank_device
from paritykit.harness.sharded import shard_module
from paritykit.harness.tables import TableSpec, build_ebc
from paritykit.sync import check_budget, count_syncs, on_host

WORLD_SIZE = 2

# Call sites, as ``function_site`` writes them.
JT = "torchrec/sparse/jagged_tensor.py"
DD = "torchrec/distributed/dist_data.py"
RF = "torchrec/distributed/train_pipeline/runtime_forwards.py"
# Python 3.12 inlines list comprehensions (PEP 709): their syncs then count in the enclosing function.
_LISTCOMP_INLINED = sys.version_info >= (3, 12)
LENGTH_PER_KEY = f"{JT} in _maybe_compute_length_per_key"
STRIDE_TENSOR = f"{DD} in __init__"  # torch.tensor([stride] * world_size, device)
SPLIT_TENSORS = STRIDE_TENSOR if _LISTCOMP_INLINED else f"{DD} in <listcomp>"  # torch.tensor(splits, device) each
SPLITS_READS = f"{DD} in _wait_impl"  # _safe_tolist_2d of received and of sent splits
RECAT_TENSOR = f"{DD} in _get_recat"
PIPELINE_STRIDE_TENSOR = f"{RF} in __call__"
PIPELINE_SPLIT_TENSORS = PIPELINE_STRIDE_TENSOR if _LISTCOMP_INLINED else f"{RF} in <listcomp>"
FUSED_OVERFLOW_LOG_READS = "torchrec/distributed/embedding_sharding.py in __init__"

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


def _sites(*counts: tuple[str, int]) -> dict[str, int]:
    """Call site -> count, summing sites that coincide (see _LISTCOMP_INLINED)."""
    merged: dict[str, int] = {}
    for site, count in counts:
        merged[site] = merged.get(site, 0) + count
    return dict(sorted(merged.items()))


@dataclass(frozen=True)
class DistSyncBudget:
    """A region run on every rank of a world-size-2 pool, and its exact syncs per rank and call site.

    kind: "input_dist" (args: plan, with_metadata) or "pipeline" (args: pipeline name).
    sites[rank]: call site -> count; the rank's budget is their sum.
    """

    name: str
    kind: str
    args: tuple
    sites: tuple[Mapping[str, int], ...]

    @property
    def budgets(self) -> tuple[int, ...]:
        return tuple(sum(per_rank.values()) for per_rank in self.sites)


# --- sharded EBC input_dist -----------------------------------------------------------------------

# The batch of inputs.py (lengths per key, batch of 4). Table t0 serves f0, table t1 serves f1 and f2.
# Table-wise: t0 on rank 0, t1 on rank 1, so each rank receives at least one feature.
PLANS = {
    "table_wise": {"t0": ("table_wise", 0), "t1": ("table_wise", 1)},
    "row_wise": {"t0": ("row_wise",), "t1": ("row_wise",)},
}


def _input_dist_sites(plan: str, with_metadata: bool) -> dict[str, int]:
    # One sharding type, an unweighted KJT (lengths, values: 2 split tensors), every rank
    # receiving features (so a recat tensor and a dist_init read on each).
    reads_of_input_lengths = 0 if with_metadata else 1  # KJT.split
    if plan == "row_wise":
        reads_of_input_lengths += 1  # dist_splits of the bucketized KJT, never has metadata
    return _sites(
        (LENGTH_PER_KEY, reads_of_input_lengths + 1),  # + dist_init's sync() of the received KJT
        (SPLIT_TENSORS, 2),
        (STRIDE_TENSOR, 1),
        (SPLITS_READS, 2),
        (RECAT_TENSOR, 1),
    )


INPUT_DIST_BUDGETS: tuple[DistSyncBudget, ...] = tuple(
    DistSyncBudget(
        name=f"ebc_input_dist.ws2.{plan}.{'kjt_moved_with_metadata' if with_metadata else 'kjt_without_metadata'}",
        kind="input_dist",
        args=(plan, with_metadata),
        sites=(_input_dist_sites(plan, with_metadata),) * WORLD_SIZE,
    )
    for plan in PLANS
    for with_metadata in (True, False)
)


def _input_kjt(rank: int, device: torch.device, with_metadata: bool, step: int) -> Any:
    """This rank's batch: from host JaggedTensors and moved (metadata computed on the host), or
    made on the device from flat lengths (no metadata)."""
    from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

    values = {
        key: [(7 * rank + 3 * k + step + i) % NUM_EMBEDDINGS for i in range(sum(lens))]
        for k, (key, lens) in enumerate(zip(KEYS, LENGTHS))
    }
    if with_metadata:
        jts = {key: JaggedTensor(values=torch.tensor(values[key]), lengths=torch.tensor(lens)) for key, lens in zip(KEYS, LENGTHS)}
        return KeyedJaggedTensor.from_jt_dict(on_host(jts)).to(device, non_blocking=True)
    return KeyedJaggedTensor(
        keys=list(KEYS),
        values=torch.tensor([v for key in KEYS for v in values[key]], device=device),
        lengths=torch.tensor([n for lens in LENGTHS for n in lens], device=device),
    )


def input_dist_syncs_on_rank(plan: str, with_metadata: bool, device: str = "cpu", backend: str = "cpu") -> dict[str, Any]:
    """Count ``input_dist`` plus both waits of its awaitable, after one warm-up call.

    The warm-up call is left out of the budget: the first input_dist validates the KJT
    (validate_keyed_jagged_tensor reads the lengths and every feature's id range) and builds the
    input dists (row-wise: a block-size tensor), once per module.
    """
    import torch.distributed as dist

    rank, where = dist.get_rank(), rank_device(device)
    tables = (TableSpec("t0", NUM_EMBEDDINGS, 4, ("f0",)), TableSpec("t1", NUM_EMBEDDINGS, 4, ("f1", "f2")))
    sharded = shard_module(build_ebc(tables, seed=0, device=where.type), PLANS[plan], device=where.type, compute_kernel="fused")

    warm_up = _input_kjt(rank, where, with_metadata, step=0)
    with count_syncs(backend=backend) as first:
        sharded.input_dist(sharded.create_context(), warm_up).wait().wait()

    kjt = _input_kjt(rank, where, with_metadata, step=1)
    context = sharded.create_context()
    with count_syncs(backend=backend) as record:
        received = sharded.input_dist(context, kjt).wait().wait()
    return {
        "record": record,
        "first_call_syncs": first.total,
        "received_keys": [list(features.keys()) for features in received],
    }


# --- one training step per pipeline ---------------------------------------------------------------

PIPELINE_NAMES = ("plain", "base", "sparse_dist", "fused:data_dist", "semi_sync")
# Enough batches that progress() calls 1 and 2 both run a full step in every pipeline (the
# sparse-dist pipelines run the input_dist of batch i+1 during step i; semi-sync fills two ahead).
PIPELINE_BATCHES = 5
COUNTED_CALLS = (1, 2)


def _dlrm_spec() -> Any:
    """paritykit's DLRM-style model, table-wise: t0 and the weighted w0 on rank 0, t1 on rank 1."""
    return RunSpec(model=ModelSpec(sharding_types=("table_wise",)), data=DataSpec(num_batches=PIPELINE_BATCHES))


def _ebc_input_dist_step_sites(rank: int) -> dict[str, int]:
    # Plain loop and TrainPipelineBase: each sharded EBC runs its own input_dist inside forward,
    # on batches made without metadata. Sparse EBC (f_t0 -> rank 0, f_t1 -> rank 1): split read,
    # 2 split tensors + stride, 2 splits reads, recat, dist_init read = 8 on both ranks.
    # Weighted EBC (f_w0 -> rank 0 only): split read, 3 split tensors (lengths, values, weights)
    # + stride, 2 splits reads = 7, plus recat and dist_init read on rank 0, which receives f_w0.
    receives_weighted = rank == 0
    return _sites(
        (LENGTH_PER_KEY, 2 + 1 + (1 if receives_weighted else 0)),
        (SPLIT_TENSORS, 2 + 3),
        (STRIDE_TENSOR, 2),
        (SPLITS_READS, 4),
        (RECAT_TENSOR, 1 + (1 if receives_weighted else 0)),
    )


def _fused_splits_step_sites(rank: int) -> dict[str, int]:
    # TrainPipelineSparseDist, FusedSparseDist and SemiSync (one steady progress() call): the
    # input_dist of the next batch through KJTAllToAllForward with one fused splits all-to-all.
    # Per module: split read (no metadata), split tensors (2 and 3) in the list comprehension and
    # a stride tensor in __call__; FusedKJTListSplitsAwaitable reads back all 7 split tensors for
    # its overflow log; 2 reads of the fused splits; then per module that this rank receives
    # features of: recat tensor and dist_init read.
    received_modules = 2 if rank == 0 else 1
    return _sites(
        (LENGTH_PER_KEY, 2 + received_modules),
        (PIPELINE_SPLIT_TENSORS, 2 + 3),
        (PIPELINE_STRIDE_TENSOR, 2),
        (FUSED_OVERFLOW_LOG_READS, 7),
        (SPLITS_READS, 2),
        (RECAT_TENSOR, received_modules),
    )


PIPELINE_BUDGETS: tuple[DistSyncBudget, ...] = tuple(
    DistSyncBudget(
        name=f"pipeline_step.ws2.dlrm.{name}",
        kind="pipeline",
        args=(name,),
        sites=tuple(
            (_ebc_input_dist_step_sites if name in ("plain", "base") else _fused_splits_step_sites)(rank)
            for rank in range(WORLD_SIZE)
        ),
    )
    for name in PIPELINE_NAMES
)

DIST_BUDGETS: tuple[DistSyncBudget, ...] = INPUT_DIST_BUDGETS + PIPELINE_BUDGETS


def pipeline_syncs_on_rank(pipeline: str, device: str = "cpu", backend: str = "cpu") -> dict[str, Any]:
    """Count every progress() call (plain loop: every step) separately, over PIPELINE_BATCHES batches.

    Returns the records of COUNTED_CALLS (steady state) and the total of every call. Call 0 is
    warm-up, once per model: validate_keyed_jagged_tensor on each module's first KJT (one item()
    of the lengths, two scalar reads per feature), the output dist's PooledEmbeddingsAllToAll
    buffers built lazily from Python lists, fbgemm's ``_generate_vbe_metadata`` copying
    feature_dims to the host on its first call, and (sparse-dist pipelines) the input_dist of
    the one or two batches the pipeline fills ahead. The last calls only drain the pipeline.
    Averaging the whole run over steps would blend these in; the budget is the steady step.
    """
    import torch.distributed as dist

    spec = _dlrm_spec().with_pipeline(pipeline)
    where = rank_device(device)
    model, optimizer = build_sharded(spec.model, where)
    batches = make_batches(spec.model, spec.data, dist.get_rank(), where)

    records = []
    with stream_shim():
        if pipeline == "plain":
            for batch in batches:
                with count_syncs(backend=backend) as record:
                    plain_step(model, optimizer, batch)
                records.append(record)
        else:
            runner, remaining = make_pipeline(spec, model, optimizer, where), iter(batches)
            while len(records) <= len(batches):
                with count_syncs(backend=backend) as record:
                    try:
                        runner.progress(remaining)
                    except StopIteration:
                        break
                records.append(record)
    return {
        "records": [records[i] for i in COUNTED_CALLS],
        "totals": [r.total for r in records],
    }


def measure_dist(budget: DistSyncBudget, pool: Any, device: str = "cpu") -> tuple[list[list[Any]], list[dict[str, Any]]]:
    """Run the budget's region on every rank: (per rank, the counted SyncRecords; the raw per-rank results)."""
    backend = backend_for(device)
    if budget.kind == "input_dist":
        results = pool.call(input_dist_syncs_on_rank, (*budget.args, device, backend), case=budget.name)
        return [[result["record"]] for result in results], results
    results = pool.call(pipeline_syncs_on_rank, (*budget.args, device, backend), case=budget.name)
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
                failures.append(str(exc))
    if failures:
        raise ParityError("\n".join(failures))
