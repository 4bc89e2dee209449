"""One mutant against the gate: a throwaway copy of the installed torchrec with one line changed, put
first on the path of a `paritykit gate` process that replays only the cases covering that line.

The user's installed torchrec is never written: the copy lives in a temporary directory, found
first through PYTHONPATH (the ranks inherit it). Outcomes:
  incompetent      the mutated module does not import (not counted in the score)
  killed           the gate failed a case (exit 1): a parity failure or a crash inside torchrec
  killed (error)   the gate exited 2: paritykit's own code could not digest what torchrec returned
  killed (timeout) the gate did not finish in time; its process group is killed
  survived         every replayed case passed (exit 0)
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from paritykit.errors import HarnessError
from paritykit.gate.coverage_run import CoveredCase
from paritykit.gate.mutants import Mutant, MutantChange
from paritykit.harness.line_coverage import RANK_CONFIG_ENV

KILLED, KILLED_BY_ERROR, TIMEOUT, SURVIVED, INCOMPETENT, EQUIVALENT = (
    "killed", "killed (error)", "killed (timeout)", "survived", "incompetent", "equivalent")
KILLED_OUTCOMES = (KILLED, KILLED_BY_ERROR, TIMEOUT)
IMPORT_TIMEOUT_S = 180.0
WORLD_SIZE = re.compile(r"world_size=\d+")
# A case that checkpoints and resumes runs the state-dict paths (a state's persistence) the others skip.
RESUMED = re.compile(r"\bresumed?\b")
DETAIL_LINES = 6
# The most recorded case time (seconds, as the coverage run timed the cases) a mutant's last round replays.
LAST_ROUND_BUDGET_S = 60.0


@dataclass
class MutantOutcome:
    mutant: Mutant
    before: str
    after: str
    status: str
    cases: list[str] = field(default_factory=list)  # context labels "<check>|<short id>"
    duration_s: float = 0.0
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"file": self.mutant.file, "line": self.mutant.line, "operator": self.mutant.operator,
                "occurrence": self.mutant.occurrence, "before": self.before, "after": self.after,
                "status": self.status, "cases": self.cases, "duration_s": round(self.duration_s, 1), "detail": self.detail}


def choose_cases(candidates: list[CoveredCase], limit: int, breadth: dict[str, int] | None = None,
                 paths: dict[str, frozenset[int]] | None = None,
                 readers: dict[str, frozenset[int]] | None = None) -> list[CoveredCase]:
    """Up to ``limit`` of the cases covering a line.

    With ``paths`` (each case's lines of the function holding the mutated line, ``function_paths``):
    first, for up to half the limit, the cases that take the most different paths through that
    function (greedy: each adds the most lines of it no case chosen so far ran; the fastest on a tie),
    since a mutant shows on the path that reaches what it changed; ahead of them, with ``readers``
    (each case's lines among those that read what the mutated line stores, ``line_paths``), the
    fewest cases that run every one of those lines, since a store shows where it is read; then the
    broadest case of each check (the one running the most torchrec lines: the fastest cases are the
    smallest, which run the line in its plainest form); then the other different paths; then the
    fastest of each check, then the fastest. Without ``breadth``, no broadest; without ``paths``, no different paths.

    Every check covering the line keeps one case even beyond ``limit`` (its broadest, else its
    fastest): the checks compare different things, so a mutant one check misses another may see."""
    by_speed = sorted(candidates, key=lambda case: (case.duration_s, case.label))
    reading = _different_paths(by_speed, readers) if readers else []
    different = _different_paths(by_speed, paths) if paths else []
    chosen: list[CoveredCase] = (reading + [case for case in different if case not in reading])[: max(1, limit // 2)]

    def add(cases: list[CoveredCase]) -> None:
        chosen.extend(case for case in cases if case not in chosen)

    if breadth:
        broadest: dict[str, CoveredCase] = {}
        for case in sorted(candidates, key=lambda case: (-breadth.get(case.label, 0), case.duration_s, case.label)):
            broadest.setdefault(case.check, case)
        add(list(broadest.values()))
    add(different)
    fastest: dict[str, CoveredCase] = {}
    for case in by_speed:
        fastest.setdefault(case.check, case)
    add(list(fastest.values()))
    add(by_speed)
    kept = chosen[:limit]
    represented = {case.check for case in kept}
    for case in chosen[limit:]:
        if case.check not in represented:
            kept.append(case)
            represented.add(case.check)
    return kept


def case_family(case: CoveredCase) -> str:
    """What a case exercises, without its drawn inputs: the op or kind a case id names before its
    arguments (``jt.accessors`` of ``jt.accessors: JTSpec(...)``, ``dmp reshard-split`` of
    ``dmp reshard-split [...] ...``), and the world size it names: the same op on several ranks runs the
    reductions and collectives a single rank skips (a metric state's ``dist_reduce_fx``); and whether it
    resumes from a checkpoint (a state left out of ``state_dict`` shows only there)."""
    head = case.case_id.split(":", 1)[0] if ":" in case.case_id[:60] else " ".join(case.case_id.split()[:2])
    ranks = WORLD_SIZE.search(case.case_id)
    return (f"{case.check}|{head}" + (f"|{ranks.group(0)}" if ranks else "")
            + ("|resumed" if RESUMED.search(case.case_id) else ""))


def second_round(candidates: list[CoveredCase], ran: list[CoveredCase], limit: int) -> list[CoveredCase]:
    """For a mutant the first cases let through: up to ``limit`` more of the cases covering its line, the
    fastest of each family of cases none of those ran (a line every case runs alike, such as a
    constructor's check, shows only on the inputs some family draws), fastest families first."""
    seen = {case_family(case) for case in ran}
    fresh: dict[str, CoveredCase] = {}
    for case in sorted(candidates, key=lambda case: (case.duration_s, case.label)):
        if case not in ran and case_family(case) not in seen:
            fresh.setdefault(case_family(case), case)
    return list(fresh.values())[:limit]


def last_round(candidates: list[CoveredCase], ran: list[CoveredCase], budget_s: float) -> list[CoveredCase]:
    """For a mutant both earlier rounds let through: the rest of the cases covering its line, fastest first,
    while their recorded times sum to at most ``budget_s``. A line every case of a check runs alike (a
    window's bookkeeping, a default argument) shows only on the inputs a few of its cases draw, whose family
    the earlier rounds need not have picked; a cheap check's cases all fit the budget."""
    picked: list[CoveredCase] = []
    total = 0.0
    for case in sorted(candidates, key=lambda case: (case.duration_s, case.label)):
        if case in ran:
            continue
        if total + case.duration_s > budget_s:
            break
        picked.append(case)
        total += case.duration_s
    return picked


def _different_paths(by_speed: list[CoveredCase], paths: dict[str, frozenset[int]]) -> list[CoveredCase]:
    """Greedy cover of the function's lines by the cases' paths through it, while a case adds one."""
    seen: set[int] = set()
    picked: list[CoveredCase] = []
    left = [case for case in by_speed if paths.get(case.label)]
    while left:
        best = max(left, key=lambda case: len(paths[case.label] - seen))  # max keeps the first (fastest) on a tie
        if not paths[best.label] - seen:
            break
        picked.append(best)
        seen |= paths[best.label]
        left.remove(best)
    return picked


def function_paths(lines: dict[int, list[CoveredCase]], span: tuple[int, int] | None) -> dict[str, frozenset[int]]:
    """{case label: the lines of ``span`` (a function's first and last line) that the case ran}."""
    return line_paths(lines, range(span[0], span[1] + 1)) if span is not None else {}


def line_paths(lines: dict[int, list[CoveredCase]], among: Iterable[int]) -> dict[str, frozenset[int]]:
    """{case label: the lines of ``among`` that the case ran}."""
    paths: dict[str, set[int]] = {}
    for line in among:
        for case in lines.get(line, ()):
            paths.setdefault(case.label, set()).add(line)
    return {label: frozenset(ran) for label, ran in paths.items()}


def innermost_function(spans: list[tuple[int, int]], line: int) -> tuple[int, int] | None:
    """The narrowest of the functions' (first, last) line spans holding ``line``, if any."""
    holding = [span for span in spans if span[0] <= line <= span[1]]
    return min(holding, key=lambda span: span[1] - span[0]) if holding else None


def case_breadth(covered: dict[str, dict[int, list[CoveredCase]]]) -> dict[str, int]:
    """How many covered torchrec lines each case ran (by label)."""
    counts: dict[str, int] = {}
    for lines in covered.values():
        for running in lines.values():
            for case in running:
                counts[case.label] = counts.get(case.label, 0) + 1
    return counts


def module_name(relative: str) -> str:
    parts = relative[: -len(".py")].split("/")
    return ".".join(["torchrec"] + (parts[:-1] if parts[-1] == "__init__" else parts))


def gate_command(gate: dict[str, Any], cases: list[CoveredCase]) -> list[str]:
    command = [sys.executable, "-m", "paritykit", "gate", "--no-shrink", "--device", gate["device"],
               "--world-size", ",".join(str(w) for w in gate["world_sizes"]), "--examples", str(gate["examples"]),
               "--seed", str(gate["seed"]), "--hosts", ",".join(gate.get("hosts") or ["none"])]
    for check in sorted({case.check for case in cases}):
        command += ["--check", check]
    for case in cases:
        command += ["--case", case.short_id]
    return command


STALE_CASES = "paritykit: error: no case of"  # gating's refusal of a --case id it does not draw


def run_mutant(mutant: Mutant, change: MutantChange, root: Path, cases: list[CoveredCase], gate: dict[str, Any],
               timeout_s: float) -> MutantOutcome:
    outcome = MutantOutcome(mutant, change.before, change.after, SURVIVED, [case.label for case in cases])
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="paritykit-mutant-") as scratch:
        env = _throwaway_torchrec(root, Path(scratch), mutant, change)
        problem = _import_problem(mutant, scratch, env)
        if problem is not None:
            outcome.status, outcome.detail = INCOMPETENT, problem
        else:
            outcome.status, outcome.detail = _replay(gate_command(gate, cases), env, timeout_s)
            if outcome.status == KILLED_BY_ERROR and STALE_CASES in outcome.detail:
                # Not the mutant's doing: the gate no longer has the cases the coverage run recorded.
                raise HarnessError(f"replaying {mutant.key}: {outcome.detail.splitlines()[0]}; the coverage run is older "
                                   "than this paritykit: run `paritykit coverage` again")
    outcome.duration_s = time.perf_counter() - started
    return outcome


def _throwaway_torchrec(root: Path, scratch: Path, mutant: Mutant, change: MutantChange) -> dict[str, str]:
    """Copy torchrec into ``scratch`` with the mutated file; the environment that puts it first."""
    copy = scratch / "torchrec"
    shutil.copytree(root, copy, symlinks=True)
    target = copy / mutant.file
    for stale in (target.parent / "__pycache__").glob(f"{target.stem}.*.pyc"):
        stale.unlink()
    target.write_text(change.source)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(scratch)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.pop(RANK_CONFIG_ENV, None)
    return env


def _import_problem(mutant: Mutant, scratch: str, env: dict[str, str]) -> str | None:
    """None when the mutated module imports from the throwaway copy; else why not (an incompetent mutant)."""
    probe = (f"import torchrec, {module_name(mutant.file)}\n"
             f"assert torchrec.__file__.startswith({scratch!r}), 'torchrec loaded from ' + torchrec.__file__")
    try:
        done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=IMPORT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"importing {module_name(mutant.file)} took over {IMPORT_TIMEOUT_S:g} s"
    if done.returncode == 0:
        return None
    return (done.stderr.strip().splitlines() or ["(no output)"])[-1]


def _replay(command: list[str], env: dict[str, str], timeout_s: float) -> tuple[str, str]:
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        return TIMEOUT, f"no answer within {timeout_s:.0f} s"
    if process.returncode == 0:
        return SURVIVED, ""
    status = KILLED_BY_ERROR if process.returncode == 2 else KILLED
    return status, first_failure(output) or f"exit code {process.returncode}"


def first_failure(output: str) -> str:
    """The first failing case's header and first message lines from the gate's terminal output."""
    lines = output.splitlines()
    for index, line in enumerate(lines):
        if line.startswith(("[fail]", "[error]", "paritykit: error", "paritykit: internal error")):
            return "\n".join(lines[index : index + DETAIL_LINES])
    return "\n".join(lines[-DETAIL_LINES:])
