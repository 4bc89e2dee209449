"""What one rank's torchrec sees of the hosts: run on the ranks of a RankPool and of a torchrun launch alike.

Module level (not a test module) so that pool ranks can import it and torchrun scripts can put this
folder on their path.
"""

from __future__ import annotations

import os

from paritykit.harness.hosts import TORCHRUN_TOPOLOGY_VARIABLES


def torchrec_topology() -> dict:
    """The launcher's variables, torchrec's comm helpers, the ranks of the intra- and cross-host process
    groups torchrec builds for TWRW/GRID, and the hosts paritykit resolves plans for, on this rank."""
    import torch
    import torch.distributed as dist
    from torchrec.distributed import comm

    from paritykit.dist import launched_by_torchrun
    from paritykit.harness.plans import local_world_size

    intra, cross = comm.intra_and_cross_node_pg(torch.device("cpu"), backend=dist.get_backend())
    return {
        "rank": dist.get_rank(),
        "environment": {name: os.environ.get(name) for name in TORCHRUN_TOPOLOGY_VARIABLES},
        "local_size": comm.get_local_size(),
        "local_rank": comm.get_local_rank(),
        "group_rank": comm.get_group_rank(),
        "num_groups": comm.get_num_groups(),
        "intra_group": dist.get_process_group_ranks(intra),
        "cross_group": dist.get_process_group_ranks(cross),
        "paritykit_ranks_per_host": local_world_size(dist.get_world_size()),
        "launched_by_torchrun": launched_by_torchrun(),
    }
