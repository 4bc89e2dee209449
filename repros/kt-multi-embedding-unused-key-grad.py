"""Known torchrec issue kt-multi-embedding-unused-key-grad (listed for torchrec >=1.8,<1.10).

the backward of fbgemm permute_multi_embedding (KTRegroupAsDict, permute_multi_embedding,
regroup_kts) leaves the gradient of a KeyedTensor key that no group uses uninitialised: whatever the
memory held (KeyedTensor.regroup gives zeros), so a model that regroups a subset of an EBC's pooled
embeddings trains the left-out tables on garbage.

The script builds two KeyedTensors of pooled embeddings (64 samples; kt0 with keys f0 and f1, kt1
with key f2, 8 columns each) whose values require a gradient, regroups them with
KTRegroupAsDict([['f2', 'f0']], ['group0']) (f1 is in no group) and back-propagates
sum(group0 * g), g a fixed pattern of small integers. Each KeyedTensor's gradient is compared against
a pure-Python reference of the op's meaning: a key's columns get g's columns where the group placed
them, and zero where no group took the key. Everything is a small integer, exact in float32, so the
comparison is exact. Uninitialised memory is not always non-zero: before the backward the script
frees blocks of the gradient's size filled with 7s, and it tries up to 5 times (fresh tensors each
time); the first difference reproduces the issue.

    python this_script.py            f1 in no group
    python this_script.py --control  every key in a group: KTRegroupAsDict([['f2', 'f0'], ['f1']]),
                                     the same tensors, loss pattern and attempts

    exit 0: torchrec matches the reference (prints OK)
    exit 1: it does not, or torchrec raised (prints REPRODUCED and where)
    exit 2: the script itself could not run (prints CANNOT RUN)
"""

import argparse
import os
import sys
import traceback

import torch

BATCH, WIDTH, ATTEMPTS = 64, 8, 5
KTS = [["f0", "f1"], ["f2"]]  # the keys of each KeyedTensor, WIDTH columns each


def upstream(group: int, rows: int, columns: int) -> list:
    """g: the gradient flowing into a group's output, a fixed pattern of small integers."""
    return [[float((3 * r + 5 * c + 7 * group) % 11 - 5) for c in range(columns)] for r in range(rows)]


def reference_grads(groups: list) -> list:
    """Per KeyedTensor: g's columns where a group placed its key's columns, 0 for a key in no group."""
    grads = [[[0.0] * (WIDTH * len(keys)) for _ in range(BATCH)] for keys in KTS]
    where = {key: (t, WIDTH * k) for t, keys in enumerate(KTS) for k, key in enumerate(keys)}
    for g, group in enumerate(groups):
        g_rows = upstream(g, BATCH, WIDTH * len(group))
        for position, key in enumerate(group):
            t, start = where[key]
            for r in range(BATCH):
                for c in range(WIDTH):
                    grads[t][r][start + c] += g_rows[r][WIDTH * position + c]
    return grads


def regroup(kts: list, groups: list) -> list:
    """The call under test."""
    from torchrec.modules.regroup import KTRegroupAsDict

    names = [f"group{g}" for g in range(len(groups))]
    out = KTRegroupAsDict(groups, names)(kts)
    return [out[name] for name in names]


def torchrec_grads(groups: list) -> list:
    from torchrec.sparse.jagged_tensor import KeyedTensor

    kts = [KeyedTensor(keys=keys, length_per_key=[WIDTH] * len(keys),
                       values=torch.arange(BATCH * WIDTH * len(keys), dtype=torch.float32)
                       .remainder(13).view(BATCH, -1).requires_grad_()) for keys in KTS]
    outputs = regroup(kts, groups)
    for _ in range(2):  # freed blocks of the gradient's size, holding 7s: garbage that shows
        torch.full((BATCH, WIDTH * len(KTS[0])), 7.0).sum()
    loss = sum((out * torch.tensor(upstream(g, *out.shape))).sum() for g, out in enumerate(outputs))
    loss.backward()
    return [kt.values().grad.tolist() if kt.values().grad is not None else None for kt in kts]


def first_difference(actual: list, expected: list) -> str:
    for t, (got, want) in enumerate(zip(actual, expected)):
        if got is None:
            return f"kts[{t}] got no gradient"
        for r, (got_row, want_row) in enumerate(zip(got, want)):
            for c, (a, e) in enumerate(zip(got_row, want_row)):
                if a != e:
                    key = KTS[t][c // WIDTH]
                    return f"kts[{t}].values().grad[{r}][{c}] (key {key!r}) is {a:.6g}, the reference {e:g}"
    return ""


def torchrec_frame(exc: BaseException) -> str:
    """The innermost torchrec or fbgemm frame of the traceback ("" when the error is not theirs)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if f"{os.sep}torchrec{os.sep}" in f.filename or f"{os.sep}fbgemm_gpu{os.sep}" in f.filename]
    return f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].name})" if frames else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--control", action="store_true", help="every key in a group, which torchrec gets right")
    groups = [["f2", "f0"], ["f1"]] if parser.parse_args().control else [["f2", "f0"]]
    what = f"the gradient through KTRegroupAsDict({groups})"
    try:
        expected = reference_grads(groups)
        for attempt in range(ATTEMPTS):
            difference = first_difference(torchrec_grads(groups), expected)
            if difference:
                print(f"REPRODUCED: {what}, attempt {attempt + 1}: {difference}")
                return 1
    except Exception as exc:
        if torchrec_frame(exc):
            print(f"REPRODUCED: {what} raised {type(exc).__name__}: {exc} (in {torchrec_frame(exc)})".replace("\n", " "))
            return 1
        print(f"CANNOT RUN: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        return 2
    print(f"OK: {what} matches the reference ({ATTEMPTS} attempts x {len(KTS)} gradients compared)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
