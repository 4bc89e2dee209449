"""Runtime and peak memory of every torchrec training pipeline on the same model and data, KJT and TD.

``paritykit bench pipelines`` (bench/bench_pipelines.py) prints the table; ``save_benchmark(report_dir)``
writes it into a gate report. Every ratio is to TrainPipelineSparseDist with KJT batches measured in
the same run.

Runtime: each rank times every ``progress()`` call (on CUDA between events recorded on the current
stream, so the pipelines keep their overlap; on CPU with the wall clock, everything being in program
order there). A step's time is the slowest rank's; the warm-up steps of each run and the draining
steps after the data ends are left out; P50 and P90 are over the remaining steps of every round.
Configurations run in interleaved rounds on one pool, so a change of machine load spreads over all.

Memory: on CUDA the allocator's peak allocated and reserved bytes; on CPU how far the rank process'
resident set peaks above its value before the model is built (Linux: the peak is reset first, so it
is this run's), in a fresh pool per configuration (a process never gives its heap back, so an
earlier run would hide a later one's).
The larger rank's figure is reported.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from paritykit.engine.builtin_models import DataSpec, ModelSpec, batches_of, builtin_setup, make_batches
from paritykit.engine.pipeline_runs import PIPELINES, make_torchrec_pipeline
from paritykit.engine.pipeline_setup import sharded_for_training
from paritykit.checks.pipeline.td_input import to_td_batch
from paritykit.engine.training import TrainingSetup
from paritykit.harness.cpu_shim import stream_shim
from paritykit.harness.devices import rank_device

BASELINE = ("sparse_dist", "kjt")
CLASS_LABELS = {"base": "TrainPipelineBase", "sparse_dist": "TrainPipelineSparseDist", "semi_sync": "TrainPipelineSemiSync"}


@dataclass(frozen=True)
class BenchSettings:
    """The model, data and schedule of one benchmark run (defaults: a few minutes on 2 CPU cores)."""

    model: ModelSpec = field(default_factory=lambda: ModelSpec(
        num_tables=4, num_weighted_tables=1, num_embeddings=20_000, embedding_dim=64, num_float_features=16,
        sharding_types=("table_wise", "row_wise", "column_wise"), fused_optimizer="rowwise_adagrad", hidden_dim=256,
    ))
    data: DataSpec = field(default_factory=lambda: DataSpec(batch_size=512, num_batches=20, max_ids_per_feature=20))
    world_size: int = 2
    warmup_steps: int = 4
    rounds: int = 3
    device: str = "cpu"
    measure_memory: bool = True
    semi_sync_start_batch: int = 0
    # Which pipelines (names of runs.PIPELINES); each runs with KJT and with TD batches.
    pipelines: tuple[str, ...] = tuple(name for name in PIPELINES if name != "plain")
    # CPU memory runs: the peak is reached within the first steps, so a short run is enough.
    memory_batches: int = 8


@dataclass(frozen=True)
class BenchJob:
    """One pipeline on one input type; each rank makes its own batches. Picklable."""

    setup: TrainingSetup  # resolved from one step of batches; the ranks train on ``data``
    model: ModelSpec
    data: DataSpec
    pipeline: str
    input_type: str
    warmup_steps: int
    semi_sync_start_batch: int = 0


def configurations(pipelines: tuple[str, ...]) -> list[tuple[str, str]]:
    """(pipeline, input type) for each pipeline, KJT then TD; SparseDist with KJT (the baseline) always."""
    names = tuple(dict.fromkeys(("sparse_dist",) + tuple(pipelines)))
    unknown = [name for name in names if name not in PIPELINES or name == "plain"]
    if unknown:
        raise ValueError(f"unknown pipeline(s) {unknown}; known: {', '.join(n for n in PIPELINES if n != 'plain')}")
    return [(name, input_type) for input_type in ("kjt", "td") for name in names]


def label(pipeline: str) -> str:
    if pipeline in CLASS_LABELS:
        return CLASS_LABELS[pipeline]
    options = PIPELINES[pipeline][1]
    where = "after data dist" if options.get("embedding_lookup_after_data_dist") else "before optimizer"
    return f"TrainPipelineFusedSparseDist ({options['emb_lookup_stream']} stream, lookup {where})"


# ---------------------------------------------------------------------------------------------
# On each rank


def _proc_status_bytes(name: str) -> int | None:
    """A ``VmRSS``/``VmHWM`` line of /proc/self/status in bytes (None off Linux)."""
    try:
        with open("/proc/self/status") as status:
            line = next((line for line in status if line.startswith(name + ":")), None)
    except OSError:
        return None
    return None if line is None else int(line.split()[1]) * 1024


def _start_rss_window() -> int:
    """Reset the peak resident set to the current one (Linux: clear_refs 5), so the peak read after
    the run is this run's, not the import's; returns the resident set at the start."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
    except OSError:
        pass
    return _proc_status_bytes("VmRSS") or _rusage_peak_bytes()


def _peak_rss_bytes() -> int:
    return _proc_status_bytes("VmHWM") or _rusage_peak_bytes()


def _rusage_peak_bytes() -> int:
    """Lifetime peak resident set where /proc is missing (ru_maxrss: KiB on Linux, bytes on macOS);
    it cannot be reset, so the growth it gives is a lower bound."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _rank_batches(job: BenchJob, rank: int) -> list[Any]:
    batches = make_batches(job.model, job.data, rank, torch.device("cpu"))
    return [to_td_batch(batch) for batch in batches] if job.input_type == "td" else batches


def _step_times(pipeline: Any, batches: list[Any], device: torch.device) -> list[float]:
    """Seconds of each progress() call that trained a batch."""
    remaining, marks = iter(batches), []
    cuda = device.type == "cuda"
    event = (lambda: torch.cuda.Event(enable_timing=True)) if cuda else None
    start = event() if cuda else time.perf_counter()
    if cuda:
        start.record()
    while True:
        try:
            pipeline.progress(remaining)
        except StopIteration:
            break
        if cuda:
            marks.append(event())
            marks[-1].record()
        else:
            marks.append(time.perf_counter())
    if cuda:
        torch.cuda.synchronize()
        return [a.elapsed_time(b) / 1000 for a, b in zip([start] + marks, marks)]
    return [b - a for a, b in zip([start] + marks, marks)]


def time_pipeline_on_rank(job: BenchJob) -> dict[str, Any]:
    """Train every batch through the pipeline; per-step seconds (warm-up left out) and peak memory."""
    import torch.distributed as dist

    rank, device = dist.get_rank(), rank_device(job.setup.device)
    batches = _rank_batches(job, rank)
    rss_before = _start_rss_window()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model, optimizer = sharded_for_training(job.setup, device)
    with stream_shim():
        pipeline = make_torchrec_pipeline(job.pipeline, model, optimizer, device, job.semi_sync_start_batch)
        steps = _step_times(pipeline, batches, device)
    memory = {"peak_rss_growth": _peak_rss_bytes() - rss_before}
    if device.type == "cuda":
        memory = {"peak_allocated": torch.cuda.max_memory_allocated(device), "peak_reserved": torch.cuda.max_memory_reserved(device)}
    return {"step_s": steps[job.warmup_steps : len(batches)], **memory}


# ---------------------------------------------------------------------------------------------
# In the caller


@dataclass
class BenchRow:
    pipeline: str
    input_type: str
    step_s: list[float] = field(default_factory=list)
    memory: dict[str, float] = field(default_factory=dict)

    def percentile(self, q: float) -> float:
        if not self.step_s:
            return float("nan")
        return statistics.quantiles(self.step_s, n=100, method="inclusive")[int(q) - 1] if len(self.step_s) > 1 else self.step_s[0]


def _jobs(settings: BenchSettings) -> dict[tuple[str, str], BenchJob]:
    one_step = batches_of(settings.model, replace(settings.data, num_batches=1), settings.world_size)
    setup = builtin_setup(settings.model, one_step, settings.device)
    return {
        (pipeline, input_type): BenchJob(setup, settings.model, settings.data, pipeline, input_type, settings.warmup_steps,
                                         settings.semi_sync_start_batch)
        for pipeline, input_type in configurations(settings.pipelines)
    }


def _merge_steps(per_rank: list[dict[str, Any]]) -> list[float]:
    return [max(steps) for steps in zip(*(record["step_s"] for record in per_rank))]


def run_benchmark(settings: BenchSettings = BenchSettings(), progress: Any = None) -> list[BenchRow]:
    """Every configuration: ``settings.rounds`` interleaved timing rounds on one pool, then memory
    (on CUDA from the first round; on CPU in a fresh pool per configuration)."""
    from paritykit.dist import RankPool

    jobs = _jobs(settings)
    rows = {key: BenchRow(*key) for key in jobs}
    with RankPool(settings.world_size, device=settings.device) as pool:
        for round_index in range(settings.rounds):
            for key, job in jobs.items():
                per_rank = pool.call(time_pipeline_on_rank, (job,), case=f"bench {key}")
                rows[key].step_s += _merge_steps(per_rank)
                if settings.device == "cuda" and round_index == 0:
                    rows[key].memory = _largest(per_rank)
                if progress:
                    progress(f"round {round_index + 1}/{settings.rounds}: {label(key[0])} {key[1].upper()}")
    if settings.device != "cuda" and settings.measure_memory:
        for key, job in jobs.items():
            short = replace(job, data=replace(job.data, num_batches=min(job.data.num_batches, settings.memory_batches)))
            with RankPool(settings.world_size, device=settings.device) as pool:
                rows[key].memory = _largest(pool.call(time_pipeline_on_rank, (short,), case=f"bench memory {key}"))
            if progress:
                progress(f"memory: {label(key[0])} {key[1].upper()}")
    return list(rows.values())


def _largest(per_rank: list[dict[str, Any]]) -> dict[str, float]:
    return {key: float(max(record[key] for record in per_rank)) for key in per_rank[0] if key != "step_s"}
