"""The losses' comparison after every output agreed: its floor is the size of the terms a loss sums,
since the default loss's weighted output elements cancel far below them."""

from __future__ import annotations

import torch

from paritykit.engine.comparison import losses_bound, per_step_problems
from paritykit.engine.losses import default_loss, loss_terms_magnitude
from paritykit.engine.tolerances import default_tolerance
from paritykit.engine.training import TrainingRecord


def _cancelling_output() -> dict[str, torch.Tensor]:
    """An output whose default loss is about a thousandth of its terms' size."""
    torch.manual_seed(0)
    big = torch.randn(8, 12) * 4
    terms = loss_terms_magnitude({"a": big})
    # A second leaf that cancels all but a sliver of the first one's weighted sum.
    other = torch.ones(1, 1)
    weight = float(default_loss({"b": other}))
    return {"a": big, "b": other * -(float(default_loss({"a": big})) - 1e-3 * terms) / weight}


def _record(output, loss: torch.Tensor) -> TrainingRecord:
    return TrainingRecord(outputs=[[output]], losses=[[loss]], embeddings=[[{}]], state={})


def test_the_terms_magnitude_is_the_sum_of_the_absolute_weighted_elements():
    output = {"a": torch.tensor([[1.0, -2.0]]), "b": torch.tensor([3.0])}
    expected = sum(float((leaf.double() * _weights_of(path, leaf)).abs().sum()) for path, leaf in
                   (("output['a']", output["a"]), ("output['b']", output["b"])))
    assert loss_terms_magnitude(output) == expected and expected > 0
    assert loss_terms_magnitude({"ids": torch.tensor([1, 2])}) == 0.0


def _weights_of(path: str, leaf: torch.Tensor) -> torch.Tensor:
    from paritykit.harness.seeding import generator

    return torch.randn(leaf.shape, generator=generator("loss", path, tuple(leaf.shape)), dtype=torch.float32).double()


def test_a_loss_that_cancels_may_move_by_a_few_units_of_its_terms():
    output = _cancelling_output()
    loss = default_loss(output)
    terms = loss_terms_magnitude(output)
    assert abs(float(loss)) < 0.01 * terms  # the sum is far below its terms
    unit = torch.finfo(torch.float32).eps * terms
    moved = loss + 4 * unit  # four units of the terms: roundoff of another summation order
    tolerance = default_tolerance()
    assert per_step_problems(_record(output, moved), _record(output, loss), tolerance) == []
    # The loss's own magnitude would have refused it: the floor is what lets it through.
    assert tolerance.losses.differences(moved.reshape(1, 1), loss.reshape(1, 1), "losses")


def test_a_loss_off_by_a_thousandth_of_its_terms_still_fails():
    output = _cancelling_output()
    loss = default_loss(output)
    wrong = loss + 1e-3 * loss_terms_magnitude(output)
    problems = per_step_problems(_record(output, wrong), _record(output, loss), default_tolerance())
    assert len(problems) == 1 and "the losses differ while every output agrees" in problems[0]
    bound = losses_bound(default_tolerance().losses, _record(output, loss))
    assert bound.atol == bound.max_relative * loss_terms_magnitude(output) and "the loss's terms" in bound.describe()


def test_an_exact_bound_keeps_no_floor():
    from paritykit.engine.comparison import EXACT

    assert losses_bound(EXACT, _record(_cancelling_output(), torch.tensor(0.0))) is EXACT
