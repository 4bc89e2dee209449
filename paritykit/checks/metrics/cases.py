"""One metrics case: torchrec's metric class fed the spec's batches, each value it reports for each
task (lifetime and window) against the formula over the samples that value is over (reference.py).

The bound: torchrec sums float32 inputs (a product per sample, then a sum over the batch, then the
batches into float64 states), so each sum is off by at most about (n + 2) float32 roundings of its
terms' magnitude; a ratio of two such sums adds their relative errors. Held to 8 (n + 2) units of
float32 roundoff relative to max(|value|, 1): 6e-6 for 12 samples, far below what a wrong formula,
window or task does.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from paritykit.checks.metrics import reference
from paritykit.checks.metrics.specs import METRICS, MetricSpec
from paritykit.compare.bounds import unit_roundoff
from paritykit.errors import ParityError, expect

TASK_NAMES = ("task_a", "task_b")


def _tasks(spec: MetricSpec) -> list[Any]:
    from torchrec.metrics.metrics_config import RecTaskInfo

    return [RecTaskInfo(name=TASK_NAMES[t], label_name=f"label_{t}", prediction_name=f"prediction_{t}",
                        weight_name=f"weight_{t}") for t in range(spec.tasks)]


def _mode(spec: MetricSpec) -> Any:
    from torchrec.metrics.metrics_config import RecComputeMode

    return RecComputeMode.FUSED_TASKS_COMPUTATION if spec.compute_mode == "fused" else RecComputeMode.UNFUSED_TASKS_COMPUTATION


def _metric(spec: MetricSpec) -> Any:
    path, _, extra, _ = METRICS[spec.metric]
    module, name = path.rsplit(".", 1)
    cls = getattr(importlib.import_module(module), name)
    return cls(world_size=1, my_rank=0, batch_size=spec.batch_size, tasks=_tasks(spec), compute_mode=_mode(spec),
               window_size=spec.window_size, **extra)


def _metric_module(spec: MetricSpec) -> Any:
    from torchrec.metrics.metric_module import RecMetricModule, generate_metric_module
    from torchrec.metrics.metrics_config import MetricsConfig, RecMetricDef, RecMetricEnum

    _, _, extra, _ = METRICS[spec.metric]
    tasks = _tasks(spec)
    config = MetricsConfig(rec_tasks=tasks, rec_metrics={RecMetricEnum(spec.metric): RecMetricDef(
        rec_tasks=tasks, window_size=spec.window_size, arguments=dict(extra) or None)},
        throughput_metric=None, rec_compute_mode=_mode(spec), state_metrics=[])
    return generate_metric_module(RecMetricModule, config, batch_size=spec.batch_size, world_size=1, my_rank=0,
                                  state_metrics_mapping={}, device=torch.device("cpu"))


def torchrec_report(spec: MetricSpec) -> dict[str, Any]:
    """What torchrec reports after the spec's stream: the metric class's compute(), or the module's."""
    if spec.via == "module":
        module = _metric_module(spec)
        for batch in spec.batches:
            preds, labels, weights = _tensors(spec, batch)
            model_out = {}
            for t in range(spec.tasks):
                task = TASK_NAMES[t]
                model_out.update({f"prediction_{t}": preds[task], f"label_{t}": labels[task], f"weight_{t}": weights[task]})
            module.update(model_out)
        return module.compute()
    metric = _metric(spec)
    for batch in spec.batches:
        preds, labels, weights = _tensors(spec, batch)
        metric.update(predictions=preds, labels=labels, weights=weights)
    return metric.compute()


def _tensors(spec: MetricSpec, batch: tuple) -> tuple[dict, dict, dict]:
    preds, labels, weights = {}, {}, {}
    for t, samples in enumerate(batch):
        name = TASK_NAMES[t]
        preds[name] = torch.tensor([p for p, _, _ in samples], dtype=torch.float32)
        labels[name] = torch.tensor([l for _, l, _ in samples], dtype=torch.float32)
        weights[name] = torch.tensor([w for _, _, w in samples], dtype=torch.float32)
    return preds, labels, weights


def _reported(report: dict[str, Any], task: str, prefix: str, name: str) -> float:
    suffix = f"-{task}|{prefix}_{name}"
    keys = [k for k in report if k.endswith(suffix)]
    expect(len(keys) == 1, f"the report has {len(keys)} values named *{suffix} (keys: {sorted(report)})")
    value = report[keys[0]]
    expect(value.numel() == 1, f"{keys[0]} holds {value.numel()} values, not one")
    return float(value.reshape(-1)[0])


def _defined(name: str, samples: list) -> bool:
    """NE's and logloss's formulas divide by the entropy of the base rate and by the label weight:
    undefined (torchrec returns a clamped or infinite value) when those are zero."""
    weight, pos, neg = (sum(w for _, _, w in samples), sum(w * l for _, l, w in samples),
                        sum(w * (1 - l) for _, l, w in samples))
    if name == "ne":
        return pos > 0 and neg > 0
    if name == "unweighted_ne":
        return 0 < sum(l for _, l, _ in samples) < len(samples)
    if name == "logloss":
        return weight > 0
    return True


def run_metric_case(spec: MetricSpec) -> dict[str, Any]:
    report = torchrec_report(spec)
    _, names, _, window_kind = METRICS[spec.metric]
    holds = reference.window_of_samples if window_kind == "samples" else reference.window_of_batches
    compared = 0
    for t in range(spec.tasks):
        task = TASK_NAMES[t]
        stream = [list(batch[t]) for batch in spec.batches]
        spans = {"window": holds(stream, spec.window_size)}
        if spec.metric != "auc":  # AUC reports its window only
            spans["lifetime"] = [s for b in stream for s in b]
        for prefix, samples in spans.items():
            for name in names:
                if not _defined(name, samples):
                    continue
                want = getattr(reference, name)(samples)
                got = _reported(report, task, prefix, name)
                bound = 8 * (len(samples) + 2) * unit_roundoff(torch.float32) * max(abs(want), 1.0)
                if not abs(got - want) <= bound:
                    raise ParityError(
                        f"{spec.metric}: task {task} {prefix} {name} = {got:.9g}, the formula over the {len(samples)} "
                        f"samples it holds gives {want:.9g} (off by {abs(got - want):.3g}; bound {bound:.3g})")
                compared += 1
    expect(compared > 0 or all(not _defined(n, []) for n in names), "nothing compared")
    return {"compared": compared}
