"""`paritykit gate | info` (the command-line contract is in DESIGN.md).

Exit codes of `gate`: 0 every selected check passed; 1 a parity failure (a crashed or hung rank
included: that is a failure of the code under test); 2 the harness or environment could not run a
check (unknown or missing check, `--device cuda` without a GPU, bad arguments).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from paritykit.errors import HarnessError
from paritykit.gate import known_issues
from paritykit.harness.devices import resolve_device
from paritykit.harness.noise import quiet_known_noise
from paritykit.harness.versions import installed_versions

EXIT_OK, EXIT_PARITY_FAILURE, EXIT_HARNESS_ERROR = 0, 1, 2

# The default gate must finish within minutes on a 2-core machine.
DEFAULT_EXAMPLES = 50
DEFAULT_WORLD_SIZES = (1, 2)


def main(argv: list[str] | None = None) -> int:
    quiet_known_noise()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except HarnessError as exc:
        print(f"paritykit: error: {exc}", file=sys.stderr)
        return EXIT_HARNESS_ERROR


def build_parser() -> argparse.ArgumentParser:
    from paritykit.checks import CHECK_PACKAGES

    parser = argparse.ArgumentParser(prog="paritykit", description="Numerical-parity checks for TorchRec")
    sub = parser.add_subparsers(dest="command", required=True)

    gate = sub.add_parser("gate", help="run the parity matrix and answer pass/fail")
    gate.add_argument("--check", action="append", choices=list(CHECK_PACKAGES), help="a check to run (repeatable); default: all")
    gate.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    gate.add_argument("--world-size", type=_world_sizes, default=None, help="N or a list such as 1,2,4 (default: 1,2)")
    gate.add_argument("--examples", type=_positive_int, default=DEFAULT_EXAMPLES, help="hypothesis examples per property")
    gate.add_argument("--seed", type=int, default=0)
    gate.add_argument("--report", type=Path, default=None, metavar="DIR", help="write report.md, report.json, junit.xml here")
    gate.add_argument("--known-issues", type=Path, default=known_issues.DEFAULT_FILE, metavar="FILE")
    gate.add_argument("--strict", action="store_true", help="fail when a listed known issue no longer reproduces")
    gate.add_argument("--no-shrink", action="store_true", help="report the first failing example without shrinking it")
    gate.set_defaults(handler=run_gate)

    selftest = sub.add_parser("selftest", help="show which check catches each planted bug, and count false alarms")
    selftest.add_argument("--plant", action="append", help="a planted bug to run (repeatable); default: the whole catalog")
    selftest.add_argument("--list", action="store_true", help="list the catalog and exit")
    selftest.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    selftest.add_argument("--examples", type=_positive_int, default=3)
    selftest.add_argument("--clean-seeds", type=int, default=2, help="clean runs of every check, one per seed (0: none)")
    selftest.set_defaults(handler=run_selftest)

    bench = sub.add_parser("bench", help="run the benchmarks in the repository's bench/ (ratios measured in one run)")
    bench.add_argument("names", nargs="*", help="benchmarks to run, e.g. convert sync_guard rank_pool (default: all)")
    bench.set_defaults(handler=run_bench)

    fixtures = sub.add_parser("fixtures", help="record or verify the golden fixtures")
    fixtures.add_argument("action", choices=("record", "verify"))
    fixtures.add_argument("--dir", type=Path, default=None, help="fixture directory (default: the repository's fixtures/)")
    fixtures.set_defaults(handler=run_fixtures)

    info = sub.add_parser("info", help="print versions, device and available backends")
    info.set_defaults(handler=run_info)
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _world_sizes(text: str) -> tuple[int, ...]:
    """Any positive world size: what a size needs (memory, GPUs, a torchrun launch of that size) is
    checked where its ranks start, with the numbers of the host (paritykit.dist.capacity)."""
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"world size must be N or N,M,...; got {text!r}") from None
    bad = [s for s in sizes if s < 1]
    if bad:
        raise argparse.ArgumentTypeError(f"world sizes must be positive, got {bad}")
    return tuple(dict.fromkeys(sizes))


def environment() -> dict[str, str]:
    import platform

    import torch

    env = {"python": platform.python_version(), "platform": platform.platform()}
    env.update(installed_versions())
    env["cuda available"] = str(torch.cuda.is_available())
    if torch.cuda.is_available():
        env["cuda devices"] = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    import torch.distributed as dist

    env["backends"] = ", ".join(b for b in ("gloo", "nccl", "mpi") if getattr(dist, f"is_{b}_available")())
    return env


def run_info(args: argparse.Namespace) -> int:
    from paritykit.checks import available_checks

    for key, value in environment().items():
        print(f"{key:<16} {value}")
    print(f"{'checks':<16} {', '.join(available_checks())}")
    return EXIT_OK


def run_gate(args: argparse.Namespace) -> int:
    from paritykit.checks import CHECK_PACKAGES
    from paritykit.checks.runner import GateConfig
    from paritykit.dist import PoolProvider
    from paritykit.gate.gating import run_checks
    from paritykit.gate.report import Report, render_terminal, write_report

    device = resolve_device(args.device)
    config = GateConfig(
        device=device,
        world_sizes=args.world_size or DEFAULT_WORLD_SIZES,
        examples=args.examples,
        seed=args.seed,
        report_dir=args.report,
        shrink=not args.no_shrink,
    )
    with PoolProvider(device=device) as pools:
        cases, stale = run_checks(args.check or list(CHECK_PACKAGES), config, pools, args.known_issues, progress=True)
    report = Report(cases=cases, environment=environment())
    for issue in stale:
        report.notes.append(f"known issue no longer reproduces: {issue.check} {issue.case!r}: {issue.reason}")
    if _is_reporting_rank():
        print(render_terminal(report))
        if args.report is not None:
            for path in write_report(report, args.report):
                print(f"wrote {path}")
    code = report.exit_code()
    if code == EXIT_OK and args.strict and stale:
        return EXIT_PARITY_FAILURE
    return code


def _is_reporting_rank() -> bool:
    """Under torchrun every rank runs the gate; rank 0 alone prints and writes the report."""
    from paritykit.dist import launched_by_torchrun

    return not launched_by_torchrun() or os.environ.get("RANK") == "0"


def run_bench(args: argparse.Namespace) -> int:
    import subprocess

    bench_dir = Path(__file__).resolve().parents[2] / "bench"
    scripts = sorted(bench_dir.glob("bench_*.py"))
    if not scripts:
        raise HarnessError(f"no benchmarks at {bench_dir}: they live in the source repository, not in an installed wheel")
    available = {p.stem.removeprefix("bench_"): p for p in scripts}
    unknown = [n for n in args.names if n not in available]
    if unknown:
        raise HarnessError(f"unknown benchmark(s) {unknown}; available: {', '.join(available)}")
    for name in args.names or list(available):
        print(f"== {name}", flush=True)
        if subprocess.run([sys.executable, str(available[name])]).returncode != 0:
            raise HarnessError(f"benchmark {name} failed")
    return EXIT_OK


def run_fixtures(args: argparse.Namespace) -> int:
    from paritykit.checks.golden import store as fixtures
    from paritykit.gate.report import Report, render_terminal

    directory = args.dir or fixtures.DEFAULT_DIR
    if args.action == "record":
        print(f"wrote {fixtures.record(directory)}")
        return EXIT_OK
    report = Report(cases=fixtures.verify(directory))
    print(render_terminal(report))
    return report.exit_code()


def run_selftest(args: argparse.Namespace) -> int:
    from paritykit.gate.selftest import run_selftest_command

    return run_selftest_command(args.plant, args.list, resolve_device(args.device), args.examples, args.clean_seeds)


if __name__ == "__main__":
    sys.exit(main())
