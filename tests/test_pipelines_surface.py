"""The pipeline check's surface cases: the catalog of torchrec pipelines found by feature, the oracles
on their own (plain accumulation by hand, the unsharded eval forward, the lifecycle order, the
hook-order rule, the flaky dataloader), then every surface case passing on the installed torchrec
and the four known-broken comparisons failing as listed."""

from __future__ import annotations

import fnmatch

import pytest
import torch

from paritykit.checks.known_issues import load as load_known_issues
from paritykit.checks.pipeline.comparison import DEFAULT_SEMI_SYNC_BOUNDS
from paritykit.checks.pipeline.surface import dlrm_surface_setup, known_broken_bodies, surface_bodies, variant_pipelines
from paritykit.checks.pipeline.surface_runs import backward_optimizer, gradient_accumulation, staged, stopped_eval_joined
from paritykit.checks.runner import GateConfig
from paritykit.engine.builtin_models import DataSpec, ModelSpec, batches_of, builtin_setup
from paritykit.engine.pipeline_accumulation import accumulate_plainly
from paritykit.engine.pipeline_catalog import EVAL, VARIANTS, Variant, accepts, available
from paritykit.engine.pipeline_eval import FlakyBatches, FlakyBatchError, EvalDrive, eval_reference, evaluated_steps
from paritykit.engine.pipeline_hooks import FORWARD, STEP, check_hook_order
from paritykit.engine.pipeline_lifecycle import lifecycle_order
from paritykit.engine.pipeline_runs import RunSpec
from paritykit.engine.pipeline_staged import StagedDrive
from paritykit.errors import ParityError

CONFIG = GateConfig(world_sizes=(2,))


def test_the_catalog_finds_classes_and_options_by_feature():
    from torchrec.distributed.train_pipeline.train_pipelines import EvalPipelineFusedSparseDist, TrainPipelineSparseDist

    # EvalPipelineFusedSparseDist(*args, **kwargs) passes emb_lookup_stream on to its parent.
    assert accepts(EvalPipelineFusedSparseDist, "emb_lookup_stream")
    assert accepts(EvalPipelineFusedSparseDist, "enable_embedding_lookup_prefetch")
    assert not accepts(TrainPipelineSparseDist, "no_such_option")
    assert "has no train_pipelines.NoSuchPipeline" in Variant("NoSuchPipeline").missing()
    assert "takes no no_such_option" in Variant("TrainPipelineSparseDist", (("no_such_option", 1),)).missing()
    assert set(available()) <= set(VARIANTS)
    assert {"lite", "threaded", "hybrid", "eval:sparse_dist", "eval:fused"} <= set(available())
    assert set(available(EVAL)) == {name for name in available() if name.startswith("eval:")}
    assert RunSpec(pipeline="lite").pipeline == "lite"
    with pytest.raises(ValueError, match="unknown pipeline 'nope'"):
        RunSpec(pipeline="nope")


def test_the_variants_case_runs_every_training_variant_this_torchrec_has():
    names = variant_pipelines()
    assert not {"sparse_dist:postproc", "fused:no_postproc"} & set(names)  # they run on the nested model
    assert not set(names) & set(available(EVAL))
    assert {"sparse_dist:stop_with_data", "semi_sync:stash_gradients", "pt2:eager"} <= set(names)


def test_the_flaky_dataloader_and_what_each_failure_leaves_evaluated():
    batches = list("abcd")
    flaky = FlakyBatches(batches, 1, retryable=True)
    assert next(flaky) == "a"
    with pytest.raises(FlakyBatchError) as raised:
        next(flaky)
    assert raised.value.is_retryable is True
    assert list(flaky) == ["c", "d"]
    assert evaluated_steps(4, EvalDrive("eval:sparse_dist", 1, True)) == [0, 2, 3]
    assert evaluated_steps(4, EvalDrive("eval:sparse_dist", 2, False)) == [0, 1]
    assert evaluated_steps(4, EvalDrive("eval:sparse_dist")) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="not an eval pipeline"):
        EvalDrive("lite")


def test_the_lifecycle_trains_the_side_batch_between_the_detached_steps_and_bs_first_half_after_the_last_reset():
    assert lifecycle_order(6, 3, 2) == [0, 1, 3, 2, 4, 5, 4]
    assert lifecycle_order(5, 3, 3) == [0, 1, 2, 3, 4, 4]
    assert lifecycle_order(8, 3, 2) == [0, 1, 3, 2, 4, 5, 6, 7, 4, 5]
    with pytest.raises(ValueError, match="detach_after"):
        lifecycle_order(3, 3, 2)


def test_the_hook_order_rule():
    works = ["a", "b"]
    check_hook_order([FORWARD, "b", "a", STEP, FORWARD, "a", "b", STEP], works, 2)
    for events, steps, message in (
        ([FORWARD, "a", STEP], 1, "expected its forward"),
        ([FORWARD, "a", "b", STEP, FORWARD, "a", "a", STEP], 2, "step 1 ran"),
        ([FORWARD, "a", "b", STEP], 2, "2 steps ran 1 forwards"),
        (["a", FORWARD, "b", STEP], 1, "before any forward"),
    ):
        with pytest.raises(ParityError, match=message):
            check_hook_order(events, works, steps)


class _Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)

    def forward(self, batch):
        x, y = batch
        prediction = self.layer(x).squeeze(-1)
        return ((prediction - y) ** 2).mean(), prediction


def test_plain_accumulation_is_one_step_per_window_of_summed_gradients_by_hand():
    torch.manual_seed(0)
    model, lr = _Linear(), 0.1
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    batches = [(torch.randn(4, 3), torch.randn(4)) for _ in range(3)]
    accumulate_plainly(model, torch.optim.SGD(model.parameters(), lr=lr), batches, num_steps=2)

    by_hand = _Linear()
    by_hand.load_state_dict(start)

    def gradients(batch):
        by_hand.zero_grad()
        by_hand(batch)[0].backward()
        return [p.grad.clone() for p in by_hand.parameters()]

    window = [a + b for a, b in zip(gradients(batches[0]), gradients(batches[1]))]  # both at the start weights
    with torch.no_grad():
        for param, grad in zip(by_hand.parameters(), window):
            param -= lr * grad
    last = gradients(batches[2])  # the short last window
    with torch.no_grad():
        for param, grad in zip(by_hand.parameters(), last):
            param -= lr * grad
    for (name, expected), actual in zip(by_hand.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-7, msg=name)
    # Left inside its last window, the loop steps the full window only: the third batch's gradient is dropped.
    left = _Linear()
    left.load_state_dict(start)
    accumulate_plainly(left, torch.optim.SGD(left.parameters(), lr=lr), batches, num_steps=2, step_last_window=False)
    for (name, value), grad in zip(left.state_dict().items(), window):
        torch.testing.assert_close(value, start[name] - lr * grad, rtol=1e-6, atol=1e-7, msg=name)


def test_the_eval_reference_is_the_unsharded_models_eval_forward_and_trains_nothing():
    spec = ModelSpec(num_tables=2, sharding_types=("table_wise", "row_wise"))
    setup = builtin_setup(spec, batches_of(spec, DataSpec(num_batches=3), 2))
    record = eval_reference(setup, [0, 2])
    model = setup.model_fn()
    model.load_state_dict(setup.full_state)
    model.eval()
    with torch.no_grad():
        expected = [[model(batch)[1] for batch in setup.batches[step]] for step in (0, 2)]
    assert len(record.outputs) == 2 and len(record.outputs[0]) == 2
    assert all(torch.equal(a, b) for step_a, step_b in zip(record.outputs, expected) for a, b in zip(step_a, step_b))
    assert all(torch.equal(record.state[k], setup.full_state[k]) for k in setup.full_state)
    assert set(record.embeddings[0][1]) == {"sparse", "weighted"}


@pytest.mark.world_size(2)
def test_every_surface_case_passes_on_the_installed_torchrec(rank_pool):
    metrics = {name: body(rank_pool, None) for name, body in surface_bodies(CONFIG, 2).items()}
    variants = metrics["dlrm/pipeline-variants"]
    assert set(variant_pipelines()) <= set(variants)
    assert variants["sparse_dist:stop_with_data"]["reference"] == "plain[stopped]"
    assert variants["sparse_dist:stop_with_data"]["steps"] == 6 - 2
    assert variants["lite"]["max_output_diff"] == 0.0
    eval_metrics = metrics["dlrm/eval-pipelines"]
    assert eval_metrics["eval:sparse_dist[retriable failure]"]["steps"] == 5
    assert eval_metrics["eval:sparse_dist[failure]"]["steps"] < 2
    assert set(available(EVAL)) <= set(eval_metrics)
    accumulated = metrics["dlrm/gradient-accumulation"]
    assert {m["steps"] for name, m in accumulated.items() if "warm-up" not in name} == {5}
    assert accumulated["sparse_dist[accumulating, epoch left after 3]"]["steps"] == 3 + 2  # the left epoch's, then the next
    assert [m["steps"] for name, m in accumulated.items() if "warm-up" in name] == [6]  # one epoch of all six
    staged = metrics["dlrm/staged"]
    # Looking batch i+1 up before batch i's backward is semi-synchronous: not exact, but bounded.
    assert staged["staged:lookup_ahead"]["max_output_diff"] > 0.0 and staged["staged"]["steps"] == 6
    assert staged["staged:two_epochs"]["steps"] == 6  # refilled with flush_end() between the epochs
    assert set(metrics["dlrm/lifecycle"]) == {"sparse_dist[lifecycle]", "fused:new[lifecycle]", "base[lifecycle]",
                                              "semi_sync:never_starts[lifecycle]", "hybrid[train-eval-train]"}
    nested = metrics["nested/postproc-and-tracing"]
    assert nested["anchor"]["steps"] == 6 and nested["sparse_dist:postproc"]["max_output_diff"] == 0.0


@pytest.mark.world_size(2)
def test_the_known_broken_comparisons_fail_with_diverged_replicas_and_are_listed(rank_pool):
    setup = dlrm_surface_setup(CONFIG, 2)
    replicas = r"replicated '[\w.]+' on rank 1 differs from rank 0"
    with pytest.raises(ParityError, match=replicas):
        gradient_accumulation(rank_pool, setup, ("sparse_dist",), epochs=(3,), mark_last=False)
    # Told of the last batch, the same wrapper all-reduces that window and matches the plain loop.
    gradient_accumulation(rank_pool, setup, ("sparse_dist",), epochs=(3,), mark_last=True)
    with pytest.raises(ParityError, match=replicas):
        backward_optimizer(rank_pool, setup)
    # A loop that stops at the first None trains only the first epoch's 3 batches.
    with pytest.raises(ParityError, match="staged:two_epochs ran 3 steps but plain.staged. ran 6"):
        staged(rank_pool, setup, DEFAULT_SEMI_SYNC_BOUNDS, (("staged:two_epochs", StagedDrive(epochs=2, refill_between_epochs=False)),))
    # The stopped eval pipeline's thread cannot be joined (its _stop flag shadows Thread._stop).
    with pytest.raises(ParityError, match=r"DataLoadingThread.join\(\) of the stopped pipeline's thread raised TypeError"):
        stopped_eval_joined(rank_pool, setup)
    listed = [issue for issue in load_known_issues() if issue.check == "pipeline"]
    for name in known_broken_bodies(CONFIG, 2):
        assert any(fnmatch.fnmatch(f"ws2/{name}", issue.case) for issue in listed), name
    assert known_broken_bodies(GateConfig(world_sizes=(1,)), 1) == {}


def test_a_reset_that_leaves_contexts_in_flight_is_caught_on_a_stand_in_pipeline():
    # A stand-in with the deques torchrec's pipelines keep; the lifecycle case runs the real ones.
    from collections import deque

    from paritykit.engine.pipeline_lifecycle import checked_reset
    from paritykit.errors import ParityError

    class StandIn:
        def __init__(self, forget: str | None) -> None:
            self.batches, self.contexts, self.forget = deque([1, 2]), deque(["a", "b"]), forget

        def reset(self) -> None:
            for name in ("batches", "contexts"):
                if name != self.forget:
                    getattr(self, name).clear()

    checked_reset(StandIn(None), "sparse_dist")
    with pytest.raises(ParityError, match="reset\\(\\) left 0 batches, 2 contexts in flight"):
        checked_reset(StandIn("contexts"), "sparse_dist")
