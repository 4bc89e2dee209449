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
from paritykit.checks.modules.position_cases import VARIABLE_BATCH_MIXED, VARIABLE_BATCH_MIXED_SPEC, run_position_case
from paritykit.errors import ParityError

MLP_SWISH_DTYPE = "mlp-swish-layernorm-ignores-dtype"
MLP_UNKNOWN_ACTIVATION = "mlp-unknown-activation-accepted"


def unknown_activation_refused() -> dict[str, Any]:
    """MLP given an activation name it does not support must refuse it when built, naming it (the
    docstring lists "relu", "sigmoid" and "swish_layernorm"); a module built with it fails later."""
    import torch
    from torchrec.modules.mlp import MLP

    try:
        mlp = MLP(4, [3], activation="tanh")
    except Exception as exc:  # the refusal the name deserves, if it names the activation
        if "tanh" not in str(exc):
            raise ParityError(f"MLP(activation='tanh') refused without naming the activation: {type(exc).__name__}: {exc}") from exc
        return {"refused": 1}
    try:
        mlp(torch.randn(2, 4))
    except Exception as exc:
        raise ParityError(f"MLP(activation='tanh') was built (no refusal of the unsupported name); its forward raised "
                          f"{type(exc).__name__}: {exc}") from exc
    raise ParityError("MLP(activation='tanh') was built and ran: the name is not among the documented relu, sigmoid, swish_layernorm")


KNOWN_BROKEN: dict[str, tuple[str, Callable[[], Any]]] = {
    MLP_SWISH_DTYPE: ("MLP(activation='swish_layernorm', dtype=torch.float64) against its formula",
                      lambda: run_dense_case(DenseSpec("mlp", 3, 4, (4, 5), SWISH, dtype="float64"))),
    MLP_UNKNOWN_ACTIVATION: ("MLP(activation='tanh'), a name it does not support, refused when built", unknown_activation_refused),
    KJT_POOL_WEIGHTED: ("an unsharded weighted KeyedJaggedTensorPool updated and looked up, against the pool model",
                        lambda: run_pool_case(None, pinned_pool_specs("kjt", 1, weighted=True)[0])),
    KJT_POOL_EMPTY_UPDATE: ("an unsharded KeyedJaggedTensorPool updated with one sample, then with none, then looked up",
                            lambda: run_pool_case(None, PoolSpec(
                                "kjt", 1, 3, "int64", "int64", (("update", ((1,),)), ("update", ((),)), ("lookup", ((0, 1, 2),))),
                                features=(("f0", 2), ("f1", 1)), input_keys=("f0", "f1"), lengths=((((2, 1),),), ((),), None)))),
    VARIABLE_BATCH_MIXED: ("PositionWeightedProcessor weighting f1 of a KJT of a variable batch (f0 1 bag, f1 3, f2 1), against "
                           "the position weights by hand", lambda: run_position_case(VARIABLE_BATCH_MIXED_SPEC)),
}

# Those that need a pool of two ranks: rule -> (what, body(pool)).
SHARDED_KNOWN_BROKEN: dict[str, tuple[str, Callable[[Any], Any]]] = {
    KJT_POOL_SHARD_ORDER: ("a KeyedJaggedTensorPool sharded row-wise on 2 ranks, rank 0 updating slots [4, 0, 2], against the pool model",
                           lambda pool: run_pool_case(pool, out_of_shard_order_spec())),
    KJT_POOL_EMPTY_LOOKUP: ("a KeyedJaggedTensorPool sharded row-wise on 2 ranks, rank 1 looking up no slot, against the pool model",
                            lambda pool: run_pool_case(pool, empty_lookup_spec())),
}
