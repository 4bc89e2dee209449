"""Known torchrec issue construct-jagged-tensors-zero-batch (listed for torchrec >=1.8,<1.10).

torchrec.modules.utils.construct_jagged_tensors (the sharded EmbeddingCollection's output builder) of
features with keys and a batch of no samples raises (features.lengths().view(-1, features.stride())
with stride 0: 'cannot reshape tensor of 0 elements into shape [-1, 0]') instead of returning empty
JaggedTensors. Workaround: skip the lookup for a batch of no samples.

The script calls construct_jagged_tensors as the sharded EmbeddingCollection calls it for column-wise
shards: features with key a once per shard (a, a) and key b once, each shard's embeddings (2
columns) one after the other, the shard order {"a": [1, 0]}, need_indices. It compares each output
JaggedTensor with a pure-Python reference of its meaning computed from the batch's rows: the
feature's lengths, per id the shards' columns joined in shard order, the ids as weights. Numbers are
only copied (small integers in float32), so the comparison is exact.

    python this_script.py            a batch of no samples
    python this_script.py --control  the same keys, shards and order with a batch of two samples

    exit 0: torchrec matches the reference (prints OK)
    exit 1: it does not, or torchrec raised (prints REPRODUCED and where)
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


# key -> rows of ids
NO_SAMPLES = {"a": [], "b": []}
TWO_SAMPLES = {"a": [[3, 1], []], "b": [[2], [4, 0]]}
SHARDS = ["a", "a", "b"]  # the features as the CW lookup sees them: a once per column shard
ORDER = {"a": [1, 0]}  # features_to_permute_indices: a's shards joined second shard first
DIM = 2


def pieces(batch: dict) -> list:
    """Each shard's embedding rows (one per id): shard s, id position j -> [100*s + 10*j, 100*s + 10*j + 1]."""
    return [[[100.0 * s + 10 * j + c for c in range(DIM)] for j in range(sum(len(r) for r in batch[key]))]
            for s, key in enumerate(SHARDS)]


def reference(batch: dict) -> dict:
    out = {}
    rows = pieces(batch)
    for key in batch:
        mine = [s for s, k in enumerate(SHARDS) if k == key]
        ordered = [mine[i] for i in ORDER.get(key, range(len(mine)))]
        ids = [i for row in batch[key] for i in row]
        out[key] = {"lengths": [len(r) for r in batch[key]], "values": [[x for s in ordered for x in rows[s][j]] for j in range(len(ids))],
                    "weights": ids}
    return out


def torchrec_answer(batch: dict) -> dict:
    from torchrec.modules.utils import construct_jagged_tensors
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    lengths = [len(r) for key in SHARDS for r in batch[key]]
    ids = [i for key in SHARDS for r in batch[key] for i in r]
    features = KeyedJaggedTensor(keys=SHARDS, values=torch.tensor(ids, dtype=torch.int64),
                                 lengths=torch.tensor(lengths, dtype=torch.int64), stride=len(batch["a"]))
    embeddings = torch.tensor([row for piece in pieces(batch) for row in piece], dtype=torch.float32).reshape(-1, DIM)
    out = construct_jagged_tensors(embeddings=embeddings, features=features, embedding_names=SHARDS, need_indices=True,
                                   features_to_permute_indices=ORDER)
    return {key: {"lengths": jt.lengths().tolist(), "values": jt.values().tolist(), "weights": jt.weights().tolist()}
            for key, jt in out.items()}


def main() -> int:
    batch = TWO_SAMPLES if control_requested("a batch of two samples, which torchrec gets right") else NO_SAMPLES
    call = f"construct_jagged_tensors(features {SHARDS} with {len(batch['a'])} samples, order {ORDER}, need_indices=True)"
    try:
        want = reference(batch)
        got = torchrec_answer(batch)
    except Exception as exc:
        return verdict_of_raise(exc, call)
    wrong = [f"{key}.{part}: torchrec {got.get(key, {}).get(part)}, the reference {want[key][part]}"
             for key in want for part in want[key] if got.get(key, {}).get(part) != want[key][part]]
    if sorted(got) != sorted(want) or wrong:
        return reproduced(f"{call} differs; first: {wrong[0] if wrong else f'keys {sorted(got)} vs {sorted(want)}'}")
    return ok(f"{call} matches the reference ({len(want)} features compared)")


if __name__ == "__main__":
    run_script(main)
