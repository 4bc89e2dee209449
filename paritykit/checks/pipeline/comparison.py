"""What a pipeline run is compared on: per-step and final max-abs differences, NE, SemiSync bounds."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from paritykit.checks.pipeline.runs import PipelineRun, RunSpec

REFERENCE = "plain"


@dataclass(frozen=True)
class SemiSyncBounds:
    """How far TrainPipelineSemiSync may drift from the plain loop.

    Semi-sync computes batch i's embeddings before batch i-1's backward has updated the tables, so
    its predictions lag by one embedding update. The bounds are for the models of
    models.py at learning rates up to 0.1 over up to 16 steps; measured drift
    there stayed below 0.045 (drift) and 0.004 (NE difference) over both models, every fused and
    dense optimizer and world sizes 1 and 2 (16 steps of 4 examples).
    """

    max_output_drift: float = 0.1
    max_ne_difference: float = 0.02


DEFAULT_SEMI_SYNC_BOUNDS = SemiSyncBounds()


@dataclass
class PairComparison:
    """A candidate pipeline against the reference: per-step and final max-abs differences."""

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
            "steps": self.candidate_steps,
            "max_output_diff": self.max_output_diff,
            "max_loss_diff": max(self.loss_diff, default=0.0),
            **{f"final_{k}_diff": v for k, v in self.final_diff.items()},
            "ne_difference": self.ne_difference,
        }


@dataclass
class PipelineParityResult:
    """What ``assert_pipeline_parity`` ran and measured (the report is written from this)."""

    spec: RunSpec
    runs: dict[str, PipelineRun]
    comparisons: list[PairComparison] = field(default_factory=list)

    def metrics(self) -> dict[str, Any]:
        return {c.candidate: c.metrics() for c in self.comparisons}


# ---------------------------------------------------------------------------------------------
# Measuring


def normalized_entropy(run: PipelineRun) -> float:
    """Mean log loss over all steps and ranks divided by the entropy of the label rate (nan if undefined)."""
    if not run.losses:
        return math.nan
    losses = torch.stack(run.losses).double()
    labels = torch.stack(run.labels).double()
    rate = labels.mean().item()
    if rate <= 0.0 or rate >= 1.0:
        return math.nan
    entropy = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
    return losses.mean().item() / entropy


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item()


def final_state(run: PipelineRun) -> dict[str, dict[str, torch.Tensor]]:
    return {"tables": run.tables, "dense": run.dense, "fused_state": run.fused_state, "dense_state": run.dense_state}


def compare_pair(reference: PipelineRun, candidate: PipelineRun) -> PairComparison:
    steps = min(reference.steps, candidate.steps)
    final_diff = {}
    for category, expected in final_state(reference).items():
        actual = final_state(candidate)[category]
        shared = [k for k in expected if k in actual and actual[k].shape == expected[k].shape]
        final_diff[category] = max((_max_abs(actual[k], expected[k]) for k in shared), default=0.0)
    return PairComparison(
        reference=reference.spec.pipeline,
        candidate=candidate.spec.pipeline,
        reference_steps=reference.steps,
        candidate_steps=candidate.steps,
        output_diff=[_max_abs(candidate.outputs[i], reference.outputs[i]) for i in range(steps)],
        loss_diff=[_max_abs(candidate.losses[i], reference.losses[i]) for i in range(steps)],
        final_diff=final_diff,
        ne_reference=normalized_entropy(reference),
        ne_candidate=normalized_entropy(candidate),
    )


def fmt_list(values: Iterable[float]) -> str:
    return "[" + ", ".join(f"{v:.3g}" for v in values) + "]"
