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
from paritykit.checks.metrics.formulas import base_rate_clamped, formulas_of, fused_batches, keyed, rounded_predictions_slack
from paritykit.checks.metrics.specs import (GROUPED, LATEST_BATCH, METRICS, MULTICLASS, NAMESPACES, OFFLOADED, RECALIBRATED,
                                            SECOND_KEY, SEGMENTED, SESSION_LEVEL, TENSOR_AVERAGED, UNPREFIXED, VARIANTS, WINDOW_ONLY,
                                            MetricSpec, compared_names, second_keys, window_compared)
from paritykit.compare.bounds import unit_roundoff
from paritykit.errors import HarnessError, NothingCompared, ParityError, expect

TASK_NAMES = ("task_a", "task_b")
# RecMetricModule's own: a compute every second batch (should_compute() says when), and a throughput metric
# whose example counts follow from the batches (its rates are wall-clock times: not compared).
COMPUTE_INTERVAL_STEPS = 2
TOTAL_EXAMPLES, ATTEMPT_EXAMPLES = "throughput-throughput|total_examples", "throughput-throughput|attempt_examples"


def _tasks(spec: MetricSpec) -> list[Any]:
    from torchrec.metrics.metrics_config import RecTaskInfo

    return [RecTaskInfo(name=TASK_NAMES[t], label_name=f"label_{t}", prediction_name=f"prediction_{t}",
                        weight_name=f"weight_{t}", **_task_options(spec, t)) for t in range(spec.tasks)]


def _task_options(spec: MetricSpec, task: int) -> dict[str, Any]:
    """A task marked negative (NDCG), the tensor a task averages and whether by the weights (the tensor average), a
    session metric's definition (its arguments are the task's, not the metric's constructor's)."""
    if spec.metric in SESSION_LEVEL:
        from torchrec.metrics.metrics_config import SessionMetricDef

        return {"session_metric_def": SessionMetricDef(session_var_name="session", **dict(spec.arguments))}
    if spec.metric in TENSOR_AVERAGED:
        return {"tensor_name": f"target_{task}", "weighted": task not in spec.unweighted_tasks}
    return {"is_negative_task": True} if task in spec.negative_tasks else {}


def _mode(spec: MetricSpec) -> Any:
    from torchrec.metrics.metrics_config import RecComputeMode

    return RecComputeMode.FUSED_TASKS_COMPUTATION if spec.compute_mode == "fused" else RecComputeMode.UNFUSED_TASKS_COMPUTATION


def _metric(spec: MetricSpec, rank: int) -> Any:
    path, _, extra, _ = METRICS[spec.metric]
    module, name = path.rsplit(".", 1)
    cls = getattr(importlib.import_module(module), name)
    return cls(world_size=spec.world_size, my_rank=rank, batch_size=spec.batch_size, tasks=_tasks(spec),
               compute_mode=_mode(spec), window_size=spec.window_size, fused_update_limit=spec.fused_updates,
               compute_on_all_ranks=spec.all_ranks, **extra, **_constructor_arguments(spec))


def _constructor_arguments(spec: MetricSpec) -> dict[str, Any]:
    """The metric's own arguments (a session metric's are its tasks'); segmented NE with a second grouping key
    takes both keys' configurations as grouping_keys."""
    if spec.metric in SESSION_LEVEL:
        return {}
    arguments = dict(spec.arguments)
    second = arguments.pop("second_key_groups", 0)
    if second:
        first = {"name": "grouping_keys", "num_groups": arguments.pop("num_groups"),
                 "cast_keys_to_int": arguments.pop("cast_keys_to_int", False)}
        arguments["grouping_keys"] = [first, {"name": SECOND_KEY, "num_groups": second}]
    return arguments


def _metric_module(spec: MetricSpec, rank: int) -> Any:
    """RecMetricModule built the trainer's way, or CPUOffloadedRecMetricModule (``via`` offloaded)."""
    from torchrec.metrics.metric_module import RecMetricModule, generate_metric_module
    from torchrec.metrics.metrics_config import BatchSizeStage, MetricsConfig, RecMetricDef, RecMetricEnum, ThroughputDef

    _, _, extra, _ = METRICS[spec.metric]
    tasks = _tasks(spec)
    config = MetricsConfig(rec_tasks=tasks, rec_metrics={RecMetricEnum(VARIANTS.get(spec.metric, spec.metric)): RecMetricDef(
        rec_tasks=tasks, window_size=spec.window_size, arguments={**extra, **_constructor_arguments(spec)} or None)},
        throughput_metric=ThroughputDef(warmup_steps=1), rec_compute_mode=_mode(spec), state_metrics=[],
        compute_interval_steps=COMPUTE_INTERVAL_STEPS, fused_update_limit=spec.fused_updates, compute_on_all_ranks=spec.all_ranks)
    if spec.via in OFFLOADED:
        from torchrec.metrics.cpu_offloaded_metric_module import CPUOffloadedRecMetricModule

        offloaded = {"model_out_device": torch.device("cpu"), "update_batch_size": 1 if spec.via == "offloaded" else 10}
        return generate_metric_module(CPUOffloadedRecMetricModule, config, batch_size=spec.batch_size, world_size=spec.world_size,
                                      my_rank=rank, state_metrics_mapping={}, device=torch.device("cpu"), module_kwargs=offloaded)
    stages = [BatchSizeStage(size, last) for size, last in spec.batch_size_stages] or None
    return generate_metric_module(RecMetricModule, config, batch_size=spec.batch_size, world_size=spec.world_size,
                                  my_rank=rank, state_metrics_mapping={}, device=torch.device("cpu"), batch_size_stages=stages)


def torchrec_report(spec: MetricSpec, rank: int = 0) -> dict[str, Any]:
    """What torchrec reports on ``rank`` after that rank's stream: the metric class's compute(), or the
    module's (on several ranks, compute() reduces every rank's states: call it on every rank). With
    ``resume_at``, the metric is checkpointed before that batch: its state_dict() loaded (strictly) into
    a fresh one, which takes the rest of the stream, as a resumed training job does; the lifetime values
    must then cover the whole stream (the states torchrec marks persistent are those it promises to
    checkpoint; its window buffers are not among them, so the window is not compared after a resume)."""
    return _fed_metric(spec, rank).compute()


def _fed_metric(spec: MetricSpec, rank: int) -> Any:
    """The metric class or module after ``rank``'s stream (resumed where the spec says)."""
    build = _metric if spec.via == "class" else _metric_module
    metric, updates = build(spec, rank), 0
    for index, batch in enumerate(spec.streams()[rank]):
        if index == spec.resume_at:
            saved = metric.state_dict()
            metric, updates = build(spec, rank), 0
            metric.load_state_dict(saved)
        preds, labels, weights = _tensors(spec, batch)
        fed = {"predictions": preds, "labels": labels, "weights": weights}
        before = {(what, task): tensor.clone() for what, tensors in fed.items() for task, tensor in tensors.items()}
        if spec.via != "class":
            model_out = {}
            for t in range(spec.tasks):
                task = TASK_NAMES[t]
                model_out.update({f"prediction_{t}": preds[task], f"label_{t}": labels[task], f"weight_{t}": weights[task]})
            metric.update({**model_out, **_required_inputs(spec, preds)})
            updates += 1
            # The module counts the batches it was given since it was built (a resumed one starts again).
            if metric.should_compute() != (updates % COMPUTE_INTERVAL_STEPS == 0):
                raise ParityError(f"{spec.metric} (module): should_compute() is {metric.should_compute()} after {updates} "
                                  f"batches with compute_interval_steps={COMPUTE_INTERVAL_STEPS}")
        else:
            metric.update(predictions=preds, labels=labels, weights=weights, **_session_inputs(spec, preds))
        _expect_untouched(spec, fed, before, index)
    return metric


def _compare_examples(spec: MetricSpec, report: dict[str, Any], who: str) -> None:
    """RecMetricModule's throughput counts: every batch given (every rank's batch size, or its stage's), and those
    since the resume (torchrec does not checkpoint the attempt's count)."""
    batches = len(spec.batches)
    for key, first in ((TOTAL_EXAMPLES, 0), (ATTEMPT_EXAMPLES, spec.resume_at or 0)):
        sizes = [_stage_batch_size(spec, index + 1) for index in range(first, batches)]
        want = sum(sizes) * spec.world_size
        expect(key in report, f"the module's report has no {key} (it has {sorted(report)})")
        if float(report[key]) != want:
            raise ParityError(f"{spec.metric} ({who}): {key} = {float(report[key]):g} after {len(sizes)} batches of "
                              f"{sizes} samples on each of {spec.world_size} ranks ({want})")


def _stage_batch_size(spec: MetricSpec, batch: int) -> int:
    """The batch size the module's stages give the ``batch``-th batch (from 1): the first stage whose last batch is
    not before it (the last stage has none)."""
    for size, last in spec.batch_size_stages:
        if last is None or batch <= last:
            return size
    return spec.batch_size


def _expect_untouched(spec: MetricSpec, fed: dict, before: dict, batch: int) -> None:
    """update() reads the model's outputs; writing to them changes what the loss, other metrics and the
    rest of the step see."""
    for (what, task), was in before.items():
        if not torch.equal(fed[what][task].view(torch.int32), was.view(torch.int32)):  # bit for bit: NaN labels too
            raise ParityError(f"{spec.metric} ({spec.via}): update() changed the {what} of {task} it was fed in batch {batch}: "
                              f"{was.tolist()} became {fed[what][task].tolist()}")


def report_on_rank(spec: MetricSpec) -> dict[str, dict[str, float]]:
    """Run on every rank of a pool: this rank's reports, as plain numbers: ``reduced``, compute() over every
    rank's states; ``local``, local_compute() over this rank's alone; and for RecMetricModule ``restored``,
    local_compute() of a fresh module that loaded get_pre_compute_states() (every rank's states gathered
    and reduced, as a job hands them to another process), which covers every rank's samples again."""
    import torch.distributed as dist

    def numbers(report: dict) -> dict[str, float | list[float]]:
        return {k: float(v.reshape(-1)[0]) if v.numel() == 1 else _listed(v) for k, v in report.items()}

    rank = dist.get_rank()
    metric = _fed_metric(spec, rank)
    if spec.via in OFFLOADED:  # its compute thread gathers the states; local ones once the worker is done
        try:
            reduced = metric.async_compute().resolve()
            return {"reduced": numbers(reduced), "local": numbers(metric.local_compute())}
        finally:
            metric.shutdown()
    reports = {"local": numbers(metric.local_compute())}
    if spec.via == "module":
        fresh = _metric_module(spec, rank)
        fresh.load_pre_compute_states(metric.get_pre_compute_states())
        reports["restored"] = numbers(fresh.local_compute())
    reports["reduced"] = numbers(metric.compute())
    return reports


def _session_inputs(spec: MetricSpec, preds: dict) -> dict[str, Any]:
    """GAUC's ``num_candidates`` (the sizes of a batch's consecutive sessions), the others' ``required_inputs``."""
    if spec.sessions:
        return {"num_candidates": torch.tensor(spec.sessions)}
    required = _required_inputs(spec, preds)
    return {"required_inputs": required} if required else {}


def _required_inputs(spec: MetricSpec, preds: dict) -> dict[str, torch.Tensor]:
    """NDCG's ``session_id`` of every sample (one row a task when the tasks are computed fused: NDCG asserts
    the shape of the stacked predictions; one row when unfused: torchrec views it as each task's row);
    segmented NE's ``grouping_keys`` (int64, or float32 to be cast) and its second key; the grouped metrics'
    ``grouping_keys``; the session metrics' ``session``; the tensor each task averages, 1 - p."""
    if spec.metric in TENSOR_AVERAGED:
        return {f"target_{t}": 1.0 - preds[TASK_NAMES[t]] for t in range(spec.tasks)}
    if not spec.sample_keys:
        return {}
    keys = torch.tensor(spec.sample_keys)
    if spec.metric in SEGMENTED:
        second = second_keys(spec)
        return {"grouping_keys": keys.float() if dict(spec.arguments).get("cast_keys_to_int") else keys,
                **({SECOND_KEY: torch.tensor(second)} if second else {})}
    if spec.metric in GROUPED:
        return {"grouping_keys": keys}
    if spec.metric in SESSION_LEVEL:
        return {"session": keys}
    return {"session_id": keys.expand(spec.tasks, -1).contiguous() if spec.compute_mode == "fused" else keys}


def _tensors(spec: MetricSpec, batch: tuple) -> tuple[dict, dict, dict]:
    """Each task's predictions (a score a class of a multiclass metric's: a row a sample), labels and weights."""
    preds, labels, weights = {}, {}, {}
    classes = dict(spec.arguments).get("number_of_classes") if spec.metric in MULTICLASS else None
    for t, samples in enumerate(batch):
        name = TASK_NAMES[t]
        preds[name] = torch.tensor([reference.class_scores(p, classes) if classes else p for p, _, _ in samples], dtype=torch.float32)
        labels[name] = torch.tensor([l for _, l, _ in samples], dtype=torch.float32)
        weights[name] = torch.tensor([w for _, _, w in samples], dtype=torch.float32)
    return preds, labels, weights


def _reported(report: dict[str, Any], metric: str, task: str, prefix: str, name: str) -> float:
    """The value torchrec names ``<metric>-<task>|<prefix><name>`` (``metric``: the metric's namespace, its
    name or NAMESPACES'; ``prefix``: "lifetime_", "local_window_", ...; ``name[k]``: the k-th of a vector's
    values): the key is part of what users read, so another name fails too."""
    name, _, index = name.partition("[")
    key = f"{metric}-{task}|{prefix}{name}"
    expect(key in report, f"the report has no {key} (it has {sorted(report)})")
    values = _listed(report[key])
    if not index:
        expect(len(values) == 1, f"{key} holds {len(values)} values, not one")
        return values[0]
    k = int(index.rstrip("]"))
    expect(k < len(values), f"{key} holds {len(values)} values, no value {k}")
    return values[k]


def _listed(value: Any) -> list[float]:
    """A reported value as a list of numbers (a tensor of torchrec's, a number or list a rank sent back)."""
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, list):
        return value
    return [float(v) for v in value.reshape(-1)]


def run_metric_case(spec: MetricSpec, pool: Any = None, every_value: bool = False) -> dict[str, Any]:
    """Single-rank specs run here; a spec of several ranks runs on ``pool``, and rank 0's report (the
    reduced values; other ranks may report nothing, or the same) is compared. ``every_value``: also the
    values a standing known issue keeps out of the draws (a known-broken case's)."""
    if spec.world_size == 1:
        report = torchrec_report(spec)
        compared = _compare(spec, report, "rank 0", every_value)
        if spec.via == "module":
            _compare_examples(spec, report, "rank 0")
    else:
        if pool is None or pool.world_size != spec.world_size:
            raise HarnessError(f"a metrics case of {spec.world_size} ranks needs a pool of that size")
        compared = _compare_ranks(spec, pool.call(report_on_rank, (spec,), case=spec.case_id()), every_value)
    if compared == 0:
        raise NothingCompared(f"every value of {spec.metric} is undefined on these samples (one label only, or no weight)")
    return {"compared": compared}


def _compare_ranks(spec: MetricSpec, reports: list[dict], every_value: bool) -> int:
    """Rank 0's reduced values (another rank's too where it reports them) and restored ones over every rank's
    samples; each rank's local values over its own. How many values were compared."""
    compared = _compare(spec, reports[0]["reduced"], "rank 0", every_value)
    namespace = NAMESPACES.get(spec.metric, spec.metric)
    for rank, report in enumerate(reports):
        computes = any(key.startswith(f"{namespace}-") for key in report["reduced"])
        if rank and spec.all_ranks and not computes:
            raise ParityError(f"{spec.metric} ({spec.via}, compute_on_all_ranks=True): rank {rank}'s compute() reports none of "
                              f"its values ({sorted(report['reduced'])})")
        if rank and computes:  # one that computes reports them too
            _compare(spec, report["reduced"], f"rank {rank}", every_value)
        if spec.via != "class":
            _compare_examples(spec, report["reduced"], f"rank {rank}")
        compared += _compare(spec, report["local"], f"rank {rank}, local_compute()", every_value, key_prefix="local_",
                             ranks=(rank,))
        if "restored" in report:
            compared += _compare(spec, report["restored"], f"rank {rank}, a module restored from get_pre_compute_states()",
                                 every_value, key_prefix="local_")
    return compared


def _compare(spec: MetricSpec, report: dict[str, Any], who: str, every_value: bool = False, key_prefix: str = "",
             ranks: tuple[int, ...] | None = None) -> int:
    """Each value of ``report`` (keys ``<metric>-<task>|<key_prefix><lifetime or window>_<name>``) against its
    formula over the samples of ``ranks``' streams (every rank's by default) it holds."""
    _, every_name, _, window_kind = METRICS[spec.metric]
    names = every_name if every_value else compared_names(spec.metric)
    holds = reference.window_of_samples if window_kind == "samples" else reference.window_of_batches
    local_window = -(-spec.window_size // spec.world_size)
    compared = 0
    for t in range(spec.tasks):
        task = TASK_NAMES[t]
        streams = [[keyed(spec, batch[t]) for batch in stream] for r, stream in enumerate(spec.streams()) if ranks is None or r in ranks]
        spans = {"window": [s for stream in streams for s in holds(fused_batches(stream, spec.fused_updates), local_window)]}
        window_dropped = len(spans["window"]) < sum(len(b) for stream in streams for b in stream)
        # A resumed metric's window starts again at the checkpoint (torchrec saves the lifetime states only); a
        # worker that merges queued batches holds other batches in its window, by its timing.
        if spec.resume_at is not None or spec.via == "offloaded-merged" or not (every_value or window_compared(spec.metric)):
            del spans["window"]
        if spec.metric in LATEST_BATCH:  # each rank's latest batch (reduced by the mean over the ranks)
            spans["lifetime"] = [s for stream in streams for s in stream[-1]]
        elif spec.metric not in WINDOW_ONLY:
            spans["lifetime"] = [s for stream in streams for b in stream for s in b]
        held_to = formulas_of(spec, t, names)
        for prefix, samples in spans.items():
            if spec.metric in RECALIBRATED:
                samples = reference.recalibrated(samples, dict(spec.arguments)["recalibration_coefficient"])
            for name, formula in held_to:
                if name in UNPREFIXED and prefix != "lifetime":  # a count over every sample: no window of it
                    continue
                want = formula(samples)
                if want is None:  # undefined on these samples (formulas.defined and reference.py say where)
                    continue
                if prefix == "window" and window_dropped and base_rate_clamped(name, samples):
                    continue
                got = _reported(report, NAMESPACES.get(spec.metric, spec.metric), task,
                                key_prefix + ("" if name in UNPREFIXED else f"{prefix}_"), name)
                bound = 8 * (len(samples) + 2) * unit_roundoff(torch.float32) * max(abs(want), 1.0)
                if spec.metric in RECALIBRATED:
                    bound += rounded_predictions_slack(formula, samples, want)
                if not abs(got - want) <= bound:
                    raise ParityError(
                        f"{spec.metric} ({who}): task {task} {prefix} {name} = {got:.9g}, the formula over the {len(samples)} "
                        f"samples it holds gives {want:.9g} (off by {abs(got - want):.3g}; bound {bound:.3g})")
                compared += 1
    return compared
