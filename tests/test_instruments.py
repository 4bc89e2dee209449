"""`paritykit coverage` and `paritykit mutate` end to end, on a small run of the sharding check.

One coverage run (module scope) serves every test here: it must show torchrec lines run on the ranks
recorded under the case that made the call, the oracle-compared share per area, and it feeds a
smoke run of `paritykit mutate`, a mutant made by hand that the covering cases must kill, and one
that breaks the import (incompetent, not a kill).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("cosmic_ray", reason="paritykit mutate needs cosmic-ray (requirements/tools.txt)")

from paritykit.gate.coverage_run import load_cases  # noqa: E402
from paritykit.gate.coverage_scope import torchrec_dir  # noqa: E402
from paritykit.gate.mutant_run import INCOMPETENT, KILLED, choose_cases, run_mutant  # noqa: E402
from paritykit.gate.mutants import Mutant, MutantChange  # noqa: E402
from paritykit.gate.mutate import covered_lines  # noqa: E402

# One host (the cross-host pool would double the run for no line these tests need), and one pinned
# case: an EBC with column-wise, table-column-wise and table-wise tables on two ranks.
RUN = ["--check", "sharding", "--world-size", "2", "--hosts", "none", "--examples", "1", "--seed", "0"]


def _one_pinned_case() -> str:
    from paritykit.checks.sharding.pinned import pinned_cases

    return next(c for c in pinned_cases(2) if c.module == "ebc" and ("table_column_wise", (0, 1, 0)) in c.plan.values()).case_id()


def _paritykit(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    # A fresh process: coverage must start before torchrec is imported.
    return subprocess.run([sys.executable, "-m", "paritykit", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def coverage_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("coverage")
    done = _paritykit("coverage", *RUN, "--case", _one_pinned_case(), "--report", str(out), "--no-html")
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def test_coverage_records_each_case_and_the_ranks_lines_under_it(coverage_dir):
    gate, cases = load_cases(coverage_dir)
    assert gate["world_sizes"] == [2] and gate["cases"] == [_one_pinned_case()]
    assert [c.case_id for c in cases] == [_one_pinned_case()] and cases[0].check == "sharding"
    passing = {c.label for c in cases if c.status == "pass"}
    covered = covered_lines(coverage_dir, cases)
    # The sharded EBC runs only on the ranks; its lines carry the labels of the caller's cases.
    sharded = covered["distributed/embeddingbag.py"]
    assert sharded and all({c.label for c in running} <= passing for running in sharded.values())
    # The unsharded reference runs in the caller.
    assert covered["modules/embedding_modules.py"]


def test_the_summary_gives_each_area_its_share_under_an_oracle(coverage_dir):
    summary = json.loads((coverage_dir / "summary.json").read_text())
    areas = {area["name"]: area for area in summary["areas"]}
    sharding_types = areas["distributed/sharding/ (sharding types)"]
    assert 0 < sharding_types["function_under_oracle"] <= sharding_types["function_executed"] <= sharding_types["function_statements"]
    pipelines = areas["distributed/train_pipeline/"]
    assert pipelines["function_under_oracle"] == 0  # the sharding check runs no pipeline
    assert "## Public functions and methods nothing ran" in (coverage_dir / "summary.md").read_text()


def test_a_smoke_run_of_mutate_ends_with_its_score(coverage_dir, tmp_path):
    done = _paritykit("mutate", "--coverage", str(coverage_dir), "--sample", "2", "--seed", "5",
                      "--max-cases", "2", "--report", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    last = done.stdout.strip().splitlines()[-1]
    report = json.loads((tmp_path / "mutants.json").read_text())
    assert report["sampled"] == 2 and report["in_scope"] > 1000
    assert last == f"mutation score: {report['killed']} of {report['counted']} killed " + (
        f"({100.0 * report['killed'] / report['counted']:.1f}%)" if report["counted"] else "(-)")


def _mutant_of(relative: str, anchor: str, before: str, after: str) -> tuple[Mutant, MutantChange, int]:
    """A mutant made by hand: the first ``before`` after ``anchor`` in a torchrec file becomes ``after``."""
    source = (torchrec_dir() / relative).read_text()
    at = source.index(before, source.index(anchor))
    line = source[:at].count("\n") + 1
    mutated = source[:at] + after + source[at + len(before):]
    return Mutant(relative, line, "by-hand", 0), MutantChange(mutated, before.strip(), after.strip()), line


def test_a_mutant_of_a_covered_line_is_killed_by_the_cases_covering_it(coverage_dir):
    gate, cases = load_cases(coverage_dir)
    # The pooled all-to-all's backward (table-wise and column-wise EBC tables) stops dividing the
    # gradient by the world size.
    mutant, change, line = _mutant_of("distributed/comm_ops.py", "class All2All_Pooled_Req(",
                                      "grad_input.div_(dist.get_world_size(ctx.pg))", "pass")
    covering = covered_lines(coverage_dir, cases)["distributed/comm_ops.py"].get(line)
    assert covering, "the mutated line is not covered by this run"
    outcome = run_mutant(mutant, change, torchrec_dir(), choose_cases(covering, 2), gate, timeout_s=300)
    assert outcome.status == KILLED, outcome.detail
    assert "sharded training differs from the unsharded reference" in outcome.detail


def test_a_mutant_that_breaks_the_import_is_incompetent_not_killed(coverage_dir):
    gate, cases = load_cases(coverage_dir)
    mutant, change, _ = _mutant_of("sparse/jagged_tensor.py", "import", "import torch\n",
                                   "import torch\nraise ImportError('mutant')\n")
    outcome = run_mutant(mutant, change, torchrec_dir(), [c for c in cases if c.status == "pass"][:1], gate, timeout_s=300)
    assert outcome.status == INCOMPETENT and "mutant" in outcome.detail


def test_a_replay_of_cases_the_gate_no_longer_draws_is_a_harness_error_not_a_kill(coverage_dir):
    import dataclasses

    from paritykit.errors import HarnessError

    gate, cases = load_cases(coverage_dir)
    mutant, change, _ = _mutant_of("distributed/comm_ops.py", "class All2All_Pooled_Req(",
                                   "grad_input.div_(dist.get_world_size(ctx.pg))", "pass")
    stale = dataclasses.replace(next(c for c in cases if c.status == "pass"), short_id="0000000000")
    with pytest.raises(HarnessError, match="run `paritykit coverage` again"):
        run_mutant(mutant, change, torchrec_dir(), [stale], gate, timeout_s=300)


def test_a_def_header_maps_to_its_function_body_and_nested_ones_are_left_out():
    import ast

    from paritykit.gate.mutate import def_headers

    source = "def f(a,\n      b=1):\n    def g(c=2):\n        return c\n    return a + b\n\nclass C:\n    def m(self, x=3):\n        return x\n"
    headers = def_headers(ast.parse(source))
    assert headers == {1: (3, 5), 2: (3, 5), 8: (9, 9)}


def test_a_constructors_line_is_told_apart_by_paths_through_its_whole_class():
    from paritykit.gate.mutate import path_span_finder

    source = "class A:\n    def __init__(self):\n        self.x = 1\n\n    def read(self):\n        return self.x\n\ndef f():\n    return 2\n"
    span = path_span_finder(source)
    assert span(3) == (1, 6)  # in __init__: the class
    assert span(6) == (6, 6) and span(9) == (9, 9)  # elsewhere: the function's body
    assert span(1) is None
