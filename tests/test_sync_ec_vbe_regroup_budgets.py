"""Single-process sync budgets of the EmbeddingCollection, variable-batch KJTs and KeyedTensor.regroup.

Exact counts and call sites of every budget are asserted in test_sync_budgets.py; these tests pin
what each budget rests on: the regions do the work they claim (outputs checked against hand
computations), the differences between budgets, and the features detected.
"""

from __future__ import annotations

import pytest
import torch

from paritykit.checks.sync.budget import measure
from paritykit.checks.sync.budgets import BUDGETS_BY_NAME as BY_NAME
from paritykit.checks.sync.inputs import device_kjt, host_jts, make_ec
from paritykit.checks.sync.regroup_budgets import GROUPS_EACH_KEY_ONCE, GROUPS_KEY_TWICE, device_keyed_tensors
from paritykit.checks.sync.vbe_budgets import VBE_LENGTHS, VBE_PERMUTE, VBE_STRIDES, vbe_device_kjt, vbe_host_jts
from paritykit.errors import UnsupportedByTorchrec
from paritykit.sync import count_syncs

CPU = torch.device("cpu")


# --- EmbeddingCollection eager -----------------------------------------------------------------


@pytest.mark.parametrize("metadata", ["kjt_from_host_jts_moved", "kjt_without_metadata"])
def test_need_indices_changes_no_ec_forward_count_or_site(metadata):
    plain = measure(BY_NAME[f"ec_forward.{metadata}"], "cpu")
    with_indices = measure(BY_NAME[f"ec_forward.{metadata}.need_indices"], "cpu")
    assert (plain.total, plain.by_site) == (with_indices.total, with_indices.by_site)


@pytest.mark.parametrize("need_indices", [False, True])
def test_ec_forward_region_looks_up_every_id_and_returns_indices_only_when_asked(need_indices):
    # The region the budgets count does the whole forward: each feature's rows are its ids' rows.
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    ec = make_ec(CPU, need_indices)
    out = ec(KeyedJaggedTensor.from_jt_dict(host_jts()))
    for key, jt in host_jts().items():
        table = ec.embeddings[f"t_{key}"].weight
        assert torch.equal(out[key].values(), table[jt.values()].float())
        assert out[key].lengths().tolist() == jt.lengths().tolist()
        assert (out[key].weights_or_none() is not None) is need_indices


def test_ec_forward_without_metadata_reads_length_per_key_once_with_a_tolist():
    record = measure(BY_NAME["ec_forward.kjt_without_metadata"], "cpu")
    assert record.by_kind == {"tolist": 1}
    (site,) = record.by_site
    assert site.startswith("torchrec/sparse/jagged_tensor.py:") and site.endswith(" in _maybe_compute_length_per_key")


def test_torchrec_td_into_ec_syncs_once_where_paritykit_td_to_kjt_does_not():
    torchrec_path = measure(BY_NAME["ec_td_path.torchrec_maybe_td_to_kjt"], "cpu")
    paritykit_path = measure(BY_NAME["ec_td_path.paritykit_td_to_kjt"], "cpu")
    assert (torchrec_path.total, paritykit_path.total) == (1, 0)
    assert torchrec_path.by_kind == {"tolist": 1}


def test_ec_forward_of_a_device_kjt_made_with_metadata_by_sync_reads_nothing():
    # Metadata is what matters, not where it came from: sync() before the region pays the read.
    ec = make_ec(CPU)
    kjt = device_kjt(CPU, synced=True)
    with count_syncs(backend="cpu") as record:
        ec(kjt)
    assert record.total == 0


# --- variable-batch KJT ------------------------------------------------------------------------


def test_vbe_input_has_one_batch_size_per_key():
    kjt = vbe_device_kjt(CPU, synced=False)
    assert kjt.variable_stride_per_key()
    assert kjt.stride_per_key() == list(VBE_STRIDES)
    assert kjt.stride_per_key_per_rank() == [[s] for s in VBE_STRIDES]


def test_vbe_length_per_key_is_each_keys_length_sum_read_in_one_tolist():
    kjt = vbe_device_kjt(CPU, synced=False)
    with count_syncs(backend="cpu") as record:
        length_per_key = kjt.length_per_key()
    assert length_per_key == [sum(lens) for lens in VBE_LENGTHS] == [2, 4, 4]
    assert record.by_kind == {"tolist": 1}


def test_vbe_stride_reads_are_host_reads_and_count_only_if_the_strides_were_device_data():
    # torchrec keeps stride_per_key_per_rank on the host: stride() and stride_per_key() read it.
    kjt = vbe_device_kjt(CPU, synced=False)
    with count_syncs(backend="cpu") as host_strides:
        kjt.stride(), kjt.stride_per_key()
    # Negative control: the same reads of a strides tensor standing for device data are 2 syncs.
    control = vbe_device_kjt(CPU, synced=False)
    control._stride_per_key_per_rank = control._stride_per_key_per_rank.as_subclass(torch.Tensor)
    with count_syncs(backend="cpu") as device_strides:
        control.stride(), control.stride_per_key()
    assert (host_strides.total, device_strides.total) == (0, 2)
    assert device_strides.by_kind == {"item": 1, "tolist": 1}


def test_vbe_permute_moves_each_keys_values_with_its_lengths():
    kjt = vbe_device_kjt(CPU, synced=True)
    permuted = kjt.permute(VBE_PERMUTE)
    values_per_key = kjt.to_dict()
    assert permuted.keys() == [kjt.keys()[i] for i in VBE_PERMUTE]
    assert permuted.stride_per_key() == [VBE_STRIDES[i] for i in VBE_PERMUTE]
    for key, jt in permuted.to_dict().items():
        assert torch.equal(jt.values(), values_per_key[key].values())
        assert torch.equal(jt.lengths(), values_per_key[key].lengths())


def test_vbe_permute_budget_counts_the_device_kernel_syncs_only_on_cuda():
    # keyed_jagged_index_select_dim1 without selected_lengths_sum reads its output size in C++ on
    # CUDA, for the lengths and for the values; the CPU path has no such read to see.
    for name, cpu_count in (("vbe_kjt.permute.with_metadata", 1), ("vbe_kjt.permute.without_metadata", 2)):
        budget = BY_NAME[name]
        assert (budget.budget_on("cpu"), budget.budget_on("cuda")) == (cpu_count, cpu_count + 2)
        assert budget.sites_on("cuda") - budget.sites_on("cpu") == {"_permute_tensor_by_segments"}


def test_vbe_kjt_from_host_jts_is_variable_batch_and_keeps_its_metadata_through_the_move():
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    with count_syncs(backend="cpu") as record:
        moved = KeyedJaggedTensor.from_jt_dict(vbe_host_jts()).to(CPU, non_blocking=True)
        jt_dict = moved.to_dict()
    assert record.total == 0
    assert moved.variable_stride_per_key() and moved.stride_per_key() == list(VBE_STRIDES)
    assert [jt.lengths().tolist() for jt in jt_dict.values()] == [list(lens) for lens in VBE_LENGTHS]


# --- KeyedTensor.regroup -----------------------------------------------------------------------


def _columns(kts, key):
    for kt in kts:
        if key in kt.keys():
            return kt.to_dict()[key]
    raise KeyError(key)


@pytest.mark.parametrize("groups", [GROUPS_EACH_KEY_ONCE, GROUPS_KEY_TWICE], ids=["each_key_once", "key_used_twice"])
def test_regroup_region_concatenates_each_groups_columns(groups):
    from torchrec.sparse.jagged_tensor import KeyedTensor

    kts = device_keyed_tensors(CPU)
    regrouped = KeyedTensor.regroup(kts, groups)
    expected = [torch.cat([_columns(kts, key) for key in group], dim=1) for group in groups]
    assert len(regrouped) == len(expected)
    for got, want in zip(regrouped, expected):
        assert torch.equal(got, want)


def test_regroup_as_dict_budget_runs_exactly_where_torchrec_has_it():
    from torchrec.sparse.jagged_tensor import KeyedTensor

    budget = BY_NAME["kt.regroup_as_dict"]
    if hasattr(KeyedTensor, "regroup_as_dict"):
        assert measure(budget, "cpu").total == 0
    else:
        with pytest.raises(UnsupportedByTorchrec, match="regroup_as_dict"):
            measure(budget, "cpu")



# --- features missing from a torchrec (simulated by deleting them for the test) -----------------


def test_regroup_as_dict_case_is_unsupported_on_a_torchrec_without_it_simulated_by_deleting_it(monkeypatch):
    from torchrec.sparse.jagged_tensor import KeyedTensor

    from paritykit.checks.runner import GateConfig
    from paritykit.checks.sync.matrix import run_budget

    monkeypatch.delattr(KeyedTensor, "regroup_as_dict")
    result = run_budget(BY_NAME["kt.regroup_as_dict"], GateConfig(device="cpu"))
    assert result.status == "unsupported"
    assert "has no regroup_as_dict" in result.message


def test_td_input_cases_are_unsupported_on_a_torchrec_without_td_input_simulated_by_deleting_it(monkeypatch):
    import torchrec.sparse.tensor_dict as tensor_dict

    from paritykit.checks.runner import GateConfig
    from paritykit.checks.sync.budgets import DIST_BUDGETS_BY_NAME
    from paritykit.checks.sync.matrix import run_budget, run_dist_budget

    monkeypatch.delattr(tensor_dict, "maybe_td_to_kjt")
    config = GateConfig(device="cpu")
    eager = run_budget(BY_NAME["ec_td_path.torchrec_maybe_td_to_kjt"], config)
    # Decided in the caller before any rank runs: no pool is needed to report it.
    sharded = run_dist_budget(DIST_BUDGETS_BY_NAME["ec_input_dist.ws2.row_wise.torchrec_td"], config, pool=None)
    assert (eager.status, sharded.status) == ("unsupported", "unsupported")
    assert "EmbeddingCollection.forward" in eager.message
    assert "ShardedEmbeddingCollection.input_dist" in sharded.message
    # paritykit's own conversion does not depend on torchrec's.
    assert run_budget(BY_NAME["ec_td_path.paritykit_td_to_kjt"], config).status == "pass"
