"""Known torchrec issue kt-regroup-key-dim-0 (listed for torchrec >=1.8,<1.10).

KeyedTensor.regroup of KeyedTensors with key_dim 0, every key used once, takes
_fbgemm_permute_pooled_embs, which joins and permutes along dim 1 whatever the key dim: a size
error, or wrong blocks when the shapes happen to fit (the key-used-twice path and KTRegroupAsDict
honour key_dim).

The script builds two KeyedTensors whose keys lie along dim 0 (key_dim=0): kt0 with keys f0 and f1
of one row each, kt1 with key f2 of two rows, each two columns wide (so that joining along dim 1
fits and torchrec returns numbers, not an error). It calls KeyedTensor.regroup(kts, [['f2', 'f0'],
['f1']]) and compares each group against a pure-Python reference of regroup's meaning: the blocks
of the group's keys, cut from their KeyedTensor along its key dim, joined along the key dim in the
group's order. The values are small integers, copied only, so the comparison is exact (shape and
every element).

    python this_script.py            key_dim=0
    python this_script.py --control  the same keys, lengths, groups and call with key_dim=1 (the
                                     usual layout: keys along the columns)

    exit 0: torchrec matches the reference (prints OK)
    exit 1: it does not, or torchrec raised (prints REPRODUCED and where)
    exit 2: the script itself could not run (prints CANNOT RUN)
"""

import argparse
import os
import sys
import traceback

import torch

# each KeyedTensor: (keys, their lengths along the key dim, first value); the other dim is WIDTH
KTS = [(["f0", "f1"], [1, 1], 0), (["f2"], [2], 100)]
WIDTH = 2
GROUPS = [["f2", "f0"], ["f1"]]


def values_of(lengths: list, first: int, key_dim: int) -> list:
    """The KeyedTensor's values as rows: distinct small integers, keys laid along key_dim."""
    shape = (sum(lengths), WIDTH) if key_dim == 0 else (WIDTH, sum(lengths))
    return [[float(first + 10 * r + c) for c in range(shape[1])] for r in range(shape[0])]


def reference_regroup(key_dim: int) -> list:
    """Each group: its keys' blocks, cut along the key dim, joined along the key dim in group order."""
    blocks = {}
    for keys, lengths, first in KTS:
        rows, start = values_of(lengths, first, key_dim), 0
        for key, length in zip(keys, lengths):
            blocks[key] = rows[start:start + length] if key_dim == 0 else [row[start:start + length] for row in rows]
            start += length
    if key_dim == 0:
        return [[row for key in group for row in blocks[key]] for group in GROUPS]
    return [[[v for key in group for v in blocks[key][r]] for r in range(WIDTH)] for group in GROUPS]


def torchrec_regroup(key_dim: int) -> list:
    from torchrec.sparse.jagged_tensor import KeyedTensor

    kts = [KeyedTensor(keys=keys, length_per_key=lengths, key_dim=key_dim,
                       values=torch.tensor(values_of(lengths, first, key_dim), dtype=torch.float32))
           for keys, lengths, first in KTS]
    return [tensor.tolist() for tensor in KeyedTensor.regroup(kts, GROUPS)]


def torchrec_frame(exc: BaseException) -> str:
    """The innermost torchrec or fbgemm frame of the traceback ("" when the error is not theirs)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if f"{os.sep}torchrec{os.sep}" in f.filename or f"{os.sep}fbgemm_gpu{os.sep}" in f.filename]
    return f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].name})" if frames else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--control", action="store_true", help="key_dim=1, which torchrec gets right")
    key_dim = 1 if parser.parse_args().control else 0
    what = f"KeyedTensor.regroup(key_dim-{key_dim} kts, {GROUPS})"
    try:
        expected = reference_regroup(key_dim)
        actual = torchrec_regroup(key_dim)
    except Exception as exc:
        if torchrec_frame(exc):
            print(f"REPRODUCED: {what} raised {type(exc).__name__}: {exc} (in {torchrec_frame(exc)})")
            return 1
        print(f"CANNOT RUN: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        return 2
    for g, (got, want) in enumerate(zip(actual, expected)):
        if got != want:
            print(f"REPRODUCED: {what}[{g}] (keys {GROUPS[g]}) is {got}, the reference {want}")
            return 1
    if len(actual) != len(expected):
        print(f"REPRODUCED: {what} returned {len(actual)} tensors for {len(expected)} groups")
        return 1
    print(f"OK: {what} matches the reference ({len(expected)} groups compared)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
