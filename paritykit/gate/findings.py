"""Findings: the failing cases of a run grouped by root cause, across checks.

Two failures are one finding when their first divergences (``paritykit.errors.Divergence``) agree on
what a case-independent description can say: the phase (forward, a training step, a crash, ...),
what differs (an embedding output, a table's gradient or update, an exception type), the comparison
("sharded vs unsharded", "TensorDict vs KJT", "pipeline vs plain loop") and, for a crash, the
torchrec function that raised. Table and feature names are each case's own (``t0`` of one case is not
``t0`` of another), so within such a group the cases are split by the placement traits their
differing tables share (``sharding=row_wise``, ``pooling=MEAN``, ...): greedily, the trait the most
cases share first, until every group has traits in common (or nothing is left to split on).

Each finding names its smallest case (by its configuration: ranks, steps, tables, ids), that case's
first divergence and replay, and the standalone script written from its configuration.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from paritykit.checks.results import CaseResult
from paritykit.errors import Divergence
from paritykit.harness.configuration import ShardedConfiguration


@dataclass
class Finding:
    id: str
    divergence: Divergence  # the smallest case's
    traits: tuple[str, ...]  # what every case's differing tables share
    cases: list[CaseResult]
    smallest: CaseResult
    known_issues: list[str] = field(default_factory=list)  # entries the smallest configuration matches
    script: str = ""  # the standalone script, relative to the report directory

    def checks(self) -> dict[str, int]:
        return dict(Counter(case.check for case in self.cases))

    def what_differs(self) -> str:
        """What torchrec computes differently, in one phrase."""
        d = self.divergence
        if d.stage == "crash":
            return f"torchrec raises {d.what}" + (f" in {d.module}" if d.module else "")
        if d.stage == "unlocated":
            return f"a difference its comparison did not locate: {d.detail[:120]}"
        tables = f" of tables with {', '.join(self.traits)}" if self.traits else ""
        return f"{d.phase}: {d.what}{tables} differs ({d.path})"

    def headline(self) -> str:
        spread = ", ".join(f"{check} {count}" for check, count in self.checks().items())
        return (f"{self.id}: {self.what_differs()}: {len(self.cases)} case(s) ({spread}); smallest "
                f"{self.smallest.check} {self.smallest.short_id} ({describe_size(self.smallest)})")

    def to_json(self) -> dict:
        return {"id": self.id, "what_differs": self.what_differs(), "cause": list(self.divergence.cause()),
                "traits": list(self.traits), "cases": [case.short_id for case in self.cases],
                "checks": self.checks(), "smallest": self.smallest.short_id, "replay": self.smallest.replay,
                "first_divergence": self.divergence.to_dict(), "location": self.divergence.location(),
                "script": self.script or None, "known_issues": self.known_issues}


def divergence_of(case: CaseResult) -> Divergence:
    """The case's first divergence, or one made from its message when its check did not locate it."""
    if case.divergence:
        return Divergence.from_dict(case.divergence)
    headline = next((line.strip() for line in case.message.splitlines() if line.strip()), case.case_id)
    return Divergence("unlocated", "difference", case.check, detail=re.sub(r"\d+", "N", headline)[:200])


def size_of(case: CaseResult) -> tuple:
    """Cases with a configuration first, smallest first; then the others by how much their id says."""
    if case.configuration:
        return (0, *ShardedConfiguration.from_json(case.configuration).size())
    return (1, len(case.case_id))


def describe_size(case: CaseResult) -> str:
    if not case.configuration:
        return "no configuration recorded"
    config = ShardedConfiguration.from_json(case.configuration)
    return (f"{config.module}, {config.world_size} rank(s), {len(config.steps)} step(s), {len(config.tables)} table(s), "
            f"{config.id_count()} ids")


def group(failures: list[CaseResult]) -> list[Finding]:
    """One finding per root cause, the most widespread first."""
    by_cause: dict[tuple, list[tuple[CaseResult, Divergence]]] = {}
    for case in failures:
        divergence = divergence_of(case)
        key = divergence.cause() if divergence.stage != "unlocated" else ("unlocated", case.check, divergence.detail, "")
        by_cause.setdefault(key, []).append((case, divergence))
    groups = [split for members in by_cause.values() for split in _split_by_traits(members)]
    groups.sort(key=lambda g: (-len(g[0]), min(size_of(c) for c, _ in g[0])))
    findings = []
    for index, (members, traits) in enumerate(groups, 1):
        smallest, divergence = min(members, key=lambda m: size_of(m[0]))
        findings.append(Finding(f"F{index}", divergence, traits, [case for case, _ in members], smallest))
    return findings


def _split_by_traits(members: list) -> list[tuple[list, tuple[str, ...]]]:
    out, remaining = [], list(members)
    while remaining:
        shared = frozenset.intersection(*(frozenset(d.traits) for _, d in remaining))
        counts = Counter(trait for _, d in remaining for trait in d.traits)
        if shared or not counts or len(remaining) == 1:
            out.append((remaining, tuple(sorted(shared))))
            break
        best = min(counts, key=lambda trait: (-counts[trait], trait))
        chosen = [m for m in remaining if best in m[1].traits]
        out.append((chosen, tuple(sorted(frozenset.intersection(*(frozenset(d.traits) for _, d in chosen))))))
        remaining = [m for m in remaining if best not in m[1].traits]
    return out
