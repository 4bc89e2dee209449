"""The references of fbgemm's fused optimizers against fbgemm itself: one table-batched embedding
(TBE) trained directly on the CPU, with the hyper-parameters torchrec would hand it, against the
reference stepping the same table unsharded (every hyper-parameter the strategy draws, every
weight-decay mode the CPU kernel applies). Several TBE tables fed the same ids stand for the column
shards of one table (fbgemm keeps row state per shard), and some rows are never looked up (fbgemm
updates only the rows a batch reads)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paritykit.checks.known_issues import rule_kept_out
from paritykit.compare.bounds import normwise_bound
from paritykit.harness.optimizers import OptimizerSpec, in_backward_arguments, supported_fused_optimizers
from paritykit.harness.optimizers.fbgemm import applied_weight_decay_modes
from paritykit.harness.optimizers.oracle import begin_step, fused_state, reference_optimizer, touch
from paritykit.strategies.optimizers import embedding_optimizer_specs

ROWS = 8
UNREAD = (6, 7)  # never looked up
# fbgemm's state names (get_optimizer_state) -> torchrec's (the first is always momentum1).
TORCHREC_NAMES = {"sum": "momentum1"}


def tbe_for(spec: OptimizerSpec, widths: tuple[int, ...]):
    """fbgemm's TBE configured as torchrec configures it from apply_optimizer_in_backward(cls, kwargs)."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen
    from torchrec.distributed.utils import optimizer_type_to_emb_opt_type

    cls, kwargs = in_backward_arguments(spec)
    optimizer = kwargs.pop("optimizer", None) or optimizer_type_to_emb_opt_type(cls)
    kwargs["learning_rate"] = kwargs.pop("lr")
    specs = [(ROWS, width, EmbeddingLocation.HOST, ComputeDevice.CPU) for width in widths]
    return SplitTableBatchedEmbeddingBagsCodegen(specs, optimizer=optimizer, **kwargs)


def train_both(spec: OptimizerSpec, widths: tuple[int, ...], seed: int, steps: int = 4):
    """(TBE weights, reference weights, TBE states by torchrec name, reference states) after ``steps``."""
    generator = torch.Generator().manual_seed(seed)
    initial = torch.randn(ROWS, sum(widths), generator=generator)
    tbe = tbe_for(spec, widths)
    with torch.no_grad():
        for table, block in zip(tbe.split_embedding_weights(), initial.split(list(widths), dim=1)):
            table.copy_(block)
    param = torch.nn.Parameter(initial.clone())
    reference = reference_optimizer(spec, [param], {id(param): list(widths)})
    readable = torch.tensor([row for row in range(ROWS) if row not in UNREAD])
    for _ in range(steps):
        lengths = torch.randint(0, 4, (3,), generator=generator)
        ids = readable[torch.randint(0, len(readable), (int(lengths.sum()),), generator=generator)]
        upstream = torch.randn(3, sum(widths), generator=generator)
        # The TBE: one feature per table, each reading the same bags.
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.repeat(len(widths)).cumsum(0)])
        (tbe(ids.repeat(len(widths)), offsets) * upstream).sum().backward()
        # The reference: the same bags pooled from the unsharded table.
        begin_step(reference)
        bags = torch.repeat_interleave(torch.arange(3), lengths)
        param.grad = None
        (torch.zeros(3, sum(widths)).index_add(0, bags, param[ids]) * upstream).sum().backward()
        touch(reference, {id(param): torch.unique(ids)})
        reference.step()
    states = {}
    for table_states in tbe.get_optimizer_state():
        for name, value in table_states.items():
            states.setdefault(TORCHREC_NAMES.get(name, name), []).append(value)
    # An element-wise state joins the tables' columns (the unsharded layout); a row-wise one lists
    # the tables one after another (torchrec's layout of a column-cut table's row state).
    flat = {name: torch.cat(values, dim=values[0].dim() - 1) for name, values in states.items() if name != "iter"}
    return torch.cat(tbe.split_embedding_weights(), dim=1), param.detach(), flat, fused_state(reference, param)


def assert_within(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    rtol, max_relative = normwise_bound(torch.float32)
    allowed = rtol * expected.abs() + max_relative * expected.abs().max()
    excess = (actual - expected).abs() - allowed
    assert excess.max() <= 0, f"{what}: {actual} vs {expected}"


@settings(max_examples=40, deadline=None)
@given(embedding_optimizer_specs(), st.lists(st.sampled_from((4, 8, 12)), min_size=1, max_size=3),
       st.integers(0, 2**16))
def test_every_fused_optimizer_reference_steps_like_fbgemms_cpu_kernel(spec, widths, seed):
    got, expected, states, reference_states = train_both(spec, tuple(widths), seed)
    assert_within(got, expected, f"{spec.describe()} weights")
    assert got[list(UNREAD)].equal(expected[list(UNREAD)]), "rows never looked up moved"
    for name, value in states.items():
        assert_within(value, reference_states[name], f"{spec.describe()} state {name}")
    assert set(states) == set(reference_states) - {"iter"}


@pytest.mark.parametrize("spec", [
    OptimizerSpec("rowwise_adagrad", 0.2, eps=1e-3, weight_decay=0.05, weight_decay_mode="counter", counter_halflife=2,
                  counter_weight_decay_mode="decouple"),
    OptimizerSpec("rowwise_adagrad", 0.2, eps=1e-3, weight_decay=0.05, weight_decay_mode="counter", counter_halflife=-1,
                  counter_weight_decay_mode="l2"),
    OptimizerSpec("ema_rowwise_adagrad", 0.2, eps=1e-3, step_ema=2, step_start=1, step_ema_coef=0.4),
    OptimizerSpec("rowwise_rmsprop_ar", 0.2, eps=1e-3, ar_alpha=0.5, ema_beta=0.9, min_shrinkage=0.2),
], ids=lambda spec: spec.name + "/" + str(spec.kwargs.get("counter_weight_decay_mode", "")))
def test_hyper_parameters_the_references_model_move_fbgemms_numbers(spec):
    """Each modelled hyper-parameter matters to fbgemm (so agreeing on it is not vacuous)."""
    if spec.name not in supported_fused_optimizers():
        with pytest.raises(Exception, match="has no cpu kernel"):
            from paritykit.harness.optimizers import require_embedding_optimizer
            require_embedding_optimizer(spec)
        return
    plain = OptimizerSpec("rowwise_adagrad", spec.lr, eps=spec.hyper("eps"))
    with_it, expected, _, _ = train_both(spec, (4, 4), seed=3)
    without, _, _, _ = train_both(plain, (4, 4), seed=3)
    assert not torch.allclose(with_it, without, atol=1e-4)
    assert_within(with_it, expected, spec.describe())


@pytest.mark.parametrize("mode", ["l2", "decouple"])
def test_whether_fbgemms_cpu_kernel_ignores_l2_and_decoupled_weight_decay_is_what_the_known_issues_and_the_probe_say(mode):
    decayed = OptimizerSpec("rowwise_adagrad", 0.2, eps=1e-3, weight_decay=0.1, weight_decay_mode=mode)
    got, reference, _, _ = train_both(decayed, (4,), seed=5)
    plain, _, _, _ = train_both(OptimizerSpec("rowwise_adagrad", 0.2, eps=1e-3), (4,), seed=5)
    ignored = bool(got.equal(plain))
    assert not torch.allclose(reference, plain, atol=1e-4), "the reference applies the weight decay"
    assert ignored == (rule_kept_out("cpu-row-wise-adagrad-weight-decay-ignored") is not None)
    assert ignored == (mode not in applied_weight_decay_modes("cpu"))
