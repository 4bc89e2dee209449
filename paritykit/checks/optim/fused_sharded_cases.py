"""A FusedEmbeddingBagCollection sharded by DistributedModelParallel (torchrec's
``FusedEmbeddingBagCollectionSharder``, among its default sharders): the tables table-wise, column-wise
on ranks in any order and table-column-wise in one module, trained on every rank's own batch. The
oracle: the plain EmbeddingBagCollection with the same weights trained by the optimizer's reference
(torch's SGD and Adagrad) on the ranks' batches together, the loss each rank's divided by the world
size where torchrec's all-to-all divides the gradients (``comm_ops.get_gradient_division``). Every
rank's outputs of every step (by key: the sharded module groups its output keys by sharding type) and
the tables gathered from their shards at the end, within the norm-wise bound.

The plan names the fused kernel, the one kernel the sharder offers for these types. Left to
torchrec's plan generators (no ``compute_kernel``), the tables get the dense kernel, which the sharder
does not offer, and never train: a known issue (known_broken.py). A data-parallel table is not
placed in the pinned cases: on a CPU the sharded module wraps it in DDP with ``device_ids=[cpu]``,
which DDP refuses (a known issue, run as its known-broken case).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from paritykit.checks.optim.fused_module_cases import raise_on_differences
from paritykit.engine.tolerances import normwise
from paritykit.errors import HarnessError, ParityError
from paritykit.harness.plans import describe_plan
from paritykit.harness.tables import TableSpec

OPTIMIZERS = {"sgd": "SGD", "adagrad": "Adagrad"}  # torch.optim classes, fbgemm's exact rules
STEPS = 2
SAMPLES_PER_RANK = 2


@dataclass(frozen=True)
class FusedShardedCase:
    optimizer: str
    lr: float
    world_size: int
    tables: tuple[TableSpec, ...]
    plan: tuple[tuple[str, tuple], ...]  # (table, placement entry)
    kernel: str | None = "fused"  # None: torchrec's plan generators choose (known broken)
    seed: int = 0

    def case_id(self) -> str:
        tables = ", ".join(f"{t.name}[{t.num_embeddings}x{t.embedding_dim} {'/'.join(t.feature_names)}]" for t in self.tables)
        kernel = "kernel=torchrec's default" if self.kernel is None else f"kernel={self.kernel}"
        return (f"sharded fused ebc world_size={self.world_size} optimizer={self.optimizer}(lr={self.lr}) {kernel} "
                f"plan={describe_plan(dict(self.plan))} tables=({tables}) steps={STEPS} seed={self.seed}")

    def keys(self) -> list[str]:
        return [f for t in self.tables for f in t.feature_names]


def _rows(case: FusedShardedCase, rank: int, step: int) -> dict[str, list[list[int]]]:
    generator = torch.Generator().manual_seed(case.seed * 1000 + step * 10 + rank)
    rows = {}
    for table in case.tables:
        for feature in table.feature_names:
            rows[feature] = [torch.randint(0, table.num_embeddings, (int(torch.randint(0, 4, (1,), generator=generator)),),
                                           generator=generator).tolist() for _ in range(SAMPLES_PER_RANK)]
    return rows


def _upstream(case: FusedShardedCase, rank: int, step: int, key: str, shape: torch.Size) -> torch.Tensor:
    seed = case.seed * 100_000 + step * 1000 + rank * 100 + case.keys().index(key)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def train_fused_sharded_on_rank(case: FusedShardedCase) -> dict[str, Any]:
    """On a rank: the fused module sharded by DMP, trained ``STEPS`` steps on this rank's batches."""
    import torch.distributed as dist
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

    from paritykit.harness.dmp import shard_model
    from paritykit.harness.plans import normalize_plan_entry, parameter_sharding_generator
    from paritykit.harness.sharded import copy_full_weights_into, gather_full_weights
    from paritykit.harness.tables import build_ebc, kjt_from_rows, unsharded_full_weights

    from paritykit.harness.devices import rank_device

    rank, device = dist.get_rank(), rank_device("cuda" if dist.get_backend() == "nccl" else "cpu")
    plain = build_ebc(case.tables, seed=case.seed)
    fused = FusedEmbeddingBagCollection(tables=plain.embedding_bag_configs(), optimizer_type=getattr(torch.optim, OPTIMIZERS[case.optimizer]),
                                        optimizer_kwargs={"lr": case.lr}, device=device)
    model = torch.nn.Module()
    model.ebc = fused
    plan = {table: parameter_sharding_generator(normalize_plan_entry(table, entry), case.kernel) for table, entry in case.plan}
    dmp = shard_model(model, plan, device=device)
    sharded = dmp.module.ebc
    if type(sharded).__name__ != "ShardedFusedEmbeddingBagCollection":
        raise HarnessError(f"{case.case_id()}: DMP made a {type(sharded).__name__} of the fused module")
    copy_full_weights_into(dmp, unsharded_full_weights(plain))
    outputs = []
    for step in range(STEPS):
        out = sharded(kjt_from_rows(case.keys(), _rows(case, rank, step), device=device.type)).to_dict()
        sum((out[key] * _upstream(case, rank, step, key, out[key].shape).to(device)).sum() for key in case.keys()).backward()
        outputs.append({key: value.detach().cpu() for key, value in out.items()})
    return {"outputs": outputs, "tables": {name: table.cpu() for name, table in gather_full_weights(dmp).items()}}


def _reference(case: FusedShardedCase) -> tuple[list[list[dict[str, torch.Tensor]]], dict[str, torch.Tensor]]:
    """Per step, per rank, the plain module's outputs of that rank's samples; and its tables at the end."""
    from paritykit.harness.sharded import gradient_division
    from paritykit.harness.tables import build_ebc, kjt_from_rows

    plain = build_ebc(case.tables, seed=case.seed)
    optimizer = getattr(torch.optim, OPTIMIZERS[case.optimizer])(plain.parameters(), lr=case.lr)
    scale = 1.0 / case.world_size if gradient_division() else 1.0
    per_step = []
    for step in range(STEPS):
        rows = {key: [row for rank in range(case.world_size) for row in _rows(case, rank, step)[key]] for key in case.keys()}
        out = plain(kjt_from_rows(case.keys(), rows)).to_dict()
        mine = [{key: value[rank * SAMPLES_PER_RANK:(rank + 1) * SAMPLES_PER_RANK] for key, value in out.items()}
                for rank in range(case.world_size)]
        loss = sum((part[key] * _upstream(case, rank, step, key, part[key].shape)).sum()
                   for rank, part in enumerate(mine) for key in case.keys())
        optimizer.zero_grad()
        (loss * scale).backward()
        optimizer.step()
        per_step.append([{key: value.detach() for key, value in part.items()} for part in mine])
    return per_step, {name.split(".")[-2]: param.detach() for name, param in plain.named_parameters()}


def run_fused_sharded_case(case: FusedShardedCase, pool: Any) -> dict[str, Any]:
    """ParityError naming the step, rank and key, or the table, where the sharded fused module parts from
    the plain module trained by the optimizer's reference."""
    if pool.world_size != case.world_size:
        raise HarnessError(f"case needs world size {case.world_size}, the pool has {pool.world_size}")
    per_rank = pool.call(train_fused_sharded_on_rank, (case,), case=case.case_id())
    expected, tables = _reference(case)
    bound = normwise()
    for step in range(STEPS):
        for rank, result in enumerate(per_rank):
            got = result["outputs"][step]
            if sorted(got) != sorted(expected[step][rank]):
                raise ParityError(f"{case.case_id()}\n  step {step}, rank {rank}: output keys {sorted(got)}, "
                                  f"the module's {sorted(expected[step][rank])}")
            for key, want in expected[step][rank].items():
                raise_on_differences(bound.differences(got[key], want, f"output[{key!r}]"), case,
                                     f"step {step}, rank {rank}: output {key!r}")
    for name, want in tables.items():
        raise_on_differences(bound.differences(per_rank[0]["tables"][name], want, f"table {name}"), case,
                             f"table {name!r} after {STEPS} steps (its tables never trained if it equals the start)")
    return {"steps": STEPS, "ranks": case.world_size, "tables": len(tables), "plan_shape": "sharded-fused-ebc"}


def pinned_fused_sharded_cases(world_size: int) -> tuple[FusedShardedCase, ...]:
    """Every type the sharder offers on a CPU but data-parallel, in one module: table-wise on the last
    rank and the first, column-wise on ranks in reverse order, table-column-wise on one rank twice."""
    last = world_size - 1
    tables = (TableSpec("t0", 6, 8, ("f0",)), TableSpec("t1", 5, 8, ("f1", "f2")), TableSpec("t2", 7, 8, ("f3",)),
              TableSpec("t3", 4, 4, ("f4",)))
    plan = (("t0", ("table_wise", last)), ("t1", ("column_wise", (last, 0))), ("t2", ("table_column_wise", (0, 0))),
            ("t3", ("table_wise", 0)))
    return tuple(FusedShardedCase(name, lr, world_size, tables, plan, seed=seed)
                 for name, lr, seed in (("sgd", 0.1, 1), ("adagrad", 0.05, 2)))
