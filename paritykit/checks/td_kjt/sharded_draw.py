"""Drawn sharded td-kjt cases: a plan mixing the placements torchrec offers on the device, one
kernel, SUM and MEAN tables, several features per table, and two steps of batches per rank, with
a variable batch size per feature (VBE) where torchrec takes it.

The draws stay inside what torchrec computes (so examples test parity, not known failures):
- placements (``placements_to_draw``) and kernels (``kernels_for``) are what torchrec offers, minus the known issues'
  (what torchrec offers, minus ``supported_on_device``);
- VBE only with the placements and kernels whose forward torchrec computes (``VBE_BROKEN``); where
  it cannot train them on the device, the case compares outputs only (``train=False``); the
  broken ones are run on purpose by ``known_broken.py``. Every batch of a VBE case is VBE: a
  sharded EBC decides at its first batch whether it will ever expand by inverse indices (a VBE
  batch after a fixed one is refused);
- no row-wise MEAN table beside tables of other placements (``RW_MEAN_BESIDE_OTHERS``);
- an EmbeddingCollection has one embedding dim, and its column-wise tables one shard count;
- a weighted EBC pools with SUM (torch's embedding_bag takes per-id weights only with SUM);
- torchrec's own TensorDict route only where it is defined: unweighted, no VBE, contiguous forms.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from hypothesis import assume
from hypothesis import strategies as st

from paritykit.checks.td_kjt.sharded_spec import (
    ROUTE_KJT,
    ROUTE_PARITYKIT,
    ROUTE_TORCHREC,
    RankBatch,
    ShardedCase,
)
from paritykit.harness.plans import ROW_WISE_KINDS, local_world_size, row_wise_mean_beside_others
from paritykit.harness.tables import TableSpec
from paritykit.strategies import (
    CONTIGUOUS_FORMS,
    JAGGED_FORMS,
    SparseBatch,
    sparse_batches,
)

STEPS = 2
MAX_BATCH = 4
CW_SHARDS = (2, 3)
SHARD_WIDTH = 4

# Names a case carries beside its module, kernel and placements (see case_names): its tables pool
# both ways; a row-sharded MEAN table sits in a plan with both row-sharded placements (which can
# reorder the features).
MIXED_POOLING = "mixed-pooling"
ROW_MEAN_TWO_PLACEMENTS = "row-mean-two-placements"


@dataclass(frozen=True)
class Broken:
    """A configuration that fails inside torchrec: on ``device`` ("*": any), with ``name`` (a
    placement, kernel or module kind) in the case, from ``min_world_size`` ranks on."""

    label: str  # stable: known issues match it in the case id
    device: str
    name: str
    reason: str
    training_only: bool = False  # the forward is right; backward or the step is not
    min_world_size: int = 1

    def applies(self, device: str, names: set[str], world_size: int) -> bool:
        return self.device in ("*", device) and self.name in names and world_size >= self.min_world_size


VBE_BROKEN = (
    Broken("vbe-dense-kernel", "cpu", "dense", "a VBE batch into a sharded EBC with the dense kernel on CPU raises a "
           "split-size error (table-wise, row-wise) or returns wrong pooled rows (column-wise)"),
    Broken("vbe-mixed-pooling", "cpu", MIXED_POOLING, "a VBE batch into a sharded EBC on CPU whose tables of one "
           "sharding type on one rank need two TBEs (SUM and MEAN tables) raises: TBE's pre-allocated vbe_output is "
           "not supported on CPU"),
    Broken("vbe-row-mean-reordered", "*", ROW_MEAN_TWO_PLACEMENTS, "a VBE batch into a sharded EBC with row-sharded "
           "MEAN tables whose plan reorders the features: the MEAN divisor takes the inverse indices in input key order "
           "(_create_mean_pooling_divisor reorders them only when the key count differs): index out of range, or "
           "wrong divisors"),
    Broken("vbe-data-parallel", "*", "data_parallel", "a data-parallel table has no variable-batch output path in "
           "torchrec (dp_sharding.py): a VBE batch raises a split-size error"),
    Broken("vbe-training-ec", "cpu", "ec", "a sharded EC fed a VBE batch on CPU returns the right embeddings but its "
           "tables get no gradient (the VBE reindex in construct_jagged_tensors does not pass gradients back)",
           training_only=True),
    Broken("vbe-training-row-wise", "cpu", "row_wise", "backward of a VBE batch through row-wise tables needs an "
           "all_gather of uneven sizes (ReduceScatterV), which gloo refuses", training_only=True, min_world_size=2),
    Broken("vbe-training-table-row-wise", "cpu", "table_row_wise", "backward of a VBE batch through table-row-wise "
           "tables needs an all_gather of uneven sizes (ReduceScatterV), which gloo refuses", training_only=True,
           min_world_size=2),
)
RW_MEAN_BESIDE_OTHERS = (
    "a sharded EBC with a row-wise or table-row-wise MEAN table divides the pooled output of every other table by "
    "its bag length (_create_mean_pooling_divisor sets only row-sharded SUM features to 1): SUM tables come out "
    "averaged, MEAN tables averaged twice"
)


def vbe_problems(device: str, names: set[str], world_size: int) -> list[Broken]:
    """The VBE_BROKEN entries a VBE case with these placements/kernel/module names runs into."""
    return [b for b in VBE_BROKEN if b.applies(device, names, world_size)]


def vbe_supported(device: str, name: str, world_size: int = 1) -> bool:
    """False for a placement or kernel whose VBE forward fails inside torchrec on ``device``."""
    return not any(not b.training_only for b in vbe_problems(device, {name}, world_size))


def trains_with_vbe(device: str, names: set[str], world_size: int) -> bool:
    return not vbe_problems(device, names, world_size)


def placements_to_draw(module: str, device: str) -> tuple[str, ...]:
    """What torchrec's sharder offers for ``module`` on ``device``, minus the known-broken ones; for an
    EBC also row-wise and table-row-wise, which its sharder advertises only for CUDA but which shard
    and compute on CPU when a plan asks for them (the pinned cases show it)."""
    from paritykit.checks.known_issues import supported_on_device
    from paritykit.harness.plans import placements_for

    # TWCW and GRID are the sharding check's to draw; this check's tables and entries know the rest.
    offered = tuple(p for p in placements_for(module, device) if p not in ("table_column_wise", "grid_shard"))
    if module == "ebc":
        offered = tuple(dict.fromkeys(offered + ROW_WISE_KINDS))
    return tuple(p for p in offered if supported_on_device(device, module, p))


def routes_for(weighted: bool, variable_batch: bool, form: str) -> tuple[str, ...]:
    torchrec_takes_it = not weighted and not variable_batch and form in CONTIGUOUS_FORMS
    return (ROUTE_KJT, ROUTE_PARITYKIT) + ((ROUTE_TORCHREC,) if torchrec_takes_it else ())


def case_names(module: str, kernel: str, tables, plan) -> set[str]:
    """What a case is made of, in the names of VBE_BROKEN: module, kernel, placements, mixed pooling."""
    placements = {entry[0] for entry in plan.values()}
    names = {module, kernel, *placements}
    if module == "ebc" and len({t.pooling for t in tables}) > 1:
        names.add(MIXED_POOLING)
    row_mean = any(t.pooling == "MEAN" and plan[t.name][0] in ROW_WISE_KINDS for t in tables)
    if module == "ebc" and row_mean and set(ROW_WISE_KINDS) <= placements:
        names.add(ROW_MEAN_TWO_PLACEMENTS)
    return names


def kernels_for(module: str, device: str) -> tuple[str, ...]:
    """Kernels torchrec offers a model-parallel table of ``module`` on ``device`` that no known issue keeps
    out of the draws (data-parallel tables always use dense)."""
    from paritykit.checks.known_issues import supported_on_device
    from paritykit.harness.plans import compute_kernels

    return tuple(k for k in compute_kernels(device, "column_wise", module) if supported_on_device(device, module, k))


def placement_entry(kind: str, world_size: int, draw: Any, cw_shards: int | None = None) -> tuple:
    """A drawn short placement of ``kind``: CW shards on ranks in any order, TW on any rank."""
    if kind == "column_wise":
        return (kind, tuple(draw(st.lists(st.integers(0, world_size - 1), min_size=cw_shards, max_size=cw_shards))))
    if kind == "table_wise":
        return (kind, draw(st.integers(0, world_size - 1)))
    if kind == "table_row_wise":
        # Any host of a torchrun launch of several (the ranks shard with the launch's hosts); else host 0.
        hosts = world_size // local_world_size(world_size)
        return (kind, draw(st.integers(0, hosts - 1)) if hosts > 1 else 0)
    return (kind,)


def _draw_tables(draw: Any, module: str, world_size: int, placements: tuple[str, ...], weighted: bool, one_pooling: bool):
    num_tables = draw(st.integers(1, 3))
    ec_shards = draw(st.sampled_from(CW_SHARDS))
    module_pooling = draw(st.sampled_from(("SUM", "MEAN"))) if module == "ebc" and not weighted else "SUM"
    tables, plan, feature = [], {}, 0
    for index in range(num_tables):
        kind = draw(st.sampled_from(placements))
        shards = ec_shards if module == "ec" else draw(st.sampled_from(CW_SHARDS))
        count = draw(st.integers(1, 2))  # several features per table
        names = tuple(f"f{feature + i}" for i in range(count))
        feature += count
        dim = SHARD_WIDTH * shards if (module == "ec" or kind == "column_wise") else draw(st.sampled_from((4, 8)))
        pooling = module_pooling if one_pooling or weighted else draw(st.sampled_from(("SUM", "MEAN")))
        tables.append(TableSpec(f"t{index}", draw(st.integers(4, 12)), dim, names, pooling))
        plan[f"t{index}"] = placement_entry(kind, world_size, draw, cw_shards=shards)  # CW on ranks in any order
    if row_wise_mean_beside_others(tables, plan):  # RW_MEAN_BESIDE_OTHERS, known-broken: run on purpose, not drawn
        tables = [replace(t, pooling="SUM") if plan[t.name][0] in ROW_WISE_KINDS else t for t in tables]
    return tuple(tables), plan


@st.composite
def rank_batches(draw: Any, tables: tuple[TableSpec, ...], weighted: bool, variable_batch: bool, batch_size: int) -> RankBatch:
    """One rank's batch; with ``variable_batch``, ``batch_size`` is the output's B and each feature
    has its own B_f <= B (sometimes one B_f for all: a VBE batch need not differ per feature)."""
    keys = [f for t in tables for f in t.feature_names]
    bounds = {f: t.num_embeddings for t in tables for f in t.feature_names}
    one_size = not variable_batch or draw(st.booleans())
    smallest = draw(st.integers(1, batch_size)) if variable_batch and one_size else 1 if variable_batch else batch_size
    batch = draw(sparse_batches(
        keys=keys, min_batch_size=smallest, max_batch_size=smallest if one_size else batch_size, id_bounds=bounds,
        weighted=weighted, variable_batch=not one_size, id_dtypes=(torch.int64,), offsets_dtypes=(torch.int64,),
    ))
    if not variable_batch:
        return RankBatch(batch)
    inverse = tuple(
        tuple(draw(st.lists(st.integers(0, size - 1), min_size=batch_size, max_size=batch_size)))
        for size in batch.batch_sizes
    )
    return RankBatch(batch, inverse)


@st.composite
def sharded_cases(draw: Any, world_size: int, device: str, module: str | None = None,
                  variable_batch: bool | None = None) -> ShardedCase:
    # EBC twice as often: pooling, weights and VBE expansion give it more to get wrong.
    module = module or draw(st.sampled_from(("ebc", "ebc", "ec")))
    vbe = draw(st.booleans()) if variable_batch is None else variable_batch
    placements = tuple(p for p in placements_to_draw(module, device) if not vbe or vbe_supported(device, p, world_size))
    kernels = tuple(k for k in kernels_for(module, device) if not vbe or vbe_supported(device, k, world_size))
    kernel = draw(st.sampled_from(kernels))
    weighted = module == "ebc" and draw(st.booleans())
    one_pooling = vbe and not vbe_supported(device, MIXED_POOLING, world_size)
    tables, plan = _draw_tables(draw, module, world_size, placements, weighted, one_pooling)
    names = case_names(module, kernel, tables, plan)
    assume(not vbe or all(vbe_supported(device, name, world_size) for name in names))
    form = draw(st.sampled_from(JAGGED_FORMS))
    steps = []
    for _ in range(STEPS):
        # A VBE batch needs room for two batch sizes per feature (sparse_batches draws distinct ones).
        size = draw(st.integers(2 if vbe else 1, MAX_BATCH))
        steps.append(tuple(draw(rank_batches(tables, weighted, vbe, size)) for _ in range(world_size)))
    return ShardedCase(
        module=module, world_size=world_size, tables=tables, plan=plan, kernel=kernel,
        routes=routes_for(weighted, vbe, form), form=form, steps=tuple(steps), weighted=weighted,
        need_indices=module == "ec" and draw(st.booleans()), device=device, seed=draw(st.integers(0, 2**16)),
        # Where torchrec cannot train a VBE configuration on the device, its outputs are still checked.
        train=not vbe or trains_with_vbe(device, names, world_size),
    )


def fixed_batch(keys: tuple[str, ...], lengths: tuple[tuple[int, ...], ...], bound: int, seed: int,
                weighted: bool = False, inverse: tuple[tuple[int, ...], ...] | None = None) -> RankBatch:
    batch = SparseBatch(keys=keys, lengths=lengths, id_bounds=(bound,) * len(keys), seed=seed, weighted=weighted)
    return RankBatch(batch, inverse)
