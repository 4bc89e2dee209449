"""A shard's floors and ceilings (estimate_rules.py holds the other rules; planning.estimate_problems applies
them): a shard's compute reads at least what its step needs, at the fastest memory bandwidth the topology
gives the device (its ids, 4 bytes each at least, their rows' columns, the vectors it writes, each way),
its storage holds at least its weights, those ids and those vectors, and the input distribution to it
takes at least the other ranks' share of its ids over the fastest link between ranks; and its compute
takes at most CEILING_SLACK times moving every byte its step could touch at the slowest bandwidth the
topology declares (any calibration passes, a time in another unit does not).
"""

from __future__ import annotations

from typing import Any

from paritykit.checks.planner.estimate_rules import LINEAR_TOLERANCE, OUTPUT_BYTES, held_by, option_name

MIN_ID_BYTES = 4  # int32 ids, the narrowest torchrec's kernels take


def fastest_bandwidth(topology: Any, device: str) -> float:
    """The fastest memory bandwidth the topology declares for ``device``'s ranks (bytes per ms)."""
    if device == "cpu":
        return topology.ddr_mem_bw
    return max(topology.hbm_mem_bw, topology.ddr_mem_bw, topology.hbm_to_ddr_mem_bw)


def _samples_served(option: Any, shard: Any, world_size: int) -> float:
    """The samples whose ids reach a shard in a step: every rank's batch (a data-parallel table: its
    own rank's) times the shard's share of their ids (its rows' share, or one row block's: the smaller)."""
    served = 1 if option.sharding_type == "data_parallel" else world_size
    blocks = sum(1 for other in option.shards if other.offset[1] == shard.offset[1])
    return option.batch_size * served * min(shard.size[0] / option.tensor.shape[0], 1 / blocks)


def step_traffic(option: Any, shard: Any, world_size: int) -> tuple[float, float]:
    """(ids, output vectors) of the shard's step: the ids it looks up and the vectors it writes."""
    polls = option.num_poolings or [1.0] * option.num_inputs
    samples = _samples_served(option, shard, world_size)
    ids = samples * sum(length * bags for length, bags in zip(option.input_lengths, polls))
    return ids, (samples * sum(polls) if option.is_pooled else ids)


def compute_floor(option: Any, shard: Any, topology: Any, device: str) -> float:
    """The least time (ms) the shard's step can take to read its ids, their rows' columns and write its
    output vectors at the fastest bandwidth the topology declares."""
    ids, vectors = step_traffic(option, shard, topology.world_size)
    return (ids * MIN_ID_BYTES + (ids + vectors) * shard.size[1] * option.tensor.element_size()) / fastest_bandwidth(topology, device)


def storage_floor(option: Any, shard: Any, world_size: int) -> float:
    """The least bytes a shard holds: its weights, the ids its step receives and the vectors it outputs."""
    ids, vectors = step_traffic(option, shard, world_size)
    rows, columns = shard.size
    element = option.tensor.element_size()
    return rows * columns * element + ids * MIN_ID_BYTES + vectors * columns * element


def input_dist_floor(option: Any, shard: Any, topology: Any) -> float:
    """The least time (ms) the input distribution to a shard takes: the ids the other ranks send it (its
    step's ids but its own rank's share), MIN_ID_BYTES each, at the fastest link between ranks."""
    ids, _ = step_traffic(option, shard, topology.world_size)
    return ids * (topology.world_size - 1) / topology.world_size * MIN_ID_BYTES / max(topology.intra_host_bw, topology.inter_host_bw)


def floor_problems(options: list[Any], device: str, topology: Any) -> list[str]:
    """Shards whose forward or backward compute is less than the bytes its step must move at the
    fastest bandwidth the topology declares, or whose storage is less than its weights and its step's
    ids and output vectors."""
    problems = []
    for option in options:
        for shard in option.shards:
            where = f"{option_name(option, device)}, shard {shard.size} at {shard.offset}"
            ids, vectors = step_traffic(option, shard, topology.world_size)
            least = compute_floor(option, shard, topology, device)
            for component in ("fwd_compute", "bwd_compute"):
                found = getattr(shard.perf, component)
                if found < least * (1 - LINEAR_TOLERANCE):
                    problems.append(f"{where}: {component} {found} ms, less than reading its {ids:g} ids and their rows and "
                                    f"writing {vectors:g} output vectors takes at {fastest_bandwidth(topology, device):g} bytes/ms ({least} ms)")
            if option.sharding_type != "data_parallel" and hasattr(shard.perf, "input_dist_comms"):
                least_sent = input_dist_floor(option, shard, topology)
                if shard.perf.input_dist_comms < least_sent * (1 - LINEAR_TOLERANCE):
                    problems.append(f"{where}: input_dist_comms {shard.perf.input_dist_comms} ms, less than the other ranks' "
                                    f"{ids * (topology.world_size - 1) / topology.world_size:g} ids it receives take at the fastest "
                                    f"bandwidth between ranks the topology declares ({least_sent} ms)")
            held, least_held = held_by(shard), storage_floor(option, shard, topology.world_size)
            if held < least_held:
                problems.append(f"{where}: storage {held} bytes, less than its weights, its step's {ids:g} ids and "
                                f"{vectors:g} output vectors ({least_held:.0f} bytes)")
    return problems


# The most a step's compute may take, over the time to move every byte it could touch at the slowest
# bandwidth the topology declares: three orders of magnitude for any calibration (torchrec's UVM
# kernels run at a tenth of the host link, its block penalties below 2); a time in the wrong unit is
# off by seven.
CEILING_SLACK = 1000
MAX_ID_BYTES, MIN_LOOKUP_COLUMNS = 16, 32  # an int64 id and its float64 weight; kernels read 32 columns at least


def slowest_bandwidth(topology: Any) -> float:
    return min(b for b in (topology.hbm_mem_bw, topology.ddr_mem_bw, topology.hbm_to_ddr_mem_bw, getattr(topology, "ssd_mem_bw", None)) if b)


def compute_ceiling_problems(options: list[Any], device: str, topology: Any) -> list[str]:
    """Shards whose forward or backward compute exceeds CEILING_SLACK times moving every byte its step
    could touch (ids with weights, its rows and output vectors at float32, 32 columns at least) at
    the slowest bandwidth the topology declares."""
    problems = []
    bandwidth = slowest_bandwidth(topology)
    for option in options:
        for shard in option.shards:
            ids, vectors = step_traffic(option, shard, topology.world_size)
            most = CEILING_SLACK * (ids * MAX_ID_BYTES + (ids + vectors) * max(shard.size[1], MIN_LOOKUP_COLUMNS) * OUTPUT_BYTES) / bandwidth
            for component in ("fwd_compute", "bwd_compute"):
                found = getattr(shard.perf, component)
                if found > most:
                    problems.append(f"{option_name(option, device)}, shard {shard.size} at {shard.offset}: {component} {found} ms, more than "
                                    f"{CEILING_SLACK} times moving its step's {ids:g} ids, their rows and {vectors:g} output vectors at the "
                                    f"slowest bandwidth the topology declares, {bandwidth:g} bytes/ms ({most} ms)")
    return problems
