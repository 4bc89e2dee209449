"""Feature-processed EBC configurations that torchrec trains wrongly on CPU, each run on purpose once per
gate as ``known-broken <rule> ...`` (matched by paritykit/checks/known_issues.toml, verified on torchrec
1.8.0 and 1.9.2). The pinned FP cases (fp_cases.py) stay clear of them; each rule says what it avoids.
"""

from __future__ import annotations

from typing import Any, Callable

from paritykit.checks.sharding.fp_cases import FpCase, fp_plans, run_fp_case

RULES = {
    "fp-ebc-root-position-weights-not-averaged":
        "a FeatureProcessedEmbeddingBagCollection that is itself the model DistributedModelParallel wraps does "
        "not average its position weights' gradients over the ranks: DDP (static_graph=True) wraps the sharded "
        "FP-EBC, whose forward returns an awaitable rather than tensors, so the first iteration's delayed "
        "all-reduce never runs and the replicas drift apart (the pinned FP cases hold the FP-EBC in a module "
        "returning its pooled embeddings; DefaultDataParallelWrapper(static_graph=False) also avoids it)",
}


def known_broken_fp_cases(world_size: int) -> dict[str, tuple[str, Callable[[Any], dict[str, Any]]]]:
    """Rule name -> (case id, the body that runs it on a pool of ``world_size`` (>= 2) ranks)."""
    root = FpCase("train", "collection", world_size, fp_plans(world_size)[0], seed=90, root=True)
    rule = "fp-ebc-root-position-weights-not-averaged"
    return {rule: (f"known-broken {rule} {root.case_id()}", lambda pool, case=root: run_fp_case(case, pool))}
