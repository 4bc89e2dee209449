"""Small models the DMP cases shard: an EBC under a dense layer (the shape DMP.reshard and DDP expect:
the sharded module is a child, the dense part wrapped by DDP), and a plain ``nn.EmbeddingBag``.

Both read pooled embeddings by key, never by position (a sharded EBC orders its keys by placement).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from paritykit.harness.seeding import generator
from paritykit.errors import HarnessError
from paritykit.harness.tables import TableSpec, build_ebc, build_ec

DENSE_OUT = 3
BAG_ROWS, BAG_WIDTH, BAG_BATCH = 12, 8, 3
# torchrec's fused kernels by the name of paritykit's optimizer.
FUSED_OPTIMIZERS = {"sgd": "EXACT_SGD", "adagrad": "EXACT_ADAGRAD", "rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD"}


class EbcUnderDense(nn.Module):
    """``dense(cat(ebc(kjt)[feature] for every feature in table order))``; returns both, the pooled
    embeddings by key and the dense layer's output."""

    def __init__(self, tables: Sequence[TableSpec], seed: int) -> None:
        super().__init__()
        self.ebc = build_ebc(tables, seed=seed)
        self.features = [f for t in tables for f in t.feature_names]
        if len(set(self.features)) != len(self.features):
            raise ValueError("EbcUnderDense reads each feature's pooled embedding by its name: features must be unique")
        width = sum(t.embedding_dim for t in tables for _ in t.feature_names)
        self.dense = nn.Linear(width, DENSE_OUT)
        with torch.no_grad():
            shape = self.dense.weight.shape
            self.dense.weight.copy_(torch.randn(shape, generator=generator("ebc-under-dense", seed, tuple(shape))) * 0.3)
            self.dense.bias.fill_(0.1)
        # A buffer outside the sharded module: DMP must list it (named_buffers) and carry it.
        self.register_buffer("shift", torch.linspace(-0.1, 0.1, DENSE_OUT))

    def forward(self, kjt):
        pooled = self.ebc(kjt).to_dict()
        return {"pooled": pooled, "dense": self.dense(torch.cat([pooled[f] for f in self.features], dim=1)) + self.shift}


def unsharded_buffers(dmp: nn.Module) -> dict[str, torch.Tensor]:
    """A probe (run on every rank after the state is loaded): the buffers DMP's named_buffers lists outside
    its sharded modules, by their unsharded names."""
    from torchrec.distributed.types import ShardedModule

    from paritykit.harness.dmp import canonical_name

    sharded = [canonical_name(name) for name, module in dmp.named_modules() if isinstance(module, ShardedModule)]
    return {canonical_name(name): buffer.detach().clone() for name, buffer in dmp.named_buffers()
            if not any(canonical_name(name).startswith(f"{fqn}.") for fqn in sharded)}


def kernels_and_tables(dmp: nn.Module) -> list[tuple[int, int]]:
    """A probe: for every lookup of every sharded embedding module, (its batched kernels, the tables
    they hold shards of: a table's column shards on one rank share a kernel)."""
    from torchrec.distributed.types import ShardedModule

    found = []
    for module in dmp.modules():
        if not isinstance(module, ShardedModule):
            continue
        for lookup in getattr(module, "_lookups", ()):
            lookup = getattr(lookup, "module", lookup)  # a data-parallel lookup is wrapped in DDP
            configs, kernels = getattr(lookup, "grouped_configs", None), getattr(lookup, "_emb_modules", None)
            if configs is None or kernels is None:
                continue  # not a batched lookup (none on this stack's shape): nothing to count
            found.append((len(kernels), len({table.name for config in configs for table in config.embedding_tables})))
    return found


# The step a user resuming at step 5 hands DMP's fused optimizer (set_optimizer_step).
OPTIMIZER_STEP = 5


def optimizer_steps(dmp: nn.Module) -> list[int]:
    """A probe: ``dmp.fused_optimizer.set_optimizer_step(OPTIMIZER_STEP)``, then the step counter of every
    batched kernel (fbgemm's TBE ``iter``) of the model. SGD and (row-wise) Adagrad do not read it."""
    from torchrec.distributed.types import ShardedModule

    dmp.fused_optimizer.set_optimizer_step(OPTIMIZER_STEP)
    kernels = [getattr(kernel, "_emb_module", None) for module in dmp.modules() if isinstance(module, ShardedModule)
               for lookup in getattr(module, "_lookups", ()) for kernel in getattr(getattr(lookup, "module", lookup), "_emb_modules", ())]
    return [int(kernel.iter[0]) for kernel in kernels if isinstance(getattr(kernel, "iter", None), torch.Tensor)]


# The sharding types whose EC outputs are selected with torch.gather (the rest with index_select):
# the per-type choice overrides the module-wide one, both set.
GATHER_SELECT = {"use_gather_select": True, "use_gather_select_per_sharding": {"row_wise": False}}


def build_gather_select_ec(tables: tuple[TableSpec, ...], seed: int, need_indices: bool) -> nn.Module:
    """The EC told to select its sharded outputs with torch.gather (GATHER_SELECT)."""
    import inspect

    from torchrec.modules.embedding_modules import EmbeddingCollection

    missing = set(GATHER_SELECT) - set(inspect.signature(EmbeddingCollection).parameters)
    if missing:
        raise HarnessError(f"this torchrec's EmbeddingCollection takes no {sorted(missing)}")
    return build_ec(tables, seed=seed, need_indices=need_indices, **GATHER_SELECT)


def build_ebc_under_dense(tables: tuple[TableSpec, ...], seed: int) -> nn.Module:
    return EbcUnderDense(tables, seed)


class BagModel(nn.Module):
    """A plain torch ``nn.EmbeddingBag`` (SUM: the only mode torchrec shards) with seeded weights, fed
    (ids, offsets, per-sample weights). torchrec's sharded bag reads ``offsets`` as a KJT does (one
    more than the batch), so the unsharded bag is built with ``include_last_offset`` to read them alike."""

    def __init__(self, num_embeddings: int, embedding_dim: int, seed: int, include_last_offset: bool = True) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(num_embeddings, embedding_dim, mode="sum", include_last_offset=include_last_offset)
        with torch.no_grad():
            self.bag.weight.copy_(torch.randn((num_embeddings, embedding_dim),
                                              generator=generator("embedding-bag", seed, num_embeddings, embedding_dim)))

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.bag(ids, offsets, per_sample_weights=weights)


def build_bag_model(num_embeddings: int, embedding_dim: int, seed: int, include_last_offset: bool = True) -> nn.Module:
    return BagModel(num_embeddings, embedding_dim, seed, include_last_offset)


def bag_batches(world_size: int, seed: int, steps: int = 3) -> tuple:
    """Seeded bags of ids with per-id weights, as the sharding cases' RankBatch (feature "bag")."""
    from paritykit.checks.sharding.cases import RankBatch

    source = generator("bag-batches", seed, world_size)
    batches = []
    for _ in range(steps):
        step = []
        for _rank in range(world_size):
            rows = tuple(tuple(int(i) for i in torch.randint(0, BAG_ROWS, (int(n),), generator=source))
                         for n in torch.randint(0, 4, (BAG_BATCH,), generator=source))
            weights = tuple(tuple(0.25 + 0.5 * ((i + r) % 3) for i in range(len(row))) for r, row in enumerate(rows))
            step.append(RankBatch((("bag", rows),), (("bag", weights),)))
        batches.append(tuple(step))
    return tuple(batches)


def bag_inputs(batch: Any, with_end: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, offsets, weights) of one RankBatch of bags; the offsets end with the number of ids, or
    (torch's default, ``include_last_offset=False``) give each bag's start only."""
    rows, weights = batch.ids[0][1], batch.weights[0][1]
    lengths = torch.tensor([len(row) for row in rows], dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    offsets = offsets if with_end else offsets[:-1]
    ids = torch.tensor([i for row in rows for i in row], dtype=torch.int64)
    return ids, offsets, torch.tensor([w for row in weights for w in row], dtype=torch.float32)


def bag_setup(case: Any, device: str = "cpu", include_last_offset: bool = True):
    """The TrainingSetup of a plain nn.EmbeddingBag sharded by torchrec's EmbeddingBagSharder (its
    placement is ``case.plan["weight"]``, its kernel ``case.kernel``), trained with SGD on both sides."""
    import functools

    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingPlan

    from paritykit.engine.dmp_options import DmpOptions
    from paritykit.engine.training import TrainingSetup
    from paritykit.harness.optimizers import OptimizerSpec
    from paritykit.harness.plans import normalize_plan_entry, parameter_sharding_generator

    table = case.tables[0]
    model_fn = functools.partial(build_bag_model, table.num_embeddings, table.embedding_dim, case.seed, include_last_offset)
    model = model_fn()
    spec = OptimizerSpec(case.optimizer)
    fused = (("optimizer", getattr(EmbOptimType, FUSED_OPTIMIZERS[spec.name])), ("learning_rate", spec.lr))
    entry = normalize_plan_entry("weight", case.plan["weight"])
    module_plan = construct_module_sharding_plan(
        model.bag, per_param_sharding={"weight": parameter_sharding_generator(entry, case.kernel)},
        sharder=EmbeddingBagSharder(fused_params=dict(fused)), local_size=case.world_size, world_size=case.world_size,
        device_type=torch.device(device).type)
    return TrainingSetup(model_fn=model_fn, full_state={k: v.detach().clone() for k, v in model.state_dict().items()},
                         sharding_plan=ShardingPlan({"bag": module_plan}),
                         batches=[[bag_inputs(batch, include_last_offset) for batch in step] for step in case.step_batches()],
                         embedding_optimizer=spec, dense_optimizer=spec, device=device,
                         options=DmpOptions(embedding_bag_fused_params=fused))
