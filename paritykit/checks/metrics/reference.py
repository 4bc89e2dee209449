"""What each metric means, in float64 over plain Python lists (no torchrec): the weighted formula of
every reported value, over the samples a lifetime or a window holds.

A sample is (prediction p, label l, weight w), l in {0, 1}. With sums over the held samples:
    NE          = the cross entropy over the entropy of the base rate m = pos / sum w, both in bits:
                  sum w*(-l log2 p - (1-l) log2(1-p)) / (-pos log2 m - neg log2(1-m))
    logloss     = sum w*CE(p, l) / (pos + neg)
    CTR         = pos / sum w                       (0 when sum w = 0)
    calibration = sum w*p / pos                     (0 when pos <= 0)
    MSE, RMSE   = sum w*(p-l)^2 / sum w, its root   (0 when sum w = 0)
    MAE         = sum w*|p-l| / sum w               (0 when sum w = 0)
    accuracy    = sum w*[ (p >= t) == l ] / sum w   (0 when sum w = 0)
    precision   = TP / (TP + FP), recall = TP / (TP + FN)  (0 when empty), TP = sum w*[p >= t]*l,
                  FP = sum w*[p >= t]*(1-l), FN = sum w*[p < t]*l
    AUC         = sum over positive i, negative j of w_i w_j [p_i > p_j] (+ half on ties), over
                  sum w*l * sum w*(1-l)                      (0.5 when either sum is 0)
    unweighted NE = NE with every weight 1; num_positive_samples = pos; sum_weights = sum w;
    weighted_sum_predictions = sum w*p
    NE positive = the positives' part of NE's cross entropy, sum w*l*(-log2 p), over NE's norm
    NMSE, NRMSE = MSE over the MSE of the constant prediction 1 (torchrec's baseline), RMSE over its root
                  (0 when that baseline is 0)
    weighted_avg, prediction_average = sum w*p / sum w (weighted_avg undefined, average 0, when sum w = 0);
    label_average = pos / sum w (0 when sum w = 0); serving NE and calibration = NE and calibration
    AUPRC       = average precision: over the distinct predictions t, highest first,
                  sum (R(t) - R(t_prev)) * P(t), P and R the weighted precision and recall of [p >= t]
                  (undefined without a positive's weight)
    GAUC        = over the sessions (consecutive samples of a batch) with both labels' weight and predictions
                  not all equal, the mean of each session's AUC (0.5 without one); gauc_num_samples = how
                  many such sessions
    calibration-free NE = the cross entropy over the cross entropy of the weighted mean prediction
                  q = sum w*p / sum w: sum w*CE(p, l) / (-pos log2 q - neg log2(1-q)), i.e. NE over the NE
                  of a model that predicts q everywhere (no change when every weight is scaled)
    recalibrated NE and calibration = NE and calibration of the predictions recalibrated for a negative
                  downsampling by k (the recalibration coefficient): p' = p / (p + (1-p)/k)
    RAUC        = 1 - (the pairs ranked against their labels: p_i < p_j and l_i > l_j) / (n(n-1)/2), over
                  the n samples held, weights not used (a pair tied in prediction or label is not against)
    XAUC        = over the pairs i < j of one batch, sum w_i w_j [p and l ordered alike, or both tied] over
                  sum w_i w_j (0 without a pair's weight)
    num_missing_labels = the weight of the samples whose label is NaN
    segmented NE, logloss_<g> = NE and logloss over the samples whose group key is g
    scalar      = the mean over the batches held of each batch's mean label (the label is the value logged);
                  its lifetime holds the latest batch only
    NDCG, recall and precision at session level: reference_sessions.py
    hindsight target PR = the index i of the lowest of 1000 thresholds t_i = i / 999 whose precision of
                  [p >= t_i] reaches the target precision (the last when none does), and that threshold's
                  precision and recall (0 where their denominator is)
    grouped AUC, AUPRC, RAUC = over the groups of the samples held (a key a sample), the mean of the
                  metric over each group's samples (undefined where a group's is)
    total_examples = the samples of a weight other than 0 (the serving metrics' count)
    multi-label precision of label i = TP_i / (TP_i + FP_i) (0 when that is 0), p and l codes whose bit i
                  (lowest first) says whether label i is predicted and whether it holds: TP_i = sum w*b_i(p)*b_i(l),
                  FP_i = sum w*b_i(p)*(1-b_i(l))
    multiclass recall at k = the weight of the samples whose label is among the k classes of the highest
                  scores, over every sample's weight (undefined when that is 0), for k = 1 .. the classes
    tensor weighted_avg = sum w*x / sum w, or the plain mean of x for a task not weighted, x a tensor of the
                  model's outputs other than the predictions (paritykit feeds x = 1 - p)
where pos = sum w*l, neg = sum w*(1-l), t the threshold (0.5). In NE, logloss, NE positive, unweighted,
serving and segmented NE, and the calibration-free NE's cross entropy, p and NE's base rate m are clamped
to [1e-12, 1 - 1e-12] (torchrec's eta): a saturated prediction or a window of one label gives a finite
value, not log2(0). RAUC and XAUC take labels in [0, 1] (a regression target), num_missing_labels NaN
among them.

Which samples a value is over: *lifetime* every sample given; *window* (torchrec's window_size, per
rank ceil(window_size / world_size) = W): for the state metrics the most recent whole batches whose
samples number at most W (a batch that would overflow drops the oldest batches); for AUC the most
recent W samples.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Callable

Sample = tuple[float, float, float]  # prediction, label, weight
THRESHOLD = 0.5
ETA = 1e-12  # the NE family's eta: predictions and NE's base rate m are taken within [eta, 1 - eta]


def sums(samples: list[Sample]) -> tuple[float, float, float]:
    """(sum w, pos, neg) of the samples."""
    weight = math.fsum(w for _, _, w in samples)
    pos = math.fsum(w * l for _, l, w in samples)
    neg = math.fsum(w * (1.0 - l) for _, l, w in samples)
    return weight, pos, neg


def clamped(x: float) -> float:
    """x within [ETA, 1 - ETA]: the NE family's guard against log2(0) (a saturated prediction, a base rate of all
    positives or all negatives)."""
    return min(max(x, ETA), 1.0 - ETA)


def _cross_entropy(samples: list[Sample]) -> float:
    return math.fsum(-w * l * math.log2(clamped(p)) - w * (1.0 - l) * math.log2(1.0 - clamped(p)) for p, l, w in samples)


def ne(samples: list[Sample]) -> float:
    return _cross_entropy(samples) / _norm(samples)


def _norm(samples: list[Sample]) -> float:
    """NE's denominator: the cross entropy of the base rate, in bits."""
    weight, pos, neg = sums(samples)
    mean = clamped(pos / weight)
    return -pos * math.log2(mean) - neg * math.log2(1.0 - mean)


def ne_positive(samples: list[Sample]) -> float:
    return math.fsum(-w * l * math.log2(clamped(p)) for p, l, w in samples) / _norm(samples)


def cali_free_ne(samples: list[Sample]) -> float:
    _, pos, neg = sums(samples)
    mean_prediction = weighted_avg(samples)
    return _cross_entropy(samples) / (-pos * math.log2(mean_prediction) - neg * math.log2(1.0 - mean_prediction))


def logloss(samples: list[Sample]) -> float:
    _, pos, neg = sums(samples)
    return _cross_entropy(samples) / (pos + neg)


def _ratio(num: float, den: float) -> float:
    return 0.0 if den == 0 else num / den


def ctr(samples: list[Sample]) -> float:
    weight, pos, _ = sums(samples)
    return _ratio(pos, weight)


def calibration(samples: list[Sample]) -> float:
    _, pos, _ = sums(samples)
    return 0.0 if pos <= 0 else weighted_sum_predictions(samples) / pos


def mse(samples: list[Sample]) -> float:
    return _ratio(math.fsum(w * (p - l) ** 2 for p, l, w in samples), sums(samples)[0])


def rmse(samples: list[Sample]) -> float:
    return math.sqrt(mse(samples))


def weighted_avg(samples: list[Sample]) -> float:
    return weighted_sum_predictions(samples) / sums(samples)[0]


def prediction_average(samples: list[Sample]) -> float:
    return _ratio(weighted_sum_predictions(samples), sums(samples)[0])


def label_average(samples: list[Sample]) -> float:
    weight, pos, _ = sums(samples)
    return _ratio(pos, weight)


def auprc(samples: list[Sample]) -> float:
    positives = sums(samples)[1]
    area, recall_before = 0.0, 0.0
    for threshold in sorted({p for p, _, _ in samples}, reverse=True):
        tp = math.fsum(w * l for p, l, w in samples if p >= threshold)
        fp = math.fsum(w * (1.0 - l) for p, l, w in samples if p >= threshold)
        if tp + fp > 0:
            area += (tp / positives - recall_before) * tp / (tp + fp)
            recall_before = tp / positives
    return area


def _sessions(samples: list[Sample], sizes: tuple[int, ...]) -> list[list[Sample]]:
    """The samples (whole batches, one after the other) cut into sessions of ``sizes``, batch after batch."""
    cut, start = [], 0
    while start < len(samples):
        for size in sizes:
            cut.append(samples[start:start + size])
            start += size
    return cut


def _counted_sessions(samples: list[Sample], sizes: tuple[int, ...]) -> list[list[Sample]]:
    """The sessions with both labels' weight and predictions not all equal."""
    return [s for s in _sessions(samples, sizes) if min(sums(s)[1:]) > 0 and len({p for p, _, _ in s}) > 1]


def gauc(samples: list[Sample], sizes: tuple[int, ...]) -> float:
    counted = _counted_sessions(samples, sizes)
    return math.fsum(auc(s) for s in counted) / len(counted) if counted else 0.5


def gauc_num_samples(samples: list[Sample], sizes: tuple[int, ...]) -> float:
    return float(len(_counted_sessions(samples, sizes)))


def _constant_one_mse(samples: list[Sample]) -> float:
    return _ratio(math.fsum(w * (1.0 - l) ** 2 for _, l, w in samples), sums(samples)[0])


def nmse(samples: list[Sample]) -> float:
    return _ratio(mse(samples), _constant_one_mse(samples))


def nrmse(samples: list[Sample]) -> float:
    return _ratio(rmse(samples), math.sqrt(_constant_one_mse(samples)))


def mae(samples: list[Sample]) -> float:
    return _ratio(math.fsum(w * abs(p - l) for p, l, w in samples), sums(samples)[0])


def accuracy(samples: list[Sample]) -> float:
    right = math.fsum(w for p, l, w in samples if (p >= THRESHOLD) == (l == 1.0))
    return _ratio(right, sums(samples)[0])


def _confusion(samples: list[Sample], threshold: float = THRESHOLD) -> tuple[float, float, float]:
    tp = math.fsum(w for p, l, w in samples if p >= threshold and l == 1.0)
    fp = math.fsum(w for p, l, w in samples if p >= threshold and l == 0.0)
    fn = math.fsum(w for p, l, w in samples if p < threshold and l == 1.0)
    return tp, fp, fn


def precision(samples: list[Sample]) -> float:
    tp, fp, _ = _confusion(samples)
    return _ratio(tp, tp + fp)


def recall(samples: list[Sample]) -> float:
    tp, _, fn = _confusion(samples)
    return _ratio(tp, tp + fn)


def auc(samples: list[Sample]) -> float:
    positives = [(p, w) for p, l, w in samples if l == 1.0]
    negatives = [(p, w) for p, l, w in samples if l == 0.0]
    pos, neg = math.fsum(w for _, w in positives), math.fsum(w for _, w in negatives)
    if pos * neg == 0:
        return 0.5
    ranked = math.fsum(wi * wj * (1.0 if pi > pj else 0.5 if pi == pj else 0.0)
                       for pi, wi in positives for pj, wj in negatives)
    return ranked / (pos * neg)


def unweighted_ne(samples: list[Sample]) -> float:
    return ne([(p, l, 1.0) for p, l, _ in samples])


def num_positive_samples(samples: list[Sample]) -> float:
    return sums(samples)[1]


def sum_weights(samples: list[Sample]) -> float:
    return sums(samples)[0]


def weighted_sum_predictions(samples: list[Sample]) -> float:
    return math.fsum(w * p for p, _, w in samples)


def window_of_batches(batches: list[list[Sample]], local_window: int) -> list[Sample]:
    """The most recent whole batches holding at most ``local_window`` samples."""
    held: list[list[Sample]] = []
    for batch in batches:
        held.append(batch)
        while sum(len(b) for b in held) > local_window:
            held.pop(0)
    return [s for b in held for s in b]


def window_of_samples(batches: list[list[Sample]], local_window: int) -> list[Sample]:
    """The most recent ``local_window`` samples."""
    every = [s for b in batches for s in b]
    return every[-local_window:] if local_window > 0 else []


def recalibrated(samples: list[Sample], coefficient: float) -> list[Sample]:
    """The samples with their predictions recalibrated for a negative downsampling by ``coefficient``."""
    return [(p / (p + (1.0 - p) / coefficient), l, w) for p, l, w in samples]


def rauc(samples: list[Sample]) -> float:
    against = sum(1 for pi, li, _ in samples for pj, lj, _ in samples if pi < pj and li > lj)
    n = len(samples)
    return 1.0 - against / (n * (n - 1) / 2)


def xauc(samples: list[Sample], batch_size: int) -> float:
    alike, pairs = [], []
    for start in range(0, len(samples), batch_size):
        batch = samples[start:start + batch_size]
        for i, (pi, li, wi) in enumerate(batch):
            for pj, lj, wj in batch[i + 1:]:
                pairs.append(wi * wj)
                if (pi > pj and li > lj) or (pi < pj and li < lj) or (pi == pj and li == lj):
                    alike.append(wi * wj)
    return _ratio(math.fsum(alike), math.fsum(pairs))


def num_missing_labels(samples: list[Sample]) -> float:
    return math.fsum(w for _, l, w in samples if math.isnan(l))


def tensor_weighted_avg(samples: list[Sample], weighted: bool) -> float | None:
    """The average of x = 1 - p (the tensor paritykit feeds), by the weights or plain; None without weight."""
    weight = sums(samples)[0] if weighted else float(len(samples))
    return math.fsum((w if weighted else 1.0) * (1.0 - p) for p, _, w in samples) / weight if weight else None


HINDSIGHT_THRESHOLDS = 1000


@functools.lru_cache(maxsize=16)
def _hindsight(samples: tuple[Sample, ...], target: float) -> tuple[int, float, float]:
    """(index, precision, recall) at the lowest threshold whose precision reaches ``target``: 1000 thresholds
    over the samples, computed once for the three values."""
    for i in range(HINDSIGHT_THRESHOLDS):
        tp, fp, fn = _confusion(samples, i / (HINDSIGHT_THRESHOLDS - 1))
        if _ratio(tp, tp + fp) >= target or i == HINDSIGHT_THRESHOLDS - 1:
            return i, _ratio(tp, tp + fp), _ratio(tp, tp + fn)
    raise AssertionError("unreachable")


def hindsight_target_pr(samples: list[Sample], target: float) -> float:
    return float(_hindsight(tuple(samples), target)[0])


def hindsight_target_precision(samples: list[Sample], target: float) -> float:
    return _hindsight(tuple(samples), target)[1]


def hindsight_target_recall(samples: list[Sample], target: float) -> float:
    return _hindsight(tuple(samples), target)[2]


def scalar(samples: list[Sample], batch_size: int) -> float:
    means = [math.fsum(l for _, l, _ in samples[i:i + batch_size]) / batch_size for i in range(0, len(samples), batch_size)]
    return math.fsum(means) / len(means)


def grouped(formula: Callable[[list[Sample]], float | None], keyed: list[tuple[float, float, float, int]]) -> float | None:
    """The mean over the groups of the samples (each with its group key after it) of ``formula`` over each
    group's; None (undefined) where a group's is, or where there is no sample."""
    values = [formula([s[:3] for s in keyed if s[3] == key]) for key in sorted({s[3] for s in keyed})]
    if not values or any(v is None for v in values):
        return None
    return math.fsum(values) / len(values)


def multi_label_precision(samples: list[Sample], label: int) -> float:
    def bit(code: float) -> int:
        return (int(code) >> label) & 1

    true_positives = math.fsum(w * bit(p) * bit(l) for p, l, w in samples)
    predicted = math.fsum(w * bit(p) for p, _, w in samples)
    return _ratio(true_positives, predicted)


def class_ranking(code: float, classes: int) -> tuple[int, ...]:
    """The classes from the highest score down that a multiclass prediction's code names: the code-th of their orders
    (lexicographic, modulo their number)."""
    orders = list(itertools.permutations(range(classes)))
    return orders[int(code) % len(orders)]


def class_scores(code: float, classes: int) -> list[float]:
    """Scores a class that rank the classes as ``class_ranking`` says (distinct: no tie for the sort to break)."""
    scores = [0.0] * classes
    for position, label in enumerate(class_ranking(code, classes)):
        scores[label] = (classes - position) / (classes + 1)
    return scores


def multiclass_recall(samples: list[Sample], k: int, classes: int) -> float | None:
    weight = sums(samples)[0]
    if weight == 0:
        return None
    return math.fsum(w for p, l, w in samples if int(l) in class_ranking(p, classes)[:k]) / weight


def total_examples(samples: list[Sample]) -> float:
    return float(sum(1 for _, _, w in samples if w != 0))
