"""Known torchrec issue position-weighted-processor-variable-batch (listed for torchrec >=1.8,<1.10).

PositionWeightedProcessor (torchrec.modules.feature_processor) given a KJT of a variable batch per
feature that also holds features it does not weight splits the KJT's lengths by its one stride (the
largest batch) instead of each feature's batch: a weighted feature takes another's lengths.

The script builds PositionWeightedProcessor(max_feature_lengths={"f1": 2}) on CPU, its position
weights set to [0.5, 0.25], and feeds it a KJT of keys f0, f1, f2 with a batch of 1, 3 and 1 bags
(stride_per_key_per_rank [[1], [3], [1]]): f0 [[7]], f1 [[1, 2], [], [3]], f2 [[4]]. Its oracle is the
class's docstring written out by hand: the processor keeps f1, the feature it weights, with its own
three bags, and the id at position j of a bag gets position weight j: f1's bags [[1, 2], [], [3]] with
weights [0.5, 0.25, 0.5]. The comparison is exact.

    python this_script.py            the variable batch: f0, f2 of 1 bag, f1 of 3
    python this_script.py --control  every feature of 3 bags (f0 [[7], [], []], f2 [[4], [], []])

    exit 0: the output matches the docstring's meaning (prints OK)
    exit 1: it does not, or torchrec raised (prints REPRODUCED and where)
    exit 2: the script itself could not run (prints CANNOT RUN)
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


WEIGHTS = [0.5, 0.25]  # f1's position weights


def batch(variable: bool) -> dict:
    """{feature: bags}: f1's three bags beside one bag of f0 and of f2 (three each for the control)."""
    others = [[7]] if variable else [[7], [], []]
    return {"f0": others, "f1": [[1, 2], [], [3]], "f2": [[4]] if variable else [[4], [], []]}


def torchrec_output(bags: dict, variable: bool) -> dict:
    from torchrec.modules.feature_processor import PositionWeightedProcessor
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    processor = PositionWeightedProcessor(max_feature_lengths={"f1": len(WEIGHTS)})
    with torch.no_grad():
        processor.position_weights["f1"].copy_(torch.tensor(WEIGHTS))
    keys = list(bags)
    values = torch.tensor([v for key in keys for bag in bags[key] for v in bag])
    lengths = torch.tensor([len(bag) for key in keys for bag in bags[key]])
    sizes = {"stride_per_key_per_rank": [[len(bags[key])] for key in keys]} if variable else {"stride": 3}
    out = processor(KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, **sizes))
    return {"keys": out.keys(), "bags": [row.tolist() for row in out["f1"].to_dense()], "weights": out["f1"].weights().tolist()}


def main() -> int:
    variable = not control_requested("every feature of the same batch, which torchrec gets right")
    what = ("PositionWeightedProcessor on a variable batch (f0, f2: 1 bag, f1: 3)" if variable
            else "PositionWeightedProcessor on a batch of 3 bags per feature")
    bags = batch(variable)
    expected = {"keys": ["f1"], "bags": bags["f1"], "weights": [WEIGHTS[j] for bag in bags["f1"] for j in range(len(bag))]}
    try:
        actual = torchrec_output(bags, variable)
    except Exception as exc:
        return verdict_of_raise(exc, what)
    for field, want in expected.items():
        if actual[field] != want:
            return reproduced(f"{what}: f1's {field} came back {actual[field]}, the docstring's meaning {want}")
    return ok(f"{what}: f1's keys, bags and weights match the docstring's meaning")


if __name__ == "__main__":
    run_script(main)
