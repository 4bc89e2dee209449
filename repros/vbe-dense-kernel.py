"""A standalone reproduction of a TorchRec parity failure. It needs torch and torchrec only.

Known torchrec issue vbe-dense-kernel (listed for torchrec >=1.8,<1.10).

a VBE batch into a sharded EmbeddingBagCollection with the dense kernel on CPU: split-size errors or
wrong pooled rows.

What to do instead: with variable batches, use the fused kernel (an optimizer in backward) on CPU.

CONFIG below is the configuration: one embedding module (an EmbeddingBagCollection "ebc" or an
EmbeddingCollection "ec"), its tables with their initial weights (seeded torch.randn), a sharding
plan in the names of torchrec.distributed.sharding_plan ("column_wise_sized":
column_wise(size_per_rank=...)), and each step's batch on each rank (ids per feature, row by row).
The script spawns the ranks itself (torch.multiprocessing, gloo), shards the module with
DistributedModelParallel and trains it, each rank on its own batch, with the tables' optimizer fused
into the backward (CONFIG's "ranks_per_host": the ranks stand for hosts of that many, as torchrun
sets them). On every rank it also trains the same module unsharded on every rank's batch with
torchrec's gradient semantics: the ranks' losses summed, each table's gradient divided by the world
size (torchrec's default). Per step it compares what the module returned for each feature, then
every table after the step (this rank's shards against the same rows and columns of the unsharded
table), within |sharded - unsharded| <= 64 units of roundoff x (|unsharded| + max|unsharded|).

    python this_script.py   exit 0: the sharded module matches the unsharded one
                            exit 1: it does not, or torchrec raised (the message says where)
                            exit 2: the script itself could not run
"""

import datetime
import json
import os
import sys
import tempfile
import traceback
import zlib

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CONFIG = {'module': 'ebc',
 'world_size': 1,
 'tables': [{'name': 't0',
             'num_embeddings': 8,
             'embedding_dim': 4,
             'feature_names': ['f0', 'f1'],
             'pooling': 'SUM',
             'init_seed': 64334438},
            {'name': 't1',
             'num_embeddings': 6,
             'embedding_dim': 8,
             'feature_names': ['f2'],
             'pooling': 'SUM',
             'init_seed': 1959959280},
            {'name': 't2',
             'num_embeddings': 7,
             'embedding_dim': 4,
             'feature_names': ['f3'],
             'pooling': 'SUM',
             'init_seed': 1843120971}],
 'plan': {'t0': ['table_wise', 0], 't1': ['column_wise', [0, 0]], 't2': ['table_wise', 0]},
 'kernels': {'t0': 'dense', 't1': 'dense', 't2': 'dense'},
 'steps': [[{'ids': {'f0': [[2, 3], []], 'f1': [[5], [0, 1, 3], [1]], 'f2': [[], [1, 1]], 'f3': [[3]]},
             'inverse': {'f0': [1, 0, 1], 'f1': [2, 0, 1], 'f2': [0, 1, 1], 'f3': [0, 0, 0]}}]],
 'weighted': False,
 'need_indices': False,
 'optimizer': 'sgd',
 'dense_optimizer': 'sgd',
 'lr': 0.1,
 'seed': 32,
 'device': 'cpu',
 'train': False,
 'feedings': [],
 'fqn': '',
 'source': 'td-kjt check, step 0 of: sharded ebc ws1 kernel=dense weighted=False vbe=True train=False '
           "routes=kjt+td-paritykit form=nested_tensor device=cpu plan={'t0': table_wise(0), 't1': "
           "column_wise(0,0), 't2': table_wise(0)} tables=(t0[8x4 f0/f1 SUM], t1[6x8 f2 SUM], t2[7x4 f3 "
           'SUM]) seed=32 steps=((RankBatch(lengths=((2, 0), (1, 3, 1), (0, 2), (1,)), seed=0, inverse=((1, '
           '0, 1), (2, 0, 1), (0, 1, 1), (0, 0, 0))),), (RankBatch(lengths=((1,), (2, 0), (3, 1, 0), (0, '
           '1)), seed=100, inverse=((0, 0, 0), (1, 1, 0), (1, 2, 0), (1, 0, 1))),))'}

UNITS_OF_ROUNDOFF = 64


def main() -> int:
    world_size = CONFIG["world_size"]
    with tempfile.TemporaryDirectory(prefix="torchrec-repro-") as scratch:
        ended = ""
        try:
            mp.spawn(run_rank, args=(world_size, scratch), nprocs=world_size, join=True)
        except Exception as exc:  # a rank exited early; its result file says why
            ended = f"{type(exc).__name__}: {exc}"
        results = [read_result(scratch, rank) for rank in range(world_size)]
    return verdict(results, ended)


def read_result(scratch: str, rank: int) -> dict:
    try:
        with open(os.path.join(scratch, f"rank{rank}.json")) as file:
            return json.load(file)
    except OSError:
        return {"rank": rank, "missing": True}


def verdict(results: list, ended: str) -> int:
    raised = [r for r in results if r.get("raised")]
    problems = sorted((p for r in results for p in r.get("problems", [])), key=lambda p: (p["step"], p["order"], p["rank"]))
    errors = [r for r in results if r.get("error")]
    if raised:
        first = raised[0]
        print(f"REPRODUCED: torchrec raised {first['raised']}\n  on rank {first['rank']} while {first['stage']}, "
              f"in {first['where']}\n{first['traceback']}")
        return 1
    if problems:
        print(f"REPRODUCED: the sharded {CONFIG['module']} differs from the unsharded one ({len(problems)} difference(s))")
        for problem in problems[:6]:
            print(f"  step {problem['step']}, rank {problem['rank']}: {problem['text']}")
        return 1
    if errors or any(r.get("missing") for r in results):
        print("the reproduction could not run:", *(f"rank {r['rank']} while {r['stage']}: {r['error']}\n{r['traceback']}"
                                                     for r in errors), ended, sep="\n")
        return 2
    compared = sum(r.get("compared", 0) for r in results)
    print(f"OK: the sharded {CONFIG['module']} matches the unsharded one ({compared} tensors compared)")
    return 0


def run_rank(rank: int, world_size: int, scratch: str) -> None:
    result = {"rank": rank, "problems": [], "compared": 0}
    stage = "starting the process group"
    try:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # tiny tensors: more threads only add overhead
        local = CONFIG.get("ranks_per_host") or world_size
        os.environ.update(LOCAL_WORLD_SIZE=str(local), LOCAL_RANK=str(rank % local), GROUP_RANK=str(rank // local),
                          GROUP_WORLD_SIZE=str(world_size // local))
        dist.init_process_group("gloo", init_method=f"file://{scratch}/rendezvous", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=120))
        stage = "training the unsharded reference"
        reference = train_unsharded(world_size)
        stage = "sharding the module"
        sharded, dense = shard(world_size, device)
        train_sharded(rank, sharded, dense, reference, result)
    except Exception as exc:
        where = torchrec_frame(exc) if stage not in ("starting the process group", "training the unsharded reference") else ""
        # Raised inside torchrec (or fbgemm): a reproduction. Anywhere else: this script could not run.
        result.update({"raised" if where else "error": f"{type(exc).__name__}: {exc}", "where": where,
                       "traceback": traceback.format_exc(limit=-8), "stage": result.get("stage", stage)})
    with open(os.path.join(scratch, f"rank{rank}.json"), "w") as file:
        json.dump(result, file)
    if result.get("raised") or result.get("error"):
        sys.exit(1)  # the other ranks may wait in a collective: torch.multiprocessing ends them
    dist.destroy_process_group()


def torchrec_frame(exc: BaseException) -> str:
    """The innermost frame of torchrec or fbgemm in the exception's traceback ("" when there is none)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if f"{os.sep}torchrec{os.sep}" in f.filename or f"{os.sep}fbgemm_gpu{os.sep}" in f.filename]
    return f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].name})" if frames else ""


# ---------------------------------------------------------------- the module, its plan and its batches


def build_module():
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    tables, cpu = CONFIG["tables"], torch.device("cpu")
    if CONFIG["module"] == "ebc":
        configs = [EmbeddingBagConfig(name=t["name"], num_embeddings=t["num_embeddings"], embedding_dim=t["embedding_dim"],
                                      feature_names=t["feature_names"], pooling=PoolingType[t["pooling"]]) for t in tables]
        module = EmbeddingBagCollection(tables=configs, is_weighted=CONFIG["weighted"], device=cpu)
    else:
        configs = [EmbeddingConfig(name=t["name"], num_embeddings=t["num_embeddings"], embedding_dim=t["embedding_dim"],
                                   feature_names=t["feature_names"]) for t in tables]
        module = EmbeddingCollection(tables=configs, need_indices=CONFIG["need_indices"], device=cpu)
    with torch.no_grad():
        for key, tensor in module.state_dict().items():
            tensor.copy_(initial_weight(table_of(key)))
    return module


def table_of(key: str) -> str:
    return key.split(".")[-2]


def initial_weight(name: str) -> torch.Tensor:
    table = next(t for t in CONFIG["tables"] if t["name"] == name)
    return torch.randn(table["num_embeddings"], table["embedding_dim"], generator=torch.Generator().manual_seed(table["init_seed"]))


def placement(table: str):
    """torchrec's own sharding_plan generator for the table's entry of the plan."""
    import dataclasses

    from torchrec.distributed import sharding_plan as sp

    kind, *args = CONFIG["plan"][table]
    kernel = CONFIG["kernels"][table]
    if kind == "column_wise":
        return sp.column_wise(ranks=list(args[0]), compute_kernel=kernel)
    if kind == "column_wise_sized":  # shard i, of the i-th width, on rank i
        return sp.column_wise(size_per_rank=list(args[0]), compute_kernel=kernel)
    if kind == "table_column_wise":  # column-wise shards read as table-column-wise, as torchrec's TwCw sharding does
        column_wise = sp.column_wise(ranks=list(args[0]), compute_kernel=kernel)
        return lambda *a: dataclasses.replace(column_wise(*a), sharding_type="table_column_wise")
    if kind == "table_wise":
        return sp.table_wise(rank=args[0], compute_kernel=kernel)
    if kind == "row_wise":
        return sp.row_wise(compute_kernel=kernel)
    if kind == "table_row_wise":
        return sp.table_row_wise(host_index=args[0])
    if kind == "grid_shard":
        return sp.grid_shard(host_indexes=list(args[0]))
    return sp.data_parallel()


def with_fused_optimizer(module):
    """The tables get the embedding optimizer in backward, as a user does before sharding: torchrec then
    picks the fused kernel wherever the plan leaves the choice to it."""
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    cls, args = optimizer(CONFIG["optimizer"])
    apply_optimizer_in_backward(cls, list(module.parameters()), args)
    return module


def module_plan(module, world_size: int):
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan

    generators, local = {table: placement(table) for table in CONFIG["plan"]}, CONFIG.get("ranks_per_host") or world_size
    return construct_module_sharding_plan(module, generators, local_size=local, world_size=world_size, device_type="cpu")


def optimizer(name: str):
    from torchrec.optim import RowWiseAdagrad

    known = {"sgd": (torch.optim.SGD, {}), "adagrad": (torch.optim.Adagrad, {"eps": 1e-8}), "adam": (torch.optim.Adam, {}),
             "rowwise_adagrad": (RowWiseAdagrad, {"eps": 1e-8})}
    cls, extra = known[name]
    return cls, {**extra, "lr": CONFIG["lr"]}


def kjt(batch: dict, expand: bool = False):
    """The batch as torchrec's KeyedJaggedTensor; a variable batch (inverse indices) keeps its own batch
    size per feature, or with ``expand`` is repeated out to the output's rows (the reference's input)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys, ids, inverse, weights = list(batch["ids"]), batch["ids"], batch.get("inverse"), batch.get("weights")
    rows = {k: [ids[k][i] for i in inverse[k]] if inverse and expand else ids[k] for k in keys}
    row_weights = {k: [weights[k][i] for i in inverse[k]] if inverse and expand else weights[k] for k in keys} if weights else None
    kwargs = {"stride_per_key_per_rank": [[len(ids[k])] for k in keys],
              "inverse_indices": (keys, torch.tensor([inverse[k] for k in keys], dtype=torch.int64))} if inverse and not expand else {}
    return KeyedJaggedTensor(
        keys=keys, values=torch.tensor([v for k in keys for row in rows[k] for v in row], dtype=torch.int64),
        lengths=torch.tensor([len(row) for k in keys for row in rows[k]], dtype=torch.int32),
        weights=torch.tensor([w for k in keys for row in row_weights[k] for w in row]) if row_weights else None, **kwargs)


def tensordict(batch: dict):
    """The batch as a TensorDict of jagged tensors, the form torchrec's sharded input_dist also takes."""
    from tensordict import TensorDict

    entries = {}
    for key, rows in batch["ids"].items():
        lengths = torch.tensor([len(row) for row in rows], dtype=torch.int64)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
        values = torch.tensor([v for row in rows for v in row], dtype=torch.int64)
        entries[key] = torch.nested.nested_tensor_from_jagged(values, offsets=offsets)
    return TensorDict(entries, batch_size=[])


def by_key(output) -> dict:
    """{key: tensor}: a KeyedTensor's pooled embeddings, or an EmbeddingCollection's values (with lengths)."""
    cached = getattr(output, "_result", None)
    output = cached if cached is not None else output.wait() if hasattr(output, "wait") else output
    if CONFIG["module"] == "ebc":
        return dict(output.to_dict())
    return {**{k: jt.values() for k, jt in output.items()}, **{f"{k}.lengths": jt.lengths() for k, jt in output.items()}}


def loss_of(outputs: dict) -> torch.Tensor:
    """A fixed function of every output element: each gets its own upstream gradient."""
    total = torch.zeros(())
    for key in sorted(k for k in outputs if outputs[k].is_floating_point()):
        seed = zlib.crc32(f"{key}{tuple(outputs[key].shape)}".encode())
        total = total + (outputs[key] * torch.randn(outputs[key].shape, generator=torch.Generator().manual_seed(seed))).sum()
    return total


# ---------------------------------------------------------------- the unsharded reference


def train_unsharded(world_size: int) -> list:
    """Per step: (the outputs for each rank's batch, the tables after the step)."""
    from torchrec.distributed import comm_ops

    module = build_module()
    plan = module_plan(with_fused_optimizer(build_module()), world_size)
    division = 1.0 / world_size if comm_ops.get_gradient_division() else 1.0
    replicated = {n for n, _ in module.named_parameters() if plan[table_of(n)].sharding_type == "data_parallel"}
    # Fused-kernel tables train with the embedding optimizer, the others (dense, data parallel) with the dense one.
    fused = {n: p for n, p in module.named_parameters() if n not in replicated and plan[table_of(n)].compute_kernel != "dense"}
    others = [p for n, p in module.named_parameters() if n not in fused]
    embedding = ReferenceOptimizer(fused, plan)
    dense_class, dense_args = optimizer(CONFIG["dense_optimizer"])
    dense = dense_class(others, **dense_args) if others else None
    records = []
    for step in CONFIG["steps"]:
        module.zero_grad(set_to_none=True)
        outputs = [by_key(module(kjt(batch, expand=True))) for batch in step]
        if CONFIG["train"]:
            torch.stack([loss_of(o) for o in outputs]).sum().backward()
            with torch.no_grad():  # DDP averages replicated tables; the all-to-all divides the others
                for name, param in module.named_parameters():
                    if param.grad is not None:
                        param.grad.mul_(1.0 / world_size if name in replicated else division)
            embedding.step()
            if dense is not None:
                dense.step()
        tables = {table_of(k): v.detach().clone() for k, v in module.state_dict().items()}
        records.append(([{k: v.detach().clone() for k, v in o.items()} for o in outputs], tables))
    return records


class ReferenceOptimizer:
    """The fused optimizer's semantics, unsharded: torch's SGD or Adagrad, or row-wise Adagrad with one
    accumulator per row of each column shard (as fbgemm keeps it for a column-wise sharded table)."""

    def __init__(self, params: dict, plan) -> None:
        self.params, self.plan, self.sums = params, plan, {}
        cls, args = optimizer(CONFIG["optimizer"])
        self.torch = None if CONFIG["optimizer"] == "rowwise_adagrad" or not params else cls(list(params.values()), **args)

    @torch.no_grad()
    def step(self) -> None:
        if self.torch is not None:
            self.torch.step()
            return
        for name, param in self.params.items():
            if param.grad is None:
                continue
            spec = self.plan[table_of(name)].sharding_spec
            starts = sorted({int(s.shard_offsets[1]) for s in spec.shards}) if spec else [0]
            bounds = list(zip(starts, starts[1:] + [param.shape[1]]))
            total = self.sums.setdefault(name, torch.zeros(param.shape[0], len(bounds)))
            for block, (start, end) in enumerate(bounds):
                grad = param.grad[:, start:end]
                total[:, block] += grad.pow(2).mean(dim=1)
                param[:, start:end].addcdiv_(grad, total[:, block:block + 1].sqrt().add_(1e-8), value=-CONFIG["lr"])


# ---------------------------------------------------------------- the sharded module


def shard(world_size: int, device: torch.device):
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import get_default_sharders
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    module = with_fused_optimizer(build_module())
    plan = ShardingPlan({"": module_plan(module, world_size)})
    sharded = DistributedModelParallel(module, env=ShardingEnv.from_process_group(dist.group.WORLD), device=device,
                                       plan=plan, sharders=get_default_sharders())
    with torch.no_grad():
        for key, piece, offsets in local_pieces(sharded):
            piece.copy_(initial_weight(key)[tuple(slice(o, o + n) for o, n in zip(offsets, piece.shape))])
    params = dict(in_backward_optimizer_filter(sharded.named_parameters()))
    dense_class, dense_args = optimizer(CONFIG["dense_optimizer"])
    dense = KeyedOptimizerWrapper(params, lambda ps: dense_class(ps, **dense_args)) if params else None
    return sharded, dense


def local_pieces(sharded):
    """(table, this rank's piece of it, its offsets in the table) for every table shard and replica."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    for key, value in sharded.state_dict().items():
        if isinstance(value, ShardedTensor):
            for shard in value.local_shards():
                yield table_of(key), shard.tensor, tuple(shard.metadata.shard_offsets)
        else:
            yield table_of(key), value, (0,) * value.dim()


def train_sharded(rank: int, sharded, dense, reference: list, result: dict) -> None:
    for step, batches in enumerate(CONFIG["steps"]):
        expected_outputs, expected_tables = reference[step]
        feedings = CONFIG.get("feedings") or ["kjt"]
        for order, form in enumerate(feedings):
            result["stage"] = f"feeding the {form} of step {step} to the sharded module"
            if dense is not None:
                dense.zero_grad()
            output = sharded(kjt(batches[rank]) if form == "kjt" else tensordict(batches[rank]))
            outputs = by_key(output)
            label = f"feeding {order + 1} ({form}): " if len(feedings) > 1 else ""
            for key in sorted(expected_outputs[rank]):
                compare(result, step, 0, f"{label}output {key!r}", outputs.get(key), expected_outputs[rank][key])
            if CONFIG["train"]:
                result["stage"] = f"back-propagating step {step} through the sharded module"
                loss_of(outputs).backward()
                if dense is not None:
                    dense.step()
        if CONFIG["train"]:
            result["stage"] = f"reading the sharded tables after step {step}"
            for table, piece, offsets in local_pieces(sharded):
                window = expected_tables[table][tuple(slice(o, o + n) for o, n in zip(offsets, piece.shape))]
                where = f"table {table!r} after the step, shard at {list(offsets)}"
                compare(result, step, 1, where, piece.detach(), window)
    result.pop("stage", None)


def compare(result: dict, step: int, order: int, what: str, actual, expected) -> None:
    result["compared"] += 1
    problem = beyond_bound(actual, expected)
    if problem:
        result["problems"].append({"step": step, "order": order, "rank": result["rank"], "text": f"{what}: {problem}"})


def beyond_bound(actual, expected) -> str:
    if actual is None:
        return "missing from the sharded output"
    if actual.shape != expected.shape:
        return f"shape {tuple(actual.shape)} vs unsharded {tuple(expected.shape)}"
    if not expected.is_floating_point():
        bad = actual != expected
    else:
        a, e = actual.double(), expected.double()
        unit = torch.finfo(expected.dtype).eps / 2
        bound = UNITS_OF_ROUNDOFF * unit * (e.abs() + (e.abs().max() if e.numel() else 0.0))
        bad = ((a - e).abs() > bound) | (a.isnan() != e.isnan())
    if not bool(bad.any()):
        return ""
    first = tuple(int(i) for i in bad.nonzero()[0])
    largest = float((actual.double() - expected.double()).abs().max()) if expected.is_floating_point() else float("nan")
    return (f"{int(bad.sum())} of {bad.numel()} elements beyond the bound, first at {list(first)}: "
            f"{actual[first].item():.6g} vs unsharded {expected[first].item():.6g} (largest difference {largest:.3g})")


if __name__ == "__main__":
    sys.exit(main())
