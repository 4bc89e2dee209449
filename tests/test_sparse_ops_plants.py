"""The sparse-ops check's planted bugs: each first shown to change what torchrec computes (its own
outputs, gradients or syncs, with and without the plant, nothing of paritykit's in between), then
found caught by the self-test with its few examples, against a clean run of the same check."""

from __future__ import annotations

import pytest
import torch

from paritykit.checks.runner import GateConfig
from paritykit.gate.selftest import run_clean, run_plant
from paritykit.harness import plants
from paritykit.sync import count_syncs

SPARSE_PLANTS = sorted(name for name, plant in plants.PLANTS.items() if plant.check == "sparse-ops")
# The self-test's configuration: its default 3 examples, world size 2, seed 0.
SELFTEST = GateConfig(device="cpu", world_sizes=(2,), examples=3, seed=0, shrink=False)


def _kts(requires_grad: bool = False):
    from torchrec.sparse.jagged_tensor import KeyedTensor

    first = torch.arange(10.0).reshape(2, 5).requires_grad_(requires_grad)
    second = torch.arange(100.0, 112.0).reshape(2, 6).requires_grad_(requires_grad)
    return [KeyedTensor(["a", "b"], [2, 3], first), KeyedTensor(["c", "d", "e"], [1, 4, 1], second)], (first, second)


def _kjt(vbe: bool = False):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    if vbe:
        return KeyedJaggedTensor(keys=["a", "b"], values=torch.arange(6), lengths=torch.tensor([1, 2, 0, 1, 2]),
                                 stride_per_key_per_rank=[[2], [3]])
    return KeyedJaggedTensor(keys=["a", "b", "c"], values=torch.arange(7), lengths=torch.tensor([1, 0, 2, 1, 2, 1]),
                             weights=torch.arange(7.0) / 8, stride=2)


def _jt():
    from torchrec.sparse.jagged_tensor import JaggedTensor

    return JaggedTensor(values=torch.arange(6.0), lengths=torch.tensor([3, 0, 3]), weights=torch.arange(6.0) / 4)


def _regroup():
    from torchrec.sparse.jagged_tensor import KeyedTensor

    return KeyedTensor.regroup(_kts()[0], [["e", "a"], ["d", "b", "c"]])


def _repeated_key_gradient():
    from torchrec.sparse.jagged_tensor import KeyedTensor

    kts, (first, second) = _kts(requires_grad=True)
    out = KeyedTensor.regroup(kts, [["a", "c"], ["a", "b", "d", "e"]])
    torch.autograd.backward(out, [torch.ones_like(t) for t in out])
    return [t.detach() for t in out] + [first.grad, second.grad]


def _regroup_module():
    from torchrec.modules.regroup import KTRegroupAsDict
    from torchrec.types import DataType

    return list(KTRegroupAsDict([["c", "a"], ["b"]], ["x", "y"], emb_dtype=DataType.FP16)(_kts()[0]).values())


def _getitem_syncs():
    kjt = _kjt().sync()
    with count_syncs(backend="cpu") as record:
        kjt["b"]
    return [torch.tensor(record.total)]


def _concat_length_per_key_syncs():
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    first, second = _kjt().sync(), _kjt().sync()
    with count_syncs(backend="cpu") as record:
        KeyedJaggedTensor.concat([first, second]).length_per_key()
    return [torch.tensor(record.total)]


def _first_offset_verdict():
    """1 where validate_keyed_jagged_tensor rejects a KJT whose offsets start at 1, else 0."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    from torchrec.sparse.jagged_tensor_validator import validate_keyed_jagged_tensor

    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.arange(5), offsets=torch.tensor([1, 2, 4, 4, 5]))
    try:
        validate_keyed_jagged_tensor(kjt)
    except ValueError:
        return [torch.tensor(1)]
    return [torch.tensor(0)]


def _length_per_key_from_offsets():
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.arange(5), offsets=torch.tensor([0, 1, 3, 3, 5]))
    return [torch.tensor(kjt.length_per_key())]


def _ec_with_indices():
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingCollection

    torch.manual_seed(0)
    ec = EmbeddingCollection(tables=[EmbeddingConfig(name="t", embedding_dim=2, num_embeddings=5, feature_names=["a", "b"])],
                             need_indices=True)
    out = ec(_kjt().permute([0, 1]))
    return [t for jt in out.values() for t in (jt.values().detach(), jt.lengths(), jt.weights_or_none())]


def _constructed_shards():
    from torchrec.modules.utils import construct_jagged_tensors

    features = _kjt().permute([0, 0])  # key a once per column shard
    embeddings = torch.arange(2.0 * features.values().numel()).reshape(-1, 2)
    out = construct_jagged_tensors(embeddings, features, ["a", "a"], features_to_permute_indices={"a": [1, 0]})
    return [out["a"].values()]


# plant -> what torchrec computes that the plant changes (tensors, compared bit for bit).
TORCHREC_NUMBERS = {
    "regroup-misorders-second-kt-keys": _regroup,
    "to-padded-dense-ignores-desired-length": lambda: [_jt().to_padded_dense(2, -1.0)],
    "padded-dense-weights-ignore-padding-value": lambda: [_jt().to_padded_dense_weights(4, 0.5)],
    "permute-drops-weights": lambda: [_kjt().permute([2, 0, 1]).weights_or_none()],
    "split-last-key-off-by-one": lambda: [p.values() for p in _kjt().split([1, 2])],
    "vbe-to-dict-wrong-stride": lambda: [jt.lengths() for jt in _kjt(vbe=True).to_dict().values()],
    "dist-splits-weights-use-batch-sizes": lambda: [torch.tensor(s) for s in _kjt().dist_splits([1, 2])],
    "regroup-repeated-key-loses-gradient": _repeated_key_gradient,
    "kt-regroup-module-ignores-emb-dtype": _regroup_module,
    "getitem-reads-offsets": _getitem_syncs,
    "kjt-concat-drops-length-per-key": _concat_length_per_key_syncs,
    "validator-skips-first-offset": _first_offset_verdict,
    "offsets-only-length-per-key-empty": _length_per_key_from_offsets,
    "ec-drops-need-indices": _ec_with_indices,
    "construct-jagged-tensors-ignores-shard-order": _constructed_shards,
}


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y))
        for x, y in zip(a, b)
    )


def test_every_sparse_ops_plant_has_a_demonstration_on_torchrec():
    assert sorted(TORCHREC_NUMBERS) == SPARSE_PLANTS


@pytest.mark.parametrize("plant", SPARSE_PLANTS)
def test_planted_bug_changes_what_torchrec_computes(plant):
    clean = TORCHREC_NUMBERS[plant]()
    with plants.applied([plant]):
        planted = TORCHREC_NUMBERS[plant]()
    assert not _same(clean, planted)
    assert _same(clean, TORCHREC_NUMBERS[plant]())  # and is gone once the block ends


def test_the_gradient_plant_leaves_the_forward_numbers_alone():
    clean = _repeated_key_gradient()
    with plants.applied(["regroup-repeated-key-loses-gradient"]):
        planted = _repeated_key_gradient()
    assert _same(clean[:2], planted[:2]) and not _same(clean[2:], planted[2:])


@pytest.fixture(scope="module")
def clean_run():
    return run_clean("sparse-ops", SELFTEST, None)


@pytest.mark.parametrize("plant", SPARSE_PLANTS)
def test_self_test_catches_the_plant_with_the_sparse_ops_check(plant, clean_run):
    outcome = run_plant(plant, SELFTEST, None, clean_run)
    assert (outcome.verdict, outcome.check) == ("caught", "sparse-ops"), outcome.evidence
