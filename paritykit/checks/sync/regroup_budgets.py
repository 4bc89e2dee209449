"""Budgets of ``KeyedTensor.regroup`` and ``KeyedTensor.regroup_as_dict`` (where torchrec has it).

Regrouping pooled embeddings (the KeyedTensors of several EBCs) into the groups a model's
interaction layer reads needs no device data: every size is a KeyedTensor's ``length_per_key``,
a Python list. In torchrec/sparse/jagged_tensor.py:

* ``regroup`` with every key used exactly once (``_all_keys_used_once``) takes
  ``_fbgemm_permute_pooled_embs``: ``_remap_to_groups`` builds the permute, inverse-permute and
  offset tensors on the host from those lists, ``_pin_and_move`` moves each (pinned,
  ``non_blocking=True``: no sync), and ``fbgemm.permute_pooled_embs_auto_grad`` permutes the
  concatenated values, sized by the input (no output size to read): 0.
* ``regroup`` with a key used twice (or left out) takes ``_regroup_keyed_tensors``: ``to_dict``
  splits each KeyedTensor's values by length_per_key, one ``torch.cat`` and a split by the
  groups' summed lengths: 0.
* ``regroup_as_dict`` is ``regroup`` and a dict of the results: 0.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from paritykit.checks.sync.budget import SyncBudget
from paritykit.checks.sync.features import require_regroup_as_dict

BATCH = 4
# Two KeyedTensors, as two EBCs give them: keys and each key's embedding dimension.
KT_LAYOUT = ((("a", 2), ("b", 3)), (("c", 4),))
GROUPS_EACH_KEY_ONCE = [["c", "a"], ["b"]]
GROUPS_KEY_TWICE = [["c", "a"], ["b", "a"]]
GROUP_NAMES = ["sparse_c_a", "sparse_b"]


def device_keyed_tensors(device: torch.device) -> list[Any]:
    """The KeyedTensors, their values made on the device (as an EBC's output is)."""
    from torchrec.sparse.jagged_tensor import KeyedTensor

    generator = torch.Generator().manual_seed(0)
    kts = []
    for layout in KT_LAYOUT:
        dims = [dim for _key, dim in layout]
        values = torch.randn(BATCH, sum(dims), generator=generator).to(device)
        kts.append(KeyedTensor(keys=[key for key, _dim in layout], length_per_key=dims, values=values))
    return kts


def _regroup(groups: list[list[str]]) -> Callable[[torch.device], Callable[[], Any]]:
    def prepare(device: torch.device) -> Callable[[], Any]:
        from torchrec.sparse.jagged_tensor import KeyedTensor

        kts = device_keyed_tensors(device)
        return lambda: KeyedTensor.regroup(kts, groups)

    return prepare


def _regroup_as_dict(device: torch.device) -> Callable[[], Any]:
    require_regroup_as_dict()
    from torchrec.sparse.jagged_tensor import KeyedTensor

    kts = device_keyed_tensors(device)
    return lambda: KeyedTensor.regroup_as_dict(kts, GROUPS_EACH_KEY_ONCE, GROUP_NAMES)


REGROUP_BUDGETS: tuple[SyncBudget, ...] = (
    SyncBudget("kt.regroup.each_key_once", 0, _regroup(GROUPS_EACH_KEY_ONCE)),
    SyncBudget("kt.regroup.key_used_twice", 0, _regroup(GROUPS_KEY_TWICE)),
    SyncBudget("kt.regroup_as_dict", 0, _regroup_as_dict),
)
