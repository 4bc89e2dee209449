"""DistributedModelParallel's options and torchrec's collectives against the unsharded model: the pinned
DMP cases, the configurations known to fail inside torchrec, and the options' own checks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from paritykit.checks.known_issues import active_issues
from paritykit.checks.results import CaseResult
from paritykit.checks.sharding.dmp_cases import MODELS, DmpCase, dmp_cases, dmp_setup, run_dmp_case
from paritykit.checks.sharding.dmp_known_broken import RULES, known_broken_dmp_cases
from paritykit.engine.dmp_options import DmpOptions, QComm
from paritykit.engine.tolerances import codec_tolerance
from paritykit.errors import HarnessError, ParityError, RankFailure
from paritykit.harness.versions import installed_versions

CASES = dmp_cases(2)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{i}-{c.name}" for i, c in enumerate(CASES)])
def test_every_dmp_case_trains_like_the_unsharded_model_on_two_ranks(rank_pool, index):
    metrics = run_dmp_case(CASES[index], rank_pool)
    assert metrics["steps"] == 3 and metrics["ranks"] == 2 and metrics["state_tensors"] >= 1


@pytest.mark.world_size(3)
def test_the_dmp_cases_train_like_the_unsharded_model_on_three_ranks(rank_pool):
    names = {case.name for case in dmp_cases(3)}
    picked = [next(case for case in dmp_cases(3) if case.name == name) for name in sorted(names)]
    assert [run_dmp_case(case, rank_pool)["ranks"] for case in picked] == [3] * len(picked)


def test_every_option_and_model_is_pinned():
    options = [case.options for case in CASES]
    assert any(o.sync_collectives for o in options) and any(o.gradient_division is False for o in options)
    assert any(o.hyper_parameters for o in options) and any(o.qcomm for o in options)
    assert any(o.meta_model and not o.init_data_parallel and o.dense_from_bare for o in options)
    assert any(case.reshard_to for case in CASES) and any(o.one_tbe_per_table for o in options)
    assert {case.base.module for case in CASES if case.options.debug_checks} == {"ebc", "ec"}
    assert {case.model for case in CASES} == {"module", "ebc-under-dense", "embedding-bag", "ec-gather-select"}
    assert {case.base.module for case in CASES if case.options.sync_collectives} == {"ebc", "ec"}


@pytest.mark.world_size(2)
@pytest.mark.parametrize("rule", sorted(RULES))
def test_each_known_broken_dmp_configuration_fails_inside_torchrec_and_is_listed(rank_pool, rule):
    case_id, body = known_broken_dmp_cases(2)[rule]
    with pytest.raises((ParityError, RankFailure)):
        body(rank_pool)
    failed = CaseResult("sharding", case_id, "fail")
    listed = [issue for issue in active_issues() if issue.matches(failed)]
    assert [issue.standing(installed_versions()) for issue in listed] == ["applies"]


def test_lookups_holding_other_kernels_than_asked_are_caught():
    from types import SimpleNamespace

    from paritykit.checks.sharding.dmp_cases import kernels_problem
    from paritykit.checks.sharding.dmp_models import kernels_and_tables

    case = next(case for case in CASES if case.options.one_tbe_per_table)
    setup = SimpleNamespace(probes=(kernels_and_tables,))
    assert kernels_problem(case, setup, SimpleNamespace(probes=[[[(2, 2), (1, 1)]], [[(3, 3)]]])) is None
    found = kernels_problem(case, setup, SimpleNamespace(probes=[[[(2, 2)]], [[(1, 3)]]]))
    assert found == "rank 1: use_one_tbe_per_table, yet lookups hold 3 tables in 1 kernel(s)", found
    assert "no batched lookup" in kernels_problem(case, setup, SimpleNamespace(probes=[[[]], [[(1, 1)]]]))
    # By default the tables of one configuration share a kernel.
    grouped = next(case for case in CASES if case.name == "grouped-tables")
    assert kernels_problem(grouped, setup, SimpleNamespace(probes=[[[(1, 2)]], [[(1, 1)]]])) is None
    found = kernels_problem(grouped, setup, SimpleNamespace(probes=[[[(1, 2)]], [[(2, 2)]]]))
    assert found == "rank 1: tables of one data type, pooling and kernel, yet lookups hold 2 tables in 2 kernel(s)", found


def _case(**options) -> DmpCase:
    return dataclasses.replace(CASES[0], options=DmpOptions(**options))


@pytest.mark.parametrize("options, words", [
    ({"hyper_parameters": ({"lr": 0.1},)}, "one entry per step"),
    ({"hyper_parameters": ({"lr": 0.1}, {"momentum": 0.9}, {"lr": 0.1})}, "hyper_parameters[1]"),
    ({"hyper_parameters": ({"lr": 0.1, "eps": 1e-3},) * 3}, "sgd has no eps"),
    ({"qcomm": QComm("int3", "fp16")}, "precision 'int3'"),
])
def test_a_wrong_option_is_a_harness_error_naming_it_before_any_rank_runs(options, words):
    with pytest.raises(HarnessError, match=words.replace("[", r"\[").replace("]", r"\]")):
        dmp_setup(_case(**options))


def test_a_reshard_outside_the_steps_and_an_unknown_model_are_harness_errors():
    moved = next(case for case in CASES if case.reshard_to)
    with pytest.raises(HarnessError, match="reshard.before_step"):
        dmp_setup(dataclasses.replace(moved, reshard_before=3))
    with pytest.raises(HarnessError, match="model 'tower'"):
        dmp_setup(dataclasses.replace(CASES[0], model="tower"))
    assert "tower" not in MODELS


def test_the_codec_bound_counts_the_roundings_of_a_reduce_scatter():
    two, four = codec_tolerance(torch.float16, 2), codec_tolerance(torch.float16, 4)
    u = torch.finfo(torch.float16).eps / 2
    assert two.embeddings.rtol == pytest.approx(6 * u) and four.state.max_relative == pytest.approx(14 * u)
    assert not two.first_step_embeddings.exact and two.losses.rtol == pytest.approx(64 * u)
    # A consistent 1e-2 relative error is beyond it: the bound is tight enough to see a codec that is off.
    assert 1e-2 > 2 * two.embeddings.rtol


def _switches_inside_and_after(options: DmpOptions):
    from torchrec.distributed import comm_ops, embedding

    def read():
        return comm_ops.get_use_sync_collectives(), comm_ops.get_gradient_division(), embedding.get_ec_index_dedup()

    with options.on_rank():
        inside = read()
    return inside, read()


@pytest.mark.world_size(2)
def test_torchrecs_process_wide_switches_are_set_for_one_call_and_restored(rank_pool):
    options = DmpOptions(sync_collectives=True, gradient_division=False, ec_index_dedup=True)
    for inside, after in rank_pool.run(_switches_inside_and_after, options):
        assert inside == (True, False, True) and after == (False, True, False)


@pytest.mark.world_size(2)
def test_the_buffers_probe_reads_the_dense_buffer_dmp_lists_and_a_wrong_one_is_named(rank_pool):
    from paritykit.checks.sharding.dmp_cases import buffers_problem
    from paritykit.checks.sharding.dmp_models import unsharded_buffers
    from paritykit.engine.training import TrainingRecord

    case = next(case for case in CASES if case.model == "ebc-under-dense")
    setup = dataclasses.replace(dmp_setup(case), probes=(unsharded_buffers,))
    record = TrainingRecord([], [], [], {}, probes=[[probed] for probed in rank_pool.run(_probe_buffers, setup)])
    assert [set(probes[-1]) for probes in record.probes] == [{"shift"}, {"shift"}]
    assert buffers_problem(case, setup, record) is None
    record.probes[1][-1]["shift"] = record.probes[1][-1]["shift"] + 1
    assert "rank 1: DMP.named_buffers()" in buffers_problem(case, setup, record)


def _probe_buffers(setup):
    from paritykit.checks.sharding.dmp_models import unsharded_buffers
    from paritykit.harness.devices import rank_device
    from paritykit.harness.dmp import load_full_state
    from paritykit.engine.training import build_model

    dmp = setup.options.sharded(lambda: build_model(setup), setup.sharding_plan, rank_device(setup.device))
    load_full_state(dmp, setup.full_state)
    return unsharded_buffers(dmp)
