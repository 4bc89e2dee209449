"""The unsharded oracle of a sharded td-kjt case: the same tables and weights, unsharded, fed each
rank's batch (expanded to the output's rows when the batch size varies per feature), and the
tables after one SGD step on every rank's batch with torchrec's gradient semantics.

The loss of rank r is sum over output keys of <output, upstream_gradient(case, step, r, key)>, so
every output element reaches the gradients with its own weight.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paritykit.checks.td_kjt.batches import oracle_kjt, route_input
from paritykit.checks.td_kjt.sharded_spec import ROUTE_KJT, ShardedCase
from paritykit.checks.td_kjt.tolerances import gradient_scale
from paritykit.errors import HarnessError, ParityError
from paritykit.harness.seeding import generator
from paritykit.harness.sharded import gradient_division
from paritykit.harness.tables import (
    build_ebc,
    build_ec,
    table_of_key,
    unsharded_full_weights,
)


def build_unsharded(case: ShardedCase, seed: int, device: torch.device) -> nn.Module:
    if case.module == "ec":
        return build_ec(case.tables, seed=seed, need_indices=case.need_indices, device=str(device))
    return build_ebc(case.tables, seed=seed, is_weighted=case.weighted, device=str(device))


def outputs_by_key(module_kind: str, output: Any) -> dict[str, Any]:
    """{key: pooled tensor} for an EBC's KeyedTensor, {key: JaggedTensor} for an EC: the sharded
    KeyedTensor orders its keys by sharding, so outputs are compared key by key."""
    if hasattr(output, "wait") and not isinstance(output, (dict, torch.Tensor)):
        output = output.wait()
    if module_kind == "ec":
        return dict(output)
    return {key: output[key] for key in output.keys()}


def upstream_gradient(case: ShardedCase, step: int, rank: int, key: str, like: torch.Tensor) -> torch.Tensor:
    """A fixed gradient in [-1, 1) for every element of output ``key`` (tolerances.UPSTREAM_BOUND)."""
    values = torch.rand(like.shape, generator=generator("td-kjt upstream", case.seed, step, rank, key)) * 2 - 1
    return values.to(device=like.device, dtype=like.dtype)


def loss_of(case: ShardedCase, step: int, rank: int, outputs: dict[str, Any]) -> torch.Tensor:
    total = None
    for key in sorted(outputs):
        values = outputs[key].values() if case.module == "ec" else outputs[key]
        term = (values * upstream_gradient(case, step, rank, key, values)).sum()
        total = term if total is None else total + term
    if total is None:
        raise HarnessError(f"{case.module} produced no output keys: nothing to take a loss of")
    return total


def _expect_unsharded_vbe_expands(case: ShardedCase, step: int, rank: int, module: nn.Module, rank_batch: Any,
                                  expanded: dict[str, Any], device: torch.device) -> None:
    """The unsharded EBC fed the variable batch itself (with its inverse indices) must give the
    outputs of the batch expanded by hand: the oracle above takes the expanded one, so torchrec's
    own expansion (``process_pooled_embeddings``) is held to it here."""
    if case.module != "ebc" or rank_batch.inverse is None:
        return
    with torch.no_grad():
        outputs = outputs_by_key("ebc", module(route_input(rank_batch, ROUTE_KJT, case.form, device)))
    for key, want in expanded.items():
        got = outputs.get(key)
        if got is not None and got.shape == want.shape and torch.equal(got, want.detach()):
            continue
        found = "no such output" if got is None else f"shape {tuple(got.shape)}"
        if got is not None and got.shape == want.shape:
            found += f", max abs diff {(got - want).abs().max():.3g}"
        raise ParityError(f"td-kjt step {step} rank {rank}: the unsharded EBC fed the variable batch with its inverse indices "
                          f"gives output[{key!r}] ({found}) unlike the {tuple(want.shape)} rows of the same batch expanded by hand")


def reference_step(
    case: ShardedCase, step: int, rank: int, device: torch.device, learning_rate: float
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(this rank's unsharded outputs, every table after one SGD step on every rank's batch)."""
    module = build_unsharded(case, case.seed, device)
    total = None
    mine: dict[str, Any] = {}
    for r, rank_batch in enumerate(case.steps[step]):
        outputs = outputs_by_key(case.module, module(oracle_kjt(rank_batch, device)))
        loss = loss_of(case, step, r, outputs)
        total = loss if total is None else total + loss
        if r == rank:
            mine = outputs
            _expect_unsharded_vbe_expands(case, step, rank, module, rank_batch, outputs, device)
    if not case.train:
        return mine, {}
    total.backward()
    division = gradient_division()
    stepped = {}
    with torch.no_grad():
        for name, param in module.named_parameters():
            table = table_of_key(name)
            if table is None:
                continue
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            stepped[table] = param.detach() - learning_rate * gradient_scale(case, table, division) * grad
    full = unsharded_full_weights(module)
    return mine, {table: stepped.get(table, full[table]) for table in full}
