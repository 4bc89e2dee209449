"""What every check shares: the gate's configuration, the pool provider and the property runner."""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from hypothesis import HealthCheck, Phase, example, given, seed, settings
from hypothesis import strategies as st

from paritykit.errors import HarnessError, ParityError, RankFailure, UnsupportedByTorchrec
from paritykit.report import CaseResult


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


class PoolProvider:
    """Hands out one pool of ranks per world size, kept for the whole gate run."""

    def __init__(self, device: str = "cpu", timeout: float = 120.0) -> None:
        self.device = device
        self.timeout = timeout
        self._pools: dict[tuple[int, str | None], Any] = {}

    def get(self, world_size: int, backend: str | None = None):
        """A local RankPool, or the launcher's ranks when running under torchrun.

        ``backend`` None means the device's default (gloo on CPU, nccl on CUDA).
        """
        from paritykit.dist import get_pool

        pool = self._pools.get((world_size, backend))
        if pool is None:
            pool = get_pool(world_size, device=self.device, backend=backend, timeout=self.timeout)
            self._pools[(world_size, backend)] = pool
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()

    def __enter__(self) -> "PoolProvider":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def result_from_exception(check: str, case_id: str, replay: str, exc: BaseException, started: float) -> CaseResult:
    """Map an exception raised by a case to its status: the split behind exit codes 1 and 2."""
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
    message = str(exc) if isinstance(exc, (ParityError, RankFailure, UnsupportedByTorchrec, HarnessError)) else (
        "".join(traceback.format_exception(exc)).rstrip()
    )
    return CaseResult(check, case_id, status, replay=replay, message=message, duration_s=duration)


def run_property(
    check: str,
    strategy: st.SearchStrategy,
    body: Callable[[Any], dict[str, Any] | None],
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
    results: dict[str, CaseResult] = {}
    failures: list[CaseResult] = []

    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if config.shrink else [])

    @seed(config.seed)
    @settings(
        max_examples=config.examples,
        deadline=None,
        database=None,
        phases=phases,
        suppress_health_check=list(HealthCheck),
        derandomize=False,
        print_blob=False,
    )
    @given(strategy)
    def property_(spec: Any) -> None:
        cid = case_id(spec)
        replay = config.replay(check, spec)
        started = time.perf_counter()
        try:
            metrics = body(spec) or {}
        except UnsupportedByTorchrec as exc:
            results[cid] = result_from_exception(check, cid, replay, exc, started)
            return
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            failures.append(result_from_exception(check, cid, replay, exc, started))
            raise
        results[cid] = CaseResult(
            check, cid, "pass", replay=replay, metrics=metrics, duration_s=time.perf_counter() - started
        )

    for spec in reversed(explicit):
        property_ = example(spec)(property_)
    try:
        property_()
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        if not failures:
            # Hypothesis itself gave up (e.g. could not draw examples): the harness failed.
            return list(results.values()) + [
                result_from_exception(check, "<property>", config.replay(check), HarnessError(str(exc)), time.perf_counter())
            ]
    # Hypothesis re-runs the minimal failing example last: report that one as the failure.
    out = [r for cid, r in results.items() if not any(f.case_id == cid for f in failures)]
    if failures:
        out.append(failures[-1])
    return out
