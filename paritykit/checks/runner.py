"""How a check runs its cases: the gate's configuration, the one exception -> result mapping, and
the property runner that turns hypothesis examples into CaseResults."""

from __future__ import annotations

import contextlib
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

from hypothesis import HealthCheck, Phase, example, given, seed, settings
from hypothesis import strategies as st

from paritykit.checks.results import NOTHING_COMPARED, CaseResult, short_case_id
from paritykit.errors import (Divergence, HarnessError, NothingCompared, ParityError, RankFailure, UnsupportedByTorchrec, crash_divergence,
                              raised_by_harness)
from paritykit.harness.case_scope import case_scope
from paritykit.harness.configuration import configuration_json
from paritykit.harness.hosts import HostLayout
from paritykit.harness.patching import replaced

Metrics = dict[str, Any]
# The status of a case that ``--case`` did not select: never run, dropped by the gate.
NOT_SELECTED = "not selected by --case"
# The status of a case after a ``stop_once`` run had its answer: never run, dropped by the gate.
NOT_RUN_ANSWERED = "not run: the run already had its answer"
NOT_UNDER_TORCHRUN = (
    "not run under torchrun: this known-broken case fails inside torchrec on some ranks while the others wait "
    "in a collective, and only paritykit's own rank pool can tear such ranks down (torchrun's would wait out the "
    "process-group timeout); run the gate without torchrun to judge it"
)
REPLAY_LABEL_CHARS = 100
# The layouts of several hosts the default gate and the self-test run beside their world sizes:
# 2 hosts of 2 ranks, the smallest where a host has ranks to split rows over and hosts to cross.
DEFAULT_HOSTS = (HostLayout(2, 2),)


def default_hosts() -> tuple[HostLayout, ...]:
    """Cross-host placements beside the one-host world sizes; under torchrun the launch's hosts only."""
    from paritykit.dist import launched_by_torchrun

    return () if launched_by_torchrun() else DEFAULT_HOSTS


@dataclass(frozen=True)
class GateConfig:
    """How the gate (or a test) asks a check to run.

    device: "cpu" or "cuda" (already resolved from "auto").
    world_sizes: the world sizes to cover; each check picks the ones that make sense for it. Each is one
        host of that many ranks (under torchrun: the launch's hosts).
    hosts: pools that stand for several hosts (HostLayout: hosts x ranks per host), run beside
        ``world_sizes`` by the checks whose placements depend on hosts (sharding, checkpoint).
    examples: hypothesis examples per property.
    case: run only this case (its full id or its short id), or these cases (a tuple of ids); the
          others are generated, not run.
    fixtures_dir: the golden fixtures to verify (default: those shipped with the package).
    strict: missing fixtures are an error rather than a skip.
    """

    device: str = "cpu"
    world_sizes: tuple[int, ...] = (1, 2)
    hosts: tuple[HostLayout, ...] = ()
    examples: int = 10
    seed: int = 0
    report_dir: Path | None = None
    shrink: bool = True
    case: str | tuple[str, ...] | None = None
    fixtures_dir: Path | None = None
    strict: bool = False

    def replay(self, check: str, case_id: str | None = None) -> str:
        """The command that re-runs ``check`` (or only its case ``case_id``) as this run did."""
        ws = ",".join(str(w) for w in self.world_sizes)
        hosts = ",".join(str(h) for h in self.hosts) or "none"
        command = (
            f"paritykit gate --check {check} --device {self.device} --world-size {ws} --hosts {hosts} "
            f"--examples {self.examples} --seed {self.seed}"
        ) + (f" --fixtures-dir {self.fixtures_dir}" if self.fixtures_dir is not None else "")
        if case_id is None:
            return command
        # The descriptive id follows as a shell comment, for the reader.
        label = " ".join(case_id.split())
        label = label if len(label) <= REPLAY_LABEL_CHARS else label[: REPLAY_LABEL_CHARS - 3] + "..."
        return f"{command} --no-shrink --case {short_case_id(check, case_id)}  # {label}"

    def pinned_host_layouts(self) -> list[HostLayout]:
        """The layouts of several hosts that pinned cases run on: ``hosts``, and where each of them has as
        many hosts as ranks per host, one with a host more. On a square layout a host index and a rank
        within the host are interchangeable (2x2 cannot tell ``rank // ranks_per_host`` from ``rank %
        ranks_per_host``, nor the host count from the ranks per host in an index), where 3x2 can."""
        layouts = [h for h in self.hosts if h.hosts > 1]
        if layouts and all(h.hosts == h.ranks_per_host for h in layouts):
            layouts.append(HostLayout(layouts[0].hosts + 1, layouts[0].ranks_per_host))
        return layouts

    def selects(self, check: str, case_id: str) -> bool:
        """Whether ``--case`` (if given) names this case, by its full id or its short id."""
        if self.case is None:
            return True
        wanted = (self.case,) if isinstance(self.case, str) else self.case
        return case_id in wanted or short_case_id(check, case_id) in wanted


def result_from_exception(check: str, case_id: str, replay: str, exc: BaseException, started: float) -> CaseResult:
    """Map an exception raised by a case to its status: the split behind exit codes 1 and 2.

    This is the only place that decides it; every check's cases go through ``run_case`` or
    ``run_property``, which call it, and so does the gate for an exception escaping a check.
    Whose fault an untyped exception is comes from where it was raised (``raised_by_harness``).
    """
    duration = time.perf_counter() - started
    if isinstance(exc, UnsupportedByTorchrec):
        status = "unsupported"
    elif isinstance(exc, NothingCompared):
        status = "skip"
    elif raised_by_harness(exc):
        status = "error"
    else:
        # ParityError, RankFailure, and anything raised inside the code under test.
        status = "fail"
    known = (ParityError, RankFailure, UnsupportedByTorchrec, HarnessError, NothingCompared)
    message = str(exc) if isinstance(exc, known) else "".join(traceback.format_exception(exc)).rstrip()
    if isinstance(exc, NothingCompared):
        message = f"{NOTHING_COMPARED}{message}"
    elif status == "error" and not isinstance(exc, HarnessError):
        message = f"harness error: an exception raised in paritykit's own code\n{message}"
    if status != "fail":
        return CaseResult(check, case_id, status, replay=replay, message=message, duration_s=duration)
    # A failure travels up as data: where the numbers first went apart (or where the code under test
    # raised), and the configuration a standalone reproduction is written from.
    divergence = getattr(exc, "divergence", None)
    if divergence is None and not isinstance(exc, (ParityError, RankFailure)):
        divergence = crash_divergence(exc)
    return CaseResult(check, case_id, status, replay=replay, message=message, duration_s=duration,
                      divergence=divergence.to_dict() if divergence is not None else None,
                      configuration=configuration_json(getattr(exc, "configuration", None)))


class _Answered:
    """A run that stops once a case's result answers its question (``stop_once``)."""

    def __init__(self, answers: Callable[[CaseResult], bool]) -> None:
        self.answers, self.hit = answers, False


_ANSWERED: list[_Answered] = []  # the active one, if any


@contextlib.contextmanager
def stop_once(answers: Callable[[CaseResult], bool]) -> Iterator[_Answered]:
    """Within: once a case's result satisfies ``answers``, the cases after it are not run (the gate drops
    them). A planted run of the self-test needs one failure the clean run lacks, not the whole check;
    ``.hit`` tells whether the run stopped early."""
    answered = _Answered(answers)
    _ANSWERED.append(answered)
    try:
        yield answered
    finally:
        _ANSWERED.remove(answered)


def stopped_early() -> bool:
    return any(a.hit for a in _ANSWERED)


def run_case(check: str, case_id: str, config: GateConfig, body: Callable[[], Metrics | None]) -> CaseResult:
    """Run one fixed case: ``body()`` returns metrics (a pass) or raises (mapped by result_from_exception).

    A case that ``config.case`` does not select is not run (its result says so; the gate drops it), nor
    is one after a ``stop_once`` run had its answer.
    """
    replay = config.replay(check, case_id)
    if not config.selects(check, case_id):
        return CaseResult(check, case_id, "skip", replay=replay, message=NOT_SELECTED)
    if stopped_early():
        return CaseResult(check, case_id, "skip", replay=replay, message=NOT_RUN_ANSWERED)
    started = time.perf_counter()
    try:
        with case_scope(f"{check}|{short_case_id(check, case_id)}"):
            metrics = body() or {}
        result = CaseResult(check, case_id, "pass", replay=replay, metrics=metrics, duration_s=time.perf_counter() - started)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - every outcome becomes a result
        result = result_from_exception(check, case_id, replay, exc, started)
    for answered in _ANSWERED:
        answered.hit = answered.hit or answered.answers(result)
    return result


def run_known_broken_case(check: str, case_id: str, config: GateConfig, pool: Any, body: Callable[[], Metrics | None]) -> CaseResult:
    """A case expected to fail inside torchrec, possibly on some ranks only: run like ``run_case``, except
    on a torchrun launch, where it is a skip saying why (the known-issues judgement does not count it)."""
    from paritykit.dist import LauncherGroup

    if isinstance(pool, LauncherGroup):
        return CaseResult(check, case_id, "skip", replay=config.replay(check, case_id), message=NOT_UNDER_TORCHRUN)
    return run_case(check, case_id, config, body)


@dataclass
class _Examples:
    """What the examples of one property did. A failing example re-raises so that hypothesis shrinks it."""

    check: str
    config: GateConfig
    body: Callable[[Any], Metrics | None]
    case_id: Callable[[Any], str]
    results: dict[str, CaseResult] = field(default_factory=dict)
    failures: list[CaseResult] = field(default_factory=list)

    def run(self, spec: Any) -> None:
        cid = self.case_id(spec)
        if not self.config.selects(self.check, cid) or stopped_early():
            return  # generated (so the sequence of cases is the same) but not run
        # A case seen already is not run again (hypothesis replays the failing one at the end).
        done = self.results.get(cid) or next((f for f in self.failures if f.case_id == cid), None)
        result = done or run_case(self.check, cid, self.config, lambda: self.body(spec))
        if result.status in ("pass", "unsupported", "skip"):
            self.results[cid] = result
            return
        if done is None:
            self.failures.append(result)
        raise _ExampleFailed(result.message)

    def outcome(self) -> list[CaseResult]:
        """Every example once; a failure is reported as the first failing case (the one ``--case``
        can replay: shrinking only re-runs variations of it), with the minimal one found by shrinking."""
        failed_ids = {f.case_id for f in self.failures}
        out = [r for cid, r in self.results.items() if cid not in failed_ids]
        if not self.failures:
            return out
        first, minimal = self.failures[0], self.failures[-1]
        if minimal.case_id != first.case_id:
            shrunk = "\n".join(minimal.message.splitlines()[:MINIMAL_CASE_LINES])
            first = replace(first, message=f"{first.message}\n--- hypothesis shrank it to a smaller failing case: {minimal.case_id}\n{shrunk}")
            if minimal.configuration and _same_cause(first, minimal):
                # The reproduction is written from the smallest configuration that fails the same way.
                first = replace(first, configuration=minimal.configuration)
        return out + [first]


def _same_cause(first: CaseResult, other: CaseResult) -> bool:
    if not first.divergence or not other.divergence:
        return False
    return Divergence.from_dict(first.divergence).cause() == Divergence.from_dict(other.divergence).cause()


# How much of the shrunk case's message the report repeats under the reported one.
MINIMAL_CASE_LINES = 12


class _ExampleFailed(Exception):
    """Raised inside the property so hypothesis treats the example as failing (and shrinks it)."""


def _settings(config: GateConfig) -> settings:
    # Shrinking needs every example to run: with --case only the selected one runs.
    shrink = config.shrink and config.case is None
    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if shrink else [])
    return settings(
        max_examples=config.examples,
        deadline=None,
        database=None,
        phases=phases,
        suppress_health_check=list(HealthCheck),
        derandomize=False,
        print_blob=False,
    )


@contextlib.contextmanager
def _no_mined_constants() -> Iterator[None]:
    """Hypothesis draws "interesting" integers and strings from the literals of every local module
    loaded so far. Which modules are loaded depends on what ran before (a whole gate vs one
    ``--case`` replay), and paritykit's own literals change between its versions, so the drawn
    cases would too. Cases must depend only on the seed and the arguments: turn the mining off
    for paritykit's properties, where this version of hypothesis has it (detected, not assumed)."""
    try:
        from hypothesis.internal.conjecture import providers
    except ImportError:  # pragma: no cover - a hypothesis without the providers module mines nothing
        yield
        return
    mine = getattr(providers, "_get_local_constants", None)
    constants = getattr(providers, "Constants", None)
    if mine is None or constants is None:
        yield
        return
    empty = constants()
    # Hypothesis also caches the constants it filtered per kind of draw (CONSTANTS_CACHE), filled by
    # whatever hypothesis test ran first in this process (in a test suite, a plain @given test with
    # mining on): a fresh cache for the property, so that those never reach its draws.
    cache = getattr(providers, "CONSTANTS_CACHE", None)
    fresh_cache = contextlib.nullcontext() if cache is None else replaced(
        providers, "CONSTANTS_CACHE", lambda original: type(original)(getattr(original, "max_size", 1024)))
    with replaced(providers, "_get_local_constants", lambda _original: lambda: empty), fresh_cache:
        yield


def run_property(
    check: str,
    strategy: st.SearchStrategy,
    body: Callable[[Any], Metrics | None],
    config: GateConfig,
    *,
    case_id: Callable[[Any], str] = repr,
    explicit: tuple[Any, ...] = (),
) -> list[CaseResult]:
    """Run ``body(spec)`` for ``config.examples`` specs drawn from ``strategy``.

    Every example becomes a CaseResult. The first failing example is reported as the failure,
    with the replay command that re-runs it alone (``--case``) and the minimal spec hypothesis
    shrank it to. Examples that ``config.case`` does not select are drawn but not run.
    ``body`` returns metrics, raises ParityError/RankFailure for a failure and
    UnsupportedByTorchrec when torchrec refuses the configuration. ``explicit`` specs always run
    first (the configurations a check must never skip, e.g. CW shards on ranks [0, 1, 0]).
    """
    examples = _Examples(check, config, body, case_id)
    property_ = seed(config.seed)(_settings(config)(given(strategy)(examples.run)))
    for spec in reversed(explicit):
        property_ = example(spec)(property_)
    started = time.perf_counter()
    try:
        with _no_mined_constants():
            property_()
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - a failing example was recorded; anything else is ours
        if not examples.failures:
            # Outside every case body (drawing or naming cases, or hypothesis giving up): the harness's.
            text = "".join(traceback.format_exception(exc)).rstrip()
            error = HarnessError(f"the property could not run its cases (drawing or naming them raised):\n{text}")
            return list(examples.results.values()) + [result_from_exception(check, "<property>", config.replay(check), error, started)]
    return examples.outcome()


@dataclass(frozen=True)
class CheckEntry:
    """A check as the registry sees it (satisfies ``paritykit.checks.Check``)."""

    name: str
    plants: str  # the module that registers the check's planted bugs
    run: Callable[[GateConfig, Any], list[CaseResult]]
    # What its cases compare torchrec against, when that is independent of the code under test
    # (the unsharded module, a reference of an op's meaning); None when it is not (recorded
    # numbers, sync counts). `paritykit coverage` counts a torchrec line as checked only when a
    # case of a check with an oracle ran it.
    oracle: str | None = None
    # The module that registers the configurations of the check's known issues (known_configurations.py).
    known_configurations: str = ""
