"""`--world-size` takes any positive size; what a size needs is checked where its ranks start."""

from __future__ import annotations

import pytest

from paritykit.dist import capacity
from paritykit.gate import cli


def _parsed_world_sizes(text: str) -> tuple[int, ...]:
    return cli.build_parser().parse_args(["gate", "--world-size", text]).world_size


@pytest.mark.parametrize("text, sizes", [("16", (16,)), ("1,2,10", (1, 2, 10)), ("4,4,2", (4, 2)), ("128", (128,))])
def test_any_positive_world_size_a_launcher_may_provide_is_accepted(text, sizes):
    assert _parsed_world_sizes(text) == sizes


@pytest.mark.parametrize("text, message", [("0", "world sizes must be positive, got [0]"), ("2,-1", "got [-1]"), ("two", "N or N,M")])
def test_world_sizes_that_are_not_positive_ints_are_refused_by_name(text, message, capsys):
    with pytest.raises(SystemExit) as info:
        _parsed_world_sizes(text)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_world_size_beyond_this_host_is_a_harness_error_with_the_numbers(capsys):
    host = capacity.measure_host()
    if host.memory_available_bytes is None:
        pytest.skip("this operating system does not say how much memory is available")
    too_many = host.memory_available_bytes // capacity.rank_memory_estimate() + 1
    code = cli.main(["gate", "--check", "td-kjt", "--device", "cpu", "--world-size", str(too_many), "--examples", "1"])
    assert code == cli.EXIT_HARNESS_ERROR
    out = capsys.readouterr().out
    assert f"this host cannot hold a pool of {too_many} ranks on cpu: memory: {too_many} ranks x" in out
