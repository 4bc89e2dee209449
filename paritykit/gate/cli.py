"""`paritykit gate | selftest | fixtures | bench | info` (the command-line contract is in DESIGN.md).

Exit codes of `gate`: 0 every selected check passed; 1 a parity failure (a crashed or hung rank
included: that is a failure of the code under test), or under `--strict` a known-issues file that
no longer matches what reproduces; 2 the harness or environment could not run a check (unknown or
missing check, `--device cuda` without a GPU, bad arguments, an exception raised by paritykit's
own code, missing golden fixtures under `--strict`). docs/gate.md states the rule.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import traceback
from typing import Any, Iterator
from pathlib import Path

from paritykit.checks import known_issues
from paritykit.checks.runner import DEFAULT_HOSTS, default_hosts
from paritykit.errors import HarnessError
from paritykit.harness.devices import resolve_device
from paritykit.harness.noise import quiet_known_noise
from paritykit.harness.versions import installed_versions

EXIT_OK, EXIT_PARITY_FAILURE, EXIT_HARNESS_ERROR = 0, 1, 2

# The default gate must finish within minutes on a 2-core machine.
DEFAULT_EXAMPLES = 50
DEFAULT_WORLD_SIZES = (1, 2)
HYPOTHESIS_STORAGE_ENV = "HYPOTHESIS_STORAGE_DIRECTORY"


def main(argv: list[str] | None = None) -> int:
    quiet_known_noise()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with hypothesis_storage_outside_cwd():
            return args.handler(args)
    except HarnessError as exc:
        print(f"paritykit: error: {exc}", file=sys.stderr)
        return EXIT_HARNESS_ERROR
    except Exception:  # noqa: BLE001 - paritykit's own code failed: a harness error, never torchrec's
        print(f"paritykit: internal error (a harness error):\n{traceback.format_exc()}", file=sys.stderr)
        return EXIT_HARNESS_ERROR


@contextlib.contextmanager
def hypothesis_storage_outside_cwd() -> Iterator[None]:
    """Hypothesis caches unicode tables and mined constants under ./.hypothesis; a gate or a
    self-test leaves nothing in the directory it is run from. Its ranks inherit the setting.
    A storage directory the user chose (HYPOTHESIS_STORAGE_DIRECTORY) is kept."""
    if os.environ.get(HYPOTHESIS_STORAGE_ENV):
        yield
        return
    from hypothesis import configuration

    set_home = getattr(configuration, "set_hypothesis_home_dir", None)
    with tempfile.TemporaryDirectory(prefix="paritykit-hypothesis-") as scratch:
        os.environ[HYPOTHESIS_STORAGE_ENV] = scratch
        if set_home is not None:
            set_home(scratch)
        try:
            yield
        finally:
            del os.environ[HYPOTHESIS_STORAGE_ENV]
            if set_home is not None:
                set_home(None)


def build_parser() -> argparse.ArgumentParser:
    from paritykit.checks import ALIASES, CHECK_PACKAGES

    parser = argparse.ArgumentParser(prog="paritykit", description="Numerical-parity checks for TorchRec")
    sub = parser.add_subparsers(dest="command", required=True)

    _add_gate_parser(sub, list(CHECK_PACKAGES) + list(ALIASES))

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
    fixtures.add_argument("--dir", type=Path, default=None, help="fixture directory (default: the fixtures shipped with paritykit)")
    fixtures.set_defaults(handler=run_fixtures)

    from paritykit.gate.instrument_cli import add_coverage_parser, add_mutate_parser

    add_coverage_parser(sub, examples=DEFAULT_EXAMPLES, positive_int=_positive_int, world_sizes=_world_sizes, host_layouts=_host_layouts)
    add_mutate_parser(sub, examples=DEFAULT_EXAMPLES, positive_int=_positive_int, world_sizes=_world_sizes, host_layouts=_host_layouts)

    info = sub.add_parser("info", help="print versions, device and available backends")
    info.set_defaults(handler=run_info)

    repro = sub.add_parser("repro", help="write a standalone torch+torchrec script that reproduces a known issue or a finding")
    repro.add_argument("case", nargs="?", help="a known issue's id, or a finding id (F1) or case id of a report (--from)")
    repro.add_argument("--from", dest="source", type=Path, default=None, metavar="REPORT",
                       help="the gate's report.json (or its directory) the finding or case is in")
    repro.add_argument("-o", "--output", type=Path, default=None, metavar="FILE", help="write the script here (default: print it)")
    repro.add_argument("--list", action="store_true", help="list the known issues that have a reproduction")
    repro.add_argument("--refresh-prelude", action="store_true",
                       help="rewrite the shared prelude block of every hand-written script in repros/ from its one source")
    repro.set_defaults(handler=run_repro)

    plant = sub.add_parser("plant", help="run a command with planted bugs applied in it and in every Python process it starts")
    plant.add_argument("plants", metavar="NAME[,NAME]", help="planted bug(s) (`paritykit selftest --list`)")
    plant.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS]: e.g. -- python repro.py")
    plant.set_defaults(handler=run_plant)
    return parser


def _add_gate_parser(sub: Any, checks: list[str]) -> None:
    gate = sub.add_parser("gate", help="run the parity matrix and answer pass/fail")
    gate.add_argument("--check", action="append", choices=checks, help="a check to run (repeatable); default: all")
    gate.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    gate.add_argument("--world-size", type=_world_sizes, default=None, help="N or a list such as 1,2,4 (default: 1,2)")
    gate.add_argument("--hosts", type=_host_layouts, default=None, metavar="HxR[,HxR...]|none",
                      help="also run the checks whose placements depend on hosts (sharding) on ranks standing for H hosts "
                           f"of R ranks each (default: {','.join(map(str, DEFAULT_HOSTS))}; none under torchrun, where the "
                           "launch's own hosts apply)")
    gate.add_argument("--examples", type=_positive_int, default=DEFAULT_EXAMPLES, help="hypothesis examples per property")
    gate.add_argument("--seed", type=int, default=0)
    gate.add_argument("--report", type=Path, default=None, metavar="DIR", help="write report.md, report.json, junit.xml here")
    gate.add_argument("--known-issues", type=Path, default=known_issues.DEFAULT_FILE, metavar="FILE")
    gate.add_argument("--strict", action="store_true",
                      help="also fail when the known-issues file does not match what reproduces, or golden fixtures are missing")
    gate.add_argument("--no-shrink", action="store_true", help="report the first failing example without shrinking it")
    gate.add_argument("--case", action="append", default=None, metavar="ID",
                      help="run only this case (its short id from a report, or its full id); repeatable")
    gate.add_argument("--compare-to", type=Path, default=None, metavar="REPORT_JSON",
                      help="compare with an older gate's report.json: new failures, fixed known issues, metrics that moved")
    gate.add_argument("--fixtures-dir", type=Path, default=None, metavar="DIR", help="golden fixtures to verify (default: those shipped)")
    gate.set_defaults(handler=run_gate)


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


def _host_layouts(text: str):
    """"2x2" or "2x2,3x2" (hosts x ranks per host, at least two hosts), or "none"."""
    from paritykit.harness.hosts import HostLayout

    if text.strip().lower() == "none":
        return ()
    try:
        layouts = tuple(HostLayout.parse(part) for part in text.split(","))
    except HarnessError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    single = [str(layout) for layout in layouts if layout.hosts < 2]
    if single:
        raise argparse.ArgumentTypeError(f"--hosts takes layouts of at least two hosts, got {single}: "
                                         "one host of N ranks is --world-size N")
    return tuple(dict.fromkeys(layouts))


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
    from paritykit.dist.capacity import describe_host
    from paritykit.harness.cpu_shim import shim_needed, shim_patches

    for key, value in environment().items():
        print(f"{key:<16} {value}")
    print(f"{'checks':<16} {', '.join(available_checks())}")
    print("rank capacity (how many ranks a RankPool may start here):")
    for line in describe_host().splitlines():
        print(f"  {line}")
    if shim_needed():
        needed = [p.name for p in shim_patches() if p.needed]
        print(f"{'cpu stream shim':<16} patches {', '.join(needed) or 'nothing'} (what this torch/torchrec lack on CPU); "
              "anything else torchrec reaches there is a harness error")
    return EXIT_OK


def run_gate(args: argparse.Namespace) -> int:
    from paritykit.checks import CHECK_PACKAGES
    from paritykit.checks.runner import GateConfig
    from paritykit.dist import PoolProvider
    from paritykit.gate.gating import run_checks
    from paritykit.gate.outputs import require_writable_directory
    from paritykit.gate.report import REPORT_FILES

    if args.report is not None:
        # Before anything runs: a report that cannot be written must not cost the whole run.
        require_writable_directory(args.report, "--report", REPORT_FILES)
    device = resolve_device(args.device)
    config = GateConfig(
        device=device,
        world_sizes=args.world_size or DEFAULT_WORLD_SIZES,
        hosts=default_hosts() if args.hosts is None else args.hosts,
        examples=args.examples,
        seed=args.seed,
        report_dir=args.report,
        shrink=not args.no_shrink,
        case=None if not args.case else args.case[0] if len(args.case) == 1 else tuple(args.case),
        fixtures_dir=args.fixtures_dir,
        strict=args.strict,
    )
    old = _old_report(args.compare_to)
    reporting = _is_reporting_rank()
    with PoolProvider(device=device) as pools:
        cases, judgement = run_checks(args.check or list(CHECK_PACKAGES), config, pools, args.known_issues, progress=reporting)
    return _report_gate(args, cases, judgement, old, reporting)


def _old_report(path: Path | None):
    """The report --compare-to names, read before the run so a bad path fails in seconds."""
    from paritykit.gate.report import report_from_json

    if path is None:
        return None
    try:
        return report_from_json(Path(path).read_text())
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise HarnessError(f"--compare-to {path}: cannot read it as a paritykit report.json: {exc}") from exc


def _report_gate(args: argparse.Namespace, cases, judgement, old, reporting: bool) -> int:
    from paritykit.gate import compare
    from paritykit.gate.repro_command import attach_to_report
    from paritykit.gate.report import Report, render_terminal, write_report

    report = Report(cases=cases, environment=environment())
    report.notes += judgement.notes(installed_versions(), args.known_issues)
    missing_fixtures = [c for c in cases if c.check == "fixtures" and c.case_id == "<fixtures>"]
    report.notes += [f"golden fixtures missing (a skip, an error under --strict): {c.message}" for c in missing_fixtures]
    if old is not None:
        report.comparison = compare.compare(old.cases, cases, str(args.compare_to), old.environment)
    if reporting:
        attach_to_report(report, args.report)
        print(render_terminal(report))
        if args.report is not None:
            for path in write_report(report, args.report):
                print(f"wrote {path}")
    code = report.exit_code()
    if code == EXIT_OK and args.strict and judgement.strict_failures:
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
        from paritykit.gate.outputs import require_writable_directory

        require_writable_directory(directory, "--dir" if args.dir else "the shipped fixtures directory")
        key = fixtures.stack_key(installed_versions())
        print(f"wrote {fixtures.record(directory)}: goldens of stack {key}. Goldens pin the numbers every later "
              "gate is held to: record them only on a stack you trust, never on a release under test.")
        return EXIT_OK
    report = Report(cases=fixtures.verify(directory))
    print(render_terminal(report))
    return report.exit_code()


def run_selftest(args: argparse.Namespace) -> int:
    from paritykit.gate.selftest import run_selftest_command

    return run_selftest_command(args.plant, args.list, resolve_device(args.device), args.examples, args.clean_seeds)


def run_repro(args: argparse.Namespace) -> int:
    from paritykit.gate.repro_command import run_repro as repro

    return repro(args)


def run_plant(args: argparse.Namespace) -> int:
    from paritykit.gate.repro_command import run_plant as plant

    return plant(args)


if __name__ == "__main__":
    sys.exit(main())
