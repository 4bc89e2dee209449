"""Module configurations torchrec gets wrong, each run on purpose by every gate as a minimal
reproduction against the formula, so that its failure is matched against the known issues
(paritykit/checks/known_issues.toml, case ``known-broken <rule>: <what>``) and ``--strict`` notices
the day torchrec fixes it. The draws keep clear of them (draws.py, pool_cases.py)."""

from __future__ import annotations

from typing import Any, Callable

from paritykit.checks.modules.dense_cases import run_dense_case
from paritykit.checks.modules.dense_modules import SWISH, DenseSpec
from paritykit.checks.modules.pool_cases import (KJT_POOL_EMPTY_LOOKUP, KJT_POOL_EMPTY_UPDATE, KJT_POOL_SHARD_ORDER,
                                                 KJT_POOL_WEIGHTED, PoolSpec, empty_lookup_spec, out_of_shard_order_spec,
                                                 pinned_pool_specs, run_pool_case)

MLP_SWISH_DTYPE = "mlp-swish-layernorm-ignores-dtype"

KNOWN_BROKEN: dict[str, tuple[str, Callable[[], Any]]] = {
    MLP_SWISH_DTYPE: ("MLP(activation='swish_layernorm', dtype=torch.float64) against its formula",
                      lambda: run_dense_case(DenseSpec("mlp", 3, 4, (4, 5), SWISH, dtype="float64"))),
    KJT_POOL_WEIGHTED: ("an unsharded weighted KeyedJaggedTensorPool updated and looked up, against the pool model",
                        lambda: run_pool_case(None, pinned_pool_specs("kjt", 1, weighted=True)[0])),
    KJT_POOL_EMPTY_UPDATE: ("an unsharded KeyedJaggedTensorPool updated with one sample, then with none, then looked up",
                            lambda: run_pool_case(None, PoolSpec(
                                "kjt", 1, 3, "int64", "int64", (("update", ((1,),)), ("update", ((),)), ("lookup", ((0, 1, 2),))),
                                features=(("f0", 2), ("f1", 1)), input_keys=("f0", "f1"), lengths=((((2, 1),),), ((),), None)))),
}

# Those that need a pool of two ranks: rule -> (what, body(pool)).
SHARDED_KNOWN_BROKEN: dict[str, tuple[str, Callable[[Any], Any]]] = {
    KJT_POOL_SHARD_ORDER: ("a KeyedJaggedTensorPool sharded row-wise on 2 ranks, rank 0 updating slots [4, 0, 2], against the pool model",
                           lambda pool: run_pool_case(pool, out_of_shard_order_spec())),
    KJT_POOL_EMPTY_LOOKUP: ("a KeyedJaggedTensorPool sharded row-wise on 2 ranks, rank 1 looking up no slot, against the pool model",
                            lambda pool: run_pool_case(pool, empty_lookup_spec())),
}
