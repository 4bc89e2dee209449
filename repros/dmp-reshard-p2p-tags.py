"""Known torchrec issue dmp-reshard-p2p-tags (listed for torchrec >=1.8,<1.10).

DistributedModelParallel.reshard tags each point-to-point transfer with Python's hash() of a tuple
holding the table's name (torchrec/distributed/sharding/dynamic_sharding.py, _generate_tag); it
differs between processes (unless they share PYTHONHASHSEED), so on gloo, which matches sends to
receives by tag, the reshard waits forever. Workaround: start every rank with the same
PYTHONHASHSEED (e.g. export PYTHONHASHSEED=0 before the launcher).

The script starts 2 ranks (torch.multiprocessing "spawn", gloo on CPU, process-group timeout 15 s),
each with its own PYTHONHASHSEED (1 and 2: two processes as a launcher gives them, made
deterministic), builds a model with an EmbeddingBagCollection of t0 (8 x 4, f0) and t1 (8 x 4, f1) (seeded
torch.randn, SUM pooling, fused SGD) under a dense layer, shards it with DistributedModelParallel (t0 table-wise on rank
0, t1 table-wise on rank 1), then moves t0 to rank 1 with dmp.reshard (the delta computed by
torchrec's output_sharding_plans_delta) and feeds each rank a batch. The oracle is the unsharded
module with the same weights: after the reshard, rank 1 must hold both tables (rank 0 none), with
exactly their initial weights, and each rank's pooled outputs must equal the unsharded module's within
|sharded - oracle| <= 1e-5 * (1 + |oracle|) (sums of at most 3 float32 rows of order 1). Each rank
also reports the tag torchrec computes for t0's transfer (rank 0 -> rank 1); the ranks must agree.
The parent waits at most 120 s and ends any rank still running, so the script cannot hang.

    python this_script.py            different PYTHONHASHSEEDs: exit 1 (REPRODUCED) when the reshard fails
                                     (gloo times out waiting for the transfer) or the outputs differ
    python this_script.py --control  the same PYTHONHASHSEED on both ranks: exit 0 (OK)
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

WORLD_SIZE, DIM, DEADLINE_S = 2, 4, 120
TABLES = {"t0": (8, "f0"), "t1": (8, "f1")}  # name: (rows, feature)
BATCHES = [{"f0": [[1, 2], [], [3]], "f1": [[5], [0, 7], []]}, {"f0": [[4], [5, 6], [7]], "f1": [[1], [], [2, 2]]}]


def initial_weight(table: str) -> torch.Tensor:
    return torch.randn(TABLES[table][0], DIM, generator=torch.Generator().manual_seed(int(table[1:]) + 1))


class Model(torch.nn.Module):
    """The EBC under a dense layer, as in a model: DistributedModelParallel wraps the model in DDP, and
    reshard reaches it through DDP's .module."""

    def __init__(self) -> None:
        super().__init__()
        self.ebc, self.dense = build(), torch.nn.Linear(DIM, 1)

    def forward(self, features) -> dict:
        return self.ebc(features).to_dict()


def build():
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    module = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=DIM, feature_names=[f])
                                            for n, (r, f) in TABLES.items()])
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(initial_weight(name.split(".")[-2]))
    apply_optimizer_in_backward(torch.optim.SGD, list(module.parameters()), {"lr": 0.1})
    return module


def kjt(ids: dict):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor(keys=list(ids), values=torch.tensor([i for rows in ids.values() for row in rows for i in row]),
                             lengths=torch.tensor([len(row) for rows in ids.values() for row in rows]))


def module_plan(module, t0_rank: int):
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise

    return construct_module_sharding_plan(module, {"t0": table_wise(rank=t0_rank, compute_kernel="fused"),
                                                   "t1": table_wise(rank=1, compute_kernel="fused")},
                                          local_size=WORLD_SIZE, world_size=WORLD_SIZE, device_type="cpu")


def reshard_and_compare(rank: int, result: dict) -> None:
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding import dynamic_sharding
    from torchrec.distributed.sharding_plan import get_default_sharders
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    model = Model()
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                                   plan=ShardingPlan({"ebc": module_plan(model.ebc, 0)}), sharders=get_default_sharders())
    with torch.no_grad():
        for key, value in tables(dmp):
            for shard in value.local_shards():
                shard.tensor.copy_(initial_weight(key.split(".")[-2]))
    # The tag of t0's weight transfer, rank 0 -> rank 1 (source, shard, local shard, destination, name, optimizer state).
    result["tag"] = dynamic_sharding._generate_tag(0, 0, 0, 1, "t0", False)
    deltas = dynamic_sharding.output_sharding_plans_delta(dmp.plan.plan, {"ebc": module_plan(build(), 1)}, True)
    result["stage"] = "moving t0 from rank 0 to rank 1 with DistributedModelParallel.reshard"
    dmp.reshard(deltas)
    result["stage"] = "reading the tables and feeding the resharded model"
    held = sorted(key.split(".")[-2] for key, value in tables(dmp) if value.local_shards())
    result["compared"] += 1
    if held != (["t0", "t1"] if rank == 1 else []):  # the new plan: both tables on rank 1
        result["problems"].append(f"rank {rank} holds {held} after the reshard, not what the new plan places there")
    for key, value in tables(dmp):
        for shard in value.local_shards():
            result["compared"] += 1
            if not torch.equal(shard.tensor, initial_weight(key.split(".")[-2])):
                result["problems"].append(f"rank {rank}: table {key.split('.')[-2]} after the reshard is not its weights")
    actual = dmp(kjt(BATCHES[rank]))
    for key, want in build()(kjt(BATCHES[rank])).to_dict().items():
        result["compared"] += 1
        bad = (actual[key].detach() - want.detach()).abs() > 1e-5 * (1 + want.detach().abs())
        if bool(bad.any()):
            result["problems"].append(f"rank {rank}: output {key!r} differs from the unsharded module's at "
                                      f"{[int(i) for i in bad.nonzero()[0]]}")


def tables(dmp) -> list:
    return [(key, value) for key, value in dmp.state_dict().items() if ".embedding_bags." in key]


def run_rank(rank: int, scratch: str) -> None:
    result = {"rank": rank, "problems": [], "compared": 0, "stage": "setting up"}
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{scratch}/rendezvous", rank=rank, world_size=WORLD_SIZE,
                                timeout=datetime.timedelta(seconds=15))
        result["stage"] = "sharding the module"
        reshard_and_compare(rank, result)
        result["done"] = True
    except Exception as exc:
        places = [os.sep + p + os.sep for p in ("torchrec", "fbgemm_gpu", os.path.join("torch", "distributed"))]
        in_torchrec = result["stage"] != "setting up" and any(
            place in f.filename for f in traceback.extract_tb(exc.__traceback__)[1:] for place in places)
        result["raised" if in_torchrec else "error"] = f"{type(exc).__name__}: {str(exc).strip()[:400]}"
    with open(os.path.join(scratch, f"rank{rank}.json"), "w") as file:
        json.dump(result, file)
    if result.get("done"):
        dist.destroy_process_group()
    os._exit(0)  # do not wait for a transfer gloo will never complete


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--control", action="store_true", help="the same PYTHONHASHSEED on both ranks")
    control = parser.parse_args().control
    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="torchrec-repro-") as scratch:
        processes, saved = [], os.environ.get("PYTHONHASHSEED")
        try:
            for rank in range(WORLD_SIZE):
                os.environ["PYTHONHASHSEED"] = "1" if control else str(rank + 1)  # read by the new interpreter
                processes.append(context.Process(target=run_rank, args=(rank, scratch)))
                processes[-1].start()
        finally:
            if saved is None:
                del os.environ["PYTHONHASHSEED"]
            else:
                os.environ["PYTHONHASHSEED"] = saved
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=DEADLINE_S)
        for process in processes:
            process.join(max(0.0, (deadline - datetime.datetime.now()).total_seconds()))
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
        results = []
        for rank in range(WORLD_SIZE):
            try:
                with open(os.path.join(scratch, f"rank{rank}.json")) as file:
                    results.append(json.load(file))
            except OSError:
                results.append({"rank": rank, "problems": [], "stage": "unknown", "error": f"still running after {DEADLINE_S} s"})
    return verdict(results)


def verdict(results: list) -> int:
    tags = ", ".join(f"rank {r['rank']}: {r['tag']}" for r in results if "tag" in r)
    raised = [r for r in results if r.get("raised")]
    if raised:
        print(f"REPRODUCED: rank {raised[0]['rank']} raised while {raised[0]['stage']}: {raised[0]['raised']} "
              f"(torchrec's P2P tag for the transfer of t0, rank 0 -> rank 1: {tags})")
        return 1
    problems = [p for r in results for p in r["problems"]]
    if problems:
        print("REPRODUCED: after DistributedModelParallel.reshard, " + "; ".join(problems[:4]) + f" (P2P tags: {tags})")
        return 1
    errors = [r for r in results if not r.get("done")]
    if errors:
        print(f"CANNOT RUN: rank {errors[0]['rank']} while {errors[0]['stage']}: {errors[0].get('error')}")
        return 2
    print(f"OK: after DistributedModelParallel.reshard the tables and outputs match the unsharded module "
          f"({sum(r['compared'] for r in results)} tensors compared; P2P tags {tags})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
