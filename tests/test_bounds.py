"""Derived tolerances: rounding-order differences pass, a consistent 1e-3 relative drift fails."""

import pytest
import torch

from paritykit.compare import assert_close
from paritykit.compare.bounds import summation_tolerance, unit_roundoff
from paritykit.errors import ParityError


def sums_in_two_orders(seed: int, rows: int = 64, terms: int = 12):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, terms, generator=generator) * 4
    forward = values.sum(dim=1)
    backward = torch.zeros(rows)
    for j in reversed(range(terms)):
        backward = backward + values[:, j]
    return forward, backward, terms, float(values.abs().max())


@pytest.mark.parametrize("seed", range(5))
def test_two_summation_orders_agree_within_the_bound(seed):
    forward, backward, terms, magnitude = sums_in_two_orders(seed)
    rtol, atol = summation_tolerance(torch.float32, terms, magnitude)
    assert_close(backward, forward, rtol=rtol, atol=atol)


@pytest.mark.parametrize("seed", range(5))
def test_a_consistent_relative_drift_of_1e_3_fails(seed):
    forward, _, terms, magnitude = sums_in_two_orders(seed)
    rtol, atol = summation_tolerance(torch.float32, terms, magnitude)
    with pytest.raises(ParityError):
        assert_close(forward * (1 + 1e-3), forward, rtol=rtol, atol=atol)


def test_the_bound_is_the_stated_formula():
    u = unit_roundoff(torch.float32)
    assert u == 2.0**-24
    rtol, atol = summation_tolerance(torch.float32, 12, 4.0)
    assert rtol == 4 * u and atol == pytest.approx(2 * (12 * u / (1 - 12 * u)) * 12 * 4.0)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        summation_tolerance(torch.float32, -1, 1.0)
    with pytest.raises(ValueError):
        summation_tolerance(torch.float16, 5000, 1.0)
