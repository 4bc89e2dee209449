"""The metrics check's pinned cases: a fixed stream of three batches of two tasks (labels and inputs shaped
for each metric), fused and unfused, through the class and RecMetricModule, resumed; and on two ranks,
rank 1 the mirror of rank 0, through RecMetricModule and CPUOffloadedRecMetricModule."""

from __future__ import annotations

from paritykit.checks.known_issues import rule_kept_out
from paritykit.checks.metrics.rules import NDCG_NEGATIVE_TASK_IN_PLACE, RECALL_AT_THRESHOLD
from paritykit.checks.metrics.specs import (BINNED, ENCODED, GROUPED, LABELS, METRICS, MULTICLASS, NOT_CHECKPOINTED, RECALIBRATED,
                                            REGRESSION_LABELS, SATURABLE, SEGMENTED, SESSIONED, SESSION_IDS, SESSION_LEVEL, TARGETED,
                                            TENSOR_AVERAGED, THRESHOLD, MetricSpec, compute_mode, fused_updates_allowed,
                                            offloaded_vias, unpruned)


def _batch(*tasks: list[tuple[float, float, float]]) -> tuple:
    return tuple(tuple(task) for task in tasks)


# Always run: two tasks fused and unfused, a window that drops the first batch (7 and 6 samples of
# batches of 3), zero weights, both labels, a prediction at the threshold (moved off it for recall
# while the known defect stands).
_STREAM = (
    _batch([(0.9, 1.0, 1.0), (0.2, 0.0, 2.0), (0.6, 0.0, 0.5)], [(0.3, 1.0, 1.0), (0.8, 1.0, 0.0), (0.45, 0.0, 3.0)]),
    _batch([(0.7, 0.0, 1.0), (0.4, 1.0, 1.0), (0.5, 1.0, 2.0)], [(0.1, 0.0, 2.0), (0.65, 1.0, 1.0), (0.25, 1.0, 0.5)]),
    _batch([(0.35, 0.0, 3.0), (0.95, 1.0, 0.5), (0.05, 0.0, 1.0)], [(0.55, 0.0, 1.0), (0.15, 1.0, 2.0), (0.85, 1.0, 1.0)]),
)


# The metrics of NE's cross entropy at its edges: task a all positives, task b all negatives (a base rate of 1
# and of 0, clamped), saturated predictions (0 for a positive, 1 for a negative: clamped off log2(0)), zero weights.
_SATURATED = (
    _batch([(1.0, 1.0, 1.0), (0.0, 1.0, 2.0), (0.6, 1.0, 0.5)], [(0.0, 0.0, 1.0), (1.0, 0.0, 2.0), (0.45, 0.0, 3.0)]),
    _batch([(0.3, 1.0, 1.0), (1.0, 1.0, 0.0), (0.0, 1.0, 3.0)], [(1.0, 0.0, 0.5), (0.65, 0.0, 1.0), (0.0, 0.0, 0.0)]),
    _batch([(0.95, 1.0, 0.5), (0.0, 1.0, 1.0), (1.0, 1.0, 2.0)], [(0.15, 0.0, 2.0), (1.0, 0.0, 1.0), (0.85, 0.0, 1.0)]),
)


# The module's batch size stages in the unfused case: the first batch counted at 3 samples, the others at 6.
STAGES = ((3, 1), (6, None))


def _mapped(stream: tuple, sample) -> tuple:
    """The stream with ``sample(p, l, w)`` in place of each sample."""
    return tuple(tuple(tuple(sample(p, l, w) for p, l, w in task) for task in batch) for batch in stream)


def _off_threshold(stream: tuple) -> tuple:
    return _mapped(stream, lambda p, l, w: (0.55 if p == THRESHOLD else p, l, w))


def _relabelled(stream: tuple, label) -> tuple:
    return _mapped(stream, lambda p, l, w: (p, label(p, l), w))


def _stream(metric: str) -> tuple:
    if metric == "recall" and rule_kept_out(RECALL_AT_THRESHOLD) is not None:
        return _off_threshold(_STREAM)
    if LABELS.get(metric) == REGRESSION_LABELS:  # labels on the grid, near the predictions, some tied
        return _relabelled(_STREAM, lambda p, l: round((l + p) * 2) / 4)
    if metric == "num_missing_labels":  # the samples predicted below 0.3 have no label
        return _relabelled(_STREAM, lambda p, l: float("nan") if p < 0.3 else l)
    if metric in BINNED:  # soft labels: below 0.5 either side of the bin threshold, above it hard
        return _relabelled(_STREAM, lambda p, l: (0.05 if l else 0.02) if p < 0.5 else l)
    if metric in MULTICLASS:  # an order of the classes a sample; its label class 0 or 1
        return _mapped(_STREAM, lambda p, l, w: (float(int(p * 20) % 24), l, w))
    if metric in ENCODED:  # codes: the label's code the prediction's with bit 0 (positives) or bit 1 (negatives) flipped
        return _mapped(_STREAM, lambda p, l, w: (float(int(p * 20) % 8), float((int(p * 20) % 8) ^ (1 if l else 2)), w))
    if metric in SESSION_IDS:  # graded labels, against the predictions' order in part
        return _relabelled(_STREAM, lambda p, l: round((l + 1 - p) * 2) / 4)
    return _STREAM


def _pinned_inputs(metric: str, index: int) -> dict:
    """The pinned cases' arguments (the fused case, the unfused one, the resumed one): a coefficient below 1
    and above; NDCG's defaults with a negative task and sessions of two and one, every argument turned
    (k=2, a session of one dropped), and the exponential gain at k=1 over one session a batch; segmented NE
    over three groups (one without a sample) with logloss, two from float keys cast beside a second key of
    two groups, one; the tensor average with one task unweighted, then the other, then both weighted; the
    multiclass recall over 3, 4, 2 classes; the multi-label precision over 3 labels, 2 named, 1; the grouped
    metrics' keys."""
    if metric in RECALIBRATED:
        return {"arguments": (("recalibration_coefficient", (0.5, 4.0, 0.5)[index]),)}
    if metric in TENSOR_AVERAGED:
        return {"unweighted_tasks": ((1,), (0,), ())[index]}
    if metric in TARGETED:
        return {"arguments": (("target_precision", (0.5, 0.75, 0.5)[index]),)}
    if metric in SESSION_LEVEL:
        return ({"sample_keys": (4, 1, 4), "arguments": (("top_threshold", 1), ("run_ranking_of_labels", False))},
                {"sample_keys": (0, 0, 0), "arguments": (("top_threshold", 2), ("run_ranking_of_labels", True))},
                {"sample_keys": (1, 1, 2), "arguments": (("top_threshold", 1), ("run_ranking_of_labels", True))})[index]
    if metric in MULTICLASS:
        return {"arguments": (("number_of_classes", (3, 4, 2)[index]),)}
    if metric in ENCODED:
        return ({"arguments": (("num_labels", 3),)}, {"arguments": (("num_labels", 2), ("label_names", ("cat", "dog")))},
                {"arguments": (("num_labels", 1),)})[index]
    if metric in GROUPED:
        return ({"sample_keys": (0, 1, 0)}, {"sample_keys": (7, 3, 3)}, {"sample_keys": (1, 1, 1)})[index]
    if metric in SEGMENTED:
        return ({"sample_keys": (2, 0, 2), "arguments": (("num_groups", 3), ("include_logloss", True))},
                {"sample_keys": (1, 0, 1), "arguments": (("num_groups", 2), ("include_logloss", True), ("cast_keys_to_int", True),
                                                          ("second_key_groups", 2))},
                {"sample_keys": (0, 0, 0), "arguments": (("num_groups", 1),)})[index]
    if metric not in SESSION_IDS:
        return {}
    turned = (("exponential_gain", True), ("k", 2), ("report_ndcg_as_decreasing_curve", False),
              ("remove_single_length_sessions", True), ("scale_by_weights_tensor", True))
    unfused_negative = () if rule_kept_out(NDCG_NEGATIVE_TASK_IN_PLACE) is not None else (0,)
    return ({"sample_keys": (5, 2, 5), "negative_tasks": (1,)},
            {"sample_keys": (3, 1, 3), "negative_tasks": unfused_negative, "arguments": turned},
            {"sample_keys": (0, 0, 0), "arguments": (("exponential_gain", True), ("k", 1))})[index]


def pinned(metric: str) -> tuple[MetricSpec, ...]:
    stream = _stream(metric)
    # Resumed from a checkpoint before the last batch, where torchrec checkpoints the metric's state.
    resumed = () if metric in NOT_CHECKPOINTED else (2,)
    if metric in SESSIONED:  # sessions of two samples and one (one of each task's without both labels), then one a batch
        return (MetricSpec(metric, 2, "fused", 3, 7, stream, sessions=(2, 1)), MetricSpec(metric, 2, "unfused", 3, 6, stream, sessions=(3,)),
                *(MetricSpec(metric, 2, "fused", 3, 7, stream, sessions=(2, 1), resume_at=r) for r in resumed))
    fused, unfused = (9, 9) if unpruned(metric) else (7, 6)  # the whole stream, or a window that drops a batch
    return (MetricSpec(metric, 2, compute_mode(metric, "fused"), 3, fused, stream, **_pinned_inputs(metric, 0)),
            MetricSpec(metric, 2, "unfused", 3, unfused, stream, via="module", batch_size_stages=STAGES, **_pinned_inputs(metric, 1)),
            *(MetricSpec(metric, 2, "unfused", 3, 7, stream, via="module", resume_at=r, **_pinned_inputs(metric, 2))
              for r in resumed),
            # Two batches fused into one update, then the last: the window of 6 holds that last update alone.
            *((MetricSpec(metric, 2, "unfused", 3, unfused, stream, fused_updates=2, **_pinned_inputs(metric, 1)),)
              if fused_updates_allowed(metric) else ()),
            # The saturated stream, a window holding all of it (one that drops batches subtracts their sums: formulas.py)
            *((MetricSpec(metric, 2, compute_mode(metric, "fused"), 3, 9, _SATURATED, **_pinned_inputs(metric, 0)),)
              if metric in SATURABLE else ()))


def _mirrored(stream: tuple, metric: str) -> tuple:
    """Another rank's stream: the same labels and weights, predictions mirrored (1 - p, moved by 0.001
    off every prediction of rank 0's grid; a code's bits flipped), the batches reversed."""
    mirror = ((lambda p: 7.0 - p) if metric in ENCODED else (lambda p: float((int(p) + 5) % 24)) if metric in MULTICLASS
              else (lambda p: round(1.001 - p, 4)))
    return _mapped(tuple(reversed(stream)), lambda p, l, w: (mirror(p), l, w))


# The metrics pinned on two ranks through CPUOffloadedRecMetricModule too (as offloaded_vias allows).
OFFLOADED_PINNED = {"ne": ("offloaded",), "auc": ("offloaded",), "calibration": ("offloaded-merged",)}


def pinned_on_ranks(metric: str, world_size: int) -> tuple[MetricSpec, ...]:
    """On two ranks, through RecMetricModule (and CPUOffloadedRecMetricModule for some), tasks fused: rank 0
    the pinned stream, rank 1 its mirror; a window of 13 samples (7 a rank: two of its batches of 3)."""
    if world_size != 2:
        return ()
    stream = _stream(metric)
    others = (_mirrored(stream, metric),)
    if metric in SESSIONED:  # its class alone: sessions of two samples and one
        return (MetricSpec(metric, 2, "fused", 3, 13, stream, rank_batches=others, sessions=(2, 1)),)
    window = 18 if unpruned(metric) else 13  # the whole stream of each rank, or a window that drops a batch
    # Every other metric (by name) has each rank compute the reduced values (compute_on_all_ranks), the others rank 0.
    all_ranks = sorted(METRICS).index(metric) % 2 == 1
    return tuple(MetricSpec(metric, 2, compute_mode(metric, "fused"), 3, window, stream, via=via, rank_batches=others,
                            all_ranks=all_ranks and via == "module", **_pinned_inputs(metric, 0))
                 for via in ("module",) + tuple(v for v in OFFLOADED_PINNED.get(metric, ()) if v in offloaded_vias(metric)))
