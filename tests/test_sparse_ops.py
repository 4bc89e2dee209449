"""The sparse-ops check on the installed torchrec: every op passes its pinned and drawn inputs, every
budget is exact, the known-broken reproductions fail (as listed known issues) and nothing else does."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import find
from hypothesis.errors import NoSuchExample

from paritykit.checks import known_issues
from paritykit.checks.runner import GateConfig
from paritykit.checks.sparse_ops import rules
from paritykit.checks.sparse_ops.budget import OpBudget, check_op_budget, functions_of, measure
from paritykit.checks.sparse_ops.kjt_op_cases import _kjts
from paritykit.checks.sparse_ops.known_broken import KNOWN_BROKEN
from paritykit.checks.sparse_ops.matrix import NAME, op_cases, run_known_broken, run_matrix, run_op
from paritykit.checks.sparse_ops.op_budgets import op_budgets
from paritykit.errors import ParityError, UnsupportedByTorchrec
from paritykit.gate.profiles import PROFILE_EXAMPLES, profile_from_env
from paritykit.harness.versions import installed_versions

CASES = {case.name: case for case in op_cases()}
BUDGETS = {budget.name: budget for budget in op_budgets()}
CONFIG = GateConfig(device="cpu", examples=PROFILE_EXAMPLES[profile_from_env()], seed=0)


def test_op_names_are_unique_and_every_case_has_pinned_inputs():
    assert len(CASES) == len(op_cases())
    assert [name for name, case in CASES.items() if not case.pinned] == []


@pytest.mark.parametrize("name", sorted(CASES))
def test_pinned_inputs_of_every_op_match_the_reference_or_are_refused_for_their_dtype(name):
    refused = []
    for spec in CASES[name].pinned:
        try:
            CASES[name].body(spec)
        except UnsupportedByTorchrec as exc:
            refused.append(str(exc))
    # Only the float64 / float16-weights inputs that fbgemm's CPU kernels have no version for.
    assert all("no Double version" in r or "no Half version" in r for r in refused), refused
    assert len(refused) < len(CASES[name].pinned)


@pytest.mark.parametrize("name", sorted(CASES))
def test_drawn_inputs_of_every_op_match_the_reference(name):
    results = run_op(CASES[name], CONFIG)
    assert [(r.case_id, r.message) for r in results if r.status not in ("pass", "unsupported")] == []
    assert sum(r.status == "pass" for r in results) >= 1


@pytest.mark.parametrize("name", sorted(BUDGETS))
def test_every_budget_is_the_exact_count_at_the_named_functions(name):
    record = measure(BUDGETS[name], "cpu")
    assert (record.total, functions_of(record)) == (BUDGETS[name].budget, Counter(BUDGETS[name].sites))


def test_budget_names_do_not_repeat_the_sync_checks_budgets():
    from paritykit.checks.sync.budgets import BUDGETS_BY_NAME

    assert set(BUDGETS) & set(BUDGETS_BY_NAME) == set()


def test_a_budget_fails_over_its_count_and_at_a_function_it_does_not_name():
    lengths = torch.tensor([1, 2])
    over = OpBudget("reads", lambda device: lambda: lengths.tolist())
    with pytest.raises(ParityError, match="budget 0"):
        check_op_budget(over, measure(over, "cpu"))
    elsewhere = OpBudget("reads elsewhere", lambda device: lambda: lengths.tolist(), ("to_dense",))
    with pytest.raises(ParityError, match="does not name"):
        check_op_budget(elsewhere, measure(elsewhere, "cpu"))


def test_known_broken_cases_fail_here_as_listed_known_issues_or_pass_where_fixed():
    results = run_known_broken(CONFIG, None)
    judged = known_issues.apply(results, known_issues.load(), installed_versions()).cases
    statuses = {r.case_id.split(":")[0].removeprefix("known-broken "): r.status for r in judged}
    fixed = {rule for rule in KNOWN_BROKEN if not rules.kept_out(rule)}
    assert {rule: status for rule, status in statuses.items() if rule in fixed} == {rule: "pass" for rule in fixed}
    on_rank = {rules.PERMUTE_GRAD_NOT_BIJECTIVE: "skip"}  # no pool given
    expected = {rule: on_rank.get(rule, "known-issue") for rule in KNOWN_BROKEN if rule not in fixed}
    assert {rule: s for rule, s in statuses.items() if rule not in fixed} == expected


def test_the_permute_gradient_that_kills_its_process_fails_on_a_rank(rank_pools):
    results = [r for r in run_known_broken(GateConfig(device="cpu", world_sizes=(2,)), rank_pools)
               if rules.PERMUTE_GRAD_NOT_BIJECTIVE in r.case_id]
    assert [r.status for r in results] == ["fail"], results[0].message
    assert "SIGSEGV" in results[0].message or "gradient" in results[0].message


def test_draws_leave_out_the_inputs_a_standing_known_issue_lists():
    assert rules.kept_out(rules.OFFSETS_ZERO_BATCH)
    with pytest.raises(NoSuchExample):
        find(_kjts(), rules.offsets_only_zero_batch)
    drawn_zero_batch = find(_kjts(), rules.zero_batch)  # the lengths form is drawn
    assert drawn_zero_batch.form != "offsets" or drawn_zero_batch.metadata


def test_a_gate_run_without_pools_fails_nothing_but_the_known_broken_cases():
    results = run_matrix(GateConfig(device="cpu", examples=2, seed=3), None)
    failing = {r.case_id for r in results if r.status in ("fail", "error")}
    assert all(case_id.startswith("known-broken ") for case_id in failing), failing
    assert {r.check for r in results} == {NAME}
    assert sum(r.status == "pass" for r in results) > len(CASES) + len(BUDGETS)


def test_on_cuda_the_check_says_it_runs_on_cpu_only():
    (result,) = run_matrix(GateConfig(device="cuda"), None)
    assert (result.status, result.message.startswith("the sparse-ops check builds its tensors on CPU")) == ("skip", True)


def test_under_torchrun_the_crashing_case_is_skipped_on_the_launchs_ranks(monkeypatch):
    from paritykit.checks.runner import NOT_UNDER_TORCHRUN
    from paritykit.checks.sparse_ops import matrix
    from paritykit.dist.launcher import LauncherGroup

    launch = LauncherGroup.__new__(LauncherGroup)  # the launch's ranks, never started here
    asked = []

    class LaunchPools:
        def get(self, world_size, backend=None):
            asked.append(world_size)
            return launch

    monkeypatch.setattr(matrix, "launched_by_torchrun", lambda: True)
    results = [r for r in run_known_broken(GateConfig(device="cpu", world_sizes=(4,)), LaunchPools())
               if rules.PERMUTE_GRAD_NOT_BIJECTIVE in r.case_id]
    assert (asked, [(r.status, r.message) for r in results]) == ([4], [("skip", NOT_UNDER_TORCHRUN)])


def test_the_validators_soft_verdict_is_heard_when_torchrecs_logs_are_quieted():
    import logging

    from paritykit.checks.sparse_ops.validator_cases import ONE_RANK_VBE, ValidateSpec, build_raw, corrupted, verdict
    from paritykit.harness.noise import quiet_known_noise

    quiet_known_noise()
    spec = ValidateSpec(ONE_RANK_VBE, "vbe-strides-sum")
    logger = logging.getLogger("torchrec.sparse.jagged_tensor_validator")
    before = (logger.level, logger.propagate, logger.handlers[:])
    error, returned, warned = verdict(build_raw(corrupted(spec), spec.kjt), None)
    assert error is None and len(warned) == 1 and "must equal" in warned[0]
    assert (logger.level, logger.propagate, logger.handlers) == before


def test_the_ops_under_non_strict_export_match_the_reference_and_a_wrong_export_branch_is_caught(monkeypatch):
    from torchrec.sparse import jagged_tensor

    from paritykit.checks.sparse_ops.export_cases import export_cases, run_export_case

    cases = export_cases()
    assert [run_export_case(case)["ops"] for case in cases] == [4] * len(cases)
    # A bug only the export branches see: split's lengths narrowed from the wrong offsets while exporting.
    original = jagged_tensor.KeyedJaggedTensor.lengths_offset_per_key

    def zeroed_while_exporting(self):
        offsets = original(self)
        return [0] * len(offsets) if jagged_tensor.is_non_strict_exporting() else offsets

    monkeypatch.setattr(jagged_tensor.KeyedJaggedTensor, "lengths_offset_per_key", zeroed_while_exporting)
    with pytest.raises(ParityError, match=r"the exported program's kjt.split\(\[1, 2\]\)\[0\].lengths\(\)"):
        run_export_case(cases[0])
