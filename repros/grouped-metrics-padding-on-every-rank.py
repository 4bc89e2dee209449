"""A standalone reproduction of a TorchRec defect. It needs torch and torchrec only.

Known torchrec issue grouped-metrics-padding-on-every-rank (listed for torchrec >=1.8,<1.10).

AUCMetric, AUPRCMetric and RAUCMetric computed per group (grouped_auc, grouped_auprc, grouped_rauc: a
grouping_keys input of a key a sample) hold a padding key -1 first (AUPRC also a padding sample of
prediction, label and weight 0). On several ranks compute() gathers every rank's keys and samples and
removes the first padding only. Grouped AUC and RAUC then raise IndexError (the keys outnumber the
samples); grouped AUPRC averages in a group -1 of the other ranks' padding samples, whose AUPRC is 0, and
reports a value silently too low.

What to do instead: compute the grouped metrics on one rank (gather the predictions, labels and keys
yourself).

The script runs two ranks (gloo, CPU), each feeding one batch of four samples in groups 0, 1, 0, 1
(weight 1; rank 1's predictions 0.01 above rank 0's). Its oracle is each grouped value over both ranks'
eight samples, in float64 by hand: group 0 ranks both positives above both negatives (AUC, AUPRC 1),
group 1 both negatives first (AUC 0, AUPRC 5/12); the mean AUPRC is 17/24 = 0.708, where torchrec
reports 0.472, the mean with a third group of AUPRC 0.

    python this_script.py            two ranks: AUC and RAUC raise, AUPRC reports 0.472
    python this_script.py --control  one rank fed both ranks' samples: the oracle's values

    exit 0: every metric reports the oracle's values
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


WORLD_SIZE = 2
ORACLE_BOUND = 1e-5  # float32 sums of a few samples against float64
PREDICTIONS, LABELS, KEYS = [0.1, 0.4, 0.35, 0.8], [0.0, 1.0, 1.0, 0.0], [0, 1, 0, 1]
METRICS = (("auc", "AUCMetric"), ("auprc", "AUPRCMetric"), ("rauc", "RAUCMetric"))


def batch_of(rank: int) -> tuple:
    return [p + 0.01 * rank for p in PREDICTIONS], LABELS, KEYS


def group_auc(samples: list) -> float:
    positives = [p for p, l in samples if l == 1.0]
    negatives = [p for p, l in samples if l == 0.0]
    if not positives or not negatives:
        return 0.5  # torchrec's no-signal value
    return sum(1.0 if pp > pn else 0.5 if pp == pn else 0.0 for pp in positives for pn in negatives) / (len(positives) * len(negatives))


def group_auprc(samples: list) -> float:
    """Average precision: over the predictions from the highest down, the recall gained times the precision there."""
    positives, area, recall_before = sum(l for _, l in samples), 0.0, 0.0
    for threshold in sorted({p for p, _ in samples}, reverse=True):
        above = [l for p, l in samples if p >= threshold]
        recall = sum(above) / positives
        area += (recall - recall_before) * sum(above) / len(above)
        recall_before = recall
    return area


def group_rauc(samples: list) -> float:
    against = sum(1 for pi, li in samples for pj, lj in samples if pi < pj and li > lj)
    return 1.0 - against / (len(samples) * (len(samples) - 1) / 2)


def oracle() -> dict:
    samples, keys = [], []
    for rank in range(WORLD_SIZE):
        predictions, labels, batch_keys = batch_of(rank)
        samples += list(zip(predictions, labels))
        keys += batch_keys
    formulas = {"auc": group_auc, "auprc": group_auprc, "rauc": group_rauc}
    groups = sorted(set(keys))
    return {name: sum(formula([s for s, k in zip(samples, keys) if k == g]) for g in groups) / len(groups)
            for name, formula in formulas.items()}


def grouped_values(world_size: int, rank: int, batches: list) -> dict:
    """Each grouped value rank ``rank`` computes after ``batches``; a raise inside torchrec as its message."""
    from torchrec.metrics.auc import AUCMetric
    from torchrec.metrics.auprc import AUPRCMetric
    from torchrec.metrics.metrics_config import RecTaskInfo
    from torchrec.metrics.rauc import RAUCMetric

    task = RecTaskInfo(name="task", label_name="label", prediction_name="prediction", weight_name="weight")
    values = {}
    for (name, class_name), cls in zip(METRICS, (AUCMetric, AUPRCMetric, RAUCMetric)):
        metric = cls(world_size=world_size, my_rank=rank, batch_size=len(batches[0][0]), tasks=[task], window_size=100,
                     **{f"grouped_{name}": True})
        try:
            for predictions, labels, keys in batches:
                metric.update(predictions={"task": torch.tensor(predictions)}, labels={"task": torch.tensor(labels)},
                              weights={"task": torch.ones(len(labels))}, required_inputs={"grouping_keys": torch.tensor(keys)})
            report = metric.compute()
        except Exception as exc:
            if not library_frame(exc):
                raise
            values[name] = f"{class_name}(grouped_{name}=True) raised {type(exc).__name__}: {exc} (in {library_frame(exc)})"
            continue
        key = f"{name}-task|window_grouped_{name}"
        values[name] = float(report[key].reshape(-1)[0]) if key in report else None  # computed on rank 0 only
    return values


def run_rank(rank: int, scratch: str) -> None:
    result, stage = {"rank": rank}, "starting the process group"
    try:
        start_process_group(rank, WORLD_SIZE, scratch)
        stage = "computing the grouped metrics"
        result["values"] = grouped_values(WORLD_SIZE, rank, [batch_of(rank)])
    except Exception as exc:
        result.update(error=f"{type(exc).__name__}: {exc}", stage=stage, traceback=traceback.format_exc(limit=-6))
    finish_rank(scratch, result, failed="error" in result)


def main() -> int:
    control = control_requested("one rank fed both ranks' batches")
    if control:
        values, how = grouped_values(1, 0, [batch_of(rank) for rank in range(WORLD_SIZE)]), "one rank"
    else:
        results = run_ranks(run_rank, (), WORLD_SIZE)
        errors = [r for r in results if "error" in r]
        if errors:
            return cannot_run("; ".join(f"rank {r['rank']} while {r.get('stage', '?')}: {r['error']}\n{r.get('traceback', '')}"
                                        for r in errors))
        values, how = results[0]["values"], f"{WORLD_SIZE} ranks"
    expected, problems = oracle(), []
    for name, _ in METRICS:
        got = values[name]
        if isinstance(got, str):
            problems.append(got)
        elif got is None:
            problems.append(f"grouped {name.upper()} on {how}: rank 0 reports no window_grouped_{name}")
        elif abs(got - expected[name]) > ORACLE_BOUND:
            problems.append(f"grouped {name.upper()} on {how} = {got:.6g}; the mean of each group's over every sample is "
                            f"{expected[name]:.6g}")
    if problems:
        return reproduced("; ".join(problems).replace("\n", " "))
    return ok(f"the grouped AUC, AUPRC and RAUC on {how} give the oracle's values")


if __name__ == "__main__":
    run_script(main)
