"""torchrec's plan delta (``output_sharding_plan_delta_single`` and ``output_sharding_plans_delta``, what
a user hands ``DistributedModelParallel.reshard``) against what it means, in the caller: the delta of
an old and a new plan of the same tables holds exactly the tables whose ranks changed, each as the new
plan places it, and its data volume is the moved shards' bytes (float32) in MB; a new plan for other
tables than the old one is refused (the delta of plans that do not describe the same module means
nothing). The resharding cases (dmp_reshard_cases.py) train through the deltas these make.
"""

from __future__ import annotations

from typing import Any

from paritykit.errors import HarnessError, ParityError

# (name, rows, columns) of the EBC the plans place, on 2 ranks.
TABLES = (("t0", 8, 4), ("t1", 6, 8), ("t2", 10, 4))
OLD = {"t0": ("table_wise", 0), "t1": ("column_wise", (0, 1)), "t2": ("row_wise",)}
# t0 moves to rank 1; t1's column shards swap ranks; t2 stays where it was.
NEW = {"t0": ("table_wise", 1), "t1": ("column_wise", (1, 0)), "t2": ("row_wise",)}
MOVED = ("t0", "t1")
MB = 1024 * 1024


def _module_plan(plan: dict[str, tuple]) -> Any:
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed import sharding_plan as sp

    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=c, feature_names=[f"f_{n}"])
                                         for n, r, c in TABLES], device=torch.device("meta"))
    helpers = {"table_wise": lambda args: sp.table_wise(rank=args[0]), "column_wise": lambda args: sp.column_wise(ranks=list(args[0])),
               "row_wise": lambda args: sp.row_wise()}
    return sp.construct_module_sharding_plan(ebc, {n: helpers[e[0]](e[1:]) for n, e in plan.items()}, world_size=2, local_size=2,
                                             device_type="cpu")


def _delta_functions() -> tuple[Any, Any]:
    try:
        from torchrec.distributed.sharding.dynamic_sharding import output_sharding_plan_delta_single, output_sharding_plans_delta
    except ImportError as exc:
        raise HarnessError(f"this torchrec has no plan delta helpers: {exc}") from exc
    return output_sharding_plan_delta_single, output_sharding_plans_delta


def run_plan_delta_case() -> dict[str, Any]:
    single, plans_delta = _delta_functions()
    old, new = _module_plan(OLD), _module_plan(NEW)
    volume, delta = single(old, new, return_data_volume=True)
    if sorted(delta) != sorted(MOVED):
        raise ParityError(f"output_sharding_plan_delta_single: delta of tables {sorted(delta)}, expected those whose ranks moved {list(MOVED)}")
    for name in MOVED:
        if delta[name].ranks != new[name].ranks or delta[name].sharding_type != new[name].sharding_type:
            raise ParityError(f"output_sharding_plan_delta_single: table {name!r} in the delta is {delta[name].sharding_type} on "
                              f"{delta[name].ranks}, the new plan's is {new[name].sharding_type} on {new[name].ranks}")
    moved_bytes = sum(r * c * 4 for n, r, c in TABLES if n in MOVED)
    if abs(volume - moved_bytes / MB) > 1e-12:
        raise ParityError(f"output_sharding_plan_delta_single: data volume {volume} MB, the moved tables hold {moved_bytes / MB} MB")
    whole = plans_delta({"ebc": old}, {"ebc": new})  # {module path: (data volume, its delta)}
    if sorted(whole) != ["ebc"] or sorted(whole["ebc"][1]) != sorted(MOVED):
        raise ParityError(f"output_sharding_plans_delta: {({k: sorted(v[1]) for k, v in whole.items()})}, expected {{'ebc': {list(MOVED)}}}")
    without_t2 = type(new)({name: sharding for name, sharding in new.items() if name != "t2"})
    try:
        fewer = single(old, without_t2)
    except Exception:  # noqa: BLE001 - a refusal is what is asked
        return {"plan_shape": "plan-helpers/delta", "moved": len(MOVED)}
    raise ParityError(f"output_sharding_plan_delta_single of a plan of t0, t1, t2 against one of t0, t1 returned a delta of "
                      f"{sorted(fewer[1])} instead of refusing plans of other tables")
