"""Known torchrec issue one-row-shard-row-states-as-single-values (listed for torchrec >=1.8,<1.10).

A row-wise shard of one row trained by an optimizer with per-row states besides momentum1
(counter-based row-wise Adagrad's prev_iter and row_counter, row-wise RMSprop's prev_iter):
ShardedEmbeddingBagCollection's fused optimizer state_dict (batched_embedding_kernel
get_sharded_optim_state: nelement() == 1 and state_key != 'momentum1') takes the one-element state
for a single-value state and gives it the metadata of one value per rank (size world_size, offset
rank), so a checkpoint of it overlaps another shard's rows. Found by the gate's seed 2 on 2 hosts x 2
ranks (10 rows over 4 ranks: 3, 3, 3, 1). Workaround (what paritykit's draws do): give a row-sharded
table at least two rows in every shard (rows >= 2 x the ranks it is cut over).

The script spawns 2 ranks (torch.multiprocessing, gloo on CPU), builds an EmbeddingBagCollection with
table t0 (3 x 4) sharded row-wise and t1 (8 x 4) table-wise on rank 0, marks both with fused
counter-based row-wise Adagrad (apply_optimizer_in_backward(torchrec.optim.RowWiseAdagrad,
weight_decay_mode=COUNTER, counter halflife 1, counter weight decay L2)), wraps it in
DistributedModelParallel and reads the fused optimizer's state_dict. The oracle is the metadata a
correct sharded state_dict must carry for a per-row state of t0, computed by hand from the plan:
row-wise cuts the 3 rows into blocks of ceil(3 / 2) = 2, so every per-row state (momentum1,
prev_iter, row_counter) is a ShardedTensor of global size [3] with shards [0, 2) on rank 0 and [2, 3)
on rank 1, the same as the table's rows. Metadata is compared exactly (integers).

    python this_script.py            t0 of 3 rows (shards of 2 and 1 rows): exit 1 (REPRODUCED) when a
                                     state's metadata differs from the plan's
    python this_script.py --control  t0 of 4 rows (shards of 2 and 2 rows), the same comparison: exit 0 (OK)
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

WORLD_SIZE, DIM = 2, 4
ROW_STATES = ("momentum1", "prev_iter", "row_counter")  # fbgemm's per-row states of counter-based row-wise Adagrad


def fbgemm_config(argument: str):
    """fbgemm's class for one argument of its TBE, read from the annotation of the TBE class torchrec
    imports (fbgemm_gpu comes with torchrec; the script imports torch and torchrec only)."""
    from torchrec.distributed.batched_embedding_kernel import SplitTableBatchedEmbeddingBagsCodegen

    annotation = SplitTableBatchedEmbeddingBagsCodegen.__init__.__annotations__[argument]
    return next(a for a in getattr(annotation, "__args__", (annotation,)) if a is not type(None))


def expected_metadata(rows: int) -> dict:
    """Row-wise sharding by hand: blocks of ceil(rows / world size) rows, rank by rank."""
    block = -(-rows // WORLD_SIZE)
    shards = [[[r * block], [min(block, rows - r * block)]] for r in range(WORLD_SIZE)]
    return {"global_size": [rows], "shards": shards}


def run_rank(rank: int, rows: int, scratch: str) -> None:
    result = {"rank": rank}
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{scratch}/rendezvous", rank=rank, world_size=WORLD_SIZE,
                                timeout=datetime.timedelta(seconds=60))
        result["states"] = optimizer_state_metadata(rows)
    except Exception as exc:
        in_torchrec = any(f"{os.sep}torchrec{os.sep}" in f.filename or f"{os.sep}fbgemm_gpu{os.sep}" in f.filename
                          for f in traceback.extract_tb(exc.__traceback__))
        result["raised" if in_torchrec else "error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-6)}"
    with open(os.path.join(scratch, f"rank{rank}.json"), "w") as file:
        json.dump(result, file)
    if "states" in result:
        dist.destroy_process_group()


def optimizer_state_metadata(rows: int) -> dict:
    """{state: (global size, [[offset, size] of every shard], [offset, size] of this rank's shard)} for t0."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, get_default_sharders, row_wise, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    module = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t0", num_embeddings=rows, embedding_dim=DIM, feature_names=["f0"]),
                                            EmbeddingBagConfig(name="t1", num_embeddings=8, embedding_dim=DIM, feature_names=["f1"])])
    counter = fbgemm_config("counter_based_regularization")
    counter_mode = type(counter.__dataclass_fields__["counter_weight_decay_mode"].default)
    apply_optimizer_in_backward(RowWiseAdagrad, list(module.parameters()), {
        "lr": 0.1, "eps": 1e-3, "weight_decay": 0.1, "weight_decay_mode": fbgemm_config("weight_decay_mode").COUNTER,
        "counter_based_regularization": counter(counter_weight_decay_mode=counter_mode.L2, counter_halflife=1)})
    plan = construct_module_sharding_plan(module, {"t0": row_wise(compute_kernel="fused"), "t1": table_wise(rank=0, compute_kernel="fused")},
                                          local_size=WORLD_SIZE, world_size=WORLD_SIZE, device_type="cpu")
    sharded = DistributedModelParallel(module, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                                       plan=ShardingPlan({"": plan}), sharders=get_default_sharders())
    states = next(v for k, v in sharded.fused_optimizer.state_dict()["state"].items() if k.endswith("t0.weight"))
    found = {}
    for key, value in states.items():
        name = key.split(".")[-1]
        if name in ROW_STATES:
            metadata = value.metadata()
            found[name] = (list(metadata.size),
                           sorted([list(s.shard_offsets), list(s.shard_sizes)] for s in metadata.shards_metadata),
                           [[list(s.metadata.shard_offsets), list(s.metadata.shard_sizes)] for s in value.local_shards()])
    return found


def verdict(results: list, rows: int) -> int:
    for result in results:
        if result.get("raised"):
            print(f"REPRODUCED: torchrec raised on rank {result['rank']}: {result['raised']}")
            return 1
        if "states" not in result:
            print(f"CANNOT RUN: rank {result['rank']}: {result.get('error', 'it wrote no result')}")
            return 2
        missing = [s for s in ROW_STATES if s not in result["states"]]
        if missing:
            print(f"CANNOT RUN: rank {result['rank']}: t0's fused optimizer state has no {missing} (nothing to compare)")
            return 2
    expected = expected_metadata(rows)
    problems = []
    for result in results:
        rank = result["rank"]
        want = [expected["global_size"], expected["shards"], [expected["shards"][rank]]]
        for name in ROW_STATES:
            got = result["states"][name]
            if got != want:
                problems.append(f"rank {rank}, state t0.{name}: global size {got[0]}, shards [[offset], [size]] {got[1]}, "
                                f"this rank's {got[2]}; the plan gives {want[0]}, {want[1]}, {want[2]}")
    if problems:
        print(f"REPRODUCED: t0 ({rows} rows row-wise over {WORLD_SIZE} ranks) has per-row optimizer states whose sharded "
              f"metadata is not the plan's ({len(problems)} difference(s)): " + "; ".join(problems[:3]))
        return 1
    print(f"OK: every per-row optimizer state of t0 ({rows} rows row-wise over {WORLD_SIZE} ranks) carries the plan's "
          f"metadata ({len(ROW_STATES)} states x {WORLD_SIZE} ranks compared)")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--control", action="store_true", help="t0 of 4 rows: two rows in every shard")
    rows = 4 if parser.parse_args().control else 3
    with tempfile.TemporaryDirectory(prefix="torchrec-repro-") as scratch:
        try:
            mp.spawn(run_rank, args=(rows, scratch), nprocs=WORLD_SIZE, join=True)
        except Exception:
            pass  # a rank that failed wrote why into its result file
        results = []
        for rank in range(WORLD_SIZE):
            try:
                with open(os.path.join(scratch, f"rank{rank}.json")) as file:
                    results.append(json.load(file))
            except OSError:
                results.append({"rank": rank})
    return verdict(results, rows)


if __name__ == "__main__":
    sys.exit(main())
