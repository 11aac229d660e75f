"""Pause and resume on a real Redis Cluster (:mod:`cluster`, docs/protocol.md#pause,
docs/topology.md#cluster-key-layout): the key is ``{q}:paused`` in the queue's slot, the
commands and ``inspect`` print what they do standalone, the poller's peek pipeline reads it
on one node, and no node refuses anything (CROSSSLOT)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pytest
import trio
from cluster import RedisCluster, redis_cluster
from support import invoke, member

from claimkit.cli.console import format_time
from claimkit.protocol.keys import QueueKeys, key_slot
from claimkit.protocol.ops import QueueOps
from claimkit.protocol.pause import PauseMark, parse_pause
from claimkit.store import open_store
from claimkit.store.topology import Topology

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterator

    from claimkit.store import Store

__all__ = ["redis_cluster"]  # the fixture, imported for pytest

pytestmark = pytest.mark.slow

LAYOUTS = ["q", "{t}:q"]


def topology(cluster: RedisCluster) -> Topology:
    return Topology(
        "cluster", tuple(u.removeprefix("redis://").split("/")[0] for u in cluster.urls)
    )


def on_cluster(cluster: RedisCluster, fn: Callable[[Store], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        with trio.fail_after(30):
            async with open_store(cluster.url, topology=topology(cluster)) as store:
                return await fn(store)

    return trio.run(main)


def masters(cluster: RedisCluster) -> list[int]:
    return [i for i in range(len(cluster.nodes)) if cluster.call(i, "ROLE")[0] == b"master"]


def node_of(cluster: RedisCluster, key: str) -> int:
    """The index in ``cluster.nodes`` of the primary serving ``key``'s slot."""
    return cluster.nodes.index(cluster.primary_for_slot(key_slot(key)))


def errors(cluster: RedisCluster) -> list[str]:
    out = []
    for node in range(len(cluster.nodes)):
        info = cluster.call(node, "INFO", "errorstats").decode()
        out += [
            line
            for line in info.splitlines()
            if line.startswith("errorstat_") and not line.startswith("errorstat_NOSCRIPT:")
        ]
    return out


@pytest.fixture(autouse=True)
def clean(redis_cluster: RedisCluster) -> Iterator[None]:
    for node in masters(redis_cluster):
        redis_cluster.call(node, "FLUSHALL")
    for node in range(len(redis_cluster.nodes)):
        redis_cluster.call(node, "CONFIG", "RESETSTAT")
    yield
    assert errors(redis_cluster) == []


def transport(cluster: RedisCluster, queue: str) -> str:
    return json.dumps(
        {
            "url": cluster.url,
            "mode": "cluster",
            "addrs": list(topology(cluster).addrs),
            "queues": [{"queue_name": queue, "igw_base_url": "http://127.0.0.1:9"}],
        }
    )


@pytest.mark.parametrize("queue", LAYOUTS)
def test_pause_inspect_resume_on_a_cluster(redis_cluster: RedisCluster, queue: str) -> None:
    keys = QueueKeys.for_queue(queue, cluster=True)
    assert keys.paused == ("{q}:paused" if queue == "q" else "{t}:q:paused")
    assert key_slot(keys.paused) == key_slot(queue)
    conf = ["--transport-config", transport(redis_cluster, queue)]
    raw_member = member("p1", 2_000_000_000)
    on_cluster(redis_cluster, lambda s: s.command("ZADD", queue, 2_000_000_000, raw_member))

    paused = invoke(["pause", "-q", queue, "--reason", "redis move", *conf])
    node = node_of(redis_cluster, keys.paused)
    assert node == node_of(redis_cluster, queue), "the pause key lives with the queue"
    raw = redis_cluster.call(node, "GET", keys.paused)
    mark = parse_pause(raw)
    assert mark is not None
    assert mark.since is not None
    assert raw == PauseMark(since=mark.since, reason="redis move").encode()
    since = format_time(mark.since)
    assert (paused.exit_code, paused.stdout, paused.stderr) == (
        0,
        f"claimkit pause {queue}: paused since {since} (redis move)\n",
        "",
    )
    again = invoke(["pause", "-q", queue, *conf])
    assert again.stdout == (
        f"claimkit pause {queue}: already paused since {since} (redis move); nothing changed\n"
    )

    shown = invoke(["inspect", "-q", queue, *conf])
    assert shown.exit_code == 0, shown.output
    assert shown.stdout.splitlines()[1] == f"paused since {since} (redis move)"
    doc = json.loads(invoke(["inspect", "-q", queue, "--json", *conf]).stdout)
    assert doc["paused"] == {"since": mark.since, "reason": "redis move", "until": None}
    assert doc["counts"]["pending"] == 1

    async def peek(store: Store) -> tuple[PauseMark | None, list[bytes]]:
        return await QueueOps(store, queue).peek_unless_paused(10)

    assert on_cluster(redis_cluster, peek) == (mark, [])

    resumed = invoke(["resume", "-q", queue, *conf])
    assert (resumed.exit_code, resumed.stdout) == (
        0,
        f"claimkit resume {queue}: resumed; it was paused since {since} (redis move)\n",
    )
    assert redis_cluster.call(node, "EXISTS", keys.paused) == 0
    assert on_cluster(redis_cluster, peek) == (None, [raw_member])
    assert invoke(["resume", "-q", queue, *conf]).stdout == (
        f"claimkit resume {queue}: not paused; nothing changed\n"
    )
    assert "paused" not in invoke(["inspect", "-q", queue, *conf]).stdout
