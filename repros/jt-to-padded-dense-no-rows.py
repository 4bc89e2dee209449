"""Known torchrec issue jt-to-padded-dense-no-rows (listed for torchrec >=1.8,<1.10).

JaggedTensor.to_padded_dense (and to_padded_dense_weights) of a JaggedTensor with no rows and no
desired_length raises (torch.max of empty lengths) instead of returning a (0, 0) tensor.

What to do instead: pass desired_length (0 for no rows) when a JaggedTensor may have no rows.

The script builds a weighted JaggedTensor from lengths (no rows, so no values) and calls
to_padded_dense() and to_padded_dense_weights() without desired_length. Each result is compared
against a pure-Python reference of the op's meaning: one row per row of the JaggedTensor, as wide as
its longest row, padded with 0 (no rows: shape (0, 0)). The shape must match and every element must
be equal: the op only copies values and pads, so the comparison is exact.

    python this_script.py            the JaggedTensor with no rows
    python this_script.py --control  the same calls on a JaggedTensor with one row

    exit 0: torchrec matches the reference (prints OK)
    exit 1: it does not, or torchrec raised (prints REPRODUCED and where)
    exit 2: the script itself could not run (prints CANNOT RUN)
"""

import argparse
import os
import sys
import traceback

import torch

# rows of (value, weight); values and weights are small binary fractions, exact in float32
NO_ROWS = []
ONE_ROW = [[(1.5, 0.25), (-2.0, 0.5)]]


def reference_padded(rows: list, part: int) -> tuple:
    """(shape, rows as lists): each row padded with 0 to the longest row's length."""
    width = max((len(row) for row in rows), default=0)
    dense = [[pair[part] for pair in row] + [0.0] * (width - len(row)) for row in rows]
    return (len(rows), width), dense


def padded(jt, part: int) -> torch.Tensor:
    """The call under test."""
    return jt.to_padded_dense() if part == 0 else jt.to_padded_dense_weights()


def torchrec_padded(rows: list, part: int) -> tuple:
    from torchrec.sparse.jagged_tensor import JaggedTensor

    jt = JaggedTensor(values=torch.tensor([v for row in rows for v, _ in row], dtype=torch.float32),
                      weights=torch.tensor([w for row in rows for _, w in row], dtype=torch.float32),
                      lengths=torch.tensor([len(row) for row in rows], dtype=torch.int64))
    dense = padded(jt, part)
    return tuple(dense.shape), dense.tolist()


def torchrec_frame(exc: BaseException) -> str:
    """The innermost torchrec or fbgemm frame of the traceback ("" when the error is not theirs)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if f"{os.sep}torchrec{os.sep}" in f.filename or f"{os.sep}fbgemm_gpu{os.sep}" in f.filename]
    return f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].name})" if frames else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--control", action="store_true", help="a JaggedTensor with one row, which torchrec gets right")
    rows = ONE_ROW if parser.parse_args().control else NO_ROWS
    failures = []
    for part, call in enumerate(["to_padded_dense()", "to_padded_dense_weights()"]):
        what = f"JaggedTensor(lengths={[len(row) for row in rows]}).{call}"
        try:
            expected = reference_padded(rows, part)
            actual = torchrec_padded(rows, part)
        except Exception as exc:
            if not torchrec_frame(exc):
                print(f"CANNOT RUN: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
                return 2
            failures.append(f"{what} raised {type(exc).__name__}: {exc} (in {torchrec_frame(exc)})")
            continue
        if actual != expected:
            failures.append(f"{what} is {actual[1]} of shape {actual[0]}, the reference {expected[1]} of shape {expected[0]}")
    if failures:
        print(f"REPRODUCED: {len(failures)} of 2 calls wrong; {'; '.join(failures)}")
        return 1
    print(f"OK: to_padded_dense() and to_padded_dense_weights() of {len(rows)} row(s) match the reference (2 tensors compared)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
