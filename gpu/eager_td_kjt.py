"""Eager TD/KJT parity on a device: EBC and EC fed a batch as a TensorDict and as a KJT, on CUDA.

    python gpu/eager_td_kjt.py --device cuda [--examples 200] [--seed 0]

The cases are the td-kjt check's own eager cases (EBC/EC, SUM/MEAN, weighted, variable batch,
every jagged form, torchrec's route and paritykit's). Each one builds the module and both forms of
the batch on ``--device`` from the batch's rows, checks that paritykit's conversion of the
TensorDict gives the KJT built from the rows, then compares outputs and gradients with
paritykit.assert_td_kjt_parity. With ``--device cpu`` it runs the same code on CPU.
Exit code: 0 every case passed, 1 a case failed (the message names it), 2 no such device here.
"""

from __future__ import annotations

import argparse
import sys


def tables_for(keys: tuple[str, ...], pooling: str):
    from paritykit.harness.tables import TableSpec

    # The first two features share a table, so shared-table gradients are covered.
    groups = [keys[:2], *[(key,) for key in keys[2:]]]
    return tuple(TableSpec(f"t{i}", 20, 4, group, pooling=pooling) for i, group in enumerate(groups))


def run_case(case, device: str) -> dict:
    import paritykit
    from paritykit.harness.tables import build_ebc, build_ec

    tables = tables_for(case.batch.keys, case.pooling)
    seed = case.batch.seed % 1000
    if case.module == "ebc":
        module = build_ebc(tables, seed=seed, is_weighted=case.batch.weighted, device=device)
    else:
        module = build_ec(tables, seed=seed, device=device)
    td = case.batch.to_td(case.form, device)
    rows_kjt = case.batch.to_kjt(device, lengths_dtype=case.batch.kjt_lengths_dtype(case.form))
    paritykit.assert_close(paritykit.td_to_kjt(td), rows_kjt, exact=True, msg=f"td_to_kjt on {device}")
    return paritykit.assert_td_kjt_parity(module, td, route=case.route)


def run_cases(device: str, examples: int, seed: int) -> int:
    """Run ``examples`` drawn cases on ``device``; returns how many ran (raises on the first failure)."""
    from hypothesis import HealthCheck, Phase, given, seed as fixed_seed, settings

    from paritykit.checks.td_kjt.cases import eager_cases

    ran = []

    @fixed_seed(seed)
    @settings(max_examples=examples, deadline=None, database=None, phases=(Phase.generate, Phase.shrink),
              suppress_health_check=list(HealthCheck))
    @given(eager_cases())
    def each(case) -> None:
        run_case(case, device)
        ran.append(case)

    each()
    return len(ran)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), required=True)
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.examples < 1:
        parser.error(f"--examples must be at least 1, got {args.examples}")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("eager_td_kjt: --device cuda, but torch sees no CUDA device here", file=sys.stderr)
        return 2
    try:
        ran = run_cases(args.device, args.examples, args.seed)
    except AssertionError as exc:
        print(f"eager_td_kjt: FAILED on {args.device}: {exc}", file=sys.stderr)
        return 1
    print(f"eager TD/KJT parity on {args.device}: {ran} cases passed (seed {args.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
