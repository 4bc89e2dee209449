"""The modules check's planted bugs: each first shown to change what torchrec computes (its own
outputs, nothing of paritykit's in between), then found caught by the self-test with its few
examples, against a clean run of the same check."""

from __future__ import annotations

import pytest
import torch

from paritykit.checks.runner import GateConfig
from paritykit.gate.selftest import run_clean, run_plant
from paritykit.harness import plants

from test_modules_mc_sharded import RANK_PLANTS as MC_RANK_PLANTS  # noqa: E402 - caught on the ranks, tested there
from test_modules_pools import RANK_PLANTS as POOL_RANK_PLANTS  # noqa: E402

MODULE_PLANTS = sorted(name for name, plant in plants.PLANTS.items()
                       if plant.check == "modules" and name not in MC_RANK_PLANTS | POOL_RANK_PLANTS)
# One drawn example per property: the pinned cases are what catch each plant (`paritykit selftest`,
# with its default 3 examples, catches all of them too: docs/modules.md).
SELFTEST = GateConfig(device="cpu", world_sizes=(2,), examples=1, seed=0, shrink=False)


def _seeded(module: torch.nn.Module) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return module


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(1))


def _cross(name: str, **kwargs):
    from torchrec.modules import crossnet

    return lambda: [_seeded(getattr(crossnet, name)(4, 2, **kwargs))(_x(3, 4))]


def _fm():
    from torchrec.modules.deepfm import FactorizationMachine

    return [FactorizationMachine()(embeddings=[_x(3, 2, 3), _x(3, 1, 3) + 1])]


def _mlp():
    from torchrec.modules.mlp import MLP

    return [_seeded(MLP(4, [3, 2]))(_x(3, 4))]


def _swish():
    from torchrec.modules.activation import SwishLayerNorm

    return [SwishLayerNorm([3, 4])(_x(2, 3, 4))]


def _remap(steps, policy=None, **hash_options):
    from torchrec.modules.mc_modules import LFU_EvictionPolicy, MCHManagedCollisionModule
    from torchrec.sparse.jagged_tensor import JaggedTensor

    module = MCHManagedCollisionModule(zch_size=4, device=torch.device("cpu"), eviction_policy=policy or LFU_EvictionPolicy(),
                                       eviction_interval=1, **hash_options)
    return [module({"t": JaggedTensor(values=torch.tensor(ids), lengths=torch.tensor([len(ids)]))})["t"].values() for ids in steps]


def _tensor_pool():
    from torchrec.modules.tensor_pool import TensorPool

    pool = TensorPool(pool_size=3, dim=1, dtype=torch.float32, device=torch.device("cpu"))
    pool.update(torch.tensor([2, 0, 2]), torch.tensor([[1.0], [2.0], [3.0]]))
    return [pool.lookup(torch.tensor([0, 1, 2]))]


def _lru():
    from torchrec.modules.mc_modules import LRU_EvictionPolicy

    return LRU_EvictionPolicy()


def _average_filtered_lfu():
    from torchrec.modules import mc_modules

    return mc_modules.LFU_EvictionPolicy(threshold_filtering_func=mc_modules.average_threshold_filter)


def _interaction():
    from torchrec.models.dlrm import InteractionArch

    return [InteractionArch(2)(_x(3, 4), _x(3, 2, 4))]


# plant -> what torchrec computes that the plant changes (tensors, compared bit for bit).
TORCHREC_NUMBERS = {
    "cross-layer-uses-x-l-for-x0": _cross("CrossNet"),
    "low-rank-factor-transposed": _cross("LowRankCrossNet", low_rank=4),
    "vector-cross-bias-inside-product": _cross("VectorCrossNet"),
    "mixture-gating-softmax-over-batch": _cross("LowRankMixtureCrossNet", num_experts=3, low_rank=2),
    "fm-over-field-axis": _fm,
    "mlp-drops-last-activation": _mlp,
    "swish-layernorm-last-dim-only": _swish,
    "mch-default-slot-off-by-one": lambda: _remap([[1, 2, 3], [4]]),  # 4 finds the three slots held
    # ids mod 2: 1, 3 and 5 are one id, which takes one slot; unhashed, they fill all three.
    "mch-input-hash-not-applied": lambda: _remap([[1, 3, 5], [2]], input_hash_size=2, input_hash_func=torch.remainder),
    # 1, 2, 3 fill the three slots; 4 then ties with 3 (one hit each).
    "lfu-ties-favour-new-ids": lambda: _remap([[1, 1, 2, 2, 3], [4], [3, 4]]),
    # counts (2, 2): the mean, 2, which only a count strictly above passes; the plant lets both in.
    "threshold-filter-passes-ties": lambda: _remap([[1, 1, 2, 2]], _average_filtered_lfu()),
    # 1, 2, 3 fill the three slots; 4 then replaces the least recent of them (a tie of three: the
    # largest id), which the plant keeps.
    "lru-keeps-least-recent": lambda: _remap([[1, 2, 3], [4], [1, 4]], _lru()),
    "dlrm-interaction-keeps-self-dots": _interaction,
    "tensor-pool-update-keeps-first-duplicate": _tensor_pool,  # slot 2 written twice
}


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def test_every_modules_plant_has_a_demonstration_on_torchrec():
    assert sorted(TORCHREC_NUMBERS) == MODULE_PLANTS


@pytest.mark.parametrize("plant", MODULE_PLANTS)
def test_planted_bug_changes_what_torchrec_computes(plant):
    clean = TORCHREC_NUMBERS[plant]()
    with plants.applied([plant]):
        planted = TORCHREC_NUMBERS[plant]()
    assert not _same(clean, planted)
    assert _same(clean, TORCHREC_NUMBERS[plant]())  # and is gone once the block ends


@pytest.fixture(scope="module")
def clean_run():
    return run_clean("modules", SELFTEST, None)


@pytest.mark.parametrize("plant", MODULE_PLANTS)
def test_self_test_catches_the_plant_with_the_modules_check(plant, clean_run):
    outcome = run_plant(plant, SELFTEST, None, clean_run)
    assert (outcome.verdict, outcome.check) == ("caught", "modules"), outcome.evidence
