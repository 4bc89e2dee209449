"""An MC-EBC and an MC-EC sharded row-wise: each shard's remapper against the unsharded model fed every
id routed to it, each rank's embeddings against a lookup by hand; its specs refused when malformed."""

from __future__ import annotations

import pytest

from paritykit.checks.modules.mc_sharded_cases import ShardedMCSpec, _check_slots, pinned_specs, run_sharded_mc_case
from paritykit.errors import HarnessError, ParityError


def test_a_spec_whose_shards_get_other_id_counts_in_a_later_forward_is_refused():
    with pytest.raises(HarnessError, match=r"step 1: ids per shard \[1, 1\], the first forward's \[2, 0\]"):
        ShardedMCSpec(2, 2, 1, 5, (((1,), (2,)), ((1,), (7,))), ((0, 0), (0, 0)))
    with pytest.raises(HarnessError, match=r"ids \[10\] outside \[0, 10\)"):
        ShardedMCSpec(2, 2, 1, 5, (((1,), (10,)),), ((0, 0),))


def test_the_pinned_case_evicts_on_a_shard():
    spec = pinned_specs(2)[0]
    shard0 = {i for ids in spec.steps[0] for i in ids if spec.shard_of(i) == 0}
    assert len(shard0) > spec.zch_per_shard - 1  # more ids than slots: LFU keeps some, the rest get the default


def _remapped(spec, slots_of):
    return [{"forwards": [{"slots": [slots_of(step, i) for i in spec.steps[step][rank]]} for step in range(len(spec.steps))]}
            for rank in range(spec.world_size)]


def test_slots_from_another_shards_range_are_a_parity_error():
    spec = pinned_specs(2)[0]
    # Every id on the default slot of the other shard's range.
    other_default = lambda step, i: (1 - spec.shard_of(i)) * spec.zch_per_shard + spec.zch_per_shard - 1  # noqa: E731
    with pytest.raises(ParityError, match=r"outside \["):
        _check_slots(spec, _remapped(spec, other_default))


@pytest.mark.world_size(2)
def test_pinned_sharded_mc_ebc_and_ec_match_their_model_and_a_lookup_by_hand(rank_pool):
    ebc, ec, hashed = pinned_specs(2)
    assert (ebc.module, ec.module, hashed.module, hashed.hashed) == ("mc-ebc", "mc-ec", "mc-ebc", True)
    # forwards x ranks x features x samples x dim; an EC: one vector per id (4 ids a rank a forward)
    assert run_sharded_mc_case(rank_pool, ebc) == {"forwards": 3, "embedding_elements": 3 * 2 * 2 * 2 * 4}
    assert run_sharded_mc_case(rank_pool, ec) == {"forwards": 3, "embedding_elements": 3 * 2 * 4 * 4}
    assert run_sharded_mc_case(rank_pool, hashed) == {"forwards": 3, "embedding_elements": 3 * 2 * 2 * 2 * 4}


def test_the_hashed_pinned_case_sends_each_shard_the_ids_of_the_unhashed_one():
    ebc, _ec, hashed = pinned_specs(2)
    assert hashed.steps != ebc.steps
    for step, rank_ids in enumerate(hashed.steps):
        assert [hashed.remapped_ids(ids) for ids in rank_ids] == [list(ids) for ids in ebc.steps[step]]


@pytest.mark.world_size(2)
def test_an_input_hash_the_shards_do_not_apply_is_caught(rank_pool):
    from paritykit.checks import load_plants
    from paritykit.harness import plants

    load_plants(["modules"])
    with plants.applied(["mch-input-hash-not-applied"]), pytest.raises(ParityError, match="hashed id"):
        run_sharded_mc_case(rank_pool, pinned_specs(2)[2])


# The modules check's plants that only ranks show (tests/test_modules_plants.py runs the others in-process).
RANK_PLANTS = {"mc-evicted-rows-keep-their-embedding"}


@pytest.mark.world_size(2)
@pytest.mark.parametrize("index", [0, 1], ids=["mc-ebc", "mc-ec"])
def test_planted_evicted_rows_keeping_their_embedding_are_caught(rank_pool, index):
    from paritykit.checks import load_plants
    from paritykit.harness import plants

    load_plants(["modules"])
    spec = pinned_specs(2)[index]
    with plants.applied(sorted(RANK_PLANTS)):
        with pytest.raises(ParityError, match="model admits 2 new id"):
            run_sharded_mc_case(rank_pool, spec)
    assert run_sharded_mc_case(rank_pool, spec)["forwards"] == 3
