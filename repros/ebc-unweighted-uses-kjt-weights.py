"""Known torchrec issue ebc-unweighted-uses-kjt-weights (listed for torchrec >=1.8,<1.10).

an EmbeddingBagCollection built unweighted (is_weighted=False) ignores the per-id weights of the
KeyedJaggedTensor it is fed; sharded (any placement) it multiplies the ids by them.

What to do instead: feed an unweighted EmbeddingBagCollection KeyedJaggedTensors without weights
(or build it with is_weighted=True if the weights are meant).

The script spawns 2 ranks (torch.multiprocessing, gloo on CPU, a file:// rendezvous in a temporary
directory, 60 s timeouts). Each builds an unweighted EmbeddingBagCollection of three SUM tables (t0,
t1, t2 reading f0, f1, f2; weights from seeded generators), shards it with DistributedModelParallel
(t0 table-wise on rank 0, t1 row-wise, t2 data-parallel; the dense kernel) and feeds it its own batch
as a KeyedJaggedTensor with per-id weights (0.5, 0.75, 1.0, ...). The oracle is the unsharded
unweighted EmbeddingBagCollection with the same tables fed the same KeyedJaggedTensor: each pooled
embedding the plain sum of its ids' rows. Every feature's pooled output is compared within
|sharded - unsharded| <= 64 units of float32 roundoff x (|unsharded| + max|unsharded|): a bag sums
at most 3 rows, so a few roundings at most separate two correct summation orders.

    python this_script.py            the KeyedJaggedTensor carries per-id weights
    python this_script.py --control  the same ids without weights (the same module, plan and comparison)

    exit 0: the sharded module matches the unsharded one (prints OK)
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

WORLD_SIZE, WIDTH, SEED = 2, 4, 53
TABLES = {"t0": (10, "f0"), "t1": (12, "f1"), "t2": (8, "f2")}  # name: (rows, feature)
BATCHES = [  # per rank, per feature: the ids of each sample
    {"f0": [[1, 4], [], [9]], "f1": [[0, 11, 5], [2], []], "f2": [[3], [7, 1], [6]]},
    {"f0": [[0], [3, 3], []], "f1": [[8], [], [1, 10]], "f2": [[], [2, 4, 5], [0]]},
]
UNITS_OF_ROUNDOFF = 64


def kjt(rank: int, weighted: bool):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    batch = BATCHES[rank]
    ids = [i for rows in batch.values() for row in rows for i in row]
    return KeyedJaggedTensor(keys=list(batch), values=torch.tensor(ids),
                             lengths=torch.tensor([len(row) for rows in batch.values() for row in rows]),
                             weights=torch.tensor([0.5 + 0.25 * (n % 4) for n in range(len(ids))]) if weighted else None)


def build_ebc():
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    configs = [EmbeddingBagConfig(name=name, num_embeddings=rows, embedding_dim=WIDTH, feature_names=[feature],
                                  pooling=PoolingType.SUM) for name, (rows, feature) in TABLES.items()]
    ebc = EmbeddingBagCollection(tables=configs, is_weighted=False, device=torch.device("cpu"))
    with torch.no_grad():
        for key, tensor in ebc.state_dict().items():
            tensor.copy_(initial_weight(key.split(".")[-2]))
    return ebc


def initial_weight(table: str) -> torch.Tensor:
    rows = TABLES[table][0]
    return torch.randn(rows, WIDTH, generator=torch.Generator().manual_seed(SEED + int(table[1:])))


def sharded(rank: int, weighted: bool, result: dict) -> None:
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    result["stage"] = "sharding the EmbeddingBagCollection"
    ebc = build_ebc()
    generators = {"t0": sp.table_wise(rank=0, compute_kernel="dense"), "t1": sp.row_wise(compute_kernel="dense"),
                  "t2": sp.data_parallel()}
    plan = sp.construct_module_sharding_plan(ebc, generators, local_size=WORLD_SIZE, world_size=WORLD_SIZE,
                                             device_type="cpu")
    dmp = DistributedModelParallel(ebc, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                                   plan=ShardingPlan({"": plan}), sharders=sp.get_default_sharders())
    with torch.no_grad():  # DMP initialises the shards itself: give them the unsharded tables' weights
        for key, value in dmp.state_dict().items():
            pieces = ([(s.tensor, s.metadata.shard_offsets) for s in value.local_shards()]
                      if isinstance(value, ShardedTensor) else [(value, [0, 0])])
            for piece, (row, col) in pieces:
                piece.copy_(initial_weight(key.split(".")[-2])[row:row + piece.shape[0], col:col + piece.shape[1]])
    result["stage"] = "the forward of the sharded EmbeddingBagCollection"
    output = dmp(kjt(rank, weighted))
    output = output.wait() if hasattr(output, "wait") else output
    actual = output.to_dict()
    expected = build_ebc()(kjt(rank, weighted)).to_dict()
    for feature, want in expected.items():
        compare(result, f"the pooled output of {feature!r}", actual[feature].detach(), want.detach())


def compare(result: dict, what: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    result["compared"] += 1
    if actual.shape != expected.shape:
        result["problems"].append(f"{what}: shape {tuple(actual.shape)}, the unsharded module's {tuple(expected.shape)}")
        return
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


def run_rank(rank: int, weighted: bool, scratch: str) -> None:
    result = {"rank": rank, "problems": [], "compared": 0, "stage": "starting the process group"}
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{scratch}/rendezvous", rank=rank, world_size=WORLD_SIZE,
                                timeout=datetime.timedelta(seconds=60))
        sharded(rank, weighted, result)
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
    parser.add_argument("--control", action="store_true", help="a KJT without weights, which torchrec gets right")
    weighted = not parser.parse_args().control
    results = []
    with tempfile.TemporaryDirectory(prefix="torchrec-repro-") as scratch:
        try:
            mp.spawn(run_rank, args=(weighted, scratch), nprocs=WORLD_SIZE, join=True)
        except Exception:
            pass  # a rank exited early: its result file says why
        for rank in range(WORLD_SIZE):
            path = os.path.join(scratch, f"rank{rank}.json")
            results.append(json.load(open(path)) if os.path.exists(path) else {"rank": rank, "error": "no result", "stage": "?"})
    label = f"the sharded unweighted EmbeddingBagCollection fed a KJT {'with' if weighted else 'without'} weights"
    raised = [r for r in results if r.get("raised")]
    if raised:
        r = raised[0]
        print(f"REPRODUCED: {label}: torchrec raised {r['raised']} on rank {r['rank']} during {r['stage']}, in {r['where']}")
        return 1
    problems = [f"rank {r['rank']}, {p}" for r in results for p in r["problems"]]
    if problems:
        print(f"REPRODUCED: {label} differs from the unsharded one: {'; '.join(problems[:3])}")
        return 1
    errors = [r for r in results if r.get("error")]
    if errors:
        print(f"CANNOT RUN: rank {errors[0]['rank']} during {errors[0]['stage']}: {errors[0]['error']}\n"
              f"{errors[0].get('traceback', '')}")
        return 2
    print(f"OK: {label} matches the unsharded one ({sum(r['compared'] for r in results)} tensors compared)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
