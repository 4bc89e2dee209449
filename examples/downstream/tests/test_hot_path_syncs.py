"""Our serving path must not stall the GPU: zero device->host syncs per forward."""

import pytest
import torch
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

import paritykit
from recsys_model import RankingModel

MODEL = RankingModel(seed=1)


def host_batch():
    # Prepared on the host, as a data loader would: lengths known in Python, metadata from them.
    history = JaggedTensor(values=torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([3, 1]))
    tags = JaggedTensor(values=torch.tensor([5, 6]), lengths=torch.tensor([0, 2]))
    ads = JaggedTensor(values=torch.tensor([7, 8]), lengths=torch.tensor([1, 1]))
    return paritykit.on_host({"user_history": history, "item_tags": tags, "ad_id": ads})


def test_forward_on_a_batch_prepared_on_the_host_makes_no_sync(paritykit_device):
    jts = host_batch()
    with paritykit.sync_guard(max_syncs=0):
        kjt = KeyedJaggedTensor.from_jt_dict(jts).to(paritykit_device, non_blocking=True)
        MODEL.to(paritykit_device)(kjt)


def test_a_kjt_without_metadata_costs_one_sync_and_the_guard_names_it(paritykit_device):
    kjt = KeyedJaggedTensor(
        keys=["user_history", "item_tags", "ad_id"],
        values=torch.tensor([1, 2, 3, 4, 5, 6, 7, 8], device=paritykit_device),
        lengths=torch.tensor([3, 1, 0, 2, 1, 1], device=paritykit_device),
    )
    with pytest.raises(paritykit.ParityError, match="_maybe_compute_length_per_key"):
        with paritykit.sync_guard(max_syncs=0):
            MODEL.to(paritykit_device)(kjt)
