"""What the planner reports about its own plan, held against the plan it chose (torchrec's
``ShardingOption`` list, handed to every ``Stats``):

- the statistics table ``EmbeddingStats`` logs is a box: every row is framed by ``#`` and as wide as
  its top border, unless its text is wider; the sum of the ranks' maximal perf components and the
  largest total perf it prints are those of the plan's shards, summed per rank here;
- its per-rank rows count each rank's shards by sharding type, its parameter rows give each table's
  sharding type, compute kernel, rows and the ranks of its shards, as the plan has them;
- its perf imbalance statistics are those of the ranks' total perf p (normalized to sum 1) against
  the uniform 1/k on k ranks, as the table's legend names them (0-1, higher more imbalanced): the
  largest |p_i - 1/k|, the sum of |p_i - 1/k|, the chi-square divergence sum k (p_i - 1/k)^2 over
  its largest value (all on one rank: k ((k-1)/k)^2 + (k-1)/k), and the KL divergence
  sum p_i log(k p_i) over its largest value log k;
- each 'Maximum of' a perf component (and of the total) is the largest of the ranks' sums, on ranks
  that have it, named as a run 'a-b' where they are consecutive; the mean total perf and the percent
  by which the maximum exceeds it are those of the ranks' totals;
- no figure is negative (every one is an amount); its compute kernels count the plan's tables per
  kernel, and its peak HBM pressure tiers name every rank by tier (report_blocks.py);
- each rank's row gives its shards' perf summed (total and components), and at least their HBM and
  DDR, each with its percent of what the rank can plan with;
- the reserved and planning memory are the reservation's share of the topology's HBM and the rest
  (with its DDR), the peak HBM pressure tiers numbered from 1 at the highest, each on its own ranks;
- its critical path and the tables it names as causing the maximum perf and HBM (report_summary.py);
- each chosen shard's estimates keep the rules of every option (estimate_rules.single_problems): its
  storage holds at least its weights and, pooled, one rank's output of the planner's batch, since a
  planner that estimates less than that overcommits memory.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
from typing import Any, Iterator

from paritykit.checks.planner.estimate_rules import PERF_COMPONENTS, single_problems
from paritykit.checks.planner.plan_rules import COLUMN_WISE
from paritykit.checks.planner.report_blocks import kernel_count_problems, printed_ranks, tier_problems
from paritykit.checks.planner.report_summary import critical_path_problems, top_table_problems

# torchrec's stats table writes this one row with one pad too many (a cosmetic defect of its own in
# every supported stack): it may be one character wider than the border.
ONE_WIDER = "# Estimated Sharding Distribution"
STATS_LOGGER = "torchrec.distributed.planner.stats"
# Perf figures are printed rounded to 3 decimals (ms).
PRINTED_PERF_UNIT = 1e-3
# The imbalance statistics are printed with 3 decimals: the printed value is within half a unit.
PRINTED_IMBALANCE_HALF_UNIT = 0.5e-3 + 1e-9
ABBREVIATIONS = {"data_parallel": "DP", "table_wise": "TW", "column_wise": "CW", "row_wise": "RW",
                 "table_row_wise": "TWRW", "table_column_wise": "TWCW", "grid_shard": "GS"}


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


def negative_figure_problems(rows: list[str]) -> list[str]:
    """Every figure of the table is an amount (bytes, ms, MB, a share or a count): none is negative
    ('-0.0' included, which a negative amount smaller than the printed unit rounds to)."""
    return [f"the stats table prints a negative figure: {row.strip('# ').strip()[:100]!r}"
            for row in rows if re.search(r"(?<![\w.-])-\d", row)][:2]


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


def storage_per_rank(options: list[Any]) -> dict[int, dict[str, int]]:
    """{rank: {"hbm": bytes, "ddr": bytes}} the chosen shards need on each rank."""
    needed: dict[int, dict[str, int]] = {}
    for option in options:
        for shard in option.shards:
            per_rank = needed.setdefault(shard.rank, {"hbm": 0, "ddr": 0})
            for kind in per_rank:
                per_rank[kind] += getattr(shard.storage, kind)
    return needed


def _printed(rows: list[str], label: str) -> float | None:
    for row in rows:
        found = re.search(re.escape(label) + r":\s*([0-9.eE+-]+) ms", row)
        if found:
            return float(found.group(1))
    return None


def rank_totals(per_rank: dict[int, dict[str, float]], world_size: int) -> list[float]:
    """Each rank's total perf (0 for a rank without shards), in rank order."""
    return [sum(per_rank.get(rank, {}).values()) for rank in range(world_size)]


def perf_figure_problems(rows: list[str], best_plan: list[Any]) -> list[str]:
    """'Sum of Maxima' against the plan's shards summed per rank (a figure the stack does not print
    is not compared); the 'Maximum of' rows are maxima_problems'."""
    ranks = perf_per_rank(best_plan)
    if not ranks:
        return ["the planner's plan carries no perf estimate on any shard"]
    value = sum(max(perf[c] for perf in ranks.values()) for c in PERF_COMPONENTS)
    printed = _printed(rows, "Sum of Maxima")
    if printed is not None and abs(printed - value) > PRINTED_PERF_UNIT:
        return [f"the stats table prints Sum of Maxima: {printed} ms, the plan's shards sum to {value:.4f} ms"]
    return []


def _cells(row: str) -> list[str]:
    return re.split(r"\s{2,}", row.strip().strip("#").strip())


def sub_table(rows: list[str], first_header: str) -> list[dict[str, str]]:
    """The data rows of the sub-table whose header row starts with ``first_header``, as {header: cell},
    up to its first empty row; [] when the stack prints no such table."""
    start = next((i for i, row in enumerate(rows) if _cells(row)[:1] == [first_header]), None)
    if start is None:
        return []
    header, found = _cells(rows[start]), []
    for row in rows[start + 2:]:  # past the row of dashes
        cells = _cells(row)
        if cells == [""]:
            break
        found.append(dict(zip(header, cells)) if len(cells) == len(header) else {"unparsed": row.strip()})
    return found


def shard_count_problems(rows: list[str], best_plan: list[Any], world_size: int) -> list[str]:
    """Each rank's 'Shards' cell against the plan's shards on that rank, counted by sharding type (a
    type the plan uses elsewhere shows 0)."""
    counts = {rank: dict.fromkeys({ABBREVIATIONS[o.sharding_type] for o in best_plan}, 0) for rank in range(world_size)}
    for option in best_plan:
        for shard in option.shards:
            counts[shard.rank][ABBREVIATIONS[option.sharding_type]] += 1
    problems = []
    for row in sub_table(rows, "Rank"):
        if "unparsed" in row or not row.get("Rank", "").isdigit() or int(row["Rank"]) not in counts:
            problems.append(f"the stats table's per-rank row {row.get('unparsed', row)!r} names no rank of {world_size}")
            continue
        printed = {kind: int(n) for kind, n in re.findall(r"(\w+): (\d+)", row.get("Shards", ""))}
        if printed != counts[int(row["Rank"])]:
            problems.append(f"the stats table counts rank {row['Rank']}'s shards as {printed}, the plan has {counts[int(row['Rank'])]}")
    return problems


# The sharding types that cut a table's columns: the report gives their shards' width beside the table's.
COLUMN_CUTTING = COLUMN_WISE + ("grid_shard",)


def parameter_row_problems(rows: list[str], best_plan: list[Any]) -> list[str]:
    """Each table's parameter row against its sharding option: type, kernel, rows, output and weighting,
    features, its columns (and its shards' where they cut them) and its shards' ranks."""
    printed = {row.get("FQN"): row for row in sub_table(rows, "FQN")}
    problems = []
    for option in best_plan:
        row = printed.get(option.fqn)
        if row is None:
            problems.append(f"the stats table has no parameter row for {option.fqn}")
            continue
        columns = option.tensor.shape[1]
        wanted = {"Sharding": ABBREVIATIONS[option.sharding_type], "Compute Kernel": option.compute_kernel,
                  "Hash Size": str(option.tensor.shape[0]), "Output": "pooled" if option.is_pooled else "sequence",
                  "Weighted": "weighted" if option.is_weighted else "unweighted", "Features": str(len(option.input_lengths)),
                  "Emb Dim (CW Dim)": (f"{columns} ({option.shards[0].size[1]})" if option.sharding_type in COLUMN_CUTTING
                                       else str(columns))}
        for column, value in wanted.items():
            if column in row and row[column] != value:
                problems.append(f"the stats table gives {option.fqn} {column} {row[column]!r}, the plan {value!r}")
        ranks = sorted(shard.rank for shard in option.shards)
        if "Ranks" in row and printed_ranks(row["Ranks"]) != ranks:
            problems.append(f"the stats table gives {option.fqn} ranks {row['Ranks']!r}, its shards are on {ranks}")
    return problems


def imbalance(p: list[float]) -> dict[str, float]:
    """The four imbalance statistics of a distribution over k ranks against the uniform one."""
    k = len(p)
    largest_chi = k * ((k - 1) / k) ** 2 + (k - 1) / k
    chi = sum(k * (x - 1 / k) ** 2 for x in p)
    kl = sum(x * math.log(k * x) for x in p if x > 0)
    return {"Total Variation": max(abs(x - 1 / k) for x in p), "Total Distance": sum(abs(x - 1 / k) for x in p),
            "Chi Divergence": chi / largest_chi if largest_chi > 0 else 0.0, "KL Divergence": kl / math.log(k) if k > 1 else 0.0}


def imbalance_problems(rows: list[str], best_plan: list[Any], world_size: int) -> list[str]:
    """The printed perf imbalance statistics against those of the ranks' total perf."""
    totals = rank_totals(perf_per_rank(best_plan), world_size)
    start = next((i for i, row in enumerate(rows) if "Total Perf Imbalance Statistics" in row), None)
    if start is None or sum(totals) <= 0:
        return []
    wanted = imbalance([t / sum(totals) for t in totals])
    problems = []
    for row in rows[start + 1:start + 1 + len(wanted)]:
        found = re.match(r"#\s*([A-Za-z ]+): (\S+)", row)
        if not found or found.group(1) not in wanted:
            continue
        printed = float(found.group(2)) if re.fullmatch(r"[0-9]+(\.[0-9]+)?", found.group(2)) else math.nan
        if not abs(printed - wanted[found.group(1)]) <= PRINTED_IMBALANCE_HALF_UNIT:  # a NaN fails too
            problems.append(f"the stats table prints the perf {found.group(1)} {found.group(2)}, the ranks' total perf "
                            f"{[round(t, 6) for t in totals]} gives {wanted[found.group(1)]:.4f}")
    return problems


# The rows "Maximum of <label>: <ms> ms on rank(s) <ranks>" and the perf component each names.
MAXIMA = {"Total Perf": PERF_COMPONENTS, "Forward Compute": ("fwd_compute",), "Forward Comms": ("fwd_comms",),
          "Backward Compute": ("bwd_compute",), "Backward Comms": ("bwd_comms",), "Prefetch Compute": ("prefetch_compute",)}
GB = 1024 ** 3


def _ranks_text_problem(what: str, word: str, text: str) -> str | None:
    """How a set of ranks must read: 'rank 2', or 'ranks a-b' for a run of consecutive ranks, else
    'ranks 0,2'."""
    ranks = printed_ranks(text)
    consecutive = len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1))
    if not ranks or word != ("ranks" if len(ranks) > 1 else "rank") or ("-" in text) != consecutive:
        return f"the stats table names the ranks of {what} as {word} {text!r}"
    return None


def maxima_problems(rows: list[str], best_plan: list[Any], world_size: int) -> list[str]:
    """Each 'Maximum of X: v ms on ranks R': v the largest of the ranks' X, R ranks that have it
    (within the roundoff of two sums in other orders); the mean total perf and how much greater the
    maximum is than it, in percent."""
    per_rank = perf_per_rank(best_plan)
    problems = []
    for label, components in MAXIMA.items():
        values = [sum(per_rank.get(rank, {}).get(c, 0.0) for c in components) for rank in range(world_size)]
        top = max(values)
        near = {rank for rank, value in enumerate(values) if value >= top - 1e-9 * max(1.0, abs(top))}
        for row in rows:
            found = re.search(rf"Maximum of {label}: (\S+) ms on (ranks?) (\S+)", row)
            if not found:
                continue
            if abs(float(found.group(1)) - top) > PRINTED_PERF_UNIT:
                problems.append(f"the stats table prints Maximum of {label}: {found.group(1)} ms, the ranks' largest is {top:.4f}")
            elif not set(printed_ranks(found.group(3))) <= near:
                problems.append(f"the stats table puts the Maximum of {label} on ranks {found.group(3)}, the ranks' values are {values}")
            problems.append(_ranks_text_problem(f"the Maximum of {label}", found.group(2), found.group(3)))
    totals = rank_totals(per_rank, world_size)
    mean = sum(totals) / world_size
    mean_printed = _printed(rows, "Mean Total Perf")
    if mean_printed is not None and abs(mean_printed - mean) > PRINTED_PERF_UNIT:
        problems.append(f"the stats table prints Mean Total Perf: {mean_printed} ms, the ranks' mean is {mean:.4f}")
    for row in rows:
        found = re.search(r"Max Total Perf is (\S+)% greater than the mean", row)
        if found and mean > 0 and not math.isclose(float(found.group(1)), (max(totals) - mean) / mean * 100, rel_tol=5e-3, abs_tol=1e-3):
            problems.append(f"the stats table prints Max Total Perf {found.group(1)}% above the mean, the ranks' totals {totals} give "
                            f"{(max(totals) - mean) / mean * 100:.4g}%")
    return [problem for problem in problems if problem]


def _one_sig_fig_ok(printed: float, value: float) -> bool:
    """torchrec writes a perf component of 1 ms or more rounded to an integer, a smaller one to one
    significant figure."""
    if value >= 1:
        return abs(printed - value) <= 0.5 + 1e-9
    unit = 10 ** math.floor(math.log10(value)) if value > 0 else 0.0
    return abs(printed - value) <= unit / 2 + 1e-12


def rank_row_problems(rows: list[str], best_plan: list[Any], topology: Any, reserved: float) -> list[str]:
    """Each rank's row: its perf, the total and each component (fwd/bwd compute and comms, prefetch),
    that of its shards summed; its HBM and DDR at least its shards' storage, and the percent beside
    each the printed amount over what the rank can plan with (HBM: the share left after the
    reservation, on GPU ranks; DDR: all of it)."""
    per_rank, storage_of, problems = perf_per_rank(best_plan), storage_per_rank(best_plan), []
    gpu = topology.compute_device in ("cuda", "mtia")
    for row in sub_table(rows, "Rank"):
        if not row.get("Rank", "").isdigit() or int(row["Rank"]) >= len(topology.devices):
            continue  # shard_count_problems reports it
        rank, storage = int(row["Rank"]), topology.devices[int(row["Rank"])].storage
        perf = per_rank.get(rank, dict.fromkeys(PERF_COMPONENTS, 0.0))
        found = re.fullmatch(r"(\S+) \(([^)]*)\)", row.get("Perf (ms)", ""))
        parts = found.group(2).split(",") if found else []
        if not found or len(parts) != len(PERF_COMPONENTS) or abs(float(found.group(1)) - sum(perf.values())) > PRINTED_PERF_UNIT \
                or not all(_one_sig_fig_ok(float(x), perf[c]) for x, c in zip(parts, PERF_COMPONENTS)):
            problems.append(f"the stats table gives rank {rank} perf {row.get('Perf (ms)')!r}, its shards sum to "
                            f"{sum(perf.values()):.4f} ({', '.join(f'{c} {perf[c]:.4g}' for c in PERF_COMPONENTS)})")
        for kind, cell, plannable in (("hbm", "HBM (GB)", (1 - reserved) * storage.hbm if gpu else 0),
                                      ("ddr", "DDR (GB)", storage.ddr)):
            found = re.fullmatch(r"([0-9.]+) \((\d+)%\)", row.get(cell, ""))
            if found is None:
                problems.append(f"the stats table gives rank {rank} {cell} {row.get(cell)!r}")
                continue
            amount, percent = float(found.group(1)) * GB, int(found.group(2))
            need = storage_of.get(rank, {}).get(kind, 0)
            share_low = (amount - 0.0005 * GB) / plannable if plannable else 0.0
            share_high = (amount + 0.0005 * GB) / plannable if plannable else 0.0
            if amount + 0.0005 * GB < need or not share_low * 100 - 0.5 - 1e-9 <= percent <= share_high * 100 + 0.5 + 1e-9:
                problems.append(f"the stats table gives rank {rank} {cell} {row[cell]!r}: its shards need {need} bytes, and the "
                                f"percent is of the {plannable:.0f} bytes it can plan with")
    return problems


def _row_value(rows: list[str], after: str, pattern: str) -> re.Match | None:
    """The first match of ``pattern`` in the rows below the first row holding ``after``."""
    start = next((i for i, row in enumerate(rows) if after in row), None)
    return None if start is None else next(filter(None, (re.search(pattern, row) for row in rows[start + 1:])), None)


def memory_problems(rows: list[str], topology: Any, reserved: float) -> list[str]:
    """The reserved and the planning memory: ``reserved`` of the first device's HBM, and the rest of
    it with all of its DDR (in GB), each as a percent of the HBM; and the peak HBM pressure tiers
    (report_blocks.tier_problems)."""
    storage, problems = topology.devices[0].storage, []
    expected = {"Reserved Memory:": (reserved * storage.hbm / GB, None, reserved),
                "Planning Memory:": ((1 - reserved) * storage.hbm / GB, storage.ddr / GB, 1 - reserved)}
    for section, (hbm, ddr, share) in expected.items():
        found = _row_value(rows, section, r"HBM: ([0-9.]+) GB(?:, DDR: ([0-9.]+) GB)?")
        percent = _row_value(rows, section, r"Percent of Total HBM: (-?[0-9]+)%")
        if found is None or percent is None:
            continue
        if abs(float(found.group(1)) - hbm) > 1e-3 or (ddr is not None and abs(float(found.group(2) or "nan") - ddr) > 1e-3):
            problems.append(f"the stats table's {section} {found.group(0)!r}: the topology's HBM {storage.hbm} and DDR {storage.ddr} "
                            f"bytes with {reserved:.0%} reserved give HBM {hbm:.3f} GB" + ("" if ddr is None else f", DDR {ddr:.3f} GB"))
        if int(percent.group(1)) != round(share * 100):
            problems.append(f"the stats table's {section} is {percent.group(1)}% of the HBM, the planner reserves {reserved:.0%}")
    return problems + tier_problems(rows, topology.world_size)


def report_problems(rows: list[str], best_plan: list[Any] | None, device: str, world_size: int,
                    topology: Any = None, reserved: float | None = None) -> list[str]:
    """Everything above; the memory rows only given the planner's ``topology`` and the share of HBM
    its storage reservation keeps (``reserved``)."""
    if best_plan is None:
        return ["the planner never handed its plan to the Stats it was given"]
    chosen = [f"the chosen plan: {problem}" for problem in single_problems(best_plan, device)]
    memory = (memory_problems(rows, topology, reserved) + rank_row_problems(rows, best_plan, topology, reserved)
              if topology is not None and reserved is not None else [])
    return (frame_problems(rows) + negative_figure_problems(rows) + perf_figure_problems(rows, best_plan)
            + shard_count_problems(rows, best_plan, world_size) + parameter_row_problems(rows, best_plan) + imbalance_problems(rows, best_plan, world_size)
            + maxima_problems(rows, best_plan, world_size) + kernel_count_problems(rows, best_plan)
            + critical_path_problems(rows, best_plan) + top_table_problems(rows, best_plan) + memory + chosen[:4])
