"""Known torchrec issue kjt-validator-negative-row-length (listed for torchrec >=1.8,<1.10).

validate_keyed_jagged_tensor accepts a KeyedJaggedTensor with a row of negative length: it
checks only the sum of the lengths (a -1 beside a longer row passes) and only the first and last
offset (offsets that decrease in between pass). Workaround: check (lengths >= 0).all() yourself.

The script builds KeyedJaggedTensors from plain lists (keys, ids, lengths and/or offsets, stride or
stride_per_key_per_rank), asks torchrec.sparse.jagged_tensor_validator.validate_keyed_jagged_tensor
for its verdict (a ValueError or a returned False rejects; True accepts) and compares it with a
pure-Python reference of when a KJT means a batch (non-negative lengths summing to the ids, offsets
from 0 never decreasing to the ids, rows dividing among the keys as the stride says, one rank's
samples per key summing to the rows). Verdicts are yes/no: nothing to round, no tolerance.

    python this_script.py            keys a, b, 4 ids: lengths [-1, 3, 0, 2]; offsets [0, 4, 3, 3, 4]
    python this_script.py --control  the same keys and ids: valid lengths [1, 1, 0, 2], and lengths summing to 5 (caught)

    exit 0: torchrec's verdicts match the reference (prints OK)
    exit 1: a verdict differs, or torchrec raised (prints REPRODUCED and which KJT)
    exit 2: the script itself could not run (prints CANNOT RUN)
"""

import argparse
import os
import sys
import traceback

import torch

DEFECT = {
    "lengths [-1, 3, 0, 2]": {"keys": ["a", "b"], "values": [1, 2, 3, 4], "lengths": [-1, 3, 0, 2], "stride": 2},
    "offsets [0, 4, 3, 3, 4]": {"keys": ["a", "b"], "values": [1, 2, 3, 4], "offsets": [0, 4, 3, 3, 4], "stride": 2},
}
CONTROL = {
    "lengths [1, 1, 0, 2]": {"keys": ["a", "b"], "values": [1, 2, 3, 4], "lengths": [1, 1, 0, 2], "stride": 2},
    "lengths [2, 1, 0, 2]": {"keys": ["a", "b"], "values": [1, 2, 3, 4], "lengths": [2, 1, 0, 2], "stride": 2},
}
CONTROL_HELP = "a valid KJT and one whose lengths sum wrong, which torchrec judges right"


def problems(kjt: dict) -> list:
    """A pure-Python reference of when a KJT a user hands torchrec means a batch (no torch, no torchrec):
    every rule it breaks."""
    keys, values, lengths, offsets = kjt["keys"], len(kjt["values"]), kjt.get("lengths"), kjt.get("offsets")
    out = []
    if lengths is not None:
        out += [f"lengths[{i}] = {n} is negative" for i, n in enumerate(lengths) if n < 0]
        if sum(lengths) != values:
            out.append(f"the lengths sum to {sum(lengths)}, not the {values} values")
    if offsets is not None:
        if offsets[0] != 0:
            out.append(f"offsets start at {offsets[0]}")
        out += [f"offsets decrease at {i + 1} ({offsets[i]} -> {offsets[i + 1]})" for i in range(len(offsets) - 1) if offsets[i + 1] < offsets[i]]
        if offsets[-1] != values:
            out.append(f"offsets end at {offsets[-1]}, not at the {values} values")
    rows = len(lengths) if lengths is not None else len(offsets) - 1
    strides = kjt.get("stride_per_key_per_rank")
    if strides is None:
        if rows % len(keys):
            out.append(f"{rows} rows do not divide among {len(keys)} keys")
        elif kjt.get("stride") is not None and rows != kjt["stride"] * len(keys):
            out.append(f"{rows} rows are not {len(keys)} keys of the batch size {kjt['stride']}")
    else:
        if len(strides) != len(keys) or any(len(s) != 1 for s in strides):
            out.append(f"stride_per_key_per_rank {strides} is not one rank's samples for the {len(keys)} keys")
        elif sum(s[0] for s in strides) != rows:
            out.append(f"samples per key sum to {sum(s[0] for s in strides)}, not the {rows} rows")
    return out


def torchrec_verdict(kjt: dict) -> str:
    """'accepted' or 'rejected (...)': what validate_keyed_jagged_tensor says of the KJT."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    from torchrec.sparse.jagged_tensor_validator import validate_keyed_jagged_tensor

    args = {"keys": kjt["keys"], "values": torch.tensor(kjt["values"], dtype=torch.int64)}
    for name in ("lengths", "offsets"):
        if kjt.get(name) is not None:
            args[name] = torch.tensor(kjt[name], dtype=torch.int32)
    for name in ("stride", "stride_per_key_per_rank"):
        if kjt.get(name) is not None:
            args[name] = kjt[name]
    try:
        returned = validate_keyed_jagged_tensor(KeyedJaggedTensor(**args))
    except ValueError as exc:
        return f"rejected (ValueError: {exc})"
    return "rejected (returned False)" if returned is False else f"accepted (returned {returned!r})"


def torchrec_frame(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f"{os.sep}torchrec{os.sep}" in f.filename]
    return f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].name})" if frames else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--control", action="store_true", help=CONTROL_HELP)
    cases = CONTROL if parser.parse_args().control else DEFECT
    wrong = []
    try:
        for name, kjt in cases.items():
            found = problems(kjt)
            verdict = torchrec_verdict(kjt)
            if verdict.startswith("accepted") != (not found):
                wrong.append(f"{name}: torchrec {verdict}; the reference: {'; '.join(found) or 'a valid KJT'}")
    except Exception as exc:
        if torchrec_frame(exc):
            print(f"REPRODUCED: torchrec raised {type(exc).__name__}: {exc} (in {torchrec_frame(exc)})")
            return 1
        print(f"CANNOT RUN: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        return 2
    if wrong:
        print(f"REPRODUCED: {len(wrong)} of {len(cases)} verdicts of validate_keyed_jagged_tensor are wrong; first: {wrong[0]}")
        return 1
    print(f"OK: validate_keyed_jagged_tensor agrees with the reference on {len(cases)} KJTs ({', '.join(cases)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
