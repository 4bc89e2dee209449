"""Shrinking a user's failing model configuration to the smallest one that still fails the same way.

When ``assert_sharded_matches_unsharded`` fails, the configuration is made smaller one change at a
time, each change kept only if the run still fails with the same first divergence (its phase, what
differs and the comparison: ``Divergence.cause``):
1. fewer steps: up to the step where the numbers first went apart;
2. each table moved, one at a time, to a plain placement (table-wise on rank 0, torchrec's kernel);
3. each table's ids dropped, one at a time (its features get empty rows; KJT batches only);
4. fewer samples per batch, halved while it fails (KJT batches only);
5. one rank (rank 0's batches, the plan's ranks folded onto rank 0), when the model ran on more.
Each try is a whole sharded and unsharded run, so the search stops after ``MAX_RUNS`` tries or
``BUDGET_S`` seconds and reports what it reached.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from paritykit.engine.configuration import short_placement
from paritykit.engine.training import TrainingSetup
from paritykit.errors import Divergence, HarnessError, ParityError, RankFailure, UnsupportedByTorchrec
from paritykit.harness.inputs import table_configs
from paritykit.harness.plans import describe_plan, parameter_sharding_generator

MAX_RUNS = 16
BUDGET_S = 180.0
PLAIN = ("table_wise", 0)


@dataclass(frozen=True)
class Candidate:
    """A configuration to try: placements per module, steps, samples per batch, tables without ids, ranks."""

    placements: dict[str, dict[str, tuple]]
    steps: int
    world_size: int
    samples: int | None = None
    dropped: frozenset[tuple[str, str]] = frozenset()

    def describe(self, original: TrainingSetup) -> str:
        plan = "; ".join(f"{fqn or '(model)'}: {describe_plan(tables)}" for fqn, tables in self.placements.items())
        parts = [f"{self.world_size} rank(s)", f"{self.steps} of {len(original.batches)} step(s)", f"plan {plan}"]
        parts += [f"batches cut to {self.samples} sample(s)"] if self.samples is not None else []
        parts += [f"no ids for table(s) {sorted(t for _, t in self.dropped)}"] if self.dropped else []
        return ", ".join(parts)


@dataclass
class Shrunk:
    candidate: Candidate
    runs: int
    seconds: float
    kept: list[str] = field(default_factory=list)

    def describe(self, original: TrainingSetup) -> str:
        steps = "; ".join(self.kept) or "nothing could be removed"
        return (f"smallest failing configuration found by shrinking ({self.runs} runs, {self.seconds:.0f} s): "
                f"{self.candidate.describe(original)}\n  (kept changes: {steps})")


def shrink(setup: TrainingSetup, divergence: Divergence, still_fails: Callable[[TrainingSetup], Any]) -> Shrunk:
    """The smallest candidate reached; ``still_fails(setup)`` runs one try and returns its divergence cause
    (None when it passes or fails otherwise)."""
    started, runs, cause = time.perf_counter(), 0, divergence.cause()
    current = Candidate({fqn: {t: short_placement(s, setup.world_size) for t, s in tables.items()}
                         for fqn, tables in setup.sharding_plan.plan.items()}, len(setup.batches), setup.world_size)
    kept: list[str] = []
    for change, candidate in _changes(setup, current, divergence.step):
        if runs >= MAX_RUNS or time.perf_counter() - started > BUDGET_S:
            break
        candidate = candidate(current) if callable(candidate) else candidate
        if candidate is None or candidate == current:
            continue
        runs += 1
        try:
            fails = still_fails(_setup_of(setup, candidate)) == cause
        except (HarnessError, UnsupportedByTorchrec):
            fails = False
        if fails:
            current = candidate
            kept.append(change)
    return Shrunk(current, runs, time.perf_counter() - started, kept)


def _changes(setup: TrainingSetup, start: Candidate, step: int | None):
    if step is not None and step + 1 < start.steps:
        yield f"{step + 1} step(s)", dataclasses.replace(start, steps=step + 1)
    for fqn, tables in start.placements.items():
        for table, entry in tables.items():
            if entry != PLAIN:
                yield (f"table {table!r} table-wise on rank 0",
                       lambda c, fqn=fqn, table=table: _placed(c, fqn, table, PLAIN))
    if _kjt_batches(setup):
        for fqn, tables in start.placements.items():
            for table in tables:
                yield f"no ids for table {table!r}", lambda c, key=(fqn, table): dataclasses.replace(c, dropped=c.dropped | {key})
        size = _samples(setup)
        while size > 1:
            size //= 2
            yield f"{size} sample(s) per batch", lambda c, size=size: dataclasses.replace(c, samples=size)
    if start.world_size > 1:
        yield "one rank", lambda c: dataclasses.replace(c, world_size=1, placements=_folded(c.placements))


def _placed(candidate: Candidate, fqn: str, table: str, entry: tuple) -> Candidate:
    placements = {m: dict(tables) for m, tables in candidate.placements.items()}
    placements[fqn][table] = entry
    return dataclasses.replace(candidate, placements=placements)


def _folded(placements: dict[str, dict[str, tuple]]) -> dict[str, dict[str, tuple]]:
    """Every rank a plan names moved onto rank 0 (host indexes onto host 0)."""
    def fold(entry: tuple) -> tuple:
        kind, *args = entry
        if not args:
            return entry
        return (kind, tuple(0 for _ in args[0])) if isinstance(args[0], tuple) else (kind, 0)

    return {fqn: {table: fold(entry) for table, entry in tables.items()} for fqn, tables in placements.items()}


def _kjt_batches(setup: TrainingSetup) -> bool:
    return all(type(b).__name__ == "KeyedJaggedTensor" and not b.variable_stride_per_key() for step in setup.batches for b in step)


def _samples(setup: TrainingSetup) -> int:
    return min(b.stride() for step in setup.batches for b in step)


def _setup_of(setup: TrainingSetup, candidate: Candidate) -> TrainingSetup:
    """``setup`` changed as ``candidate`` says (its plan re-resolved by torchrec for its world size)."""
    import torch

    from paritykit.harness.plan_resolution import resolve_plan

    batches = [[_cut(batch, candidate, setup) for batch in step[: candidate.world_size]] for step in setup.batches[: candidate.steps]]
    kernels = {fqn: {t: s.compute_kernel for t, s in tables.items()} for fqn, tables in setup.sharding_plan.plan.items()}
    generators = {fqn: {t: parameter_sharding_generator(entry, None if entry[0] in ("data_parallel", "table_row_wise", "grid_shard")
                                                          else kernels[fqn][t])
                        for t, entry in tables.items()} for fqn, tables in candidate.placements.items()}
    plan = resolve_plan(setup.model_fn(), generators, world_size=candidate.world_size, device_type=torch.device(setup.device).type)
    return dataclasses.replace(setup, sharding_plan=plan, batches=batches)


def _cut(batch: Any, candidate: Candidate, setup: TrainingSetup) -> Any:
    if candidate.samples is None and not candidate.dropped:
        return batch
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    dropped = _dropped_features(setup, candidate.dropped)
    samples = candidate.samples or batch.stride()
    by_key = batch.to_dict()
    lengths, values, weights = [], [], []
    for key in batch.keys():
        jt = by_key[key]
        kept = jt.lengths()[:samples] * (0 if key in dropped else 1)
        count = int(kept.sum())
        lengths.append(kept)
        values.append(jt.values()[:count])
        weights.append(jt.weights()[:count] if jt.weights_or_none() is not None else None)
    return KeyedJaggedTensor(keys=batch.keys(), values=torch.cat(values), lengths=torch.cat(lengths),
                             weights=torch.cat(weights) if weights and weights[0] is not None else None)


def _dropped_features(setup: TrainingSetup, dropped: frozenset[tuple[str, str]]) -> set[str]:
    from paritykit.harness.plan_resolution import embedding_modules

    if not dropped:
        return set()
    modules = embedding_modules(setup.model_fn())
    features = set()
    for fqn, table in dropped:
        module = modules[fqn]
        configs = table_configs(module)
        features |= {f for c in configs if c.name == table for f in c.feature_names}
    return features


def failure_cause(run: Callable[[], Any]) -> tuple | None:
    """Run one try: its divergence's cause when it fails with a located ParityError, else None."""
    try:
        run()
    except ParityError as exc:
        divergence = getattr(exc, "divergence", None)
        return divergence.cause() if divergence is not None else None
    except RankFailure:
        return None
    return None
