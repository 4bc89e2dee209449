"""DistributedModelParallel.reshard between steps: the tables really move to the new placement, the
transfer's point-to-point tags agree between ranks under paritykit's tag shim, and without it torchrec's
own tags (Python's per-process hash) leave gloo waiting (the known issue dmp-reshard-p2p-tags)."""

from __future__ import annotations

import pytest

from paritykit.checks.sharding.dmp_cases import dmp_cases, dmp_setup
from paritykit.engine.resharding import PROBE_TAG_ARGUMENTS, agreeing_p2p_tags, rank_tags, reshard
from paritykit.engine.training import build_model
from paritykit.errors import RankFailure
from paritykit.harness.devices import rank_device
from paritykit.harness.dmp import load_full_state

RESHARD = next(case for case in dmp_cases(2) if case.name == "reshard")


def _placements(dmp) -> dict[str, list[int]]:
    return {table: list(sharding.ranks) for table, sharding in dmp.plan.plan["ebc"].items()}


def _sharded(setup):
    device = rank_device(setup.device)
    dmp = setup.options.sharded(lambda: build_model(setup), setup.sharding_plan, device)
    load_full_state(dmp, setup.full_state)
    return dmp


def _placements_before_and_after_reshard(setup):
    dmp = _sharded(setup)
    before = _placements(dmp)
    reshard(dmp, setup.options.reshard.plan)
    return before, _placements(dmp)


def _tags_inside_and_outside_the_shim():
    from torchrec.distributed.sharding import dynamic_sharding

    with agreeing_p2p_tags():
        inside = dynamic_sharding._generate_tag(*PROBE_TAG_ARGUMENTS)
    return inside, rank_tags()


def _reshard_with_torchrecs_own_tags(setup):
    from torchrec.distributed.sharding.dynamic_sharding import output_sharding_plans_delta

    dmp = _sharded(setup)
    dmp.reshard(output_sharding_plans_delta(dmp.plan.plan, setup.options.reshard.plan.plan), sharded_module_fqn="ebc")


@pytest.mark.world_size(2)
def test_reshard_moves_every_table_to_its_new_ranks(rank_pool):
    setup = dmp_setup(RESHARD)
    wanted = {table: list(sharding.ranks) for table, sharding in setup.options.reshard.plan.plan["ebc"].items()}
    for before, after in rank_pool.run(_placements_before_and_after_reshard, setup):
        assert before != wanted and after == wanted


@pytest.mark.world_size(2)
def test_under_the_shim_a_sender_and_its_receiver_compute_the_same_tag(rank_pool):
    (inside_0, _), (inside_1, _) = rank_pool.run(_tags_inside_and_outside_the_shim)
    assert inside_0 == inside_1


@pytest.mark.slow
def test_without_the_shim_torchrecs_reshard_waits_forever_on_gloo():
    from paritykit.dist import RankPool

    with RankPool(2) as pool, pytest.raises(RankFailure, match="did not finish"):
        if len(set(pool.run(rank_tags))) == 1:
            pytest.skip("these ranks share PYTHONHASHSEED: torchrec's tags agree here")
        pool.call(_reshard_with_torchrecs_own_tags, (dmp_setup(RESHARD),), timeout=30)


def test_the_dmp_block_runs_the_reshards_of_three_ranks_and_the_subgroup_collectives_on_the_pool_of_two_hosts(rank_pools):
    from paritykit.checks.runner import GateConfig
    from paritykit.checks.sharding.collective_cases import subgroup_collective_cases
    from paritykit.checks.sharding.dmp_matrix import run_dmp_matrix
    from paritykit.checks.sharding.dmp_reshard_cases import reshards_beyond_two_ranks
    from paritykit.harness.hosts import HostLayout

    split = next(case for case in reshards_beyond_two_ranks(4) if case.name == "reshard-split")
    collectives = subgroup_collective_cases(4)
    assert {case.groups for case in collectives} == {((0, 2), (1, 3))} and len(collectives) == 4
    wanted = (split.case_id(),) + tuple(case.case_id() for case in collectives)
    config = GateConfig(world_sizes=(1,), hosts=(HostLayout(2, 2),), examples=1, case=wanted)  # no pool of two ranks to start
    results, _ = run_dmp_matrix("sharding", config, rank_pools)
    ran = {r.case_id: r.status for r in results if r.case_id in wanted}
    assert ran == dict.fromkeys(wanted, "pass")
    assert reshards_beyond_two_ranks(2) == () and {c.name for c in reshards_beyond_two_ranks(3)} == {"reshard-several-shards", "reshard-split"}
