"""Known torchrec issue kjt-to-dict-zero-batch (listed for torchrec 1.8.*, fixed in torchrec 1.9.2).

KeyedJaggedTensor.to_dict of a KJT with keys and a batch of no samples raises IndexError
(_maybe_compute_kjt_to_jt_dict unbinds the empty lengths into no rows at all). torchrec 1.9.2 gives
each key empty lengths and offsets [0].

The script builds a weighted KeyedJaggedTensor with keys f0 and f1 from lengths (stride 0: no
samples, no ids) and calls to_dict(). It compares each key's JaggedTensor (lengths, offsets, values,
weights) against a pure-Python reference of to_dict's meaning: key k's rows of the batch, their
lengths, the running sum of the lengths starting at 0, their ids and weights in order. to_dict only
copies numbers, so the comparison is exact (weights are small binary fractions).

    python this_script.py            the batch of no samples
    python this_script.py --control  the same keys and call with a batch of one sample

    exit 0: torchrec matches the reference (prints OK)
    exit 1: it does not, or torchrec raised (prints REPRODUCED and where)
    exit 2: the script itself could not run (prints CANNOT RUN)
"""

import argparse
import os
import sys
import traceback

import torch

# key -> rows of the batch, each row a list of (id, weight)
ZERO_BATCH = {"f0": [], "f1": []}
ONE_SAMPLE = {"f0": [[(3, 0.5), (1, 0.25)]], "f1": [[]]}


def reference_to_dict(batch: dict) -> dict:
    """What to_dict means: per key, the lengths, offsets, ids and weights of its own rows."""
    out = {}
    for key, rows in batch.items():
        lengths = [len(row) for row in rows]
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        out[key] = {"lengths": lengths, "offsets": offsets,
                    "values": [i for row in rows for i, _ in row], "weights": [w for row in rows for _, w in row]}
    return out


def torchrec_to_dict(batch: dict) -> dict:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys = list(batch)
    kjt = KeyedJaggedTensor(
        keys=keys,
        values=torch.tensor([i for k in keys for row in batch[k] for i, _ in row], dtype=torch.int64),
        weights=torch.tensor([w for k in keys for row in batch[k] for _, w in row], dtype=torch.float32),
        lengths=torch.tensor([len(row) for k in keys for row in batch[k]], dtype=torch.int32),
        stride=len(batch[keys[0]]))
    jts = kjt.to_dict()
    return {key: {"lengths": jt.lengths().tolist(), "offsets": jt.offsets().tolist(),
                  "values": jt.values().tolist(), "weights": jt.weights().tolist()} for key, jt in jts.items()}


def torchrec_frame(exc: BaseException) -> str:
    """The innermost torchrec or fbgemm frame of the traceback ("" when the error is not theirs)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if f"{os.sep}torchrec{os.sep}" in f.filename or f"{os.sep}fbgemm_gpu{os.sep}" in f.filename]
    return f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].name})" if frames else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--control", action="store_true", help="a batch of one sample, which torchrec gets right")
    control = parser.parse_args().control
    batch = ONE_SAMPLE if control else ZERO_BATCH
    what = f"KeyedJaggedTensor(keys=['f0', 'f1'], stride={len(batch['f0'])}).to_dict()"
    try:
        expected = reference_to_dict(batch)
        actual = torchrec_to_dict(batch)
    except Exception as exc:
        if torchrec_frame(exc):
            print(f"REPRODUCED: {what} raised {type(exc).__name__}: {exc} (in {torchrec_frame(exc)})")
            return 1
        print(f"CANNOT RUN: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        return 2
    if sorted(actual) != sorted(expected):
        print(f"REPRODUCED: {what} has keys {sorted(actual)}, the reference {sorted(expected)}")
        return 1
    for key in expected:
        for part in expected[key]:
            if actual[key][part] != expected[key][part]:
                print(f"REPRODUCED: {what}[{key!r}].{part}() is {actual[key][part]}, the reference {expected[key][part]}")
                return 1
    print(f"OK: {what} matches the reference ({len(expected)} keys x 4 tensors compared)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
