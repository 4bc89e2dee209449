"""What the planner reports about its own plan, held against the plan it chose (torchrec's
``ShardingOption`` list, handed to every ``Stats``):

- the statistics table ``EmbeddingStats`` logs is a box: every row is framed by ``#`` and as wide as
  its top border, unless its text is wider; the sum of the ranks' maximal perf components and the
  largest total perf it prints are those of the plan's shards, summed per rank here;
- each chosen shard's estimates keep the rules of every option (estimate_rules.single_problems): its
  storage holds at least its weights and, pooled, one rank's output of the planner's batch, since a
  planner that estimates less than that overcommits memory.
"""

from __future__ import annotations

import contextlib
import logging
import re
from typing import Any, Iterator

from paritykit.checks.planner.estimate_rules import PERF_COMPONENTS, single_problems

# torchrec's stats table writes this one row with one pad too many (a cosmetic defect of its own in
# every supported stack): it may be one character wider than the border.
ONE_WIDER = "# Estimated Sharding Distribution"
STATS_LOGGER = "torchrec.distributed.planner.stats"
# Perf figures are printed rounded to 3 decimals (ms).
PRINTED_PERF_UNIT = 1e-3


def recorder() -> Any:
    """A torchrec ``Stats`` that keeps the plan the planner chose (``best_plan``)."""
    from torchrec.distributed.planner.types import Stats

    class PlanRecorder(Stats):
        best_plan: list[Any] | None = None

        def log(self, sharding_plan: Any, topology: Any, batch_size: int, storage_reservation: Any, num_proposals: int,
                num_plans: int, run_time: float, best_plan: list[Any], *args: Any, **kwargs: Any) -> None:
            self.best_plan = list(best_plan)

    return PlanRecorder()


@contextlib.contextmanager
def captured_stats_table() -> Iterator[list[str]]:
    """The rows of the table torchrec's EmbeddingStats logs while the block runs (its lines that open
    with the table's '#'; other messages of the module are not the table), kept out of the user's log."""
    rows: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if message.startswith("#"):
                rows.append(message)

    logger = logging.getLogger(STATS_LOGGER)
    saved = (logger.level, logger.propagate)
    handler = Keep(logging.INFO)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield rows
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


def frame_problems(rows: list[str]) -> list[str]:
    """Rows of the table that break its box: not closed by '#', or wider or narrower than the top
    border while their text fits."""
    if not rows:
        return ["EmbeddingStats logged no table"]
    width = len(rows[0])
    problems = []
    if rows[0] != "#" * width or rows[-1] != "#" * width:
        problems.append("the table's first and last rows are not its border of '#'")
    for index, row in enumerate(rows):
        text = row[1:-1].strip()
        fits = len(text) + 3 <= width
        allowed = {width, width + 1} if row.startswith(ONE_WIDER) else {width}
        if not (row.startswith("#") and row.endswith("#")) or (fits and len(row) not in allowed):
            problems.append(f"row {index} of the stats table is {len(row)} characters, its border {width}: {row.strip()[:80]!r}")
    return problems[:3]


def perf_per_rank(best_plan: list[Any]) -> dict[int, dict[str, float]]:
    """Each rank's perf components: the sum over the plan's shards on that rank."""
    ranks: dict[int, dict[str, float]] = {}
    for option in best_plan:
        for shard in option.shards:
            if shard.perf is None or shard.rank is None:
                continue
            into = ranks.setdefault(shard.rank, dict.fromkeys(PERF_COMPONENTS, 0.0))
            for component in PERF_COMPONENTS:
                into[component] += getattr(shard.perf, component)
    return ranks


def _printed(rows: list[str], label: str) -> float | None:
    for row in rows:
        found = re.search(re.escape(label) + r":\s*([0-9.eE+-]+) ms", row)
        if found:
            return float(found.group(1))
    return None


def perf_figure_problems(rows: list[str], best_plan: list[Any]) -> list[str]:
    """'Sum of Maxima' and 'Maximum of Total Perf' against the plan's shards summed per rank
    (a figure the stack does not print is not compared)."""
    ranks = perf_per_rank(best_plan)
    if not ranks:
        return ["the planner's plan carries no perf estimate on any shard"]
    expected = {"Sum of Maxima": sum(max(perf[c] for perf in ranks.values()) for c in PERF_COMPONENTS),
                "Maximum of Total Perf": max(sum(perf.values()) for perf in ranks.values())}
    problems = []
    for label, value in expected.items():
        printed = _printed(rows, label)
        if printed is not None and abs(printed - value) > PRINTED_PERF_UNIT:
            problems.append(f"the stats table prints {label}: {printed} ms, the plan's shards sum to {value:.4f} ms")
    return problems


def report_problems(rows: list[str], best_plan: list[Any] | None, device: str) -> list[str]:
    if best_plan is None:
        return ["the planner never handed its plan to the Stats it was given"]
    chosen = [f"the chosen plan: {problem}" for problem in single_problems(best_plan, device)]
    return frame_problems(rows) + perf_figure_problems(rows, best_plan) + chosen[:4]
