"""The mutation operators of `paritykit mutate`: which Cosmic Ray operators are kept, the exact
code each of paritykit's own operators produces."""

from __future__ import annotations

import pytest

pytest.importorskip("cosmic_ray", reason="paritykit mutate needs cosmic-ray (requirements/tools.txt)")

from paritykit.gate.mutants import (  # noqa: E402
    Equivalent,
    Mutant,
    MutantChange,
    equivalent_reason,
    load_equivalents,
    mutation_points,
    sample,
)
from paritykit.gate.mutation_operators import mutate_source, operators  # noqa: E402
from paritykit.errors import HarnessError  # noqa: E402

SOURCE = """def f(a, b, x):
    y = g(a.q, b[0], eps=1e-8, k=2)
    h(x)
    z = x[a:b]
    if a < b and x:
        return y
    return z
"""


def _mutations(operator: str) -> list[str]:
    found, occurrence = [], 0
    while (mutated := mutate_source(SOURCE, operator, occurrence)) is not None:
        compile(mutated, "<mutant>", "exec")
        found.append(next(new for old, new in zip(SOURCE.splitlines(), mutated.splitlines()) if old != new).strip())
        occurrence += 1
    return found


def test_binary_and_comparison_operators_are_replaced_only_within_their_family():
    names = {name.split("/")[-1] for name in operators()}
    assert "ReplaceBinaryOperator_Add_Sub" in names and "ReplaceBinaryOperator_Div_FloorDiv" in names
    assert "ReplaceBinaryOperator_Add_LShift" not in names and "ReplaceBinaryOperator_Mul_BitOr" not in names
    assert "ReplaceComparisonOperator_Lt_LtE" in names and "ReplaceComparisonOperator_Is_IsNot" in names
    assert "ReplaceComparisonOperator_Eq_Is" not in names
    assert {"AddNot", "NumberReplacer", "ReplaceAndWithOr", "SwapArguments", "DropKeywordArgument",
            "RemoveStatement", "SliceBoundOffByOne"} <= names
    assert not {"VariableReplacer", "VariableInserter", "RemoveDecorator", "ExceptionReplacer"} & names


def test_swap_arguments_swaps_adjacent_positional_arguments_and_keeps_the_spacing():
    assert _mutations("paritykit/SwapArguments") == ["y = g(b[0], a.q, eps=1e-8, k=2)"]


def test_drop_keyword_argument_leaves_out_one_keyword_argument_at_a_time():
    assert _mutations("paritykit/DropKeywordArgument") == ["y = g(a.q, b[0], k=2)", "y = g(a.q, b[0], eps=1e-8)"]


def test_drop_keyword_argument_of_a_call_with_one_argument():
    assert mutate_source("f(x=1)\n", "paritykit/DropKeywordArgument", 0) == "f()\n"


def test_remove_statement_replaces_assignments_and_calls_with_pass():
    assert _mutations("paritykit/RemoveStatement") == ["pass", "pass", "pass"]
    assert mutate_source('"""doc"""\n', "paritykit/RemoveStatement", 0) is None
    assert mutate_source("x: int\n", "paritykit/RemoveStatement", 0) is None  # a bare annotation does nothing
    assert mutate_source("x: int = 1\n", "paritykit/RemoveStatement", 0) == "pass\n"
    assert mutate_source("x += 1\n", "paritykit/RemoveStatement", 0) == "pass\n"


def test_no_mutant_is_made_inside_a_logging_statement():
    source = "logger.info(f'{a + 1}', extra=2)\ny = a + 1\n"
    assert {line for _, _, line in mutation_points(source)} == {2}


def test_slice_bounds_move_by_one_each_way():
    assert _mutations("paritykit/SliceBoundOffByOne") == [
        "z = x[(a) + 1:b]", "z = x[(a) - 1:b]", "z = x[a:(b) + 1]", "z = x[a:(b) - 1]"]


def test_mutation_points_are_numbered_per_operator_in_walk_order():
    points = [(name, occurrence, line) for name, occurrence, line in mutation_points(SOURCE)
              if name in ("paritykit/RemoveStatement", "core/NumberReplacer")]
    assert points == [
        ("paritykit/RemoveStatement", 0, 2), ("core/NumberReplacer", 0, 2), ("core/NumberReplacer", 1, 2),
        ("core/NumberReplacer", 2, 2), ("core/NumberReplacer", 3, 2), ("core/NumberReplacer", 4, 2),
        ("core/NumberReplacer", 5, 2), ("paritykit/RemoveStatement", 1, 3), ("paritykit/RemoveStatement", 2, 4)]


def test_a_sample_is_a_function_of_the_seed():
    mutants = [Mutant("sparse/x.py", line, "core/AddNot", 0) for line in range(100)]
    assert sample(mutants, 10, seed=3) == sample(mutants, 10, seed=3)
    assert sample(mutants, 10, seed=3) != sample(mutants, 10, seed=4)
    assert len(set(sample(mutants, 10, seed=3))) == 10
    assert sample(mutants, 500, seed=0) == mutants
    # Drawn order: a shorter sample of the same seed is the start of a longer one (an interrupted run's
    # finished part is a uniform sample), and the order is not the files'.
    assert sample(mutants, 20, seed=3) != sorted(sample(mutants, 20, seed=3), key=lambda m: m.line)
    assert sample(mutants, 10, seed=3) == sample(mutants, 20, seed=3)[:10]


def test_an_equivalent_survivor_is_matched_by_its_text_not_its_line_number():
    entry = Equivalent("sparse/x.py", "core/AddNot", "if a:", "if not a:", "a is always true here")
    change = MutantChange("...", "if a:", "if not a:")
    assert equivalent_reason(Mutant("sparse/x.py", 7, "core/AddNot", 0), change, [entry]) == "a is always true here"
    assert equivalent_reason(Mutant("sparse/y.py", 7, "core/AddNot", 0), change, [entry]) is None


def test_a_device_only_equivalent_is_matched_on_that_device_alone():
    entry = Equivalent("sparse/x.py", "paritykit/DropKeywordArgument", "f(x, device=d)", "f(x)", "d is the default", ("cpu",))
    change = MutantChange("...", "f(x, device=d)", "f(x)")
    mutant = Mutant("sparse/x.py", 3, "paritykit/DropKeywordArgument", 0)
    assert equivalent_reason(mutant, change, [entry], "cpu") == "on cpu only: d is the default"
    assert equivalent_reason(mutant, change, [entry], "cuda") is None


def test_an_equivalent_mutant_without_a_reason_is_refused(tmp_path):
    path = tmp_path / "equivalent.toml"
    path.write_text('[[mutant]]\nfile = "sparse/x.py"\noperator = "core/AddNot"\nbefore = "if a:"\nafter = "if not a:"\n')
    with pytest.raises(HarnessError, match="lacks \\['reason'\\]"):
        load_equivalents(path)


def test_the_checked_in_equivalent_list_loads():
    for entry in load_equivalents():
        assert entry.reason.strip()


def test_an_interrupted_run_resumes_from_its_journal_and_refuses_another_runs(tmp_path):
    from paritykit.gate.mutant_journal import Journal
    from paritykit.gate.mutant_run import KILLED, MutantOutcome

    identity = {"cases_sha256": "abc", "seed": 0, "sample": 200, "max_cases": 6}
    mutant = Mutant("sparse/x.py", 7, "core/AddNot", 0)
    Journal(tmp_path, identity, resume=False).record(MutantOutcome(mutant, "if a:", "if not a:", KILLED, ["sharding|1"], 3.0, "x"))
    resumed = Journal(tmp_path, identity, resume=True).done(mutant)
    assert (resumed.mutant, resumed.status, resumed.cases) == (mutant, KILLED, ["sharding|1"])
    assert Journal(tmp_path, identity, resume=False).done(mutant) is None  # a fresh run starts a fresh journal
    with pytest.raises(HarnessError, match="belongs to another mutation run"):
        Journal(tmp_path, {**identity, "seed": 1}, resume=True)


def test_an_earlier_reports_survivors_run_again_only_on_the_torchrec_they_were_made_on(tmp_path):
    import json

    from paritykit.gate.coverage_scope import torchrec_dir
    from paritykit.gate.mutate import _same_torchrec, earlier_survivors
    from paritykit.gate.mutants import change_of, population

    root = torchrec_dir()
    first, second = population(root, {"optim/warmup.py": set(range(1, 1000))})[:2]
    change = change_of(root, first)
    record = lambda m, status, before: {"file": m.file, "line": m.line, "operator": m.operator,  # noqa: E731
                                        "occurrence": m.occurrence, "before": before, "after": change.after, "status": status}
    (tmp_path / "mutants.json").write_text(json.dumps({"mutants": [record(first, "survived", change.before),
                                                                   record(second, "killed", "x")]}))
    again = earlier_survivors(tmp_path)
    assert again == [(first, change.before, change.after)]  # the killed one is not run again
    _same_torchrec(root, again)
    with pytest.raises(HarnessError, match="made on another torchrec"):
        _same_torchrec(root, [(first, change.before + " # elsewhere", change.after)])
    with pytest.raises(HarnessError, match="not a `paritykit mutate` report"):
        earlier_survivors(tmp_path / "missing")


def test_an_equivalent_limited_to_a_function_leaves_the_same_text_elsewhere_alone():
    from paritykit.gate.mutants import enclosing_definition

    source = "class A:\n    def f(self,\n          strict=True):\n        pass\n\n    def g(self,\n          strict=True):\n        pass\n"
    assert [enclosing_definition(source, line) for line in (3, 7)] == ["A.f", "A.g"]
    entry = Equivalent("x.py", "core/ReplaceTrueWithFalse", "strict=True):", "strict=False):", "g's callers pass it",
                       function="A.g")
    change = MutantChange(source, "strict=True):", "strict=False):")
    assert equivalent_reason(Mutant("x.py", 7, "core/ReplaceTrueWithFalse", 1), change, [entry]) == "g's callers pass it"
    assert equivalent_reason(Mutant("x.py", 3, "core/ReplaceTrueWithFalse", 0), change, [entry]) is None


# ---------------------------------------------------------------- which cases replay a mutant


def _case(check: str, name: str, seconds: float):
    from paritykit.gate.coverage_run import CoveredCase

    return CoveredCase(label=f"{check}|{name}", check=check, case_id=name, short_id=name, status="pass",
                       duration_s=seconds, oracle="unsharded")


def test_a_survivors_second_round_takes_the_fastest_case_of_each_family_the_first_did_not_run():
    from paritykit.gate.mutant_run import case_family, second_round

    lengths = _case("sparse-ops", "jt.accessors: JTSpec(form='lengths')", 0.1)
    offsets = _case("sparse-ops", "jt.accessors: JTSpec(form='offsets')", 0.2)
    dense, dense_slow = _case("sparse-ops", "jt.to_dense: JTSpec(a)", 0.3), _case("sparse-ops", "jt.to_dense: JTSpec(b)", 0.05)
    reshard = _case("sharding", "dmp reshard-split [ebc] world_size=4", 3.0)
    assert case_family(offsets) == "sparse-ops|jt.accessors"
    assert case_family(reshard) == "sharding|dmp reshard-split|world_size=4"
    # The same metric on two ranks is a family of its own: it runs the states' reductions one rank skips.
    one_rank, two_ranks = _case("metrics", "ne via module tasks=1", 0.1), _case("metrics", "ne via module world_size=2 tasks=1", 0.4)
    assert second_round([one_rank, two_ranks], [one_rank], 10) == [two_ranks]
    # So is a case that resumes from a checkpoint: it runs state_dict and load_state_dict.
    resumed = _case("metrics", "ne via module resumed before batch 2 tasks=1", 0.3)
    assert case_family(resumed) == "metrics|ne via|resumed"
    assert second_round([one_rank, resumed], [one_rank], 10) == [resumed]
    candidates = [lengths, offsets, dense, dense_slow, reshard]
    # jt.accessors ran already: its other inputs wait; each new family sends its fastest case, fastest first.
    assert second_round(candidates, [lengths], 10) == [dense_slow, reshard]
    assert second_round(candidates, [lengths], 1) == [dense_slow]
    assert second_round(candidates, candidates, 10) == []


def test_a_survivors_last_round_takes_the_rest_of_the_covering_cases_fastest_first_within_the_budget():
    from paritykit.gate.mutant_run import last_round

    ran = _case("metrics", "ne via module tasks=1", 0.1)
    cheap = [_case("metrics", f"ne via module window_size={w}", 0.2 + w / 100) for w in range(1, 5)]
    slow = _case("sharding", "dmp reshard-split [ebc] world_size=4", 30.0)
    candidates = [slow, ran, *reversed(cheap)]
    # Every covering case not yet run, fastest first, while the recorded times fit the budget.
    assert last_round(candidates, [ran], 60.0) == [*cheap, slow]
    assert last_round(candidates, [ran], 1.0) == cheap[:4]
    assert last_round(candidates, [ran], 0.5) == cheap[:2]
    assert last_round(candidates, candidates, 60.0) == []


def test_the_broadest_case_of_each_check_replays_first_then_the_fastest_of_each():
    from paritykit.gate.mutant_run import case_breadth, choose_cases

    small, broad, other = _case("sharding", "small", 1.0), _case("sharding", "broad", 9.0), _case("sharding", "other", 2.0)
    pipe = _case("pipeline", "p", 5.0)
    covered = {"a.py": {1: [small, broad, other, pipe], 2: [broad], 3: [broad, pipe]}, "b.py": {7: [broad]}}
    breadth = case_breadth(covered)
    assert breadth == {"sharding|small": 1, "sharding|broad": 4, "sharding|other": 1, "pipeline|p": 2}
    assert choose_cases([small, broad, other, pipe], 3, breadth) == [broad, pipe, small]
    assert choose_cases([small, broad, other, pipe], 10, breadth) == [broad, pipe, small, other]
    # Without the breadth of the cases: the fastest of each check, then the fastest.
    assert choose_cases([small, broad, other, pipe], 3) == [small, pipe, other]
    # Beyond the limit, every check covering the line keeps one case (its broadest).
    sync = _case("sync", "s", 0.5)
    assert choose_cases([small, broad, other, pipe, sync], 1, breadth) == [broad, pipe, sync]


def test_cases_taking_different_paths_through_the_mutated_function_replay_first():
    from paritykit.gate.mutant_run import case_breadth, choose_cases, function_paths, innermost_function

    plain, other_plain = _case("sharding", "plain", 1.0), _case("sharding", "plain2", 1.5)
    branch, broad = _case("sharding", "branch", 3.0), _case("pipeline", "broad", 9.0)
    # The function spans lines 10-16; the branch case alone runs 13-14, the others the straight path.
    lines = {10: [plain, other_plain, branch, broad], 11: [plain, other_plain, branch, broad], 12: [plain, other_plain, broad],
             13: [branch], 14: [branch], 16: [plain, other_plain, branch, broad], 40: [broad], 41: [broad]}
    span = innermost_function([(1, 60), (10, 16), (30, 45)], 11)
    assert span == (10, 16) and innermost_function([(10, 16)], 20) is None
    paths = function_paths(lines, span)
    assert paths["sharding|branch"] == frozenset({10, 11, 13, 14, 16})
    breadth = case_breadth({"a.py": lines})
    # branch adds the most lines of the function, then the fastest case that adds line 12 (plain);
    # half the limit of 4 is 2, then the broadest of each check.
    assert choose_cases(lines[11], 4, breadth, paths) == [branch, plain, broad, other_plain]
    # Without the paths: the broadest of each check, then the fastest.
    assert choose_cases(lines[11], 4, breadth) == [broad, branch, plain, other_plain]


def test_a_store_replays_the_cases_that_read_it_first():
    from paritykit.gate.mutant_run import case_breadth, choose_cases, function_paths, line_paths
    from paritykit.gate.mutate import attribute_reader_finder

    source = ("class Dist:\n"                       # 1
              "    def setup(self, dims):\n"        # 2
              "        self._dims = list(dims)\n"   # 3
              "        self._other = 0\n"           # 4
              "    def forward(self, x, mean):\n"   # 5
              "        if mean:\n"                  # 6
              "            return x / self._dims\n" # 7
              "        return x + self._other\n")   # 8
    readers = attribute_reader_finder(source)
    assert readers(3) == frozenset({7}) and readers(4) == frozenset({8}) and readers(6) == frozenset()
    plain, other_plain = _case("sharding", "plain", 1.0), _case("sharding", "plain2", 1.5)
    mean, broad = _case("td-kjt", "mean", 4.0), _case("pipeline", "broad", 9.0)
    lines = {3: [plain, other_plain, mean, broad], 4: [plain, other_plain, mean, broad], 6: [plain, other_plain, mean, broad],
             7: [mean], 8: [plain, other_plain, broad], 20: [broad], 21: [broad]}
    breadth = case_breadth({"a.py": lines})
    paths = function_paths(lines, (2, 4))  # every case takes the one path through setup
    # Only the mean case reads what line 3 stores: it replays first, though it is neither the
    # fastest nor the broadest; with a limit of 2 the broadest of the other checks follows.
    assert choose_cases(lines[3], 2, breadth, paths, line_paths(lines, readers(3))) == [mean, broad, plain]
    assert choose_cases(lines[3], 2, breadth, paths) == [plain, broad, mean]
