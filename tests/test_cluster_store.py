"""The cluster store (``mode: cluster``) against a real Redis Cluster (:mod:`cluster`):
routing by key, pipelines split per node, single-slot transactions, scripts by EVALSHA
with the NOSCRIPT fallback, CROSSSLOT refused with nothing written, the mode mismatch
refusals, and the eviction check on every primary (docs/topology.md)."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import pytest
import trio
from cluster import RedisCluster, redis_cluster

from claimkit.config import ConfigError
from claimkit.store import StoreError, StoreUnavailable, open_store
from claimkit.store.cluster_store import NotACluster
from claimkit.store.scripts import Script
from claimkit.store.server_checks import eviction_policy
from claimkit.store.slots import key_positions, key_slot
from claimkit.store.topology import Topology

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from claimkit.store import Store

__all__ = ["redis_cluster"]  # the fixture, imported for pytest

_SOURCE = "redis.call('SET', KEYS[1], ARGV[1]); return redis.call('INCR', KEYS[2])"
SET_INCR = Script("set-incr", 2, _SOURCE, hashlib.sha1(_SOURCE.encode()).hexdigest())
# Keys of three slots, one per master of a 3-master cluster (0-5460, 5461-10922, rest).
KEYS = {"{a}": key_slot("a"), "{b}": key_slot("b"), "{c}": key_slot("c")}


def masters(cluster: RedisCluster) -> list[int]:
    """The indexes of the cluster's nodes that are primaries (``ROLE`` says master)."""
    return [i for i in range(len(cluster.nodes)) if cluster.call(i, "ROLE")[0] == b"master"]


def holder(cluster: RedisCluster, key: str) -> int:
    """The index of the primary holding ``key``'s slot."""
    slot = key_slot(key)
    for i in masters(cluster):
        if _serves(cluster, i, slot):
            return i
    raise AssertionError(f"no primary serves slot {slot}")


def _serves(cluster: RedisCluster, node: int, slot: int) -> bool:
    mine = cluster.call(node, "CLUSTER", "MYID")
    for start, end, primary, *_ in cluster.call(node, "CLUSTER", "SLOTS"):
        if start <= slot <= end:
            return bool(primary[2] == mine)
    return False


def flush(cluster: RedisCluster) -> None:
    for i in masters(cluster):
        assert cluster.call(i, "FLUSHALL") == b"OK"
        assert cluster.call(i, "SCRIPT", "FLUSH") == b"OK"


def total_keys(cluster: RedisCluster) -> int:
    return sum(int(cluster.call(i, "DBSIZE")) for i in masters(cluster))


def topology(cluster: RedisCluster) -> Topology:
    return Topology(
        "cluster", tuple(u.removeprefix("redis://").split("/")[0] for u in cluster.urls[1:])
    )


@pytest.fixture
async def cstore(redis_cluster: RedisCluster) -> AsyncIterator[Store]:
    flush(redis_cluster)
    async with open_store(redis_cluster.url, topology=topology(redis_cluster)) as store:
        yield store


def test_key_positions_of_the_commands_claimkit_sends() -> None:
    assert key_positions(("EVALSHA", "sha", 2, "k1", "k2", "a")) == [3, 4]
    assert key_positions(("ZADD", "q", 1, "m")) == [1]
    assert key_positions(("TIME",)) == []
    assert key_positions(("WAIT", 1, 100)) == []
    assert key_positions(("DEL", "a", "b")) == [1, 2]
    assert key_positions(("LMOVE", "a", "b", "LEFT", "RIGHT")) == [1, 2]
    assert key_positions(("BLMOVE", "a", "b", "RIGHT", "LEFT", 1)) == [1, 2]
    assert key_positions(("OBJECT", "ENCODING", "k")) == [2]
    assert key_slot("{q}:claimed") == key_slot("q")


async def test_commands_go_to_the_primary_of_their_slot(
    redis_cluster: RedisCluster, cstore: Store
) -> None:
    assert cstore.mode == "cluster"
    with trio.fail_after(20):
        for key in KEYS:
            assert await cstore.command("SET", key, key) == b"OK"
        for key in KEYS:
            assert await cstore.command("GET", key) == key.encode()
    holders = {key: holder(redis_cluster, key) for key in KEYS}
    assert sorted(holders.values()) == sorted(masters(redis_cluster))  # one key per primary
    for key, node in holders.items():
        assert redis_cluster.call(node, "GET", key) == key.encode()


async def test_a_pipeline_is_split_per_node_and_answers_in_order(
    redis_cluster: RedisCluster, cstore: Store
) -> None:
    with trio.fail_after(20):
        replies = await cstore.pipeline(
            [
                ("TIME",),
                ("SET", "{a}", "1"),
                ("SET", "{b}", "2"),
                ("TIME",),
                ("SET", "{c}", "3"),
                ("MGET", "{a}"),
                ("GET", "{b}"),
                ("GET", "{c}"),
                ("TYPE", "{a}"),
            ],
            transaction=False,
        )
    assert [len(replies[0]), replies[1], replies[2], len(replies[3])] == [2, b"OK", b"OK", 2]
    assert replies[4:] == [b"OK", [b"1"], b"2", b"3", b"string"]
    assert total_keys(redis_cluster) == 3


async def test_a_transaction_in_one_slot_runs(redis_cluster: RedisCluster, cstore: Store) -> None:
    with trio.fail_after(20):
        replies = await cstore.pipeline(
            [("SET", "{a}:x", "1"), ("INCR", "a"), ("TIME",), ("MGET", "{a}:x", "a")],
            transaction=True,
        )
    assert replies[:2] == [b"OK", 1]
    assert len(replies[2]) == 2
    assert replies[3] == [b"1", b"1"]
    assert redis_cluster.call(holder(redis_cluster, "a"), "GET", "{a}:x") == b"1"


async def test_a_transaction_across_slots_is_refused_and_sends_nothing(
    redis_cluster: RedisCluster, cstore: Store
) -> None:
    with trio.fail_after(20), pytest.raises(StoreError) as info:
        await cstore.pipeline([("SET", "{a}", "1"), ("SET", "{b}", "2")], transaction=True)
    assert str(info.value) == (
        "CROSSSLOT a transaction's keys must share one hash slot in Redis Cluster, these do "
        f"not: '{{b}}' (slot {KEYS['{b}']}), '{{a}}' (slot {KEYS['{a}']}); nothing was "
        "written (docs/topology.md#cluster-key-layout)"
        if KEYS["{b}"] < KEYS["{a}"]
        else "CROSSSLOT a transaction's keys must share one hash slot in Redis Cluster, these "
        f"do not: '{{a}}' (slot {KEYS['{a}']}), '{{b}}' (slot {KEYS['{b}']}); nothing was "
        "written (docs/topology.md#cluster-key-layout)"
    )
    assert not isinstance(info.value, StoreUnavailable)
    assert total_keys(redis_cluster) == 0


async def test_a_multi_key_command_across_slots_is_crossslot_not_split(
    redis_cluster: RedisCluster, cstore: Store
) -> None:
    with trio.fail_after(20), pytest.raises(StoreError) as info:
        await cstore.command("MSET", "{a}", "1", "{b}", "2")
    assert str(info.value).startswith("CROSSSLOT ")
    assert total_keys(redis_cluster) == 0


async def test_scripts_run_by_evalsha_on_each_slot_with_the_noscript_fallback(
    redis_cluster: RedisCluster, cstore: Store
) -> None:
    """The scripts are flushed first: every node answers NOSCRIPT once, then EVAL loads it;
    the second round is EVALSHA only."""
    calls: list[tuple[list[str], list[Any]]] = [
        ([f"{key}:v", f"{key}:n"], [key]) for key in ("{c}", "{a}", "{b}", "{a}")
    ]
    with trio.fail_after(20):
        assert await cstore.run_many(SET_INCR, calls) == [1, 1, 1, 2]
        assert await cstore.run(SET_INCR, ["{b}:v", "{b}:n"], ["again"]) == 2
        assert await cstore.run_many(SET_INCR, calls[:2]) == [2, 3]
    for key in KEYS:
        node = holder(redis_cluster, key)
        assert redis_cluster.call(node, "SCRIPT", "EXISTS", SET_INCR.sha1) == [1]
    assert redis_cluster.call(holder(redis_cluster, "a"), "GET", "{a}:n") == b"3"
    assert redis_cluster.call(holder(redis_cluster, "b"), "GET", "{b}:v") == b"again"


async def test_a_script_with_keys_of_two_slots_is_crossslot_and_writes_nothing(
    redis_cluster: RedisCluster, cstore: Store
) -> None:
    with trio.fail_after(20):
        with pytest.raises(StoreError) as single:
            await cstore.run(SET_INCR, ["{a}", "{b}"], ["x"])
        with pytest.raises(StoreError) as batch:
            await cstore.run_many(SET_INCR, [(["{a}:1", "{a}:2"], ["x"]), (["{a}", "{c}"], ["y"])])
    for error in (single.value, batch.value):
        assert str(error).startswith("CROSSSLOT ")
        assert not isinstance(error, StoreUnavailable)
    assert total_keys(redis_cluster) == 0


async def test_the_eviction_policy_is_read_on_every_primary(
    redis_cluster: RedisCluster, cstore: Store
) -> None:
    node = masters(redis_cluster)[-1]
    with trio.fail_after(20):
        assert await eviction_policy(cstore) == ("noeviction", "")
        assert (
            redis_cluster.call(node, "CONFIG", "SET", "maxmemory-policy", "volatile-lru") == b"OK"
        )
        try:
            assert await eviction_policy(cstore) == ("volatile-lru", "")
            other = masters(redis_cluster)[0]
            assert (
                redis_cluster.call(other, "CONFIG", "SET", "maxmemory-policy", "allkeys-lru")
                == b"OK"
            )
            try:
                assert await eviction_policy(cstore) == ("allkeys-lru", "")
            finally:
                redis_cluster.call(other, "CONFIG", "SET", "maxmemory-policy", "noeviction")
        finally:
            redis_cluster.call(node, "CONFIG", "SET", "maxmemory-policy", "noeviction")


async def test_cluster_mode_refuses_a_standalone_server_and_sends_nothing(redis_url: str) -> None:
    with trio.fail_after(20):
        async with open_store(redis_url, topology=Topology("cluster")) as store:
            with pytest.raises(NotACluster) as info:
                await store.command("SET", "k", "v")
            with pytest.raises(NotACluster):
                await store.run(SET_INCR, ["{a}", "{a}:2"], ["x"])
    assert str(info.value) == (
        f"Redis at {redis_url} is not a Redis Cluster node (it answered This instance has "
        'cluster support disabled): set "mode": "standalone" in the transport config, or '
        "point url at a cluster node (docs/topology.md#configuration)"
    )


async def test_an_unreachable_cluster_is_unavailable_not_an_error_at_open(
    closed_port: int,
) -> None:
    with trio.fail_after(20):
        url = f"redis://127.0.0.1:{closed_port}/0"
        async with open_store(url, topology=Topology("cluster"), timeout=2) as store:
            with pytest.raises(StoreUnavailable) as info:
                await store.command("GET", "k")
    assert str(info.value).startswith(f"Redis Cluster at {url} cannot be reached: ")


@pytest.fixture
def closed_port() -> int:
    from support import closed_port as pick

    return pick()


async def test_the_redispy_backend_refuses_cluster_and_sentinel_in_one_line(
    redis_url: str,
) -> None:
    for topology in (Topology("cluster"), Topology("sentinel", master_name="m")):
        with pytest.raises(ConfigError) as info:
            async with open_store(redis_url, backend="redispy", topology=topology):
                raise AssertionError("opened")
        assert str(info.value) == (
            f'mode "{topology.mode}" needs the coredis store backend: the redispy backend '
            "serves a standalone Redis only (docs/store-backends.md)"
        )


async def test_open_store_checks_the_topology_before_connecting() -> None:
    with pytest.raises(ConfigError) as info:
        async with open_store("redis://127.0.0.1:1/3", topology=Topology("cluster")):
            raise AssertionError("opened")
    assert str(info.value) == (
        'mode "cluster" does not support selecting database 3; use database 0 in url'
    )


def test_a_crossslot_reply_is_a_store_error_with_its_text() -> None:
    import coredis.exceptions as cx

    from claimkit.store.coredis_store import _translate

    reply = cx.ClusterCrossSlotError("Keys in request don't hash to the same slot")
    for cluster in (True, False):
        error = _translate(reply, cluster=cluster)
        assert type(error) is StoreError
        assert str(error) == "CROSSSLOT Keys in request don't hash to the same slot"
    down = _translate(cx.ClusterDownError("The cluster is down"), cluster=True)
    assert type(down) is StoreUnavailable
    assert str(down) == "CLUSTERDOWN The cluster is down"


async def test_the_store_follows_a_cluster_failover() -> None:
    """A primary dies and its replica takes its slots over: the store re-reads the cluster's
    map after the first failed calls, and the key written before (confirmed by a replica)
    is read from the promoted replica; a consumer does not stay stuck on the dead node."""
    from claimkit.dev.cluster import RedisClusterProcesses

    with RedisClusterProcesses(masters=3, replicas=1) as cluster:
        async with open_store(cluster.urls[0], topology=Topology(mode="cluster")) as store:
            assert await store.command("SET", "failover-key", "before") == b"OK"
            victim = cluster.primary_for_key("failover-key")
            (replica,) = cluster.replicas_of(victim)
            assert await store.pipeline(
                [["SET", "failover-key", "before"], ["WAIT", 1, 5000]], transaction=False
            ) == [b"OK", 1]
            cluster.kill_primary(cluster.masters.index(victim))
            await trio.to_thread.run_sync(cluster.wait_failover, 30.0)
            answers: list[object] = []
            with trio.move_on_after(30):
                while True:
                    try:
                        answers.append(await store.command("GET", "failover-key"))
                        break
                    except StoreUnavailable as exc:
                        answers.append(type(exc).__name__)
                        await trio.sleep(0.1)
            assert answers[-1] == b"before", answers
            assert cluster.primary_for_key("failover-key").port == replica.port
