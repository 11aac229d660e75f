"""The ``wait_replicas`` knob (docs/topology.md#failover): a writing script's call is
followed on its connection by ``WAIT n timeout_ms``; fewer confirmations give one warning
line, and the call counts as done; read-only scripts never wait. On a real primary and its
replica (``--replicaof``), and on a real cluster."""

from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING, Any, cast

import pytest
import trio
from cluster import RedisCluster, redis_cluster
from support import command_calls, wait_until

from claimkit.dev.resp_client import call
from claimkit.store import open_store, script_calls
from claimkit.store.scripts import Script, all_scripts
from claimkit.store.slots import key_slot
from claimkit.store.topology import Topology

if TYPE_CHECKING:
    from conftest import RedisFactory

    from claimkit.dev.redis_server import RedisServer

__all__ = ["redis_cluster"]  # the fixture, imported for pytest


def _script(name: str, source: str, *, writes: bool) -> Script:
    return Script(name, 2, source, hashlib.sha1(source.encode()).hexdigest(), writes)


SET_INCR = _script(
    "set-incr",
    "redis.call('SET', KEYS[1], ARGV[1]); return redis.call('INCR', KEYS[2])",
    writes=True,
)
READ = _script("read-two", "return {redis.call('GET', KEYS[1]), KEYS[2]}", writes=False)


def test_the_read_only_scripts() -> None:
    # Those flagged no-writes (lua/inspect-6.lua,
    # lua/result-inspect-3.lua, lua/queue-stats-7.lua, lua/consumers-3.lua): no WAIT after
    # them.
    assert sorted(s.name for s in all_scripts().values() if not s.writes) == [
        "consumers",
        "inspect",
        "queue-stats",
        "result-inspect",
    ]


@pytest.fixture
def pair(redis_factory: RedisFactory) -> tuple[RedisServer, RedisServer]:
    # Diskless sync at once (by default the primary waits 5 s for more replicas).
    primary = redis_factory(extra_args=["--repl-diskless-sync-delay", "0"])
    replica = redis_factory(extra_args=["--replicaof", "127.0.0.1", str(primary.port)])

    def linked() -> bool:
        info = call(replica.port, [["INFO", "replication"]], 5.0)[0]
        return isinstance(info, bytes) and b"master_link_status:up" in info

    wait_until("the replica linked", linked)
    return primary, replica


def _get(server: RedisServer, key: str) -> Any:
    return call(server.port, [["GET", key]], 5.0)[0]


async def test_writes_wait_for_the_replica_and_reads_do_not(
    pair: tuple[RedisServer, RedisServer],
) -> None:
    """Once a call returns, the replica has its writes: no polling needed."""
    primary, replica = pair
    with trio.fail_after(20):
        async with open_store(primary.url, wait_replicas=1, wait_timeout_ms=5000) as store:
            before = (await command_calls(store)).get("wait", 0)
            assert await store.run(SET_INCR, ["a", "n"], ["1"]) == 1
            assert _get(replica, "a") == b"1"
            assert await store.run_many(SET_INCR, [(["b", "n"], ["2"]), (["c", "n"], ["3"])]) == [
                2,
                3,
            ]
            assert [_get(replica, k) for k in ("b", "c", "n")] == [b"2", b"3", b"3"]
            assert await store.run(READ, ["a", "x"], []) == [b"1", b"x"]
            assert await store.run_many(READ, [(["b", "x"], []), (["c", "y"], [])]) == [
                [b"2", b"x"],
                [b"3", b"y"],
            ]
            # One WAIT per writing call's pipeline, none for the read-only script; the
            # first call also loaded the script (NOSCRIPT, then EVAL): one WAIT after each.
            assert (await command_calls(store)).get("wait", 0) - before == 3


async def test_no_wait_without_the_knob(pair: tuple[RedisServer, RedisServer]) -> None:
    primary, _ = pair
    with trio.fail_after(20):
        async with open_store(primary.url) as store:
            before = (await command_calls(store)).get("wait", 0)
            assert await store.run(SET_INCR, ["a", "n"], ["1"]) == 1
            assert await store.run_many(SET_INCR, [(["b", "n"], ["2"])]) == [2]
            assert (await command_calls(store)).get("wait", 0) == before


def _short_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "replicas within" in r.getMessage()]


async def test_a_write_no_replica_confirms_is_done_with_one_warning(
    pair: tuple[RedisServer, RedisServer], caplog: pytest.LogCaptureFixture
) -> None:
    """The replica is stopped: the script ran on the primary, but WAIT answers 0 of 1
    within the 50 ms allowed. The call counts as done (its reply is returned) and one
    warning line says so; later short calls within 10 s add no line."""
    primary, replica = pair
    replica.kill()
    caplog.set_level(logging.WARNING, logger="claimkit")
    script_calls._short_since.clear()
    with trio.fail_after(20):
        async with open_store(primary.url, wait_replicas=1, wait_timeout_ms=50) as store:
            assert await store.run(SET_INCR, ["a", "n"], ["1"]) == 1
            assert await store.run_many(SET_INCR, [(["b", "n"], ["2"]), (["c", "n"], ["3"])]) == [
                2,
                3,
            ]
            # Read-only calls do not wait, so they still answer at once.
            assert await store.run(READ, ["a", "x"], []) == [b"1", b"x"]
    assert _short_warnings(caplog) == [
        f"claimkit: warning: Redis at {primary.url}: a set-incr call reached 0 of 1 replicas "
        "within 50 ms (wait_replicas); it is done on the primary, but a failover before the "
        "replicas catch up may lose it (docs/topology.md#failover)"
    ]
    assert _get(primary, "n") == b"3"


async def test_the_noscript_fallback_waits_too(pair: tuple[RedisServer, RedisServer]) -> None:
    primary, replica = pair
    with trio.fail_after(20):
        async with open_store(primary.url, wait_replicas=1, wait_timeout_ms=5000) as store:
            assert await store.command("SCRIPT", "FLUSH") == b"OK"
            before = (await command_calls(store)).get("wait", 0)
            assert await store.run_many(SET_INCR, [(["b", "n"], ["2"])]) == [1]
            assert _get(replica, "b") == b"2"
            # One WAIT after the refused EVALSHA, one after the EVAL that ran it.
            assert (await command_calls(store)).get("wait", 0) - before == 2


@pytest.mark.redispy
async def test_the_redispy_backend_waits_too(
    pair: tuple[RedisServer, RedisServer], caplog: pytest.LogCaptureFixture
) -> None:
    primary, replica = pair
    caplog.set_level(logging.WARNING, logger="claimkit")
    with trio.fail_after(20):
        async with open_store(
            primary.url, backend="redispy", wait_replicas=1, wait_timeout_ms=5000
        ) as store:
            assert await store.run(SET_INCR, ["a", "n"], ["1"]) == 1
            assert _get(replica, "a") == b"1"
        replica.kill()
        script_calls._short_since.clear()
        async with open_store(
            primary.url, backend="redispy", wait_replicas=1, wait_timeout_ms=50
        ) as store:
            assert await store.run(SET_INCR, ["a", "n"], ["2"]) == 2
    (warning,) = _short_warnings(caplog)
    assert warning.startswith(f"claimkit: warning: Redis at {primary.url}: a set-incr call ")
    assert "reached 0 of 1 replicas within 50 ms (wait_replicas)" in warning


def _replicas_per_master(cluster: RedisCluster) -> list[int]:
    counts = []
    for i in range(len(cluster.nodes)):
        role = cluster.call(i, "ROLE")
        if role[0] == b"master":
            counts.append(len(role[2]))
    return counts


async def test_on_a_cluster_each_node_waits_for_its_own_replicas(
    redis_cluster: RedisCluster,
) -> None:
    """Calls of three slots, one per primary, in one run_many: a WAIT follows the last call
    of each node, on that node's connection. With a replica per primary every call is
    confirmed; a cluster without replicas confirms none (0 of 1)."""
    addrs = tuple(u.removeprefix("redis://").split("/")[0] for u in redis_cluster.urls[1:])
    calls: list[tuple[list[str], list[Any]]] = [
        ([f"{{{tag}}}:v", f"{{{tag}}}:n"], [tag]) for tag in ("a", "b", "c", "a")
    ]
    assert len({key_slot(keys[0]) for keys, _ in calls}) == 3
    with trio.fail_after(30):
        async with open_store(
            redis_cluster.url,
            topology=Topology("cluster", addrs),
            wait_replicas=1,
            wait_timeout_ms=2000 if min(_replicas_per_master(redis_cluster)) else 50,
        ) as store:
            for key in ("{a}:n", "{b}:n", "{c}:n"):
                await store.command("DEL", key)
            if min(_replicas_per_master(redis_cluster)) >= 1:
                assert await store.run_many(SET_INCR, calls) == [1, 1, 1, 2]
            else:  # no replica confirms: the calls are done all the same (and warned about)
                assert await store.run_many(SET_INCR, calls) == [1, 1, 1, 2]
                assert await store.run(READ, ["{a}:v", "{a}:x"], []) == [b"a", b"{a}:x"]


async def test_a_waiting_producer_returns_once_a_replica_has_the_request(
    pair: tuple[RedisServer, RedisServer], caplog: pytest.LogCaptureFixture
) -> None:
    """``Producer(wait_replicas=1)``: the ZADD is followed by WAIT on its connection, so the
    replica holds the request when ``submit`` returns; with the replica gone the request is
    queued all the same and one warning says a failover could lose it."""
    from claimkit.producer import Producer

    primary, replica = pair
    caplog.set_level(logging.WARNING, logger="claimkit")
    script_calls._short_since.clear()
    with trio.fail_after(20):
        async with open_store(primary.url) as store:
            (now,) = call(primary.port, [["TIME"]], 5.0)
            deadline = int(cast("list[bytes]", now)[0]) + 600
            producer = Producer(store, "q", wait_replicas=1, wait_timeout_ms=5000)
            token = await producer.submit({"id": "r1", "deadline": deadline})
            assert call(replica.port, [["ZCARD", "q"], ["GET", "request-active:r1"]], 5.0) == [
                1,
                token.encode(),
            ]
            assert _short_warnings(caplog) == []
            replica.kill()
            quick = Producer(store, "q", wait_replicas=1, wait_timeout_ms=50)
            await quick.submit({"id": "r2", "deadline": deadline})
    assert call(primary.port, [["ZCARD", "q"]], 5.0) == [2]
    assert _short_warnings(caplog) == [
        f"claimkit: warning: Redis at {primary.url}: a submit call reached 0 of 1 replicas "
        "within 50 ms (wait_replicas); it is done on the primary, but a failover before the "
        "replicas catch up may lose it (docs/topology.md#failover)"
    ]
