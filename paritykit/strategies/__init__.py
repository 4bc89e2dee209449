"""Hypothesis strategies for sparse batches, KJTs, TensorDicts and sharding plans — for paritykit's own
checks and for a user's tables or model.

    from paritykit import strategies as pks

    @given(pks.kjts_for(model))                          # batches over the model's features, ids in range
    @given(pks.plans_for(model, world_size=2))           # placements every table's sharder implements
    @given(pks.training_batches_for(model, world_size=2, steps=3))   # batches[step][rank]
    @given(pks.embedding_optimizer_specs(), pks.dense_optimizer_specs())   # OptimizerSpecs, drawn hyper-parameters

``sparse_batches`` and ``SparseBatch`` are the building block: a batch drawn as structure plus a seed,
which builds its KJT and its TensorDict independently of paritykit's conversion.
"""

from paritykit.strategies.optimizers import dense_optimizer_specs, embedding_optimizer_specs
from paritykit.strategies.sparse import (
    CONTIGUOUS_FORMS,
    JAGGED_FORMS,
    SparseBatch,
    jagged_forms,
    key_selections,
    kjts,
    sparse_batches,
    tensordicts,
)
from paritykit.strategies.tables import (
    batches_for,
    features_of,
    kjts_for,
    plans_for,
    tensordicts_for,
    training_batches_for,
    variable_batch_kjts_for,
)

__all__ = [
    "CONTIGUOUS_FORMS",
    "JAGGED_FORMS",
    "SparseBatch",
    "batches_for",
    "dense_optimizer_specs",
    "embedding_optimizer_specs",
    "features_of",
    "jagged_forms",
    "key_selections",
    "kjts",
    "kjts_for",
    "plans_for",
    "sparse_batches",
    "tensordicts",
    "tensordicts_for",
    "training_batches_for",
    "variable_batch_kjts_for",
]
