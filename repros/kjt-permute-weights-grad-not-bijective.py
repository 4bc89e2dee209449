"""Known torchrec issue kjt-permute-weights-grad-not-bijective (listed for torchrec >=1.8,<1.10).

the backward of KeyedJaggedTensor.permute (fbgemm permute_2D_sparse_data) inverts the permutation
(invert_permute), so with a key taken twice or left out the weights' gradient reads outside the
permutation: a negative-size error, a crash of the process (SIGSEGV) or wrong gradients.

The script builds a weighted KeyedJaggedTensor (keys f0, f1; 3 samples; lengths [2, 0, 1] and
[1, 3, 0]) whose weights require a gradient, permutes it with [1, 0, 1] (f1 taken twice) and
back-propagates sum(permuted.weights() * g), g = 1, 2, 3, ... (one distinct integer per permuted
weight). The weights' gradient is compared against a pure-Python reference of the op's meaning:
permute copies each weight once per time its key is taken, so a weight's gradient is the sum of g
over the positions its copies land on. The weights, g and these sums are small integers, exact in
float32, so the comparison is exact. The backward can kill the process, so it runs in a child
process (torch.multiprocessing, spawn) that the script waits for at most 120 s; a death by a
signal is reported as the reproduction.

    python this_script.py            permute([1, 0, 1])
    python this_script.py --control  permute([1, 0]): every key once (a bijection), same KJT and loss

    exit 0: torchrec matches the reference (prints OK)
    exit 1: it does not, torchrec raised, or the process computing the backward died (prints REPRODUCED)
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


KEYS = ["f0", "f1"]
LENGTHS = [[2, 0, 1], [1, 3, 0]]  # per key, per sample
TIMEOUT_S = 120
PLACES = TORCHREC + ("torch/autograd",)  # the backward's error surfaces in torch's autograd


def reference_grad(permutation: list) -> list:
    """Each weight's gradient: the sum of g (1, 2, 3, ... over the permuted weights) at its copies."""
    counts = [sum(lengths) for lengths in LENGTHS]
    starts = [sum(counts[:k]) for k in range(len(KEYS))]
    grad, position = [0.0] * sum(counts), 0
    for key in permutation:
        for j in range(starts[key], starts[key] + counts[key]):
            position += 1
            grad[j] += float(position)
    return grad


def torchrec_grad(permutation: list) -> list:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    total = sum(map(sum, LENGTHS))
    weights = torch.arange(1.0, total + 1.0).requires_grad_()
    kjt = KeyedJaggedTensor(keys=KEYS, values=torch.arange(total), weights=weights, stride=len(LENGTHS[0]),
                            lengths=torch.tensor([n for lengths in LENGTHS for n in lengths]))
    permuted = kjt.permute(permutation).weights()
    (permuted * torch.arange(1.0, permuted.numel() + 1.0)).sum().backward()
    return weights.grad.tolist() if weights.grad is not None else None


def child(permutation: list, path: str) -> None:
    """In the child process: the gradient, or the error torchrec (or the script) raised."""
    try:
        result = {"grad": torchrec_grad(permutation)}
    except Exception as exc:
        where = library_frame(exc, PLACES)
        result = {"raised" if where else "error": f"{type(exc).__name__}: {exc}", "where": where,
                  "traceback": traceback.format_exc()}
    with open(path, "w") as file:
        json.dump(result, file)


def main() -> int:
    permutation = [1, 0] if control_requested("permute([1, 0]), which torchrec gets right") else [1, 0, 1]
    what = f"the weights' gradient through kjt.permute({permutation})"
    with tempfile.TemporaryDirectory(prefix="torchrec-repro-") as scratch:
        path = os.path.join(scratch, "result.json")
        process = mp.get_context("spawn").Process(target=child, args=(permutation, path))
        process.start()
        process.join(TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join()
            return cannot_run(f"the child process computing {what} did not finish in {TIMEOUT_S} s")
        if process.exitcode and process.exitcode < 0:
            signal = -process.exitcode
            return reproduced(f"the process computing {what} died by signal {signal}"
                              f"{' (SIGSEGV)' if signal == 11 else ''} in its backward")
        if not os.path.exists(path):
            return cannot_run(f"the child process exited with {process.exitcode} and no result")
        with open(path) as file:
            result = json.load(file)
    if result.get("raised"):
        return reproduced(f"{what} raised {result['raised']} (in {result['where']})".replace("\n", " "))
    if result.get("error"):
        return cannot_run(f"{result['error']}\n{result['traceback']}")
    expected = reference_grad(permutation)
    if result["grad"] != expected:
        return reproduced(f"{what} is {result['grad']}, the reference {expected}")
    return ok(f"{what} matches the reference ({len(expected)} elements compared)")


if __name__ == "__main__":
    run_script(main)
