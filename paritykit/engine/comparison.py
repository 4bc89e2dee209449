"""Comparing a sharded training run with the unsharded reference, under a stated tolerance.

Per step and rank, in this order: what each embedding module returned, by key (so a wrong lookup is
named at its module and feature, even where the dense layers after it would hide it); the model's
output; the loss (all steps and ranks as one tensor). Then, after the last step: the state (tables
gathered from the shards, dense parameters), the fused optimizer's state, and the dense optimizer's
state of replicated parameters. One ParityError names the step, rank, module or state key, and
element of every difference found (the first few shown).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from paritykit.engine.training import TrainingRecord, TrainingSetup
from paritykit.compare import find_differences, format_differences
from paritykit.engine.divergence import Placements, common_traits, element_of, step_detail
from paritykit.engine.losses import loss_terms_magnitude
from paritykit.errors import Divergence, ParityError


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


def losses_bound(bound: Bound, expected: TrainingRecord) -> Bound:
    """The losses' bound, its floor raised to the size of the terms a loss sums: the default loss adds
    weighted output elements that cancel, so its roundoff is relative to the terms, not to the loss
    (a loss of 0.04 from terms of size 10 moves by several of their units). A user's loss is held to
    the same floor, the outputs' size measured with the default loss's weights."""
    if bound.exact:
        return bound
    terms = max((loss_terms_magnitude(output) for step in expected.outputs for output in step), default=0.0)
    floor = (bound.max_relative or bound.rtol) * terms
    if floor <= bound.atol:
        return bound
    return replace(bound, atol=floor, why=f"{bound.why}; at least that of the loss's terms, {terms:.3g} in all")


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
        found = losses_bound(tolerance.losses, expected).differences(losses_a, losses_e, "losses[step, rank]")
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


def compare_records(actual: TrainingRecord, expected: TrainingRecord, tolerance: Tolerance, header: str,
                    where: "Where | Callable[[], Where] | None" = None) -> dict[str, Any]:
    """ParityError naming every differing (step, rank) and final state, carrying where the numbers
    first went apart (``where`` says what the runs were); else metrics of what was compared."""
    per_step, final = per_step_problems(actual, expected, tolerance), final_problems(actual, expected, tolerance)
    problems = per_step + final
    if problems:
        # The first steps that differ, then always the final state: it names the tables.
        hidden = max(0, len(per_step) - 3)
        shown = per_step[:3] + ([f"... and {hidden} more step(s)/rank(s) differ"] if hidden else []) + final
        divergence = first_divergence(actual, expected, tolerance, where)
        located = [f"first divergence: {divergence.location()}"] if divergence is not None else []
        raise ParityError(f"{header}: sharded training differs from the unsharded reference\n" + "\n".join(shown + located),
                          divergence=divergence)
    return {
        "steps": len(expected.outputs),
        "ranks": len(expected.outputs[0]) if expected.outputs else 0,
        "state_tensors": len(expected.state),
        "optimizer_state_tensors": len(expected.fused_state) + len(expected.dense_state),
    }


# ---------------------------------------------------------------- the first divergence, as data


# What differs when a table (or its optimizer state) first differs after a step.
TABLE_STEP = "table gradient or update"


@dataclass
class Where:
    """What a first divergence is located with: the comparison's name, the tables' placements (the
    model's, from ``Placements.of``), the state before the first step, and whether both optimizers
    are SGD (then a step's direction tells the gradient from the update)."""

    path: str = "sharded vs unsharded"
    placements: Placements | None = None
    initial_state: dict[str, torch.Tensor] | None = None
    sgd: bool = False


def where_for(setup: TrainingSetup, path: str = "sharded vs unsharded") -> Callable[[], Where]:
    """What locates a divergence of ``setup``'s runs, built only when something differs."""

    def build() -> Where:
        sgd = setup.embedding_optimizer.name == "sgd" and setup.dense_optimizer.name == "sgd"
        return Where(path, Placements.of(setup.model_fn(), setup.sharding_plan), dict(setup.full_state), sgd)

    return build


def first_divergence(actual: TrainingRecord, expected: TrainingRecord, tolerance: Tolerance,
                     where: "Where | Callable[[], Where] | None" = None) -> Divergence | None:
    """Where ``actual`` first went apart from ``expected``, in the order the numbers are made."""
    try:
        where = where() if callable(where) else where
        return _Walk(actual, expected, tolerance, where or Where()).first()
    except Exception:  # noqa: BLE001 - locating is a courtesy: never turn a parity failure into a harness error
        return None


class _Walk:
    def __init__(self, actual: TrainingRecord, expected: TrainingRecord, tolerance: Tolerance, where: Where) -> None:
        self.a, self.e, self.tolerance, self.where = actual, expected, tolerance, where
        self.places = where.placements or Placements()

    def first(self) -> Divergence | None:
        if len(self.a.outputs) != len(self.e.outputs):
            return Divergence("schedule", "step count", self.where.path,
                              detail=f"{len(self.a.outputs)} steps vs {len(self.e.outputs)} in the reference")
        states = len(self.a.step_states) == len(self.e.step_states) == len(self.e.outputs)
        for step in range(len(self.e.outputs)):
            found = self.embeddings(step) or self.outputs(step) or (self.state(step) if states else None)
            if found:
                return found
        return self.final(states)

    def _divergence(self, stage: str, what: str, step: int | None, rank: int | None, places: list, difference: Any,
                    **named: Any) -> Divergence:
        index = element_of(difference)
        place = places[0] if places else None
        if place is not None:
            named.setdefault("module", place.module)
            named.setdefault("table", place.table)
            named.setdefault("placement", place.placement())
        return Divergence(stage, what, self.where.path, step, rank, element="" if index is None else str(list(index)),
                          traits=common_traits(places), detail=named.pop("detail", str(difference)), **named)

    def embeddings(self, step: int) -> Divergence | None:
        bound = self.tolerance.first_step_embeddings if step == 0 else self.tolerance.embeddings
        found = []  # (rank, module, key, difference)
        for rank, recorded in enumerate(self.e.embeddings[step] if step < len(self.e.embeddings) else []):
            got = self.a.embeddings[step][rank]
            for fqn, rec in recorded.items():
                for key in rec["by_key"]:
                    actual = got.get(fqn, {}).get("by_key", {}).get(key)
                    differences = bound.differences(actual, rec["by_key"][key], f"{fqn}[{key!r}]")
                    found += [(rank, fqn, key, differences[0])] if differences else []
        if not found:
            return None
        rank, fqn, key, difference = found[0]
        places = [self.places.for_output(m, k) for _r, m, k, _d in found]
        module = places[0].module if places and places[0] is not None else fqn
        return self._divergence("forward", "embedding output", step, rank, places, difference, module=module, feature=key)

    def outputs(self, step: int) -> Divergence | None:
        for rank in range(len(self.e.outputs[step])):
            found = self.tolerance.outputs.differences(by_key(self.a.outputs[step][rank]), by_key(self.e.outputs[step][rank]), "output")
            if found:
                return self._divergence("forward", "model output", step, rank, [], found[0])
        losses = self.tolerance.losses.differences(torch.stack(self.a.losses[step]), torch.stack(self.e.losses[step]), "losses[rank]")
        return self._divergence("forward", "loss", step, None, [], losses[0]) if losses else None

    def _differing(self, actual: dict, expected: dict, bound: Bound) -> list[tuple[str, Any]]:
        # Tables first (they name placements), then everything else, each in key order.
        keys = sorted(expected, key=lambda k: (self.places.for_state(k) is None, k))
        return [(key, found[0]) for key in keys if (found := bound.differences(actual.get(key), expected[key], key))]

    def state(self, step: int) -> Divergence | None:
        differing = self._differing(self.a.step_states[step], self.e.step_states[step], self.tolerance.state)
        if not differing:
            return None
        key, difference = differing[0]
        places = [self.places.for_state(k) for k, _ in differing if self.places.for_state(k) is not None]
        before = self.e.step_states[step - 1] if step else self.where.initial_state
        stage, detail = "backward or update", str(difference)
        accumulators = [k for k, _ in differing if "/" in k]
        if accumulators:
            # An optimizer's running sum of squared gradients differs: the gradient itself does.
            key, difference = next((k, d) for k, d in differing if k == accumulators[0])
            stage, detail = "backward", f"the optimizer's running sum of squared gradients differs, so the gradient does; {difference}"
        elif before is not None and key in before:
            stage, moved = step_detail(before[key].double(), self.a.step_states[step][key].double(),
                                       self.e.step_states[step][key].double(), self.where.sgd)
            detail = f"{moved}; {difference}"
        what = TABLE_STEP if places else "dense parameter"
        divergence = self._divergence(stage, what, step, None, places, difference, detail=detail)
        return divergence if accumulators else self._with_shard(divergence, places)

    def _with_shard(self, divergence: Divergence, places: list) -> Divergence:
        if not places or not divergence.element:
            return divergence
        index = tuple(int(i) for i in divergence.element.strip("[]").split(",") if i.strip())
        return replace(divergence, shard=places[0].shard_at(index))

    def final(self, steps_recorded: bool) -> Divergence | None:
        last = len(self.e.outputs) - 1
        checks = [(TABLE_STEP, self.a.fused_state, self.e.fused_state), ("dense optimizer state", self.a.dense_state, self.e.dense_state)]
        if not steps_recorded:
            checks.insert(0, ("state", self.a.state, self.e.state))
        for what, actual, expected in checks:
            bound = self.tolerance.state if what == "state" else self.tolerance.optimizer_state
            differing = self._differing(actual, expected, bound)
            if differing:
                places = [self.places.for_state(k) for k, _ in differing if self.places.for_state(k) is not None]
                what = TABLE_STEP if places else ("dense parameter" if what == "state" else what)
                return self._with_shard(self._divergence("final state", what, last, None, places, differing[0][1]), places)
        return None
