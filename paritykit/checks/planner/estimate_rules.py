"""What the planner's estimates of every sharding option must mean, whatever their calibration (the
rules; planning.estimate_problems applies them): the options torchrec's EmbeddingEnumerator proposes
for the case's tables (under the user's constraints, and with none: every type and kernel), with its
default perf and storage estimators, on the case's hosts for CPU ranks and for GPU ranks (planning
only: nothing runs on a GPU), at the planner's default batch size and at twice that.

- every perf component is finite and not negative;
- time is bytes moved over a bandwidth, and every byte a shard computes on or sends in a step is one
  of the batch's: each component doubles with the batch, except a data-parallel table's backward
  comms (the all-reduce of its gradient, the size of the table), which does not move;
- a sharding type that degenerates into another estimates as that one does, shard by shard: a
  column-wise or table-column-wise option of one shard is the table-wise placement of the table, and
  on one host a table-row-wise option is the row-wise one (same shards, same transfers);
- an EmbeddingBagCollection's tables are pooled, an EmbeddingCollection's are sequences (the
  module's kind, not the option's own flag: every pooled-or-not rule below reads the flag);
- each shard's storage holds at least its weights (rows x columns x element size) and, for a pooled
  table, one rank's pooled output of the batch (batch x columns x element size);
- the ids per bag (the user's pooling factor, at least 1): a sequence table (EC) outputs one vector
  per id, so doubling them doubles every component as the batch does; a pooled table outputs one
  vector per bag, so its transfers do not move and its compute grows, by at most twice;
- the bags per sample (the user's num_poolings) are a batch of their own: doubling them doubles every
  component as the batch does;
- every table's columns doubled (shards cut alike): each output vector and gradient is twice as wide,
  so the transfers double (a data-parallel table's all-reduce too), and the compute grows by at most
  twice;
- a placement holds each row of its table once (a data-parallel table once per rank): with no
  optimizer state to hold, doubling the rows adds exactly their bytes to its shards together, and at
  least that with a cache in front of them (the UVM-caching kernel);
- a shard's floors and ceilings (estimate_floors.py): its compute reads at least what its step needs at
  the fastest bandwidth the topology declares, its storage holds its weights, ids and output vectors,
  its input distribution receives the other ranks' ids at the fastest link; its compute takes at most
  a thousand times moving every byte its step could touch at the slowest bandwidth;
- a UVM cache holds the user's load factor of its table's rows in HBM: a caching shard's HBM exceeds
  the same shard's without a cache (UVM) by at least that share of its weights;
- the topology's ``bwd_compute_multiplier`` (the backward's compute as a multiple of the forward's)
  doubled doubles every unweighted shard's backward compute and moves nothing else;
- a weighted feature does everything an unweighted one does and more (its weights read, multiplied
  and differentiated): no component estimates less for the same table weighted, and all of them
  together more;
- and a shard holds at most that: its weights (twice them with a cache), plus what every rank's batch
  can send it and get back for its features: the ids (8 bytes each; a weighted feature's weights as
  many again) and the output vectors of its columns (float32 at most; one per bag, or per id for a
  sequence table).

The constants of the cost model (bandwidths, penalties) are calibration, not meaning: no rule here
pins them (docs/planner.md).
"""

from __future__ import annotations

import math
from typing import Any

PERF_COMPONENTS = ("fwd_compute", "fwd_comms", "bwd_compute", "bwd_comms", "prefetch_compute")
# Relative roundoff of a component computed at two batch sizes.
LINEAR_TOLERANCE = 1e-9


def option_name(option: Any, device: str) -> str:
    return f"table {option.name!r} {option.sharding_type}/{option.compute_kernel} on {device}"


def _storage_least(option: Any, shard: Any) -> int:
    element = option.tensor.element_size()
    rows, columns = shard.size
    return rows * columns * element + (option.batch_size * columns * element if option.is_pooled else 0)


def output_problems(options: list[Any], device: str, module: str) -> list[str]:
    """Each option pooled exactly when its module is an EmbeddingBagCollection."""
    pooled = module == "ebc"
    return [f"{option_name(option, device)}: is_pooled is {option.is_pooled}, its module ({module}) "
            f"{'pools its bags' if pooled else 'returns sequences'}" for option in options if option.is_pooled != pooled][:1]


def single_problems(options: list[Any], device: str) -> list[str]:
    """Shards without an estimate, with a negative or infinite perf component, or with less storage
    than their weights and (pooled) one rank's output. Also applied to the plan the planner chose."""
    problems = []
    for option in options:
        for shard in option.shards:
            where = f"{option_name(option, device)}, shard {shard.size} at {shard.offset}"
            if shard.perf is None or shard.storage is None:
                problems.append(f"{where}: no perf or storage estimate")
                continue
            bad = [c for c in PERF_COMPONENTS if not math.isfinite(getattr(shard.perf, c)) or getattr(shard.perf, c) < 0]
            if bad:
                problems.append(f"{where}: perf {', '.join(f'{c}={getattr(shard.perf, c)}' for c in bad)}")
            held, least = held_by(shard), _storage_least(option, shard)
            if held < least:
                problems.append(f"{where}: storage {held} bytes, less than its weights"
                                + (" and one rank's pooled output" if option.is_pooled else "") + f" ({least} bytes)")
    return problems


def batch_problems(single: list[Any], double: list[Any], device: str) -> list[str]:
    """Components that do not double with the batch (the data-parallel all-reduce: do not move)."""
    return _ratio_problems(single, double, device, "the batch doubled", _like_batch)


def _key(option: Any) -> tuple:
    return (option.name, option.sharding_type, option.compute_kernel, len(option.shards))


def _ratio_problems(single: list[Any], double: list[Any], device: str, what: str, expected: Any,
                    reshaped_ok: bool = False) -> list[str]:
    """Components of the options in ``double`` (after ``what``) against ``expected(option,
    component, before)``: the (low, high) bounds of the component after, or None where it is free.
    ``reshaped_ok``: an option whose shards are cut otherwise after the change is not compared."""
    doubled = {_key(option): option for option in double}
    problems = []
    for option in single:
        other = doubled.get(_key(option))
        if other is None or [s.size[0] for s in other.shards] != [s.size[0] for s in option.shards]:
            if not reshaped_ok:
                problems.append(f"{option_name(option, device)}: proposed before {what}, not after")
            continue
        for shard, twice in zip(option.shards, other.shards):
            for component in PERF_COMPONENTS:
                before, after = getattr(shard.perf, component), getattr(twice.perf, component)
                bounds = expected(option, component, before)
                if bounds is None:
                    continue
                low, high = bounds
                slack = LINEAR_TOLERANCE * max(abs(v) for v in (low, high, after) if math.isfinite(v))  # high may be unbounded
                if not low - slack <= after <= high + slack:
                    want = f"{low}" if low == high else f"at least {low}" if high == math.inf else f"between {low} and {high}"
                    problems.append(f"{option_name(option, device)}, shard {shard.size} at {shard.offset}: {component} "
                                    f"{before}, then {after} with {what} (expected {want})")
    return problems


def bwd_multiplier_problems(single: list[Any], double: list[Any], device: str) -> list[str]:
    """Options of unweighted tables whose backward compute does not double with the topology's
    bwd_compute_multiplier ("backward compute estimation" as a multiple of the forward's), or whose
    other components move with it."""

    def expected(option: Any, component: str, before: float) -> tuple[float, float]:
        return (2 * before, 2 * before) if component == "bwd_compute" else (before, before)

    return _ratio_problems(single, double, device, "the topology's bwd_compute_multiplier doubled", expected)


def columns_problems(single: list[Any], double: list[Any], device: str) -> list[str]:
    """Options whose transfers do not double with the columns of every table (each output vector, and
    a data-parallel table's gradient, twice as wide), or whose compute shrinks or more than doubles.
    Options whose shards are cut otherwise (column-wise blocks) are not compared."""

    def expected(option: Any, component: str, before: float) -> tuple[float, float]:
        return (2 * before, 2 * before) if component in ("fwd_comms", "bwd_comms") else (before, 2 * before)

    return _ratio_problems(single, double, device, "the columns doubled", expected, reshaped_ok=True)


def _fixed(option: Any, component: str) -> bool:
    """The data-parallel all-reduce of the gradient: the table's size, whatever the batch."""
    return option.sharding_type == "data_parallel" and component == "bwd_comms"


def _like_batch(option: Any, component: str, before: float) -> tuple[float, float]:
    return (before, before) if _fixed(option, component) else (2 * before, 2 * before)


def pooling_factor_problems(single: list[Any], double: list[Any], device: str) -> list[str]:
    """Options whose estimates do not follow doubled ids per bag (a sequence table's output grows with
    them, a pooled table's does not)."""

    def expected(option: Any, component: str, before: float) -> tuple[float, float] | None:
        if not option.is_pooled:
            return None if component == "prefetch_compute" else _like_batch(option, component, before)
        if component in ("fwd_comms", "bwd_comms"):
            return before, before
        return before, 2 * before

    return _ratio_problems(single, double, device, "the ids per bag doubled", expected)


def num_poolings_problems(single: list[Any], double: list[Any], device: str) -> list[str]:
    """Options whose estimates do not double with the bags per sample (the data-parallel all-reduce:
    do not move)."""
    return _ratio_problems(single, double, device, "the bags per sample doubled",
                           lambda option, component, before: None if component == "prefetch_compute"
                           else _like_batch(option, component, before))


def _held(option: Any) -> int:
    return sum(held_by(shard) for shard in option.shards)


def rows_problems(single: list[Any], double: list[Any], device: str, world_size: int) -> list[str]:
    """Options whose storage grows by other than the added rows' bytes when every table's rows double
    (``double``: the same tables, twice the rows; no optimizer)."""
    doubled = {_key(option): option for option in double}
    problems = []
    for option in single:
        other = doubled.get(_key(option))
        if other is None:
            problems.append(f"{option_name(option, device)}: proposed before the rows doubled, not after")
            continue
        rows, columns = option.tensor.shape
        copies = world_size if option.sharding_type == "data_parallel" else 1
        added = copies * rows * columns * option.tensor.element_size()
        grown = _held(other) - _held(option)
        rounding = 2 * len(option.shards)  # each shard's size is rounded up to a byte
        cached = option.compute_kernel == "fused_uvm_caching"
        if grown < added - rounding or (not cached and grown > added + rounding):
            problems.append(f"{option_name(option, device)}: {rows} more rows of {columns} columns added {grown} bytes to its "
                            f"{len(option.shards)} shard(s) together, expected {'at least ' if cached else ''}{added}"
                            + (f" ({copies} copies)" if copies > 1 else ""))
    return problems


ID_BYTES, OUTPUT_BYTES = 8, 4  # int64 ids; float32, the widest output torchrec's tables emit


def ceiling_problems(options: list[Any], device: str, world_size: int) -> list[str]:
    """Shards whose storage estimate exceeds their weights (twice with a cache) plus every rank's
    batch of ids and outputs for the table's features (estimated with no optimizer)."""
    problems = []
    for option in options:
        element = option.tensor.element_size()
        ids = option.batch_size * sum(option.input_lengths) * ID_BYTES * (2 if option.is_weighted else 1)
        vectors = option.batch_size * (option.num_inputs if option.is_pooled else sum(option.input_lengths))
        for shard in option.shards:
            rows, columns = shard.size
            weights = rows * columns * element * (2 if option.compute_kernel == "fused_uvm_caching" else 1)
            most = weights + world_size * (ids + vectors * columns * OUTPUT_BYTES)
            if held_by(shard) > most:
                problems.append(f"{option_name(option, device)}, shard {shard.size} at {shard.offset}: storage "
                                f"{held_by(shard)} bytes, more than its weights and every rank's ids and outputs ({most})")
    return problems


def cache_problems(options: list[Any], device: str, load_factor: float) -> list[str]:
    """UVM-caching shards that hold in HBM, beyond what the same shard without a cache (UVM) holds there,
    less than the user's load factor of their weights (the cache's rows)."""
    uncached = {(o.name, o.sharding_type): o for o in options if o.compute_kernel == "fused_uvm"}
    problems = []
    for option in options:
        plain = uncached.get((option.name, option.sharding_type))
        if option.compute_kernel != "fused_uvm_caching" or plain is None or len(plain.shards) != len(option.shards):
            continue
        for shard, without in zip(option.shards, plain.shards):
            rows, columns = shard.size
            cache = math.floor(load_factor * rows * columns * option.tensor.element_size())
            added = shard.storage.hbm - without.storage.hbm
            if added < cache:
                problems.append(f"{option_name(option, device)}, shard {shard.size} at {shard.offset}: its cache adds {added} "
                                f"bytes of hbm to the uncached shard's, less than the load factor {load_factor} of its weights ({cache})")
    return problems


def weighted_problems(unweighted: list[Any], weighted: list[Any], device: str) -> list[str]:
    """Perf components estimated less for the tables weighted than unweighted, or no more in all (a weighted
    feature's weights are read, multiplied and differentiated: more work; the storage estimator does not
    count them: no rule on storage here)."""
    problems = _ratio_problems(unweighted, weighted, device, "the features weighted",
                               lambda option, component, before: (before, math.inf))
    heavier = {_key(option): option for option in weighted}
    for option in unweighted:
        other = heavier.get(_key(option))
        if other is None or problems:
            continue
        for shard, twin in zip(option.shards, other.shards):
            if sum(getattr(twin.perf, c) for c in PERF_COMPONENTS) <= sum(getattr(shard.perf, c) for c in PERF_COMPONENTS):
                problems.append(f"{option_name(option, device)}, shard {shard.size} at {shard.offset}: estimated no more with its "
                                f"features weighted ({twin.perf}) than unweighted ({shard.perf})")
                break
    return problems


def held_by(shard: Any) -> int:
    return shard.storage.hbm + shard.storage.ddr + getattr(shard.storage, "ssd", 0)


def _estimates(option: Any) -> list[tuple]:
    return [tuple(getattr(shard.perf, c) for c in PERF_COMPONENTS) + (shard.storage.hbm, shard.storage.ddr, tuple(shard.size))
            for shard in option.shards]


def degenerate_problems(options: list[Any], device: str, one_host: bool) -> list[str]:
    """Options of a degenerate type whose estimates differ from those of the type they equal."""
    by_table: dict[tuple[str, str], dict[str, Any]] = {}
    for option in options:
        by_table.setdefault((option.name, option.compute_kernel), {})[option.sharding_type] = option
    problems = []
    for kinds in by_table.values():
        pairs = [(kind, "table_wise") for kind in ("column_wise", "table_column_wise")
                 if kind in kinds and len(kinds[kind].shards) == 1]
        pairs += [("table_row_wise", "row_wise")] if one_host else []
        for kind, equal in pairs:
            if kind not in kinds or equal not in kinds:
                continue
            found, expected = _estimates(kinds[kind]), _estimates(kinds[equal])
            if len(found) != len(expected) or any(not math.isclose(a, b, rel_tol=LINEAR_TOLERANCE) for x, y in zip(found, expected)
                                                  for a, b in zip(x[:-1], y[:-1])):
                problems.append(f"{option_name(kinds[kind], device)} is the {equal} placement of the table "
                                f"({len(found)} shard(s)), estimated {found[:2]}, {equal} estimated {expected[:2]}")
    return problems
