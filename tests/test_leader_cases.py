"""torchrec's collective control flow (checks/sharding/leader_cases.py): it passes on the ranks for
every leader, and each way a rank's result can be wrong is caught (the ranks' results changed)."""

from __future__ import annotations

import copy
import re
from types import SimpleNamespace

import pytest

from paritykit.checks.sharding.leader_cases import leader_cases, run_leader_case, run_leader_case_on_rank
from paritykit.errors import ParityError


@pytest.mark.world_size(2)
def test_every_leader_runs_once_and_shares_its_result(rank_pool):
    for case in leader_cases(2):
        assert run_leader_case(case, rank_pool) == {"ranks": 2, "leader": case.leader, "calls": 3}


_RESULTS: dict[str, list] = {}


def _ranks_results(rank_pool, case) -> list:
    """The ranks' results of ``case``, asked once for every change below."""
    if case.case_id() not in _RESULTS:
        _RESULTS[case.case_id()] = rank_pool.call(run_leader_case_on_rank, (case,), case=case.case_id())
    return _RESULTS[case.case_id()]


@pytest.mark.world_size(2)
@pytest.mark.parametrize("change,words", [
    (lambda found: found[1].update(is_leader=True), "is_leader(pg, 0) = True"),
    (lambda found: found[0].update(is_leader_default=False), "the leader defaults to rank 0"),
    (lambda found: found[1].update(invoked=(1, "abab")), "expected the leader's (rank 0) result"),
    (lambda found: found[1].update(calls=["ab", "c"]), "only on the leader"),
    (lambda found: found[1]["shared"].__setitem__(1, found[1]["shared"][0]), "create_on_rank_and_share_result gave"),
    (lambda found: found[1].update(shared_after_write=found[1]["shared"][0]), "shared memory, not a copy"),
])
def test_a_wrong_rank_result_is_caught(rank_pool, change, words):
    case = leader_cases(2)[0]
    changed = copy.deepcopy(_ranks_results(rank_pool, case))
    change(changed)
    with pytest.raises(ParityError, match=re.escape(words)):
        run_leader_case(case, SimpleNamespace(world_size=2, call=lambda *args, **kwargs: changed))


def test_on_strided_subgroups_every_member_gets_its_group_leaders_result_unless_the_known_issue_stands(rank_pools):
    from paritykit.checks import known_issues
    from paritykit.checks.results import CaseResult
    from paritykit.checks.sharding.leader_cases import subgroup_leader_cases
    from paritykit.harness.versions import installed_versions

    entry = next(i for i in known_issues.load() if i.id == "collective-utils-subgroup-leader-as-global-rank")
    pool = rank_pools.get(4, ranks_per_host=2)
    cases = subgroup_leader_cases(4)
    assert [c.leader for c in cases] == [0, 1] and subgroup_leader_cases(2) == ()
    for case in cases:
        assert entry.matches(CaseResult("sharding", case.case_id(), "fail"))
        if entry.standing(installed_versions()) == "applies":  # torchrec 1.8: the leader's group rank read as a global rank
            with pytest.raises(ParityError, match=r"is not part of group .*\(in distributed/collective_utils.py"):
                run_leader_case(case, pool)
        else:
            assert run_leader_case(case, pool) == {"ranks": 4, "leader": case.leader, "calls": 3}
    # The world group's cases do not match the entry.
    assert not entry.matches(CaseResult("sharding", leader_cases(2)[0].case_id(), "fail"))
