"""Sync budgets of the sparse ops that the ``sync`` check does not budget.

The ``sync`` check keeps its budgets of KJT construction, ``length_per_key``, ``permute``,
``split``, ``to_dict``, ``to``, the VBE ``permute``/``split``/``to_dict`` and ``KeyedTensor.regroup``
/ ``regroup_as_dict`` (paritykit/checks/sync/kjt_budgets.py, vbe_budgets.py, regroup_budgets.py);
these are the rest. Each count comes from torchrec/sparse/jagged_tensor.py (and
torchrec/modules/regroup.py):

* Without length_per_key a KJT computes it with one ``_safe_tolist`` of the per-key sums of its
  lengths (``_maybe_compute_length_per_key``; VBE: ``_length_per_key_from_stride_per_key``): 1 for
  ``from_offsets_sync``, ``from_jt_dict`` of device JaggedTensors, ``offset_per_key``,
  ``__getitem__``, ``flatten_lengths``, ``dist_splits`` and ``dist_init`` (its ``sync()``); 0 with it.
* ``dist_init`` of a VBE batch also copies the received strides and their cumulative sum to the
  host (two ``.cpu()``, d2h copies) to build stride_per_key_per_rank.
* ``JaggedTensor.to_padded_dense`` without desired_length reads the longest row (``.item()``);
  ``to_dense`` reads two offsets per row (``.item()`` each): 2B for B rows.
* ``JaggedTensor.from_dense`` builds its lengths with ``torch.tensor(list, device=...)``: a blocking
  host->device copy. ``from_dense_lengths`` selects with a boolean mask (``values[mask]``), whose
  output size needs the data: once for the values, once more for weights.
* An op on a KJT that knows its length_per_key hands it on (``concat``, ``flatten_lengths``,
  ``split``, ``to``): its results' ``length_per_key()`` makes 0 syncs. A pytree round trip keeps the
  tensors only, so the rebuilt KJT computes it again: 1.
* Everything else only slices, concatenates or moves tensors whose sizes are host metadata: 0.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from paritykit.checks.sparse_ops.budget import OpBudget
from paritykit.sync import on_host

KEYS = ("f0", "f1", "f2")
BATCH = 4
LENGTHS = ((2, 0, 1, 3), (1, 1, 0, 2), (0, 3, 1, 1))  # per key, one per sample
VBE_STRIDES = ((2, 1), (1, 3), (0, 2))  # per key per rank
VBE_LENGTHS = ((2, 0, 1), (1, 1, 0, 2), (3, 1))
JT_LENGTHS = (2, 0, 3, 1)

PER_KEY = "_maybe_compute_length_per_key"
VBE_PER_KEY = "_length_per_key_from_stride_per_key"


def device_kjt(device: torch.device, metadata: bool, weighted: bool = False) -> Any:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    lengths = [n for lens in LENGTHS for n in lens]
    kjt = KeyedJaggedTensor(
        keys=list(KEYS), values=torch.arange(sum(lengths), device=device), lengths=torch.tensor(lengths, device=device),
        weights=torch.rand(sum(lengths), device=device) if weighted else None, stride=BATCH,
    )
    return kjt.sync() if metadata else kjt


def vbe_kjt(device: torch.device, metadata: bool) -> Any:
    """A VBE KJT of two ranks; its strides are host data, as torchrec keeps them."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    lengths = [n for lens in VBE_LENGTHS for n in lens]
    kjt = KeyedJaggedTensor(
        keys=list(KEYS), values=torch.arange(sum(lengths), device=device), lengths=torch.tensor(lengths, device=device),
        stride_per_key_per_rank=on_host(torch.tensor([list(s) for s in VBE_STRIDES], dtype=torch.int32)),
    )
    return kjt.sync() if metadata else kjt


def device_jt(device: torch.device, weighted: bool = False) -> Any:
    from torchrec.sparse.jagged_tensor import JaggedTensor

    total = sum(JT_LENGTHS)
    return JaggedTensor(values=torch.rand(total, device=device), lengths=torch.tensor(JT_LENGTHS, device=device),
                        weights=torch.rand(total, device=device) if weighted else None)


def _kjt_op(op: Callable[[Any], Any], metadata: bool, vbe: bool = False) -> Callable[[torch.device], Callable[[], Any]]:
    def prepare(device: torch.device) -> Callable[[], Any]:
        kjt = vbe_kjt(device, metadata) if vbe else device_kjt(device, metadata, weighted=True)
        return lambda: op(kjt)

    return prepare


def _jt_op(op: Callable[[Any], Any], weighted: bool = False) -> Callable[[torch.device], Callable[[], Any]]:
    def prepare(device: torch.device) -> Callable[[], Any]:
        jt = device_jt(device, weighted)
        return lambda: op(jt)

    return prepare


def _from_offsets_sync(device: torch.device) -> Callable[[], Any]:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjt = device_kjt(device, metadata=False)
    values, offsets = kjt.values(), kjt.offsets()
    return lambda: KeyedJaggedTensor.from_offsets_sync(keys=list(KEYS), values=values, offsets=offsets)


def _from_device_jts(device: torch.device) -> Callable[[], Any]:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    jts = {key: jt for key, jt in device_kjt(device, metadata=True).to_dict().items()}
    return lambda: KeyedJaggedTensor.from_jt_dict(jts)


def _dense_input(op: Callable[[list, Any, Any], Any]) -> Callable[[torch.device], Callable[[], Any]]:
    """Dense inputs made on the device beforehand: one tensor per row, and a (B, N) tensor with lengths."""

    def prepare(device: torch.device) -> Callable[[], Any]:
        rows = [torch.rand(n, device=device) for n in JT_LENGTHS]
        dense = torch.rand(len(JT_LENGTHS), max(JT_LENGTHS), device=device)
        lengths = torch.tensor(JT_LENGTHS, device=device)
        return lambda: op(rows, dense, lengths)

    return prepare


def _concat(device: torch.device) -> Callable[[], Any]:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjts = [device_kjt(device, metadata=True), device_kjt(device, metadata=False)]
    return lambda: KeyedJaggedTensor.concat(kjts)


def _carried(op: Callable[[Any, Any], Any], vbe: bool = False) -> Callable[[torch.device], Callable[[], Any]]:
    """The op on KJTs that know their length_per_key, then each result's length_per_key(): 0 syncs
    when the op hands the metadata on (the input dist asks every batch's KJT for it)."""
    def prepare(device: torch.device) -> Callable[[], Any]:
        first, second = (vbe_kjt(device, True), vbe_kjt(device, True)) if vbe else (
            device_kjt(device, True, weighted=True), device_kjt(device, True, weighted=True))

        def region() -> list:
            out = op(first, second)
            return [kjt.length_per_key() for kjt in (out if isinstance(out, list) else [out])]

        return region

    return prepare


def _dist_init(vbe: bool) -> Callable[[torch.device], Callable[[], Any]]:
    def prepare(device: torch.device) -> Callable[[], Any]:
        # Two ranks sent the same batch; the received tensors are on the device, rank-major.
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        kjt = vbe_kjt(device, False) if vbe else device_kjt(device, False)
        tensors = [torch.cat([kjt.lengths(), kjt.lengths()]), torch.cat([kjt.values(), kjt.values()])]
        recat = torch.tensor([r * len(KEYS) + k for k in range(len(KEYS)) for r in range(2)], dtype=torch.int32, device=device)
        if vbe:
            per_rank = [s for s in kjt.stride_per_key()]
            tensors.append(torch.tensor(per_rank + per_rank, device=device))
        return lambda: KeyedJaggedTensor.dist_init(list(KEYS), tensors, vbe, 2, recat, None if vbe else [BATCH, BATCH])

    return prepare


def _kt_op(op: Callable[[list], Any]) -> Callable[[torch.device], Callable[[], Any]]:
    def prepare(device: torch.device) -> Callable[[], Any]:
        from torchrec.sparse.jagged_tensor import KeyedTensor

        kts = [KeyedTensor(["a", "b"], [2, 3], torch.rand(BATCH, 5, device=device)), KeyedTensor(["c"], [4], torch.rand(BATCH, 4, device=device))]
        return lambda: op(kts)

    return prepare


def _regroup_module(calls: int) -> Callable[[torch.device], Callable[[], Any]]:
    def prepare(device: torch.device) -> Callable[[], Any]:
        from torchrec.modules.regroup import KTRegroupAsDict

        module, kts = KTRegroupAsDict([["c", "a"], ["b"]], ["x", "y"]), _kt_op(lambda kts: kts)(device)()
        for _ in range(calls - 1):
            module(kts)  # the first call builds the module's layout, uncounted here
        return lambda: module(kts)

    return prepare


def _torchrec(name: str) -> Any:
    import torchrec.sparse.jagged_tensor as jagged_tensor

    return getattr(jagged_tensor, name)


def op_budgets() -> tuple[OpBudget, ...]:
    from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

    groups = [["c", "a"], ["b"]]
    return (
        OpBudget("kjt.from_offsets_sync", _from_offsets_sync, (PER_KEY,)),
        OpBudget("kjt.from_jt_dict.device_jts", _from_device_jts, (PER_KEY,)),
        OpBudget("kjt.concat", _concat),
        OpBudget("kjt.concat.carries_length_per_key", _carried(lambda k, other: KeyedJaggedTensor.concat([k, other]))),
        OpBudget("kjt.flatten_lengths.carries_length_per_key", _carried(lambda k, _: k.flatten_lengths())),
        OpBudget("kjt.split.carries_length_per_key", _carried(lambda k, _: k.split([1, 2]))),
        OpBudget("kjt.to.carries_length_per_key", _carried(lambda k, _: k.to(k.device()))),
        OpBudget("kjt.pytree.drops_length_per_key", _carried(lambda k, _: _pytree_round_trip(k)), (PER_KEY,)),
        OpBudget("vbe_kjt.concat.carries_length_per_key", _carried(lambda k, other: KeyedJaggedTensor.concat([k, other]), True)),
        OpBudget("vbe_kjt.flatten_lengths.carries_length_per_key", _carried(lambda k, _: k.flatten_lengths(), True)),
        OpBudget("vbe_kjt.split.carries_length_per_key", _carried(lambda k, _: k.split([1, 2]), True)),
        OpBudget("vbe_kjt.pytree.drops_length_per_key", _carried(lambda k, _: _pytree_round_trip(k), True), (VBE_PER_KEY,)),
        OpBudget("kjt.empty", lambda device: lambda: KeyedJaggedTensor.empty(device=device)),
        OpBudget("kjt.empty_like", _kjt_op(KeyedJaggedTensor.empty_like, metadata=False)),
        OpBudget("kjt.offset_per_key.without_metadata", _kjt_op(lambda k: k.offset_per_key(), False), (PER_KEY,)),
        OpBudget("kjt.stride+stride_per_key+lengths_offset_per_key", _kjt_op(lambda k: (k.stride(), k.stride_per_key(), k.lengths_offset_per_key()), False)),
        OpBudget("kjt.offsets_from_lengths", _kjt_op(lambda k: k.offsets(), False)),
        OpBudget("kjt.getitem.with_metadata", _kjt_op(lambda k: k["f1"], True)),
        OpBudget("kjt.getitem.without_metadata", _kjt_op(lambda k: k["f1"], False), (PER_KEY,)),
        OpBudget("kjt.flatten_lengths.with_metadata", _kjt_op(lambda k: k.flatten_lengths(), True)),
        OpBudget("kjt.flatten_lengths.without_metadata", _kjt_op(lambda k: k.flatten_lengths(), False), (PER_KEY,)),
        OpBudget("kjt.dist_splits.with_metadata", _kjt_op(lambda k: (k.dist_labels(), k.dist_splits([1, 2])), True)),
        OpBudget("kjt.dist_splits.without_metadata", _kjt_op(lambda k: k.dist_splits([1, 2]), False), (PER_KEY,)),
        OpBudget("kjt.dist_tensors", _kjt_op(lambda k: k.dist_tensors(), False)),
        OpBudget("kjt.dist_init", _dist_init(vbe=False), (PER_KEY,)),
        OpBudget("kjt.copy_", _kjt_op(lambda k: KeyedJaggedTensor.empty_like(k, device=k.device()).copy_(k), True)),
        OpBudget("kjt.pytree", _kjt_op(lambda k: _pytree_round_trip(k), True)),
        OpBudget("kjt.clear_storage", _kjt_op(lambda k: k.clear_storage(), True)),
        OpBudget("vbe_kjt.stride+stride_per_key", _kjt_op(lambda k: (k.stride(), k.stride_per_key()), False, vbe=True)),
        OpBudget("vbe_kjt.getitem.with_metadata", _kjt_op(lambda k: k["f1"], True, vbe=True)),
        OpBudget("vbe_kjt.getitem.without_metadata", _kjt_op(lambda k: k["f1"], False, vbe=True), (VBE_PER_KEY,)),
        OpBudget("vbe_kjt.dist_splits.with_metadata", _kjt_op(lambda k: k.dist_splits([1, 2]), True, vbe=True)),
        OpBudget("vbe_kjt.dist_tensors", _kjt_op(lambda k: k.dist_tensors(), True, vbe=True)),
        OpBudget("vbe_kjt.dist_init", _dist_init(vbe=True), ("dist_init", "dist_init", VBE_PER_KEY)),  # 2 .cpu()
        OpBudget("jt.offsets_from_lengths", _jt_op(lambda j: j.offsets())),
        OpBudget("jt.to_padded_dense.desired_length", _jt_op(lambda j: (j.to_padded_dense(2), j.to_padded_dense_weights(2)), True)),
        OpBudget("jt.to_padded_dense.longest_row", _jt_op(lambda j: j.to_padded_dense()), ("to_padded_dense",)),
        OpBudget("jt.to_padded_dense_weights.longest_row", _jt_op(lambda j: j.to_padded_dense_weights(), True), ("to_padded_dense_weights",)),
        OpBudget("jt.to_dense", _jt_op(lambda j: j.to_dense()), ("to_dense",) * 2 * len(JT_LENGTHS)),
        OpBudget("jt.to_dense_weights", _jt_op(lambda j: j.to_dense_weights(), True), ("to_dense_weights",) * 2 * len(JT_LENGTHS)),
        OpBudget("jt.from_dense", _dense_input(lambda rows, dense, lengths: JaggedTensor.from_dense(rows)), ("from_dense",)),
        OpBudget("jt.from_dense_lengths", _dense_input(lambda rows, dense, lengths: JaggedTensor.from_dense_lengths(dense, lengths)),
                 ("from_dense_lengths",)),
        OpBudget("jt.from_dense_lengths.weighted",
                 _dense_input(lambda rows, dense, lengths: JaggedTensor.from_dense_lengths(dense, lengths, weights=dense)),
                 ("from_dense_lengths", "_optional_mask")),
        OpBudget("jt.empty_like", _jt_op(lambda j: JaggedTensor.empty_like(j))),
        OpBudget("jt.to+copy_", _jt_op(lambda j: JaggedTensor.empty_like(j, device=j.device()).copy_(j.to(j.device(), non_blocking=True)), True)),
        OpBudget("kt.from_tensor_list+getitem+to_dict", _kt_op(lambda kts: (KeyedTensor.from_tensor_list(["x", "y"], [kts[0]["a"], kts[1]["c"]]), kts[0].to_dict()))),
        OpBudget("kt.permute_multi_embedding", _kt_op(lambda kts: _torchrec("permute_multi_embedding")(kts, groups))),
        OpBudget("kt.regroup_kts", _kt_op(lambda kts: _torchrec("regroup_kts")(kts, groups))),
        OpBudget("kt.KTRegroupAsDict.first_call", _regroup_module(calls=1)),
        OpBudget("kt.KTRegroupAsDict.steady", _regroup_module(calls=2)),
    )


def _pytree_round_trip(kjt: Any) -> Any:
    from torch.utils import _pytree as pytree

    leaves, tree = pytree.tree_flatten(kjt)
    return pytree.tree_unflatten(leaves, tree)
