"""Sync budgets of TorchRec hot paths (one test each), the `sync` check, and its negative control."""

from __future__ import annotations

import pytest
import torch

from paritykit.harness import plants
from paritykit.checks import load_check
from paritykit.checks.runner import GateConfig
from paritykit.checks.sync.budget import measure
from paritykit.checks.sync.budgets import BUDGETS, BUDGETS_BY_NAME as BY_NAME
from paritykit.checks.sync.inputs import backend_for
from paritykit.checks.sync.matrix import run_budget
from paritykit.errors import ParityError, UnsupportedByTorchrec
from paritykit.sync import sync_guard


@pytest.mark.parametrize("budget", BUDGETS, ids=[b.name for b in BUDGETS])
def test_hot_path_makes_exactly_its_budgeted_syncs_at_the_named_torchrec_sites(budget, paritykit_device):
    backend = backend_for(paritykit_device)
    try:
        record = measure(budget, paritykit_device)
    except UnsupportedByTorchrec as exc:
        pytest.skip(f"not offered by this torchrec: {exc}")
    # Exact, not "at most": a change in either torchrec or the proxy shows up here.
    assert record.total == budget.budget_on(backend), record.describe()
    functions = {site.rsplit(" in ", 1)[1] for site in record.by_site}
    assert functions == budget.sites_on(backend)
    assert all(site.startswith("torchrec") for site in record.by_site)


def test_metadata_free_kjt_in_ebc_forward_counts_the_tolist_of_length_per_key():
    record = measure(BY_NAME["ebc_forward.kjt_without_metadata"], "cpu")
    assert record.by_kind == {"tolist": 1}
    (event,) = record.events
    assert event.site.startswith("torchrec/sparse/jagged_tensor.py:")
    assert event.site.endswith(" in _maybe_compute_length_per_key")
    assert event.torchrec_site == event.site


def test_torchrec_td_path_syncs_where_paritykit_td_to_kjt_does_not():
    torchrec_path = measure(BY_NAME["td_path.torchrec_maybe_td_to_kjt"], "cpu")
    paritykit_path = measure(BY_NAME["td_path.paritykit_td_to_kjt"], "cpu")
    assert (torchrec_path.total, paritykit_path.total) == (1, 0)


def test_planted_tolist_in_ebc_forward_is_caught_with_its_call_site():
    budget = BY_NAME["ebc_forward.kjt_from_host_jts_moved"]
    region = budget.prepare(torch.device("cpu"))
    with plants.applied(["tolist-in-ebc-forward"]):
        with pytest.raises(ParityError) as info:
            with sync_guard(max_syncs=0, backend="cpu"):
                region()
    message = str(info.value)
    assert "1 synchronization(s), budget 0" in message
    assert "tolist at paritykit/checks/sync/plants.py:" in message
    assert "in forward_with_planted_tolist" in message
    # The plant is gone after the block: the same region is clean again.
    with sync_guard(max_syncs=0, backend="cpu"):
        region()


def test_sync_check_passes_every_budget_on_cpu():
    check = load_check("sync")
    results = check.run(GateConfig(device="cpu"), None)
    assert [r.case_id for r in results] == [b.name for b in BUDGETS]
    # Every feature the corpus exercises exists on the supported stacks: all pass, none skipped.
    assert {r.case_id: r.status for r in results} == {b.name: "pass" for b in BUDGETS}
    metrics = {r.case_id: r.metrics for r in results}
    assert metrics["kjt.to_device_blocking"]["syncs"] == 2
    vbe_permute = metrics["vbe_kjt.permute.without_metadata"]
    assert (vbe_permute["syncs"], vbe_permute["budget"]) == (2, 2)
    assert vbe_permute["by_kind"] == {"h2d-copy": 1, "tolist": 1}


def test_sync_check_fails_the_zero_budget_forward_under_the_planted_tolist():
    config = GateConfig(device="cpu")
    with plants.applied(["tolist-in-ebc-forward"]):
        result = run_budget(BY_NAME["ebc_forward.kjt_from_host_jts_moved"], config)
    assert result.status == "fail"
    assert "forward_with_planted_tolist" in result.message
    assert "--check sync" in result.replay and "ebc_forward.kjt_from_host_jts_moved" in result.replay


def test_sync_check_rejects_an_unknown_device():
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        measure(BUDGETS[0], "tpu")
