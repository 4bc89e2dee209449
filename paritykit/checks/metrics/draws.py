"""The metrics check's draws: a MetricSpec of a metric (its tasks, stream of batches on each rank, window,
compute mode, the class or module that runs it, a resume, its own arguments and inputs), kept clear of the
torchrec defects that stand (rules.py names them, specs.py says what each keeps out)."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from paritykit.checks.known_issues import rule_kept_out
from paritykit.checks.metrics.rules import NDCG_FUSED_MODULE_ONE_TASK, NDCG_NEGATIVE_TASK_IN_PLACE, RECALL_AT_THRESHOLD
from paritykit.checks.metrics.specs import (CLASS_ORDERS, CLASSES, CODES, COMPUTE_MODES, ENCODED, FUSED_UPDATE_LIMITS,
                                            GROUPED, LABEL_NAMES, LABELS, MULTICLASS, NDCG_ARGUMENTS, NOT_CHECKPOINTED,
                                            OFFLOADED, PAIRED_GROUPS, RANKING, RECALIBRATED, RECALIBRATION_COEFFICIENTS, SATURABLE,
                                            SEGMENTED, SEGMENTED_ARGUMENTS, SESSION_IDS, SESSION_LEVEL,
                                            SESSION_LEVEL_ARGUMENTS, SESSIONED, TARGET_PRECISIONS, TARGETED,
                                            TENSOR_AVERAGED, THRESHOLD, TIED, MetricSpec, compute_mode, fused_updates_allowed,
                                            min_batch, offloaded_vias, unpruned)


@st.composite
def metric_specs(draw: st.DrawFn, metric: str, world_size: int = 1) -> MetricSpec:
    tasks = draw(st.integers(1, 2))
    batch_size = draw(st.integers(min_batch(metric), 5))
    count = draw(st.integers(1, 5))
    # torchrec needs a window of a batch at least on every rank (its local window is window / world size)
    fewest = (count if unpruned(metric) else 1) * batch_size * world_size
    window = draw(st.integers(fewest, max(fewest, batch_size * world_size * 6)))
    classes = draw(st.sampled_from(CLASSES)) if metric in MULTICLASS else 0
    grid = [k / 20 for k in range(1, 20)] if metric not in TIED else [0.25, 0.5, 0.75]
    if metric in SATURABLE:
        grid = [0.0, 1.0] + grid
    if metric == "recall" and rule_kept_out(RECALL_AT_THRESHOLD) is not None:
        grid.remove(THRESHOLD)
    prediction = st.sampled_from(CODES if metric in ENCODED else CLASS_ORDERS if classes else grid) if metric not in RANKING else None
    label = st.sampled_from(tuple(float(c) for c in range(classes)) if classes else LABELS.get(metric, (0.0, 1.0)))
    weight = st.sampled_from((0.0, 0.5, 1.0, 2.0, 3.0))
    per_stream = count * batch_size
    distinct = None
    if prediction is None:  # AUC, AUPRC: every prediction of a task distinct over every rank's stream
        distinct = [draw(st.lists(st.integers(1, 999), min_size=per_stream * world_size, max_size=per_stream * world_size,
                                  unique=True)) for _ in range(tasks)]
    streams = []
    for rank in range(world_size):
        batches = []
        for b in range(count):
            per_task = []
            for t in range(tasks):
                if distinct is not None:
                    start = rank * per_stream + b * batch_size
                    values = [p / 1000 for p in distinct[t][start:start + batch_size]]
                else:
                    values = draw(st.lists(prediction, min_size=batch_size, max_size=batch_size))
                labels = draw(st.lists(label, min_size=batch_size, max_size=batch_size))
                weights = draw(st.lists(weight, min_size=batch_size, max_size=batch_size))
                per_task.append(tuple(zip(values, labels, weights)))
            batches.append(tuple(per_task))
        streams.append(tuple(batches))
    mode = compute_mode(metric, draw(st.sampled_from(COMPUTE_MODES)))
    via = draw(_via(metric, tasks, mode, world_size, batch_size))
    resumable = metric not in NOT_CHECKPOINTED and count > 1 and via not in OFFLOADED
    resume_at = draw(st.none() | st.integers(1, count - 1)) if resumable else None
    return MetricSpec(metric, tasks, mode, batch_size, window, streams[0], via=via,
                      rank_batches=tuple(streams[1:]), sessions=draw(_sessions(batch_size)) if metric in SESSIONED else (),
                      resume_at=resume_at,
                      **_drawn_inputs(draw, metric, tasks, batch_size, mode, classes),
                      fused_updates=draw(_fused_updates(metric, mode, via, batch_size * world_size, window)),
                      batch_size_stages=draw(_stages(batch_size, count)) if via == "module" and resume_at is None else (),
                      all_ranks=draw(st.booleans()) if world_size > 1 and via in ("class", "module") else False)


def _stages(batch_size: int, count: int) -> st.SearchStrategy:
    """No stages, or two of batch sizes a multiple of the base one, the first ending at a batch of the stream
    (a resumed module counts its batches again from 0 unless told otherwise: not drawn resumed)."""
    sizes = st.integers(1, 3).map(lambda m: m * batch_size)
    return st.just(()) | st.tuples(st.tuples(sizes, st.integers(1, count)), st.tuples(sizes, st.none()))


def _fused_updates(metric: str, mode: str, via: str, samples_a_batch: int, window: int) -> st.SearchStrategy:
    """0, or a fused_update_limit whose fused batch the window holds (a window smaller than one batch holds none)."""
    allowed = fused_updates_allowed(metric, mode, via)
    return st.sampled_from((0,) + tuple(n for n in FUSED_UPDATE_LIMITS if n * samples_a_batch <= window and allowed))


def _via(metric: str, tasks: int, mode: str, world_size: int, batch_size: int) -> st.SearchStrategy:
    """The metric class, or RecMetricModule where it can build the metric and a standing defect does not refuse it;
    on several ranks also CPUOffloadedRecMetricModule (it starts its own gloo group: a process group is needed)."""
    squeezed = tasks == 1 or batch_size == 1  # the module squeezes session_id's dimension of one away
    refused = (metric in SESSION_IDS and mode == "fused" and squeezed
               and rule_kept_out(NDCG_FUSED_MODULE_ONE_TASK) is not None)
    if metric in SESSIONED or refused:
        return st.just("class")
    return st.sampled_from(("class", "module") + (offloaded_vias(metric) if world_size > 1 else ()))


def _drawn_inputs(draw: st.DrawFn, metric: str, tasks: int, batch_size: int, mode: str, classes: int) -> dict:
    """The fields some metrics take: their constructor's arguments, NDCG's sessions and negative tasks."""
    if metric in MULTICLASS:
        return {"arguments": (("number_of_classes", classes),)}
    if metric in RECALIBRATED:
        return {"arguments": (("recalibration_coefficient", draw(st.sampled_from(RECALIBRATION_COEFFICIENTS))),)}
    if metric in TENSOR_AVERAGED:
        return {"unweighted_tasks": tuple(sorted(draw(st.sets(st.integers(0, tasks - 1)))))}
    if metric in TARGETED:
        return {"arguments": (("target_precision", draw(st.sampled_from(TARGET_PRECISIONS))),)}
    if metric in SESSION_LEVEL:
        return {"arguments": _arguments(draw, SESSION_LEVEL_ARGUMENTS), "sample_keys": _keys(draw, batch_size, 3)}
    if metric in ENCODED:  # num_labels, and the labels' names or their default ones
        labels = draw(st.integers(1, len(LABEL_NAMES)))
        return {"arguments": (("num_labels", labels),) + draw(st.sampled_from(((), (("label_names", LABEL_NAMES[:labels]),))))}
    if metric in GROUPED:
        return {"sample_keys": _keys(draw, batch_size, 3, pairs=metric in PAIRED_GROUPS)}
    if metric in SEGMENTED:
        arguments = _arguments(draw, SEGMENTED_ARGUMENTS)
        return {"arguments": arguments, "sample_keys": _keys(draw, batch_size, dict(arguments)["num_groups"])}
    if metric not in SESSION_IDS:
        return {}
    # Negative tasks computed unfused write to the caller's tensors while that defect stands (known_broken.py).
    in_place = mode == "unfused" and rule_kept_out(NDCG_NEGATIVE_TASK_IN_PLACE) is not None
    negative = set() if in_place else draw(st.sets(st.integers(0, tasks - 1)))
    return {"arguments": _arguments(draw, NDCG_ARGUMENTS), "sample_keys": _keys(draw, batch_size, 4),
            "negative_tasks": tuple(sorted(negative))}


def _arguments(draw: st.DrawFn, choices: dict[str, tuple]) -> tuple[tuple[str, Any], ...]:
    """One drawn value of each argument, in the order ``choices`` lists them."""
    return tuple((name, draw(st.sampled_from(values))) for name, values in choices.items())


def _keys(draw: st.DrawFn, batch_size: int, count: int, pairs: bool = False) -> tuple[int, ...]:
    """A key among ``count`` for each sample of a batch (a session, a group); with ``pairs``, a key held by one
    sample alone is replaced by the most common one (every group two samples at least)."""
    keys = draw(st.lists(st.integers(0, count - 1), min_size=batch_size, max_size=batch_size))
    if pairs:
        common = max(sorted(set(keys)), key=keys.count)
        keys = [k if keys.count(k) > 1 else common for k in keys]
    return tuple(keys)


def _sessions(batch_size: int) -> st.SearchStrategy:
    """A split of a batch into consecutive sessions of one sample or more."""
    cuts = st.sets(st.integers(1, batch_size - 1), max_size=batch_size - 1) if batch_size > 1 else st.just(set())
    return cuts.map(lambda cut: tuple(b - a for a, b in zip([0, *sorted(cut)], [*sorted(cut), batch_size])))
