"""The reference optimizer of a fused OptimizerSpec, and its state in torchrec's names.

    optimizer = reference_optimizer(spec, tables, blocks)    # blocks[id(table)]: column-shard widths
    begin_step(optimizer); ...forward...; touch(optimizer, rows); optimizer.step()
    fused_state(optimizer, table)                            # {"momentum1": ..., "prev_iter": ...}
"""

from __future__ import annotations

from typing import Any

import torch

from paritykit.harness.optimizers.references import BlockRowWiseAdagrad, EmaRowWiseAdagrad, FusedRowWiseReference, RowWiseRMSpropAR
from paritykit.harness.optimizers.spec import OptimizerSpec

_ROW_WISE = {"rowwise_adagrad": BlockRowWiseAdagrad, "ema_rowwise_adagrad": EmaRowWiseAdagrad,
             "rowwise_rmsprop_ar": RowWiseRMSpropAR}


def reference_optimizer(spec: OptimizerSpec, params: list[torch.nn.Parameter], blocks: dict[int, list[int]]) -> torch.optim.Optimizer:
    """torch's own optimizer where its rule is fbgemm's (exact SGD, exact Adagrad), else paritykit's."""
    hypers = spec.fused_hypers()
    if spec.name == "sgd":
        return torch.optim.SGD(params, lr=hypers["lr"])
    if spec.name == "adagrad":
        return torch.optim.Adagrad(params, lr=hypers["lr"], eps=hypers["eps"])
    return _ROW_WISE[spec.name](params, blocks, **hypers)


def begin_step(optimizer: Any) -> None:
    """Before a step's forwards: fbgemm's iteration counter (and what it triggers, EMA in place)."""
    if isinstance(optimizer, FusedRowWiseReference):
        optimizer.begin_step()


def touch(optimizer: Any, rows: dict[int, torch.Tensor]) -> None:
    """The rows the step's lookups read, per table (fbgemm updates only those)."""
    if isinstance(optimizer, FusedRowWiseReference):
        optimizer.touch(rows)


def fused_state(optimizer: Any, param: torch.Tensor, shards: int = 1) -> dict[str, torch.Tensor]:
    """The optimizer's state of ``param`` under the names torchrec's fused optimizer gives it. A
    single-value state (fbgemm's ``iter``) is one value per shard of the table in torchrec's layout."""
    if isinstance(optimizer, FusedRowWiseReference):
        return {name: value.repeat(shards) if name != "momentum1" and value.numel() == 1 else value
                for name, value in optimizer.fused_state(param).items()}
    entries = optimizer.state.get(param, {})
    return {"momentum1": entries["sum"].detach().clone()} if "sum" in entries else {}
