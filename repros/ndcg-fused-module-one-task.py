"""A standalone reproduction of a TorchRec defect. It needs torch and torchrec only.

Known torchrec issue ndcg-fused-module-one-task (listed for torchrec >=1.8,<1.10).

NDCG computed fused (RecComputeMode.FUSED_TASKS_COMPUTATION) through RecMetricModule with one task fails in
update() with a bare AssertionError. RecMetricModule's parse_required_inputs squeezes the model's
session_id to one dimension; the fused update stacks the predictions to (1, n) and leaves the required
inputs as they are; ndcg._validate_model_outputs asserts the two shapes equal. No session_id the model can
give passes: (n,) stays (n,), (1, n) is squeezed to (n,). Unfused, the update views it as (1, n) and NDCG
computes.

What to do instead: compute NDCG unfused, or call NDCGMetric.update with required_inputs={"session_id": ids of
shape (n_tasks, n)}.

The script builds the module with generate_metric_module and feeds one session of three samples (predictions
0.3, 0.8, 0.5; labels 1, 0.5, 0; weights 1, 2, 1). Its oracle is 1 - NDCG of that session times its largest
weight, in float64 by hand: the labels in prediction order are 0.5, 0, 1 (DCG 1), in their own order 1, 0.5, 0
(DCG 1 + 0.5 / log2 3), so 2 (1 - 1 / 1.3155) = 0.4797.

    python this_script.py            fused: update() raises AssertionError
    python this_script.py --control  unfused: the module reports the oracle's value

    exit 0: the module reports the oracle's value
    exit 1: it raises, or reports another value
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

    from torchrec.metrics.metric_module import RecMetricModule, generate_metric_module
    from torchrec.metrics.metrics_config import MetricsConfig, RecComputeMode, RecMetricDef, RecMetricEnum, RecTaskInfo

    control = control_requested("the same module computing unfused")
    mode = RecComputeMode.UNFUSED_TASKS_COMPUTATION if control else RecComputeMode.FUSED_TASKS_COMPUTATION
    task = RecTaskInfo(name="task", label_name="label", prediction_name="prediction", weight_name="weight")
    config = MetricsConfig(rec_tasks=[task], rec_metrics={RecMetricEnum.NDCG: RecMetricDef(rec_tasks=[task], window_size=3)},
                           throughput_metric=None, rec_compute_mode=mode, state_metrics=[])
    module = generate_metric_module(RecMetricModule, config, batch_size=3, world_size=1, my_rank=0, state_metrics_mapping={},
                                    device=torch.device("cpu"))
    predictions, labels, weights = [0.3, 0.8, 0.5], [1.0, 0.5, 0.0], [1.0, 2.0, 1.0]
    try:
        module.update({"prediction": torch.tensor(predictions), "label": torch.tensor(labels), "weight": torch.tensor(weights),
                       "session_id": torch.tensor([0, 0, 0])})
        report = module.compute()
    except Exception as exc:
        return verdict_of_raise(exc, f"RecMetricModule.update/compute ({mode.name}, NDCG, one task)")
    ranked = [l for _, l in sorted(zip(predictions, labels), reverse=True)]
    dcg = sum(l / math.log2(r + 2) for r, l in enumerate(ranked))
    ideal = sum(l / math.log2(r + 2) for r, l in enumerate(sorted(labels, reverse=True)))
    expected = (1 - dcg / ideal) * max(weights)
    got = float(report["ndcg-task|lifetime_ndcg"].reshape(-1)[0])
    if abs(got - expected) > 1e-6:
        return reproduced(f"the module ({mode.name}) reports NDCG {got:.6g}; 1 - NDCG times the largest weight is {expected:.6g}")
    return ok(f"the module ({mode.name}) reports {got:.6g}, the oracle's {expected:.6g}")


if __name__ == "__main__":
    run_script(main)
