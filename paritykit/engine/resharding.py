"""DistributedModelParallel.reshard between two steps, as a user calls it: the delta between the current
plan and the new one computed by torchrec's own ``output_sharding_plans_delta``, one call per module.

torchrec tags each shard's point-to-point transfer with Python's ``hash()`` of a tuple that holds the
table's name. A string's hash differs between processes (unless every rank runs with the same
PYTHONHASHSEED), so a sender and its receiver compute different tags; NCCL ignores tags, gloo matches
by them and waits forever (paritykit/checks/known_issues.toml: ``dmp-reshard-p2p-tags``). Where the
ranks' tags disagree, ``agreeing_p2p_tags`` hashes the same tuple with a hash every process shares,
for the transfer only; what is sent, where, and how the state is rebuilt stay torchrec's.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator

from torch import nn

from paritykit.errors import HarnessError
from paritykit.harness.patching import replaced
from paritykit.harness.seeding import stable_seed

# A probe tag: two ranks compute it for the same (source, shard, destination, table).
PROBE_TAG_ARGUMENTS = (0, 0, 0, 1, "paritykit-probe-table", False)


def reshard(dmp: nn.Module, plan: Any) -> None:
    """Move every sharded module of ``dmp`` to its placement in ``plan`` (a resolved ShardingPlan)."""
    from torchrec.distributed.sharding import dynamic_sharding

    delta_of = getattr(dynamic_sharding, "output_sharding_plans_delta", None)
    if delta_of is None or not hasattr(dmp, "reshard"):
        raise HarnessError("this torchrec has no DistributedModelParallel.reshard / output_sharding_plans_delta")
    deltas = {fqn: (volume, delta) for fqn, (volume, delta) in delta_of(dmp.plan.plan, plan.plan, True).items() if len(delta)}
    with agreeing_p2p_tags():
        for fqn in deltas:
            # A model with one sharded module: let DMP find it (its search path); several: name each.
            dmp.reshard(deltas, sharded_module_fqn=fqn if len(dmp.plan.plan) > 1 else None)


def rank_tags() -> int:
    """This rank's tag for the probe transfer (run on every rank; equal everywhere or gloo hangs)."""
    from torchrec.distributed.sharding import dynamic_sharding

    return dynamic_sharding._generate_tag(*PROBE_TAG_ARGUMENTS)


@contextlib.contextmanager
def agreeing_p2p_tags() -> Iterator[None]:
    import torch.distributed as dist
    from torchrec.distributed.sharding import dynamic_sharding

    original = getattr(dynamic_sharding, "_generate_tag", None)
    if original is None:
        yield
        return
    tags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(tags, original(*PROBE_TAG_ARGUMENTS))
    if len(set(tags)) == 1:
        yield
        return
    signature = inspect.signature(original)
    limit = getattr(dynamic_sharding, "MAX_TAG_HASH_VALUE", 0x7FFFFFFF)

    def agreeing(*args: Any, **kwargs: Any) -> int:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return stable_seed(*bound.arguments.values()) & limit

    with replaced(dynamic_sharding, "_generate_tag", lambda _original: agreeing):
        yield
