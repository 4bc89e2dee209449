"""torchrec's collective validation (``TORCHREC_VALIDATE_COLLECTIVES=1``) against what it promises: ranks
calling different collectives on one process group are told so (a RuntimeError naming the collective
mismatch, on every rank), where without it the exchange goes through and one rank's ids are looked up
in another rank's table.

The ranks share a model of two EmbeddingBagCollections of one table each, alike but for their feature
name, both table-wise on rank 0. Every rank looks its batch up in one of them: the even ranks in the
first, the odd ranks in the second. The splits all-to-all has the same sizes on every rank, so only
the tags can tell the calls apart. That validation does not change a number when ranks agree is the
``debug-checks`` DMP cases' job (dmp_cases.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paritykit.errors import HarnessError, ParityError

FEATURES = ("first", "second")
ROWS, WIDTH = 6, 4


@dataclass(frozen=True)
class ValidationCase:
    world_size: int
    # False only for the negative control (the suite): the same calls with validation off.
    validate: bool = True

    def case_id(self) -> str:
        return f"collective validation: even ranks call EBC {FEATURES[0]!r}, odd ranks {FEATURES[1]!r} world_size={self.world_size}"


def validation_cases(world_size: int) -> tuple[ValidationCase, ...]:
    return (ValidationCase(world_size),)


class TwoBags(nn.Module):
    """Two EBCs of one table each (``t_first``, ``t_second``), alike but for their feature."""

    def __init__(self) -> None:
        super().__init__()
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        for feature in FEATURES:
            config = EmbeddingBagConfig(name=f"t_{feature}", embedding_dim=WIDTH, num_embeddings=ROWS, feature_names=[feature])
            setattr(self, feature, EmbeddingBagCollection(tables=[config], device=torch.device("cpu")))


def run_validation_case_on_rank(case: ValidationCase) -> dict[str, Any]:
    """What the rank saw: the error its lookup raised (None if it returned) and whether validation was on."""
    import torch.distributed as dist
    from torchrec.distributed import collective_utils
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from paritykit.engine.dmp_options import DmpOptions, torchrec_debug_checks

    rank = dist.get_rank()
    feature = FEATURES[rank % 2]
    with torchrec_debug_checks() if case.validate else contextlib.nullcontext():
        model = TwoBags()
        plan = ShardingPlan({name: construct_module_sharding_plan(getattr(model, name), {f"t_{name}": table_wise(rank=0)})
                             for name in FEATURES})
        dmp = DmpOptions().sharded(lambda: model, plan, torch.device("cpu"))
        enabled = collective_utils.validate_collectives_enabled()
        batch = KeyedJaggedTensor.from_lengths_sync(keys=[feature], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1]))
        try:
            getattr(dmp.module, feature)(batch)
            raised = None
        except RuntimeError as error:
            raised = str(error)
    return {"enabled": enabled, "raised": raised}


def run_validation_case(case: ValidationCase, pool: Any) -> dict[str, Any]:
    """ParityError naming the rank that was not told of the mismatch, or told of something else."""
    from torchrec.distributed import collective_utils

    if pool.world_size != case.world_size or case.world_size < 2:
        raise HarnessError(f"case needs world size {case.world_size} (two or more), the pool has {pool.world_size}")
    if not hasattr(collective_utils, "validate_collectives_enabled"):
        raise HarnessError("collective validation: this torchrec has no TORCHREC_VALIDATE_COLLECTIVES (collective_utils.validate_collectives_enabled)")
    per_rank = pool.call(run_validation_case_on_rank, (case,), case=case.case_id())
    problems = []
    for rank, seen in enumerate(per_rank):
        if case.validate and not seen["enabled"]:
            problems.append(f"rank {rank}: TORCHREC_VALIDATE_COLLECTIVES=1, yet DistributedModelParallel left validation off")
        elif seen["raised"] is None:
            problems.append(f"rank {rank}: looked its batch up in EBC {FEATURES[rank % 2]!r} while other ranks used the other EBC; "
                            "torchrec's collective validation raised nothing (the all-to-all mixed the two lookups)")
        elif "mismatch" not in seen["raised"].lower():
            problems.append(f"rank {rank}: raised an error that does not name a collective mismatch: {seen['raised'][:300]}")
    if problems:
        raise ParityError(f"{case.case_id()}\n  " + "\n  ".join(problems))
    return {"ranks": case.world_size, "mismatches_raised": case.world_size}
