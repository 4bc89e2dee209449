"""The mutants of `paritykit mutate`: every mutation point of the installed torchrec on a line that a
passing case of the coverage run executed, a reproducible uniform sample of them, and the checked-in
list of survivors known to be equivalent.

A mutant is named by its file, line, operator and occurrence (Cosmic Ray's addressing: the
occurrence-th position of that operator in a pre-order walk of the file's parso tree), and shown by
the line before and after. Equivalent survivors are matched by file, operator and the two lines'
text, so that they stay matched when torchrec's line numbers move.
"""

from __future__ import annotations

import ast
import difflib
import random
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from paritykit.errors import HarnessError
from paritykit.gate.mutation_operators import mutate_source, operators

EQUIVALENT_FILE = Path(__file__).with_name("equivalent_mutants.toml")


@dataclass(frozen=True)
class Mutant:
    file: str  # relative to the torchrec package
    line: int
    operator: str
    occurrence: int

    @property
    def key(self) -> str:
        return f"{self.file}:{self.line}:{self.operator}#{self.occurrence}"


@dataclass(frozen=True)
class MutantChange:
    """What a mutant changes: the mutated source and the changed lines, before and after."""

    source: str
    before: str
    after: str

    def describe(self) -> str:
        return f"`{self.before}` -> `{self.after}`"


# Statements that only log or warn: a mutant inside them cannot change what torchrec computes.
LOGGING_PREFIXES = ("logger.", "logging.", "_logger.", "log.", "warnings.warn(", "print(")


def mutation_points(source: str, ops: dict[str, Any] | None = None) -> list[tuple[str, int, int]]:
    """(operator name, occurrence, start line) of every mutation point in ``source``, leaving out the
    points inside logging statements (their occurrence numbers are kept, as ``mutate_code`` counts them)."""
    import parso
    from cosmic_ray.ast import ast_nodes

    ops = operators() if ops is None else ops
    tree = parso.parse(source)
    counts = {name: 0 for name in ops}
    points, logging_lines = [], set()
    for node in ast_nodes(tree):
        if node.type == "simple_stmt" and node.get_code(include_prefix=False).lstrip().startswith(LOGGING_PREFIXES):
            # Up to the statement's last line (its newline leaf ends on the next one).
            logging_lines.update(range(node.start_pos[0], node.children[-2].end_pos[0] + 1))
        for name, operator in ops.items():
            for start, _ in operator.mutation_positions(node):
                if start[0] not in logging_lines:
                    points.append((name, counts[name], start[0]))
                counts[name] += 1
    return points


def population(root: Path, covered: dict[str, set[int]]) -> list[Mutant]:
    """Every mutant on a covered line of the files in ``covered`` ({relative file: lines}), in a stable order."""
    found = []
    for relative in sorted(covered):
        lines = covered[relative]
        source = (root / relative).read_text()
        found += [Mutant(relative, line, name, occurrence)
                  for name, occurrence, line in mutation_points(source) if line in lines]
    return sorted(found, key=lambda m: (m.file, m.line, m.operator, m.occurrence))


def sample(mutants: list[Mutant], size: int | None, seed: int) -> list[Mutant]:
    """A uniform sample without replacement (all of them when ``size`` is None or too large), in the
    order drawn: the mutants run in that order, so the part of a run that finished before it was
    interrupted is itself a uniform sample (in file order it would be the first files only)."""
    if size is None or size >= len(mutants):
        return list(mutants)
    return random.Random(seed).sample(mutants, size)


def change_of(root: Path, mutant: Mutant) -> MutantChange:
    original = (root / mutant.file).read_text()
    mutated = mutate_source(original, mutant.operator, mutant.occurrence)
    if mutated is None:
        raise HarnessError(f"mutant {mutant.key}: the operator has no such occurrence in {mutant.file}")
    removed, added = _changed_lines(original, mutated)
    return MutantChange(mutated, " / ".join(removed), " / ".join(added))


def _changed_lines(original: str, mutated: str) -> tuple[list[str], list[str]]:
    removed, added = [], []
    for line in difflib.unified_diff(original.splitlines(), mutated.splitlines(), lineterm="", n=0):
        if line.startswith("-") and not line.startswith("---"):
            removed.append(line[1:].strip())
        elif line.startswith("+") and not line.startswith("+++"):
            added.append(line[1:].strip())
    return removed, added


@dataclass(frozen=True)
class Equivalent:
    file: str
    operator: str
    before: str
    after: str
    reason: str
    # The gate devices on which the change cannot show (a `device=` that only differs from the default
    # on a GPU is equivalent on "cpu" alone); empty: on every device.
    devices: tuple[str, ...] = ()
    # The qualified name of the function or class the line is in (Class.method), when the same text
    # stands elsewhere in the file where the change is not equivalent; empty: anywhere in the file.
    function: str = ""

    def matches(self, mutant: Mutant, change: MutantChange, device: str | None = None) -> bool:
        if self.devices and device not in self.devices:
            return False
        if (self.file, self.operator, self.before, self.after) != (mutant.file, mutant.operator, change.before, change.after):
            return False
        return not self.function or enclosing_definition(change.source, mutant.line) == self.function

    def describe(self) -> str:
        return f"on {'/'.join(self.devices)} only: {self.reason}" if self.devices else self.reason


def enclosing_definition(source: str, line: int) -> str:
    """The qualified name of the innermost function or class whose lines (signature included) hold ``line``."""
    found = ""

    def visit(node: ast.AST, prefix: str) -> None:
        nonlocal found
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and child.lineno <= line <= child.end_lineno:
                found = f"{prefix}{child.name}"
                visit(child, f"{found}.<locals>." if not isinstance(child, ast.ClassDef) else f"{found}.")
                return
            visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def load_equivalents(path: Path = EQUIVALENT_FILE) -> list[Equivalent]:
    """The checked-in equivalent survivors; an entry without a reason is a HarnessError."""
    if not path.exists():
        return []
    try:
        entries = tomllib.loads(path.read_text()).get("mutant", [])
    except tomllib.TOMLDecodeError as exc:
        raise HarnessError(f"{path} is not valid TOML: {exc}") from exc
    found = []
    for index, entry in enumerate(entries):
        # ``after`` may be empty (a dropped keyword argument); the rest may not.
        missing = [key for key in ("file", "operator", "before", "reason") if not entry.get(key)] + (
            [] if isinstance(entry.get("after"), str) else ["after"])
        if missing:
            raise HarnessError(f"{path}: entry {index} lacks {missing} (an equivalent mutant needs a reason)")
        devices = entry.get("devices", [])
        if not isinstance(devices, list) or not all(d in ("cpu", "cuda") for d in devices):
            raise HarnessError(f"{path}: entry {index}: devices must be a list of 'cpu'/'cuda', not {devices!r}")
        found.append(Equivalent(**{key: entry[key] for key in ("file", "operator", "before", "after", "reason")},
                                devices=tuple(devices), function=entry.get("function", "")))
    return found


def equivalent_reason(mutant: Mutant, change: MutantChange, equivalents: Iterable[Equivalent],
                      device: str | None = None) -> str | None:
    """Why the mutant cannot change what torchrec computes on the gate's ``device``, or None."""
    return next((e.describe() for e in equivalents if e.matches(mutant, change, device)), None)
