"""The torchrec defects the metrics check's draws keep clear of while they stand (known_issues.toml holds each
entry; known_broken.py runs each on purpose): the ids of their rules."""

# RecallMetric counts a positive predicted exactly at the threshold both as a true positive (p >= t) and as a
# false negative (p <= t).
RECALL_AT_THRESHOLD = "recall-threshold-counted-twice"
# CaliFreeNEMetric divides NE (already normalized) by an unnormalized cross entropy, so its value
# scales with the inverse of the weights: every case of it fails while that stands.
CALI_FREE_NE_UNNORMALIZED = "cali-free-ne-scales-with-weights"
# torchrec 1.8 (fixed in 1.9.2): WeightedAvgMetric's window counts updates, not samples, so
# it drops no batch until it has seen window_size updates; TensorWeightedAvgMetric's alike.
WEIGHTED_AVG_WINDOW = "weighted-avg-window-counts-updates"
TENSOR_WEIGHTED_AVG_WINDOW = "tensor-weighted-avg-window-counts-updates"
SCALAR_WINDOW = "scalar-window-counts-updates"
# torchrec 1.8 (fixed in 1.9.2): CPUOffloadedRecMetricModule's comms module rebuilds each metric
# without its own arguments (include_logloss, a recalibration coefficient, NDCG's, ...) and computes with
# their defaults.
OFFLOADED_DROPS_ARGUMENTS = "offloaded-module-drops-metric-arguments"
# RecalibratedNEMetric takes include_logloss, then NE's constructor sets it back to False, so
# it never reports logloss.
RECALIBRATED_NE_LOGLOSS = "recalibrated-ne-drops-include-logloss"
# NDCGMetric flips a negative task's predictions and labels in place, which in unfused computation are
# views of the caller's tensors (the model's outputs).
NDCG_NEGATIVE_TASK_IN_PLACE = "ndcg-negative-task-flips-inputs"
# NDCG computed fused through RecMetricModule with one task, or on a batch of one sample, takes no session_id (the
# module squeezes it to one dimension, NDCG asserts the stacked predictions' two).
NDCG_FUSED_MODULE_ONE_TASK = "ndcg-fused-module-one-task"
# HindsightTargetPRMetric: it reports the threshold as torch.Tensor(index), an uninitialized tensor
# of that many elements; and computed fused it raises (its states are one row, not a row a task).
HINDSIGHT_THRESHOLD_AS_SIZE = "hindsight-target-pr-threshold-as-tensor-size"
HINDSIGHT_FUSED = "hindsight-target-pr-fused"
# The grouped AUC, AUPRC and RAUC (a value a group of samples, averaged): once the window drops
# samples, AUC's and RAUC's grouping keys drop one fewer (the padding key is among those cut), so compute()
# raises; and on several ranks every rank's padding key and sample are gathered and only the first removed
# (AUC, RAUC raise; AUPRC averages in a group of the padding sample, AUPRC 0).
GROUPED_WINDOW = "grouped-auc-window-misaligns-keys"
GROUPED_ON_RANKS = "grouped-metrics-padding-on-every-rank"
# They raise on a batch of one sample (its one key squeezed to a 0-d tensor).
GROUPED_BATCH_OF_ONE = "grouped-metrics-batch-of-one"
# With fused_update_limit, update() buffers the predictions, labels and weights and drops every other input
# (required_inputs, GAUC's num_candidates), so each metric that needs one raises that it was not given.
FUSED_UPDATES_DROP_INPUTS = "fused-update-limit-drops-required-inputs"
# MultiLabelPrecisionMetric computed fused flattens every task's samples into one and holds one state a label, so with
# two tasks it reports the first task's precision over both tasks' samples and nothing for the others.
MULTI_LABEL_FUSED = "multi-label-precision-fused-mixes-tasks"
