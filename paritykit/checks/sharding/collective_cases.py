"""torchrec's pooled collectives on their own, against a hand computation of what they mean: the
reduce-scatters (of a list, of a flat tensor, and of uneven splits: ``reduce_scatter_v``) and the
all-gather, forward and backward, asynchronous and synchronous (``torchrec_use_sync_collectives``),
with gradient division on and off. No sharded model hides them: these are the ones the sharded
modules call only on uneven or NCCL-only paths.

    reduce-scatter:  out[r] = sum over ranks s of chunk r of in[s];   grad in[s] chunk r = up[r] / D
    all-gather:      out = concat over ranks s of in[s];             grad in[s] = sum over r of up[r] chunk s / D
with D the world size while gradient division is on, else 1.

On a pool of four ranks the same collectives also run on torchrec's kind of subgroups: the ranks split
into strided groups ({0, 2} and {1, 3}, a cross-host group of two hosts), each group calling them on its
own process group, where "the world" above is the group (its size, its members in rank order). A
collective that falls back to the default group sees four ranks where it should see two.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from paritykit.compare import format_differences
from paritykit.engine.dmp_options import DmpOptions
from paritykit.engine.tolerances import normwise
from paritykit.errors import HarnessError, ParityError
from paritykit.harness.seeding import generator
from paritykit.harness.subgroups import STRIDED_GROUPS, STRIDED_WORLD_SIZE, group_of, own_group

OPERATIONS = ("reduce_scatter_pooled", "reduce_scatter_base_pooled", "reduce_scatter_v_pooled", "all_gather_base_pooled")
WIDTH = 4


@dataclass(frozen=True)
class CollectiveCase:
    world_size: int
    sync: bool
    division: bool
    # Each rank's process group: () the world, else groups of ranks covering it (dist.new_subgroups_by_enumeration).
    groups: tuple[tuple[int, ...], ...] = ()

    def describe(self) -> str:
        on = f" groups={[list(g) for g in self.groups]}" if self.groups else ""
        return (f"collectives {'/'.join(self.operations())} world_size={self.world_size}{on} "
                f"sync_collectives={self.sync} gradient_division={self.division}")

    def group_of(self, rank: int) -> tuple[int, ...]:
        return group_of(self.groups, rank, self.world_size)

    def case_id(self) -> str:
        return self.describe()

    def operations(self) -> tuple[str, ...]:
        # The asynchronous reduce-scatter-v of uneven splits all-gathers uneven gradients, which gloo refuses
        # (known issue row-wise-family-uneven-batch); the synchronous one uses an all-to-all instead.
        return tuple(op for op in OPERATIONS if self.sync or op != "reduce_scatter_v_pooled")


def collective_cases(world_size: int) -> tuple[CollectiveCase, ...]:
    return tuple(CollectiveCase(world_size, sync, division) for sync in (False, True) for division in (True, False))


def subgroup_collective_cases(world_size: int) -> tuple[CollectiveCase, ...]:
    """The collectives on strided groups of two ranks, on a pool of four (none on another size)."""
    if world_size != STRIDED_WORLD_SIZE:
        return ()
    return tuple(CollectiveCase(world_size, sync, division, STRIDED_GROUPS) for sync in (False, True) for division in (True, False))


def rows_per_rank(world_size: int) -> list[int]:
    """Uneven chunks for reduce_scatter_v: rank r receives r + 1 rows."""
    return [rank + 1 for rank in range(world_size)]


def _input(op: str, rank: int, world_size: int) -> torch.Tensor:
    rows = {"all_gather_base_pooled": 2, "reduce_scatter_v_pooled": sum(rows_per_rank(world_size))}.get(op, 2 * world_size)
    return torch.randn((rows, WIDTH), generator=generator("collective-input", op, rank, world_size))


def _upstream(op: str, rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=generator("collective-upstream", op, rank, shape))


def _call(op: str, tensor: torch.Tensor, pg: Any, group_size: int) -> torch.Tensor:
    """The list reduce-scatter and the flat one straight from comm_ops; the uneven one and the all-gather
    through the dist_data modules that wrap them (PooledEmbeddingsReduceScatter, PooledEmbeddingsAllGather)."""
    from torchrec.distributed import comm_ops, dist_data

    if op == "reduce_scatter_pooled":
        return comm_ops.reduce_scatter_pooled(list(tensor.split(2)), pg).wait()
    if op == "reduce_scatter_v_pooled":
        return dist_data.PooledEmbeddingsReduceScatter(pg)(tensor, rows_per_rank(group_size)).wait()
    if op == "all_gather_base_pooled":
        return dist_data.PooledEmbeddingsAllGather(pg)(tensor).wait()
    return comm_ops.reduce_scatter_base_pooled(tensor, pg).wait()


def run_collectives_on_rank(case: CollectiveCase) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """On every rank: each operation forward and backward; {op: (output, gradient of the input)}."""
    import torch.distributed as dist

    rank = dist.get_rank()
    size = len(case.group_of(rank))
    found = {}
    with own_group(case.groups) as pg, DmpOptions(sync_collectives=case.sync, gradient_division=case.division).on_rank():
        for op in case.operations():
            tensor = _input(op, rank, size).requires_grad_(True)
            output = _call(op, tensor, pg, size)
            output.backward(_upstream(op, rank, tuple(output.shape)))
            found[op] = (output.detach().clone(), tensor.grad.detach().clone())
    return found


def expected_collectives(case: CollectiveCase) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The hand computation: per rank {op: (output, gradient of the input)}, each group on its own."""
    per_rank: list[dict[str, Any]] = [{} for _ in range(case.world_size)]
    for group in dict.fromkeys(case.group_of(rank) for rank in range(case.world_size)):
        for rank, found in zip(group, _expected_in_group(case, group)):
            per_rank[rank] = found
    return per_rank


def _expected_in_group(case: CollectiveCase, group: tuple[int, ...]) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Per member of ``group``, in its order."""
    world, scale = len(group), (1.0 / len(group) if case.division else 1.0)
    per_member: list[dict[str, Any]] = [{} for _ in group]
    for op in case.operations():
        inputs = [_input(op, rank, world) for rank in group]
        if op == "all_gather_base_pooled":
            output = torch.cat(inputs)
            ups = [_upstream(op, rank, tuple(output.shape)) for rank in group]
            total = torch.stack(ups).sum(0)
            for at in range(world):
                per_member[at][op] = (output, total.split(inputs[0].shape[0])[at] * scale)
            continue
        sizes = rows_per_rank(world) if op == "reduce_scatter_v_pooled" else [2] * world
        outputs = [torch.stack([x.split(sizes)[at] for x in inputs]).sum(0) for at in range(world)]
        ups = [_upstream(op, rank, tuple(outputs[at].shape)) for at, rank in enumerate(group)]
        for at in range(world):
            per_member[at][op] = (outputs[at], torch.cat(ups) * scale)
    return per_member


def run_collective_case(case: CollectiveCase, pool: Any) -> dict[str, Any]:
    if pool.world_size != case.world_size:
        raise HarnessError(f"case needs world size {case.world_size}, the pool has {pool.world_size}")
    actual = pool.call(run_collectives_on_rank, (case,), case=case.case_id())
    expected = expected_collectives(case)
    bound = normwise()
    for rank, (got, want) in enumerate(zip(actual, expected)):
        for op, (output, grad) in want.items():
            for what, a, e in (("output", got[op][0], output), ("gradient of the input", got[op][1], grad)):
                found = bound.differences(a, e, f"{op}[rank {rank}] {what}")
                if found:
                    raise ParityError(format_differences(found[:3], exact=False,
                                                         msg=f"{case.describe()}: rank {rank}: torchrec's {op} {what} is not "
                                                             f"what the collective means ({bound.describe()})"))
    return {"steps": 1, "ranks": case.world_size, "operations": len(case.operations()), "plan_shape": "dmp/collectives"}

