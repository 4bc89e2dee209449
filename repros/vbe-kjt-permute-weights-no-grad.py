"""Known torchrec issue vbe-kjt-permute-weights-no-grad (listed for torchrec >=1.8,<1.10).

KeyedJaggedTensor.permute of a variable-batch KJT on CPU permutes the weights with fbgemm
permute_1D_sparse_data, which has no autograd kernel: the weights lose their gradient (None, with
only a UserWarning).

The script builds a weighted variable-batch KeyedJaggedTensor on CPU (stride_per_key_per_rank: key
f0 has 2 samples of lengths [2, 0], key f1 has 3 samples of lengths [1, 3, 1]) whose weights require
a gradient, permutes it with [1, 0] and back-propagates sum(permuted.weights() * g), g = 1, 2, 3, ...
(one distinct integer per permuted weight). The weights' gradient is compared against a pure-Python
reference of the op's meaning: permute moves each key's weights as a block, so a weight's gradient is
g at the position it lands on. Weights, g and gradient are small integers, exact in float32, so the
comparison is exact.

    python this_script.py            the variable-batch KJT
    python this_script.py --control  the same ids, weights and permutation in a fixed batch of 3
                                     samples (f0 gets a third, empty sample; no stride_per_key_per_rank)

    exit 0: torchrec matches the reference (prints OK)
    exit 1: it does not, or torchrec raised (prints REPRODUCED and where)
    exit 2: the script itself could not run (prints CANNOT RUN)
"""

import argparse
import os
import sys
import traceback

import torch

KEYS = ["f0", "f1"]
VARIABLE_BATCH = [[2, 0], [1, 3, 1]]  # per key, the lengths of its samples
FIXED_BATCH = [[2, 0, 0], [1, 3, 1]]
PERMUTATION = [1, 0]


def reference_grad(lengths: list) -> list:
    """Each weight's gradient: g (1, 2, 3, ... over the permuted weights) at the position it lands on."""
    counts = [sum(per_key) for per_key in lengths]
    starts = [sum(counts[:k]) for k in range(len(KEYS))]
    grad, position = [0.0] * sum(counts), 0
    for key in PERMUTATION:
        for j in range(starts[key], starts[key] + counts[key]):
            position += 1
            grad[j] += float(position)
    return grad


def torchrec_grad(lengths: list, variable: bool):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    total = sum(map(sum, lengths))
    weights = torch.arange(1.0, total + 1.0).requires_grad_()
    batch = {"stride_per_key_per_rank": [[len(per_key)] for per_key in lengths]} if variable else {"stride": len(lengths[0])}
    kjt = KeyedJaggedTensor(keys=KEYS, values=torch.arange(total), weights=weights,
                            lengths=torch.tensor([n for per_key in lengths for n in per_key]), **batch)
    permuted = kjt.permute(PERMUTATION).weights()
    if not permuted.requires_grad:
        return None  # nothing to back-propagate: the weights got no gradient
    (permuted * torch.arange(1.0, permuted.numel() + 1.0)).sum().backward()
    return weights.grad.tolist() if weights.grad is not None else None


def torchrec_frame(exc: BaseException) -> str:
    """The innermost torchrec or fbgemm frame of the traceback ("" when the error is not theirs)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if f"{os.sep}torchrec{os.sep}" in f.filename or f"{os.sep}fbgemm_gpu{os.sep}" in f.filename]
    return f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].name})" if frames else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--control", action="store_true", help="a fixed batch, which torchrec gets right")
    variable = not parser.parse_args().control
    lengths = VARIABLE_BATCH if variable else FIXED_BATCH
    what = f"the weights' gradient through the {'variable-batch' if variable else 'fixed-batch'} kjt.permute({PERMUTATION})"
    try:
        expected = reference_grad(lengths)
        actual = torchrec_grad(lengths, variable)
    except Exception as exc:
        if torchrec_frame(exc):
            print(f"REPRODUCED: {what} raised {type(exc).__name__}: {exc} (in {torchrec_frame(exc)})".replace("\n", " "))
            return 1
        print(f"CANNOT RUN: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        return 2
    if actual is None:
        print(f"REPRODUCED: {what} is None (the permuted weights do not require grad), the reference {expected}")
        return 1
    if actual != expected:
        print(f"REPRODUCED: {what} is {actual}, the reference {expected}")
        return 1
    print(f"OK: {what} matches the reference ({len(expected)} elements compared)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
