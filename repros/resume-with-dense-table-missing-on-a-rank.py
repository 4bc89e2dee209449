"""A standalone reproduction of a TorchRec defect. It needs torch and torchrec only.

Known torchrec issue resume-with-dense-table-missing-on-a-rank (listed for torchrec >=1.8,<1.10).

A dense-kernel table with no shard on a rank leaves it an empty placeholder parameter that training
never gives a gradient (so no optimizer state) but KeyedOptimizer.init_state() does: load_state_dict
of the trained optimizer's state_dict then fails on that rank (ValueError: Different parameter
count).

What to do instead: give every rank a shard of each dense-kernel table (row-wise, or column-wise
over every rank), or use the fused kernel for tables placed on some ranks only.

The script spawns 2 ranks (gloo, CPU). Each builds an EmbeddingBagCollection of two tables (t0 on
f0, t1 on f1, 12 x 4 each, SUM) and a dense nn.Linear(8, 1) under DistributedModelParallel, the
tables with the dense kernel, t0 table-wise on rank 0 and t1 table-wise on rank 1, and trains every
parameter with torch's Adam (lr 0.05) through a KeyedOptimizerWrapper for 4 steps. Before step 2
it resumes as torchrec's KeyedOptimizer documents: state_dict(), a fresh KeyedOptimizerWrapper,
init_state(), load_state_dict(). Its oracle is the unsharded model on every rank, trained without
interruption by torch's Adam on all ranks' batches: the per-sample squared-error losses of every
rank summed and every gradient divided by the world size (DDP's average, torchrec's all-to-all
gradient division). After each step it compares the dense layer and this rank's shards of the
tables (|a - b| <= 64 units of float32 roundoff x (|b| + max|b|): the same sums in another order).

    python this_script.py            t0 table-wise on rank 0, t1 table-wise on rank 1
    python this_script.py --control  t0 and t1 row-wise: every rank holds a shard of each

    exit 0: the resumed run trains like the unsharded model on both ranks
    exit 1: it does not, or torchrec raised (the message says where)
    exit 2: the script itself could not run
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

WORLD_SIZE, ROWS, DIM, BATCH, LR, STEPS, RESUME_AT = 2, 12, 4, 3, 0.05, 4, 2
TABLES = ("t0", "t1")
UNITS_OF_ROUNDOFF = 64


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        configs = [EmbeddingBagConfig(name=t, num_embeddings=ROWS, embedding_dim=DIM, feature_names=[f"f{i}"],
                                      pooling=PoolingType.SUM) for i, t in enumerate(TABLES)]
        self.ebc = EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
        self.dense = torch.nn.Linear(DIM * len(TABLES), 1)
        with torch.no_grad():
            for name, param in self.named_parameters():
                param.copy_(initial_weight(name))

    def forward(self, sparse, labels):
        return (self.dense(self.ebc(sparse).values()).squeeze(1) - labels) ** 2


def initial_weight(name: str) -> torch.Tensor:
    shapes = {**{f"ebc.embedding_bags.{t}.weight": (ROWS, DIM) for t in TABLES},
              "dense.weight": (1, DIM * len(TABLES)), "dense.bias": (1,)}
    seed = sorted(shapes).index(name) + 11
    return torch.randn(shapes[name], generator=torch.Generator().manual_seed(seed))


def batch_of(step: int, rank: int):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(1000 * step + rank)
    lengths = torch.randint(1, 4, (len(TABLES) * BATCH,), generator=g)
    values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)
    keys = [f"f{i}" for i in range(len(TABLES))]
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths.int()), torch.randn(BATCH, generator=g)


def reference() -> list:
    """{parameter name: value} after each step: the unsharded model, Adam, every rank's batches."""
    model = Model()
    adam = torch.optim.Adam(model.parameters(), lr=LR)
    records = []
    for step in range(STEPS):
        adam.zero_grad()
        loss = sum(model(*batch_of(step, rank)).sum() for rank in range(WORLD_SIZE))
        (loss / WORLD_SIZE).backward()
        adam.step()
        records.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return records


def shard(row_wise: bool):
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, get_default_sharders, row_wise as rw, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    placements = {t: rw(compute_kernel="dense") if row_wise else table_wise(rank=i, compute_kernel="dense")
                  for i, t in enumerate(TABLES)}
    model = Model()
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(model.ebc, placements, local_size=WORLD_SIZE,
                                                               world_size=WORLD_SIZE, device_type="cpu")})
    sharded = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                                       plan=plan, sharders=get_default_sharders())
    with torch.no_grad():
        for name, piece, offsets in local_pieces(sharded):
            piece.copy_(initial_weight(name)[tuple(slice(o, o + n) for o, n in zip(offsets, piece.shape))])
    return sharded


def adam(sharded):
    from torchrec.optim.keyed import KeyedOptimizerWrapper

    return KeyedOptimizerWrapper(dict(sharded.named_parameters()), lambda params: torch.optim.Adam(params, lr=LR))


def local_pieces(sharded):
    """(parameter name, this rank's piece of it, its offsets) for every shard and replica on this rank."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    for name, value in sharded.state_dict().items():
        if isinstance(value, ShardedTensor):
            for piece in value.local_shards():
                yield name, piece.tensor, tuple(piece.metadata.shard_offsets)
        else:
            yield name, value, (0,) * value.dim()


def train(rank: int, row_wise: bool, expected: list, result: dict) -> None:
    sharded = shard(row_wise)
    optimizer = adam(sharded)
    for step in range(STEPS):
        if step == RESUME_AT:
            result["stage"] = f"resuming the optimizer before step {step} (init_state, load_state_dict)"
            saved = optimizer.state_dict()
            optimizer = adam(sharded)
            optimizer.init_state()
            optimizer.load_state_dict(saved)
        result["stage"] = f"training step {step}"
        optimizer.zero_grad()
        sparse, labels = batch_of(step, rank)
        sharded(sparse, labels).sum().backward()
        optimizer.step()
        for name, piece, offsets in local_pieces(sharded):
            want = expected[step][name][tuple(slice(o, o + n) for o, n in zip(offsets, piece.shape))]
            result["compared"] += 1
            bound = UNITS_OF_ROUNDOFF * torch.finfo(torch.float32).eps / 2 * (want.abs() + want.abs().max())
            bad = (piece.detach() - want).abs() > bound
            if bool(bad.any()):
                i = tuple(int(x) for x in bad.nonzero()[0])
                result["problems"].append(f"after step {step}, rank {rank}, {name} shard at {list(offsets)}, index {list(i)}: "
                                          f"{piece[i].item():.8g} vs unsharded {want[i].item():.8g}")


def run_rank(rank: int, scratch: str, row_wise: bool) -> None:
    result = {"rank": rank, "problems": [], "compared": 0, "stage": "starting the process group"}
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{scratch}/rendezvous", rank=rank, world_size=WORLD_SIZE,
                                timeout=datetime.timedelta(seconds=60))
        result["stage"] = "computing the unsharded oracle"
        expected = reference()
        result["stage"] = "sharding the model"
        train(rank, row_wise, expected, result)
    except Exception as exc:
        in_torchrec = result["stage"] not in ("starting the process group", "computing the unsharded oracle") and torchrec_frame(exc)
        result.update({"raised" if in_torchrec else "error": f"{type(exc).__name__}: {exc}", "where": torchrec_frame(exc),
                       "traceback": traceback.format_exc(limit=-6)})
    with open(os.path.join(scratch, f"rank{rank}.json"), "w") as file:
        json.dump(result, file)
    if "raised" in result or "error" in result:
        sys.exit(1)  # a rank left waiting in a collective is ended by torch.multiprocessing
    dist.destroy_process_group()


def torchrec_frame(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f"{os.sep}torchrec{os.sep}" in f.filename
              or f"{os.sep}fbgemm_gpu{os.sep}" in f.filename]
    return f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].name})" if frames else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--control", action="store_true", help="row-wise tables: the nearest configuration torchrec computes right")
    row_wise = parser.parse_args().control
    how = "t0, t1 row-wise (dense kernel)" if row_wise else "t0 table-wise on rank 0, t1 on rank 1 (dense kernel)"
    with tempfile.TemporaryDirectory(prefix="torchrec-repro-") as scratch:
        try:
            mp.spawn(run_rank, args=(scratch, row_wise), nprocs=WORLD_SIZE, join=True)
        except Exception:  # a rank exited early: its result file says why
            pass
        results = []
        for rank in range(WORLD_SIZE):
            try:
                with open(os.path.join(scratch, f"rank{rank}.json")) as file:
                    results.append(json.load(file))
            except OSError:
                results.append({"rank": rank, "error": "no result (the rank was ended)", "stage": "?", "traceback": ""})
    raised = [r for r in results if "raised" in r]
    if raised:
        print(f"REPRODUCED: torchrec raised {raised[0]['raised']} on rank {raised[0]['rank']} while {raised[0]['stage']} "
              f"({how}; {len(raised)} of {WORLD_SIZE} ranks raised), in {raised[0]['where']}")
        return 1
    errors = [r for r in results if "error" in r]
    if errors:
        print("CANNOT RUN: " + "; ".join(f"rank {r['rank']} while {r['stage']}: {r['error']}\n{r['traceback']}" for r in errors))
        return 2
    problems = [p for r in results for p in r["problems"]]
    if problems:
        print(f"REPRODUCED: resumed before step {RESUME_AT} ({how}), the model leaves the unsharded oracle "
              f"({len(problems)} difference(s)): " + "; ".join(problems[:3]))
        return 1
    print(f"OK: resumed before step {RESUME_AT} ({how}), both ranks train like the unsharded model with torch's Adam "
          f"({sum(r['compared'] for r in results)} tensors compared)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
