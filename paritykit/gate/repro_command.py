"""`paritykit repro` and `paritykit plant`, and what a report adds to its findings (their scripts and
the known issues their configurations match).

    paritykit repro ebc-row-wise-mean-beside-other-placements -o repro.py   # a known issue's script
    paritykit repro F1 --from out/ -o f1.py        # a finding (or a case's short id) of a gate report
    paritykit repro --refresh-prelude              # the hand-written scripts' shared prelude, rewritten from its source
    paritykit plant NAME -- python f1.py           # run a command with a planted bug in every process
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from paritykit.errors import HarnessError
from paritykit.gate.findings import Finding
from paritykit.gate.outputs import require_writable_file
from paritykit.gate.repro import REPOSITORY_REPROS, handwritten_script, refresh_preludes, script_text, write_script

PLANT_SITE = Path(__file__).with_name("plant_site")
PLANTS_ENV = "PARITYKIT_PLANTS"
SCRIPTS_DIR = "repro"


def known_issue_title(issue_id: str) -> str:
    from paritykit.checks import known_issues

    entry = next((i for i in known_issues.load(known_issues.active_file()) if i.id == issue_id), None)
    if entry is None:
        return f"known torchrec issue {issue_id}"
    lines = [f"Known torchrec issue {issue_id} (listed for {entry.listed_for()}"
             + (f", fixed in {', '.join(f'{p} {v}' for p, v in entry.fixed_in.items())}" if entry.fixed_in else "") + ").",
             "", f"{entry.reason}."]
    if entry.workaround:
        lines += ["", f"What to do instead: {entry.workaround}."]
    return "\n".join(lines)


def finding_title(finding: Finding) -> str:
    case = finding.smallest
    return "\n".join([f"{finding.what_differs()}.", "", f"First divergence: {finding.divergence.location()}.", "",
                      f"Found by paritykit's {case.check} check, case {case.short_id}: {case.case_id[:300]}"])


def _report_data(source: Path | None) -> dict:
    path = Path(source) if source is not None else Path("report.json")
    path = path / "report.json" if path.is_dir() else path
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise HarnessError(f"--from {path}: cannot read a paritykit report.json ({exc}); give the report of the run "
                           "the case comes from, or a known issue's id") from exc


def _from_report(case: str, source: Path | None) -> tuple[dict, str]:
    """(configuration, title) of a finding id or a case (short or full id) in a report."""
    from paritykit.gate.report import report_from_json

    data = _report_data(source)
    report = report_from_json(json.dumps(data))
    findings = report.findings()
    finding = next((f for f in findings if f.id == case), None)
    finding = finding or next((f for f in findings if any(case in (c.short_id, c.case_id) for c in f.cases)), None)
    result = finding.smallest if finding and finding.id == case else next(
        (c for c in report.cases if case in (c.short_id, c.case_id)), None)
    if result is None:
        raise HarnessError(f"{case!r} is neither a finding nor a case of that report, nor a known issue's id")
    if not result.configuration:
        raise HarnessError(f"case {result.short_id} carries no configuration a torch-and-torchrec script can be written "
                           f"from (its check records none, or it did not fail)")
    title = finding_title(finding) if finding else f"paritykit case {result.short_id}: {result.case_id[:300]}"
    return result.configuration, title


def _known_issue_script(issue_id: str, templated: dict) -> str | None:
    """The script of a known issue's id: written from its registered configuration, or the committed
    hand-written one; None for something that is not a known issue's id."""
    from paritykit.checks import known_configurations, known_issues

    if issue_id in templated:
        return script_text(known_configurations.reproduction(issue_id), known_issue_title(issue_id))
    if any(issue.id == issue_id for issue in known_issues.load(known_issues.active_file())):
        return handwritten_script(issue_id)
    return None


def run_repro(args: argparse.Namespace) -> int:
    from paritykit.checks import known_configurations, known_issues

    known = known_configurations.registered()
    templated = {i: k for i, k in known.items() if k.reproduction is not None}
    if getattr(args, "refresh_prelude", False):
        changed = refresh_preludes()
        print(f"rewrote the prelude of {len(changed)} script(s) in {REPOSITORY_REPROS}" +
              "".join(f"\n  {path.name}" for path in changed), file=sys.stderr)
        return 0
    if args.list:
        for issue in sorted((i for i in known_issues.load(known_issues.active_file()) if i.id), key=lambda i: i.id):
            print(f"{issue.id:<48} {issue.check:<12} {'generated' if issue.id in templated else 'hand-written'}")
        return 0
    if not args.case:
        raise HarnessError("paritykit repro CASE: give a known issue's id (--list), or a finding or case id with --from REPORT")
    text = _known_issue_script(args.case, templated) if args.source is None else None
    if text is None:
        if args.source is None and not Path("report.json").exists():
            raise HarnessError(f"{args.case!r} is not a known issue's id (`paritykit repro --list`), and no report was given "
                               "(--from REPORT) to find it in as a finding or a case")
        configuration, title = _from_report(args.case, args.source)
        text = script_text(configuration, title)
    if args.output is None:
        sys.stdout.write(text)
        return 0
    require_writable_file(args.output, "-o")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(f"wrote {args.output}: run it with the python that has torch and torchrec; exit 0 when torchrec computes "
          "what its oracle says, 1 when it does not (it prints what differs), 2 when it cannot run", file=sys.stderr)
    return 0


def run_plant(args: argparse.Namespace) -> int:
    """Run a command with planted bugs applied in it and in every Python process it starts."""
    from paritykit.gate.selftest import catalog

    names = [name for name in args.plants.split(",") if name]
    unknown = [name for name in names if name not in catalog()]
    if not names or unknown:
        raise HarnessError(f"unknown planted bug(s) {unknown or names}; `paritykit selftest --list` shows the catalog")
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise HarnessError("paritykit plant NAME -- COMMAND: give the command to run")
    env = dict(os.environ, **{PLANTS_ENV: ",".join(names)})
    env["PYTHONPATH"] = os.pathsep.join([str(PLANT_SITE)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    try:
        return subprocess.run(command, env=env).returncode
    except OSError as exc:
        raise HarnessError(f"cannot run {command[0]!r}: {exc}") from exc


def attach_to_report(report, directory: Path | None) -> None:
    """The known issues each finding's smallest configuration matches, and (with a report directory)
    each finding's standalone script under ``repro/``."""
    from paritykit.checks import known_configurations

    for finding in report.findings():
        configuration = finding.smallest.configuration
        if not configuration:
            continue
        try:
            matches = known_configurations.matching(configuration, check=finding.smallest.check)
            report.known_issue_matches[finding.smallest.short_id] = [m.issue.id for m in matches]
            if directory is not None:
                relative = f"{SCRIPTS_DIR}/{finding.id}.py"
                write_script(Path(directory) / relative, configuration, finding_title(finding))
                report.scripts[finding.id] = relative
        except Exception as exc:  # noqa: BLE001 - the run's results are written whatever happens to one extra
            report.notes.append(f"finding {finding.id}: no standalone script or known-issue match ({type(exc).__name__}: {exc})")
