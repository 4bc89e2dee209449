"""The oracle of a checkpoint round trip: the unsharded model trained straight through, and what a
reload must hold.

**A resume on another world size.** The unsharded reference (reference.py) steps each parameter by
(1/W) x the sum of the ranks' gradients (torchrec's gradient division, DDP's average). A run saved on
W1 ranks and resumed on W2 is trained, in one reference run, on every step's batches repeated so
that each step has L = lcm(W1, W2) of them: each of the W1 (or W2) batches L/W1 (L/W2) times. Then
(1/L) x the sum over the L batches is exactly (1/W) x the sum over that step's W ranks (up to
rounding), and one unchanged ``train_reference`` is the oracle of both phases. This needs torchrec's
gradient division on (its default): with it off, model-parallel tables sum the ranks' gradients, and
the repetition would multiply them.

**What a reload must hold** is what was saved, gathered from the shards, with one exception:
optimizer state kept per row *of each column shard* (fbgemm's row-wise Adagrad and its family: one
accumulator per row and column block, torchrec's ``momentum1`` laid out block after block). A reload
into a plan that cuts a table into other column blocks changes what each accumulator means. The
conversion that keeps the meaning, stated here and used as the oracle: the accumulator of a new
column block is the width-weighted mean of the old blocks' accumulators over the columns it covers.
Where new blocks are unions of old ones (CW -> TW or RW) it is exactly the accumulator the new
blocks would hold had they been trained so from the start (the mean of the squared gradient over a
union of columns is the width-weighted mean of the per-block means); where they split old blocks
(TW -> CW) each new block inherits its block's value, so every column keeps its step size.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from paritykit.engine.reference import table_placements, train_reference
from paritykit.engine.training import TrainingRecord, TrainingSetup
from paritykit.errors import HarnessError


def repeated(steps: list[list[Any]], copies: int) -> list[list[Any]]:
    """Every step's batches, each repeated ``copies`` times in place (rank r's at r*copies ...)."""
    return [[batch for batch in step for _ in range(copies)] for step in steps]


def record_slice(record: TrainingRecord, start: int, stop: int, every: int) -> TrainingRecord:
    """Steps [start, stop) of ``record``, keeping one of every ``every`` batches of a step (the
    repeated ones out), and its final state."""
    def pick(per_step: list[list[Any]]) -> list[list[Any]]:
        return [row[::every] for row in per_step[start:stop]]

    sliced = dataclasses.replace(record, outputs=pick(record.outputs), losses=pick(record.losses), embeddings=pick(record.embeddings))
    if getattr(record, "step_states", None):  # a record that keeps the state after every step
        sliced = dataclasses.replace(sliced, step_states=record.step_states[start:stop])
    return sliced


def resumed_reference(before: TrainingSetup, after: TrainingSetup, save_after: int, division: bool) -> TrainingRecord:
    """The unsharded model trained on the first ``save_after`` steps of ``before`` then every step of
    ``after`` (another world size allowed); the record holds the steps after the reload only."""
    first, then = before.world_size, after.world_size
    if first != then and not division:
        raise HarnessError("a resume on another world size is compared with the unsharded model only with torchrec's "
                           "gradient division on (its default): with it off the ranks' gradients are summed")
    size = math.lcm(first, then)
    batches = repeated(before.batches[:save_after], size // first) + repeated(after.batches, size // then)
    record = train_reference(dataclasses.replace(before, batches=batches), division=division)
    return record_slice(record, save_after, len(batches), size // then)


def column_blocks(setup: TrainingSetup) -> dict[str, tuple[int, ...]]:
    """Parameter FQN -> the widths of its column blocks under ``setup``'s plan, for every table."""
    model = setup.model_fn()
    return {placement.fqn: placement.column_blocks for placement in table_placements(model, setup.sharding_plan).values()}


def reblocked(value: torch.Tensor, old: tuple[int, ...], new: tuple[int, ...]) -> torch.Tensor:
    """Row-wise state laid out block after block under ``old`` column blocks, as the width-weighted
    mean over the columns each ``new`` block covers (module docstring)."""
    if sum(old) != sum(new):
        raise HarnessError(f"column blocks {old} and {new} do not cover the same {sum(old)} columns")
    rows = value.numel() // len(old)
    by_block = value.reshape(len(old), rows)
    starts_old = [sum(old[:i]) for i in range(len(old))]
    out = []
    for start, width in zip([sum(new[:j]) for j in range(len(new))], new):
        weights = [max(0, min(start + width, s + w) - max(start, s)) / width for s, w in zip(starts_old, old)]
        out.append(sum(weight * by_block[i] for i, weight in enumerate(weights) if weight))
    return torch.cat(out)


def expected_after_reload(saved: dict[str, torch.Tensor], blocks_before: dict[str, tuple[int, ...]],
                          blocks_after: dict[str, tuple[int, ...]], rows: dict[str, int]) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The fused optimizer state a reload must hold, and the keys whose meaning the new plan changed
    (row-wise state of a table cut into other column blocks: converted, compared within rounding)."""
    expected, converted = {}, set()
    for key, value in saved.items():
        fqn = key.split("/")[0]
        old, new = blocks_before.get(fqn), blocks_after.get(fqn)
        row_wise = old is not None and value.dim() == 1 and value.numel() == rows.get(fqn, -1) * len(old)
        if row_wise and new is not None and old != new:
            expected[key], converted = reblocked(value, old, new), converted | {key}
        else:
            expected[key] = value
    return expected, converted


def table_rows(setup: TrainingSetup) -> dict[str, int]:
    """Parameter FQN -> rows, for every 2-D entry of the initial state (tables among them)."""
    return {key: int(value.shape[0]) for key, value in setup.full_state.items() if value.dim() == 2}
