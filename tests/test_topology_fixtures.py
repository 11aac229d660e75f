"""The topology fixtures start real topologies: a 3+3 Redis Cluster joined with plain
``CLUSTER`` commands (:mod:`claimkit.dev.cluster`) and a primary + replica + 3 sentinels
(:mod:`claimkit.dev.sentinel`), and each survives the loss of a primary as a real one does.

Every test talks to the real processes through :func:`claimkit.dev.resp_client.call`
(one connection per call: a ``WAIT`` goes in the same call as the write it waits for).
"""

from __future__ import annotations

import pytest
from cluster import RedisCluster, cluster_available, redis_cluster
from sentinel import sentinel_available, sentinel_group

from claimkit.dev.cluster import SLOTS, RedisClusterProcesses, slot_ranges
from claimkit.dev.resp_client import HOST, call
from claimkit.dev.sentinel import SentinelGroup

__all__ = ["redis_cluster", "sentinel_group"]  # the fixtures, imported for pytest

KEY = "foo"  # slot 12182: the third primary's (10923-16383)
KEY_SLOT = 12182


def test_slot_ranges_split_the_slots_as_redis_cli_does() -> None:
    assert slot_ranges(3) == [(0, 5460), (5461, 10922), (10923, 16383)]
    assert slot_ranges(1) == [(0, SLOTS - 1)]
    assert slot_ranges(7) == [
        (0, 2340),
        (2341, 4680),
        (4681, 7021),
        (7022, 9361),
        (9362, 11702),
        (11703, 14042),
        (14043, 16383),
    ]


def test_the_cluster_has_three_primaries_in_slot_order_each_with_one_replica(
    redis_cluster: RedisCluster,
) -> None:
    nodes = redis_cluster.nodes
    assert len(nodes) == 6
    assert redis_cluster.masters == nodes[:3]
    assert redis_cluster.replicas == nodes[3:]
    assert redis_cluster.urls == [f"redis://{HOST}:{n.port}/0" for n in nodes[:3]]
    assert redis_cluster.addrs == [f"{HOST}:{n.port}" for n in nodes[:3]]
    view = {n.port: n for n in redis_cluster.cluster_nodes()}
    assert [view[n.port].slots for n in nodes[:3]] == [(r,) for r in slot_ranges(3)]
    for i in range(3):
        assert redis_cluster.replicas_of(nodes[i]) == [nodes[3 + i]]
        assert view[nodes[3 + i].port].primary_id == view[nodes[i].port].id
    for i in range(6):
        info = redis_cluster.call(i, "CLUSTER", "INFO")
        assert b"cluster_state:ok" in info
        assert b"cluster_known_nodes:6" in info
        assert b"cluster_size:3" in info
    # Every node its own directory.
    assert len({n.directory for n in nodes}) == 6


def test_a_key_lands_in_its_slots_primary_and_is_replicated(redis_cluster: RedisCluster) -> None:
    nodes = redis_cluster.nodes
    assert redis_cluster.slot_of(KEY) == KEY_SLOT
    owner = redis_cluster.primary_for_slot(KEY_SLOT)
    assert owner is nodes[2]
    assert redis_cluster.primary_for_key(KEY) is nodes[2]
    # The wrong node redirects to the right one, and writes nothing.
    moved = redis_cluster.call(0, "SET", KEY, "x")
    assert str(moved) == f"MOVED {KEY_SLOT} {HOST}:{nodes[2].port}"
    assert call(nodes[2].port, [["SET", KEY, "bar"], ["WAIT", "1", "5000"]], 10) == [b"OK", 1]
    assert redis_cluster.dbsizes() == [0, 0, 1]
    # Its replica has it (READONLY: a replica serves reads of its primary's slots).
    assert call(nodes[5].port, [["READONLY"], ["GET", KEY]], 10) == [b"OK", b"bar"]
    assert redis_cluster.call(5, "DBSIZE") == 1
    assert [redis_cluster.call(i, "DBSIZE") for i in (3, 4)] == [0, 0]
    assert redis_cluster.call(2, "DEL", KEY) == 1


def test_the_first_primarys_slots_include_slot_zero(redis_cluster: RedisCluster) -> None:
    assert redis_cluster.primary_for_slot(0) is redis_cluster.nodes[0]
    assert redis_cluster.primary_for_slot(SLOTS - 1) is redis_cluster.nodes[2]
    with pytest.raises(ValueError, match="slot out of range: 16384"):
        redis_cluster.primary_for_slot(SLOTS)


@pytest.mark.slow
def test_a_killed_cluster_primary_is_replaced_by_its_replica_with_the_data() -> None:
    why = cluster_available()
    if why is not None:
        pytest.skip(f"no Redis Cluster here: {why}")
    with RedisClusterProcesses(masters=3, replicas=1) as cluster:
        nodes = cluster.nodes
        assert call(nodes[2].port, [["SET", KEY, "bar"], ["WAIT", "1", "5000"]], 10) == [b"OK", 1]
        victim = cluster.kill_primary(2)
        assert victim is nodes[2]
        assert not victim.running
        assert cluster.wait_failover() == [nodes[5]]
        assert cluster.masters == [nodes[0], nodes[1], nodes[5]]
        assert cluster.replicas == [nodes[3], nodes[4]]
        assert cluster.primary_for_slot(KEY_SLOT) is nodes[5]
        assert cluster.call(5, "GET", KEY) == b"bar"
        assert str(cluster.call(0, "GET", KEY)) == f"MOVED {KEY_SLOT} {HOST}:{nodes[5].port}"
        for i in (0, 1, 3, 4, 5):
            assert b"cluster_state:ok" in cluster.call(i, "CLUSTER", "INFO")
        (flags,) = [n.flags for n in cluster.cluster_nodes() if n.port == victim.port]
        assert "fail" in flags
        # The old primary comes back as its replacement's replica, with the data.
        cluster.rejoin(victim)
        assert cluster.masters == [nodes[0], nodes[1], nodes[5]]
        assert cluster.replicas == [nodes[2], nodes[3], nodes[4]]
        assert cluster.replicas_of(nodes[5]) == [nodes[2]]
        assert call(nodes[2].port, [["READONLY"], ["GET", KEY]], 10) == [b"OK", b"bar"]
        assert call(nodes[5].port, [["SET", KEY, "baz"], ["WAIT", "1", "5000"]], 10) == [b"OK", 1]
    assert cluster.nodes == []
    assert not nodes[5].running


def test_the_sentinels_watch_the_primary_and_its_replica(sentinel_group: SentinelGroup) -> None:
    group = sentinel_group
    primary = group.primary
    (replica,) = group.replicas
    assert group.master_name == "claimkit"
    assert group.primary_address() == f"{HOST}:{primary.port}"
    assert group.sentinel_addrs == [f"{HOST}:{s.port}" for s in group.sentinels]
    assert len(group.sentinel_addrs) == 3
    assert group.sentinel_url == f"redis://{group.sentinel_addrs[0]}/0"
    for sentinel in group.sentinels:
        (master,) = call(sentinel.port, [["SENTINEL", "MASTER", "claimkit"]], 10)
        assert isinstance(master, list)
        fields = dict(zip(master[::2], master[1::2], strict=True))
        assert fields[b"port"] == str(primary.port).encode()
        assert fields[b"quorum"] == b"2"
        assert fields[b"down-after-milliseconds"] == b"1000"
        assert fields[b"failover-timeout"] == b"3000"
        assert fields[b"num-slaves"] == b"1"
        assert fields[b"num-other-sentinels"] == b"2"
        conf = (sentinel.directory / "sentinel.conf").read_text()
        assert f"sentinel monitor claimkit {HOST} {primary.port} 2" in conf
    (role,) = call(replica.port, [["ROLE"]], 10)
    assert isinstance(role, list)
    assert role[:3] == [b"slave", HOST.encode(), primary.port]


@pytest.mark.slow
def test_the_sentinels_promote_the_replica_with_the_data_written_with_wait() -> None:
    why = sentinel_available()
    if why is not None:
        pytest.skip(f"no Sentinel group here: {why}")
    with SentinelGroup(replicas=1, sentinels=3) as group:
        old = group.primary
        (replica,) = group.replicas
        written = call(old.port, [["SET", "k", "before"], ["WAIT", "1", "5000"]], 10)
        assert written == [b"OK", 1]
        assert group.kill_primary() is old
        assert not old.running
        address = group.wait_promoted(timeout=30)
        assert address == f"{HOST}:{replica.port}"
        assert group.primary is replica
        assert group.replicas == []
        assert group.primary_address() == address
        assert call(replica.port, [["GET", "k"], ["ROLE"]], 10)[0] == b"before"
        (role,) = call(replica.port, [["ROLE"]], 10)
        assert isinstance(role, list)
        assert role[0] == b"master"
        # The old primary comes back as the new one's replica: WAIT 1 is possible again.
        group.rejoin(old)
        assert group.replicas == [old]
        assert group.primary_address() == address
        (old_role,) = call(old.port, [["ROLE"]], 10)
        assert isinstance(old_role, list)
        assert old_role[:3] == [b"slave", HOST.encode(), replica.port]
        for sentinel in group.sentinels:  # one failover, not a second one back to old
            (master,) = call(sentinel.port, [["SENTINEL", "MASTER", "claimkit"]], 10)
            assert isinstance(master, list)
            fields = dict(zip(master[::2], master[1::2], strict=True))
            assert (fields[b"port"], fields[b"config-epoch"]) == (str(replica.port).encode(), b"1")
        assert call(replica.port, [["SET", "k", "after"], ["WAIT", "1", "5000"]], 10) == [b"OK", 1]
        assert call(old.port, [["GET", "k"]], 10) == [b"after"]
        sentinels = list(group.sentinels)
    assert group.servers == []
    assert not any(s.running for s in sentinels)
