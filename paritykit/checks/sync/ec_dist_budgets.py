"""Rank-pool sync budgets of the EmbeddingCollection: a sharded EC's input_dist (KJT and TD input)
and its whole forward (input_dist + lookup + output_dist), per rank at world size 2.

ShardedEmbeddingCollection.input_dist (torchrec/distributed/embedding.py) takes a KJT or a
TensorDict. A TD goes through ``maybe_td_to_kjt(features, feature_keys)``, which cats the TD's
lengths into a KJT without metadata: torchrec's TD input costs what a KJT without metadata does.
paritykit's ``td_to_kjt`` gives a KJT with length_per_key (read from the nested tensors' shapes,
no sync), so it costs what a moved KJT with metadata does. Then the KJT goes through the same KJT
all-to-all as the sharded EBC's (see paritykit.checks.sync.dist_budget for each sync).

The rest of the forward adds no sync: ``compute_and_output_dist`` looks the received ids up in the
fused TBE, and ``SequenceEmbeddingsAllToAll`` sends the embeddings with ``alltoall_sequence``,
whose ``permute_2D_sparse_data`` is given the output size (``sharded_input_embeddings.numel()``)
and whose splits are Python lists from the input dist. ``EmbeddingCollectionAwaitable._wait_impl``
-> ``construct_jagged_tensors`` splits the embeddings by ``features.length_per_key()`` of the
features before the all-to-all: computed by then (by KJT.split, or kept from the input), so no
read. ``need_indices`` adds the features' values to each JaggedTensor, already on the device.
Row-wise sharding unbucketizes with ``index_select`` by the permute tensor of the input dist.

The warm-up call (first batch) is left out, as for the EBC (the first input_dist validates the
KJT and builds the input dists).
"""

from __future__ import annotations

from typing import Any

from paritykit.checks.sync.dist_budget import PLANS, WORLD_SIZE, DistSyncBudget, input_dist_sites
from paritykit.checks.sync.features import require_torchrec_td_input
from paritykit.checks.sync.inputs import INPUT_DIST_TABLES, device_td, rank_kjt, rank_values
from paritykit.harness.devices import rank_device
from paritykit.harness.sharded import shard_module
from paritykit.harness.tables import build_ec
from paritykit.sync import count_syncs

# Input kinds: what the rank feeds the sharded EC, and whether the KJT torchrec distributes
# carries length_per_key.
WITH_METADATA = {
    "kjt_moved_with_metadata": True,
    "kjt_without_metadata": False,
    "torchrec_td": False,
    "paritykit_td_to_kjt": True,
}
TD_INPUTS = ("torchrec_td", "paritykit_td_to_kjt")


def _rank_input(kind: str, rank: int, where: Any, step: int) -> Any:
    if kind in TD_INPUTS:
        return device_td(where, rank_values(rank, step))
    return rank_kjt(rank, where, WITH_METADATA[kind], step)


def _run_region(sharded: Any, region: str, kind: str, features: Any) -> Any:
    if kind == "paritykit_td_to_kjt":
        from paritykit.convert import td_to_kjt

        features = td_to_kjt(features)
    if region == "input_dist":
        return sharded.input_dist(sharded.create_context(), features).wait().wait()
    return sharded(features).wait()


def ec_syncs_on_rank(
    plan: str, kind: str, region: str, need_indices: bool, device: str = "cpu", backend: str = "cpu"
) -> dict[str, Any]:
    """Count one ``region`` ("input_dist": input_dist and both waits; "forward": the module's forward
    and the wait of its output) of a sharded EC on input ``kind``, after one warm-up call."""
    import torch.distributed as dist

    rank, where = dist.get_rank(), rank_device(device)
    ec = build_ec(INPUT_DIST_TABLES, seed=0, need_indices=need_indices, device=where.type)
    sharded = shard_module(ec, PLANS[plan], device=where.type, compute_kernel="fused")

    warm_up = _rank_input(kind, rank, where, step=0)
    with count_syncs(backend=backend) as first:
        _run_region(sharded, region, kind, warm_up)

    features = _rank_input(kind, rank, where, step=1)
    with count_syncs(backend=backend) as record:
        out = _run_region(sharded, region, kind, features)
    result: dict[str, Any] = {"records": [record], "first_call_syncs": first.total}
    if region == "input_dist":
        result["received_keys"] = [list(received.keys()) for received in out]
    else:
        result["output_rows"] = {key: tuple(jt.values().shape) for key, jt in out.items()}
        result["output_has_indices"] = {key: jt.weights_or_none() is not None for key, jt in out.items()}
    return result


def _requirement(kind: str):
    return (lambda: require_torchrec_td_input("ShardedEmbeddingCollection.input_dist")) if kind == "torchrec_td" else None


def _budget(plan: str, kind: str, region: str, need_indices: bool = False) -> DistSyncBudget:
    suffix = ".need_indices" if need_indices else ""
    return DistSyncBudget(
        name=f"ec_{region}.ws2.{plan}.{kind}{suffix}",
        kind=region,
        rank_function=ec_syncs_on_rank,
        args=(plan, kind, region, need_indices),
        sites=(input_dist_sites(plan, WITH_METADATA[kind]),) * WORLD_SIZE,
        requires=_requirement(kind),
    )


EC_INPUT_DIST_BUDGETS: tuple[DistSyncBudget, ...] = tuple(
    _budget(plan, kind, "input_dist") for plan in PLANS for kind in WITH_METADATA
)
EC_FORWARD_BUDGETS: tuple[DistSyncBudget, ...] = tuple(
    _budget(plan, kind, "forward", need_indices)
    for plan in PLANS
    for kind, need_indices in (("kjt_moved_with_metadata", False), ("kjt_without_metadata", False), ("kjt_moved_with_metadata", True))
)
EC_DIST_BUDGETS: tuple[DistSyncBudget, ...] = EC_INPUT_DIST_BUDGETS + EC_FORWARD_BUDGETS
