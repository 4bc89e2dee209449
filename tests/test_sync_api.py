"""paritykit.sync's public API: records, budgets, decorator use, nesting, bad input, clean exit."""

from __future__ import annotations

import pytest
import torch

import paritykit
import paritykit.sync.cpu as sync_cpu
from paritykit.errors import HarnessError, ParityError
from paritykit.sync import SyncRecord, count_syncs, resolve_backend, sync_guard


def _read_twice_and_unique(x: torch.Tensor) -> None:
    x.tolist()
    x.sum().item()
    torch.unique(x)


def test_record_counts_total_kinds_and_sites_of_the_block():
    x = torch.arange(6)
    with count_syncs(backend="cpu") as rec:
        _read_twice_and_unique(x)
    assert isinstance(rec, SyncRecord)
    assert rec.backend == "cpu"
    assert rec.total == 3
    assert rec.by_kind == {"data-dependent": 1, "item": 1, "tolist": 1}
    # Each read has its own line in _read_twice_and_unique.
    assert len(rec.by_site) == 3
    assert all("test_sync_api.py" in site and "_read_twice_and_unique" in site for site in rec.by_site)


def test_record_names_the_caller_line_of_each_sync():
    x = torch.arange(3)
    with count_syncs(backend="cpu") as rec:
        x.tolist()
        expected_line = _current_line() - 1
    (site,) = rec.by_site
    assert site.endswith(f"test_sync_api.py:{expected_line} in test_record_names_the_caller_line_of_each_sync")


def _current_line() -> int:
    import sys

    return sys._getframe(1).f_lineno


def test_stacks_are_recorded_on_demand_only():
    x = torch.arange(3)
    with count_syncs(backend="cpu", stacks=True) as rec:
        x.tolist()
    (stack,) = rec.stacks()
    assert any("test_stacks_are_recorded_on_demand_only" in line for line in stack)
    with count_syncs(backend="cpu") as rec:
        x.tolist()
    with pytest.raises(HarnessError, match="stacks=True"):
        rec.stacks()


def test_guard_within_budget_passes_and_over_budget_names_the_call_site():
    x = torch.arange(4)
    with sync_guard(max_syncs=1, backend="cpu"):
        x.tolist()
    with pytest.raises(ParityError) as info:
        with sync_guard(max_syncs=1, backend="cpu"):
            x.tolist()
            x[0].item()
    message = str(info.value)
    assert "2 synchronization(s), budget 1" in message
    assert "tolist" in message and "item" in message
    assert "test_sync_api.py" in message and "test_guard_within_budget_passes_and_over_budget" in message


def test_guard_is_a_decorator_counting_each_call_on_its_own():
    calls = []

    @sync_guard(max_syncs=1, backend="cpu")
    def read_once(x):
        calls.append(1)
        return x.tolist()

    assert read_once(torch.arange(2)) == [0, 1]
    assert read_once(torch.arange(3)) == [0, 1, 2]  # a second call starts from zero
    assert len(calls) == 2

    @sync_guard(max_syncs=0, backend="cpu")
    def read(x):
        return x.tolist()

    with pytest.raises(ParityError, match="budget 0"):
        read(torch.arange(2))


def test_exception_from_the_block_wins_over_the_budget():
    with pytest.raises(KeyError):
        with sync_guard(max_syncs=0, backend="cpu"):
            torch.arange(2).tolist()
            raise KeyError("from the block")


def test_nested_blocks_outer_counts_inner_syncs():
    x = torch.arange(3)
    with count_syncs(backend="cpu") as outer:
        x.tolist()
        with count_syncs(backend="cpu") as inner:
            x[0].item()
    assert (outer.total, inner.total) == (2, 1)


def test_hooks_are_removed_on_exit_so_an_unguarded_run_costs_nothing():
    names = [name for owner, name, _ in sync_cpu._patches() if owner is torch.Tensor]
    before = {name: torch.Tensor.__dict__.get(name) for name in names}
    torch_before = torch.tensor, torch.nonzero, torch.unique
    with count_syncs(backend="cpu"):
        assert sync_cpu.installed()
        assert torch.tensor is not torch_before[0]
    assert not sync_cpu.installed()
    assert {name: torch.Tensor.__dict__.get(name) for name in names} == before
    assert (torch.tensor, torch.nonzero, torch.unique) == torch_before
    # Outside any block nothing is recorded anywhere.
    with count_syncs(backend="cpu") as rec:
        pass
    torch.arange(3).tolist()
    assert rec.total == 0


def test_hooks_are_removed_when_the_block_raises():
    with pytest.raises(RuntimeError):
        with count_syncs(backend="cpu"):
            raise RuntimeError("boom")
    assert not sync_cpu.installed()


@pytest.mark.parametrize("bad", [-1, 1.5, True, "0", None])
def test_bad_budget_is_rejected_with_a_clear_error(bad):
    with pytest.raises(ValueError, match="max_syncs must be a non-negative int"):
        sync_guard(max_syncs=bad)


def test_bad_backend_is_rejected_with_a_clear_error():
    with pytest.raises(ValueError, match="sync backend must be one of"):
        count_syncs(backend="gpu")
    with pytest.raises(ValueError, match="sync backend must be one of"):
        sync_guard(backend="tpu")


def test_auto_backend_is_cuda_exactly_when_cuda_is_available():
    assert resolve_backend("auto") == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on machines without CUDA")
def test_cuda_backend_without_cuda_is_a_harness_error():
    with pytest.raises(HarnessError, match="needs a CUDA device"):
        with count_syncs(backend="cuda"):
            pass


def test_public_api_is_exported_from_the_package():
    assert paritykit.sync_guard is sync_guard
    assert paritykit.count_syncs is count_syncs
