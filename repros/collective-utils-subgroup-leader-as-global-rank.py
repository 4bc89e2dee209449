"""Known torchrec issue collective-utils-subgroup-leader-as-global-rank (listed for torchrec 1.8.*, fixed in torchrec 1.9.2).

torchrec.distributed.collective_utils.invoke_on_rank_and_broadcast_result (and run_on_leader and
create_on_rank_and_share_result, built the same way) picks the leader by its rank in the group
(pg.rank() == rank) but hands that number to torch.distributed.broadcast_object_list as the global
source rank. On a group whose ranks are not the world's first ones, members raise ValueError (that
global rank is not in their group) or silently receive another member's object instead of the leader's
result. torchrec 1.9.2 passes group_src. Workaround: call them with the world group, or broadcast on
the subgroup with broadcast_object_list(..., group_src=leader, group=pg).

The script starts 4 ranks (torch.multiprocessing "spawn", gloo on CPU, process-group timeout 30 s),
splits them into the groups {0, 2} and {1, 3} (torch.distributed.new_subgroups_by_enumeration) and calls
invoke_on_rank_and_broadcast_result(group, 1, made_on) on every rank, where made_on() returns the global
rank it ran on. The oracle: the leader is the group's rank 1 (global 2 in {0, 2}, global 3 in {1, 3}),
so every member of a group must receive that member's global rank, and made_on must run there only.
The parent waits at most 120 s and ends any rank still running.

    python this_script.py            the strided groups: exit 1 (REPRODUCED)
    python this_script.py --control  the same call on the world group (the leader, rank 1, is a global rank
                                     too): every rank receives 1: exit 0 (OK)
    exit 2 (CANNOT RUN): the script itself failed.
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


WORLD_SIZE, LEADER = 4, 1  # the leader: a rank of the group
GROUPS = [[0, 2], [1, 3]]
DEADLINE_S, COLLECTIVE_TIMEOUT_S = 120, 30  # the parent ends every rank after 120 s; a collective gives up after 30 s


def compare(rank: int, control: bool, result: dict) -> None:
    from torchrec.distributed.collective_utils import invoke_on_rank_and_broadcast_result

    group = dist.new_subgroups_by_enumeration(GROUPS)[0]  # every rank makes every group
    members = list(range(WORLD_SIZE)) if control else next(g for g in GROUPS if rank in g)
    leader = members[LEADER]  # the leader as a global rank
    ran_on = []

    def made_on() -> int:
        ran_on.append(rank)
        return rank

    result["stage"] = "invoke_on_rank_and_broadcast_result"
    try:
        received = invoke_on_rank_and_broadcast_result(dist.group.WORLD if control else group, LEADER, made_on)
    except Exception as exc:
        if library_frame(exc):
            result["problems"].append(f"rank {rank} (group {members}): it raised {type(exc).__name__}: "
                                      f"{str(exc).split(' <')[0]} (in {library_frame(exc)})")
            return
        raise
    result["compared"] += 1
    if received != leader:
        result["problems"].append(f"rank {rank} (group {members}): it received {received!r}, expected the leader's {leader}")
    if ran_on != ([rank] if rank == leader else []):
        result["problems"].append(f"rank {rank} (group {members}): made_on ran here {len(ran_on)} time(s), the leader is rank {leader}")


def run_rank(rank: int, scratch: str, control: bool) -> None:
    result = {"rank": rank, "problems": [], "compared": 0, "stage": "setting up"}
    try:
        start_process_group(rank, WORLD_SIZE, scratch, timeout_s=COLLECTIVE_TIMEOUT_S)
        compare(rank, control, result)
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {str(exc).strip()[:400]} ({traceback.extract_tb(exc.__traceback__)[-1].filename})"
    # Every rank reaches the final barrier: a raise here happens before any collective of the group.
    finish_rank(scratch, result, failed=bool(result.get("error")))


def main() -> int:
    control = control_requested("the same call on the world group instead")
    results = run_ranks(run_rank, (control,), WORLD_SIZE, deadline_s=DEADLINE_S)
    errors = [r for r in results if r.get("error")]
    if errors:
        return cannot_run(f"rank {errors[0]['rank']} while {errors[0].get('stage', 'unknown')}: {errors[0]['error']}")
    problems = [p for r in results for p in r.get("problems", [])]
    if problems:
        return reproduced("; ".join(problems[:3]))
    return ok(f"every rank received its group leader's result ({sum(r['compared'] for r in results)} ranks compared)")


if __name__ == "__main__":
    run_script(main)
