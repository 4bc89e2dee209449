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


def main() -> int:
    cases = CONTROL if control_requested(CONTROL_HELP) else DEFECT
    wrong = []
    try:
        for name, kjt in cases.items():
            found = problems(kjt)
            verdict = torchrec_verdict(kjt)
            if verdict.startswith("accepted") != (not found):
                wrong.append(f"{name}: torchrec {verdict}; the reference: {'; '.join(found) or 'a valid KJT'}")
    except Exception as exc:
        return verdict_of_raise(exc, "torchrec")
    if wrong:
        return reproduced(f"{len(wrong)} of {len(cases)} verdicts of validate_keyed_jagged_tensor are wrong; first: {wrong[0]}")
    return ok(f"validate_keyed_jagged_tensor agrees with the reference on {len(cases)} KJTs ({', '.join(cases)})")


if __name__ == "__main__":
    run_script(main)
