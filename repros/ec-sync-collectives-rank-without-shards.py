"""Known torchrec issue ec-sync-collectives-rank-without-shards (listed for torchrec >=1.8,<1.10).

A sharded EmbeddingCollection under torchrec_use_sync_collectives, where a rank holds no table of a
sharding type: all2all_sequence_sync (torchrec/distributed/comm_ops.py) flattens the embeddings only
when the rank holds a table of that type (local_T > 0), so it hands that rank's empty 2-D embeddings
to the functional all_to_all_single with element-counted splits, which it reads as rows; the output
split fails. Workaround: give every rank a shard of each sharding type the EC uses, or leave the sync
collectives off.

The script spawns 2 ranks (torch.multiprocessing, gloo on CPU, process-group timeout 60 s),
switches torchrec.distributed.comm_ops.set_use_sync_collectives(True), builds an EmbeddingCollection
of t0 (10 x 8, f0), t1 (8 x 8, f1), t2 (8 x 8, f2) (seeded torch.randn), shards it with
DistributedModelParallel (fused kernel): t0 table-wise on rank 1, t1 and t2 column-wise with both shards on rank 0,
so rank 0 holds no table-wise table and rank 1 no column-wise one. Each rank feeds its own batch. The
oracle is the unsharded EmbeddingCollection with the same weights fed the same batch: each feature's
embeddings must equal it within |sharded - oracle| <= 1e-6 * (1 + |oracle|) (a lookup copies rows:
a correct result is exact; the bound only admits float32 roundoff).

    python this_script.py            the plan above: exit 1 (REPRODUCED) when torchrec raises or differs
    python this_script.py --control  the sync collectives with a shard of each type on every rank (t1
                                     table-wise on rank 0, t2 column-wise over ranks 0 and 1): exit 0 (OK)
    exit 2 (CANNOT RUN): the script itself failed.
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

WORLD_SIZE, DIM = 2, 8
TABLES = {"t0": (10, "f0"), "t1": (8, "f1"), "t2": (8, "f2")}  # name: (rows, feature)
BATCHES = [{"f0": [[1, 2], [], [3]], "f1": [[], [1], [2, 3]], "f2": [[0], [5, 5], []]},   # rank 0
           {"f0": [[4], [5, 6], []], "f1": [[1], [], []], "f2": [[], [], [7]]}]       # rank 1


def plan_generators(control: bool) -> dict:
    from torchrec.distributed.sharding_plan import column_wise, table_wise

    # The fused kernel: a sharded EC on the dense kernel fails on CPU anyway (known issue ec-dense-kernel).
    fused = {"compute_kernel": "fused"}
    if control:
        return {"t0": table_wise(rank=1, **fused), "t1": table_wise(rank=0, **fused), "t2": column_wise(ranks=[0, 1], **fused)}
    return {"t0": table_wise(rank=1, **fused), "t1": column_wise(ranks=[0, 0], **fused), "t2": column_wise(ranks=[0, 0], **fused)}


def initial_weight(table: str) -> torch.Tensor:
    return torch.randn(TABLES[table][0], DIM, generator=torch.Generator().manual_seed(int(table[1:]) + 1))


def build():
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingCollection

    module = EmbeddingCollection(tables=[EmbeddingConfig(name=n, num_embeddings=r, embedding_dim=DIM, feature_names=[f])
                                         for n, (r, f) in TABLES.items()])
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(initial_weight(name.split(".")[-2]))
    return module


def kjt(ids: dict):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor(keys=list(ids), values=torch.tensor([i for rows in ids.values() for row in rows for i in row]),
                             lengths=torch.tensor([len(row) for rows in ids.values() for row in rows]))


def sharded_outputs(rank: int, control: bool) -> dict:
    from torchrec.distributed import comm_ops
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, get_default_sharders
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    comm_ops.set_use_sync_collectives(True)
    module = build()
    plan = construct_module_sharding_plan(module, plan_generators(control), local_size=WORLD_SIZE, world_size=WORLD_SIZE,
                                          device_type="cpu")
    dmp = DistributedModelParallel(module, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                                   plan=ShardingPlan({"": plan}), sharders=get_default_sharders())
    with torch.no_grad():
        for key, value in dmp.state_dict().items():
            for shard in value.local_shards():
                rows, cols = shard.metadata.shard_offsets
                sizes = shard.metadata.shard_sizes
                shard.tensor.copy_(initial_weight(key.split(".")[-2])[rows:rows + sizes[0], cols:cols + sizes[1]])
    output = dmp(kjt(BATCHES[rank]))
    output = output.wait() if hasattr(output, "wait") else output
    return {key: jt.values().detach() for key, jt in output.items()}


def run_rank(rank: int, control: bool, scratch: str) -> None:
    result, stage = {"rank": rank, "problems": []}, "setting up"
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{scratch}/rendezvous", rank=rank, world_size=WORLD_SIZE,
                                timeout=datetime.timedelta(seconds=60))
        expected = {k: jt.values().detach() for k, jt in build()(kjt(BATCHES[rank])).items()}
        stage = "sharding the EC and feeding it this rank's batch"
        actual = sharded_outputs(rank, control)
        for key, want in expected.items():
            got = actual.get(key)
            if got is None or got.shape != want.shape:
                result["problems"].append(f"rank {rank}, output {key!r}: {None if got is None else tuple(got.shape)} "
                                          f"vs oracle {tuple(want.shape)}")
            elif bool(((got - want).abs() > 1e-6 * (1 + want.abs())).any()):
                at = tuple(int(i) for i in ((got - want).abs() > 1e-6 * (1 + want.abs())).nonzero()[0])
                result["problems"].append(f"rank {rank}, output {key!r} at {list(at)}: {got[at].item():.6g} "
                                          f"vs oracle {want[at].item():.6g}")
        result["compared"] = len(expected)
    except Exception as exc:
        # Raised in torchrec, fbgemm or the collectives torchrec waits on (torch.distributed): a reproduction.
        places = [os.sep + p + os.sep for p in ("torchrec", "fbgemm_gpu", os.path.join("torch", "distributed"))]
        in_torchrec = stage != "setting up" and any(
            place in f.filename for f in traceback.extract_tb(exc.__traceback__)[1:] for place in places)
        result["raised" if in_torchrec else "error"] = f"{type(exc).__name__}: {exc} (while {stage})\n{traceback.format_exc(limit=-5)}"
    with open(os.path.join(scratch, f"rank{rank}.json"), "w") as file:
        json.dump(result, file)
    if "compared" not in result:
        sys.exit(1)  # another rank may wait in a collective: torch.multiprocessing ends it
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--control", action="store_true", help="a shard of each sharding type on every rank")
    control = parser.parse_args().control
    with tempfile.TemporaryDirectory(prefix="torchrec-repro-") as scratch:
        try:
            mp.spawn(run_rank, args=(control, scratch), nprocs=WORLD_SIZE, join=True)
        except Exception:
            pass  # a rank that failed wrote why into its result file
        results = []
        for rank in range(WORLD_SIZE):
            try:
                with open(os.path.join(scratch, f"rank{rank}.json")) as file:
                    results.append(json.load(file))
            except OSError:
                results.append({"rank": rank, "error": "it wrote no result"})
    raised = [r for r in results if r.get("raised")]
    if raised:
        print(f"REPRODUCED: torchrec raised on rank {raised[0]['rank']} under sync collectives: {raised[0]['raised']}")
        return 1
    problems = [p for r in results for p in r["problems"]]
    if problems:
        print("REPRODUCED: the sharded EC under sync collectives differs from the unsharded one: " + "; ".join(problems[:4]))
        return 1
    errors = [r for r in results if r.get("error")]
    if errors:
        print(f"CANNOT RUN: rank {errors[0]['rank']}: {errors[0]['error']}")
        return 2
    print(f"OK: the sharded EC under sync collectives matches the unsharded one on every rank "
          f"({sum(r['compared'] for r in results)} outputs compared)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
