"""The position-weighted feature processors (checks/modules/position_cases.py): torchrec's pass the pinned
cases against the weights by hand, and a processor that weights the wrong position, drops the gradient
or keeps the wrong features is caught; the variable-batch defect reproduces."""

from __future__ import annotations

import pytest

from paritykit.checks.modules.position_cases import PINNED, VARIABLE_BATCH_MIXED_SPEC, run_position_case
from paritykit.errors import ParityError


@pytest.mark.parametrize("spec", PINNED, ids=lambda spec: spec.case_id()[:60])
def test_torchrecs_processors_weight_each_id_by_its_position(spec):
    metrics = run_position_case(spec)
    assert metrics["ids"] == sum(len(bag) for feature in spec.bags for bag in feature)


def _changed_forward(monkeypatch, change):
    from torchrec.modules.feature_processor import PositionWeightedProcessor
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    original = PositionWeightedProcessor.forward

    def forward(self, features):
        out = original(self, features)
        return KeyedJaggedTensor(keys=out.keys(), values=out.values(), lengths=out.lengths(), weights=change(out.weights()))

    monkeypatch.setattr(PositionWeightedProcessor, "forward", forward)


def test_weights_of_another_position_are_caught(monkeypatch):
    _changed_forward(monkeypatch, lambda weights: weights.roll(1))
    with pytest.raises(ParityError, match=r"weights .* expected position_weights\[f0\]"):
        run_position_case(PINNED[0])


def test_weights_cut_off_from_their_gradient_are_caught(monkeypatch):
    _changed_forward(monkeypatch, lambda weights: weights.detach().requires_grad_())
    with pytest.raises(ParityError, match="gradient"):
        run_position_case(PINNED[0])


def test_a_processor_keeping_a_feature_it_does_not_weight_is_caught(monkeypatch):
    from torchrec.modules.feature_processor import PositionWeightedProcessor

    monkeypatch.setattr(PositionWeightedProcessor, "forward", lambda self, features: features)
    with pytest.raises(ParityError, match="output keys"):
        run_position_case(PINNED[1])


def test_the_variable_batch_with_unweighted_features_gives_wrong_bags():
    with pytest.raises(ParityError, match=r"feature f1: bags \[\[\], \[\]\], expected \[\[\], \[\], \[\]\]"):
        run_position_case(VARIABLE_BATCH_MIXED_SPEC)
