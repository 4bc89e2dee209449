"""Rank-pool sync budgets of the EmbeddingBagCollection: a sharded EBC's input_dist, and one
training step per pipeline (on paritykit's DLRM-style model of EBCs).

The totals are today's behaviour of torchrec 1.8: a change that adds a sync on these paths fails
the `sync` check, and the tests assert the counts exactly, so a change that removes one shows up
too. The input_dist syncs, shared with the sharded EC, are justified in
paritykit.checks.sync.dist_budget; the pipeline ones below (read in
torchrec/distributed/train_pipeline/runtime_forwards.py and embedding_sharding.py).

The training pipelines (TrainPipelineSparseDist and its subclasses) replace each KJTAllToAll with
``runtime_forwards.KJTAllToAllForward`` and fuse the splits all-to-alls of all sharded modules
into one ``FusedKJTListSplitsAwaitable``: the split tensors are made in ``__call__`` (a list
comprehension and the stride tensor), one fused splits all-to-all is read twice as above, and
``FusedKJTListSplitsAwaitable.__init__`` reads *every* split tensor back with ``_safe_tolist`` only
to log an int overflow check: one read per split tensor of every module, a cost the base pipeline
and the plain loop do not pay.

The pipeline budgets use the batches of paritykit.engine.builtin_models.make_batches, as the `pipeline`
check does: made on the rank's device, KJTs without metadata, so the pipelines' copy to the device
moves nothing and each module's split reads its lengths. No sync of a step comes from the loop
itself (paritykit's plain loop has no loss.item()), from backward or from the optimizers: every
one is in torchrec's input distribution. Of those, the read of the received splits is inherent to
the two-phase KJT all-to-all, and dist_init's read of the received lengths is how torchrec gives
the lookup its length_per_key; the rest are avoidable: the host->device copies of Python lists
(split, stride and recat tensors), the int32-overflow reads of splits the rank itself sent, and
the split's read of an input without metadata.

The rank functions are module-level so that the rank pool can send them to its ranks.
"""

from __future__ import annotations

from typing import Any

from paritykit.engine.builtin_models import DataSpec, ModelSpec, build_sharded, make_batches
from paritykit.engine.pipeline_runs import RunSpec, make_pipeline, plain_step
from paritykit.checks.sync.dist_budget import (
    INPUT_KINDS,
    LENGTH_PER_KEY,
    LISTCOMP_INLINED,
    PLANS,
    RECAT_TENSOR,
    SPLIT_TENSORS,
    SPLITS_READS,
    STRIDE_TENSOR,
    WORLD_SIZE,
    DistSyncBudget,
    input_dist_sites,
    merge_sites,
)
from paritykit.checks.sync.inputs import INPUT_DIST_TABLES, rank_kjt
from paritykit.harness.cpu_shim import stream_shim
from paritykit.harness.devices import rank_device
from paritykit.harness.sharded import shard_module
from paritykit.harness.tables import build_ebc
from paritykit.sync import count_syncs

RF = "torchrec/distributed/train_pipeline/runtime_forwards.py"
PIPELINE_STRIDE_TENSOR = f"{RF} in __call__"
PIPELINE_SPLIT_TENSORS = PIPELINE_STRIDE_TENSOR if LISTCOMP_INLINED else f"{RF} in <listcomp>"
FUSED_OVERFLOW_LOG_READS = "torchrec/distributed/embedding_sharding.py in __init__"


# --- sharded EBC input_dist -----------------------------------------------------------------------


def input_dist_syncs_on_rank(plan: str, with_metadata: bool, device: str = "cpu", backend: str = "cpu") -> dict[str, Any]:
    """Count ``input_dist`` plus both waits of its awaitable, after one warm-up call.

    The warm-up call is left out of the budget: the first input_dist validates the KJT
    (validate_keyed_jagged_tensor reads the lengths and every feature's id range) and builds the
    input dists (row-wise: a block-size tensor), once per module.
    """
    import torch.distributed as dist

    rank, where = dist.get_rank(), rank_device(device)
    sharded = shard_module(build_ebc(INPUT_DIST_TABLES, seed=0, device=where.type), PLANS[plan], device=where.type, compute_kernel="fused")

    warm_up = rank_kjt(rank, where, with_metadata, step=0)
    with count_syncs(backend=backend) as first:
        sharded.input_dist(sharded.create_context(), warm_up).wait().wait()

    kjt = rank_kjt(rank, where, with_metadata, step=1)
    context = sharded.create_context()
    with count_syncs(backend=backend) as record:
        received = sharded.input_dist(context, kjt).wait().wait()
    return {
        "records": [record],
        "first_call_syncs": first.total,
        "received_keys": [list(features.keys()) for features in received],
    }


INPUT_DIST_BUDGETS: tuple[DistSyncBudget, ...] = tuple(
    DistSyncBudget(
        name=f"ebc_input_dist.ws2.{plan}.{INPUT_KINDS[with_metadata]}",
        kind="input_dist",
        rank_function=input_dist_syncs_on_rank,
        args=(plan, with_metadata),
        sites=(input_dist_sites(plan, with_metadata),) * WORLD_SIZE,
    )
    for plan in PLANS
    for with_metadata in (True, False)
)


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
    return merge_sites(
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
    return merge_sites(
        (LENGTH_PER_KEY, 2 + received_modules),
        (PIPELINE_SPLIT_TENSORS, 2 + 3),
        (PIPELINE_STRIDE_TENSOR, 2),
        (FUSED_OVERFLOW_LOG_READS, 7),
        (SPLITS_READS, 2),
        (RECAT_TENSOR, received_modules),
    )


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


PIPELINE_BUDGETS: tuple[DistSyncBudget, ...] = tuple(
    DistSyncBudget(
        name=f"pipeline_step.ws2.dlrm.{name}",
        kind="pipeline",
        rank_function=pipeline_syncs_on_rank,
        args=(name,),
        sites=tuple(
            (_ebc_input_dist_step_sites if name in ("plain", "base") else _fused_splits_step_sites)(rank)
            for rank in range(WORLD_SIZE)
        ),
    )
    for name in PIPELINE_NAMES
)

EBC_DIST_BUDGETS: tuple[DistSyncBudget, ...] = INPUT_DIST_BUDGETS + PIPELINE_BUDGETS
