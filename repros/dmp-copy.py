"""Known torchrec issue dmp-copy (listed for torchrec >=1.8,<1.10).

DistributedModelParallel.copy fails on a gloo-sharded model: torchrec's sharded_model_copy patches
ProcessGroupNCCL (absent from a CPU-only torch) and cannot deep-copy the ProcessGroup itself (it
gives ProcessGroupNCCL, ProcessGroupGloo and Work a no-copy __deepcopy__, not the ProcessGroup that
ShardingEnv.from_process_group(dist.group.WORLD) holds).

The script builds an EmbeddingBagCollection with tables t0 (6 x 4) and t1 (8 x 4) (seeded torch.randn,
SUM pooling), shards them (t0 table-wise, t1 row-wise) with DistributedModelParallel on one gloo
rank, calls dmp.copy(torch.device("cpu")) and feeds the copy one batch. The oracle is the unsharded
module with the same weights: the copy's pooled outputs must equal its outputs within
|copy - oracle| <= 1e-5 * (1 + |oracle|) (a sum of at most 3 float32 rows of order 1: a correct
result is off by ~1e-7).

    python this_script.py            dmp.copy(cpu), then the copy's forward: exit 1 (REPRODUCED) when
                                     copy raises or the copy's outputs differ
    python this_script.py --control  the same comparison on the DMP itself, not copied: exit 0 (OK)
    exit 2 (CANNOT RUN): the script itself failed.
"""

import argparse
import datetime
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist

TABLES = {"t0": (6, "f0"), "t1": (8, "f1")}  # name: (rows, feature); 4 columns each
IDS = {"f0": [[0, 1], [2], [1, 4, 5]], "f1": [[7], [], [3, 3]]}


def build():
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    module = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=name, num_embeddings=rows, embedding_dim=4, feature_names=[feature])
                                            for name, (rows, feature) in TABLES.items()])
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(initial_weight(name.split(".")[-2]))
    return module


def initial_weight(table: str) -> torch.Tensor:
    return torch.randn(TABLES[table][0], 4, generator=torch.Generator().manual_seed(int(table[1:]) + 1))


def batch():
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor(keys=list(IDS), values=torch.tensor([i for rows in IDS.values() for row in rows for i in row]),
                             lengths=torch.tensor([len(row) for rows in IDS.values() for row in rows]))


def sharded():
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, get_default_sharders, row_wise, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    module = build()
    plan = construct_module_sharding_plan(module, {"t0": table_wise(rank=0), "t1": row_wise()},
                                          local_size=1, world_size=1, device_type="cpu")
    dmp = DistributedModelParallel(module, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                                   plan=ShardingPlan({"": plan}), sharders=get_default_sharders())
    with torch.no_grad():
        for key, value in dmp.state_dict().items():
            value.local_shards()[0].tensor.copy_(initial_weight(key.split(".")[-2]))
    return dmp


def raised_in_torchrec(exc: BaseException) -> bool:
    """Whether the exception came out of torchrec or fbgemm (else this script itself failed)."""
    return any(f"{os.sep}torchrec{os.sep}" in f.filename or f"{os.sep}fbgemm_gpu{os.sep}" in f.filename
               for f in traceback.extract_tb(exc.__traceback__)[1:])


def compare(actual: dict, expected: dict) -> list:
    problems = []
    for key, want in expected.items():
        got = actual.get(key)
        if got is None or got.shape != want.shape:
            problems.append(f"output {key!r}: {None if got is None else tuple(got.shape)} vs oracle {tuple(want.shape)}")
            continue
        bad = (got - want).abs() > 1e-5 * (1 + want.abs())
        if bool(bad.any()):
            at = tuple(int(i) for i in bad.nonzero()[0])
            problems.append(f"output {key!r}: {int(bad.sum())} of {bad.numel()} differ, first at {list(at)}: "
                            f"{got[at].item():.6g} vs oracle {want[at].item():.6g}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--control", action="store_true", help="the DMP itself, not its copy")
    control = parser.parse_args().control
    what = "the DistributedModelParallel (not copied)" if control else "DistributedModelParallel.copy(cpu)"
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="torchrec-repro-") as scratch:
        try:
            dist.init_process_group("gloo", init_method=f"file://{scratch}/rendezvous", rank=0, world_size=1,
                                    timeout=datetime.timedelta(seconds=60))
            expected = {k: v.detach() for k, v in build()(batch()).to_dict().items()}
            dmp = sharded()
        except Exception as exc:
            print(f"CANNOT RUN: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            if dist.is_initialized():
                dist.destroy_process_group()
            return 2
        try:
            model = dmp if control else dmp.copy(torch.device("cpu"))
            actual = {k: v.detach() for k, v in model(batch()).to_dict().items()}
        except Exception as exc:
            if not raised_in_torchrec(exc):
                print(f"CANNOT RUN: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
                return 2
            print(f"REPRODUCED: {what} of a gloo-sharded EBC raised {type(exc).__name__}: {exc}\n"
                  f"{traceback.format_exc(limit=-4)}")
            return 1
        finally:
            dist.destroy_process_group()
    problems = compare(actual, expected)
    if problems:
        print(f"REPRODUCED: the outputs of {what} differ from the unsharded module's: " + "; ".join(problems))
        return 1
    print(f"OK: the outputs of {what} match the unsharded module's ({len(expected)} features compared)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
