"""What a coverage run shows, per area of torchrec: lines executed at all, lines executed inside a case
compared against an independent oracle, and the public functions that nothing ran.

Lines are coverage.py's statements. Two denominators are given: every statement (coverage.py's own
figure) and the statements inside function and method bodies (module-level lines, the ``def`` and
``class`` lines among them, run at import whatever the gate does, so only function bodies say what a
case exercised). "Under an oracle" counts a line when a passing case of a check with an independent
oracle (``CheckEntry.oracle``) ran it, in the caller or on a rank. Regions that cannot run on a CPU
machine are listed in ``coverage_unreachable.toml`` with the reason; the "CPU-reachable" column
leaves them out of the denominator.
"""

from __future__ import annotations

import ast
import fnmatch
import json
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from paritykit.gate.coverage_run import CoveredCase, load_cases, load_data, measured_root
from paritykit.gate.coverage_scope import GROUPS, relative_name, scope_files

UNREACHABLE_FILE = Path(__file__).with_name("coverage_unreachable.toml")


@dataclass
class FileLines:
    """One torchrec file: its statements, which ran, which ran under an oracle; function spans."""

    relative: str
    statements: set[int]
    executed: set[int]
    under_oracle: set[int]
    in_functions: set[int]
    unreachable: set[int]
    never_run_public: list[str] = field(default_factory=list)


@dataclass
class AreaFigures:
    name: str
    focus: bool
    files: int = 0
    statements: int = 0
    executed: int = 0
    function_statements: int = 0
    function_executed: int = 0
    function_under_oracle: int = 0
    reachable: int = 0
    reachable_under_oracle: int = 0

    def add(self, lines: FileLines) -> None:
        body = lines.statements & lines.in_functions
        reachable = body - lines.unreachable
        self.files += 1
        self.statements += len(lines.statements)
        self.executed += len(lines.executed)
        self.function_statements += len(body)
        self.function_executed += len(body & lines.executed)
        self.function_under_oracle += len(body & lines.under_oracle)
        self.reachable += len(reachable)
        self.reachable_under_oracle += len(reachable & lines.under_oracle)


def _share(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def function_spans(tree: ast.AST) -> tuple[set[int], dict[str, tuple[int, int]], set[str]]:
    """(every line inside a function body, {qualified name: (first body line, last line)} of every
    function, the public ones' names: not underscored, not inside a function or a private class)."""
    inside: set[int] = set()
    spans: dict[str, tuple[int, int]] = {}
    public: set[str] = set()

    def visit(node: ast.AST, prefix: str, exposed: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first, name = child.body[0].lineno, f"{prefix}{child.name}"
                inside.update(range(first, child.end_lineno + 1))
                spans.setdefault(name, (first, child.end_lineno))
                if exposed and not child.name.startswith("_"):
                    public.add(name)
                visit(child, f"{name}.<locals>.", False)
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.", exposed and not child.name.startswith("_"))
            else:
                visit(child, prefix, exposed)

    visit(tree, "", True)
    return inside, spans, public


def load_unreachable(path: Path = UNREACHABLE_FILE) -> list[tuple[str, tuple[str, ...]]]:
    """[(file pattern, function patterns; () for the whole file)] of the regions a CPU cannot run."""
    if not path.exists():
        return []
    return [(entry["file"], tuple(entry.get("functions", ()))) for entry in tomllib.loads(path.read_text()).get("region", [])]


def unreachable_lines(relative: str, spans: dict[str, tuple[int, int]], statements: set[int],
                      regions: list[tuple[str, tuple[str, ...]]]) -> set[int]:
    blocked: set[int] = set()
    for file_pattern, patterns in regions:
        if not fnmatch.fnmatch(relative, file_pattern):
            continue
        if not patterns:
            return set(statements)
        for name, (first, last) in spans.items():
            if any(fnmatch.fnmatch(name, pattern) for pattern in patterns):
                blocked.update(range(first, last + 1))
    return blocked & statements


def file_lines(cov: Any, path: Path, root: Path, oracle_labels: set[str],
               unreachable: list[tuple[str, tuple[str, ...]]]) -> FileLines:
    relative = relative_name(path, root) or str(path)
    _, statements, _, missing, _ = cov.analysis2(str(path))
    statements, executed = set(statements), set(statements) - set(missing)
    by_line = _contexts_by_line(cov, path)
    under_oracle = {line for line, labels in by_line.items() if oracle_labels.intersection(labels)}
    try:
        inside, spans, public = function_spans(ast.parse(path.read_text()))
    except SyntaxError:
        inside, spans, public = set(), {}, set()
    never = sorted(name for name in public
                   if not executed.intersection(range(spans[name][0], spans[name][1] + 1))
                   and statements.intersection(range(spans[name][0], spans[name][1] + 1)))
    return FileLines(relative, statements, executed, under_oracle & statements, inside,
                     unreachable_lines(relative, spans, statements, unreachable), never)


def _contexts_by_line(cov: Any, path: Path) -> dict[int, list[str]]:
    data = cov.get_data()
    for measured in data.measured_files():
        if Path(measured).resolve() == path.resolve():
            return data.contexts_by_lineno(measured)
    return {}


def summarize(out_dir: Path) -> dict[str, Any]:
    """Per area figures and the public functions never executed, from a coverage directory."""
    gate, cases = load_cases(out_dir)
    cov = load_data(out_dir)
    root = measured_root(gate)  # where the run measured torchrec (the same version may lie elsewhere here)
    oracle_labels = {case.label for case in cases if case.compared_with_oracle}
    unreachable = load_unreachable()
    areas = [AreaFigures(group.name, group.focus) for group in GROUPS]
    never_run: dict[str, list[str]] = {}
    for path in scope_files(root):
        lines = file_lines(cov, path, root, oracle_labels, unreachable)
        for group, figures in zip(GROUPS, areas):
            if group.holds(lines.relative):
                figures.add(lines)
        if lines.never_run_public:
            never_run[lines.relative] = lines.never_run_public
    return {"torchrec": str(root), "cases": _case_counts(cases), "areas": [asdict(a) for a in areas],
            "never_run_public_functions": never_run}


def _case_counts(cases: list[CoveredCase]) -> dict[str, int]:
    return {"all": len(cases), "compared with an oracle and passed": sum(c.compared_with_oracle for c in cases)}


def render_markdown(summary: dict[str, Any]) -> str:
    counts = summary["cases"]
    lines = [
        "# torchrec coverage under paritykit's gate", "",
        f"torchrec at `{summary['torchrec']}`; {counts['all']} cases, "
        f"{counts['compared with an oracle and passed']} of them passing comparisons against an independent oracle.", "",
        "| area | files | statements | executed | in functions | executed | under an oracle | CPU-reachable | under an oracle |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for area in summary["areas"]:
        name = f"**{area['name']}**" if area["focus"] else area["name"]
        lines.append(
            f"| {name} | {area['files']} | {area['statements']} | {_share(area['executed'], area['statements'])} "
            f"| {area['function_statements']} | {_share(area['function_executed'], area['function_statements'])} "
            f"| {_share(area['function_under_oracle'], area['function_statements'])} | {area['reachable']} "
            f"| {_share(area['reachable_under_oracle'], area['reachable'])} |")
    lines += ["", "Bold: the areas the gate is expected to hold under an oracle. Percentages of the column to their left.",
              "", "## Public functions and methods nothing ran", ""]
    for relative, names in sorted(summary["never_run_public_functions"].items()):
        lines.append(f"- `{relative}`: " + ", ".join(f"`{name}`" for name in names))
    return "\n".join(lines) + "\n"


def write_summary(out_dir: Path) -> dict[str, Any]:
    summary = summarize(out_dir)
    (Path(out_dir) / "summary.json").write_text(json.dumps(summary, indent=1))
    (Path(out_dir) / "summary.md").write_text(render_markdown(summary))
    return summary


def write_coverage_reports(out_dir: Path) -> None:
    """coverage.py's own HTML report (each line with the cases that ran it) and JSON report."""
    cov = load_data(out_dir)
    cov.html_report(directory=str(Path(out_dir) / "html"), show_contexts=True, ignore_errors=True)
    # Without contexts: with them the JSON lists every case on every line (over a gigabyte for the
    # default gate); the contexts stay in the .coverage database and the HTML report.
    cov.json_report(outfile=str(Path(out_dir) / "coverage.json"), ignore_errors=True)


def terminal_lines(summary: dict[str, Any]) -> list[str]:
    """The focus areas, one line each, for the command's output."""
    out = []
    for area in summary["areas"]:
        out.append(f"{area['name']:<44} executed {_share(area['executed'], area['statements']):>6} of {area['statements']:>5}; "
                   f"function bodies under an oracle {_share(area['function_under_oracle'], area['function_statements']):>6}; "
                   f"CPU-reachable under an oracle {_share(area['reachable_under_oracle'], area['reachable']):>6}")
    return out
