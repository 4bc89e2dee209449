"""Planted bugs through the checks' real comparisons: each failure carries its first divergence (step,
stage, module, table) and its configuration, and one bug failing cases of two checks is one finding."""

import pytest

from paritykit.checks import load_plants
from paritykit.checks.runner import GateConfig, run_case
from paritykit.gate.findings import group
from paritykit.harness import plants

CONFIG = GateConfig(device="cpu", world_sizes=(2,), examples=1)


@pytest.fixture(scope="module", autouse=True)
def catalog():
    load_plants(["sharding", "td-kjt"])


def sharding_result(pool, index):
    from paritykit.checks.sharding.case_runner import run_sharding_case
    from paritykit.checks.sharding.pinned import pinned_cases

    case = pinned_cases(2)[index]
    return run_case("sharding", case.case_id(), CONFIG, lambda: run_sharding_case(case, pool))


def td_kjt_result(pool):
    from paritykit.checks.td_kjt.cases import run_sharded_case
    from paritykit.checks.td_kjt.pinned import pinned_cases

    case = next(c for c in pinned_cases(2, "cpu") if c.kernel == "dense")  # a dense-kernel EBC over DP, CW and TW
    return run_case("td-kjt", case.describe(), CONFIG, lambda: run_sharded_case(pool, case))


@pytest.mark.world_size(2)
def test_a_gradient_bug_in_two_checks_is_one_finding_located_at_the_first_training_step(rank_pool):
    with plants.applied(["pooled-all-to-all-backward-not-divided"]):
        results = [sharding_result(rank_pool, 5), td_kjt_result(rank_pool)]
    assert [r.status for r in results] == ["fail", "fail"]
    assert all(r.configuration is not None for r in results)
    findings = group(results)
    assert len(findings) == 1 and findings[0].checks() == {"sharding": 1, "td-kjt": 1}
    for result in results:
        divergence = result.divergence
        assert (divergence["stage"], divergence["what"], divergence["step"], divergence["path"]) == (
            "backward or update", "table gradient or update", 0, "sharded vs unsharded")
        # The pooled all-to-all carries table- and column-wise tables' gradients: they move twice as far.
        assert "is 2 x the unsharded step" in divergence["detail"]
        assert divergence["module"] == "EmbeddingBagCollection" and divergence["table"]
    assert findings[0].smallest.check == "td-kjt"  # one step of two ranks, against three steps


@pytest.mark.world_size(2)
def test_a_forward_bug_is_located_at_the_lookup_of_the_tables_it_breaks(rank_pool):
    with plants.applied(["wrong-pooling-mode"]):
        result = sharding_result(rank_pool, 2)  # MEAN tables column-wise and table-column-wise, a SUM table table-wise
    divergence = result.divergence
    assert result.status == "fail"
    assert (divergence["stage"], divergence["what"], divergence["step"], divergence["table"]) == (
        "forward", "embedding output", 0, "t0")
    assert "pooling=MEAN" in divergence["traits"] and not any(t.startswith("sharding=") for t in divergence["traits"])
    assert "first divergence: step 0, forward: embedding output of module 'EmbeddingBagCollection', table 't0'" in result.message


@pytest.mark.world_size(2)
def test_a_crash_inside_torchrec_is_located_at_its_innermost_torchrec_frame(rank_pool):
    with plants.applied(["row-wise-bucketize-block-off-by-one"]):
        result = sharding_result(rank_pool, 5)  # ids routed to the wrong rank fall outside its shard
    divergence = result.divergence
    assert (result.status, divergence["stage"], divergence["what"]) == ("fail", "crash", "RuntimeError")
    assert divergence["module"].startswith(("torchrec.", "fbgemm_gpu.")), divergence
