"""The td-kjt check's forward-only cases on ranks standing for several hosts: batches whose sizes differ
between the ranks of a host, through table-row-wise, grid, row-wise and table-wise tables, against the
unsharded module; the layouts they run on; and a planted cross-host bug they catch."""

from __future__ import annotations

import dataclasses

import pytest

from paritykit.checks.runner import GateConfig
from paritykit.checks.td_kjt.pinned import host_cases
from paritykit.checks.td_kjt.rank import VS_UNSHARDED, check_case_on_rank, report_case_on_rank
from paritykit.errors import HarnessError
from paritykit.harness import plants
from paritykit.harness.hosts import HostLayout


def test_a_square_layout_is_joined_by_one_with_a_host_more():
    two_by_two, two_by_three = HostLayout(2, 2), HostLayout(2, 3)
    assert GateConfig(hosts=(two_by_two,)).pinned_host_layouts() == [two_by_two, HostLayout(3, 2)]
    assert GateConfig(hosts=(two_by_three,)).pinned_host_layouts() == [two_by_three]
    assert GateConfig(hosts=()).pinned_host_layouts() == []
    assert GateConfig(hosts=(HostLayout(1, 4),)).pinned_host_layouts() == []


def test_host_cases_feed_ranks_of_one_host_batches_of_different_sizes():
    for case in host_cases(4, 2, "cpu"):
        assert not case.train and case.hosts == HostLayout(2, 2)
        for step in case.steps:
            sizes = [batch.batch.batch_sizes for batch in step]  # per feature (a VBE batch's own sizes)
            assert sizes[0] != sizes[1] and sizes[2] != sizes[3]  # within each host
        assert "hosts=2x2" in case.describe()


def test_a_case_for_several_hosts_is_refused_by_ranks_of_one_host():
    with pytest.raises(HarnessError, match="does not divide world size 4"):
        dataclasses.replace(host_cases(4, 2, "cpu")[0], ranks_per_host=3)


@pytest.mark.world_size(4)
def test_a_case_for_two_hosts_is_a_harness_error_on_a_pool_of_one_host(rank_pool):
    from paritykit.errors import RankFailure

    with pytest.raises((HarnessError, RankFailure), match="stands for 2 hosts x 2 ranks"):
        rank_pool.run(check_case_on_rank, host_cases(4, 2, "cpu")[1])


@pytest.mark.world_size(4, ranks_per_host=2)
@pytest.mark.parametrize("index", [0, 1])
def test_host_case_equals_the_unsharded_module_on_two_hosts(rank_pool, index: int):
    metrics = rank_pool.run(check_case_on_rank, host_cases(4, 2, "cpu")[index])
    assert all(m["output_elements"] > 0 for m in metrics)


@pytest.mark.world_size(4, ranks_per_host=2)
def test_planted_twrw_output_split_by_host_index_is_caught_on_two_hosts(rank_pool):
    from paritykit.errors import RankFailure

    case = host_cases(4, 2, "cpu")[1]  # TWRW on host 0, batch sizes differing on every rank
    assert all(not r.problems for r in rank_pool.run(report_case_on_rank, case))
    with plants.applied(["twrw-output-split-by-host-index"]):
        try:
            reports = rank_pool.run(report_case_on_rank, case)
        except RankFailure as failure:  # torchrec's all-to-all refuses the wrong splits (1.8.0, 1.9.2)
            assert "twrw-output-split-by-host-index" in str(failure)
            return
    assert any(VS_UNSHARDED in r.kinds() for r in reports)  # or it returns other rows


def test_a_host_case_reproduction_runs_on_the_same_hosts_and_shows_the_planted_bug(tmp_path):
    import subprocess
    import sys

    from paritykit.checks.td_kjt.divergence import configuration_of
    from paritykit.gate.repro import script_text

    fixed_batch = host_cases(4, 2, "cpu")[-1]  # TWRW, RW, TW and GRID tables; ranks of a host with 1-3 rows
    configuration = configuration_of(fixed_batch)
    assert configuration.ranks_per_host == 2 and "hosts=2x2" in configuration.describe()
    path = tmp_path / "host_case.py"
    path.write_text(script_text(configuration, "a case on two hosts of two ranks"))
    assert "'ranks_per_host': 2" in path.read_text()

    def run(*prefix: str) -> subprocess.CompletedProcess:
        return subprocess.run([*prefix, sys.executable, str(path)], capture_output=True, text=True, timeout=600)

    clean = run()
    assert (clean.returncode, clean.stdout.split(":")[0]) == (0, "OK"), clean.stdout + clean.stderr[-3000:]
    planted = run(sys.executable, "-m", "paritykit", "plant", "twrw-output-split-by-host-index", "--")
    assert planted.returncode == 1 and "REPRODUCED" in planted.stdout, planted.stdout + planted.stderr[-3000:]
