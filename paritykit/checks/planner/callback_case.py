"""The planner's callbacks (``EmbeddingShardingPlanner(callbacks=[...])``: "callback functions to apply
to plans"), against what they promise: each runs once on the chosen plan, in the order given, each on
what the one before returned, and the sharding plan is made from what the last one returns.

The oracle is the callback itself: the first moves a table-wise table to the next rank and reverses
the options' order; the plan must place that table where the callback put it and every other table
where the planner without callbacks does.
"""

from __future__ import annotations

from typing import Any

from paritykit.errors import expect

CASE_ID = "planner callbacks: the first moves table-wise t0 to the next rank, the second sees its result"
WORLD_SIZE = 2


def _module() -> Any:
    import torch
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    tables = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=64, embedding_dim=16, feature_names=[f"f{i}"]) for i in range(3)]
    return EmbeddingBagCollection(tables=tables, device=torch.device("meta"))


def _placements(plan: Any) -> dict[str, tuple[str, list[int]]]:
    return {table: (sharding.sharding_type, list(sharding.ranks)) for table, sharding in plan.plan[""].items()}


def _plan(callbacks: list | None) -> Any:
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.sharding_plan import get_default_sharders

    from paritykit.checks.planner.planning import topology_of
    from paritykit.harness.noise import quiet_planner

    with quiet_planner():
        planner = EmbeddingShardingPlanner(topology=topology_of(WORLD_SIZE, WORLD_SIZE, "cpu"), callbacks=callbacks,
                                           constraints={"t0": ParameterConstraints(sharding_types=["table_wise"])})
        return planner.plan(_module(), get_default_sharders())


def run_callback_case() -> dict[str, Any]:
    calls: list[tuple[str, Any]] = []
    moved: dict[str, int] = {}

    def move_t0(options: list) -> list:
        calls.append(("move", options))
        t0 = next(o for o in options if o.name == "t0")
        moved["from"] = t0.shards[0].rank
        t0.shards[0].rank = (t0.shards[0].rank + 1) % WORLD_SIZE
        returned = list(reversed(options))
        moved["returned"] = id(returned)
        return returned

    def look(options: list) -> list:
        calls.append(("look", options))
        return options

    plain = _placements(_plan(None))
    got = _placements(_plan([move_t0, look]))
    expect([name for name, _ in calls] == ["move", "look"], f"{CASE_ID}: the callbacks ran as {[n for n, _ in calls]}, "
                                                            "expected each once, in the order given")
    expect(id(calls[1][1]) == moved["returned"], f"{CASE_ID}: the second callback got another list than the first returned")
    wanted = dict(plain, t0=("table_wise", [(moved["from"] + 1) % WORLD_SIZE]))
    expect(plain["t0"] == ("table_wise", [moved["from"]]), f"{CASE_ID}: without callbacks t0 is {plain['t0']}, the callback "
                                                            f"saw it table-wise on rank {moved['from']}")
    expect(got == wanted, f"{CASE_ID}: the plan places the tables as {got}, the last callback returned {wanted}")
    return {"callbacks": 2, "tables": len(got)}
