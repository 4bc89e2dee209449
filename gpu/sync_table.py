"""The sync corpus counted on two devices, as a Markdown table: CPU proxy vs CUDA, per budget.

    python gpu/sync_table.py --left cpu --right cuda [--markdown FILE]

Each budget of paritykit's sync corpus (paritykit.checks.sync.budgets) prepares its inputs on a
device and counts its region with that device's backend: the CPU proxy on "cpu", torch's sync
debug mode on "cuda". A row agrees when both sides count the same total with the same kinds. The
table goes to stdout (and to FILE); the exit code is 0 when every row agrees, 1 otherwise, 2 when
a side cannot run here (no GPU for "cuda"). With --right cpu both sides are the proxy, which is how
the table builder is tested on machines without a GPU.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

DEVICES = ("cpu", "cuda")
BACKEND_NAMES = {"cpu": "CPU proxy", "cuda": "CUDA"}


@dataclass(frozen=True)
class Row:
    budget: str
    allowed: int
    left_total: int
    right_total: int
    left_kinds: dict[str, int]
    right_kinds: dict[str, int]

    @property
    def agrees(self) -> bool:
        return self.left_total == self.right_total and self.left_kinds == self.right_kinds


def count_rows(budgets: list[Any], left: Callable[[Any], Any], right: Callable[[Any], Any]) -> list[Row]:
    """One row per budget; ``left``/``right`` count a budget and return its SyncRecord."""
    rows = []
    for budget in budgets:
        left_record, right_record = left(budget), right(budget)
        rows.append(Row(budget.name, budget.budget, left_record.total, right_record.total, left_record.by_kind, right_record.by_kind))
    return rows


def render_markdown(rows: list[Row], left: str, right: str) -> str:
    left_name, right_name = _column_name(left, right, "left"), _column_name(left, right, "right")
    lines = [
        f"| budget | allowed | {left_name} | {right_name} | kinds, {left_name} | kinds, {right_name} | agree |",
        "| --- | ---: | ---: | ---: | --- | --- | --- |",
    ]
    for row in rows:
        lines.append(
            f"| `{row.budget}` | {row.allowed} | {row.left_total} | {row.right_total} | {_kinds(row.left_kinds)} | "
            f"{_kinds(row.right_kinds)} | {'yes' if row.agrees else '**no**'} |"
        )
    agreeing = sum(row.agrees for row in rows)
    lines += ["", f"{agreeing} of {len(rows)} budgets agree."]
    return "\n".join(lines) + "\n"


def _column_name(left: str, right: str, side: str) -> str:
    device = left if side == "left" else right
    name = BACKEND_NAMES[device]
    return f"{name} #{1 if side == 'left' else 2}" if left == right else name


def _kinds(by_kind: dict[str, int]) -> str:
    return ", ".join(f"{kind} {count}" for kind, count in sorted(by_kind.items())) or "-"


def measure_on(device: str) -> Callable[[Any], Any]:
    from paritykit.checks.sync.budget import measure

    return lambda budget: measure(budget, device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--left", choices=DEVICES, default="cpu")
    parser.add_argument("--right", choices=DEVICES, default="cuda")
    parser.add_argument("--markdown", type=Path, default=None, metavar="FILE", help="also write the table here")
    args = parser.parse_args(argv)
    import torch

    if "cuda" in (args.left, args.right) and not torch.cuda.is_available():
        print("sync_table: a side is 'cuda' but torch sees no CUDA device here (use --right cpu to try the table)", file=sys.stderr)
        return 2
    from paritykit.checks.sync.budgets import BUDGETS

    rows = count_rows(list(BUDGETS), measure_on(args.left), measure_on(args.right))
    table = render_markdown(rows, args.left, args.right)
    print(table, end="")
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(table)
    return 0 if all(row.agrees for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
