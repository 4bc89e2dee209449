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

import argparse
import json
import os
import sys
import tempfile
import traceback

import torch
import torch.multiprocessing as mp

KEYS = ["f0", "f1"]
LENGTHS = [[2, 0, 1], [1, 3, 0]]  # per key, per sample
TIMEOUT_S = 120


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


def torchrec_frame(exc: BaseException) -> str:
    """The innermost torchrec or fbgemm frame of the traceback ("" when the error is not theirs)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if f"{os.sep}torchrec{os.sep}" in f.filename or f"{os.sep}fbgemm_gpu{os.sep}" in f.filename
              or f"{os.sep}torch{os.sep}autograd{os.sep}" in f.filename]
    return f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].name})" if frames else ""


def child(permutation: list, path: str) -> None:
    """In the child process: the gradient, or the error torchrec (or the script) raised."""
    try:
        result = {"grad": torchrec_grad(permutation)}
    except Exception as exc:
        where = torchrec_frame(exc)
        result = {"raised" if where else "error": f"{type(exc).__name__}: {exc}", "where": where,
                  "traceback": traceback.format_exc()}
    with open(path, "w") as file:
        json.dump(result, file)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--control", action="store_true", help="permute([1, 0]), which torchrec gets right")
    permutation = [1, 0] if parser.parse_args().control else [1, 0, 1]
    what = f"the weights' gradient through kjt.permute({permutation})"
    with tempfile.TemporaryDirectory(prefix="torchrec-repro-") as scratch:
        path = os.path.join(scratch, "result.json")
        process = mp.get_context("spawn").Process(target=child, args=(permutation, path))
        process.start()
        process.join(TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join()
            print(f"CANNOT RUN: the child process computing {what} did not finish in {TIMEOUT_S} s")
            return 2
        if process.exitcode and process.exitcode < 0:
            signal = -process.exitcode
            print(f"REPRODUCED: the process computing {what} died by signal {signal}"
                  f"{' (SIGSEGV)' if signal == 11 else ''} in its backward")
            return 1
        if not os.path.exists(path):
            print(f"CANNOT RUN: the child process exited with {process.exitcode} and no result")
            return 2
        with open(path) as file:
            result = json.load(file)
    if result.get("raised"):
        print(f"REPRODUCED: {what} raised {result['raised']} (in {result['where']})".replace("\n", " "))
        return 1
    if result.get("error"):
        print(f"CANNOT RUN: {result['error']}\n{result['traceback']}")
        return 2
    expected = reference_grad(permutation)
    if result["grad"] != expected:
        print(f"REPRODUCED: {what} is {result['grad']}, the reference {expected}")
        return 1
    print(f"OK: {what} matches the reference ({len(expected)} elements compared)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
