"""A standalone reproduction of a TorchRec defect. It needs torch and torchrec only.

Known torchrec issue grouped-auc-window-misaligns-keys (listed for torchrec >=1.8,<1.10).

AUCMetric and RAUCMetric computed per group (grouped_auc=True, grouped_rauc=True: a grouping_keys input of
a key a sample) raise IndexError in compute() once the window has dropped samples. Their states start
with a padding sample and a padding key -1. The first update removes the padding sample, not the
padding key; each update then cuts the samples the window drops from both, so the keys keep one more
than the samples (here "The shape of the mask [5] at index 0 does not match the shape of the indexed
tensor [4]"). AUPRCMetric keeps its padding sample beside its key and is not affected.

What to do instead: give grouped AUC and RAUC a window_size no smaller than every sample a rank sees
between resets, or compute the grouped value outside the metric.

The script feeds two batches of four samples (groups 0, 0, 1, 1; weight 1) to AUCMetric(grouped_auc=True)
and RAUCMetric(grouped_rauc=True) with a window of four samples. Its oracle is the mean over the groups of
each group's AUC (the weight of its positive-negative pairs ranked right over all its pairs) and RAUC
(1 - its pairs ranked against their labels over all its pairs) over the samples the window holds, in
float64 by hand.

    python this_script.py            a window of four: compute() raises IndexError
    python this_script.py --control  a window of eight, which drops no sample: the oracle's values

    exit 0: both metrics report the oracle's values
    exit 1: one raises, or reports another value
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


ORACLE_BOUND = 1e-5  # float32 sums of a few samples against float64


def group_auc(samples: list) -> float:
    """AUC of one group: the weight of the (positive, negative) pairs ranked right (half on a tie) over all
    such pairs' (0.5, torchrec's no-signal value, without both labels)."""
    positives = [(p, w) for p, l, w in samples if l == 1.0]
    negatives = [(p, w) for p, l, w in samples if l == 0.0]
    pairs = sum(wp * wn for _, wp in positives for _, wn in negatives)
    if pairs == 0:
        return 0.5
    return sum(wp * wn * (1.0 if pp > pn else 0.5 if pp == pn else 0.0) for pp, wp in positives for pn, wn in negatives) / pairs


def group_rauc(samples: list) -> float:
    """RAUC of one group: 1 - the pairs ranked against their labels (p_i < p_j, l_i > l_j) over all pairs."""
    against = sum(1 for pi, li, _ in samples for pj, lj, _ in samples if pi < pj and li > lj)
    return 1.0 - against / (len(samples) * (len(samples) - 1) / 2)


def grouped(formula, samples: list, keys: list) -> float:
    groups = sorted(set(keys))
    return sum(formula([s for s, k in zip(samples, keys) if k == g]) for g in groups) / len(groups)


# Two batches of four samples, groups 0 0 1 1 in each: the first ranks every group against its labels, the
# second with them (a window of four holds the second: grouped AUC and RAUC 1).
BATCHES = [([0.2, 0.7, 0.5, 0.4], [1.0, 0.0, 0.0, 1.0]), ([0.3, 0.8, 0.6, 0.1], [0.0, 1.0, 1.0, 0.0])]
KEYS = [0, 0, 1, 1]


def main() -> int:
    from torchrec.metrics.auc import AUCMetric
    from torchrec.metrics.metrics_config import RecTaskInfo
    from torchrec.metrics.rauc import RAUCMetric

    control = control_requested("a window of eight samples, which holds both batches and drops none")
    window = 8 if control else 4
    task = RecTaskInfo(name="task", label_name="label", prediction_name="prediction", weight_name="weight")
    held = [(p, l, 1.0) for predictions, labels in BATCHES for p, l in zip(predictions, labels)][-window:]
    held_keys = (KEYS * len(BATCHES))[-window:]
    problems = []
    for cls, name, formula in ((AUCMetric, "grouped_auc", group_auc), (RAUCMetric, "grouped_rauc", group_rauc)):
        metric = cls(world_size=1, my_rank=0, batch_size=4, tasks=[task], window_size=window, **{name: True})
        try:
            for predictions, labels in BATCHES:
                metric.update(predictions={"task": torch.tensor(predictions)}, labels={"task": torch.tensor(labels)},
                              weights={"task": torch.ones(4)}, required_inputs={"grouping_keys": torch.tensor(KEYS)})
            report = metric.compute()
        except Exception as exc:
            if not library_frame(exc):
                raise
            problems.append(f"{cls.__name__}({name}=True, window_size={window}) raised {type(exc).__name__}: {exc} "
                            f"(in {library_frame(exc)})")
            continue
        key = f"{name.split('_')[1]}-task|window_{name}"
        expected = grouped(formula, held, held_keys)
        got = float(report[key].reshape(-1)[0])
        if abs(got - expected) > ORACLE_BOUND:
            problems.append(f"{key} = {got:.6g}; the mean of each group's value over the {window} samples held is {expected:.6g}")
    if problems:
        return reproduced("; ".join(problems).replace("\n", " "))
    return ok(f"grouped AUC and RAUC with a window of {window} give the oracle's values")


if __name__ == "__main__":
    run_script(main)
