"""Known torchrec issue sharded-embedding-bag-column-wise (listed for torchrec >=1.8,<1.10).

a plain nn.EmbeddingBag sharded column-wise by EmbeddingBagSharder (a placement its sharder offers
on CPU) fails in its input dist: assert len(input.keys()) == sum(self._splits).

What to do instead: shard a plain nn.EmbeddingBag row-wise, or put its table in an
EmbeddingBagCollection (whose column-wise sharding works).

The script spawns 2 ranks (torch.multiprocessing, gloo on CPU, a file:// rendezvous in a temporary
directory, 60 s timeouts). Each builds a model holding a plain nn.EmbeddingBag (12 rows x 8 columns,
mode SUM, include_last_offset=True, weights from a seeded generator), shards it with
DistributedModelParallel and torchrec's EmbeddingBagSharder (fused SGD, lr 0.1) column-wise over
ranks 0 and 1, and runs one training step on its own batch (ids, offsets ending with the number of
ids, per-id weights). The oracle is the unsharded nn.EmbeddingBag with the same weights: its output
on the rank's batch, and its table after one SGD step on the sum of both ranks' losses divided by
the world size (torchrec's default gradient division). The loss is sum(output * g), g a fixed
pattern. Outputs and this rank's part of the table are compared within
|sharded - unsharded| <= 64 units of float32 roundoff x (|unsharded| + max|unsharded|): a bag sums
at most 3 rows, so a few roundings at most separate two correct summation orders.

    python this_script.py            column-wise over ranks 0 and 1
    python this_script.py --control  row-wise (the same model, batches, step and comparison)

    exit 0: the sharded bag matches the unsharded one (prints OK)
    exit 1: it does not, or torchrec raised (prints REPRODUCED and where)
    exit 2: the script itself could not run (prints CANNOT RUN)
"""

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

WORLD_SIZE, ROWS, WIDTH, LR, SEED = 2, 12, 8, 0.1, 54
BATCHES = [  # per rank: bags of (id, weight)
    [[(3, 0.25), (7, 0.75)], [], [(11, 1.25)]],
    [[(0, 0.75)], [(5, 0.25), (5, 1.25), (9, 0.75)], [(2, 0.25)]],
]
UNITS_OF_ROUNDOFF = 64


def bag_inputs(rank: int) -> tuple:
    """(ids, offsets ending with the number of ids, per-id weights) of the rank's batch."""
    bags = BATCHES[rank]
    offsets = [0]
    for bag in bags:
        offsets.append(offsets[-1] + len(bag))
    return (torch.tensor([i for bag in bags for i, _ in bag]), torch.tensor(offsets),
            torch.tensor([w for bag in bags for _, w in bag]))


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(ROWS, WIDTH, mode="sum", include_last_offset=True)
        with torch.no_grad():
            self.bag.weight.copy_(torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(SEED)))

    def forward(self, ids, offsets, weights):
        return self.bag(ids, offsets, per_sample_weights=weights)


def upstream(shape) -> torch.Tensor:
    """g: the gradient of the loss with respect to the output, a fixed pattern."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(SEED + 1))


def unsharded(rank: int) -> tuple:
    """The oracle: the rank's output, and the table after one SGD step on the ranks' summed losses / world size."""
    model = Model()
    outputs = [model(*bag_inputs(r)) for r in range(WORLD_SIZE)]
    (sum((out * upstream(out.shape)).sum() for out in outputs) / WORLD_SIZE).backward()
    with torch.no_grad():
        table = model.bag.weight - LR * model.bag.weight.grad
    return outputs[rank].detach(), table


def placement(control: bool):
    from torchrec.distributed import sharding_plan as sp

    return sp.row_wise(compute_kernel="fused") if control else sp.column_wise(ranks=[0, 1], compute_kernel="fused")


def sharded(rank: int, control: bool, result: dict) -> None:
    from torchrec.distributed.embeddingbag import EmbeddingBagSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.distributed.utils import EmbOptimType

    result["stage"] = "sharding the bag"
    sharder = EmbeddingBagSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR})
    model = Model()
    plan = construct_module_sharding_plan(model.bag, per_param_sharding={"weight": placement(control)}, sharder=sharder,
                                          local_size=WORLD_SIZE, world_size=WORLD_SIZE, device_type="cpu")
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                                   plan=ShardingPlan({"bag": plan}), sharders=[sharder])
    with torch.no_grad():  # DMP initialises the shards itself: give them the unsharded bag's weights
        for piece, offsets in local_pieces(dmp):
            piece.copy_(Model().bag.weight[tuple(slice(o, o + n) for o, n in zip(offsets, piece.shape))])
    result["stage"] = "the forward and backward of the sharded bag"
    output = dmp(*bag_inputs(rank))
    output = output.wait() if hasattr(output, "wait") else output
    (output * upstream(output.shape)).sum().backward()
    expected_output, expected_table = unsharded(rank)
    compare(result, "the output", output.detach(), expected_output)
    result["stage"] = "reading the sharded table after the step"
    for piece, offsets in local_pieces(dmp):
        window = expected_table[tuple(slice(o, o + n) for o, n in zip(offsets, piece.shape))]
        compare(result, f"the table after the step, shard at {list(offsets)}", piece.detach(), window)


def local_pieces(dmp):
    """(this rank's piece of the table, its offsets in the table): each local shard, or the replica."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    for value in dmp.state_dict().values():
        if isinstance(value, ShardedTensor):
            yield from ((shard.tensor, tuple(shard.metadata.shard_offsets)) for shard in value.local_shards())
        else:
            yield value, (0,) * value.dim()


def compare(result: dict, what: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    result["compared"] += 1
    if actual.shape != expected.shape:
        result["problems"].append(f"{what}: shape {tuple(actual.shape)}, the unsharded bag's {tuple(expected.shape)}")
        return
    bound = UNITS_OF_ROUNDOFF * torch.finfo(torch.float32).eps / 2 * (expected.abs() + expected.abs().max())
    bad = (actual - expected).abs() > bound
    if bool(bad.any()):
        first = tuple(int(i) for i in bad.nonzero()[0])
        result["problems"].append(f"{what}: {int(bad.sum())} of {bad.numel()} elements beyond the bound, first at "
                                  f"{list(first)}: {actual[first].item():.6g}, the unsharded bag {expected[first].item():.6g}")


def torchrec_frame(exc: BaseException) -> str:
    """The innermost torchrec or fbgemm frame of the traceback ("" when the error is not theirs)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if f"{os.sep}torchrec{os.sep}" in f.filename or f"{os.sep}fbgemm_gpu{os.sep}" in f.filename]
    return f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].name}: {frames[-1].line})" if frames else ""


def run_rank(rank: int, control: bool, scratch: str) -> None:
    result = {"rank": rank, "problems": [], "compared": 0, "stage": "starting the process group"}
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{scratch}/rendezvous", rank=rank, world_size=WORLD_SIZE,
                                timeout=datetime.timedelta(seconds=60))
        sharded(rank, control, result)
    except Exception as exc:
        where = torchrec_frame(exc) if result["stage"] != "starting the process group" else ""
        result.update({"raised" if where else "error": f"{type(exc).__name__}: {exc}".replace("\n", " "),
                       "where": where, "traceback": traceback.format_exc()})
    with open(os.path.join(scratch, f"rank{rank}.json"), "w") as file:
        json.dump(result, file)
    if result.get("raised") or result.get("error"):
        sys.exit(1)  # the other rank may wait in a collective: torch.multiprocessing ends it
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--control", action="store_true", help="row-wise, which torchrec gets right")
    control = parser.parse_args().control
    results = []
    with tempfile.TemporaryDirectory(prefix="torchrec-repro-") as scratch:
        try:
            mp.spawn(run_rank, args=(control, scratch), nprocs=WORLD_SIZE, join=True)
        except Exception:
            pass  # a rank exited early: its result file says why
        for rank in range(WORLD_SIZE):
            path = os.path.join(scratch, f"rank{rank}.json")
            results.append(json.load(open(path)) if os.path.exists(path) else {"rank": rank, "error": "no result", "stage": "?"})
    label = "row-wise" if control else "column-wise"
    raised = [r for r in results if r.get("raised")]
    if raised:
        r = raised[0]
        print(f"REPRODUCED: the {label} sharded nn.EmbeddingBag: torchrec raised {r['raised']} on rank {r['rank']} "
              f"during {r['stage']}, in {r['where']}")
        return 1
    problems = [f"rank {r['rank']}, {p}" for r in results for p in r["problems"]]
    if problems:
        print(f"REPRODUCED: the {label} sharded nn.EmbeddingBag differs from the unsharded one: {'; '.join(problems[:3])}")
        return 1
    errors = [r for r in results if r.get("error")]
    if errors:
        print(f"CANNOT RUN: rank {errors[0]['rank']} during {errors[0]['stage']}: {errors[0]['error']}\n"
              f"{errors[0].get('traceback', '')}")
        return 2
    compared = sum(r["compared"] for r in results)
    print(f"OK: the {label} sharded nn.EmbeddingBag matches the unsharded one ({compared} tensors compared)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
