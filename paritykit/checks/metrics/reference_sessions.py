"""What the session metrics mean, in float64 over plain Python lists (no torchrec), beside reference.py's
formulas: the samples of each batch fall into sessions by a key (one a sample, the same for every batch).

    NDCG        = over the sessions of every batch (the samples sharing a session id), the mean of
                  1 - DCG(the labels in prediction order) / DCG(the labels in label order) (NDCG itself when not
                  reported as a decreasing curve), each times the session's largest weight; DCG = sum over
                  ranks r (up to k) of gain / log2(r + 1), gain = l or 2^l - 1; an ideal DCG of 0 counts as
                  1e-6 (torchrec's guard); a negative task ranks 1 - p against 1 - l; scaled by the weights,
                  p and l are multiplied by w and the session is not weighted; sessions of one sample dropped
                  on request. Undefined where predictions tied (or nearly) with unequal labels make the order the sort's.
    recall and precision at session level = TP / (TP + FN), TP / (TP + FP), a sample predicted positive when
                  fewer than top_threshold samples of its session (in its batch) have a higher prediction, and
                  positive by its label, or (ranking the labels) when fewer than top_threshold have a higher label
                  (undefined when the denominator is 0)
"""

from __future__ import annotations

import math

from paritykit.checks.metrics.reference import Sample


def ndcg(samples: list[Sample], batch_size: int, session_ids: tuple[int, ...], negative: bool, arguments: dict) -> float | None:
    """NDCG over whole batches of ``batch_size`` samples, each split by ``session_ids`` (one id a sample, the same
    for every batch); ``arguments`` are NDCGMetric's (exponential_gain, k, report_ndcg_as_decreasing_curve,
    remove_single_length_sessions, scale_by_weights_tensor). None where undefined."""
    total, sessions = [], 0
    for start in range(0, len(samples), batch_size):
        for session in _ndcg_sessions(samples[start:start + batch_size], session_ids, negative, arguments):
            value = _session_ndcg(session, arguments)
            if value is None:
                return None
            total.append(value)
            sessions += 1
    return math.fsum(total) / sessions if sessions else None


def _ndcg_sessions(batch: list[Sample], session_ids: tuple[int, ...], negative: bool, arguments: dict) -> list[list[Sample]]:
    if negative:
        batch = [(1.0 - p, 1.0 - l, w) for p, l, w in batch]
    grouped: dict[int, list[Sample]] = {}
    for sample, session in zip(batch, session_ids):
        grouped.setdefault(session, []).append(sample)
    if arguments.get("remove_single_length_sessions"):
        grouped = {k: v for k, v in grouped.items() if len(v) > 1}
    return list(grouped.values())


def _session_ndcg(session: list[Sample], arguments: dict) -> float | None:
    scaled = arguments.get("scale_by_weights_tensor")
    if scaled:
        session = [(p * w, l * w, w) for p, l, w in session]
    k = arguments.get("k", -1)
    exponential = arguments.get("exponential_gain")

    def dcg(ranked: list[Sample]) -> float:
        kept = ranked if k == -1 else ranked[:k]
        return math.fsum(((2.0 ** l - 1.0) if exponential else l) / math.log2(r + 2) for r, (_, l, _) in enumerate(kept))

    # Predictions tied (or within float32's reach of a tie, once scaled) with unequal labels: their order is the
    # sort's, not a meaning.
    for i, (pi, li, _) in enumerate(session):
        if any(li != lj and abs(pi - pj) <= 1e-6 * max(abs(pi), abs(pj)) for pj, lj, _ in session[i + 1:]):
            return None
    ideal = dcg(sorted(session, key=lambda s: -s[1])) or 1e-6
    value = dcg(sorted(session, key=lambda s: -s[0])) / ideal
    value = 1.0 - value if arguments.get("report_ndcg_as_decreasing_curve", True) else value
    return value if scaled else value * max(0.0, *(w for _, _, w in session))


def _ranked_positive(values: list[float], keys: tuple[int, ...], top: int) -> list[bool]:
    """Whether fewer than ``top`` values of the same key are higher than each."""
    return [sum(1 for vj, kj in zip(values, keys) if kj == ki and vj > vi) < top for vi, ki in zip(values, keys)]


def _session_confusion(samples: list[Sample], batch_size: int, keys: tuple[int, ...], arguments: dict) -> tuple[float, float, float]:
    tp, fp, fn = [], [], []
    top = arguments["top_threshold"]
    for start in range(0, len(samples), batch_size):
        batch = samples[start:start + batch_size]
        predicted = _ranked_positive([p for p, _, _ in batch], keys, top)
        labelled = (_ranked_positive([l for _, l, _ in batch], keys, top) if arguments.get("run_ranking_of_labels")
                    else [l == 1.0 for _, l, _ in batch])
        for (_, _, w), yes, positive in zip(batch, predicted, labelled):
            (tp if yes and positive else fp if yes else fn if positive else []).append(w)
    return math.fsum(tp), math.fsum(fp), math.fsum(fn)


def recall_session_level(samples: list[Sample], batch_size: int, keys: tuple[int, ...], arguments: dict) -> float | None:
    tp, _, fn = _session_confusion(samples, batch_size, keys, arguments)
    return tp / (tp + fn) if tp + fn else None


def precision_session_level(samples: list[Sample], batch_size: int, keys: tuple[int, ...], arguments: dict) -> float | None:
    tp, fp, _ = _session_confusion(samples, batch_size, keys, arguments)
    return tp / (tp + fp) if tp + fp else None
