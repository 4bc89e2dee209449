"""The sync check's planted bugs in the EC, VBE and regroup paths.

For each plant: first that it changes torchrec's syncs (counted with count_syncs directly) and not
its numbers, then that the `sync` check fails the budgets it should (and passes the others), then
that the self-test finds it caught.
"""

from __future__ import annotations

import pytest
import torch

from paritykit.checks.runner import GateConfig
from paritykit.checks.sync.budgets import BUDGETS_BY_NAME, DIST_BUDGETS, DIST_BUDGETS_BY_NAME
from paritykit.checks.sync.dist_budget import measure_dist
from paritykit.checks.sync.inputs import host_jts, make_ec
from paritykit.checks.sync.matrix import run_budget, run_dist_budget
from paritykit.checks.sync.regroup_budgets import GROUPS_EACH_KEY_ONCE, GROUPS_KEY_TWICE, device_keyed_tensors
from paritykit.checks.sync.vbe_budgets import vbe_device_kjt
from paritykit.gate.selftest import run_plant
from paritykit.harness import plants
from paritykit.sync import count_syncs

CPU = torch.device("cpu")
CONFIG = GateConfig(device="cpu")
NEW_PLANTS = (
    "ec-forward-id-bounds-check",
    "ec-output-dist-drops-length-metadata",
    "vbe-length-per-key-read-per-key",
    "pin-and-move-blocks",
)


def _counted(plant, fn):
    """(result, SyncRecord) of fn(), with the plant applied when one is named."""
    with plants.applied([plant] if plant else []):
        with count_syncs(backend="cpu") as record:
            out = fn()
    return out, record


def _jt_dicts_equal(a, b) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].values(), b[k].values()) and torch.equal(a[k].lengths(), b[k].lengths()) for k in a
    )


# --- ec-forward-id-bounds-check ----------------------------------------------------------------


def test_ec_bounds_check_plant_adds_one_scalar_read_per_feature_and_no_numeric_change():
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    ec = make_ec(CPU)
    kjt = KeyedJaggedTensor.from_jt_dict(host_jts()).to(CPU, non_blocking=True)
    clean, clean_record = _counted(None, lambda: ec(kjt))
    planted, planted_record = _counted("ec-forward-id-bounds-check", lambda: ec(kjt))
    assert (clean_record.total, planted_record.by_kind) == (0, {"scalar": 3})
    assert _jt_dicts_equal(clean, planted)


def test_sync_check_fails_the_eager_ec_budgets_under_the_bounds_check_plant():
    with plants.applied(["ec-forward-id-bounds-check"]):
        moved = run_budget(BUDGETS_BY_NAME["ec_forward.kjt_from_host_jts_moved"], CONFIG)
        unsynced = run_budget(BUDGETS_BY_NAME["ec_forward.kjt_without_metadata"], CONFIG)
        ebc = run_budget(BUDGETS_BY_NAME["ebc_forward.kjt_from_host_jts_moved"], CONFIG)
    assert (moved.status, unsynced.status, ebc.status) == ("fail", "fail", "pass")
    assert "3 synchronization(s), budget 0" in moved.message
    assert "4 synchronization(s), budget 1" in unsynced.message
    assert "in forward_with_planted_bounds_check" in moved.message


# --- ec-output-dist-drops-length-metadata ------------------------------------------------------


def test_output_dist_plant_adds_one_read_to_each_sharded_ec_forward_and_none_to_input_dist(rank_pool):
    for name, extra in (("ec_forward.ws2.row_wise.kjt_moved_with_metadata", 1), ("ec_input_dist.ws2.row_wise.kjt_moved_with_metadata", 0)):
        budget = DIST_BUDGETS_BY_NAME[name]
        clean, clean_raw = measure_dist(budget, rank_pool)
        with plants.applied(["ec-output-dist-drops-length-metadata"]):
            planted, planted_raw = measure_dist(budget, rank_pool)
        assert [r[0].total - c[0].total for r, c in zip(planted, clean)] == [extra, extra]
        if extra:
            assert [r["output_rows"] for r in planted_raw] == [r["output_rows"] for r in clean_raw]
            assert all(r[0].by_kind["tolist"] - c[0].by_kind["tolist"] == 1 for r, c in zip(planted, clean))


def test_sync_check_fails_exactly_the_sharded_ec_forward_budgets_under_the_output_dist_plant(rank_pool):
    with plants.applied(["ec-output-dist-drops-length-metadata"]):
        results = {b.name: run_dist_budget(b, CONFIG, rank_pool) for b in DIST_BUDGETS if b.kind in ("input_dist", "forward")}
    failed = {name for name, result in results.items() if result.status == "fail"}
    assert failed == {name for name in results if name.startswith("ec_forward.")}
    assert all(results[name].status == "pass" for name in results if name not in failed)
    message = results["ec_forward.ws2.table_wise.kjt_moved_with_metadata"].message
    assert "8 synchronization(s), budget 7" in message and "on rank 0" in message and "on rank 1" in message


# --- vbe-length-per-key-read-per-key -----------------------------------------------------------


def test_vbe_per_key_read_plant_makes_three_reads_of_the_same_lengths():
    kjts = [vbe_device_kjt(CPU, synced=False) for _ in range(2)]
    clean, clean_record = _counted(None, kjts[0].length_per_key)
    planted, planted_record = _counted("vbe-length-per-key-read-per-key", kjts[1].length_per_key)
    assert clean == planted == [2, 4, 4]
    assert (clean_record.by_kind, planted_record.by_kind) == ({"tolist": 1}, {"scalar": 3})


def test_sync_check_fails_the_vbe_budgets_without_metadata_under_the_per_key_read_plant():
    names = [n for n in BUDGETS_BY_NAME if n.startswith("vbe_kjt.")]
    with plants.applied(["vbe-length-per-key-read-per-key"]):
        results = {n: run_budget(BUDGETS_BY_NAME[n], CONFIG) for n in names}
    assert {n for n, r in results.items() if r.status == "fail"} == {n for n in names if n.endswith("without_metadata")}
    assert "3 synchronization(s), budget 1" in results["vbe_kjt.to_dict.without_metadata"].message
    assert "in length_per_key_one_read_per_key" in results["vbe_kjt.to_dict.without_metadata"].message


# --- pin-and-move-blocks -----------------------------------------------------------------------


def test_blocking_pin_and_move_plant_adds_four_copies_to_the_fast_regroup_path_only():
    from torchrec.sparse.jagged_tensor import KeyedTensor

    kts = device_keyed_tensors(CPU)
    for groups, copies in ((GROUPS_EACH_KEY_ONCE, 4), (GROUPS_KEY_TWICE, 0)):
        clean, clean_record = _counted(None, lambda: KeyedTensor.regroup(kts, groups))
        planted, planted_record = _counted("pin-and-move-blocks", lambda: KeyedTensor.regroup(kts, groups))
        assert (clean_record.total, planted_record.total) == (0, copies)
        assert all(torch.equal(a, b) for a, b in zip(clean, planted))
    assert planted_record.by_kind == {}


def test_sync_check_fails_the_regroup_and_vbe_permute_budgets_under_the_blocking_move_plant():
    names = ["kt.regroup.each_key_once", "kt.regroup.key_used_twice", "kt.regroup_as_dict", "vbe_kjt.permute.with_metadata"]
    with plants.applied(["pin-and-move-blocks"]):
        results = {n: run_budget(BUDGETS_BY_NAME[n], CONFIG) for n in names}
    assert {n: r.status for n, r in results.items()} == {
        "kt.regroup.each_key_once": "fail",
        "kt.regroup.key_used_twice": "pass",
        "kt.regroup_as_dict": "fail",
        "vbe_kjt.permute.with_metadata": "fail",
    }
    assert "4 synchronization(s), budget 0" in results["kt.regroup.each_key_once"].message
    assert "h2d-copy: 4" in results["kt.regroup.each_key_once"].message
    assert "in move_blocking" in results["kt.regroup.each_key_once"].message


# --- the self-test ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", NEW_PLANTS)
def test_self_test_catches_each_new_plant_with_the_sync_check(name, rank_pools):
    outcome = run_plant(name, CONFIG, rank_pools)
    assert (outcome.check, outcome.verdict) == ("sync", "caught"), outcome.evidence
