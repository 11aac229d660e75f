"""Every operator command on a real Redis Cluster (``mode: cluster``, :mod:`cluster`): the
cluster key layout (docs/topology.md#cluster-key-layout), exact outputs and the exact keys
left on the nodes, and no command refused for its slots (CROSSSLOT, a script's undeclared
key): every node's ``INFO errorstats`` stays empty.

Each command runs with an untagged queue ``q`` whose result list ``results`` is in another
slot on another node, and with ``{t}:q`` and ``{t}:results`` (one slot).
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import trio
from cluster import RedisCluster, redis_cluster
from rich.console import Console
from support import NOWHERE, free_port, invoke, member, wait_port, wait_until

from claimkit.cli.inspect_command import live_watch
from claimkit.config import load_config
from claimkit.consumer.preflight import key_roles
from claimkit.ops.acl import ROLES, acl_rule
from claimkit.ops.queues import OperatorQueue
from claimkit.protocol.keys import (
    QueueKeys,
    ResultClaimKeys,
    ResultKeys,
    key_slot,
    outbox_field,
    slot_key,
)
from claimkit.protocol.models import ErrorCode, TerminalRecord, max_deliveries_message
from claimkit.protocol.result_delivery import ResultAckCode, ResultClaims
from claimkit.store import open_store
from claimkit.store.topology import Topology

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterator, Sequence

    from typer.testing import Result

    from claimkit.config import Config
    from claimkit.store import Arg, Store

__all__ = ["redis_cluster"]  # the fixture, imported for pytest

pytestmark = pytest.mark.slow

CLAIMKIT = str(Path(sys.executable).with_name("claimkit"))
TOKEN_A = "a" * 32
TOKEN_B = "b" * 32
LAYOUTS = [("q", "results"), ("{t}:q", "{t}:results")]
"""(queue, result list): another slot and node; one slot."""


def test_the_two_layouts_are_what_the_tests_say() -> None:
    assert key_slot("q") // 5461 != key_slot("results") // 5461  # two nodes of three
    assert key_slot("{t}:q") == key_slot("{t}:results")


# -- helpers -------------------------------------------------------------------------------------


def topology(cluster: RedisCluster) -> Topology:
    addrs = tuple(u.removeprefix("redis://").split("/")[0] for u in cluster.urls[1:])
    return Topology("cluster", addrs)


def transport(cluster: RedisCluster, queue: str, result_list: str, **fields: Any) -> str:
    """A cluster config serving ``queue``, its records going to ``result_list`` (global);
    ``url=None`` leaves the URL out (``$REDIS_URL`` then names it)."""
    doc: dict[str, Any] = {
        "url": cluster.url,
        "mode": "cluster",
        "addrs": list(topology(cluster).addrs),
        "result_queue_name": result_list,
        "queues": [{"queue_name": queue, "igw_base_url": NOWHERE}],
    }
    doc.update(fields)
    return json.dumps({k: v for k, v in doc.items() if v is not None})


def on_cluster(cluster: RedisCluster, fn: Callable[[Store], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        with trio.fail_after(30):
            async with open_store(cluster.url, topology=topology(cluster)) as store:
                return await fn(store)

    return trio.run(main)


def seed(cluster: RedisCluster, *commands: Sequence[Arg]) -> None:
    """Commands through the cluster store, each routed to its key's node."""

    async def go(store: Store) -> None:
        for command in commands:
            await store.command(*command)

    on_cluster(cluster, go)


def server_now(cluster: RedisCluster) -> float:
    secs, micros = cluster.call(0, "TIME")
    return int(secs) + int(micros) / 1_000_000


def masters(cluster: RedisCluster) -> list[int]:
    return [i for i in range(len(cluster.nodes)) if cluster.call(i, "ROLE")[0] == b"master"]


def keyspace(cluster: RedisCluster) -> dict[str, Any]:
    """Every key of every primary: zset -> [(member, score)], hash -> {field: value}, list ->
    [elements] (newest first), string -> value."""
    out: dict[str, Any] = {}
    for node in masters(cluster):
        for key in sorted(k.decode() for k in cluster.call(node, "KEYS", "*")):
            kind = cluster.call(node, "TYPE", key)
            if kind == b"zset":
                flat = cluster.call(node, "ZRANGE", key, "0", "-1", "WITHSCORES")
                value: Any = [(flat[i], float(flat[i + 1])) for i in range(0, len(flat), 2)]
            elif kind == b"hash":
                flat = cluster.call(node, "HGETALL", key)
                value = dict(zip(flat[0::2], flat[1::2], strict=True))
            elif kind == b"list":
                value = cluster.call(node, "LRANGE", key, "0", "-1")
            else:
                value = cluster.call(node, "GET", key)
            out[key] = value
    return out


def errors(cluster: RedisCluster) -> list[str]:
    """Every error reply any node gave since the test began (``INFO errorstats``), but
    ``NOSCRIPT``: the store's EVALSHA of a script a node has not loaded yet, answered by
    sending it whole."""
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
    """An empty cluster with fresh error counts; afterwards, no node refused anything."""
    for node in masters(redis_cluster):
        redis_cluster.call(node, "FLUSHALL")
    for node in range(len(redis_cluster.nodes)):
        redis_cluster.call(node, "CONFIG", "RESETSTAT")
    yield
    assert errors(redis_cluster) == []


def ok(result: Result) -> str:
    assert result.exit_code == 0, result.output
    assert "CROSSSLOT" not in result.output
    return result.stdout


def outbox(keys: QueueKeys) -> str:
    """The queue's ``{q}:outbox`` (cluster keys always have one)."""
    assert keys.outbox is not None
    return keys.outbox


def claim(keys: QueueKeys, rid: str, *, token: str, expiry: float, score: int) -> list[list[Arg]]:
    return [
        ["HSET", keys.claimed, rid, member(rid, score), f"{rid}:score", score],
        ["HSET", keys.owners, rid, token],
        ["ZADD", keys.index, repr(expiry), rid],
    ]


# -- inspect -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("queue", "results"), LAYOUTS)
def test_inspect_reads_the_cluster_keys_and_the_outbox(
    redis_cluster: RedisCluster, queue: str, results: str
) -> None:
    k = QueueKeys.for_queue(queue, cluster=True)
    base = slot_key(queue)
    assert (k.claimed, k.outbox, k.retry_set) == (
        f"{base}:claimed",
        f"{base}:outbox",
        f"{base}:retry-sortedset",
    )
    now = server_now(redis_cluster)
    t0 = int(now)
    entry = json.dumps(
        {"list": results, "request_token": "g9", "record": '{"id":"o1"}', "id": "o1"}
    )
    seed(
        redis_cluster,
        ["ZADD", queue, t0 + 200, member("p2", t0 + 200), t0 + 100, member("p1", t0 + 100)],
        *claim(k, "c-old", token=TOKEN_A, expiry=now - 40.5, score=t0 + 10),
        *claim(k, "c-live", token=TOKEN_B, expiry=now + 250.25, score=t0 + 20),
        ["HSET", k.deliveries, "c-old", 3],
        ["ZADD", k.dead, 1234, member("d1", t0 + 5)],
        ["ZADD", k.retry_set, now + 3, member("r1", t0 + 9, request_queue_name=queue)],
        ["ZADD", k.retry_set, now + 4, member("r2", t0 + 9, request_queue_name="x")],
        ["HSET", outbox(k), outbox_field("o1", "tok-o1"), entry],
        ["LPUSH", results, b'{"id":"x1"}', b'{"id":"x2"}'],
    )
    before = keyspace(redis_cluster)
    conf = transport(redis_cluster, queue, results)

    doc = json.loads(ok(invoke(["inspect", "-q", queue, "--json", "--transport-config", conf])))
    assert doc["counts"] == {
        "pending": 2,
        "claimed": 2,
        "orphans": 0,
        "expired": 1,
        "retrying": 1,
        "dead": 1,
        "outbox": 1,
        "results": 2,
        "redelivered": 1,
    }
    assert doc["retry_set"] == {"name": k.retry_set, "total": 2, "for_queue": 1, "exact": True}
    assert doc["result_lists"] == {results: 2}
    assert doc["oldest_pending_deadline"] == float(t0 + 100)
    assert [(c["id"], c["owner"], c["deliveries"], c["expired"]) for c in doc["claims"]] == [
        ("c-old", TOKEN_A, 3, True),
        ("c-live", TOKEN_B, 0, False),
    ]
    assert doc["redis_url"] == redis_cluster.url

    text = ok(invoke(["inspect", "-q", queue, "--transport-config", conf]))
    assert (
        "pending 2  claimed 2  orphans 0  expired 1  retrying 1  dead 1  outbox 1  results 2  "
        "redelivered 1"
    ) in text
    assert f"retry set {k.retry_set}: 2 in all; result lists: {results}=2" in text
    assert keyspace(redis_cluster) == before  # read only


@pytest.mark.parametrize(("queue", "results"), LAYOUTS)
def test_inspect_checks_the_cluster_names_types(
    redis_cluster: RedisCluster, queue: str, results: str
) -> None:
    k = QueueKeys.for_queue(queue, cluster=True)
    conf = transport(redis_cluster, queue, results)
    for key, found, want in (
        (outbox(k), "a string", "a hash"),
        (k.retry_set, "a string", "a sorted set"),
        (k.claimed, "a string", "a hash"),
    ):
        seed(redis_cluster, ["SET", key, "x"])
        result = invoke(["inspect", "-q", queue, "--transport-config", conf])
        assert result.exit_code == 1
        assert result.stderr == (
            f"claimkit: key {key!r} holds {found}, not {want}: is the queue or list name right?\n"
        )
        seed(redis_cluster, ["DEL", key])
    # The standalone names are not claimkit's on a cluster: a string there is no concern
    # (a tagged queue's are the same as the cluster's but for the retry set).
    standalone = [n for n in (f"{queue}:claimed", "retry-sortedset") if n != k.claimed]
    seed(redis_cluster, *(["SET", n, "x"] for n in standalone))
    ok(invoke(["inspect", "-q", queue, "--transport-config", conf]))


async def test_inspect_watch_on_a_cluster(redis_cluster: RedisCluster) -> None:
    """The live view reads the same cluster keys, checks their types in the cluster
    layout (the queue's outbox among them), and shows the outbox."""
    k = QueueKeys.for_queue("q", cluster=True)
    config = load_config(inline=transport(redis_cluster, "q", "results"))
    target = OperatorQueue(config, "q", config.queue("q"))
    out = io.StringIO()
    with trio.fail_after(30):
        async with open_store(redis_cluster.url, topology=config.topology) as store:
            await store.command("HSET", outbox(k), outbox_field("o1", "t"), "{}")
            key_types = target.key_types(store)
            assert key_types == {
                "results": "list",
                **QueueKeys.for_queue("q", cluster=True).types(),
            }
            assert {k.outbox, k.retry_set, k.retry_dead} <= set(key_types)
            await live_watch(
                store,
                "q",
                console=Console(file=out, width=200, force_terminal=False),
                key_types=key_types,
                result_lists=target.result_lists,
                retry_set=config.retry_queue_name,
                limit=10,
                interval=0.1,
                refreshes=1,
            )
    assert "dead 0  outbox 1  results 0" in out.getvalue()


# -- drain and reclaim ---------------------------------------------------------------------------


@pytest.mark.parametrize(("queue", "results"), LAYOUTS)
def test_drain_releases_every_claim_at_its_score(
    redis_cluster: RedisCluster, queue: str, results: str
) -> None:
    k = QueueKeys.for_queue(queue, cluster=True)
    now = server_now(redis_cluster)
    t0 = int(now)
    seed(
        redis_cluster,
        *claim(k, "c1", token=TOKEN_A, expiry=now + 300, score=t0 + 10),
        *claim(k, "c2", token=TOKEN_B, expiry=now + 300, score=t0 + 20),
        *claim(k, "c3", token=TOKEN_A, expiry=now + 300, score=t0 + 30)[:2],  # no lease entry
    )
    conf = transport(redis_cluster, queue, results)
    before = keyspace(redis_cluster)
    dry = ok(
        invoke(["drain", "-q", queue, "--release-all", "--dry-run", "--transport-config", conf])
    )
    assert dry.splitlines()[-1] == (
        f"claimkit drain {queue}: dry run: would release 3 of 3 claims (0 ghosts skipped); "
        "nothing changed"
    )
    assert keyspace(redis_cluster) == before
    done = ok(invoke(["drain", "-q", queue, "--release-all", "--transport-config", conf]))
    assert done == (
        f"claimkit drain {queue}: released=3 of 3 claims gone=0 renewed=0 other_owner=0 ghosts=0\n"
    )
    assert keyspace(redis_cluster) == {
        queue: [(member(f"c{i}", t0 + 10 * i), float(t0 + 10 * i)) for i in (1, 2, 3)]
    }
    again = ok(invoke(["drain", "-q", queue, "--release-all", "--transport-config", conf]))
    assert again == (
        f"claimkit drain {queue}: released=0 of 0 claims gone=0 renewed=0 other_owner=0 ghosts=0\n"
    )


@pytest.mark.parametrize(("queue", "results"), LAYOUTS)
def test_reclaim_once_redelivers_dead_letters_and_replays_the_outbox(
    redis_cluster: RedisCluster, queue: str, results: str
) -> None:
    """An expired claim goes back to pending; one at max_deliveries is dead-lettered and its
    record goes through the outbox to the list; an entry a crashed ack left in the outbox is
    pushed once, under its marker."""
    k = QueueKeys.for_queue(queue, cluster=True)
    m = ResultKeys.for_list(results)
    now = server_now(redis_cluster)
    t0 = int(now)
    left = b'{"id":"o1","payload":"{}","status_code":200}'
    entry = {"list": results, "request_token": "g-o1", "record": left.decode(), "id": "o1"}
    seed(
        redis_cluster,
        *claim(k, "c1", token=TOKEN_A, expiry=now - 10, score=t0 + 10),
        *claim(k, "c2", token=TOKEN_B, expiry=now - 10, score=t0 + 20),
        ["HSET", k.deliveries, "c2", 9],
        ["HSET", outbox(k), outbox_field("o1", "tok-o1"), json.dumps(entry)],
    )
    conf = transport(redis_cluster, queue, results)
    shown = ok(invoke(["reclaim", "--once", "--transport-config", conf]))
    assert shown == (
        "claimkit reclaim: queues=1 redelivered=1 dead_lettered=1 ghosts=0 leases_restored=0 "
        "handed_on=0 "
        "replayed=2\n"
    )
    after = keyspace(redis_cluster)
    dead_record = TerminalRecord.error(
        "c2", ErrorCode.MAX_DELIVERIES_EXCEEDED, max_deliveries_message(10, 10)
    ).to_json()
    assert sorted(after[results]) == sorted([left, dead_record])
    assert after[m.terminal] == {b"o1": b"g-o1", b"c2": b"1"}
    ttl = 21600  # result_dedup_ttl_seconds' default
    assert [name for name, _ in after[m.expiry]] == sorted([b"c2", b"o1"])
    assert all(now + ttl - 1 <= score <= now + ttl + 60 for _, score in after[m.expiry])
    assert [name for name, _ in after[k.dead]] == [member("c2", t0 + 20)]
    del after[results], after[m.terminal], after[m.expiry], after[k.dead]
    assert after == {queue: [(member("c1", t0 + 10), float(t0 + 10))], k.deliveries: {b"c1": b"1"}}

    doc = json.loads(ok(invoke(["reclaim", "--once", "--json", "--transport-config", conf])))
    zero = {
        "redelivered": 0,
        "dead_lettered": 0,
        "ghosts": 0,
        "orphans": 0,
        "leases_restored": 0,
        "handed_on": 0,
        "replayed": 0,
    }
    assert doc == {"queues": {queue: zero}, **zero, "failover_skipped": {}}


# -- dead ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("queue", "results"), LAYOUTS)
def test_dead_list_requeue_purge(redis_cluster: RedisCluster, queue: str, results: str) -> None:
    k = QueueKeys.for_queue(queue, cluster=True)
    m = ResultKeys.for_list(results)
    t0 = int(server_now(redis_cluster))
    d1 = member("r1", t0 + 600, request_token="g1")
    d2 = member("r2", t0 + 700)
    bad = b"not json"
    seed(
        redis_cluster,
        ["ZADD", k.dead, 10, d1, 20, d2, 30, bad],
        ["HSET", k.deliveries, "r1", 3, "r2", 2, "r9", 1],
        # r1's marker is its generation's, r2's ("1": no token) too, r3's another request's.
        ["HSET", m.terminal, "r1", "g1", "r2", "1", "r3", "g3"],
        ["ZADD", m.expiry, t0 + 900, "r1", t0 + 900, "r2", t0 + 900, "r3"],
    )
    conf = transport(redis_cluster, queue, results)

    listed = json.loads(
        ok(invoke(["dead", "list", "-q", queue, "--json", "--transport-config", conf]))
    )
    assert listed["total"] == 3
    assert [(d["id"], d["cause"], d["dead_at"]) for d in listed["dead"]] == [
        ("r1", "max_deliveries", 10.0),
        ("r2", "max_deliveries", 20.0),
        (None, "invalid", 30.0),
    ]
    assert listed["dead"][0]["reason"] == max_deliveries_message(10, 10)
    table = ok(invoke(["dead", "list", "-q", queue, "--transport-config", conf]))
    assert f"{k.dead} (3 of 3, oldest first" in table

    shown = ok(invoke(["dead", "requeue", "-q", queue, "r1", "r2", "--transport-config", conf]))
    assert shown == f"claimkit dead requeue {queue}: requeued=2 refused=0 not_found=0\n"
    after = keyspace(redis_cluster)
    assert after[queue] == [(d1, float(t0 + 600)), (d2, float(t0 + 700))]
    assert after[k.dead] == [(bad, 30.0)]
    assert after[k.deliveries] == {b"r9": b"1"}
    assert after[m.terminal] == {b"r3": b"g3"}  # only the requeued generations' markers
    assert after[m.expiry] == [(b"r3", float(t0 + 900))]

    emptied = ok(invoke(["dead", "purge", "-q", queue, "--all", "--transport-config", conf]))
    assert emptied == f"claimkit dead purge {queue}: purged=1 not_found=0\n"
    assert k.dead not in keyspace(redis_cluster)
    assert ok(invoke(["dead", "list", "-q", queue, "--transport-config", conf])) == (
        f"{k.dead} is empty\n"
    )


def test_dead_list_judges_reserved_lists_by_the_cluster_names(redis_cluster: RedisCluster) -> None:
    """A member whose own result list names a cluster key of the queue (its outbox) died
    invalid; the standalone name of that key is no claimkit key on a cluster."""
    k = QueueKeys.for_queue("q", cluster=True)
    t0 = int(server_now(redis_cluster))
    seed(
        redis_cluster,
        ["ZADD", k.dead, 1, member("r1", t0 + 600, result_queue_name=outbox(k))],
        ["ZADD", k.dead, 2, member("r2", t0 + 600, result_queue_name="q:outbox")],
        ["ZADD", k.dead, 3, member("r3", t0 + 600, result_queue_name="x}y")],
    )
    conf = transport(redis_cluster, "q", "results")
    doc = json.loads(ok(invoke(["dead", "list", "-q", "q", "--json", "--transport-config", conf])))
    assert [(d["id"], d["cause"], d["reason"]) for d in doc["dead"]] == [
        (
            "r1",
            "invalid",
            "Failed: internal.result_queue_name names a key claimkit uses: '{q}:outbox'",
        ),
        ("r2", "max_deliveries", max_deliveries_message(10, 10)),
        (
            "r3",
            "invalid",
            "Failed: internal.result_queue_name 'x}y' cannot be used in cluster mode: it holds "
            "a '}' but no hash tag, so no other key can share its slot; give it a hash tag "
            "({tenant}:...) or drop the '}' (docs/topology.md#cluster-key-layout)",
        ),
    ]


@pytest.mark.parametrize(("queue", "results"), LAYOUTS)
def test_dead_requeue_keep_marker_and_purge_by_id_and_age(
    redis_cluster: RedisCluster, queue: str, results: str
) -> None:
    k = QueueKeys.for_queue(queue, cluster=True)
    m = ResultKeys.for_list(results)
    t0 = int(server_now(redis_cluster))
    d1 = member("r1", t0 + 600, request_token="g1")
    d2 = member("r2", t0 + 700)
    d3 = member("r3", t0 + 800)
    seed(
        redis_cluster,
        ["ZADD", k.dead, 10, d1, t0 - 10, d2, t0 + 5, d3],
        ["HSET", m.terminal, "r1", "g1"],
    )
    conf = transport(redis_cluster, queue, results)
    kept = ok(
        invoke(["dead", "requeue", "-q", queue, "r1", "--keep-marker", "--transport-config", conf])
    )
    assert kept == f"claimkit dead requeue {queue}: requeued=1 refused=0 not_found=0\n"
    assert keyspace(redis_cluster)[m.terminal] == {b"r1": b"g1"}
    purged = ok(
        invoke(["dead", "purge", "-q", queue, "--older-than", "5", "--transport-config", conf])
    )
    assert purged == f"claimkit dead purge {queue}: purged=1 not_found=0\n"  # d2
    by_id = invoke(["dead", "purge", "-q", queue, "r3", "r7", "--transport-config", conf])
    assert by_id.exit_code == 1
    assert by_id.stdout == f"claimkit dead purge {queue}: purged=1 not_found=1\n"
    assert by_id.stderr == "claimkit: no dead letter for 'r7'\n"
    after = keyspace(redis_cluster)
    assert k.dead not in after
    assert after[queue] == [(d1, float(t0 + 600))]


# -- results -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("queue", "results"), LAYOUTS)
def test_results_read_pop_and_follow(redis_cluster: RedisCluster, queue: str, results: str) -> None:
    records = [b'{"id":"x%d","payload":"{}","status_code":200}' % i for i in (1, 2, 3)]
    seed(redis_cluster, ["LPUSH", results, *records])
    conf = transport(redis_cluster, queue, results)
    assert ok(invoke(["results", "--count", "2", "--json", "--transport-config", conf])) == (
        '{"id":"x1","payload":"{}","status_code":200}\n'
        '{"id":"x2","payload":"{}","status_code":200}\n'
    )
    assert ok(invoke(["results", "--pop", "--count", "1", "--transport-config", conf])) == (
        "x1  200  {}\n"
    )
    followed = ok(invoke(["results", "--follow", "--count", "2", "--transport-config", conf]))
    assert followed == "x2  200  {}\nx3  200  {}\n"
    # The list emptied; what is left is the two tombstones, in the list's slot.
    k = ResultClaimKeys.for_list(results, cluster=True)
    after = keyspace(redis_cluster)
    assert sorted(after) == [k.tombstones]
    assert sorted(m for m, _ in after[k.tombstones]) == [b"x2", b"x3"]
    assert key_slot(k.tombstones) == key_slot(results)
    # A pop now meets durable-reader state: refused, nothing popped.
    seed(redis_cluster, ["LPUSH", results, records[0]])
    refused = invoke(["results", "--pop", "--transport-config", conf])
    assert refused.exit_code == 1
    assert "has durable readers" in refused.stderr
    assert keyspace(redis_cluster)[results] == [records[0]]


@pytest.mark.parametrize(("queue", "results"), LAYOUTS)
async def test_receive_renew_ack_use_the_lists_slot(
    redis_cluster: RedisCluster, queue: str, results: str
) -> None:
    del queue
    k = ResultClaimKeys.for_list(results, cluster=True)
    assert k.claimed == f"{slot_key(results)}:result-claimed"
    assert {key_slot(name) for name in k.all()} == {key_slot(results)}
    record = b'{"id":"x1","payload":"{}","request_token":"g1"}'
    with trio.fail_after(30):
        async with open_store(redis_cluster.url, topology=topology(redis_cluster)) as store:
            await store.command("LPUSH", results, record)
            claims = ResultClaims(store, results)
            (got,) = await claims.receive(lease_ms=60_000)
            assert (got.raw, got.claim_id, got.request_token) == (record, "x1\0g1", "g1")
            held = keyspace(redis_cluster)
            assert held[k.claimed] == {b"x1\0g1": record}
            assert held[k.owners] == {b"x1\0g1": got.owner.encode()}
            assert await claims.renew([got], lease_ms=60_000) == [True]
            assert await claims.ack(got) is ResultAckCode.ACKED
    after = keyspace(redis_cluster)
    assert sorted(after) == [k.tombstones]
    assert [m for m, _ in after[k.tombstones]] == [b"x1\0g1"]


# -- acl -----------------------------------------------------------------------------------------


def cluster_config(queue: str, results: str) -> Config:
    return load_config(
        inline=json.dumps(
            {
                "url": "redis://127.0.0.1:7000/0",
                "mode": "cluster",
                "addrs": ["127.0.0.1:7001"],
                "result_queue_name": results,
                "queues": [{"queue_name": queue, "igw_base_url": NOWHERE}],
            }
        )
    )


def test_acl_keys_are_the_cluster_names() -> None:
    """Exact patterns, braces escaped; the queue's outbox and retry sets, each list's two
    marker keys and its durable-reader keys in the list's slot; no result-terminal:*, no shared
    retry set."""
    untagged = acl_rule(cluster_config("q", "results"), "operator")
    assert untagged.keys == (
        "q",
        "\\{q\\}:claimed",
        "\\{q\\}:claim-owners",
        "\\{q\\}:claims-idx",
        "\\{q\\}:deliveries",
        "\\{q\\}:dead",
        "\\{q\\}:paused",
        "\\{q\\}:consumers",
        "\\{q\\}:consumer-info",
        "\\{q\\}:outbox",
        "\\{q\\}:retry-sortedset",
        "\\{q\\}:retry-sortedset:dead",
        "results",
        "\\{results\\}:result-claimed",
        "\\{results\\}:result-claim-owners",
        "\\{results\\}:result-claims-idx",
        "\\{results\\}:result-ack-tombstones",
        "\\{results\\}:result-terminal",
        "\\{results\\}:result-terminal-expiry",
        "request-active:*",
        "request-cancel:*",
    )
    tagged = acl_rule(cluster_config("{t}:q", "{t}:results"), "consumer")
    assert tagged.keys == (
        "\\{t\\}:q",
        "\\{t\\}:q:claimed",
        "\\{t\\}:q:claim-owners",
        "\\{t\\}:q:claims-idx",
        "\\{t\\}:q:deliveries",
        "\\{t\\}:q:dead",
        "\\{t\\}:q:paused",
        "\\{t\\}:q:consumers",
        "\\{t\\}:q:consumer-info",
        "\\{t\\}:q:outbox",
        "\\{t\\}:q:retry-sortedset",
        "\\{t\\}:q:retry-sortedset:dead",
        "\\{t\\}:results",
        "\\{t\\}:results:result-terminal",
        "\\{t\\}:results:result-terminal-expiry",
        "request-active:*",
        "request-cancel:*",
        "request-payload:*",  # payload keys, read and deleted (docs/topology.md#payload-keys)
    )
    producer = acl_rule(cluster_config("q", "results"), "producer")
    assert producer.keys[:3] == ("q", "request-seq:\\{q\\}:*", "results")
    assert producer.keys[-1] == "request-payload:*"
    for rule in (untagged, tagged, producer):
        assert {"cluster|slots", "asking"} <= set(rule.commands)
    assert {"hlen", "hdel", "hscan"} <= set(untagged.commands)  # outbox count and replay
    assert {"mget", "del"} <= set(tagged.commands)  # payload fetch, deletion after the ack
    assert "wait" not in untagged.commands


def test_acl_grants_wait_when_the_config_waits_for_replicas() -> None:
    """``wait_replicas`` > 0: every writing script call is followed by WAIT, in either
    mode; the producer's submit script and its durable result reading write through
    scripts too."""
    for mode_fields in ({}, {"mode": "cluster", "addrs": ["127.0.0.1:7001"]}):
        doc = {
            "url": "redis://127.0.0.1:7000/0",
            "wait_replicas": 1,
            "queues": [{"queue_name": "q", "igw_base_url": NOWHERE}],
            **mode_fields,
        }
        config = load_config(inline=json.dumps(doc))
        waits = {role: "wait" in acl_rule(config, role).commands for role in ROLES}
        assert waits == {"consumer": True, "producer": True, "operator": True}


def _knows_client_setinfo(cluster: RedisCluster) -> bool:
    """Whether the servers are Redis >= 7.2 or Valkey, whose ``CLIENT SETINFO`` coredis sends
    on connecting (docs/security.md: the rule leaves it out, since Redis 7.0 refuses a rule
    naming it; add it there)."""
    info = cluster.call(0, "INFO", "server").decode()
    version = next(
        line.split(":", 1)[1] for line in info.splitlines() if line.startswith("redis_version:")
    )
    major, minor = (int(part) for part in version.strip().split(".")[:2])
    return (major, minor) >= (7, 2)


def acl_user(cluster: RedisCluster, role: str, conf: str) -> str:
    """Define the user ``role`` on every node with exactly the rule ``claimkit acl`` prints
    for ``conf`` (and ``+client|setinfo`` where the servers know it, as docs/security.md
    says); empty every node's ACL LOG. Returns the user's URL."""
    args = ["acl", "--role", role, "--rule-only", "--transport-config", conf]
    rule = ok(invoke(args)).strip()
    if _knows_client_setinfo(cluster):
        rule += " +client|setinfo"
    for node in range(len(cluster.nodes)):
        assert cluster.call(node, "ACL", "LOG", "RESET") == b"OK"
        cluster.call(node, "ACL", "DELUSER", role)
        assert cluster.call(node, "ACL", "SETUSER", role, "on", ">pw", *rule.split()) == b"OK"
    return cluster.url.replace("redis://", f"redis://{role}:pw@")


def acl_logs(cluster: RedisCluster) -> list[Any]:
    """Every node's ACL LOG (a refusal leaves an entry on the node that refused)."""
    return [cluster.call(node, "ACL", "LOG") for node in range(len(cluster.nodes))]


def drop_users(cluster: RedisCluster, *users: str) -> None:
    for node in range(len(cluster.nodes)):
        for user in users:
            cluster.call(node, "ACL", "DELUSER", user)


@pytest.mark.parametrize(("queue", "results"), LAYOUTS)
def test_the_operator_rule_is_enough_on_every_node(
    redis_cluster: RedisCluster, queue: str, results: str
) -> None:
    """The operator rule `claimkit acl` prints for a cluster config, set on every node, runs
    every operator command there, the outbox replay and marker deletion included, with
    nothing refused (no ACL LOG entry on any node)."""
    k = QueueKeys.for_queue(queue, cluster=True)
    m = ResultKeys.for_list(results)
    url = acl_user(redis_cluster, "operator", transport(redis_cluster, queue, results))
    now = server_now(redis_cluster)
    t0 = int(now)
    r1 = member("r1", t0 + 600, request_token="g1")
    o1 = {"list": results, "request_token": "g-o1", "record": '{"id":"o1"}', "id": "o1"}
    seed(
        redis_cluster,
        ["ZADD", k.dead, 1, r1],
        ["HSET", m.terminal, "r1", "g1"],
        *claim(k, "c1", token=TOKEN_A, expiry=now - 10, score=t0 + 10),
        ["HSET", k.deliveries, "c1", 9],
        *claim(k, "c2", token=TOKEN_A, expiry=now - 10, score=t0 + 20),
        *claim(k, "c3", token=TOKEN_B, expiry=now + 300, score=t0 + 30),
        ["HSET", outbox(k), outbox_field("o1", "t"), json.dumps(o1)],
        ["LPUSH", results, b'{"id":"x1"}'],
    )
    conf = transport(redis_cluster, queue, results, url=None)
    try:
        outputs = [
            ok(invoke([*args, "--transport-config", conf], url))
            for args in (
                ["inspect", "-q", queue, "--json"],
                ["dead", "list", "-q", queue],
                ["reclaim", "--once"],
                ["drain", "-q", queue, "--release-all"],
                ["dead", "requeue", "-q", queue, "--all"],
                ["dead", "purge", "-q", queue, "--all"],
                ["results"],
                ["results", "--follow", "--count", "3", "--json"],
            )
        ]
        assert acl_logs(redis_cluster) == [[]] * len(redis_cluster.nodes)
    finally:
        drop_users(redis_cluster, "operator")
    assert json.loads(outputs[0])["counts"]["outbox"] == 1
    assert outputs[2:6] == [
        "claimkit reclaim: queues=1 redelivered=1 dead_lettered=1 ghosts=0 leases_restored=0 "
        "handed_on=0 "
        "replayed=2\n",
        f"claimkit drain {queue}: released=1 of 1 claims gone=0 renewed=0 other_owner=0 ghosts=0\n",
        f"claimkit dead requeue {queue}: requeued=2 refused=0 not_found=0\n",
        f"claimkit dead purge {queue}: purged=0 not_found=0\n",
    ]
    popped = [json.loads(line)["id"] for line in outputs[7].splitlines()]
    assert popped[0] == "x1"
    assert sorted(popped) == ["c1", "o1", "x1"]
    after = keyspace(redis_cluster)
    assert [name for name, _ in after.pop(m.expiry)] == [b"o1"]
    # results --follow acked what it printed: one tombstone each, in the list's slot.
    tombstones = ResultClaimKeys.for_list(results, cluster=True).tombstones
    assert sorted(name for name, _ in after.pop(tombstones)) == [b"c1", b"o1", b"x1"]
    assert after == {
        queue: sorted(
            [
                (member("c1", t0 + 10), float(t0 + 10)),
                (member("c2", t0 + 20), float(t0 + 20)),
                (member("c3", t0 + 30), float(t0 + 30)),
                (r1, float(t0 + 600)),
            ],
            key=lambda pair: (pair[1], pair[0]),
        ),
        k.deliveries: {b"c2": b"1"},
        m.terminal: {b"o1": b"g-o1"},  # requeue dropped r1's and c1's
    }


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[str]:
    """A gateway simulator answering at once (``claimkit sim``), stopped by PID."""
    port = free_port()
    with (tmp_path / "sim.log").open("w") as log:
        proc = subprocess.Popen(
            [CLAIMKIT, "sim", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT
        )
    try:
        wait_port(port)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(10)


def test_serves_preflight_checks_only_the_cluster_keys() -> None:
    roles = key_roles(cluster_config("q", "results"))
    markers = ResultKeys.for_list("results")
    assert set(roles) == {
        *QueueKeys.for_queue("q", cluster=True).types(),
        *markers.types(),
    }


@pytest.mark.parametrize(("queue", "results"), LAYOUTS)
def test_the_consumer_rule_is_enough_for_serve_on_every_node(
    redis_cluster: RedisCluster, queue: str, results: str, sim: str, tmp_path: Path
) -> None:
    """`serve` under the consumer rule `claimkit acl` prints for a cluster config: every
    request gets its record (through the outbox for a list of another slot), and no node
    refused a command or a key."""
    queues = [{"queue_name": queue, "igw_base_url": sim}]
    fields: dict[str, Any] = {
        "queues": queues,
        "poll_interval_ms": 50,
        "claim_reclaim_interval_ms": 200,
        "drain_timeout_seconds": 1,
    }
    url = acl_user(
        redis_cluster,
        "consumer",
        transport(redis_cluster, queue, results, **fields),
    )
    t0 = int(server_now(redis_cluster))
    ids = ["r1", "r2", "r3"]
    pending: list[Arg] = ["ZADD", queue]
    for rid in ids:
        pending += [t0 + 600, member(rid, t0 + 600, request_token=f"g-{rid}")]
    seed(redis_cluster, pending)
    conf = transport(redis_cluster, queue, results, url=None, **fields)
    log = tmp_path / "serve.log"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [
                CLAIMKIT,
                "serve",
                "--transport-config",
                conf,
                "--metrics-port",
                "0",
                "--health-port",
                "0",
            ],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env={**os.environ, "REDIS_URL": url},
        )
    try:

        def done() -> bool:
            assert proc.poll() is None, log.read_text()
            assert acl_logs(redis_cluster) == [[]] * len(redis_cluster.nodes)
            return len(keyspace(redis_cluster).get(results, [])) == len(ids)

        wait_until("three records", done, timeout=60)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        drop_users(redis_cluster, "consumer")
    assert "NOPERM" not in log.read_text()
    assert acl_logs(redis_cluster) == [[]] * len(redis_cluster.nodes)
    after = keyspace(redis_cluster)
    records = sorted((json.loads(raw) for raw in after[results]), key=lambda r: str(r["id"]))
    assert [(r["id"], r["status_code"]) for r in records] == [(rid, 200) for rid in ids]
    k = QueueKeys.for_queue(queue, cluster=True)
    m = ResultKeys.for_list(results)
    assert after[m.terminal] == {rid.encode(): f"g-{rid}".encode() for rid in ids}
    assert set(after) == {results, m.terminal, m.expiry}  # nothing claimed, pending or in
    assert k.outbox not in after  # the outbox


@pytest.mark.parametrize(("queue", "results"), LAYOUTS)
def test_the_producer_rule_is_enough_on_every_node(
    redis_cluster: RedisCluster, queue: str, results: str
) -> None:
    """submit, cancel and results under the producer rule for a cluster config: nothing
    refused on any node; cancel reads the list's marker hash."""
    conf = transport(redis_cluster, queue, results, url=None)
    url = acl_user(redis_cluster, "producer", transport(redis_cluster, queue, results))
    t0 = int(server_now(redis_cluster))
    try:
        submitted = invoke(
            ["submit", "-q", queue, "--transport-config", conf],
            url,
            stdin=json.dumps({"id": "r1", "deadline": t0 + 600})
            + "\n"
            + json.dumps({"id": "r2", "deadline": t0 + 600})
            + "\n",
        )
        tokens = ok(submitted).split()
        assert len(tokens) == 2
        seed(redis_cluster, ["HSET", ResultKeys.for_list(results).terminal, "r2", tokens[1]])
        cancelled = invoke(["cancel", "r1", "r2", "--transport-config", conf], url)
        assert cancelled.exit_code == 1  # r2 is finished: its record's marker holds its token
        assert cancelled.stdout == (
            "r1: cancelled\nr2: not active (unknown, finished or expired); not cancelled\n"
        )
        assert cancelled.stderr.splitlines()[-1] == "claimkit: no live request to cancel for 'r2'"
        seed(redis_cluster, ["LPUSH", results, b'{"id":"x1"}'])
        assert ok(invoke(["results", "--pop", "--json", "--transport-config", conf], url)) == (
            '{"id":"x1"}\n'
        )
        assert acl_logs(redis_cluster) == [[]] * len(redis_cluster.nodes)
    finally:
        drop_users(redis_cluster, "producer")
    after = keyspace(redis_cluster)
    assert after["request-cancel:r1"] == tokens[0].encode()
    assert sorted(json.loads(m)["data"]["id"] for m, _ in after[queue]) == ["r1", "r2"]
    assert {after["request-active:r1"], after["request-active:r2"]} == {t.encode() for t in tokens}
