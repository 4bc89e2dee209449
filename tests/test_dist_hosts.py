"""A RankPool standing for several hosts: what each rank is told, what torchrec makes of it, how pools
are keyed, and the layouts refused before any rank starts. (The same topology under a real torchrun
launch of two launchers: tests/test_dist_launcher.py.)"""

from __future__ import annotations

import pytest

from host_topology import torchrec_topology
from paritykit.dist import PoolProvider, RankPool
from paritykit.dist import pool as pool_module
from paritykit.errors import HarnessError
from paritykit.harness.hosts import HostLayout, gpus_by_host, host_layout


def expected_topology(hosts: int, ranks_per_host: int) -> list[dict]:
    """What torchrun documents for a launch of ``hosts`` launchers x ``ranks_per_host`` workers, written
    out by hand: global rank = node rank x ranks per host + local rank; torchrec's intra-host group is
    the node's ranks, its cross-host group the ranks with the same local rank."""
    world = hosts * ranks_per_host
    out = []
    for node in range(hosts):
        for local in range(ranks_per_host):
            rank = node * ranks_per_host + local
            out.append({
                "rank": rank,
                "environment": {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
                                "LOCAL_WORLD_SIZE": str(ranks_per_host), "GROUP_RANK": str(node), "GROUP_WORLD_SIZE": str(hosts),
                                "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world), "ROLE_NAME": "default"},
                "local_size": ranks_per_host, "local_rank": local, "group_rank": node, "num_groups": hosts,
                "intra_group": [node * ranks_per_host + r for r in range(ranks_per_host)],
                "cross_group": [n * ranks_per_host + local for n in range(hosts)],
                "paritykit_ranks_per_host": ranks_per_host,
                "launched_by_torchrun": False,
            })
    return out


def test_a_layout_gives_each_rank_what_torchrun_would():
    layout = HostLayout(2, 3)
    assert layout.world_size == 6 and str(layout) == "2x3" and HostLayout.parse("2x3") == layout
    assert [layout.host_of(r) for r in range(6)] == [0, 0, 0, 1, 1, 1]
    assert layout.ranks_of_host(1) == (3, 4, 5)
    assert layout.torchrun_environment(4) == expected_topology(2, 3)[4]["environment"]


@pytest.mark.parametrize("world_size, ranks_per_host", [(4, 3), (6, 4), (4, 0), (4, -2)])
def test_ranks_per_host_that_do_not_divide_the_world_are_refused_before_any_rank_starts(monkeypatch, world_size, ranks_per_host):
    def no_ranks(*args, **kwargs):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(pool_module, "start_ranks", no_ranks)
    with pytest.raises(HarnessError, match=f"ranks_per_host.*{ranks_per_host}"):
        RankPool(world_size, device="cpu", ranks_per_host=ranks_per_host)


def test_host_layout_text_and_defaults():
    assert host_layout(4) == HostLayout(1, 4)
    assert host_layout(4, 2) == HostLayout(2, 2)
    with pytest.raises(HarnessError, match="does not divide world size 6.*divisors of 6: \\[1, 2, 3, 6\\]"):
        host_layout(6, 4)
    for bad in ("2", "2x", "x2", "2*2", "0x2"):
        with pytest.raises(HarnessError):
            HostLayout.parse(bad)


def test_each_host_sees_its_own_gpus_on_cuda():
    assert gpus_by_host(HostLayout(2, 2), None, 4) == ["0,1", "2,3"]
    assert gpus_by_host(HostLayout(2, 1), "5,7,9", 8) == ["5", "7"]  # a slice of what the owner sees
    with pytest.raises(HarnessError, match="needs 4 GPUs"):
        gpus_by_host(HostLayout(2, 2), "0,1,2", 8)


@pytest.mark.world_size(4, ranks_per_host=2)
def test_a_pool_of_two_hosts_gives_torchrec_the_process_groups_of_a_two_host_launch(rank_pool):
    assert rank_pool.ranks_per_host == 2 and rank_pool.hosts == HostLayout(2, 2)
    assert "ranks_per_host=2" in repr(rank_pool)
    assert rank_pool.run(torchrec_topology) == expected_topology(2, 2)


@pytest.mark.world_size(2)
def test_a_one_host_pool_still_tells_torchrec_one_host(rank_pool):
    assert rank_pool.run(torchrec_topology) == expected_topology(1, 2)


def test_pools_are_keyed_by_world_size_and_ranks_per_host():
    with PoolProvider(device="cpu") as pools:
        one_host, two_hosts = pools.get(2), pools.get(2, ranks_per_host=1)
        assert one_host is not two_hosts and pools.get(2, ranks_per_host=2) is one_host
        assert pools.get(2, ranks_per_host=1) is two_hosts
        assert (one_host.ranks_per_host, two_hosts.ranks_per_host) == (2, 1)
        assert [r["cross_group"] for r in two_hosts.run(torchrec_topology)] == [[0, 1], [0, 1]]
