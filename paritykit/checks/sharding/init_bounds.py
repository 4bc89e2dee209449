"""Tables a user configures with ``weight_init_min``/``weight_init_max`` and never loads weights into:
after DistributedModelParallel shards (and initialises) them, every value of every shard on every
rank must lie in [min, max]. The oracle is the configuration's own bounds; they are chosen away from
torchrec's default range (uniform in +-sqrt(1 / rows)), so a sharding that drops them shows. Every
sharding type the module's sharder implements, built on the meta device (DMP materialises it, the
way a large model is built) and on the CPU; the module built must hold every table on the device it
was given. With ``constant_init`` each table is also given an ``init_fn`` (``nn.init.constant_`` at the
middle of its bounds): the sharded tables must hold exactly that value, which only the sharded
module's own ``reset_parameters`` applies (the kernels initialise uniformly in the bounds).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from paritykit.errors import HarnessError, ParityError
from paritykit.harness.plans import describe_plan

# (name, rows, columns, weight_init_min, weight_init_max): disjoint from the default +-sqrt(1/rows) (above it: a
# sharding that drops the max asks for an empty range), or inside it with each bound alone inside the default range
# (a sharding that drops only one bound initialises outside the other).
Table = tuple[str, int, int, float, float]


@dataclass(frozen=True)
class InitBoundsCase:
    module: str  # "ebc" or "ec"
    world_size: int
    tables: tuple[Table, ...]
    plan: dict[str, tuple] = field(hash=False)
    meta: bool = True
    constant_init: bool = False

    def case_id(self) -> str:
        shapes = ", ".join(f"{n}[{r}x{c} init {lo}..{hi}]" for n, r, c, lo, hi in self.tables)
        return (f"init-bounds {self.module} world_size={self.world_size} {'meta' if self.meta else 'cpu'} "
                + ("init_fn=constant_(middle) " if self.constant_init else "") + f"plan={describe_plan(self.plan)} tables=({shapes})")


def middle(low: float, high: float) -> float:
    """The middle of the bounds as the float32 table holds it."""
    import torch

    return float(torch.tensor((low + high) / 2, dtype=torch.float32))


def _build(module: str, tables: tuple[Table, ...], device: str, constant_init: bool):
    import functools

    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig

    config_type, module_type = (EmbeddingConfig, EmbeddingCollection) if module == "ec" else (EmbeddingBagConfig, EmbeddingBagCollection)
    configs = [config_type(name=n, num_embeddings=r, embedding_dim=c, feature_names=[f"f_{n}"], weight_init_min=lo, weight_init_max=hi,
                           **({"init_fn": functools.partial(torch.nn.init.constant_, val=middle(lo, hi))} if constant_init else {}))
               for n, r, c, lo, hi in tables]
    return module_type(tables=configs, device=torch.device(device))


def init_ranges_on_rank(case: InitBoundsCase) -> dict[str, tuple[float, float, int]]:
    """On a rank: shard the never-loaded module; per table, (min, max, count) of this rank's values."""
    import torch

    from paritykit.harness.dmp import shard_model
    from paritykit.harness.plans import parameter_sharding_generator, normalize_plan_entry

    device = "meta" if case.meta else "cpu"
    model = _build(case.module, case.tables, device, case.constant_init)
    # The module puts every table on the device it is given (on meta: nothing allocated until DMP).
    elsewhere = sorted(f"{name} on {p.device}" for name, p in model.named_parameters() if p.device.type != device)
    if elsewhere:
        raise ParityError(f"{case.case_id()}\n  {type(model).__name__}(device={device!r}) placed {elsewhere}")
    plan = {name: parameter_sharding_generator(normalize_plan_entry(name, entry), None) for name, entry in case.plan.items()}
    dmp = shard_model(model, plan, device="cpu")
    found: dict[str, tuple[float, float, int]] = {}
    for key, value in dmp.state_dict().items():
        name = key.split(".")[-2]
        local = [s.tensor for s in value.local_shards()] if hasattr(value, "local_shards") else [value]
        flat = torch.cat([t.detach().reshape(-1).float() for t in local]) if local else torch.empty(0)
        if flat.numel():
            found[name] = (float(flat.min()), float(flat.max()), int(flat.numel()))
    return found


def run_init_bounds_case(case: InitBoundsCase, pool: Any) -> dict[str, Any]:
    """ParityError naming the rank and table whose initial values leave the configured bounds."""
    if pool.world_size != case.world_size:
        raise HarnessError(f"case needs world size {case.world_size}, the pool has {pool.world_size}")
    per_rank = pool.call(init_ranges_on_rank, (case,), case=case.case_id())
    bounds = {n: (lo, hi) for n, _r, _c, lo, hi in case.tables}
    seen = {name: 0 for name in bounds}
    for rank, found in enumerate(per_rank):
        for name, (low, high, count) in sorted(found.items()):
            lo, hi = bounds[name]
            if case.constant_init and (low, high) != (middle(lo, hi), middle(lo, hi)):
                raise ParityError(f"{case.case_id()}\n  rank {rank}, table {name!r} ({case.plan[name][0]}): initial values span "
                                  f"[{low:.4g}, {high:.4g}], not the {middle(lo, hi)} its init_fn sets")
            if low < lo or high > hi:
                raise ParityError(f"{case.case_id()}\n  rank {rank}, table {name!r} ({case.plan[name][0]}): initial values span "
                                  f"[{low:.4g}, {high:.4g}], outside the configured weight_init_min..max [{lo}, {hi}]")
            seen[name] += count
    empty = sorted(name for name, count in seen.items() if not count)
    if empty:
        raise HarnessError(f"{case.case_id()}: no rank returned values of table(s) {empty}: nothing was compared")
    return {"plan_shape": f"init-bounds/{case.module}", "values": sum(seen.values())}


def init_bounds_cases(world_size: int) -> tuple[InitBoundsCase, ...]:
    """Every sharding type of each module's sharder, on the meta device and on the CPU; on the CPU with
    an init_fn too."""
    from torchrec.distributed.planner.constants import MIN_CW_DIM

    last = world_size - 1
    rows = 4 * world_size
    ebc_tables = (("t0", 12, 8, 2.0, 3.0), ("t1", rows, 8, -5.0, -4.0), ("t2", 10, 8, 0.5, 0.75), ("t3", 9, 12, 7.0, 7.5),
                  ("t4", rows, 8, 1.0, 1.25), ("t5", rows, MIN_CW_DIM, -2.0, -1.5), ("t6", 6, 4, 4.0, 4.5), ("t7", 12, 8, -0.03, 0.02))
    ebc_plan = {"t0": ("table_wise", last), "t1": ("row_wise",), "t2": ("column_wise", (last, 0)), "t3": ("table_column_wise", (0, last, 0)),
                "t4": ("table_row_wise", 0), "t5": ("grid_shard", (0,)), "t6": ("data_parallel",), "t7": ("table_wise", 0)}
    ec_tables = (("t0", 12, 8, 2.0, 3.0), ("t1", rows, 8, -5.0, -4.0), ("t2", 10, 8, 0.5, 0.75), ("t3", 6, 8, 4.0, 4.5),
                 ("t4", 12, 8, -0.03, 0.02))
    ec_plan = {"t0": ("table_wise", last), "t1": ("row_wise",), "t2": ("column_wise", (0, last)), "t3": ("data_parallel",),
               "t4": ("table_wise", 0)}
    return (InitBoundsCase("ebc", world_size, ebc_tables, ebc_plan), InitBoundsCase("ec", world_size, ec_tables, ec_plan),
            InitBoundsCase("ebc", world_size, ebc_tables, ebc_plan, meta=False),
            InitBoundsCase("ebc", world_size, ebc_tables, ebc_plan, meta=False, constant_init=True),
            InitBoundsCase("ec", world_size, ec_tables, ec_plan, meta=False, constant_init=True))
