"""The command lines of the two instruments that measure the checks themselves:

    paritykit coverage [--check NAME ...] [--device D] [--world-size N[,M]] [--examples N] [--seed S] [--case ID ...] --report DIR
    paritykit mutate [--sample N] [--seed S] [--report DIR] [--coverage DIR] ...

docs/coverage.md says what each measures and how to read it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from paritykit.checks import known_issues

DEFAULT_COVERAGE_DIR = Path("paritykit-coverage")


def add_gate_run_options(parser: argparse.ArgumentParser, *, examples: int, positive_int, world_sizes, host_layouts) -> None:
    """The gate's own options that say which cases run (same meaning as under `paritykit gate`)."""
    from paritykit.checks import ALIASES, CHECK_PACKAGES

    parser.add_argument("--check", action="append", choices=list(CHECK_PACKAGES) + list(ALIASES),
                        help="a check to run (repeatable); default: all")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--world-size", type=world_sizes, default=None, help="N or a list such as 1,2,4 (default: 1,2)")
    parser.add_argument("--hosts", type=host_layouts, default=None, metavar="HxR[,HxR...]|none",
                        help="ranks standing for H hosts of R ranks, as under `paritykit gate` (default: the gate's)")
    parser.add_argument("--examples", type=positive_int, default=examples, help="hypothesis examples per property")
    parser.add_argument("--known-issues", type=Path, default=known_issues.DEFAULT_FILE, metavar="FILE")


def add_coverage_parser(sub, *, examples: int, positive_int, world_sizes, host_layouts) -> None:
    coverage = sub.add_parser("coverage", help="run the gate under coverage.py over the installed torchrec, per case")
    add_gate_run_options(coverage, examples=examples, positive_int=positive_int, world_sizes=world_sizes, host_layouts=host_layouts)
    coverage.add_argument("--seed", type=int, default=0)
    coverage.add_argument("--report", type=Path, default=DEFAULT_COVERAGE_DIR, metavar="DIR",
                          help=f"where the data and reports go (default: ./{DEFAULT_COVERAGE_DIR})")
    coverage.add_argument("--no-html", action="store_true", help="skip coverage.py's HTML and JSON reports")
    coverage.add_argument("--case", action="append", default=None, metavar="ID",
                          help="measure only this case (its short id from a report, or its full id); repeatable")
    coverage.set_defaults(handler=run_coverage_command)


def run_coverage_command(args: argparse.Namespace) -> int:
    from paritykit.checks import CHECK_PACKAGES
    from paritykit.checks.runner import GateConfig
    from paritykit.gate.coverage_run import run_coverage
    from paritykit.gate.coverage_summary import terminal_lines, write_coverage_reports, write_summary
    from paritykit.harness.devices import resolve_device

    device = resolve_device(args.device)
    from paritykit.checks.runner import default_hosts

    hosts = default_hosts() if getattr(args, "hosts", None) is None else args.hosts
    config = GateConfig(device=device, world_sizes=args.world_size or (1, 2), hosts=hosts, examples=args.examples, seed=args.seed,
                        case=tuple(args.case) if args.case else None)
    names = args.check or list(CHECK_PACKAGES)
    cases = run_coverage(names, config, args.report, args.known_issues)
    if not args.no_html:
        write_coverage_reports(args.report)
    summary = write_summary(args.report)
    failed = [case for case in cases if case.status in ("fail", "error")]
    for line in terminal_lines(summary):
        print(line)
    print(f"{len(cases)} cases ({len(failed)} failed or errored); wrote {args.report}/summary.md, "
          f"{args.report}/coverage.json, {args.report}/html/")
    return 1 if failed else 0


DEFAULT_MUTATE_DIR = Path("paritykit-mutants")
DEFAULT_MAX_CASES = 6


def add_mutate_parser(sub, *, examples: int, positive_int, world_sizes, host_layouts) -> None:
    mutate = sub.add_parser("mutate", help="mutants of the installed torchrec on covered lines, against the cases covering them")
    mutate.add_argument("--sample", type=positive_int, default=None, metavar="N",
                        help="a uniform sample of N mutants (default: every mutant in scope)")
    mutate.add_argument("--seed", type=int, default=0, help="the sample's seed")
    mutate.add_argument("--report", type=Path, default=DEFAULT_MUTATE_DIR, metavar="DIR",
                        help=f"where mutants.json and survivors.md go (default: ./{DEFAULT_MUTATE_DIR})")
    mutate.add_argument("--coverage", type=Path, default=None, metavar="DIR",
                        help="a `paritykit coverage --report DIR` run to use (default: make one in REPORT/coverage)")
    mutate.add_argument("--max-cases", type=positive_int, default=DEFAULT_MAX_CASES,
                        help="cases replayed per mutant, chosen among those covering its line")
    mutate.add_argument("--timeout", type=float, default=None, metavar="S",
                        help="seconds per mutant (default: 120 + 4x the covering cases' measured time)")
    mutate.add_argument("--jobs", type=positive_int, default=1, help="mutants run at once")
    mutate.add_argument("--resume", action="store_true",
                        help="reuse the outcomes journaled in REPORT by an interrupted run with the same arguments")
    mutate.add_argument("--again", type=Path, default=None, metavar="EARLIER",
                        help="instead of a sample, run the survivors of the earlier report EARLIER again (after "
                             "comparisons were added: which of them are killed now)")
    add_gate_run_options(mutate, examples=examples, positive_int=positive_int, world_sizes=world_sizes, host_layouts=host_layouts)
    mutate.set_defaults(handler=run_mutate_command)


def run_mutate_command(args: argparse.Namespace) -> int:
    from paritykit.gate.coverage_run import prepare_directory
    from paritykit.gate.mutate import earlier_survivors, run_sample, summary_lines, write_report

    prepare_directory(args.report)  # before anything runs: a report that cannot be written fails now
    again = earlier_survivors(args.again) if args.again is not None else None
    coverage_dir = args.coverage
    if coverage_dir is None:
        # The gate's default seed for the coverage run: --seed draws the sample.
        coverage_dir = args.report / "coverage"
        run_coverage_command(argparse.Namespace(**{**vars(args), "report": coverage_dir, "seed": 0, "no_html": True}))
    result = run_sample(coverage_dir, args.sample, args.seed, max_cases=args.max_cases, timeout_s=args.timeout,
                        jobs=args.jobs, progress=lambda line: print(line, flush=True), journal_dir=args.report,
                        resume=args.resume, again=again)
    written = write_report(result, args.report)
    print(f"wrote {', '.join(str(path) for path in written)}")
    for line in summary_lines(result):
        print(line)
    return 0
