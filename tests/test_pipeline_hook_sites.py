"""Where register_backward_hook hooks a backward work (checks/pipeline/hook_sites.py): the reference
rule worked by hand, torchrec's real hooks passing it, and a hook placed elsewhere caught."""

from __future__ import annotations

import pytest

from paritykit.checks.pipeline.hook_sites import PINNED, ActivationCase, ParamGradCase, run_hook_site_case
from paritykit.errors import ParityError


def test_the_documented_parameter_by_hand():
    # Index min(int(position * n), n - 1), clamped; the nearest hookable, the later one on a tie.
    assert ParamGradCase((False,) * 4, 0.5).expected() == 2
    assert ParamGradCase((False,) * 4, 1.0).expected() == 3 and ParamGradCase((False,) * 4, 7.0).expected() == 3
    assert ParamGradCase((False,) * 4, -1.0).expected() == 0
    assert ParamGradCase((True, False, True, False), 0.5).expected() == 3  # 1 and 3 tie around 2: the later
    assert ParamGradCase((False, True, True, True), 1.0).expected() == 0
    assert ParamGradCase((True, True), 0.5).expected() is None
    # The first leaf carrying grad, depth first: a JaggedTensor by its weights.
    assert ActivationCase(("tuple", "plain", ("dict", "jt-plain", "jt-grad"), "grad")).expected() == 2
    assert ActivationCase(("tuple", "plain", "jt-plain")).expected() is None


def test_torchrecs_hooks_sit_where_documented():
    assert [run_hook_site_case(case) for case in PINNED] == [{"hooks": 1}] * 4 + [{"refused": 1}] + [{"hooks": 1}]


def test_a_hook_on_the_earlier_neighbour_of_a_tie_is_caught():
    from torchrec.distributed.train_pipeline import backward_injection

    from paritykit.harness.patching import replaced

    def planted(original):
        def walk(start, n):  # backward first on a tie
            yield from sorted(original(start, n), key=lambda i: (abs(i - start), i > start))
        return walk

    with replaced(backward_injection, "_walk_outward", planted):
        with pytest.raises(ParityError, match="the documented site is parameter 3"):
            run_hook_site_case(ParamGradCase((True, False, True, False), 0.5))
