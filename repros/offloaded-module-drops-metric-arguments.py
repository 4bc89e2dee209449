"""A standalone reproduction of a TorchRec defect. It needs torch and torchrec only.

Known torchrec issue offloaded-module-drops-metric-arguments (listed for torchrec 1.8.*, fixed in 1.9.2).

CPUOffloadedRecMetricModule updates its metrics in a worker thread and computes them in a comms module,
CPUCommsRecMetricModule, which rebuilds each metric (_clone_rec_metrics: type(metric)(world_size=...,
tasks=..., window_size=...)) without the metric's own keyword arguments. Every metric is then computed
with its defaults: NE configured with include_logloss=True reports no logloss, a recalibrated metric
computes with coefficient 1, segmented NE with one group.

What to do instead: upgrade to torchrec 1.9.2 (which clones each metric with its arguments), or compute
metrics with arguments of their own through RecMetricModule.

The script builds the module with generate_metric_module from a MetricsConfig asking NE with
include_logloss=True, in a process group of one rank (gloo), and feeds one batch: a negative predicted
0.3 and a positive predicted 0.8 (weight 1). Its oracle is the logloss by hand: the cross entropy over
the weight, in bits.

    python this_script.py            CPUOffloadedRecMetricModule: the report has no logloss
    python this_script.py --control  RecMetricModule from the same config: it has, the oracle's value

    exit 0: the report holds the oracle's logloss
    exit 1: it does not (the message gives what it holds)
    exit 2: the script itself could not run
"""

# --- paritykit repro prelude (generated from paritykit/gate/repro_prelude.py; do not edit) ---
# Plumbing shared by paritykit's hand-written reproductions; the script's own story follows the prelude.
import argparse
import datetime
import json
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

EXIT_OK, EXIT_REPRODUCED, EXIT_CANNOT_RUN = 0, 1, 2
TORCHREC = ("torchrec", "fbgemm_gpu")  # a raise inside these is torchrec's; elsewhere the script failed
COLLECTIVE_TIMEOUT_S = 60  # a rank waiting on a collective gives up after this
DEADLINE_S = 240  # the parent ends every rank after this


def ok(message: str) -> int:
    print(f"OK: {message}")
    return EXIT_OK


def reproduced(message: str) -> int:
    print(f"REPRODUCED: {message}")
    return EXIT_REPRODUCED


def cannot_run(message: str) -> int:
    print(f"CANNOT RUN: {message}")
    return EXIT_CANNOT_RUN


def run_script(main) -> None:
    """Exits with ``main()``'s code; an exception that escapes it is this script's failure (exit 2), never
    Python's exit 1, which would read as a reproduction."""
    try:
        code = main()
    except Exception:  # noqa: BLE001 - whatever the script itself failed on
        code = cannot_run(f"the script itself failed:\n{traceback.format_exc()}")
    sys.exit(code)


def control_requested(help_text: str) -> bool:
    """Whether the script runs its --control: the nearest configuration torchrec computes right."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").strip().splitlines()[0])
    parser.add_argument("--control", action="store_true", help=help_text)
    return parser.parse_args().control


def library_frame(exc: BaseException, places: tuple = TORCHREC) -> str:
    """The innermost frame in one of ``places`` (folders such as "torchrec" or "torch/distributed") of the
    exception's traceback, as "file:line (function: code)"; "" when the exception did not come from there."""
    marks = [os.sep + os.path.join(*place.split("/")) + os.sep for place in places]
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if any(mark in f.filename for mark in marks)]
    return f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].name}: {frames[-1].line})" if frames else ""


def first_lines(text: str, count: int = 3) -> str:
    """The reason on an exception's first lines (DCP's exception repeats every rank's traceback)."""
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith((" ", "Traceback"))]
    return " | ".join(lines[:count])


def verdict_of_raise(exc: BaseException, what: str, places: tuple = TORCHREC) -> int:
    """A raise out of ``what``: torchrec's is a reproduction (its type, message and frame); else CANNOT RUN."""
    where = library_frame(exc, places)
    if not where:
        return cannot_run(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    return reproduced(f"{what} raised {type(exc).__name__}: {exc} (in {where})".replace("\n", " "))


def roundoff_bound(expected: torch.Tensor, units: int = 64, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``units`` units of roundoff of ``dtype`` x (|expected| + max|expected|): a few roundings per operation
    summed in another order stay inside; a wrong row, state or step is off by O(1)."""
    scale = expected.abs().max() if expected.numel() else 0.0
    return units * torch.finfo(dtype).eps / 2 * (expected.abs() + scale)


def first_difference(actual: torch.Tensor, expected: torch.Tensor, bound, origin: tuple = (), oracle: str = "oracle") -> str:
    """"" when ``actual`` is within ``bound`` of ``expected`` everywhere; else the shapes, or how many elements
    differ and the first (its index in the full tensor: ``origin`` added) with both values. NaN differs."""
    if tuple(actual.shape) != tuple(expected.shape):
        return f"shape {tuple(actual.shape)} vs {oracle} {tuple(expected.shape)}"
    bad = ~((actual - expected).abs() <= bound)
    if not bool(bad.any()):
        return ""
    index = tuple(int(i) for i in bad.nonzero()[0])
    at = [o + i for o, i in zip(origin, index)] if origin else list(index)
    return (f"{int(bad.sum())} of {bad.numel()} elements differ, first at {at}: "
            f"{actual[index].item():.6g} vs {oracle} {expected[index].item():.6g}")


def start_process_group(rank: int, world_size: int, scratch: str, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
    """gloo on the CPU, a file:// rendezvous in ``scratch``, collectives that give up after ``timeout_s``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{scratch}/rendezvous", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


class OneRank:
    """A process group of this process alone (gloo, world size 1) for a with-block: DMP needs one."""

    def __enter__(self) -> "OneRank":
        self.scratch = tempfile.TemporaryDirectory(prefix="torchrec-repro-")
        start_process_group(0, 1, self.scratch.name)
        return self

    def __exit__(self, *raised) -> bool:
        if dist.is_initialized():
            dist.destroy_process_group()
        self.scratch.cleanup()
        return False  # an exception goes on to the script's verdict


def finish_rank(scratch: str, result: dict, failed: bool) -> None:
    """Hands this rank's result (a JSON dict with its "rank") to the parent. A failed rank exits at once (another
    may wait in a collective: torch.multiprocessing ends it); the others leave the process group together."""
    with open(os.path.join(scratch, f"rank{result['rank']}.json"), "w") as file:
        json.dump(result, file)
    if failed:
        sys.exit(1)
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(run_rank, args: tuple, world_size: int, deadline_s: float = DEADLINE_S) -> list:
    """Runs ``run_rank(rank, scratch, *args)`` in ``world_size`` processes (torch.multiprocessing "spawn"),
    ends them all after ``deadline_s``, and returns each rank's result. A rank that crashed, hung or wrote no
    result gets {"rank": rank, "error": why}: the script could not run, never a reproduction."""
    with tempfile.TemporaryDirectory(prefix="torchrec-repro-") as scratch:
        context = mp.start_processes(run_rank, args=(scratch, *args), nprocs=world_size, join=False, start_method="spawn")
        deadline, ended = datetime.datetime.now() + datetime.timedelta(seconds=deadline_s), ""
        try:
            while not context.join(timeout=1):
                if datetime.datetime.now() > deadline:
                    ended = f"it did not finish within {deadline_s} s"
                    break
        except Exception as exc:  # a rank exited early (it wrote why); torch.multiprocessing ended the others
            ended = f"a rank exited early ({type(exc).__name__}: {first_lines(str(exc), 1)})"
        results = [read_result(scratch, rank, ended) for rank in range(world_size)]
        for result, process in zip(results, context.processes):
            if process.is_alive():  # hung past the deadline, whatever it wrote
                process.kill()
                process.join()
                result["error"] = ended
        return results


def read_result(scratch: str, rank: int, ended: str) -> dict:
    try:
        with open(os.path.join(scratch, f"rank{rank}.json")) as file:
            return json.load(file)
    except (OSError, ValueError):
        return {"rank": rank, "error": f"it wrote no result ({ended or 'it ended without one'})"}
# --- end prelude ---


def main() -> int:
    import math

    from torchrec.metrics.cpu_offloaded_metric_module import CPUOffloadedRecMetricModule
    from torchrec.metrics.metric_module import RecMetricModule, generate_metric_module
    from torchrec.metrics.metrics_config import MetricsConfig, RecComputeMode, RecMetricDef, RecMetricEnum, RecTaskInfo

    control = control_requested("RecMetricModule from the same config")
    task = RecTaskInfo(name="task", label_name="label", prediction_name="prediction", weight_name="weight")
    config = MetricsConfig(rec_tasks=[task], rec_metrics={RecMetricEnum.NE: RecMetricDef(
        rec_tasks=[task], window_size=2, arguments={"include_logloss": True})}, throughput_metric=None,
        rec_compute_mode=RecComputeMode.UNFUSED_TASKS_COMPUTATION, state_metrics=[])
    predictions, labels = [0.3, 0.8], [0.0, 1.0]
    with OneRank():
        if control:
            module = generate_metric_module(RecMetricModule, config, batch_size=2, world_size=1, my_rank=0,
                                            state_metrics_mapping={}, device=torch.device("cpu"))
        else:
            module = generate_metric_module(CPUOffloadedRecMetricModule, config, batch_size=2, world_size=1, my_rank=0,
                                            state_metrics_mapping={}, device=torch.device("cpu"),
                                            module_kwargs={"model_out_device": torch.device("cpu"), "update_batch_size": 1})
        try:
            module.update({"prediction": torch.tensor(predictions), "label": torch.tensor(labels), "weight": torch.ones(2)})
            report = dict(module.compute()) if control else module.async_compute().resolve()
        except Exception as exc:
            return verdict_of_raise(exc, f"{type(module).__name__}.update/compute")
        finally:
            if not control:
                module.shutdown()
    key = "ne-task|lifetime_logloss"
    if key not in report:
        return reproduced(f"{type(module).__name__} with NE's include_logloss=True reports {sorted(report)}: no {key}")
    expected = -sum(l * math.log2(p) + (1 - l) * math.log2(1 - p) for p, l in zip(predictions, labels)) / 2
    got = float(report[key].reshape(-1)[0])
    if abs(got - expected) > 1e-5 * expected:
        return reproduced(f"{key} = {got:.6g}; the cross entropy over the weight is {expected:.6g}")
    return ok(f"{type(module).__name__}: {key} = {got:.6g}, the oracle's {expected:.6g}")


if __name__ == "__main__":
    run_script(main)
