"""Known torchrec issue kjt-offsets-zero-batch (listed for torchrec >=1.8,<1.10).

a KeyedJaggedTensor given only offsets (no lengths, no length_per_key) with a batch of no samples
cannot compute length_per_key (torch.diff(offsets).view(-1, 0)), so from_offsets_sync, to_dict,
split, permute and __getitem__ raise; the lengths path guards the empty case.

The script builds a KeyedJaggedTensor with keys f0 and f1 by KeyedJaggedTensor.from_offsets_sync
(offsets [0], stride 0: no samples, no ids) and asks it what a user asks of a batch: length_per_key(),
lengths(), permute([1, 0]) (lengths and ids) and kjt['f1'] (to_dict is left out: on torchrec 1.8 a
batch of no samples also fails there by issue kjt-to-dict-zero-batch, whatever the KJT was built from).
Each answer is compared against a pure-Python reference of the op's meaning computed from the batch's
rows (per key: its rows' lengths and ids; a permutation reorders whole keys). Only integers are
copied, so the comparison is exact.

    python this_script.py            the batch of no samples, given by offsets
    python this_script.py --control  the same keys and ops with a batch of one sample, given by offsets

    exit 0: torchrec matches the reference (prints OK)
    exit 1: it does not, or torchrec raised (prints REPRODUCED and where)
    exit 2: the script itself could not run (prints CANNOT RUN)
"""

import argparse
import os
import sys
import traceback

import torch

# key -> rows of the batch (ids)
ZERO_BATCH = {"f0": [], "f1": []}
ONE_SAMPLE = {"f0": [[3, 1]], "f1": [[2]]}


def reference(batch: dict) -> dict:
    """The meaning of each op, from the rows: a key's lengths and ids; permute reorders whole keys."""
    keys = list(batch)
    lengths = {k: [len(row) for row in batch[k]] for k in keys}
    ids = {k: [i for row in batch[k] for i in row] for k in keys}
    permuted = [keys[1], keys[0]]
    return {"length_per_key()": [sum(lengths[k]) for k in keys],
            "lengths()": [n for k in keys for n in lengths[k]],
            "permute([1, 0]).lengths()": [n for k in permuted for n in lengths[k]],
            "permute([1, 0]).values()": [i for k in permuted for i in ids[k]],
            "kjt['f1'].lengths()": lengths["f1"],
            "kjt['f1'].values()": ids["f1"]}


def build(batch: dict):
    """The batch as a KeyedJaggedTensor given by offsets only."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys = list(batch)
    offsets = [0]
    for key in keys:
        for row in batch[key]:
            offsets.append(offsets[-1] + len(row))
    return KeyedJaggedTensor.from_offsets_sync(
        keys=keys, values=torch.tensor([i for k in keys for row in batch[k] for i in row], dtype=torch.int64),
        offsets=torch.tensor(offsets, dtype=torch.int32), stride=len(batch[keys[0]]))


def torchrec_answers(batch: dict) -> dict:
    kjt = build(batch)
    answers = {"length_per_key()": lambda: kjt.length_per_key(), "lengths()": lambda: kjt.lengths().tolist()}
    answers["permute([1, 0]).lengths()"] = lambda: kjt.permute([1, 0]).lengths().tolist()
    answers["permute([1, 0]).values()"] = lambda: kjt.permute([1, 0]).values().tolist()
    answers["kjt['f1'].lengths()"] = lambda: kjt["f1"].lengths().tolist()
    answers["kjt['f1'].values()"] = lambda: kjt["f1"].values().tolist()
    return answers


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
    kjt_text = f"KeyedJaggedTensor.from_offsets_sync(keys=['f0', 'f1'], offsets=..., stride={len(batch['f0'])})"
    failures = []
    try:
        expected = reference(batch)
        answers = torchrec_answers(batch)
        for what, want in expected.items():
            try:
                got = answers[what]()
            except Exception as exc:
                if not torchrec_frame(exc):
                    raise
                failures.append(f"{what} raised {type(exc).__name__}: {exc} (in {torchrec_frame(exc)})")
                continue
            if got != want:
                failures.append(f"{what} is {got}, the reference {want}")
    except Exception as exc:
        if torchrec_frame(exc):  # building the KJT itself
            print(f"REPRODUCED: {kjt_text} raised {type(exc).__name__}: {exc} (in {torchrec_frame(exc)})")
            return 1
        print(f"CANNOT RUN: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        return 2
    if failures:
        print(f"REPRODUCED: {len(failures)} of {len(expected)} answers of {kjt_text} are wrong; first: {failures[0]}")
        return 1
    print(f"OK: {kjt_text} matches the reference ({len(expected)} answers compared)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
