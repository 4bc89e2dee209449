"""Comparing a sharded training run with the unsharded reference, under a stated tolerance.

Per step and rank, in this order: what each embedding module returned, by key (so a wrong lookup is
named at its module and feature, even where the dense layers after it would hide it); the model's
output; the loss (all steps and ranks as one tensor). Then, after the last step: the state (tables
gathered from the shards, dense parameters), the fused optimizer's state, and the dense optimizer's
state of replicated parameters. One ParityError names the step, rank, module or state key, and
element of every difference found (the first few shown).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from paritykit.engine.training import TrainingRecord
from paritykit.compare import find_differences, format_differences
from paritykit.errors import ParityError


@dataclass(frozen=True)
class Bound:
    """|actual - expected| <= atol + max_relative * max|expected| + rtol * |expected| per tensor;
    ``exact`` means bit-identical."""

    rtol: float = 0.0
    atol: float = 0.0
    max_relative: float = 0.0
    exact: bool = False
    why: str = ""

    def describe(self) -> str:
        if self.exact:
            return "bit-exact"
        parts = [f"rtol {self.rtol:.3g}"] + ([f"atol {self.atol:.3g}"] if self.atol else [])
        parts += [f"+ {self.max_relative:.3g} x max|expected|"] if self.max_relative else []
        return ", ".join(parts) + (f" ({self.why})" if self.why else "")

    def differences(self, actual: Any, expected: Any, name: str) -> list:
        if self.exact:
            return find_differences(actual, expected, exact=True, name=name)
        return find_differences(actual, expected, rtol=self.rtol, atol=self.atol, name=name, max_relative=self.max_relative)


EXACT = Bound(exact=True, why="torchrec promises these bit for bit")


@dataclass(frozen=True)
class Tolerance:
    """The bound for each kind of compared number."""

    embeddings: Bound = EXACT
    # Before any update the embeddings come from the same initial weights: a gather is exact then.
    first_step_embeddings: Bound = EXACT
    outputs: Bound = EXACT
    losses: Bound = EXACT
    state: Bound = EXACT
    optimizer_state: Bound = EXACT


def _shown(found: list, bound: Bound, msg: str) -> str:
    return format_differences(found[:3], exact=bound.exact, msg=f"{msg} ({bound.describe()})")


def embedding_problem(actual: dict[str, Any], expected: dict[str, Any], bound: Bound, where: str) -> str | None:
    for fqn, recorded in expected.items():
        got = actual.get(fqn)
        if got is None:
            return f"{where}: the sharded model's module {fqn!r} did not run"
        found = bound.differences(got["by_key"], recorded["by_key"], name=fqn or "model")
        if found:
            return _shown(found, bound, f"{where}: embedding module {fqn or '(the model itself)'!r} returned other values (by key)")
    return None


def key_order_hint(actual: dict[str, Any], expected: dict[str, Any]) -> str:
    moved = [f"{fqn!r}: {actual[fqn]['key_order']} vs unsharded {rec['key_order']}"
             for fqn, rec in expected.items() if fqn in actual and actual[fqn]["key_order"] != rec["key_order"]]
    if not moved:
        return "  the embedding modules returned the same values in the same key order: the difference arises after them"
    return ("  the embedding modules returned the same values by key, in another key order ("
            + "; ".join(moved) + "): a model that reads KeyedTensor.values() by position sees its features "
            "permuted once sharded; index by key (to_dict(), KeyedTensor.regroup)")


def by_key(output: Any) -> Any:
    """The output with every KeyedTensor as {key: tensor}: its key order follows the placement once
    sharded, which says nothing about its numbers (key_order_hint reports it where it matters)."""
    if type(output).__name__ == "KeyedTensor":
        return dict(output.to_dict())
    if isinstance(output, dict):
        return {key: by_key(value) for key, value in output.items()}
    if isinstance(output, (list, tuple)):
        return type(output)(by_key(value) for value in output)
    return output


def per_step_problems(actual: TrainingRecord, expected: TrainingRecord, tolerance: Tolerance) -> list[str]:
    if len(actual.outputs) != len(expected.outputs):
        return [f"the sharded run recorded {len(actual.outputs)} steps, the reference {len(expected.outputs)}"]
    problems = []
    for step in range(len(expected.outputs)):
        for rank in range(len(expected.outputs[step])):
            where = f"step {step}, rank {rank}"
            emb_a, emb_e = actual.embeddings[step][rank], expected.embeddings[step][rank]
            bound = tolerance.first_step_embeddings if step == 0 else tolerance.embeddings
            problem = embedding_problem(emb_a, emb_e, bound, where)
            if problem is None:
                found = tolerance.outputs.differences(by_key(actual.outputs[step][rank]), by_key(expected.outputs[step][rank]), "output")
                if found:
                    problem = _shown(found, tolerance.outputs, f"{where}: the model's output differs") + "\n" + key_order_hint(emb_a, emb_e)
            if problem:
                problems.append(problem)
    if not problems:
        losses_a, losses_e = torch.stack([torch.stack(s) for s in actual.losses]), torch.stack([torch.stack(s) for s in expected.losses])
        found = tolerance.losses.differences(losses_a, losses_e, "losses[step, rank]")
        if found:
            problems.append(_shown(found, tolerance.losses, "the losses differ while every output agrees (the loss function is not deterministic?)"))
    return problems


def final_problems(actual: TrainingRecord, expected: TrainingRecord, tolerance: Tolerance) -> list[str]:
    last = len(expected.outputs) - 1
    problems = []
    for what, a, e, bound in (
        ("state (tables gathered from the shards, dense parameters)", actual.state, expected.state, tolerance.state),
        ("fused optimizer state", actual.fused_state, expected.fused_state, tolerance.optimizer_state),
        ("dense optimizer state", actual.dense_state, expected.dense_state, tolerance.optimizer_state),
    ):
        found = bound.differences(a, e, what.split(" ")[0])
        if found:
            problems.append(format_differences(found[:5], exact=bound.exact, msg=f"after step {last}: {what} differs ({bound.describe()})"))
    return problems


def compare_records(actual: TrainingRecord, expected: TrainingRecord, tolerance: Tolerance, header: str) -> dict[str, Any]:
    """ParityError naming every differing (step, rank) and final state; else metrics of what was compared."""
    per_step, final = per_step_problems(actual, expected, tolerance), final_problems(actual, expected, tolerance)
    problems = per_step + final
    if problems:
        # The first steps that differ, then always the final state: it names the tables.
        hidden = max(0, len(per_step) - 3)
        shown = per_step[:3] + ([f"... and {hidden} more step(s)/rank(s) differ"] if hidden else []) + final
        raise ParityError(f"{header}: sharded training differs from the unsharded reference\n" + "\n".join(shown))
    return {
        "steps": len(expected.outputs),
        "ranks": len(expected.outputs[0]) if expected.outputs else 0,
        "state_tensors": len(expected.state),
        "optimizer_state_tensors": len(expected.fused_state) + len(expected.dense_state),
    }
