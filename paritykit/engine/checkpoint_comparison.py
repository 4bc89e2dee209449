"""What a checkpoint round trip compares, each against an oracle that never ran the code under test.

1. The run that saved and carried on, per step and at the end, against the unsharded model trained
   straight through (reference.py); its state at the save against the unsharded model at that step.
2. After the reload, before any step: the model's and every optimizer's state gathered from the new
   plan's shards against what was saved (gathered from the old plan's), key by key, bit for bit; the
   learning rate each parameter's next step will use; for tables sharded with the dense kernel, whose
   dense-optimizer state is a rank-local tensor, rank by rank where both plans hold the same shards.
   Row-wise state of a table cut into other column blocks against its stated conversion
   (checkpoint_reference.py), within rounding.
3. The resumed run, per step and at the end, against the unsharded model trained straight through
   (on a world-size change: both phases in one reference run), and against the run that carried on
   (when it trained the same batches): bit for bit on the same plan, within the bound on another.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from paritykit.compare import format_differences
from paritykit.engine.comparison import EXACT, Bound, Tolerance, final_problems, per_step_problems
from paritykit.engine.training import TrainingRecord
from paritykit.errors import ParityError
from paritykit.harness.shards import assemble


@dataclass
class Snapshot:
    """The model's and the optimizers' state at one point, gathered from every rank's shards."""

    state: dict[str, torch.Tensor]
    fused_state: dict[str, torch.Tensor]
    dense_state: dict[str, torch.Tensor]
    learning_rates: dict[str, float]
    local_state: list[dict[str, torch.Tensor]] = field(default_factory=list)  # [rank]{key: tensor}


@dataclass
class PhaseRecord:
    """One phase on every rank: its steps (with the state at its end) and its snapshots."""

    steps: TrainingRecord
    saved: Snapshot | None = None
    restored: Snapshot | None = None


def assemble_snapshot(per_rank: list[dict[str, Any]], what: str) -> Snapshot:
    rates: dict[str, float] = {}
    for record in per_rank:
        rates.update(record["learning_rates"])
    return Snapshot(
        state=assemble([r["state"] for r in per_rank], f"the model's state {what}"),
        fused_state=assemble([r["fused_state"] for r in per_rank], f"the fused optimizer's state {what}"),
        dense_state=assemble([r["dense_state"] for r in per_rank], f"the dense optimizer's state {what}"),
        learning_rates=rates,
        local_state=[r["local_state"] for r in per_rank],
    )


def assemble_phase(per_rank: list[dict[str, Any]]) -> PhaseRecord:
    steps = len(per_rank[0]["outputs"])
    final = assemble_snapshot([r["final"] for r in per_rank], "after the last step")
    record = TrainingRecord(
        outputs=[[r["outputs"][s] for r in per_rank] for s in range(steps)],
        losses=[[r["losses"][s] for r in per_rank] for s in range(steps)],
        embeddings=[[r["embeddings"][s] for r in per_rank] for s in range(steps)],
        state=final.state, fused_state=final.fused_state, dense_state=final.dense_state,
    )
    saved = assemble_snapshot([r["saved"] for r in per_rank], "at the save") if "saved" in per_rank[0] else None
    restored = assemble_snapshot([r["restored"] for r in per_rank], "after the reload") if "restored" in per_rank[0] else None
    return PhaseRecord(record, saved, restored)


def as_record(snapshot: Snapshot, steps: TrainingRecord) -> TrainingRecord:
    """A snapshot in the shape ``final_problems`` compares (its step count names the step)."""
    return dataclasses.replace(steps, state=snapshot.state, fused_state=snapshot.fused_state, dense_state=snapshot.dense_state)


def labelled(problems: list[str], label: str) -> list[str]:
    return [f"{label}: {problem}" for problem in problems]


def against_reference(actual: TrainingRecord, reference: TrainingRecord, tolerance: Tolerance, label: str,
                      first_step: int = 0) -> list[str]:
    """Per-step and final problems of ``actual`` vs the unsharded reference; steps numbered from ``first_step``."""
    per_step = per_step_problems(actual, reference, tolerance)
    found = per_step[:3] + ([f"... and {len(per_step) - 3} more step(s)/rank(s) differ"] if len(per_step) > 3 else [])
    found += final_problems(actual, reference, tolerance)
    return labelled(found, f"{label} (its step 0 is step {first_step} of training)" if first_step else label)


def restored_problems(saved: Snapshot, restored: Snapshot, expected_fused: dict[str, torch.Tensor], converted: set[str],
                      converted_bound: Bound, same_shards: bool) -> list[str]:
    """Point 2 of the module docstring; every problem names the state key (and rank) and element."""
    problems = []
    kinds = (("the model's state (tables gathered from the shards, dense parameters)", "state", saved.state, restored.state),
             ("the fused optimizer's state", "fused_state", expected_fused, restored.fused_state),
             ("the dense optimizer's state", "dense_state", saved.dense_state, restored.dense_state))
    for what, name, expected, actual in kinds:
        problems += _differences(what, name, actual, {k: v for k, v in expected.items() if k not in converted}, EXACT, set(expected))
        if converted & set(expected):
            problems += _differences(f"{what}, row-wise state converted to the new column blocks", name,
                                     actual, {k: expected[k] for k in converted}, converted_bound, set())
    if same_shards:
        for rank, (before, after) in enumerate(zip(saved.local_state, restored.local_state)):
            problems += _differences(f"rank {rank}'s dense-optimizer state of its dense-kernel shards", f"rank{rank}",
                                     after, before, EXACT, set(before))
    moved = {key: (rate, restored.learning_rates.get(key)) for key, rate in saved.learning_rates.items()
             if restored.learning_rates.get(key) != rate}
    if moved:
        shown = "; ".join(f"{key}: {after!r} after the reload, {before!r} at the save" for key, (before, after) in list(moved.items())[:4])
        problems.append(f"the learning rate of the next step differs for {len(moved)} parameter(s): {shown}")
    return problems


def _differences(what: str, name: str, actual: dict[str, Any], expected: dict[str, Any], bound: Bound, keys: set[str]) -> list[str]:
    """``actual`` vs ``expected`` on the keys of ``expected``; ``keys`` (when given) must be exactly the keys of ``actual``."""
    problems = []
    missing, extra = sorted(keys - set(actual)), sorted(set(actual) - keys)
    if keys and (missing or extra):
        problems.append(f"{what}: the reloaded model " + "; ".join(filter(None, [
            f"lacks {missing}" if missing else "", f"has entries the checkpoint does not, {extra}" if extra else ""])))
    common = [key for key in expected if key in actual]
    found = bound.differences({k: actual[k] for k in common}, {k: expected[k] for k in common}, name)
    if found:
        problems.append(format_differences(found[:5], exact=bound.exact, msg=f"{what} differs from the saved one ({bound.describe()})"))
    return problems


def raise_if(problems: list[str], header: str) -> None:
    if problems:
        raise ParityError(f"{header}\n" + "\n".join(problems))
