"""Whose fault an exception is: raised in paritykit's own code -> a harness error (exit 2); raised
inside the code under test (torchrec, fbgemm, a user's model, a planted bug) -> a failure (exit 1).
Decided where the traceback exists: in the parent (the runner's one mapping) and on a rank
(``rank_error_from``)."""

import pytest
import torch

import paritykit.convert as convert
from paritykit.checks.runner import result_from_exception
from paritykit.dist.calls import rank_error_from
from paritykit.errors import HarnessError, NothingCompared, ParityError, RankFailure, raised_by_harness
from paritykit.harness import plants
from paritykit.harness.tables import seeded_full_weights


def raised(fn, *args):
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - the test inspects what was raised
        return exc
    raise AssertionError(f"{fn} did not raise")


def inconsistent_kjt_to_dict():
    """torchrec itself raises: lengths sum to 5, there are 4 values."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjt = KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], torch.arange(4), torch.tensor([2, 3]))
    return kjt.to_dict()


def status(exc):
    return result_from_exception("c", "id", "replay", exc, 0.0).status


def test_an_exception_raised_inside_torchrec_is_a_failure_of_the_code_under_test():
    exc = raised(inconsistent_kjt_to_dict)
    assert not raised_by_harness(exc)
    assert status(exc) == "fail"


def test_an_exception_raised_in_paritykits_own_conversion_is_a_harness_error():
    exc = raised(convert._lengths_from_offsets, [torch.tensor([0, 1, 2])], None, False)
    assert isinstance(exc, TypeError) and raised_by_harness(exc)
    result = result_from_exception("c", "id", "replay", exc, 0.0)
    assert result.status == "error"
    assert result.message.startswith("harness error: an exception raised in paritykit's own code")


def test_paritykit_code_called_by_a_planted_bug_belongs_to_the_plant_which_stands_for_torchrec():
    # offsets-off-by-one wraps paritykit's own _lengths_from_offsets: what raises inside it is the plant's.
    with plants.applied(["offsets-off-by-one"]):
        exc = raised(convert._lengths_from_offsets, [torch.tensor([0, 1, 2])], None, False)
    assert isinstance(exc, TypeError) and not raised_by_harness(exc)
    assert status(exc) == "fail"


def test_paritykit_model_code_that_torchrec_had_torch_fx_trace_belongs_to_torchrec():
    # torchrec decides what its tracer traces into; a built-in model's forward that fx cannot trace
    # (a branch on a shape) fails only because torchrec traced into it.
    from torchrec.fx import symbolic_trace

    from paritykit.engine.nested_models import GuardedDense

    exc = raised(symbolic_trace, GuardedDense(2, 3))
    assert type(exc).__name__ == "TraceError" and not raised_by_harness(exc)
    assert status(exc) == "fail"


def test_paritykit_code_that_paritykit_itself_had_torch_fx_trace_stays_a_harness_error():
    from paritykit.engine.nested_models import GuardedDense

    exc = raised(_trace_in_paritykit, GuardedDense(2, 3))
    assert type(exc).__name__ == "TraceError" and raised_by_harness(exc)


def _trace_in_paritykit(module):
    # A frame whose module is paritykit's calling torch.fx: the harness tracing a model itself.
    namespace = {"__name__": "paritykit.harness.tracing_here", "torch": torch}
    exec(compile("def trace(module):\n    return torch.fx.symbolic_trace(module)\n", "<paritykit>", "exec"), namespace)
    return namespace["trace"](module)


def test_typed_exceptions_keep_their_meaning_whoever_raised_them():
    assert status(HarnessError("no gpu")) == "error"
    assert status(RankFailure("rank 1 was killed by SIGKILL")) == "fail"
    result = result_from_exception("c", "id", "r", NothingCompared("zero batches"), 0.0)
    assert (result.status, result.message, result.compared_nothing) == ("skip", "nothing compared: zero batches", True)


def test_on_a_rank_the_kind_is_decided_from_the_traceback():
    assert rank_error_from(raised(inconsistent_kjt_to_dict)).kind == "exception"
    harness = rank_error_from(raised(seeded_full_weights, None, 0))
    assert harness.kind == "harness" and harness.message.startswith("harness error (raised in paritykit's own code): TypeError")


def raise_in_a_users_model():
    return 1 / 0


@pytest.mark.world_size(2)
def test_a_rank_that_fails_in_paritykit_code_is_a_harness_error_and_in_user_code_a_rank_failure(rank_pool):
    with pytest.raises(HarnessError, match="raised harness error .raised in paritykit's own code.: TypeError"):
        rank_pool.run(seeded_full_weights, None, 0)
    with pytest.raises(RankFailure, match="ZeroDivisionError"):
        rank_pool.run(raise_in_a_users_model)


def test_a_non_leaf_parameter_of_a_stand_in_model_is_the_models_fault_not_paritykits():
    # A stand-in module (no torchrec model lists a computed tensor as its parameter on these stacks).
    from paritykit.harness.dmp import dense_parameters

    class ComputedWeight(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base = torch.nn.Parameter(torch.ones(3))

        def named_parameters(self, *args, **kwargs):
            yield "base", self.base
            yield "scaled", self.base * 2

    with pytest.raises(ParityError, match=r"computed from others.*\['scaled'\]") as caught:
        dense_parameters(ComputedWeight())
    assert not raised_by_harness(caught.value)
    assert list(dense_parameters(torch.nn.Linear(2, 2))) == ["weight", "bias"]

    class RetainedView(ComputedWeight):  # torchrec's dense-kernel tables: views that retain their grad
        def named_parameters(self, *args, **kwargs):
            view = self.base[:2]
            view.retain_grad()
            yield "view", view

    assert list(dense_parameters(RetainedView())) == ["view"]
    torch.optim.SGD(dense_parameters(RetainedView()).values(), lr=0.1)  # what torch.optim accepts
