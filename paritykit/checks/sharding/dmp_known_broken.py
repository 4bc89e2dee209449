"""DMP and collectives configurations that fail inside torchrec on CPU, each run on purpose once per gate
as ``known-broken <rule> ...`` (matched by paritykit/checks/known_issues.toml, verified on torchrec 1.8.0
and 1.9.2). The pinned DMP cases (dmp_cases.py) stay clear of them; each rule says what it avoids.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from paritykit.checks.sharding.cases import RankBatch, ShardingCase
from paritykit.checks.sharding.delta_tracker_cases import embedding_mode_empty_lookup, run_tracker_case
from paritykit.checks.sharding.dmp_cases import DmpCase, _bag_base, _steps, _tables, run_dmp_case
from paritykit.checks.sharding.dmp_surface import strict_problem, surface_cases
from paritykit.engine.dmp_options import DmpOptions
from paritykit.engine.resharding import rank_tags
from paritykit.errors import ParityError

RULES = {
    "ec-sync-collectives-rank-without-shards":
        "a sharded EmbeddingCollection under torchrec_use_sync_collectives, where a rank holds no table of a "
        "sharding type: all2all_sequence_sync hands that rank's empty 2-D embeddings to the functional "
        "all_to_all_single with element-counted splits, which it reads as rows; the output split fails "
        "(the pinned sync cases give every rank a shard of each EC sharding type)",
    "dmp-reshard-p2p-tags":
        "DistributedModelParallel.reshard tags each point-to-point transfer with Python's hash() of a tuple "
        "holding the table's name; it differs between processes (unless they share PYTHONHASHSEED), so on gloo, "
        "which matches sends to receives by tag, the reshard waits forever (the pinned reshard case hashes the "
        "same tuple with a hash the ranks share: paritykit.engine.resharding)",
    "dmp-copy":
        "DistributedModelParallel.copy fails on a gloo-sharded model: torchrec's sharded_model_copy patches "
        "ProcessGroupNCCL (absent from a CPU-only torch) and cannot deep-copy the ProcessGroup itself",
    "sharded-embedding-bag-column-wise":
        "a plain nn.EmbeddingBag sharded column-wise by EmbeddingBagSharder (a placement its sharder offers "
        "on CPU) fails in its input dist: assert len(input.keys()) == sum(self._splits)",
    "sharded-embedding-bag-data-parallel":
        "a plain nn.EmbeddingBag placed data-parallel by EmbeddingBagSharder cannot be wrapped by DDP: "
        "ShardedEmbeddingBag.named_parameters(recurse=False) yields nothing, so DDP finds no parameter",
    "sharded-embedding-bag-torch-offsets":
        "a sharded nn.EmbeddingBag reads offsets as a KeyedJaggedTensor does (batch + 1, ending with the "
        "number of ids) whatever the module's include_last_offset: fed torch's default offsets (each bag's "
        "start) it fails where the unsharded module pools (the pinned bag cases use include_last_offset=True)",
    "ebc-unweighted-uses-kjt-weights":
        "an EmbeddingBagCollection built unweighted (is_weighted=False) ignores the per-id weights of the "
        "KeyedJaggedTensor it is fed; sharded (any placement) it multiplies the ids by them",
    "dmp-load-state-dict-not-strict":
        "DistributedModelParallel.load_state_dict with its default strict=True does not raise on a missing key "
        "outside the sharded modules (a dense parameter) nor on an unexpected key, where the unsharded module "
        "raises: it returns them (the missing key under a name without its module prefix), so a checkpoint "
        "that lost its dense layers loads silently (the state-surface cases compare strict=False only)",
    "delta-tracker-embedding-empty-lookup":
        "DistributedModelParallel's model delta tracker in EMBEDDING mode fails inside the forward of a sharded "
        "EmbeddingCollection on a rank whose lookup of a sharding type gets no ids (a rank holding no shard of a "
        "table-wise table): record_embeddings asserts embeddings.numel() % kjt.values().numel() == 0, a modulo "
        "by zero (the pinned EMBEDDING case shards the EC row-wise and gives every shard ids in every step)",
}


def _ec_rank_without_shards(world_size: int) -> DmpCase:
    # Every rank lacks the shards of one sharding type (table-wise on the last rank, column-wise on the
    # others), so every rank fails in its forward and none is left waiting in a collective.
    tables = _tables(8)
    others = tuple(r for r in range(world_size - 1) for _ in range(2))
    plan = {"t0": ("table_wise", world_size - 1), "t1": ("column_wise", others), "t2": ("column_wise", others)}
    return DmpCase("sync-collectives", ShardingCase("ec", world_size, tables, plan, steps=_steps(world_size, 1), seed=51),
                   DmpOptions(sync_collectives=True))


def _copy(world_size: int) -> DmpCase:
    plan = {"t0": ("table_wise", 0), "t1": ("row_wise",), "t2": ("column_wise", (0, world_size - 1))}
    return DmpCase("copy", ShardingCase("ebc", world_size, _tables(), plan, steps=_steps(world_size, 1), seed=52),
                   DmpOptions(copy=True))


def _bag(world_size: int, plan: tuple, seed: int, model: str = "embedding-bag") -> DmpCase:
    base = dataclasses.replace(_bag_base(world_size, seed, "fused"), plan={"weight": plan})
    return DmpCase("embedding-bag", dataclasses.replace(base, steps=base.steps[:1]), DmpOptions(), model=model)


def _unweighted(world_size: int) -> DmpCase:
    def weighted(batch: RankBatch) -> RankBatch:
        return RankBatch(batch.ids, tuple((key, tuple(tuple(0.5 + 0.25 * i for i in range(len(row))) for row in rows))
                                          for key, rows in batch.ids))

    steps = tuple(tuple(weighted(batch) for batch in step) for step in _steps(world_size, 1))
    plan = {"t0": ("table_wise", 0), "t1": ("row_wise",), "t2": ("data_parallel",)}
    base = ShardingCase("ebc", world_size, _tables(), plan, weighted=True, steps=steps, seed=53)
    return DmpCase("unweighted-ebc", base, DmpOptions(), model="unweighted-module")


def _tags_probe(pool: Any) -> dict[str, Any]:
    """The point-to-point tag torchrec computes for one transfer, on every rank: a sender and its
    receiver must agree (gloo matches by tag)."""
    tags = pool.call(rank_tags, (), case="torchrec's reshard P2P tags")
    if len(set(tags)) > 1:
        raise ParityError(f"torchrec's P2P tag for one shard transfer differs between ranks: {tags} "
                          "(dynamic_sharding._generate_tag hashes the table's name with Python's per-process hash); "
                          "DMP.reshard waits forever on gloo")
    return {"ranks": len(tags)}


def known_broken_dmp_cases(world_size: int) -> dict[str, tuple[str, Callable[[Any], dict[str, Any]]]]:
    """Rule name -> (case id, the body that runs its minimal reproduction on a pool of ``world_size``
    (>= 2) ranks)."""
    cases: dict[str, DmpCase] = {
        "ec-sync-collectives-rank-without-shards": _ec_rank_without_shards(world_size),
        "dmp-copy": _copy(world_size),
        "sharded-embedding-bag-column-wise": _bag(world_size, ("column_wise", (0, world_size - 1)), 54),
        "sharded-embedding-bag-data-parallel": _bag(world_size, ("data_parallel",), 55),
        "sharded-embedding-bag-torch-offsets": _bag(world_size, ("row_wise",), 56, model="embedding-bag-torch-offsets"),
        "ebc-unweighted-uses-kjt-weights": _unweighted(world_size),
    }
    found: dict[str, tuple[str, Callable[[Any], dict[str, Any]]]] = {
        rule: (f"known-broken {rule} {case.case_id()}", lambda pool, case=case: run_dmp_case(case, pool))
        for rule, case in cases.items()}
    found["dmp-reshard-p2p-tags"] = (f"known-broken dmp-reshard-p2p-tags world_size={world_size}", _tags_probe)
    tracker = embedding_mode_empty_lookup(world_size)
    found["delta-tracker-embedding-empty-lookup"] = (f"known-broken delta-tracker-embedding-empty-lookup {tracker.case_id()}",
                                                     lambda pool: run_tracker_case(tracker, pool))
    strict = surface_cases(world_size)[0]
    found["dmp-load-state-dict-not-strict"] = (f"known-broken dmp-load-state-dict-not-strict {strict.case_id()}",
                                               lambda pool: strict_problem(strict, pool))
    return {rule: found[rule] for rule in RULES}
