"""torchrec's model delta tracker (``DMP.init_torchrec_delta_tracker``), what online training publishes
from: each read, per consumer, returns the ids each rank's shards looked up since that consumer's last
read, as local row ids of the shard (``get_unique_ids``), and in EMBEDDING mode the row each id had at
its first lookup in that window (``get_unique``). The oracle is the plan and the batches alone:

    a shard of rows [start, start + n) on rank r looks up every id in that range of every rank's batch
    (data-parallel: the rank's own batch), as id - start; its row at the lookup in step s is the seeded
    row minus what the steps before s took from it (SGD, learning rate = world size, loss the sum of
    every looked-up element: each occurrence in any rank's batch takes 1 from every element).

The model holds an EBC (table-wise, column-wise [0, W-1, 0], row-wise, data-parallel) and an EC
(table-wise, row-wise) under a dense layer, so DMP wraps it as a user's model is wrapped. Reads happen
between steps, for two consumers, with torchrec's ``delete_on_read`` and ``auto_compact`` both ways.
EMBEDDING mode tracks the EC alone (``fqns_to_skip``: an EBC's pooled output has no row per id), both
its tables row-wise and every shard given ids in every step: a lookup of no ids fails inside torchrec
there (the known issue delta-tracker-embedding-empty-lookup, run by dmp_known_broken.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paritykit.errors import HarnessError, ParityError
from paritykit.harness.seeding import generator
from paritykit.harness.tables import TableSpec, build_ebc, build_ec, seeded_full_weights

WIDTH = 4
BAG_TABLES = (TableSpec("b0", 9, WIDTH, ("f0",)), TableSpec("b1", 7, 3 * WIDTH, ("f1",)), TableSpec("b2", 10, WIDTH, ("f2",)),
              TableSpec("b3", 6, WIDTH, ("f3",)))
SEQUENCE_TABLES = (TableSpec("s0", 8, WIDTH, ("g0",)), TableSpec("s1", 11, WIDTH, ("g1",)))
STEPS, ROWS_PER_BATCH = 4, 3


@dataclass(frozen=True)
class TrackerCase:
    world_size: int
    mode: str  # "ID_ONLY" or "EMBEDDING"
    # (after step, consumer): a read between steps (steps counted from 1).
    reads: tuple[tuple[int, str], ...]
    delete_on_read: bool = True
    auto_compact: bool = False
    seed: int = 0
    # The EC row-wise and every rank's shards of it given ids in every step (a first row holding an id of
    # each row block): in EMBEDDING mode a lookup of no ids fails inside torchrec (known issue
    # delta-tracker-embedding-empty-lookup).
    cover: bool = False

    @property
    def consumers(self) -> list[str]:
        return sorted({consumer for _, consumer in self.reads})

    def case_id(self) -> str:
        reads = " ".join(f"{consumer}@{step}" for step, consumer in self.reads)
        return (f"delta tracker {self.mode} reads=[{reads}] delete_on_read={self.delete_on_read} auto_compact={self.auto_compact} "
                f"{'every shard looked up ' if self.cover else ''}world_size={self.world_size} seed={self.seed}")


def tracker_cases(world_size: int) -> tuple[TrackerCase, ...]:
    interleaved = ((1, "publish"), (3, "snapshot"), (3, "publish"), (4, "publish"), (4, "snapshot"))
    return (TrackerCase(world_size, "ID_ONLY", interleaved, seed=71),
            TrackerCase(world_size, "ID_ONLY", interleaved, delete_on_read=False, auto_compact=True, seed=72),
            TrackerCase(world_size, "EMBEDDING", ((2, "publish"), (4, "publish")), auto_compact=True, seed=73, cover=True),
            # Two consumers, one lagging: its read spans lookups another read compacted apart (the ids and the
            # rows each must come from every one of them).
            TrackerCase(world_size, "EMBEDDING", interleaved, seed=74, cover=True))


def embedding_mode_empty_lookup(world_size: int) -> TrackerCase:
    """EMBEDDING mode where a rank looks up no ids for a sharding type: the EC's table-wise table is on rank 0."""
    return TrackerCase(world_size, "EMBEDDING", ((2, "publish"),), seed=73)


def placements(case: TrackerCase) -> dict[str, dict[str, Any]]:
    """Per module, each table's placement with the fused kernel (the kernel a table trained in backward has).
    A covered case's EC is row-wise alone: a rank without a table-wise shard looks up no ids there."""
    from paritykit.harness.plans import normalize_plan_entry, parameter_sharding_generator

    last = case.world_size - 1
    short = {"ebc": {"b0": ("table_wise", last), "b1": ("column_wise", (0, last, 0)), "b2": ("row_wise",), "b3": ("data_parallel",)},
             "ec": {"s0": ("row_wise",) if case.cover else ("table_wise", 0), "s1": ("row_wise",)}}
    return {module: {table: parameter_sharding_generator(normalize_plan_entry(table, entry), None if entry[0] == "data_parallel" else "fused")
                     for table, entry in entries.items()} for module, entries in short.items()}


class BagsAndSequences(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.ebc = build_ebc(BAG_TABLES, seed=seed)
        self.ec = build_ec(SEQUENCE_TABLES, seed=seed)
        self.dense = nn.Linear(sum(t.embedding_dim for t in BAG_TABLES), 1)

    def forward(self, bags: Any, sequences: Any) -> torch.Tensor:
        pooled = self.ebc(bags)
        looked_up = self.ec(sequences)
        return self.dense(pooled.values()).sum() + sum(looked_up[t.feature_names[0]].values().sum() for t in SEQUENCE_TABLES)


def batch_ids(case: TrackerCase) -> list[list[dict[str, list[list[int]]]]]:
    """ids[step][rank][feature]: rows of ids, some empty (drawn from the case's seed)."""
    draw = generator("delta-tracker", case.seed, case.world_size)
    tables = BAG_TABLES + SEQUENCE_TABLES
    ids = [[{t.feature_names[0]: [torch.randint(0, t.num_embeddings, (int(torch.randint(0, 3, (1,), generator=draw)),),
                                                generator=draw).tolist() for _ in range(ROWS_PER_BATCH)] for t in tables}
            for _ in range(case.world_size)] for _ in range(STEPS)]
    if case.cover:
        for step in ids:
            for batch in step:
                for t in SEQUENCE_TABLES:
                    block = -(-t.num_embeddings // case.world_size)
                    batch[t.feature_names[0]][0] = list(range(0, t.num_embeddings, block))
    return ids


def _kjt(rows: dict[str, list[list[int]]], tables: tuple[TableSpec, ...]) -> Any:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys = [t.feature_names[0] for t in tables]
    return KeyedJaggedTensor(keys=keys, values=torch.tensor([v for k in keys for row in rows[k] for v in row], dtype=torch.int64),
                             lengths=torch.tensor([len(row) for k in keys for row in rows[k]], dtype=torch.int32))


def run_tracker_case_on_rank(case: TrackerCase, plan: Any) -> list[dict[str, tuple[list[int], list[list[float]] | None]]]:
    """Each read's {table fqn: (ids, states or None)} on this rank, in read order."""
    import torch.distributed as dist
    from torchrec.distributed.model_tracker.types import DeltaTrackerConfig, TrackingMode
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from paritykit.engine.dmp_options import DmpOptions

    rank, model = dist.get_rank(), BagsAndSequences(case.seed)
    for module in (model.ebc, model.ec):
        apply_optimizer_in_backward(torch.optim.SGD, module.parameters(), {"lr": float(case.world_size)})
    dmp = DmpOptions().sharded(lambda: model, plan, torch.device("cpu"))
    config = DeltaTrackerConfig(tracking_mode=TrackingMode[case.mode], consumers=case.consumers, delete_on_read=case.delete_on_read,
                                auto_compact=case.auto_compact, fqns_to_skip=["ebc"] if case.mode == "EMBEDDING" else [])
    tracker = dmp.init_torchrec_delta_tracker(config)
    ids, reads = batch_ids(case), []
    for step in range(1, STEPS + 1):
        batch = ids[step - 1][rank]
        dmp(_kjt(batch, BAG_TABLES), _kjt(batch, SEQUENCE_TABLES)).backward()
        for _, consumer in (read for read in case.reads if read[0] == step):
            rows = tracker.get_unique(consumer)
            reads.append({fqn: (found.ids.tolist(), None if found.states is None else found.states.tolist())
                          for fqn, found in rows.items()})
    return reads


def expected_reads(case: TrackerCase, plan: Any) -> list[list[dict[str, tuple[list[int], list[list[float]] | None]]]]:
    """expected[rank][read]: the oracle of the module docstring, from the plan's shards and the batches."""
    ids, weights = batch_ids(case), seeded_full_weights(BAG_TABLES + SEQUENCE_TABLES, case.seed)
    tracked = [("ec", "embeddings", t) for t in SEQUENCE_TABLES] + \
        ([] if case.mode == "EMBEDDING" else [("ebc", "embedding_bags", t) for t in BAG_TABLES])
    last_read = {consumer: 0 for consumer in case.consumers}
    expected: list[list[dict]] = [[] for _ in range(case.world_size)]
    for step, consumer in case.reads:
        window = range(last_read[consumer] + 1, step + 1)
        last_read[consumer] = step
        for rank in range(case.world_size):
            found = {}
            for module, attribute, table in tracked:
                local = _local_ids(ids, window, rank, table, plan.plan[module][table.name])
                if local:
                    states = [_row_at(weights[table.name], ids, first, table, case.world_size).tolist()
                              for first in (local[i] for i in sorted(local))] if case.mode == "EMBEDDING" else None
                    found[f"{module}.{attribute}.{table.name}"] = (sorted(local), states)
            expected[rank].append(found)
    return expected


def _local_ids(ids: list, window: range, rank: int, table: TableSpec, sharding: Any) -> dict[int, tuple[int, int]]:
    """{local id: (step, global id) of its first lookup in the window} for ``rank``'s shards of ``table``."""
    feature = table.feature_names[0]
    seen: dict[int, tuple[int, int]] = {}
    for step in window:
        if sharding.sharding_type == "data_parallel":
            spans = [(0, table.num_embeddings)]
            sources = [ids[step - 1][rank]]
        else:
            spans = [(shard.shard_offsets[0], shard.shard_sizes[0]) for shard in sharding.sharding_spec.shards
                     if shard.placement.rank() == rank]
            sources = ids[step - 1]
        for start, size in spans:
            for batch in sources:
                for global_id in (v for row in batch[feature] for v in row if start <= v < start + size):
                    seen.setdefault(global_id - start, (step, global_id))
    return seen


def _row_at(seeded: torch.Tensor, ids: list, first: tuple[int, int], table: TableSpec, world_size: int) -> torch.Tensor:
    """The row ``first[1]`` at step ``first[0]``'s lookup: every earlier occurrence in any rank's batch took 1."""
    step, global_id = first
    feature = table.feature_names[0]
    taken = sum(row.count(global_id) for earlier in ids[: step - 1] for batch in earlier for row in batch[feature])
    return seeded[global_id] - taken


def tracker_plan(case: TrackerCase) -> Any:
    from paritykit.harness.plan_resolution import resolve_plan

    return resolve_plan(BagsAndSequences(case.seed), placements(case), world_size=case.world_size, device_type="cpu")


def run_tracker_case(case: TrackerCase, pool: Any) -> dict[str, Any]:
    from torchrec.distributed.model_parallel import DistributedModelParallel

    if pool.world_size != case.world_size or case.world_size < 2:
        raise HarnessError(f"case needs world size {case.world_size} (two or more), the pool has {pool.world_size}")
    if not hasattr(DistributedModelParallel, "init_torchrec_delta_tracker"):
        raise HarnessError("delta tracker: this torchrec's DistributedModelParallel has no init_torchrec_delta_tracker")
    plan = tracker_plan(case)
    return compare_reads(case, plan, pool.call(run_tracker_case_on_rank, (case, plan), case=case.case_id()))


def compare_reads(case: TrackerCase, plan: Any, per_rank: list) -> dict[str, Any]:
    """ParityError naming the rank, read (consumer, step) and table fqn whose ids or rows differ."""
    expected = expected_reads(case, plan)
    problems = []
    for rank, (reads, wanted) in enumerate(zip(per_rank, expected)):
        if len(reads) != len(wanted):
            problems.append(f"rank {rank}: {len(reads)} reads returned, {len(wanted)} made")
        for (step, consumer), got, want in zip(case.reads, reads, wanted):
            got = {fqn: found for fqn, found in got.items() if found[0]}  # a table hit by nothing: absent or empty alike
            for fqn in sorted(set(got) | set(want)):
                problem = _difference(got.get(fqn), want.get(fqn))
                if problem:
                    problems.append(f"rank {rank}, consumer {consumer!r} reading after step {step}, {fqn}: {problem}")
    if problems:
        raise ParityError(f"{case.case_id()}\n  " + "\n  ".join(problems[:8]))
    compared = sum(len(found[0]) for reads in expected for read in reads for found in read.values())
    if not compared:
        raise HarnessError(f"{case.case_id()}: no id was expected in any read (nothing compared)")
    return {"ranks": case.world_size, "reads": len(case.reads), "ids_compared": compared}


def _difference(got: tuple | None, want: tuple | None) -> str | None:
    got_ids, want_ids = (got or ([], None))[0], (want or ([], None))[0]
    if sorted(got_ids) != want_ids:
        return f"ids {sorted(got_ids)}, expected {want_ids}"
    if want is None or want[1] is None:
        return None
    if got is None or got[1] is None:
        return "no rows tracked (EMBEDDING mode)"
    rows = dict(zip(got[0], got[1]))
    wrong = [(i, rows[i], row) for i, row in zip(want_ids, want[1]) if not torch.allclose(torch.tensor(rows[i]), torch.tensor(row))]
    return None if not wrong else "; ".join(f"id {i}: row {g}, expected {w} (its row at its first lookup in the window)"
                                            for i, g, w in wrong[:2])
