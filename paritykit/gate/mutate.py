"""`paritykit mutate`: automatic mutants of the installed torchrec on lines the gate covers, each run
against only the cases that cover its line; the mutation score and every survivor.

    paritykit coverage --report cov/                 # once: which case runs which torchrec line
    paritykit mutate --coverage cov/ --sample 200 --seed 0 --report mut/

Without ``--coverage`` a coverage run of the default gate is made first (into ``<report>/coverage``).
The score is killed / (sampled - incompetent - equivalent); timeouts and harness errors (exit 2) are
kills, counted apart. The report directory gets mutants.json (every mutant: file, line, operator,
the line before and after, the cases run, the outcome) and survivors.md (grouped by file).
"""

from __future__ import annotations

import ast
import functools
import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from paritykit.errors import HarnessError
from paritykit.gate.coverage_run import CoveredCase, load_cases, load_data, measured_root
from paritykit.gate.coverage_scope import relative_name, torchrec_dir
from paritykit.gate.coverage_summary import function_spans
from paritykit.gate.mutant_run import (EQUIVALENT, INCOMPETENT, KILLED_OUTCOMES, LAST_ROUND_BUDGET_S, SURVIVED, MutantOutcome,
                                       case_breadth, choose_cases, function_paths, innermost_function, line_paths,
                                       last_round, run_mutant, second_round)
from paritykit.gate.mutant_journal import Journal, run_identity
from paritykit.gate.mutants import Mutant, change_of, equivalent_reason, load_equivalents, population, sample


def def_headers(tree: ast.AST) -> dict[int, tuple[int, int]]:
    """{line of a module-level or class-level ``def``'s header (its signature, defaults included):
    (first, last) line of that function's body}. Nested functions are left out: their headers run
    inside their enclosing function, where coverage records them."""
    headers: dict[int, tuple[int, int]] = {}

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = child.body[0].lineno
                headers.update(dict.fromkeys(range(child.lineno, first), (first, child.end_lineno)))
            elif isinstance(child, ast.ClassDef):
                visit(child)

    visit(tree)
    return headers


def path_span_finder(source: str) -> Callable[[int], tuple[int, int] | None]:
    """For a line, the span whose paths tell cases apart (``choose_cases``): the narrowest function
    holding it, but for a constructor the whole class, since what ``__init__`` sets up shows in the
    methods that read it (a removed ``self._x = x`` fails only on the path that reads ``_x``)."""
    tree = ast.parse(source)
    functions = function_spans(tree)[1]
    classes = [(node.lineno, node.end_lineno) for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]

    def span(line: int) -> tuple[int, int] | None:
        holding = {name: s for name, s in functions.items() if s[0] <= line <= s[1]}
        if not holding:
            return None
        name, narrowest = min(holding.items(), key=lambda item: item[1][1] - item[1][0])
        if name.rsplit(".", 1)[-1] == "__init__":
            return innermost_function(classes, line) or narrowest
        return narrowest

    return span


def attribute_reader_finder(source: str) -> Callable[[int], frozenset[int]]:
    """For a line, the lines of the file that read an attribute a statement on that line stores on
    ``self`` (``self._dim_per_key = ...`` -> every ``._dim_per_key`` read). What a method sets up
    shows where it is read, often on a path of its own (a removed store fails only there), which
    the paths through the storing function cannot tell apart."""
    tree = ast.parse(source)
    stored: dict[int, set[str]] = {}  # statement line -> the attributes it stores on self
    reads: dict[str, set[int]] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = {t.attr for target in targets for t in ast.walk(target)
                     if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
            for line in range(node.lineno, (node.end_lineno or node.lineno) + 1):
                stored.setdefault(line, set()).update(names)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            reads.setdefault(node.attr, set()).add(node.lineno)

    def readers(line: int) -> frozenset[int]:
        return frozenset(read for name in stored.get(line, ()) for read in reads.get(name, ()))

    return readers


def covered_lines(out_dir: Path, cases: list[CoveredCase]) -> dict[str, dict[int, list[CoveredCase]]]:
    """{torchrec-relative file: {line: the passing cases that ran it}} from a coverage directory.

    A module-level line (an import, a constant, a ``def`` line with its defaults) runs once, at
    import, usually between cases; it counts as covered by every case that ran a line of the
    file's functions, since those are what it defines. A ``def``'s header (a default changed) is
    covered by the cases that ran that function's body, where there are any: only a call can read
    a default.
    """
    by_label = {case.label: case for case in cases if case.status == "pass"}
    root = measured_root(load_cases(out_dir)[0])  # the same torchrec may lie elsewhere here
    data = load_data(out_dir).get_data()
    covered: dict[str, dict[int, list[CoveredCase]]] = {}
    for measured in data.measured_files():
        relative = relative_name(measured, root)
        if relative is None:
            continue
        by_line = {line: [by_label[label] for label in labels if label in by_label]
                   for line, labels in data.contexts_by_lineno(measured).items()}
        tree = ast.parse(Path(measured).read_text())
        in_functions, _, _ = function_spans(tree)
        users = {case.label: case for line, running in by_line.items() if line in in_functions for case in running}
        lines = {line: running or (list(users.values()) if line not in in_functions else [])
                 for line, running in by_line.items()}
        for line, (first, last) in def_headers(tree).items():
            callers = {case.label: case for body in range(first, last + 1) for case in by_line.get(body, ())}
            if line in lines and callers:
                lines[line] = list(callers.values())
        lines = {line: running for line, running in lines.items() if running}
        if lines:
            covered[relative] = lines
    return covered


def run_sample(coverage_dir: Path, size: int | None, seed: int, *, max_cases: int, timeout_s: float | None,
               jobs: int = 1, progress: Callable[[str], None] = print, journal_dir: Path | None = None,
               resume: bool = False, again: list[tuple[Mutant, str, str]] | None = None) -> dict[str, Any]:
    """Draw the sample, run every mutant, and return the results (``write_report`` renders them).
    With ``journal_dir`` every outcome is journaled as it finishes; ``resume`` reuses a journal's.
    ``again`` (mutants with their recorded line before and after, from ``earlier_survivors``) runs
    those instead of a sample."""
    gate, cases = load_cases(coverage_dir)
    journal = Journal(journal_dir, run_identity(coverage_dir, seed, max_cases), resume) if journal_dir else None
    root = torchrec_dir()
    covered = covered_lines(coverage_dir, cases)
    breadth = case_breadth(covered)
    # The path spans of a file a sampled mutant lies in, parsed once (a sample touches a few files).
    spans = functools.cache(lambda file: path_span_finder((root / file).read_text()))
    readers = functools.cache(lambda file: attribute_reader_finder((root / file).read_text()))
    everything = population(root, {file: set(lines) for file, lines in covered.items()})
    chosen = sample(everything, size, seed) if again is None else [mutant for mutant, _, _ in again]
    progress(f"{len(everything)} mutants in scope ({sum(len(v) for v in covered.values())} covered lines of "
             f"{len(covered)} torchrec files); running {len(chosen)} "
             + (f"(seed {seed})" if again is None else "(an earlier report's survivors)"))
    if again is not None:
        _same_torchrec(root, again)
    equivalents = load_equivalents()

    def one(index_and_mutant: tuple[int, Mutant]) -> MutantOutcome:
        index, mutant = index_and_mutant
        change = change_of(root, mutant)
        reason = equivalent_reason(mutant, change, equivalents, gate.get("device"))
        resumed = journal.done(mutant) if journal else None
        if resumed is not None and reason is None:
            progress(f"[{index + 1}/{len(chosen)}] {resumed.status:<16} {mutant.file}:{mutant.line} (from the journal)")
            return resumed
        if reason is not None:
            outcome = MutantOutcome(mutant, change.before, change.after, EQUIVALENT, detail=reason)
        elif mutant.line not in covered.get(mutant.file, {}):
            outcome = MutantOutcome(mutant, change.before, change.after, SURVIVED, detail="no passing case runs its line")
        else:
            lines = covered[mutant.file]
            paths = function_paths(lines, spans(mutant.file)(mutant.line))
            reading = line_paths(lines, readers(mutant.file)(mutant.line))
            picked = choose_cases(lines[mutant.line], max_cases, breadth, paths, reading)
            outcome = _against_cases(mutant, change, root, gate, picked, lines[mutant.line], max_cases, timeout_s)
            if journal:
                journal.record(outcome)
        progress(f"[{index + 1}/{len(chosen)}] {outcome.status:<16} {mutant.file}:{mutant.line} "
                 f"{mutant.operator.split('/')[-1]} {change.describe()} ({len(outcome.cases)} cases, {outcome.duration_s:.0f} s)")
        return outcome

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as executor:
        outcomes = list(executor.map(one, enumerate(chosen)))
    return {"gate": gate, "seed": seed, "in_scope": len(everything), "covered_files": len(covered),
            "outcomes": outcomes}


def _against_cases(mutant: Mutant, change: Any, root: Path, gate: dict[str, Any], picked: list[CoveredCase],
                   covering: list[CoveredCase], max_cases: int, timeout_s: float | None) -> MutantOutcome:
    """The mutant against the picked cases; should they let it through, against a second round of the
    covering cases of families they did not run (``second_round``), then against the rest of the covering
    cases that fit LAST_ROUND_BUDGET_S of their recorded time (``last_round``)."""
    outcome = run_mutant(mutant, change, root, picked, gate, timeout_s or 120.0 + 4.0 * sum(case.duration_s for case in picked))
    ran = list(picked)
    for next_round in (lambda: second_round(covering, ran, max_cases), lambda: last_round(covering, ran, LAST_ROUND_BUDGET_S)):
        if outcome.status != SURVIVED:
            break
        more = next_round()
        if not more:
            continue
        again = run_mutant(mutant, change, root, more, gate, timeout_s or 120.0 + 4.0 * sum(case.duration_s for case in more))
        again.cases, again.duration_s = outcome.cases + again.cases, outcome.duration_s + again.duration_s
        outcome = again
        ran += more
    return outcome


def earlier_survivors(report_dir: Path) -> list[tuple[Mutant, str, str]]:
    """The survivors of an earlier ``paritykit mutate`` report, with the lines it recorded."""
    path = Path(report_dir) / "mutants.json"
    try:
        recorded = json.loads(path.read_text())["mutants"]
    except (OSError, ValueError, KeyError) as exc:
        raise HarnessError(f"{path}: not a `paritykit mutate` report: {exc}") from exc
    return [(Mutant(m["file"], m["line"], m["operator"], m["occurrence"]), m["before"], m["after"])
            for m in recorded if m["status"] == SURVIVED]


def _same_torchrec(root: Path, again: list[tuple[Mutant, str, str]]) -> None:
    # The earlier report's mutants are positions in its torchrec's files: they must make the same change here.
    for mutant, before, after in again:
        change = change_of(root, mutant)
        if (change.before, change.after) != (before, after):
            raise HarnessError(f"mutant {mutant.key} changes `{change.before}` to `{change.after}` in {root}, but the earlier "
                               f"report recorded `{before}` to `{after}`: it was made on another torchrec")


def score(outcomes: list[MutantOutcome]) -> tuple[int, int]:
    """(killed, counted): counted leaves out incompetent and equivalent mutants."""
    counted = [o for o in outcomes if o.status not in (INCOMPETENT, EQUIVALENT)]
    return sum(o.status in KILLED_OUTCOMES for o in counted), len(counted)


def score_line(outcomes: list[MutantOutcome]) -> str:
    killed, counted = score(outcomes)
    share = f"{100.0 * killed / counted:.1f}%" if counted else "-"
    return f"mutation score: {killed} of {counted} killed ({share})"


def summary_lines(result: dict[str, Any]) -> list[str]:
    outcomes = result["outcomes"]
    counts = Counter(o.status for o in outcomes)
    lines = [f"{result['in_scope']} mutants in scope; sampled {len(outcomes)} (seed {result['seed']}): "
             + ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))]
    survivors = [o for o in outcomes if o.status == SURVIVED]
    if survivors:
        lines.append(f"survivors ({len(survivors)}):")
        lines += [f"  {o.mutant.file}:{o.mutant.line} {o.mutant.operator.split('/')[-1]}: `{o.before}` -> `{o.after}` "
                  f"(cases {', '.join(o.cases)})" for o in survivors]
    lines.append(score_line(outcomes))
    return lines


def write_report(result: dict[str, Any], out_dir: Path) -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    outcomes = result["outcomes"]
    killed, counted = score(outcomes)
    data = {"schema": 1, "gate": result["gate"], "seed": result["seed"], "in_scope": result["in_scope"],
            "sampled": len(outcomes), "killed": killed, "counted": counted,
            "by_status": dict(Counter(o.status for o in outcomes)), "mutants": [o.to_json() for o in outcomes]}
    (out_dir / "mutants.json").write_text(json.dumps(data, indent=1))
    (out_dir / "survivors.md").write_text(render_survivors(result))
    return [out_dir / "mutants.json", out_dir / "survivors.md"]


def render_survivors(result: dict[str, Any]) -> str:
    outcomes = result["outcomes"]
    lines = ["# Surviving mutants", "", score_line(outcomes), "",
             f"{result['in_scope']} mutants in scope (mutation points on covered lines); sample of {len(outcomes)}, "
             f"seed {result['seed']}; gate arguments {json.dumps(result['gate'])}.", ""]
    by_file: dict[str, list[MutantOutcome]] = {}
    for outcome in outcomes:
        if outcome.status == SURVIVED:
            by_file.setdefault(outcome.mutant.file, []).append(outcome)
    for file, survivors in sorted(by_file.items()):
        lines += [f"## {file}", ""]
        lines += [f"- line {o.mutant.line}, {o.mutant.operator}: `{o.before}` -> `{o.after}`; cases run: "
                  + ", ".join(f"`{label}`" for label in o.cases) for o in survivors]
        lines.append("")
    return "\n".join(lines)
