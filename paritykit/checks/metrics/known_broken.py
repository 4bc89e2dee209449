"""Metric behaviour torchrec gets wrong, each run on purpose by every gate as a minimal reproduction
against the formula, so that its failure is matched against the known issues
(paritykit/checks/known_issues.toml, case ``known-broken <rule>: <what>``) and ``--strict`` notices
the day torchrec fixes it. The draws keep clear of them (specs.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from paritykit.checks.metrics.cases import run_metric_case
from paritykit.checks.metrics.specs import (CALI_FREE_NE_UNNORMALIZED, HINDSIGHT_FUSED, HINDSIGHT_THRESHOLD_AS_SIZE,
                                            NDCG_FUSED_MODULE_ONE_TASK, NDCG_NEGATIVE_TASK_IN_PLACE, OFFLOADED_DROPS_ARGUMENTS,
                                            RECALIBRATED_NE_LOGLOSS, RECALL_AT_THRESHOLD, SCALAR_WINDOW, TENSOR_WEIGHTED_AVG_WINDOW,
                                            WEIGHTED_AVG_WINDOW, MetricSpec)

# One positive predicted at the threshold, one predicted above it: recall 1, torchrec reports 2/3.
RECALL_SPEC = MetricSpec("recall", 1, "unfused", 2, 2, (((( 0.5, 1.0, 1.0), (0.9, 1.0, 1.0)),),))

# Four samples of weight 1: the cross entropy over that of the mean prediction is about 0.43; torchrec
# divides NE by the latter, about 0.11 (NE's norm, 4, too many times; half that with every weight doubled).
CALI_FREE_NE_SPEC = MetricSpec("cali_free_ne", 1, "unfused", 4, 4, ((((0.2, 0.0, 1.0), (0.7, 1.0, 1.0), (0.4, 0.0, 1.0),
                                                                     (0.9, 1.0, 1.0)),),))

# Two batches of two samples, a window of two: the window holds the second batch, average 0.7; a window
# that counts updates holds both, 0.5.
WEIGHTED_AVG_SPEC = MetricSpec("weighted_avg", 1, "unfused", 2, 2, ((((0.2, 0.0, 1.0), (0.4, 1.0, 1.0)),),
                                                                     (((0.6, 0.0, 1.0), (0.8, 1.0, 1.0)),)))

# One batch of a negative and a positive, include_logloss=True: the report has NE but no logloss.
RECALIBRATED_NE_SPEC = MetricSpec("recalibrated_ne", 1, "unfused", 2, 2, ((((0.3, 0.0, 1.0), (0.8, 1.0, 1.0)),),),
                                  arguments=(("recalibration_coefficient", 0.5),))

# One session of a positive and a negative, the task negative, computed unfused: the predictions fed become 1 - p.
NDCG_NEGATIVE_SPEC = MetricSpec("ndcg", 1, "unfused", 2, 2, ((((0.3, 0.0, 1.0), (0.8, 1.0, 1.0)),),), sample_keys=(0, 0),
                                negative_tasks=(0,))

# One task computed fused through RecMetricModule, one session of three: update() raises (AssertionError).
NDCG_FUSED_MODULE_SPEC = MetricSpec("ndcg", 1, "fused", 3, 3, ((((0.3, 1.0, 1.0), (0.8, 0.5, 2.0), (0.5, 0.0, 1.0)),),),
                                    via="module", sample_keys=(0, 0, 0))

# The same of TensorWeightedAvgMetric, whose tensor is 1 - p: the window holds the second batch, average 0.3.
TENSOR_WEIGHTED_AVG_SPEC = MetricSpec("tensor_weighted_avg", 1, "unfused", 2, 2, ((((0.2, 0.0, 1.0), (0.4, 1.0, 1.0)),),
                                                                                   (((0.6, 0.0, 1.0), (0.8, 1.0, 1.0)),)))

# Two negatives predicted 0.6 and 0.8 and a positive predicted 0.9, target precision 0.5: the lowest threshold
# reaching it is the first above 0.6 (one right of two predicted positive), index 600 of 1000: torchrec
# reports 600 uninitialized values instead of the index.
HINDSIGHT_SPEC = MetricSpec("hindsight_target_pr", 1, "unfused", 3, 3, ((((0.6, 0.0, 1.0), (0.8, 0.0, 1.0), (0.9, 1.0, 1.0)),),),
                            arguments=(("target_precision", 0.5),))

# The same of ScalarMetric, the labels its values: the window holds the second batch, mean 0.75.
SCALAR_SPEC = MetricSpec("scalar", 1, "unfused", 2, 2, ((((0.2, 0.0, 1.0), (0.4, 0.5, 1.0)),), (((0.6, 0.5, 1.0), (0.8, 1.0, 1.0)),)))

# NE with include_logloss through CPUOffloadedRecMetricModule on two ranks, one batch each: logloss missing.
OFFLOADED_SPEC = MetricSpec("ne", 1, "unfused", 2, 4, ((((0.3, 0.0, 1.0), (0.8, 1.0, 1.0)),),), via="offloaded",
                            rank_batches=(((((0.6, 1.0, 2.0), (0.1, 0.0, 1.0)),),),))

# The ones that need a process group (a pool of two ranks): rule -> (what, spec).
KNOWN_BROKEN_ON_RANKS: dict[str, tuple[str, MetricSpec]] = {
    OFFLOADED_DROPS_ARGUMENTS: ("NEMetric with include_logloss=True through CPUOffloadedRecMetricModule on two ranks, "
                                "against NE and logloss over both ranks' samples", OFFLOADED_SPEC),
}

KNOWN_BROKEN: dict[str, tuple[str, Callable[[], Any]]] = {
    WEIGHTED_AVG_WINDOW: ("WeightedAvgMetric over two batches of two samples, a window of two, against the average of the "
                          "last batch", lambda: run_metric_case(WEIGHTED_AVG_SPEC, every_value=True)),
    TENSOR_WEIGHTED_AVG_WINDOW: ("TensorWeightedAvgMetric over two batches of two samples, a window of two, against the "
                                 "average of the last batch's tensor", lambda: run_metric_case(TENSOR_WEIGHTED_AVG_SPEC, every_value=True)),
    SCALAR_WINDOW: ("ScalarMetric over two batches of two samples, a window of two, against the mean label of the last batch",
                    lambda: run_metric_case(SCALAR_SPEC, every_value=True)),
    CALI_FREE_NE_UNNORMALIZED: ("CaliFreeNEMetric over four samples of weight 1 against the cross entropy over that of the "
                                "mean prediction", lambda: run_metric_case(CALI_FREE_NE_SPEC, every_value=True)),
    RECALIBRATED_NE_LOGLOSS: ("RecalibratedNEMetric with include_logloss=True over a negative and a positive, against the "
                              "logloss of the recalibrated predictions", lambda: run_metric_case(RECALIBRATED_NE_SPEC, every_value=True)),
    NDCG_NEGATIVE_TASK_IN_PLACE: ("NDCGMetric over one session, its one task negative, computed unfused, against the "
                                  "predictions and labels it was fed, after update()", lambda: run_metric_case(NDCG_NEGATIVE_SPEC)),
    NDCG_FUSED_MODULE_ONE_TASK: ("NDCG of one task computed fused through RecMetricModule over one session of three, "
                                 "against the formula", lambda: run_metric_case(NDCG_FUSED_MODULE_SPEC)),
    HINDSIGHT_THRESHOLD_AS_SIZE: ("HindsightTargetPRMetric over three samples, target precision 0.5, against the index of the "
                                  "lowest threshold reaching it", lambda: run_metric_case(HINDSIGHT_SPEC, every_value=True)),
    HINDSIGHT_FUSED: ("HindsightTargetPRMetric of one task computed fused over the same samples, against its precision "
                      "and recall at that threshold", lambda: run_metric_case(replace(HINDSIGHT_SPEC, compute_mode="fused"))),
    RECALL_AT_THRESHOLD: ("RecallMetric over two positives, one predicted at the 0.5 threshold, against TP / (TP + FN)",
                          lambda: run_metric_case(RECALL_SPEC, every_value=True)),
}
