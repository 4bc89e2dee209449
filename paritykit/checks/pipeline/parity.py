"""One case through the plain loop, the unsharded anchor and each named pipeline, with every verdict.

A ``PipelineCase`` is resolved in the caller (the sharding engine's ``build_setup``: plan and batches
checked before any rank runs). ``run_parity_case`` then:
1. trains the plain loop over the DMP model on the ranks (KJT batches);
2. anchors it: the same loop must match the UNSHARDED model (verdicts.assert_anchor), wherever the
   sharding engine's bound holds (verdicts.anchor_unsound says where it does not);
3. runs each pipeline on the ranks, with KJT batches, TD batches, or both (``inputs``), and holds
   it to its promise: exact pipelines equal the plain loop bit for bit, SemiSync is exact through
   ``start_batch`` and bounded after it, and a TD run equals the KJT run of the same pipeline (when
   both ran; a TD-only run is held to the plain KJT loop directly).
The first broken promise raises ParityError; with a ``report_dir`` every run still happens and the
report is written first.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from paritykit.checks.pipeline.comparison import (
    REFERENCE,
    DEFAULT_SEMI_SYNC_BOUNDS,
    PipelineParityResult,
    SemiSyncBounds,
    compare_pair,
    labels_of,
    predictions,
)
from paritykit.checks.pipeline.report_files import write_report
from paritykit.engine.pipeline_catalog import EXACT, IN_FLIGHT_AT_STOP, STOPS_WITH_DATA
from paritykit.engine.pipeline_runs import PipelineJob, pipeline_promise, run_pipeline, run_plain
from paritykit.checks.pipeline.td_input import check_td_batches, to_td_batches
from paritykit.checks.pipeline.verdicts import anchor_unsound, assert_anchor, assert_identical, assert_semi_sync
from paritykit.engine.reference import train_reference
from paritykit.engine.training import TrainingRecord, TrainingSetup
from paritykit.errors import HarnessError, ParityError
from paritykit.harness.sharded import gradient_division

EXACT_PROMISE = "the pipeline promises the plain loop's numbers exactly"
STOP_PROMISE = (f"with execute_all_batches=False the pipeline stops when the data runs out: the plain loop over all "
                f"but the last {IN_FLIGHT_AT_STOP} batches, exactly")
TD_PROMISE = "the same data as TensorDicts must give the same numbers as KJTs"


@dataclass(frozen=True)
class PipelineCase:
    """Everything one parity case runs: resolved setup, pipelines and options."""

    setup: TrainingSetup
    pipelines: tuple[str, ...]
    label: str
    # The batches the pipelines get: ("kjt",), ("td",) or ("kjt", "td").
    inputs: tuple[str, ...] = ("kjt",)
    td_batches: Any = None  # batches[step][rank] with TensorDict sparse features, when "td" is in inputs
    semi_sync_start_batch: int = 0
    semi_sync_bounds: SemiSyncBounds = DEFAULT_SEMI_SYNC_BOUNDS
    overlap_optimizer: bool = False
    anchor: bool = True

    def td_setup(self) -> TrainingSetup:
        return replace(self.setup, batches=self.td_batches)


def with_td_batches(case: PipelineCase, td_batches: Any = None) -> PipelineCase:
    """``case`` with its TD batches: given, or made from its KJT batches; checked before any rank runs."""
    td = td_batches if td_batches is not None else to_td_batches(case.setup.batches)
    check_td_batches(td, case.setup.model_fn())
    return replace(case, td_batches=td)


class _Verdicts:
    """Runs and verdicts of one case; keeps the first failure so that a report can still be written."""

    def __init__(self, case: PipelineCase, keep_going: bool) -> None:
        self.case, self.keep_going = case, keep_going
        self.result = PipelineParityResult(label=case.label)
        self.failure: ParityError | None = None
        self.labels = labels_of(case.setup.batches)

    def judge(self, check: Any, *args: Any) -> Any:
        """``check(*args)``: a ParityError is a finding; any other exception is paritykit's own."""
        try:
            return ours(check, *args)
        except ParityError as exc:
            if not self.keep_going:
                raise
            self.failure = self.failure or exc
            return None

    def record(self, name: str, run: TrainingRecord, reference: TrainingRecord, reference_name: str) -> None:
        self.result.runs[name] = run
        self.result.comparisons.append(ours(compare_pair, reference, run, (reference_name, name), self.labels))


def ours(function: Any, *args: Any) -> Any:
    """Run paritykit's own comparison code: an exception other than ParityError is a harness error (exit 2),
    never a finding about torchrec (torchrec's own code runs on the ranks or in train_reference)."""
    try:
        return function(*args)
    except (ParityError, HarnessError):
        raise
    except Exception as exc:  # noqa: BLE001 - whatever broke in paritykit's code
        raise HarnessError(f"paritykit's {getattr(function, '__name__', function)} failed: {type(exc).__name__}: {exc}") from exc


def _hold_to_promise(verdicts: _Verdicts, pipeline: str, run: TrainingRecord, reference: TrainingRecord, names: tuple[str, str]) -> None:
    case = verdicts.case
    promise = pipeline_promise(pipeline)
    if promise in (EXACT, STOPS_WITH_DATA) or names[0] != REFERENCE:
        said = {EXACT: EXACT_PROMISE, STOPS_WITH_DATA: STOP_PROMISE}[promise] if names[0] == REFERENCE else TD_PROMISE
        verdicts.judge(assert_identical, reference, run, names, said, case.setup)
    else:
        verdicts.judge(assert_semi_sync, reference, run, names, case.semi_sync_bounds, case.semi_sync_start_batch, verdicts.labels)


def _run_input(verdicts: _Verdicts, pool: Any, input_type: str, plain: TrainingRecord) -> None:
    case = verdicts.case
    both = set(case.inputs) == {"kjt", "td"}
    setup = case.td_setup() if input_type == "td" else case.setup
    suffix = "[td]" if input_type == "td" else ""
    if input_type == "td" and both:
        plain_td = predictions(run_plain(pool, setup, "plain[td]"))
        verdicts.record("plain[td]", plain_td, plain, REFERENCE)
        verdicts.judge(assert_identical, plain, plain_td, (REFERENCE, "plain[td]"), TD_PROMISE, case.setup)
    for pipeline in case.pipelines:
        name = pipeline + suffix
        run = run_pipeline(pool, PipelineJob(setup, pipeline, case.semi_sync_start_batch, case.overlap_optimizer), name)
        against = pipeline if (input_type == "td" and both) else REFERENCE
        reference = verdicts.result.runs[against] if against != REFERENCE else plain
        if against == REFERENCE and pipeline_promise(pipeline) == STOPS_WITH_DATA:
            against, reference = _stopped_plain(verdicts, pool, setup, suffix)
        verdicts.record(name, run, reference, against)
        _hold_to_promise(verdicts, pipeline, run, reference, (against, name))


def _stopped_plain(verdicts: _Verdicts, pool: Any, setup: TrainingSetup, suffix: str) -> tuple[str, TrainingRecord]:
    """The plain loop over all batches but the last IN_FLIGHT_AT_STOP (run once per case and input)."""
    name = f"plain[stopped]{suffix}"
    if name not in verdicts.result.runs:
        kept = replace(setup, batches=setup.batches[: max(len(setup.batches) - IN_FLIGHT_AT_STOP, 0)])
        verdicts.result.runs[name] = predictions(run_plain(pool, kept, name))
    return name, verdicts.result.runs[name]


def run_parity_case(case: PipelineCase, pool: Any, report_dir: Path | str | None = None) -> PipelineParityResult:
    """Plain loop, anchor, then every pipeline on every input (see the module docstring)."""
    verdicts = _Verdicts(case, keep_going=report_dir is not None)
    plain_record = run_plain(pool, case.setup)
    unsound = anchor_unsound(case.setup)
    if case.anchor and not unsound:
        # The unsharded model is torchrec's code too: what it raises is not paritykit's.
        reference = train_reference(case.setup, division=gradient_division())
        header = f"{case.label} over {case.setup.world_size} ranks"
        verdicts.result.anchor = verdicts.judge(assert_anchor, case.setup, plain_record, reference, header) or {"failed": True}
    else:
        verdicts.result.anchor = {"skipped": unsound or "not asked for"}
    plain = predictions(plain_record)
    verdicts.result.runs[REFERENCE] = plain
    for input_type in case.inputs:
        _run_input(verdicts, pool, input_type, plain)
    if report_dir is not None:
        ours(write_report, verdicts.result, Path(report_dir))
    if verdicts.failure is not None:
        raise verdicts.failure
    return verdicts.result
