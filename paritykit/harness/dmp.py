"""A whole model sharded with torchrec's DistributedModelParallel, and its state moved in and out.

    apply_in_backward(OptimizerSpec("adagrad"), table_parameters(model))   # fused tables, as users do
    sharding_plan = resolve_plan(model, plan, world_size=..., device_type=...)   # in the caller
    dmp = shard_model(model, sharding_plan, device)                  # on every rank
    load_full_state(dmp, full_state)                                 # the unsharded state_dict -> shards
    pieces = state_pieces(dmp)                                       # this rank's part of every tensor
    full = assemble(per_rank_pieces)                                 # (harness.shards) in the caller

DMP keeps the unsharded model's state-dict keys, so the full state of the unsharded model and the
pieces of the sharded one are keyed alike. Run inside a rank with the default process group.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from paritykit.errors import HarnessError, ParityError
from paritykit.harness.plan_resolution import embedding_modules, sharder_of
from paritykit.harness.shards import Piece, detached, local_pieces, scatter


def table_parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    """The embedding tables of every shardable module (what fused optimizers train)."""
    for module in embedding_modules(model).values():
        yield from sharder_of(module).shardable_parameters(module).values()


def shard_model(model: nn.Module, sharding_plan: Any, device: torch.device | str | None = None) -> nn.Module:
    """``model`` wrapped in DistributedModelParallel, inside a rank with the default process group.

    ``sharding_plan`` is a torchrec ShardingPlan or anything ``resolve_plan`` takes (``{table:
    sharding_plan.table_wise(rank=1), ...}``), resolved here for this process group's world size.
    ``device`` defaults to this rank's device (its GPU under nccl, else the CPU).
    """
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import get_default_sharders
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    from paritykit.harness.devices import rank_device
    from paritykit.harness.plan_resolution import resolve_plan

    if not dist.is_initialized():
        raise HarnessError("shard_model must run inside a rank with the default process group initialised")
    if device is None:
        device = rank_device("cuda" if dist.get_backend() == "nccl" else "cpu")
    device = torch.device(device)
    if not isinstance(sharding_plan, ShardingPlan):
        sharding_plan = resolve_plan(model, sharding_plan, world_size=dist.get_world_size(), device_type=device.type)
    return DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=device,
        plan=sharding_plan,
        sharders=get_default_sharders(),
    )


def load_full_state(dmp: nn.Module, full_state: Mapping[str, torch.Tensor]) -> None:
    """Copy the unsharded model's full state into every shard and replica on this rank."""
    state = dmp.state_dict()
    missing = sorted(set(state) - set(full_state))
    if missing:
        raise HarnessError(f"the full state lacks {missing} that the sharded model has")
    scatter(local_pieces(state), full_state, what="state entry")


def gather_full_state(dmp: nn.Module) -> dict[str, torch.Tensor]:
    """Every rank gets the model's full state: tables put back together from the shards of all ranks
    (ParityError when they overlap, leave a gap, or replicas disagree), dense parameters as they are."""
    from paritykit.harness.shards import gather_on_ranks

    return gather_on_ranks(state_pieces(dmp), "the sharded model's state")


def state_pieces(dmp: nn.Module) -> list[Piece]:
    """This rank's pieces of the model's state (tables, shards and replicas, dense parameters)."""
    return detached(local_pieces(dmp.state_dict()))


def fused_optimizer_pieces(dmp: nn.Module) -> list[Piece]:
    """This rank's pieces of the fused optimizer's state, keyed ``<parameter fqn>/<state name>``."""
    fused = getattr(dmp, "fused_optimizer", None)
    if fused is None:
        return []
    flat = {f"{param}/{key}": value for param, entries in fused.state_dict()["state"].items() for key, value in entries.items()}
    return detached(local_pieces({k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}))


def canonical_name(name: str) -> str:
    """A submodule's or parameter's name in the unsharded model: DMP and DDP add wrapper prefixes."""
    parts = [part for part in name.split(".") if part not in ("_dmp_wrapped_module", "module")]
    return ".".join(parts)


def submodules_by_name(dmp: nn.Module, names: list[str]) -> dict[str, nn.Module]:
    """The sharded model's submodules at the unsharded model's ``names``."""
    found = {canonical_name(name): module for name, module in dmp.named_modules()}
    missing = [name for name in names if name not in found]
    if missing:
        raise HarnessError(f"the sharded model has no module at {missing}")
    return {name: found[name] for name in names}


def dense_parameters(dmp: nn.Module, bare: bool = False) -> dict[str, nn.Parameter]:
    """Parameters no fused optimizer trains: dense layers, dense-kernel and data-parallel tables
    (``bare``: as DMP's ``bare_named_parameters`` lists them, without its wrappers' prefixes)."""
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    named = dmp.bare_named_parameters() if bare else dmp.named_parameters()
    return leaf_parameters(in_backward_optimizer_filter(named))


def leaf_parameters(named: Any) -> dict[str, nn.Parameter]:
    """``named`` as a dict, each a tensor an optimizer can train: a leaf, or one that retains its grad
    (torchrec's dense-kernel tables are views of one buffer that do). torch.optim refuses any other,
    and that is the model's defect, reported as such, not paritykit's."""
    params = dict(named)
    derived = [name for name, param in params.items() if not (param.is_leaf or param.retains_grad)]
    if derived:
        raise ParityError(f"the sharded model lists {len(derived)} parameter(s) that are computed from others and do "
                          f"not retain their grad (no optimizer can train them): {derived[:4]}")
    return params
