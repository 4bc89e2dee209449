"""Known torchrec issue dmp-load-state-dict-not-strict (listed for torchrec >=1.8,<1.10).

DistributedModelParallel.load_state_dict with its default strict=True does not raise on a missing
key outside the sharded modules (a dense parameter) nor on an unexpected key, where the unsharded
module raises: it returns them (the missing key under a name without its module prefix), so a
checkpoint that lost its dense layers loads silently. Workaround: check the returned missing_keys
and unexpected_keys yourself.

The script starts 2 ranks (torch.multiprocessing "spawn", gloo on CPU, process-group timeout 30 s),
builds a model with an EmbeddingBagCollection of t0 (8 x 4, f0) and t1 (8 x 4, f1) (seeded
torch.randn, SUM pooling, fused SGD) under a dense layer (torch.nn.Linear(4, 1)), shards it with
DistributedModelParallel (t0 table-wise on rank 0, t1 table-wise on rank 1), takes its state_dict
and loads it back with the default (strict) after leaving out "dense.weight", then after adding
"unexpected.weight". The oracle is torch's own nn.Module.load_state_dict on the unsharded model with
the same two state dicts: it raises RuntimeError ("Missing key(s)", "Unexpected key(s)"); the
sharded model must raise too. No tolerance: what is compared is whether an error is raised.
The parent waits at most 120 s and ends any rank still running.

    python this_script.py            a dense key missing / an unexpected key: exit 1 (REPRODUCED)
                                     when DistributedModelParallel.load_state_dict does not raise
    python this_script.py --control  a table's key missing (the sharded EBC's own load hook checks
                                     it): DistributedModelParallel raises as the unsharded model does:
                                     exit 0 (OK)
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


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.modules.embedding_modules import EmbeddingBagCollection
        from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

        torch.manual_seed(0)
        self.ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=DIM, feature_names=[f])
                                                  for n, (r, f) in TABLES.items()])
        apply_optimizer_in_backward(torch.optim.SGD, list(self.ebc.parameters()), {"lr": 0.1})
        self.dense = torch.nn.Linear(DIM, 1)

    def forward(self, features):
        return self.dense(self.ebc(features).values())


def spoiled(state: dict, control: bool) -> dict:
    """The state dicts to load: without a dense key and with an unexpected one (control: without a table's key)."""
    if control:
        return {"missing ebc.embedding_bags.t1.weight": {k: v for k, v in state.items() if k != "ebc.embedding_bags.t1.weight"}}
    return {"missing dense.weight": {k: v for k, v in state.items() if k != "dense.weight"},
            "unexpected unexpected.weight": {**state, "unexpected.weight": torch.zeros(1)}}


def outcome(module, state: dict) -> str:
    try:
        returned = module.load_state_dict(state)
    except RuntimeError as exc:
        return "raised RuntimeError: " + str(exc).strip().splitlines()[-1].strip()[:120]
    return f"loaded, returned {returned}"


def compare(rank: int, control: bool, result: dict) -> None:
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, get_default_sharders, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    unsharded, model = Model(), Model()
    plan = construct_module_sharding_plan(model.ebc, {"t0": table_wise(rank=0), "t1": table_wise(rank=1)},
                                          local_size=WORLD_SIZE, world_size=WORLD_SIZE, device_type="cpu")
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                                   plan=ShardingPlan({"ebc": plan}), sharders=get_default_sharders())
    result["stage"] = "loading the spoiled state dicts"
    expected = {name: outcome(unsharded, state) for name, state in spoiled(dict(unsharded.state_dict()), control).items()}
    for name, state in spoiled(dict(dmp.state_dict()), control).items():
        result["compared"] += 1
        found = outcome(dmp, dict(state))
        if found.startswith("raised") != expected[name].startswith("raised"):
            result["problems"].append(f"rank {rank}, {name}: DistributedModelParallel.load_state_dict {found}; "
                                      f"the unsharded module {expected[name]}")


def run_rank(rank: int, scratch: str, control: bool) -> None:
    result = {"rank": rank, "problems": [], "compared": 0, "stage": "setting up"}
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{scratch}/rendezvous", rank=rank, world_size=WORLD_SIZE,
                                timeout=datetime.timedelta(seconds=30))
        result["stage"] = "sharding the model"
        compare(rank, control, result)
        dist.barrier()
        result["done"] = True
        dist.destroy_process_group()
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {str(exc).strip()[:400]} ({traceback.extract_tb(exc.__traceback__)[-1].filename})"
    with open(os.path.join(scratch, f"rank{rank}.json"), "w") as file:
        json.dump(result, file)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--control", action="store_true", help="a table's key missing instead")
    control = parser.parse_args().control
    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="torchrec-repro-") as scratch:
        processes = [context.Process(target=run_rank, args=(rank, scratch, control)) for rank in range(WORLD_SIZE)]
        for process in processes:
            process.start()
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
                results.append({"rank": rank, "problems": [], "stage": "unknown", "error": f"no result after {DEADLINE_S} s"})
    problems = [p for r in results for p in r["problems"]]
    if problems:
        print("REPRODUCED: " + "; ".join(problems[:2]))
        return 1
    errors = [r for r in results if not r.get("done")]
    if errors:
        print(f"CANNOT RUN: rank {errors[0]['rank']} while {errors[0]['stage']}: {errors[0].get('error')}")
        return 2
    print(f"OK: DistributedModelParallel.load_state_dict raises where the unsharded module does "
          f"({sum(r['compared'] for r in results)} loads compared)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
