"""Known torchrec issue fp-ebc-root-position-weights-not-averaged (listed for torchrec >=1.8,<1.10).

a FeatureProcessedEmbeddingBagCollection that is itself the model DistributedModelParallel wraps does not
average its position weights' gradients over the ranks: DDP wraps the sharded FP-EBC, whose forward returns
torchrec's awaitable rather than tensors, so DDP (static_graph=True, DMP's default) never runs its delayed
all-reduce of the first iteration, and each rank steps its replica of the position weights with its own
gradient: the replicas drift apart.

What to do instead: hold the FP-EBC in a module that returns tensors (its pooled embeddings by key, as a
model's dense part does), or give DMP a DefaultDataParallelWrapper(static_graph=False).

The script spawns 2 ranks (torch.multiprocessing, gloo on CPU, a file:// rendezvous in a temporary
directory, 60 s timeouts). Each builds the same FP-EBC (a weighted EBC of two SUM tables t0, t1 reading
f0, f1, position weights held by a PositionWeightedModuleCollection of length 3, every weight from seeded
generators), shards it with DistributedModelParallel (t0 table-wise on rank 0, t1 table-wise on rank 1),
loads the same weights, and trains two steps on its own batch: the loss the sum of the pooled embeddings
times fixed coefficients, the tables stepped by fused SGD, the position weights by torch's SGD (lr 0.1).
The oracle is the unsharded FP-EBC trained in one process on both ranks' batches with the mean of the two
ranks' gradients (what data parallelism promises), stepped by torch's SGD. The position weights of every
rank are compared within |sharded - unsharded| <= 64 units of float32 roundoff x (|unsharded| +
max|unsharded|): two correct summation orders differ by a few roundings.

    python this_script.py            the FP-EBC is the model DMP wraps
    python this_script.py --control  the same FP-EBC held in a module returning its pooled embeddings by key

    exit 0: every rank's position weights are the unsharded ones (prints OK)
    exit 1: they are not, or torchrec raised (prints REPRODUCED and where)
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

WORLD_SIZE, WIDTH, LENGTH, SEED, LR, STEPS = 2, 4, 3, 7, 0.1, 2
TABLES = {"t0": (6, "f0"), "t1": (5, "f1")}  # name: (rows, feature)
BATCHES = [  # per rank, per step, per feature: the ids of each sample
    [{"f0": [[1, 4, 2], [], [5]], "f1": [[0], [2, 3], []]}, {"f0": [[3], [0, 1], []], "f1": [[4, 4, 1], [], [2]]}],
    [{"f0": [[0], [2, 2], [1, 3]], "f1": [[], [1, 0, 2], [3]]}, {"f0": [[], [5, 4, 3], [2]], "f1": [[1], [0], [4, 3]]}],
]
UNITS_OF_ROUNDOFF = 64


def kjt(rank: int, step: int):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    batch = BATCHES[rank][step]
    ids = [i for rows in batch.values() for row in rows for i in row]
    return KeyedJaggedTensor(keys=list(batch), values=torch.tensor(ids),
                             lengths=torch.tensor([len(row) for rows in batch.values() for row in rows]))


def seeded(*shape: int, offset: int) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(SEED + offset)) + 0.5


class Pooled(torch.nn.Module):
    """The --control model: the FP-EBC's pooled embeddings by key."""

    def __init__(self, fp_ebc: torch.nn.Module) -> None:
        super().__init__()
        self.fp = fp_ebc

    def forward(self, features):
        return self.fp(features).to_dict()


def build(held: bool) -> torch.nn.Module:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

    configs = [EmbeddingBagConfig(name=name, num_embeddings=rows, embedding_dim=WIDTH, feature_names=[feature])
               for name, (rows, feature) in TABLES.items()]
    ebc = EmbeddingBagCollection(tables=configs, is_weighted=True, device=torch.device("cpu"))
    processors = PositionWeightedModuleCollection({feature: LENGTH for _rows, feature in TABLES.values()})
    model = FeatureProcessedEmbeddingBagCollection(ebc, processors)
    return Pooled(model) if held else model


def initial_state(model: torch.nn.Module) -> dict:
    state = {}
    for n, key in enumerate(sorted(model.state_dict())):
        state[key] = seeded(*model.state_dict()[key].shape, offset=n)
    return state


def loss_of(output) -> torch.Tensor:
    pooled = output.to_dict() if hasattr(output, "to_dict") else output
    return sum((k + 1) * pooled[f].sum() for k, f in enumerate(sorted(pooled)))


def unsharded(held: bool) -> dict:
    """The oracle: both ranks' batches, the mean of their gradients, torch's SGD on everything."""
    model = build(held)
    model.load_state_dict(initial_state(model))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        optimizer.zero_grad()
        (sum(loss_of(model(kjt(rank, step))) for rank in range(WORLD_SIZE)) / WORLD_SIZE).backward()
        optimizer.step()
    return {key: value.detach().clone() for key, value in model.state_dict().items() if "position" in key}


def sharded(rank: int, held: bool, result: dict) -> None:
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    result["stage"] = "sharding the FP-EBC"
    model = build(held)
    model.load_state_dict(initial_state(model))
    fp = model.fp if held else model
    tables = [p for n, p in fp.named_parameters() if "embedding_bags" in n]
    apply_optimizer_in_backward(torch.optim.SGD, tables, {"lr": LR})
    generators = {"t0": sp.table_wise(rank=0), "t1": sp.table_wise(rank=1)}
    plan = sp.construct_module_sharding_plan(fp, generators, local_size=WORLD_SIZE, world_size=WORLD_SIZE, device_type="cpu")
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                                   plan=ShardingPlan({"fp" if held else "": plan}), sharders=sp.get_default_sharders())
    state = initial_state(build(held))
    with torch.no_grad():  # DMP initialises the shards itself: give them the unsharded weights
        for key, value in dmp.state_dict().items():
            pieces = ([(s.tensor, s.metadata.shard_offsets) for s in value.local_shards()]
                      if isinstance(value, ShardedTensor) else [(value, [0] * value.dim())])
            for piece, offsets in pieces:
                piece.copy_(state[key][tuple(slice(o, o + n) for o, n in zip(offsets, piece.shape))])
    dense = [p for n, p in dmp.named_parameters() if "position" in n]
    optimizer = torch.optim.SGD(dense, lr=LR)
    result["stage"] = "training the sharded FP-EBC"
    for step in range(STEPS):
        optimizer.zero_grad()
        output = dmp(kjt(rank, step))
        output = output.wait() if hasattr(output, "wait") else output
        loss_of(output).backward()
        optimizer.step()
    expected = unsharded(held)
    for key, value in dmp.state_dict().items():
        if "position" in key:
            compare(result, f"position weights {key!r} after {STEPS} steps", value.detach(), expected[key])


def compare(result: dict, what: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    result["compared"] += 1
    bound = UNITS_OF_ROUNDOFF * torch.finfo(torch.float32).eps / 2 * (expected.abs() + expected.abs().max())
    bad = (actual - expected).abs() > bound
    if bool(bad.any()):
        first = tuple(int(i) for i in bad.nonzero()[0])
        result["problems"].append(f"{what}: {int(bad.sum())} of {bad.numel()} elements beyond the bound, first at "
                                  f"{list(first)}: {actual[first].item():.6g}, unsharded {expected[first].item():.6g}")


def torchrec_frame(exc: BaseException) -> str:
    """The innermost torchrec or fbgemm frame of the traceback ("" when the error is not theirs)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if f"{os.sep}torchrec{os.sep}" in f.filename or f"{os.sep}fbgemm_gpu{os.sep}" in f.filename]
    return f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].name}: {frames[-1].line})" if frames else ""


def run_rank(rank: int, held: bool, scratch: str) -> None:
    result = {"rank": rank, "problems": [], "compared": 0, "stage": "starting the process group"}
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{scratch}/rendezvous", rank=rank, world_size=WORLD_SIZE,
                                timeout=datetime.timedelta(seconds=60))
        sharded(rank, held, result)
    except Exception as exc:
        where = torchrec_frame(exc) if result["stage"] != "starting the process group" else ""
        result.update({"raised" if where else "error": f"{type(exc).__name__}: {exc}".replace("\n", " "),
                       "where": where, "traceback": traceback.format_exc()})
    with open(os.path.join(scratch, f"rank{rank}.json"), "w") as file:
        json.dump(result, file)
    if result.get("raised") or result.get("error"):
        sys.exit(1)  # the other rank may wait in a collective: torch.multiprocessing ends it
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--control", action="store_true", help="the FP-EBC held in a module, which torchrec gets right")
    held = parser.parse_args().control
    results = []
    with tempfile.TemporaryDirectory(prefix="torchrec-repro-") as scratch:
        try:
            mp.spawn(run_rank, args=(held, scratch), nprocs=WORLD_SIZE, join=True)
        except Exception:
            pass  # a rank exited early: its result file says why
        for rank in range(WORLD_SIZE):
            path = os.path.join(scratch, f"rank{rank}.json")
            results.append(json.load(open(path)) if os.path.exists(path) else {"rank": rank, "error": "no result", "stage": "?"})
    label = f"the FP-EBC {'held in a module' if held else 'as the model'} sharded by DMP"
    raised = [r for r in results if r.get("raised")]
    if raised:
        r = raised[0]
        print(f"REPRODUCED: {label}: torchrec raised {r['raised']} on rank {r['rank']} during {r['stage']}, in {r['where']}")
        return 1
    problems = [f"rank {r['rank']}, {p}" for r in results for p in r["problems"]]
    if problems:
        print(f"REPRODUCED: {label} trains other position weights than the unsharded one: {'; '.join(problems[:3])}")
        return 1
    errors = [r for r in results if r.get("error")]
    if errors or not all(r["compared"] for r in results):
        bad = errors[0] if errors else next(r for r in results if not r["compared"])
        print(f"CANNOT RUN: rank {bad['rank']} during {bad['stage']}: {bad.get('error', 'nothing compared')}\n"
              f"{bad.get('traceback', '')}")
        return 2
    print(f"OK: {label} trains the unsharded position weights ({sum(r['compared'] for r in results)} tensors compared)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
