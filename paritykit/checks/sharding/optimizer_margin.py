"""How close the drawn cases come to the sharding check's bound, per optimizer: the worst difference
between the sharded run and the unsharded reference, in units of roundoff of the norm-wise bound.

    python -m paritykit.checks.sharding.optimizer_margin --examples 200 --world-size 2 --seed 0

For every compared tensor (each step's embeddings by key, outputs and losses; the final tables,
dense parameters, fused and dense optimizer state) the difference is measured as
max |a - e| / (u (|e| + max|e|)), u the unit roundoff of float32; the bound allows 64. Prints the
worst per fused and per dense optimizer, with the tensor where it was seen.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, given, seed, settings

from paritykit.checks.sharding.case_runner import case_setup
from paritykit.checks.sharding.cases import optimizer_name
from paritykit.checks.sharding.draws import sharding_cases
from paritykit.checks.sharding.matrix import placements_by_module
from paritykit.compare.bounds import unit_roundoff
from paritykit.engine.comparison import by_key
from paritykit.engine.reference import train_reference
from paritykit.engine.training import TrainingRecord, assemble_records, train_on_rank
from paritykit.harness.sharded import gradient_division


def paired_tensors(actual: Any, expected: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """(path, actual, expected) for every floating tensor two records hold at the same place."""
    actual, expected = by_key(actual), by_key(expected)
    if isinstance(expected, torch.Tensor):
        if expected.is_floating_point() and isinstance(actual, torch.Tensor) and actual.shape == expected.shape:
            yield path, actual.detach().float(), expected.detach().float()
    elif type(expected).__name__ == "JaggedTensor":
        yield from paired_tensors(actual.values(), expected.values(), f"{path}.values")
    elif isinstance(expected, dict):
        for key in expected:
            if key in actual:
                yield from paired_tensors(actual[key], expected[key], f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        for index, (a, e) in enumerate(zip(actual, expected)):
            yield from paired_tensors(a, e, f"{path}[{index}]")


def worst_units(actual: TrainingRecord, expected: TrainingRecord) -> tuple[float, str]:
    """The largest difference of any compared tensor, in units of float32 roundoff of the norm-wise bound."""
    u = unit_roundoff(torch.float32)
    worst, where = 0.0, ""
    compared = {name: (getattr(actual, name), getattr(expected, name))
                for name in ("embeddings", "outputs", "state", "fused_state", "dense_state")}
    # The losses are one tensor [step, rank], as the comparison holds them.
    compared["losses"] = tuple(torch.stack([torch.stack(step) for step in r.losses]) for r in (actual, expected))
    for name, (a_side, e_side) in compared.items():
        for path, a, e in paired_tensors(a_side, e_side, name):
            if e.numel() == 0:
                continue
            units = ((a - e).abs() / (u * (e.abs() + e.abs().max()))).nan_to_num(0.0).max().item()
            if units > worst:
                worst, where = units, path
    return worst, where


def measure(pool: Any, world_size: int, examples: int, start: int) -> dict[str, tuple[float, str, int]]:
    """{"fused <name>" / "dense <name>": (worst units, where, cases)} over ``examples`` drawn cases."""
    found: dict[str, tuple[float, str, int]] = {}

    @seed(start)
    @settings(max_examples=examples, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(sharding_cases(world_size, placements_by_module("cpu")))
    def one(case):
        setup = case_setup(case)
        reference = train_reference(setup, division=gradient_division())
        record = assemble_records(pool.call(train_on_rank, (setup,), case=case.case_id()))
        units, where = worst_units(record, reference)
        for key in (f"fused {optimizer_name(case.optimizer)}", f"dense {optimizer_name(case.dense_optimizer)}"):
            previous = found.get(key, (0.0, "", 0))
            found[key] = (units, f"{where} in {case.case_id()}", previous[2] + 1) if units > previous[0] else (*previous[:2], previous[2] + 1)

    one()
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from paritykit.dist import RankPool

    with RankPool(args.world_size) as pool:
        found = measure(pool, args.world_size, args.examples, args.seed)
    print(f"{'optimizer':<30} {'cases':>6} {'worst (units of u)':>19}  where")
    for key, (units, where, cases) in sorted(found.items()):
        print(f"{key:<30} {cases:>6} {units:>19.2f}  {where[:160]}")
    print(f"overall worst: {max(units for units, _, _ in found.values()):.2f} units (the bound allows 64)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
