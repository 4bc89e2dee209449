"""Planted bugs that the `metrics` check must catch: each a realistic slip in torchrec.metrics. Each
changes what torchrec computes (tests/test_metrics.py shows it on torchrec alone first), and a
pinned case of the check catches it with the self-test's few examples."""

from __future__ import annotations

from typing import ContextManager

import torch

from paritykit.harness.patching import replaced
from paritykit.harness.plants import register

CHECK = "metrics"


@register("ne-norm-in-natural-log", check=CHECK)
def ne_norm_in_natural_log() -> ContextManager[None]:
    """NE's normalizer, the entropy of the base rate, is taken in nats while the cross entropy is in bits."""
    from torchrec.metrics import ne

    def norm(mean_label, pos_labels, neg_labels, eta):
        mean_label = mean_label.double().clamp(min=eta, max=1 - eta)
        return -pos_labels * torch.log(mean_label) - neg_labels * torch.log(1.0 - mean_label)

    return replaced(ne, "_compute_cross_entropy_norm", lambda _original: norm)


@register("window-drops-a-full-window", check=CHECK)
def window_drops_a_full_window() -> ContextManager[None]:
    """The metrics' window drops its oldest batch once it holds exactly window_size samples, not only past it."""
    from torchrec.metrics.rec_metric import WindowBuffer

    def aggregate(self, window_state, curr_state, size):
        if len(self._buffers) == self._buffers.maxlen:
            window_state -= self._buffers.popleft()
            self._window_used_size -= self._used_sizes.popleft()
        self._buffers.append(curr_state.clone())
        self._used_sizes.append(size)
        window_state += curr_state
        self._window_used_size += size
        while self._window_used_size >= self._max_size and self._buffers:
            window_state -= self._buffers.popleft()
            self._window_used_size -= self._used_sizes.popleft()

    return replaced(WindowBuffer, "_aggregate_state_impl", lambda _original: aggregate)


@register("auc-ranks-ascending", check=CHECK)
def auc_ranks_ascending() -> ContextManager[None]:
    """AUC sorts the predictions ascending before accumulating the ROC curve from the top."""
    from torchrec.metrics import auc

    def helper(original):
        def ascending(predictions, labels, weights, apply_bin=False):
            return original(-predictions, labels, weights, apply_bin)
        return ascending

    return replaced(auc, "_compute_auc_helper", helper)


@register("metric-states-not-checkpointed", check=CHECK)
def metric_states_not_checkpointed() -> ContextManager[None]:
    """Every metric state is registered non-persistent, so a checkpoint (state_dict) holds none of them and
    a resumed job's lifetime metrics start again from zero."""
    from torchrec.metrics.rec_metric import RecMetricComputation

    def planted(original):
        def add_state(self, name, default, add_window_state, **kwargs):
            original(self, name, default, add_window_state, **{**kwargs, "persistent": False})

        return add_state

    return replaced(RecMetricComputation, "_add_state", planted)


@register("recalibration-coefficient-inverted", check=CHECK)
def recalibration_coefficient_inverted() -> ContextManager[None]:
    """NE's recalibration for a negative downsampling multiplies the negatives' odds by the coefficient
    instead of dividing: p / (p + (1 - p) * k)."""
    from torchrec.metrics.ne_with_recalibration import RecalibratedNEMetricComputation

    def recalibrate(self, predictions, calibration_coef):
        return predictions if calibration_coef is None else predictions / (predictions + (1.0 - predictions) * calibration_coef)

    return replaced(RecalibratedNEMetricComputation, "_recalibrate", lambda _original: recalibrate)


@register("grouped-auc-weights-groups-by-size", check=CHECK)
def grouped_auc_weights_groups_by_size() -> ContextManager[None]:
    """Grouped AUC averages each group's AUC weighted by the group's samples, not one group one vote (the AUC of
    every sample pooled in between)."""
    from torchrec.metrics import auc

    def per_group(n_tasks, predictions, labels, weights, grouping_keys):
        preds, labs, wts = auc._concat_if_needed(predictions, labels, weights)
        keys = grouping_keys[1:] if grouping_keys.numel() and grouping_keys[0] == -1 else grouping_keys
        values = []
        for p, l, w in zip(preds, labs, wts):
            total = sum(auc._compute_auc_helper(p[keys == g], l[keys == g], w[keys == g]) * int((keys == g).sum())
                        for g in torch.unique(keys))
            values.append((total / keys.numel()).view(1).float())
        return torch.cat(values)

    return replaced(auc, "compute_auc_per_group", lambda _original: per_group)


@register("multiclass-recall-ranks-ascending", check=CHECK)
def multiclass_recall_ranks_ascending() -> ContextManager[None]:
    """Multiclass recall orders each sample's classes by ascending score, so its "top k" are the k least likely."""
    from torchrec.metrics import multiclass_recall

    def planted(original):
        def ascending(predictions, labels, weights, n_classes):
            return original(-predictions, labels, weights, n_classes)
        return ascending

    return replaced(multiclass_recall, "compute_true_positives_at_k", planted)


@register("fused-updates-not-flushed-at-compute", check=CHECK)
def fused_updates_not_flushed_at_compute() -> ContextManager[None]:
    """With fused_update_limit, compute() leaves the batches still buffered (fewer than the limit) out instead of
    flushing them first, so the values miss the latest batches."""
    from torchrec.metrics.rec_metric import RecMetric

    def planted(original):
        def check(self, force):
            return original(self, False)
        return check

    return replaced(RecMetric, "_check_fused_update", planted)
