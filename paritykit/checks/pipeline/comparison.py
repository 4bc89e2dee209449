"""What a pipeline run is measured on: per-step and final max-abs differences, NE, SemiSync bounds.

Runs are the sharding engine's ``TrainingRecord``s; a pipeline's ``outputs[step][rank]`` is what
``progress()`` returned (the prediction), so the plain loop's are cut down to the same
(``predictions``). These numbers feed the report and the SemiSync bounds; the exact verdicts are in
verdicts.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Iterable

import torch

from paritykit.engine.pipeline_contract import prediction_of
from paritykit.engine.losses import floating_leaves
from paritykit.engine.training import TrainingRecord

REFERENCE = "plain"


@dataclass(frozen=True)
class SemiSyncBounds:
    """How far TrainPipelineSemiSync may drift from the plain loop once it runs semi-synchronously.

    From batch ``start_batch + 1`` on, semi-sync looks each batch up before the previous batch's
    backward has updated the tables, so its predictions lag by one embedding update. The bounds are
    for the built-in models (binary cross-entropy on one logit) at learning rates up to 0.1 over up
    to 16 steps; docs/pipeline.md gives the measured worst case they sit above. A user's model with
    another loss or scale states its own.
    """

    max_output_drift: float = 0.1
    max_ne_difference: float = 0.02


DEFAULT_SEMI_SYNC_BOUNDS = SemiSyncBounds()


@dataclass
class PairComparison:
    """A candidate run against a reference run: per-step and final max-abs differences."""

    reference: str
    candidate: str
    reference_steps: int
    candidate_steps: int
    output_diff: list[float]
    loss_diff: list[float]
    final_diff: dict[str, float]
    ne_reference: float = math.nan
    ne_candidate: float = math.nan

    @property
    def max_output_diff(self) -> float:
        return max(self.output_diff, default=0.0)

    @property
    def ne_difference(self) -> float:
        return abs(self.ne_candidate - self.ne_reference)

    def metrics(self) -> dict[str, Any]:
        return {
            "reference": self.reference,
            "steps": self.candidate_steps,
            "max_output_diff": self.max_output_diff,
            "max_loss_diff": max(self.loss_diff, default=0.0),
            **{f"final_{k}_diff": v for k, v in self.final_diff.items()},
            "ne_difference": self.ne_difference,
        }


@dataclass
class PipelineParityResult:
    """What ``assert_pipeline_parity`` ran and measured (the report is written from this)."""

    label: str
    runs: dict[str, TrainingRecord] = field(default_factory=dict)
    comparisons: list[PairComparison] = field(default_factory=list)
    anchor: dict[str, Any] = field(default_factory=dict)

    def metrics(self) -> dict[str, Any]:
        return {"anchor": self.anchor, **{c.candidate: c.metrics() for c in self.comparisons}}


def predictions(record: TrainingRecord) -> TrainingRecord:
    """``record`` with each output cut to what a pipeline's progress() returns for it."""
    return replace(record, outputs=[[prediction_of(output) for output in step] for step in record.outputs])


def max_abs_between(actual: Any, expected: Any) -> float:
    """Largest absolute difference over the floating leaves of two pytrees (inf if their shapes differ)."""
    a, e = dict(floating_leaves(actual)), dict(floating_leaves(expected))
    if a.keys() != e.keys() or any(a[k].shape != e[k].shape for k in e):
        return math.inf
    return max(((a[k].double() - e[k].double()).abs().max().item() for k in e if e[k].numel()), default=0.0)


def labels_of(batches: list[list[Any]]) -> list[torch.Tensor] | None:
    """labels[step] of shape (ranks, batch) when every batch carries a ``label`` tensor, else None."""
    try:
        return [torch.stack([batch.label.detach().to("cpu") for batch in step]) for step in batches]
    except (AttributeError, RuntimeError, TypeError):
        return None


def normalized_entropy(record: TrainingRecord, labels: list[torch.Tensor] | None) -> float:
    """Mean loss over steps and ranks divided by the entropy of the label rate (nan where undefined)."""
    if not record.losses or labels is None:
        return math.nan
    losses = torch.stack([torch.stack(step) for step in record.losses]).double()
    rate = torch.stack(labels[: len(record.losses)]).double().mean().item()
    if rate <= 0.0 or rate >= 1.0:
        return math.nan
    entropy = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
    return losses.mean().item() / entropy


def final_states(record: TrainingRecord) -> dict[str, dict[str, torch.Tensor]]:
    return {"state": record.state, "fused_state": record.fused_state, "dense_state": record.dense_state}


def compare_pair(
    reference: TrainingRecord, candidate: TrainingRecord, names: tuple[str, str], labels: list[torch.Tensor] | None = None
) -> PairComparison:
    """Per-step and final max-abs differences of ``candidate`` from ``reference`` (named by ``names``)."""
    steps = min(len(reference.outputs), len(candidate.outputs))
    final_diff = {}
    for category, expected in final_states(reference).items():
        actual = final_states(candidate)[category]
        shared = [k for k in expected if k in actual and actual[k].shape == expected[k].shape]
        final_diff[category] = max((max_abs_between(actual[k], expected[k]) for k in shared), default=0.0)
    return PairComparison(
        reference=names[0],
        candidate=names[1],
        reference_steps=len(reference.outputs),
        candidate_steps=len(candidate.outputs),
        output_diff=[max_abs_between(candidate.outputs[i], reference.outputs[i]) for i in range(steps)],
        loss_diff=[max_abs_between(candidate.losses[i], reference.losses[i]) for i in range(steps)],
        final_diff=final_diff,
        ne_reference=normalized_entropy(reference, labels),
        ne_candidate=normalized_entropy(candidate, labels),
    )


def fmt_list(values: Iterable[float]) -> str:
    return "[" + ", ".join(f"{v:.3g}" for v in values) + "]"
