"""How a check runs its cases: the gate's configuration, the one exception -> result mapping, and
the property runner that turns hypothesis examples into CaseResults."""

from __future__ import annotations

import contextlib
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from hypothesis import HealthCheck, Phase, example, given, seed, settings
from hypothesis import strategies as st

from paritykit.checks.results import CaseResult
from paritykit.errors import HarnessError, ParityError, RankFailure, UnsupportedByTorchrec
from paritykit.harness.patching import replaced

Metrics = dict[str, Any]


@dataclass(frozen=True)
class GateConfig:
    """How the gate (or a test) asks a check to run.

    device: "cpu" or "cuda" (already resolved from "auto").
    world_sizes: the world sizes to cover; each check picks the ones that make sense for it.
    examples: hypothesis examples per property.
    """

    device: str = "cpu"
    world_sizes: tuple[int, ...] = (1, 2)
    examples: int = 10
    seed: int = 0
    report_dir: Path | None = None
    shrink: bool = True

    def replay(self, check: str, spec: Any = None) -> str:
        ws = ",".join(str(w) for w in self.world_sizes)
        command = (
            f"paritykit gate --check {check} --device {self.device} --world-size {ws} "
            f"--examples {self.examples} --seed {self.seed}"
        )
        return command if spec is None else f"{command}  # case: {spec!r}"


def result_from_exception(check: str, case_id: str, replay: str, exc: BaseException, started: float) -> CaseResult:
    """Map an exception raised by a case to its status: the split behind exit codes 1 and 2.

    This is the only place that decides it; every check's cases go through ``run_case`` or
    ``run_property``, which call it.
    """
    duration = time.perf_counter() - started
    if isinstance(exc, UnsupportedByTorchrec):
        status = "unsupported"
    elif isinstance(exc, (ParityError, RankFailure)):
        status = "fail"
    elif isinstance(exc, HarnessError):
        status = "error"
    else:
        # An unexpected exception inside the code under test is a failure of that code.
        status = "fail"
    known = (ParityError, RankFailure, UnsupportedByTorchrec, HarnessError)
    message = str(exc) if isinstance(exc, known) else "".join(traceback.format_exception(exc)).rstrip()
    return CaseResult(check, case_id, status, replay=replay, message=message, duration_s=duration)


def run_case(check: str, case_id: str, replay: str, body: Callable[[], Metrics | None]) -> CaseResult:
    """Run one fixed case: ``body()`` returns metrics (a pass) or raises (mapped by result_from_exception)."""
    started = time.perf_counter()
    try:
        metrics = body() or {}
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - every outcome becomes a result
        return result_from_exception(check, case_id, replay, exc, started)
    return CaseResult(check, case_id, "pass", replay=replay, metrics=metrics, duration_s=time.perf_counter() - started)


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
        result = run_case(self.check, cid, self.config.replay(self.check, spec), lambda: self.body(spec))
        if result.status in ("pass", "unsupported"):
            self.results[cid] = result
            return
        self.failures.append(result)
        raise _ExampleFailed(result.message)

    def outcome(self) -> list[CaseResult]:
        # Hypothesis re-runs the minimal failing example last: report that one as the failure.
        out = [r for cid, r in self.results.items() if not any(f.case_id == cid for f in self.failures)]
        return out + self.failures[-1:]


class _ExampleFailed(Exception):
    """Raised inside the property so hypothesis treats the example as failing (and shrinks it)."""


def _settings(config: GateConfig) -> settings:
    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if config.shrink else [])
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
    with replaced(providers, "_get_local_constants", lambda _original: lambda: empty):
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

    Every example becomes a CaseResult. On a failure hypothesis shrinks to a minimal spec and
    the result for that minimal spec is the one reported as failing (with its replay string).
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
            # Hypothesis itself gave up (e.g. could not draw examples): the harness failed.
            gave_up = result_from_exception(check, "<property>", config.replay(check), HarnessError(str(exc)), started)
            return list(examples.results.values()) + [gave_up]
    return examples.outcome()


@dataclass(frozen=True)
class CheckEntry:
    """A check as the registry sees it (satisfies ``paritykit.checks.Check``)."""

    name: str
    plants: str  # the module that registers the check's planted bugs
    run: Callable[[GateConfig, Any], list[CaseResult]]
