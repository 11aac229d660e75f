"""The queue-wide figures (``lua/queue-stats-7.lua``, docs/metrics.md#queue-wide-gauges) on a
prepared queue, standalone and on a real Redis Cluster, and the exporter election
(docs/metrics.md#one-exporter-per-queue) through the consumer's own sampler."""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

import pytest
import trio
from cluster import RedisCluster, redis_cluster
from support import config_doc

from claimkit.config import load_config
from claimkit.consumer.consumer import Consumer
from claimkit.consumer.upkeep import Upkeep
from claimkit.protocol.keys import QueueKeys, key_slot
from claimkit.protocol.stats import QueueStats, is_exporter, read_queue_stats
from claimkit.store import open_store
from claimkit.store.topology import Topology

if TYPE_CHECKING:
    from claimkit.consumer.metrics import Metrics
    from claimkit.store import Arg, Store

__all__ = ["redis_cluster"]  # the fixture, imported for pytest

D = 4102444800  # 2100-01-01


def member(rid: str, deadline: int, created: Any = None) -> bytes:
    data: dict[str, Any] = {"id": rid, "deadline": deadline}
    if created is not None:
        data["created"] = created
    doc = {"internal": {}, "request_kind": "plain", "data": data}
    return json.dumps(doc, separators=(",", ":")).encode()


async def server_time(store: Store) -> int:
    sec, _usec = await store.command("TIME")
    return int(sec)


async def prepare(store: Store, keys: QueueKeys) -> int:
    """A queue with 4 pending (3 sampled ones carry data.created), 3 claims (2 expired),
    2 dead, 4 in the retry set, 1 in its dead set, 3 registered consumers (2 alive).
    Returns the server time ``t`` (whole seconds) the scores were set from."""
    t = await server_time(store)
    seed: list[list[Arg]] = [
        ["ZADD", keys.pending, D + 10, member("p1", D + 10, t - 100)],
        ["ZADD", keys.pending, D + 20, member("p2", D + 20, t - 300)],  # the oldest
        ["ZADD", keys.pending, D + 5, member("p0", D + 5)],  # no data.created: skipped
        ["ZADD", keys.pending, D + 30, member("p3", D + 30, "not a number")],
        ["ZADD", keys.index, t - 20, "x", t - 5, "y", t + 600, "z"],
        ["HSET", keys.owners, "x", "tx", "y", "ty", "z", "tz"],
        ["HSET", keys.claimed, "x", member("x", D), "y", member("y", D), "z", member("z", D)],
        ["ZADD", keys.dead, t, b"dead-1", t, b"dead-2"],
        ["ZADD", keys.retry_set, t, b"r1", t, b"r2", t, b"r3", t, b"r4"],
        ["ZADD", keys.retry_dead, t, b"rd1"],
        ["ZADD", keys.consumers, t + 60, "c-b", t + 60, "c-a", t - 1, "c-0"],
    ]
    for command in seed:
        await store.command(*command)
    return t


def check(stats: QueueStats, t: int) -> None:
    now = stats.server_now
    assert t <= now < t + 30
    assert (stats.pending, stats.claimed, stats.expired) == (4, 3, 2)
    assert stats.oldest_pending_age == now - (t - 300)
    assert stats.pending_deadline_headroom == (D + 5) - now
    assert stats.lease_headroom == (t - 20) - now
    assert (stats.retry_set, stats.retry_dead, stats.dead) == (4, 1, 2)
    assert stats.consumers_alive == 2
    assert stats.exporter == "c-a"


async def test_queue_stats_standalone(store: Store) -> None:
    keys = QueueKeys.for_queue("q")
    t = await prepare(store, keys)
    with trio.fail_after(10):
        check(await read_queue_stats(store, keys), t)


async def test_queue_stats_of_an_empty_queue(store: Store) -> None:
    stats = await read_queue_stats(store, QueueKeys.for_queue("q"))
    assert (stats.pending, stats.claimed, stats.expired, stats.dead) == (0, 0, 0, 0)
    assert (stats.retry_set, stats.retry_dead, stats.consumers_alive) == (0, 0, 0)
    assert stats.oldest_pending_age == 0.0
    assert math.isnan(stats.pending_deadline_headroom)
    assert math.isnan(stats.lease_headroom)
    assert stats.exporter is None


async def test_oldest_age_is_nan_when_no_sampled_member_has_created(store: Store) -> None:
    keys = QueueKeys.for_queue("q")
    await store.command("ZADD", keys.pending, D, member("a", D), D + 1, b"not json at all")
    stats = await read_queue_stats(store, keys)
    assert stats.pending == 2
    assert math.isnan(stats.oldest_pending_age)
    # Only the lowest-scored members are read: one created beyond the sample is not seen.
    await store.command("ZADD", keys.pending, D + 2, member("late", D + 2, 1))
    assert math.isnan((await read_queue_stats(store, keys, sample=2)).oldest_pending_age)
    late = await read_queue_stats(store, keys, sample=3)
    assert late.oldest_pending_age == late.server_now - 1


async def test_a_bad_sample_is_refused_before_anything_is_sent(store: Store) -> None:
    with pytest.raises(ValueError, match="sample must be at least 1, got 0"):
        await read_queue_stats(store, QueueKeys.for_queue("q"), sample=0)


def test_the_exporter_rule() -> None:
    assert is_exporter("c-a", "c-a")
    assert not is_exporter("c-a", "c-b")
    assert is_exporter(None, "c-b")  # nobody alive: every process publishes
    assert is_exporter("c-a", None)  # no consumer id: this process publishes


# -- the cluster layout ---------------------------------------------------------------------


def topology(cluster: RedisCluster) -> Topology:
    return Topology(
        "cluster", tuple(u.removeprefix("redis://").split("/")[0] for u in cluster.urls)
    )


@pytest.mark.slow
@pytest.mark.parametrize("queue", ["q", "{t}:q"])
def test_queue_stats_on_a_cluster(redis_cluster: RedisCluster, queue: str) -> None:
    keys = QueueKeys.for_queue(queue, cluster=True)
    assert {key_slot(k) for k in (keys.consumers, keys.retry_set, keys.retry_dead)} == {
        key_slot(queue)
    }
    for node in range(3):
        redis_cluster.call(node, "FLUSHALL")
        redis_cluster.call(node, "CONFIG", "RESETSTAT")

    async def main() -> None:
        with trio.fail_after(30):
            async with open_store(redis_cluster.url, topology=topology(redis_cluster)) as store:
                t = await prepare(store, keys)
                check(await read_queue_stats(store, keys), t)

    trio.run(main)
    for node in range(3):
        info = redis_cluster.call(node, "INFO", "errorstats").decode()
        # NOSCRIPT: the first EVALSHA of the script on a node (it is then sent whole).
        stats = [line for line in info.splitlines() if line.startswith("errorstat_")]
        assert [s for s in stats if not s.startswith("errorstat_NOSCRIPT:")] == [], info


# -- the election, through the consumer's sampler ---------------------------------------------


def value(metrics: Metrics, name: str, queue: str = "q") -> float | None:
    return metrics.registry.get_sample_value(f"llm_d_async_{name}", {"queue_name": queue})


def sampler(redis_url: str, store: Store, consumer_id: str | None) -> tuple[Metrics, Upkeep]:
    """The metrics and the upkeep (queue stats sampler) of a consumer with ``consumer_id``."""
    config = load_config(inline=json.dumps(config_doc(redis_url, queue="q")))
    consumer = Consumer(config, store)
    upkeep = Upkeep(
        config,
        consumer.queues,
        consumer._health,
        consumer.clock,
        gauges=consumer.metrics.queue_gauges,
        consumer_id=consumer_id,
    )
    return consumer.metrics, upkeep


async def sample(redis_url: str, store: Store, consumer_id: str | None) -> Metrics:
    """One round of the queue stats sampler of a consumer with ``consumer_id``."""
    metrics, upkeep = sampler(redis_url, store, consumer_id)
    await upkeep.sample_queue_stats()
    return metrics


async def test_only_the_smallest_alive_consumer_publishes(redis_url: str, store: Store) -> None:
    t = await prepare(store, QueueKeys.for_queue("q"))
    with trio.fail_after(10):
        a = await sample(redis_url, store, "c-a")
        b = await sample(redis_url, store, "c-b")
        dead = await sample(redis_url, store, "c-0")  # its entry lapsed: not the exporter
    assert value(a, "async_queue_pending") == 4
    assert value(a, "async_queue_claimed") == 3
    assert value(a, "async_queue_claims_expired") == 2
    assert value(a, "async_queue_consumers_alive") == 2
    assert value(a, "async_dead_set_size") == 2
    assert value(a, "async_retry_set_size") == 4
    assert value(a, "async_retry_dead_size") == 1
    age = value(a, "async_queue_oldest_pending_age_seconds")
    assert age is not None
    assert 300 <= age < 330
    for other in (b, dead):
        assert value(other, "async_queue_pending") is None
        assert value(other, "async_queue_consumers_alive") is None
    # The per-process backlog gauge is set by every process (upstream's gauge).
    for m in (a, b, dead):
        labels = {"queue_id": "q", "queue_name": "q", "pool_name": ""}
        assert m.registry.get_sample_value("llm_d_async_async_broker_backlog", labels) == 4
    assert t > 0


async def test_every_process_publishes_when_no_consumer_is_alive(
    redis_url: str, store: Store
) -> None:
    keys = QueueKeys.for_queue("q")
    await prepare(store, keys)
    await store.command("DEL", keys.consumers)
    with trio.fail_after(10):
        a = await sample(redis_url, store, "c-a")
        b = await sample(redis_url, store, "c-b")
        anonymous = await sample(redis_url, store, None)
    for m in (a, b, anonymous):
        assert value(m, "async_queue_pending") == 4
        assert value(m, "async_queue_consumers_alive") == 0


async def test_an_exporter_that_loses_the_election_withdraws(redis_url: str, store: Store) -> None:
    keys = QueueKeys.for_queue("q")
    t = await prepare(store, keys)
    metrics, upkeep = sampler(redis_url, store, "c-b")
    await store.command("ZREM", keys.consumers, "c-a")
    await upkeep.sample_queue_stats()
    assert value(metrics, "async_queue_pending") == 4
    await store.command("ZADD", keys.consumers, t + 60, "c-a")  # a smaller id is back
    await upkeep.sample_queue_stats()
    assert value(metrics, "async_queue_pending") is None
    assert metrics.queue_gauges.exported("q") is False
