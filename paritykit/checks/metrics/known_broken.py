"""Metric behaviour torchrec gets wrong, each run on purpose by every gate as a minimal reproduction
against the formula, so that its failure is matched against the known issues
(paritykit/checks/known_issues.toml, case ``known-broken <rule>: <what>``) and ``--strict`` notices
the day torchrec fixes it. The draws keep clear of them (specs.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from paritykit.checks.metrics.cases import run_metric_case
from paritykit.checks.metrics.rules import (CALI_FREE_NE_UNNORMALIZED, FUSED_UPDATES_DROP_INPUTS, GROUPED_BATCH_OF_ONE,
                                            GROUPED_ON_RANKS, GROUPED_WINDOW, HINDSIGHT_FUSED, HINDSIGHT_THRESHOLD_AS_SIZE,
                                            MULTI_LABEL_FUSED, NDCG_FUSED_MODULE_ONE_TASK, NDCG_NEGATIVE_TASK_IN_PLACE,
                                            OFFLOADED_DROPS_ARGUMENTS, RECALIBRATED_NE_LOGLOSS, RECALL_AT_THRESHOLD,
                                            SCALAR_WINDOW, TENSOR_WEIGHTED_AVG_WINDOW, WEIGHTED_AVG_WINDOW)
from paritykit.checks.metrics.specs import MetricSpec

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

# Grouped AUC over two batches of two samples (groups 0 and 1), a window of two: compute() raises IndexError
# (the keys keep three, the samples two); with batches of one sample, update() raises at the first batch.
GROUPED_WINDOW_SPEC = MetricSpec("grouped_auc", 1, "unfused", 2, 2, ((((0.3, 0.0, 1.0), (0.8, 1.0, 1.0)),),
                                                                     (((0.6, 1.0, 1.0), (0.1, 0.0, 1.0)),)), sample_keys=(0, 1))
GROUPED_BATCH_OF_ONE_SPEC = MetricSpec("grouped_auc", 1, "unfused", 1, 10, ((((0.3, 0.0, 1.0),),), (((0.8, 1.0, 1.0),),)),
                                       sample_keys=(0,))

# Grouped AUPRC on two ranks, one batch each, groups 0 and 1: group 0 ranks its positives first (AUPRC 1), group 1
# its negatives (5/12); torchrec averages in a third group of rank 1's padding sample, 0.472 instead of 0.708.
GROUPED_ON_RANKS_SPEC = MetricSpec("grouped_auprc", 1, "unfused", 4, 100,
                                   ((((0.1, 0.0, 1.0), (0.4, 1.0, 1.0), (0.35, 1.0, 1.0), (0.8, 0.0, 1.0)),),),
                                   rank_batches=(((((0.11, 0.0, 1.0), (0.41, 1.0, 1.0), (0.36, 1.0, 1.0), (0.81, 0.0, 1.0)),),),),
                                   sample_keys=(0, 1, 0, 1))

# The tensor average (tensor 1 - p) over two batches of two samples, fused_update_limit=2: the fused update raises
# that the required inputs given with each batch are missing.
FUSED_UPDATES_SPEC = MetricSpec("tensor_weighted_avg", 1, "unfused", 2, 4, ((((0.2, 0.0, 1.0), (0.4, 1.0, 1.0)),),
                                                                            (((0.6, 0.0, 1.0), (0.8, 1.0, 1.0)),)), fused_updates=2)

# Multi-label precision (three labels) of two tasks fused, one batch of two samples each: task a predicts label 0 right
# and wrongly (1/2), task b label 1 right (1); torchrec reports task a over both tasks' samples and no task b.
MULTI_LABEL_FUSED_SPEC = MetricSpec("multi_label_precision", 2, "fused", 2, 2, ((((1.0, 1.0, 1.0), (1.0, 2.0, 1.0)),
                                                                               ((2.0, 2.0, 1.0), (6.0, 6.0, 1.0))),),
                                    arguments=(("num_labels", 3),))

# The ones that need a process group (a pool of two ranks): rule -> (what, spec).
KNOWN_BROKEN_ON_RANKS: dict[str, tuple[str, MetricSpec]] = {
    GROUPED_ON_RANKS: ("AUPRCMetric with grouped_auprc on two ranks, one batch of two groups each, against the mean of "
                       "each group's AUPRC over both ranks' samples", GROUPED_ON_RANKS_SPEC),
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
    GROUPED_WINDOW: ("AUCMetric with grouped_auc over two batches of two samples in two groups, a window of two, against "
                     "AUC and the mean of each group's AUC over the last batch", lambda: run_metric_case(GROUPED_WINDOW_SPEC)),
    GROUPED_BATCH_OF_ONE: ("AUCMetric with grouped_auc over two batches of one sample, against AUC and grouped AUC over both",
                           lambda: run_metric_case(GROUPED_BATCH_OF_ONE_SPEC)),
    FUSED_UPDATES_DROP_INPUTS: ("TensorWeightedAvgMetric with fused_update_limit=2 over two batches of two samples, against "
                                "the weighted average of the tensor given with them",
                                lambda: run_metric_case(FUSED_UPDATES_SPEC)),
    MULTI_LABEL_FUSED: ("MultiLabelPrecisionMetric of two tasks computed fused over one batch each, against each task's "
                        "precision of each label over its own samples", lambda: run_metric_case(MULTI_LABEL_FUSED_SPEC)),
    RECALL_AT_THRESHOLD: ("RecallMetric over two positives, one predicted at the 0.5 threshold, against TP / (TP + FN)",
                          lambda: run_metric_case(RECALL_SPEC, every_value=True)),
}
