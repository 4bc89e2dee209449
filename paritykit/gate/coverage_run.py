"""`paritykit coverage`: the gate run under coverage.py, in the caller and in every rank, one dynamic
context per case, so that each torchrec line is known by the cases that ran it.

Output directory:
  coveragerc          the coverage.py configuration used (torchrec's files in scope)
  .coverage           coverage.py's data, combined from every process, contexts included
  cases.json          every case: its context label, check, id, status, duration, the check's oracle
  html/, coverage.json  coverage.py's own reports, with the contexts of every line
  summary.md, summary.json  per area: lines executed, and executed under an oracle (coverage_summary)

``paritykit mutate`` reads cases.json and .coverage to pick the cases that cover a mutated line.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from paritykit.checks import load_check
from paritykit.checks.results import CaseResult
from paritykit.checks.runner import GateConfig
from paritykit.errors import HarnessError
from paritykit.gate.coverage_scope import coverage_config, torchrec_dir
from paritykit.harness import line_coverage

CONFIG_FILE, DATA_FILE, CASES_FILE = "coveragerc", ".coverage", "cases.json"


@dataclass(frozen=True)
class CoveredCase:
    """One case of the measured run, as the coverage data names it."""

    label: str  # the dynamic context: "<check>|<short id>"
    check: str
    case_id: str
    short_id: str
    status: str
    duration_s: float
    oracle: str | None

    @property
    def compared_with_oracle(self) -> bool:
        """A passing case of a check whose oracle is independent of torchrec."""
        return self.oracle is not None and self.status == "pass"


def prepare_directory(out_dir: Path) -> Path:
    """The output directory, created and checked writable before anything runs; stale data removed."""
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / ".paritykit-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise HarnessError(f"cannot write the coverage report to {out_dir}: {exc}") from exc
    for stale in out_dir.glob(f"{DATA_FILE}*"):
        stale.unlink()
    return out_dir


def run_coverage(names: list[str], config: GateConfig, out_dir: Path, known_issues_file: Path,
                 *, progress: bool = True) -> list[CoveredCase]:
    """Run the gate's ``names`` checks under coverage.py; returns the cases, writes the data."""
    from paritykit.dist import PoolProvider
    from paritykit.gate.gating import run_checks

    if "torchrec" in sys.modules:
        # Its module-level lines ran before measuring began and would count as never executed.
        raise HarnessError("torchrec was imported before coverage started: run `paritykit coverage` in a fresh process")
    out_dir = prepare_directory(out_dir)
    root = torchrec_dir()
    (out_dir / CONFIG_FILE).write_text(coverage_config(root))
    line_coverage.start(str(out_dir / CONFIG_FILE), str(out_dir / DATA_FILE))
    try:
        with PoolProvider(device=config.device) as pools:
            results, _ = run_checks(names, config, pools, known_issues_file, progress=progress)
    finally:
        line_coverage.stop()  # the pools are closed: every rank has saved its data
    cases = [covered_case(result) for result in results]
    _combine(out_dir)
    (out_dir / CASES_FILE).write_text(json.dumps({"config": _config_json(config, names),
                                                  "cases": [asdict(case) for case in cases]}, indent=1))
    return cases


def covered_case(result: CaseResult) -> CoveredCase:
    return CoveredCase(label=f"{result.check}|{result.short_id}", check=result.check, case_id=result.case_id,
                       short_id=result.short_id, status=result.status, duration_s=round(result.duration_s, 3),
                       oracle=load_check(result.check).oracle)


def _config_json(config: GateConfig, names: list[str]) -> dict[str, Any]:
    from paritykit.harness.versions import installed_versions

    return {"checks": names, "device": config.device, "world_sizes": list(config.world_sizes),
            "hosts": [str(layout) for layout in config.hosts],
            "examples": config.examples, "seed": config.seed, "torchrec_root": str(torchrec_dir()),
            "cases": None if config.case is None else list((config.case,) if isinstance(config.case, str) else config.case),
            "versions": installed_versions()}


def measured_root(gate: dict[str, Any]) -> Path:
    """Where the measured torchrec lay; HarnessError when this environment has another torchrec version
    (its lines would not be the measured ones)."""
    from paritykit.harness.versions import installed_versions

    here = installed_versions().get("torchrec")
    measured = gate.get("versions", {}).get("torchrec")
    if measured != here:
        raise HarnessError(f"the coverage run measured torchrec {measured}, this environment has torchrec {here}: "
                           "run `paritykit coverage` here first")
    return Path(gate.get("torchrec_root") or torchrec_dir())


def _combine(out_dir: Path) -> None:
    import coverage

    cov = coverage.Coverage(config_file=str(out_dir / CONFIG_FILE), data_file=str(out_dir / DATA_FILE))
    cov.combine(data_paths=[str(out_dir)], keep=False)
    cov.save()


def load_cases(out_dir: Path) -> tuple[dict[str, Any], list[CoveredCase]]:
    """(the run's gate arguments, its cases) from a coverage directory; HarnessError if there is none."""
    path = Path(out_dir) / CASES_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise HarnessError(f"{path}: no coverage run here (run `paritykit coverage --report {out_dir}` first): {exc}") from exc
    return data["config"], [CoveredCase(**case) for case in data["cases"]]


def load_data(out_dir: Path) -> Any:
    """coverage.py's Coverage object over a coverage directory's combined data."""
    import coverage

    cov = coverage.Coverage(config_file=str(Path(out_dir) / CONFIG_FILE), data_file=str(Path(out_dir) / DATA_FILE))
    cov.load()
    return cov
