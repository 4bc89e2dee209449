"""Our model gives the same predictions for a TensorDict batch and a KJT batch."""

from hypothesis import given, settings

import paritykit
from paritykit.strategies import sparse_batches
from recsys_model import FEATURES, VOCAB, RankingModel

MODEL = RankingModel(seed=3)


@settings(max_examples=25, deadline=None)
@given(sparse_batches(keys=list(FEATURES), id_bounds=VOCAB, weighted=False, variable_batch=False))
def test_tensordict_and_kjt_batches_give_identical_predictions(batch):
    td = batch.to_td("from_jagged_offsets", "cpu")
    from_td = MODEL(paritykit.td_to_kjt(td))
    from_kjt = MODEL(batch.to_kjt("cpu"))
    paritykit.assert_close(from_td, from_kjt, exact=True)


@settings(max_examples=10, deadline=None)
@given(sparse_batches(keys=list(FEATURES), id_bounds=VOCAB))
def test_the_round_trip_keeps_every_row_weights_and_batch_sizes(batch):
    kjt = batch.to_kjt("cpu")
    paritykit.assert_close(paritykit.td_to_kjt(paritykit.kjt_to_td(kjt)), kjt, exact=True)
