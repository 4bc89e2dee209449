"""The planner's refusals (planning only: the model on the meta device), on two GPU ranks of 64 MiB HBM
and 64 MiB DDR each, 15% of the HBM reserved (the default reservation):

- one table of 400000 x 64 float32 (102.4 MB): it fits cut by rows, and the plan keeps every rank within
  its memory; constrained to table-wise it fits no rank, though the ranks hold it together: the planner
  refuses it for its *strict constraints* (``PlannerErrorType.STRICT_CONSTRAINTS``);
- one of 1200000 x 64 (307.2 MB), more than the ranks hold together: refused for *insufficient
  storage* (``INSUFFICIENT_STORAGE``).

Each refusal is a ``PlannerError`` of that type whose message names the remedies with this job's
figures (two devices, the batch of 512) and the storage: the requirement at least the table's weights,
and the storage available for the tables, the ranks' memory less the reservation (HBM x 0.85, all of
the DDR), both summed over the ranks; for insufficient storage the requirement exceeds it.
"""

from __future__ import annotations

import re
from typing import Any

from paritykit.checks.planner.planning import capacity_problems, topology_of
from paritykit.checks.planner.report_rules import recorder
from paritykit.errors import ParityError

CASE_ID = ("planner refusals: a table that fits cut by rows, refused table-wise for its strict constraints and, too "
           "large, for insufficient storage, on 2 GPU ranks of 64 MiB HBM and DDR")
MiB, GB = 2**20, 1024**3
WORLD_SIZE, MEMORY, RESERVED, BATCH, COLUMNS = 2, 64 * MiB, 0.15, 512, 64
FITS_CUT, TOO_LARGE = 400_000, 1_200_000
# The message's storage figures are rounded to 3 decimals of a GB.
PRINTED_GB = 0.5e-3 + 1e-9


def _plan(rows: int, sharding_types: list[str] | None) -> Any:
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.sharding_plan import get_default_sharders

    from paritykit.harness.noise import quiet_planner

    module = EmbeddingBagCollection([EmbeddingBagConfig(name="big", num_embeddings=rows, embedding_dim=COLUMNS, feature_names=["f"])],
                                    device=torch.device("meta"))
    chosen = recorder()
    with quiet_planner():
        topology = topology_of(WORLD_SIZE, WORLD_SIZE, "cuda", hbm_cap=MEMORY, ddr_cap=MEMORY)
        constraints = {"big": ParameterConstraints(sharding_types=sharding_types)} if sharding_types else None
        planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints, batch_size=BATCH, stats=[chosen],
                                           storage_reservation=HeuristicalStorageReservation(percentage=RESERVED))
        return planner.plan(module, get_default_sharders()), chosen.best_plan, topology


def _storage(message: str, label: str) -> tuple[float, float] | None:
    found = re.search(re.escape(label) + r": Storage\(hbm = ([0-9.]+) GB, ddr = ([0-9.]+) GB\)", message)
    return None if found is None else (float(found.group(1)), float(found.group(2)))


def refusal_problems(message: str, error_type: str, expected_type: str, rows: int) -> list[str]:
    """The refusal's type and the figures its message gives (the module docstring)."""
    problems = [] if error_type == expected_type else [f"refused as {error_type}, expected {expected_type}"]
    for remedy in (f"Increase the number of devices ({WORLD_SIZE})", f"Reduce local batch size ({BATCH})"):
        if remedy not in message:
            problems.append(f"the message does not say {remedy!r}")
    weights = rows * COLUMNS * 4 / GB
    required = _storage(message, "Global storage requirement for model parallel")
    available = _storage(message, "Global storage available for model parallel")
    if required is None or available is None:
        return problems + [f"the message gives no storage requirement or availability: {message[:300]!r}"]
    if sum(required) + PRINTED_GB < weights:
        problems.append(f"the message requires {required} GB (HBM, DDR), less than the table's {weights:.3f} GB of weights")
    want = (WORLD_SIZE * (1 - RESERVED) * MEMORY / GB, WORLD_SIZE * MEMORY / GB)
    # The reservation's dense and input parts (none here, a batch's ids: under a MB) come off the HBM too.
    if not (want[0] - 0.001 - PRINTED_GB <= available[0] <= want[0] + PRINTED_GB) or abs(available[1] - want[1]) > PRINTED_GB:
        problems.append(f"the message gives {available} GB (HBM, DDR) available for the tables; the ranks' memory less the "
                        f"reservation is {tuple(round(w, 4) for w in want)}")
    if expected_type == "INSUFFICIENT_STORAGE" and not sum(required) > sum(available):
        problems.append(f"refused for insufficient storage, its requirement {required} GB within the {available} GB available")
    return problems


def run_refusal_case() -> dict[str, Any]:
    from torchrec.distributed.planner.types import PlannerError

    problems = []
    plan, best_plan, topology = _plan(FITS_CUT, None)
    if best_plan is None or not plan.plan:
        problems.append(f"the table of {FITS_CUT} rows, unconstrained: no plan")
    else:
        problems += [f"the table of {FITS_CUT} rows, unconstrained: {p}" for p in capacity_problems(best_plan, topology, "cuda")]
    refused = 0
    for rows, types, expected in ((FITS_CUT, ["table_wise"], "STRICT_CONSTRAINTS"), (TOO_LARGE, None, "INSUFFICIENT_STORAGE")):
        what = f"the table of {rows} rows" + (f" constrained to {types}" if types else "")
        try:
            plan, best_plan, _ = _plan(rows, types)
        except PlannerError as error:
            refused += 1
            problems += [f"{what}: {p}" for p in refusal_problems(str(error), getattr(error.error_type, "name", str(error.error_type)),
                                                                   expected, rows)]
            continue
        problems.append(f"{what}: planned ({plan.plan}), though it fits no rank" + (" or all of them together" if types is None else ""))
    if problems:
        raise ParityError(f"{CASE_ID}\n  torchrec's planner:\n    " + "\n    ".join(problems))
    return {"refusals": refused, "plan_shape": "planner/refusals"}
