"""The CUDA backend (CUDA-only: skipped with that reason on machines without a GPU)."""

from __future__ import annotations

import warnings

import pytest
import torch

from paritykit.sync import count_syncs, sync_guard
from paritykit.sync.cuda import SYNC_WARNING, profiler_sync_count

pytestmark = pytest.mark.gpu


def _reads(x: torch.Tensor) -> None:
    for _ in range(3):  # a loop: Python would show a deduped warning once
        x.sum().item()


def test_every_sync_in_a_loop_is_counted_not_deduplicated():
    x = torch.arange(8, device="cuda")
    with count_syncs(backend="cuda") as rec:
        _reads(x)
    assert rec.total == 3
    assert rec.by_kind == {"item": 3}


def test_debug_mode_and_warning_filters_are_restored():
    torch.cuda.set_sync_debug_mode("error")
    filters_before = list(warnings.filters)
    show_before = warnings.showwarning
    try:
        with count_syncs(backend="cuda"):
            torch.arange(3, device="cuda").tolist()
        assert torch.cuda.get_sync_debug_mode() == 2
        assert warnings.filters == filters_before
        assert warnings.showwarning is show_before
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_other_warnings_still_reach_the_previous_hook():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with count_syncs(backend="cuda") as rec:
            warnings.warn("unrelated", UserWarning)
            torch.arange(3, device="cuda").tolist()
    assert rec.total == 1
    assert [str(w.message) for w in seen] == ["unrelated"]
    assert not any(SYNC_WARNING in str(w.message) for w in seen)


def test_guard_over_budget_names_the_site_on_cuda():
    from paritykit.errors import ParityError

    x = torch.arange(4, device="cuda")
    with pytest.raises(ParityError, match="test_sync_cuda.py"):
        with sync_guard(max_syncs=0, backend="cuda"):
            torch.nonzero(x)


@pytest.mark.parametrize(
    "op",
    [
        lambda x: x.sum().item(),
        lambda x: x.tolist(),
        lambda x: x.cpu(),
        lambda x: torch.nonzero(x),
        lambda x: x[x > 1],
        lambda x: torch.unique(x),
        lambda x: bool(x[0]),
    ],
)
def test_cuda_count_matches_profiler_sync_events_and_cpu_proxy(op):
    x = torch.arange(6, device="cuda")
    # Copied outside any block: a plain CPU tensor stands for device data in the proxy (a .cpu()
    # inside the block would be counted itself and leave a host tensor that reads nothing).
    on_cpu = x.cpu()
    with count_syncs(backend="cuda") as cuda_rec:
        op(x)
    assert cuda_rec.total == profiler_sync_count(lambda: op(x))
    with count_syncs(backend="cpu") as proxy_rec:
        op(on_cpu)
    assert proxy_rec.total == cuda_rec.total


def test_torchrec_safe_tolist_counts_one_sync_named_tolist_on_both_backends():
    # _safe_tolist copies with non_blocking=True, then synchronizes the stream: one sync, which the
    # CUDA backend names after the caller's .tolist() (as the CPU proxy does), not a stream sync.
    from torchrec.sparse.jagged_tensor import _safe_tolist

    x = torch.arange(6, device="cuda")
    on_cpu = x.cpu()  # outside any block: stands for device data in the proxy
    with count_syncs(backend="cuda") as cuda_rec:
        _safe_tolist(x)
    with count_syncs(backend="cpu") as proxy_rec:
        _safe_tolist(on_cpu)
    assert cuda_rec.by_kind == proxy_rec.by_kind == {"tolist": 1}


def test_vbe_permute_kernel_syncs_are_counted_and_classified_data_dependent_on_cuda():
    from paritykit.checks.sync.budget import measure
    from paritykit.checks.sync.budgets import BUDGETS_BY_NAME

    record = measure(BUDGETS_BY_NAME["vbe_kjt.permute.with_metadata"], "cuda")
    assert record.by_kind == {"data-dependent": 2, "h2d-copy": 1}
