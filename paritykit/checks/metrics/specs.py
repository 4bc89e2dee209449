"""The metrics check's cases: one torchrec metric class, one or two tasks, a stream of batches; the tables of
what each metric reports, takes and is fed (draws.py draws the cases from them).

Each batch holds, per task, ``batch_size`` samples (prediction, label, weight). Predictions are 0 and 1
too for the metrics of NE's cross entropy (a saturated sigmoid: torchrec clamps them within 1e-12) and,
for AUC, distinct over a task's whole stream (the order of tied predictions is the sort's, not a
meaning).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paritykit.checks.known_issues import rule_kept_out
from paritykit.checks.metrics.rules import (CALI_FREE_NE_UNNORMALIZED, FUSED_UPDATES_DROP_INPUTS, GROUPED_BATCH_OF_ONE,
                                            GROUPED_ON_RANKS, GROUPED_WINDOW, HINDSIGHT_FUSED, HINDSIGHT_THRESHOLD_AS_SIZE,
                                            MULTI_LABEL_FUSED, OFFLOADED_DROPS_ARGUMENTS, RECALIBRATED_NE_LOGLOSS,
                                            SCALAR_WINDOW, TENSOR_WEIGHTED_AVG_WINDOW, WEIGHTED_AVG_WINDOW)

THRESHOLD = 0.5

# metric -> (torchrec class path, the names it reports, its constructor's extra arguments, window kind)
METRICS: dict[str, tuple[str, tuple[str, ...], dict, str]] = {
    "ne": ("torchrec.metrics.ne.NEMetric", ("ne", "logloss"), {"include_logloss": True}, "batches"),
    "ctr": ("torchrec.metrics.ctr.CTRMetric", ("ctr",), {}, "batches"),
    "calibration": ("torchrec.metrics.calibration.CalibrationMetric", ("calibration",), {}, "batches"),
    "mse": ("torchrec.metrics.mse.MSEMetric", ("mse", "rmse"), {}, "batches"),
    "mae": ("torchrec.metrics.mae.MAEMetric", ("mae",), {}, "batches"),
    "accuracy": ("torchrec.metrics.accuracy.AccuracyMetric", ("accuracy",), {}, "batches"),
    "precision": ("torchrec.metrics.precision.PrecisionMetric", ("precision",), {}, "batches"),
    "recall": ("torchrec.metrics.recall.RecallMetric", ("recall",), {}, "batches"),
    "auc": ("torchrec.metrics.auc.AUCMetric", ("auc",), {}, "samples"),
    "unweighted_ne": ("torchrec.metrics.unweighted_ne.UnweightedNEMetric", ("unweighted_ne",), {}, "batches"),
    "num_positive_samples": ("torchrec.metrics.num_positive_samples.NumPositiveSamplesMetric", ("num_positive_samples",), {}, "batches"),
    "sum_weights": ("torchrec.metrics.sum_weights.SumWeightsMetric", ("sum_weights",), {}, "batches"),
    "weighted_sum_predictions": ("torchrec.metrics.weighted_sum_predictions.WeightedSumPredictionsMetric",
                                 ("weighted_sum_predictions",), {}, "batches"),
    "ne_positive": ("torchrec.metrics.ne_positive.NEPositiveMetric", ("ne_positive",), {}, "batches"),
    "nmse": ("torchrec.metrics.nmse.NMSEMetric", ("nmse", "nrmse"), {}, "batches"),
    "cali_free_ne": ("torchrec.metrics.cali_free_ne.CaliFreeNEMetric", ("cali_free_ne",), {}, "batches"),
    "weighted_avg": ("torchrec.metrics.weighted_avg.WeightedAvgMetric", ("weighted_avg",), {}, "batches"),
    "average": ("torchrec.metrics.average.AverageMetric", ("label_average", "prediction_average"), {}, "batches"),
    "serving_ne": ("torchrec.metrics.serving_ne.ServingNEMetric", ("ne", "total_examples"), {}, "batches"),
    "serving_calibration": ("torchrec.metrics.serving_calibration.ServingCalibrationMetric", ("calibration", "total_examples"), {},
                            "batches"),
    "auprc": ("torchrec.metrics.auprc.AUPRCMetric", ("auprc",), {}, "samples"),
    "gauc": ("torchrec.metrics.gauc.GAUCMetric", ("gauc", "gauc_num_samples"), {}, "batches"),
    "recalibrated_ne": ("torchrec.metrics.ne_with_recalibration.RecalibratedNEMetric", ("ne", "logloss"),
                        {"include_logloss": True}, "batches"),
    "recalibrated_calibration": ("torchrec.metrics.calibration_with_recalibration.RecalibratedCalibrationMetric",
                                 ("calibration",), {}, "batches"),
    "rauc": ("torchrec.metrics.rauc.RAUCMetric", ("rauc",), {}, "samples"),
    "xauc": ("torchrec.metrics.xauc.XAUCMetric", ("xauc",), {}, "batches"),
    "num_missing_labels": ("torchrec.metrics.num_missing_labels.NumMissingLabelsMetric", ("num_missing_labels",), {},
                           "batches"),
    "ndcg": ("torchrec.metrics.ndcg.NDCGMetric", ("ndcg",), {}, "batches"),
    "segmented_ne": ("torchrec.metrics.segmented_ne.SegmentedNEMetric", ("segmented_ne", "logloss"), {}, "batches"),
    "tensor_weighted_avg": ("torchrec.metrics.tensor_weighted_avg.TensorWeightedAvgMetric", ("weighted_avg",), {}, "batches"),
    "hindsight_target_pr": ("torchrec.metrics.hindsight_target_pr.HindsightTargetPRMetric",
                            ("hindsight_target_pr", "hindsight_target_precision", "hindsight_target_recall"), {}, "batches"),
    "scalar": ("torchrec.metrics.scalar.ScalarMetric", ("scalar",), {}, "batches"),
    "recall_session_level": ("torchrec.metrics.recall_session.RecallSessionMetric", ("recall_session_level",), {}, "batches"),
    "precision_session_level": ("torchrec.metrics.precision_session.PrecisionSessionMetric", ("precision_session_level",), {},
                                "batches"),
    "multi_label_precision": ("torchrec.metrics.multi_label_precision.MultiLabelPrecisionMetric", ("multi_label_precision",), {},
                              "batches"),
    "multiclass_recall": ("torchrec.metrics.multiclass_recall.MulticlassRecallMetric", ("multiclass_recall",), {}, "batches"),
    "binned_auc": ("torchrec.metrics.auc.AUCMetric", ("auc",), {"apply_bin": True}, "samples"),
    "grouped_auc": ("torchrec.metrics.auc.AUCMetric", ("auc", "grouped_auc"), {"grouped_auc": True}, "samples"),
    "grouped_auprc": ("torchrec.metrics.auprc.AUPRCMetric", ("auprc", "grouped_auprc"), {"grouped_auprc": True}, "samples"),
    "grouped_rauc": ("torchrec.metrics.rauc.RAUCMetric", ("rauc", "grouped_rauc"), {"grouped_rauc": True}, "samples"),
}
# The metrics computed per group of samples too (a ``grouping_keys`` input: a key a sample), each by the
# class of the metric it groups: grouped -> that metric (its RecMetricEnum member, its namespace).
GROUPED = {"grouped_auc": "auc", "grouped_auprc": "auprc", "grouped_rauc": "rauc"}
# AUC with apply_bin: soft labels, each counted a positive from BIN_THRESHOLD up (torchrec's fixed 0.039).
BINNED = ("binned_auc",)
BIN_THRESHOLD = 0.039
# The metrics computed by another's class with arguments of their own: metric -> that one (its RecMetricEnum
# member, its namespace).
VARIANTS = {**GROUPED, "binned_auc": "auc"}
# The namespace a metric reports under, where it is not the metric's name.
NAMESPACES = {"tensor_weighted_avg": "weighted_avg", **VARIANTS}
# The values reported without a lifetime or window prefix (``<metric>-<task>|<name>``): over every sample given.
UNPREFIXED = ("total_examples",)
# The metrics that rank the samples by prediction: drawn with predictions distinct over a task's stream.
RANKING = ("auc", "auprc", "gauc", "ndcg", "grouped_auc", "grouped_auprc", "binned_auc")
# The metrics whose samples torchrec keeps out of the state dict on purpose (persistent=False: a window
# of samples would be a large checkpoint), so that a resumed one has lost them: not drawn resumed.
NOT_CHECKPOINTED = ("auc", "auprc", "rauc", *GROUPED, *BINNED)
# The metrics over sessions (``num_candidates``: consecutive samples of a batch), which RecMetricModule
# cannot build (no RecMetricEnum member): run through their class alone.
SESSIONED = ("gauc",)
# The metrics that report their window only (AUPRC's lifetime value is a weighted average of the windows
# seen at each compute() call, a history no formula over the samples gives).
WINDOW_ONLY = ("auc", "auprc", "rauc", *GROUPED, *BINNED)
# The metrics over the pairs of a batch: the reference is told the batch size.
PER_BATCH = ("xauc", "scalar")
# The metrics whose pairs tied in prediction count by their labels (XAUC: alike when the labels tie too): drawn
# from three predictions, so that a batch often holds such a pair.
TIED = ("xauc",)
# The metrics that take log2 of a prediction and clamp it: drawn saturated predictions (0 and 1) too.
SATURABLE = ("ne", "ne_positive", "unweighted_ne", "segmented_ne", "serving_ne")
# The metrics whose lifetime value is the latest batch's (ScalarMetric logs the value it is given).
LATEST_BATCH = ("scalar",)
# The labels drawn: 0 and 1, a regression target in [0, 1] for the metrics that rank labels (ties
# included), NaN (a missing label) for the metric that counts those, codes of three binary labels, soft labels
# about the bin threshold.
REGRESSION_LABELS = (0.0, 0.25, 0.5, 0.75, 1.0)
CODES = tuple(float(code) for code in range(8))
LABELS = {"rauc": REGRESSION_LABELS, "grouped_rauc": REGRESSION_LABELS, "xauc": REGRESSION_LABELS, "scalar": REGRESSION_LABELS,
          "num_missing_labels": (0.0, 1.0, float("nan")), "ndcg": (0.0, 0.5, 1.0), "multi_label_precision": CODES,
          "binned_auc": (0.0, 0.02, 0.03, 0.05, 0.5, 1.0)}
# The metrics whose samples carry a session id (NDCG's ``session_id`` input: any ids, in any order).
SESSION_IDS = ("ndcg",)
# The metrics whose samples carry a group key (segmented NE's ``grouping_keys``: a value a group).
SEGMENTED = ("segmented_ne",)
# The session-level metrics: a sample is predicted positive when fewer than top_threshold samples of its
# session (``session``, drawn ids) rank above it; a task's SessionMetricDef carries the arguments, and
# torchrec computes them per task only (it refuses fused computation with a message).
SESSION_LEVEL = ("recall_session_level", "precision_session_level")
SESSION_LEVEL_ARGUMENTS = {"top_threshold": (1, 2, 3), "run_ranking_of_labels": (False, True)}
# The metrics with a target precision (the reference finds the threshold that reaches it).
TARGETED = ("hindsight_target_pr",)
# The metrics drawn with constructor arguments of their own (beyond METRICS' fixed ones).
ARGUMENTED = ("recalibrated_ne", "recalibrated_calibration", "ndcg", "segmented_ne", "hindsight_target_pr", "multi_label_precision",
              "multiclass_recall")
# The metrics whose predictions and labels are codes of several binary labels (CODES: bit i is label i, lowest
# first; the bits above num_labels ignored): a precision a label, under its name (label_<i> or label_names').
ENCODED = ("multi_label_precision",)
# The metrics whose prediction is a score a class (number_of_classes drawn from CLASSES) and whose label is a class:
# a sample's prediction is a code naming the order of its classes' scores (reference.class_ranking), and the metric
# reports its recall at each k (the label among the k top classes) as one vector.
MULTICLASS = ("multiclass_recall",)
CLASSES = (2, 3, 4)
CLASS_ORDERS = tuple(float(code) for code in range(24))  # 4! orders, fewer classes taken modulo theirs
LABEL_NAMES = ("cat", "dog", "horse")
# The metrics that average a tensor of the model's outputs other than the predictions (a task's
# ``tensor_name``, weighted or not): paritykit feeds 1 - p there, so that averaging p would show.
TENSOR_AVERAGED = ("tensor_weighted_avg",)
# The metrics that recalibrate predictions for a negative downsampling: the coefficient is drawn.
RECALIBRATED = ("recalibrated_ne", "recalibrated_calibration")
RECALIBRATION_COEFFICIENTS = (0.1, 0.5, 2.0, 10.0)
# NDCGMetric's own arguments, drawn.
NDCG_ARGUMENTS = {"exponential_gain": (False, True), "k": (-1, 1, 2, 3), "report_ndcg_as_decreasing_curve": (True, False),
                  "remove_single_length_sessions": (False, True), "scale_by_weights_tensor": (False, True)}
# HindsightTargetPRMetric's target precision, drawn.
TARGET_PRECISIONS = (0.3, 0.5, 0.75, 0.9)
# SegmentedNEMetric's arguments, drawn (the keys fed as float32 where they are to be cast); logloss always,
# which a group has wherever it has weight (its NE needs both labels; a pinned case goes without it).
SEGMENTED_ARGUMENTS = {"num_groups": (1, 2, 3, 4), "include_logloss": (True,), "cast_keys_to_int": (False, True),
                       "second_key_groups": (0, 1, 2, 3)}
# With second_key_groups n, a second grouping key of n groups (GroupingKeyConfig: a value a group for each key,
# reported as segmented_ne_<g>@<key>), its key of sample i of a batch (7 i + the first key) mod n (second_keys).
SECOND_KEY = "country"
# RAUC divides by the pairs of the samples it holds: a batch of two at least (one sample is no pair).
MIN_BATCH = {"rauc": 2, "grouped_rauc": 2}
# And grouped, it divides by each group's pairs: every group of a batch two samples at least.
PAIRED_GROUPS = ("grouped_rauc",)
# The grouped metrics whose window is drawn never to drop a sample: while GROUPED_WINDOW stands, AUC and RAUC;
# RAUC always (a group left with one sample in the window has no pair: torchrec divides by zero, undefined).
UNPRUNED = {"grouped_auc": GROUPED_WINDOW, "grouped_rauc": None}
COMPUTE_MODES = ("unfused", "fused")
# fused_update_limit: updates buffered and fused into one of that many batches (unfused tasks only: torchrec refuses
# both fusions at once). Not drawn for the metrics over a batch's pairs or its latest batch (a fused update is one
# batch, by design), nor, while FUSED_UPDATES_DROP_INPUTS stands, for those given inputs beyond the samples.
FUSED_UPDATE_LIMITS = (2, 3)
# CPUOffloadedRecMetricModule, whose worker thread updates the metrics and whose compute thread gathers
# every rank's states: "offloaded" updates batch by batch (update_batch_size=1), "offloaded-merged" lets the
# worker merge up to 10 queued batches into one update (its default), which changes which batches a window
# holds with the thread's timing: its window is not compared. Neither is drawn resumed (its state_dict() is
# the states gathered over every rank at the last compute, a different contract).
OFFLOADED = ("offloaded", "offloaded-merged")
# A metric whose every case a standing known issue breaks is not drawn, one whose window values it breaks
# has its lifetime values compared alone (known_broken.py reproduces each).
KEPT_OUT_WHOLE = {"cali_free_ne": CALI_FREE_NE_UNNORMALIZED}
KEPT_OUT_WINDOW = {"weighted_avg": WEIGHTED_AVG_WINDOW, "tensor_weighted_avg": TENSOR_WEIGHTED_AVG_WINDOW,
                   "scalar": SCALAR_WINDOW}
# A reported name a standing known issue drops: not compared while it stands (the known-broken case is).
KEPT_OUT_NAMES = {("recalibrated_ne", "logloss"): RECALIBRATED_NE_LOGLOSS,
                  ("hindsight_target_pr", "hindsight_target_pr"): HINDSIGHT_THRESHOLD_AS_SIZE}
# A metric a standing known issue breaks when its tasks are computed fused: drawn and pinned unfused.
KEPT_OUT_FUSED = {"hindsight_target_pr": HINDSIGHT_FUSED, "multi_label_precision": MULTI_LABEL_FUSED}


def drawn_metrics(world_size: int = 1) -> tuple[str, ...]:
    """The metrics the gate draws and pins on this stack, on one rank or a pool of ``world_size``."""
    grouped_kept_out = world_size > 1 and rule_kept_out(GROUPED_ON_RANKS) is not None
    return tuple(m for m in METRICS if (m not in KEPT_OUT_WHOLE or rule_kept_out(KEPT_OUT_WHOLE[m]) is None)
                 and not (grouped_kept_out and m in GROUPED))


def min_batch(metric: str) -> int:
    """The fewest samples a batch of the metric is drawn with (MIN_BATCH; two for the grouped metrics while
    GROUPED_BATCH_OF_ONE stands)."""
    fewest = MIN_BATCH.get(metric, 1)
    return max(fewest, 2) if metric in GROUPED and rule_kept_out(GROUPED_BATCH_OF_ONE) is not None else fewest


def unpruned(metric: str) -> bool:
    """Whether the metric's window must hold every sample of the stream (UNPRUNED says why)."""
    return metric in UNPRUNED and (UNPRUNED[metric] is None or rule_kept_out(UNPRUNED[metric]) is not None)


def compared_names(metric: str) -> tuple[str, ...]:
    """The names of the metric's values compared on this stack."""
    return tuple(n for n in METRICS[metric][1]
                 if (metric, n) not in KEPT_OUT_NAMES or rule_kept_out(KEPT_OUT_NAMES[(metric, n)]) is None)


def compute_mode(metric: str, mode: str) -> str:
    """``mode``, or unfused where torchrec refuses the metric fused or a standing known issue breaks it so."""
    refused = metric in SESSION_LEVEL or (metric in KEPT_OUT_FUSED and rule_kept_out(KEPT_OUT_FUSED[metric]) is not None)
    return "unfused" if refused else mode


def window_compared(metric: str) -> bool:
    """Whether the metric's window values are compared on this stack."""
    return metric not in KEPT_OUT_WINDOW or rule_kept_out(KEPT_OUT_WINDOW[metric]) is None


@dataclass(frozen=True)
class MetricSpec:
    metric: str
    tasks: int
    compute_mode: str  # "unfused" (a computation per task) or "fused" (the tasks stacked in one)
    batch_size: int
    window_size: int
    # batches[b][t] = the samples of task t in batch b: (prediction, label, weight) each.
    batches: tuple[tuple[tuple[tuple[float, float, float], ...], ...], ...]
    # "class": the metric class itself; "module": a RecMetricModule built by generate_metric_module from a
    # MetricsConfig and fed the model's output dict, the way a trainer runs it.
    via: str = "class"
    # The streams of ranks 1, 2, ... when the metric runs on several ranks (``batches`` is rank 0's).
    rank_batches: tuple = ()
    # GAUC's sessions: how every batch splits into consecutive sessions (sizes summing to batch_size).
    sessions: tuple[int, ...] = ()
    # Before this batch the metric is checkpointed: its state_dict() loaded into a fresh one (cases.py).
    resume_at: int | None = None
    # The constructor's drawn arguments beyond METRICS' (the recalibration coefficient, NDCG's).
    arguments: tuple[tuple[str, Any], ...] = ()
    # A key of each sample of a batch, the same for every batch (NDCG's session ids, segmented NE's groups),
    # and the tasks marked negative (NDCG), or whose tensor is averaged without the weights.
    sample_keys: tuple[int, ...] = ()
    negative_tasks: tuple[int, ...] = ()
    unweighted_tasks: tuple[int, ...] = ()
    # fused_update_limit: this many batches are buffered and fed to the computation as one (0: each batch).
    fused_updates: int = 0
    # RecMetricModule's batch_size_stages: (batch size, the last batch of the stage or None) each; its throughput
    # counts each batch at its stage's size.
    batch_size_stages: tuple[tuple[int, int | None], ...] = ()
    # compute_on_all_ranks: every rank of a pool computes the reduced values (else rank 0 alone must).
    all_ranks: bool = False

    @property
    def world_size(self) -> int:
        return 1 + len(self.rank_batches)

    def streams(self) -> tuple:
        return (self.batches,) + tuple(self.rank_batches)

    def case_id(self) -> str:
        streams = " || ".join(" | ".join("; ".join(" ".join(f"{p:g}/{l:g}/{w:g}" for p, l, w in task) for task in batch)
                                         for batch in stream) for stream in self.streams())
        ranks = "" if self.world_size == 1 else f" world_size={self.world_size}"
        ranks += f" sessions={list(self.sessions)}" if self.sessions else ""
        ranks += f" resumed before batch {self.resume_at}" if self.resume_at is not None else ""
        ranks += "".join(f" {k}={v}" for k, v in self.arguments)
        ranks += f" sample_keys={list(self.sample_keys)}" if self.sample_keys else ""
        ranks += f" negative_tasks={list(self.negative_tasks)}" if self.negative_tasks else ""
        ranks += f" unweighted_tasks={list(self.unweighted_tasks)}" if self.unweighted_tasks else ""
        ranks += f" fused_update_limit={self.fused_updates}" if self.fused_updates else ""
        ranks += f" batch_size_stages={list(self.batch_size_stages)}" if self.batch_size_stages else ""
        ranks += " compute_on_all_ranks" if self.all_ranks else ""
        return (f"{self.metric} via {self.via}{ranks} tasks={self.tasks} {self.compute_mode} batch_size={self.batch_size} "
                f"window_size={self.window_size} batches: {streams}")


def fused_updates_allowed(metric: str, mode: str = "unfused", via: str = "class") -> bool:
    """Whether a fused_update_limit is drawn for the metric so computed (FUSED_UPDATE_LIMITS says why not)."""
    inputs = SESSION_IDS + SEGMENTED + SESSION_LEVEL + TENSOR_AVERAGED + tuple(GROUPED) + SESSIONED
    return not (mode != "unfused" or via in OFFLOADED or metric in PER_BATCH + LATEST_BATCH
                or (metric in inputs and rule_kept_out(FUSED_UPDATES_DROP_INPUTS) is not None))


def offloaded_vias(metric: str) -> tuple[str, ...]:
    """How CPUOffloadedRecMetricModule may run the metric here: merged updates only for a metric whose values
    are sums over samples (merging batches joins NDCG's sessions, XAUC's pairs, a scalar's batches, and a
    window of samples holds other samples); not at all for a metric with arguments of its own while the
    1.8 defect that drops them stands."""
    if rule_kept_out(OFFLOADED_DROPS_ARGUMENTS) is not None and (METRICS[metric][2] or metric in ARGUMENTED):
        return ()
    batch_structured = PER_BATCH + SESSION_IDS + SESSION_LEVEL + LATEST_BATCH + WINDOW_ONLY
    return OFFLOADED if metric not in batch_structured else OFFLOADED[:1]


def second_keys(spec: MetricSpec) -> tuple[int, ...]:
    """The second grouping key of each sample of a batch (SEGMENTED_ARGUMENTS' second_key_groups), or none."""
    groups = dict(spec.arguments).get("second_key_groups", 0)
    return tuple((7 * i + key) % groups for i, key in enumerate(spec.sample_keys)) if groups else ()
