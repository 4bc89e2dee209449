"""Which formula each value a metrics case compares is held to: the reported names of a spec's metric (a group's,
a label's, a vector's k-th) with their formula over the samples the value holds (reference.py,
reference_sessions.py), and the samples as torchrec was fed them (fused updates, group keys)."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from paritykit.checks.metrics import reference, reference_sessions
from paritykit.checks.metrics.specs import (BIN_THRESHOLD, BINNED, ENCODED, GROUPED, MULTICLASS, PER_BATCH, SECOND_KEY, SEGMENTED,
                                            SESSION_IDS, SESSION_LEVEL, SESSIONED, TARGETED, TENSOR_AVERAGED, MetricSpec,
                                            second_keys)
from paritykit.compare.bounds import unit_roundoff


def defined(name: str, samples: list) -> bool:
    """NE's and logloss's formulas divide by the entropy of the base rate and by the label weight,
    the weighted average and AUPRC by the weight and by the positives' weight: undefined (torchrec
    returns an infinite or NaN value) when those are zero. NE's base rate is clamped off 0 and 1 (a
    window of one label has a finite NE); the calibration-free NE's mean prediction is not."""
    weight, pos, neg = reference.sums(samples)
    if name in ("ne", "ne_positive"):
        return weight > 0
    if name == "cali_free_ne":
        return pos > 0 and neg > 0
    if name == "unweighted_ne":
        return len(samples) > 0
    if name in ("logloss", "weighted_avg"):
        return weight > 0
    if name == "auprc":
        return pos > 0
    if name == "rauc":  # over the pairs of the samples
        return len(samples) > 1
    return True


def base_rate_clamped(name: str, samples: list) -> bool:
    """Whether the value divides by NE's norm at a base rate clamped to 1e-12 of 0 or 1 (every weighted label
    alike): the norm is about 1e-12 of the weight. A window that dropped batches subtracted their sums from
    its own, leaving a residue of their rounding (about 1e-16 of them) that such a norm magnifies 1e12 times:
    compared in the lifetime and in windows that dropped nothing only."""
    if not name.startswith(("ne", "unweighted_ne", "segmented_ne")):
        return False
    _, pos, neg = reference.sums(samples)
    return pos == 0 or neg == 0 or len({l for _, l, _ in samples}) == 1


def rounded_predictions_slack(formula: Any, samples: list, want: float) -> float:
    """How far the formula moves when each prediction is off by 8 float32 roundings of itself: torchrec
    recalibrates in float32 (four operations), and near 1 a prediction's rounding is a large part of
    1 - p, whose log NE takes."""
    slack = 8 * unit_roundoff(torch.float32)
    return math.fsum(abs(formula(samples[:i] + [(p * (1 - slack), l, w)] + samples[i + 1:]) - want)
                     for i, (p, l, w) in enumerate(samples))


def formulas_of(spec: MetricSpec, task: int, names: tuple[str, ...]) -> list[tuple[str, Callable[[list], float | None]]]:
    """Each compared value's name and its formula over the samples it holds (None where undefined): the binned
    labels, the grouped metrics' groups, the multiclass recall at each k (``<name>[k]``), a precision a label
    (``multi_label_precision<label name>``), segmented NE's groups (``segmented_ne_<g>``, ``logloss_<g>``),
    GAUC's sessions, XAUC's batch size, NDCG's sessions and arguments, the tensor average's weighting."""
    arguments = dict(spec.arguments)
    if spec.metric in BINNED:  # AUC of the labels binned
        return [(name, lambda samples, name=name: value(name, [(p, float(l >= BIN_THRESHOLD), w) for p, l, w in samples]))
                for name in names]
    if spec.metric in GROUPED:  # samples keyed (_compare): the metric over them all, and its mean over their groups
        base = GROUPED[spec.metric]

        def of(name: str) -> Callable[[list], float | None]:
            if name == spec.metric:
                return lambda keyed: reference.grouped(lambda samples: value(base, samples), keyed)
            return lambda keyed: value(name, [s[:3] for s in keyed])

        return [(name, of(name)) for name in names]
    if spec.metric in MULTICLASS:  # the recall at each k: a vector's k-th value
        classes = arguments["number_of_classes"]
        return [(f"{spec.metric}[{k}]", lambda samples, k=k: reference.multiclass_recall(samples, k + 1, classes))
                for k in range(classes)]
    if spec.metric in ENCODED:  # a precision a label, named after it
        labels = arguments["num_labels"]
        names_of_labels = arguments.get("label_names") or tuple(f"label_{i}" for i in range(labels))
        return [(f"{spec.metric}{names_of_labels[i]}", lambda samples, i=i: reference.multi_label_precision(samples, i))
                for i in range(labels)]
    if spec.metric in SEGMENTED:  # one key a sample of a batch, every batch alike; a value a group of each key
        def of_group(name: str, keys: tuple[int, ...], group: int) -> Callable[[list], float | None]:
            base = "ne" if name == "segmented_ne" else name
            return lambda samples: value(base, [s for i, s in enumerate(samples) if keys[i % len(keys)] == group])

        seconds = arguments.get("second_key_groups", 0)
        groupings = [(spec.sample_keys, arguments["num_groups"], "@grouping_keys" if seconds else "")]
        groupings += [(second_keys(spec), seconds, f"@{SECOND_KEY}")] if seconds else []
        return [(f"{name}_{g}{suffix}", of_group(name, keys, g)) for keys, groups, suffix in groupings for g in range(groups)
                for name in names if name != "logloss" or arguments.get("include_logloss")]
    if spec.metric in SESSION_IDS:
        extra = (spec.batch_size, spec.sample_keys, task in spec.negative_tasks, arguments)
    elif spec.metric in SESSIONED:
        extra = (spec.sessions,)
    elif spec.metric in PER_BATCH:
        extra = (spec.batch_size,)
    elif spec.metric in SESSION_LEVEL:
        extra = (spec.batch_size, spec.sample_keys, arguments)
    elif spec.metric in TARGETED:
        extra = (arguments["target_precision"],)
    elif spec.metric in TENSOR_AVERAGED:
        return [(name, lambda samples: reference.tensor_weighted_avg(samples, task not in spec.unweighted_tasks)) for name in names]
    else:
        extra = ()
    return [(name, lambda samples, name=name: value(name, samples, *extra)) for name in names]


def value(name: str, samples: list, *extra: Any) -> float | None:
    formulas = reference_sessions if hasattr(reference_sessions, name) else reference
    return getattr(formulas, name)(samples, *extra) if defined(name, samples) else None


def fused_batches(stream: list[list], fused_updates: int) -> list[list]:
    """The batches the computation was fed: with fused_update_limit n, every n batches as one (the last ones
    flushed by compute()); the window holds fused batches."""
    if not fused_updates:
        return stream
    return [[s for batch in stream[i:i + fused_updates] for s in batch] for i in range(0, len(stream), fused_updates)]


def keyed(spec: MetricSpec, samples: tuple) -> list:
    """A task's samples of a batch; a grouped metric's with each sample's group key after it (the window of
    samples may start within a batch)."""
    if spec.metric not in GROUPED:
        return list(samples)
    return [(*sample, key) for sample, key in zip(samples, spec.sample_keys)]
