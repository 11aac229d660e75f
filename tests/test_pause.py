"""Pause and resume (docs/protocol.md#pause, docs/cli.md): the key, the commands' exact
lines, ``inspect``'s paused line, ``drain``'s hint, and real consumers on a private Redis
against the real gateway simulator: a paused queue claims nothing new while its work in
flight finishes, a paused queue drains to zero claims with its consumers running, and a
resume serves every request exactly once."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

import httpx
import trio
from support import (
    command_calls,
    invoke,
    one_line_error,
    redis,
    server_now,
    server_now_sync,
    wait_for,
)

from claimkit.cli.console import format_time
from claimkit.config import load_config
from claimkit.consumer.consumer import Consumer
from claimkit.dev.sim import SimConfig, serve_sim
from claimkit.ops.pause import pause_queue, read_pause, resume_queue
from claimkit.producer import Producer
from claimkit.protocol.ops import QueueOps
from claimkit.protocol.pause import PauseMark, parse_pause

if TYPE_CHECKING:
    import pytest

    from claimkit.store import Store

Q = "jobs"
PAUSED = f"{Q}:paused"


# -- the value ------------------------------------------------------------------------------


def test_the_mark_is_compact_json_and_any_value_pauses() -> None:
    assert PauseMark(since=1.5, reason="redis move").encode() == (
        b'{"since":1.5,"reason":"redis move"}'
    )
    assert PauseMark(since=1.5, until=61.5).encode() == b'{"since":1.5,"reason":null,"until":61.5}'
    assert parse_pause(None) is None
    assert parse_pause(b'{"since":1.5,"reason":"r","until":9}') == PauseMark(1.5, "r", 9.0)
    for odd in [b"1", b"", b"[]", b"\xff", b'{"since":"soon","reason":7}', b'{"since":1e999}']:
        assert parse_pause(odd) == PauseMark(), odd


# -- the commands ---------------------------------------------------------------------------


def _mark(url: str) -> tuple[bytes, PauseMark]:
    (raw,) = redis(url, lambda s: s.pipeline([("GET", PAUSED)], transaction=False))
    mark = parse_pause(raw)
    assert mark is not None
    assert mark.since is not None
    return raw, mark


def test_pause_and_resume_print_one_line_and_are_idempotent(redis_url: str) -> None:
    before = server_now_sync(redis_url)
    first = invoke(["pause", "-q", Q, "--reason", "redis move"], redis_url)
    after = server_now_sync(redis_url)
    raw, mark = _mark(redis_url)
    assert mark.since is not None
    assert before <= mark.since <= after
    assert raw == PauseMark(since=mark.since, reason="redis move").encode()
    since = format_time(mark.since)
    assert (first.exit_code, first.stdout, first.stderr) == (
        0,
        f"claimkit pause {Q}: paused since {since} (redis move)\n",
        "",
    )
    assert redis(redis_url, lambda s: s.command("TTL", PAUSED)) == -1  # no TTL by default

    again = invoke(["pause", "-q", Q, "--reason", "other"], redis_url)
    assert (again.exit_code, again.stdout) == (
        0,
        f"claimkit pause {Q}: already paused since {since} (redis move); nothing changed\n",
    )
    assert _mark(redis_url)[0] == raw, "the first pause's value stays"

    resumed = invoke(["resume", "-q", Q], redis_url)
    assert (resumed.exit_code, resumed.stdout, resumed.stderr) == (
        0,
        f"claimkit resume {Q}: resumed; it was paused since {since} (redis move)\n",
        "",
    )
    assert redis(redis_url, lambda s: s.command("EXISTS", PAUSED)) == 0
    twice = invoke(["resume", "-q", Q], redis_url)
    assert (twice.exit_code, twice.stdout) == (
        0,
        f"claimkit resume {Q}: not paused; nothing changed\n",
    )


def test_pause_for_a_while_sets_a_ttl_and_says_until_when(redis_url: str) -> None:
    result = invoke(["pause", "-q", Q, "--for", "600"], redis_url)
    raw, mark = _mark(redis_url)
    assert mark.since is not None
    assert raw == PauseMark(since=mark.since, until=mark.since + 600).encode()
    assert result.stdout == (
        f"claimkit pause {Q}: paused since {format_time(mark.since)}, "
        f"until {format_time(mark.since + 600)}\n"
    )
    ttl = redis(redis_url, lambda s: s.command("TTL", PAUSED))
    assert 0 < ttl <= 600
    assert invoke(["pause", "-q", Q, "--for", "0"], redis_url).exit_code == 2


def test_a_pause_key_of_another_type_is_one_line(redis_url: str) -> None:
    redis(redis_url, lambda s: s.command("RPUSH", PAUSED, "x"))
    for args in (["pause", "-q", Q], ["resume", "-q", Q], ["inspect", "-q", Q]):
        one_line_error(
            invoke(args, redis_url),
            f"key '{PAUSED}' holds a list, not a string: is the queue or list name right?",
        )
    assert redis(redis_url, lambda s: s.command("LRANGE", PAUSED, 0, -1)) == [b"x"]


def test_a_hand_made_key_pauses_and_resume_says_so(redis_url: str) -> None:
    redis(redis_url, lambda s: s.command("SET", PAUSED, "1"))
    shown = invoke(["inspect", "-q", Q], redis_url)
    assert "paused since an unknown time\n" in shown.stdout
    doc = json.loads(invoke(["inspect", "-q", Q, "--json"], redis_url).stdout)
    assert doc["paused"] == {"since": None, "reason": None, "until": None}
    assert invoke(["resume", "-q", Q], redis_url).stdout == (
        f"claimkit resume {Q}: resumed; it was paused since an unknown time\n"
    )


def test_inspect_shows_the_pause_and_only_while_paused(redis_url: str) -> None:
    plain = invoke(["inspect", "-q", Q], redis_url)
    assert "paused" not in plain.stdout
    assert json.loads(invoke(["inspect", "-q", Q, "--json"], redis_url).stdout)["paused"] is None
    invoke(["pause", "-q", Q, "--reason", "redis move"], redis_url)
    _raw, mark = _mark(redis_url)
    assert mark.since is not None
    lines = invoke(["inspect", "-q", Q], redis_url).stdout.splitlines()
    assert lines[0].startswith(f"queue {Q}  on ")
    assert lines[1] == f"paused since {format_time(mark.since)} (redis move)"
    assert lines[2].startswith("pending 0  claimed 0")
    doc = json.loads(invoke(["inspect", "-q", Q, "--json"], redis_url).stdout)
    assert list(doc)[:4] == ["queue", "redis_url", "server_time", "paused"]
    assert doc["paused"] == {"since": mark.since, "reason": "redis move", "until": None}


def _held_claim(url: str, rid: str) -> None:
    """A claim as a consumer holds it: live lease, owner token, pending score 100."""
    now = server_now_sync(url)
    env = json.dumps({"internal": {}, "request_kind": "plain", "data": {"id": rid}})
    redis(
        url,
        lambda s: s.pipeline(
            [
                ("HSET", f"{Q}:claimed", rid, env, f"{rid}:score", 100),
                ("HSET", f"{Q}:claim-owners", rid, "a" * 32),
                ("ZADD", f"{Q}:claims-idx", now + 300, rid),
            ],
            transaction=True,
        ),
    )


HINT = (
    f"claimkit drain: hint: {Q} is not paused, so running consumers claim the released "
    f"requests again; to hand them back for good run 'claimkit pause -q {Q}' first "
    "(docs/operations.md#a-planned-restart)\n"
)


def test_drain_hints_to_pause_first_only_when_not_paused(redis_url: str) -> None:
    _held_claim(redis_url, "r1")
    dry = invoke(["drain", "-q", Q, "--release-all", "--dry-run"], redis_url)
    assert dry.stderr == HINT
    drained = invoke(["drain", "-q", Q, "--release-all"], redis_url)
    assert drained.stdout.splitlines()[-1] == (
        f"claimkit drain {Q}: released=1 of 1 claims gone=0 renewed=0 other_owner=0 ghosts=0"
    )
    assert drained.stderr == HINT
    nothing = invoke(["drain", "-q", Q, "--release-all"], redis_url)
    assert nothing.stderr == "", "nothing released: no hint"

    _held_claim(redis_url, "r2")
    invoke(["pause", "-q", Q], redis_url)
    paused = invoke(["drain", "-q", Q, "--release-all"], redis_url)
    assert paused.stdout.splitlines()[-1] == (
        f"claimkit drain {Q}: released=1 of 1 claims gone=0 renewed=0 other_owner=0 ghosts=0"
    )
    assert paused.stderr == ""


# -- real consumers, the real simulator ------------------------------------------------------


def consumer_config(url: str, gateway: str, concurrency: int = 8) -> Any:
    doc = {
        "url": url,
        "poll_interval_ms": 20,
        "claim_lease_ttl_seconds": 3,  # a heartbeat every second
        "claim_reclaim_interval_ms": 100,
        "concurrency": concurrency,
        "metrics_port": 0,
        "health_port": 0,
        "drain_timeout_seconds": 2,
        "queues": [{"queue_name": Q, "igw_base_url": gateway}],
    }
    return load_config(inline=json.dumps(doc))


def requests(ids: list[str], deadline: int) -> list[dict[str, Any]]:
    return [
        {"id": rid, "deadline": deadline, "payload": {"id": rid, "prompt": "hi"}} for rid in ids
    ]


async def sim_calls(gateway: str) -> dict[str, int]:
    async with httpx.AsyncClient() as client:
        calls: dict[str, int] = (await client.get(f"{gateway}/stats")).json()["calls_by_id"]
        return calls


async def counts(store: Store) -> dict[str, int]:
    k = QueueOps(store, Q).keys
    replies = await store.pipeline(
        [("ZCARD", k.pending), ("HLEN", k.owners), ("ZCARD", k.index), ("LLEN", "result-list")],
        transaction=True,
    )
    return dict(zip(["pending", "claims", "leases", "records"], replies, strict=True))


async def records(store: Store) -> list[dict[str, Any]]:
    return [json.loads(r) for r in reversed(await store.command("LRANGE", "result-list", 0, -1))]


def paused_gauge(consumer: Consumer) -> float | None:
    labels = {"queue_id": Q, "queue_name": Q, "pool_name": ""}
    return consumer.metrics.registry.get_sample_value("llm_d_async_async_queue_paused", labels)


async def polls_after(store: Store, n: int) -> None:
    """Wait until the consumers have peeked ``n`` more times (``GET`` of the pause key,
    counted by Redis): proof that polls ran, not a sleep."""
    start = (await command_calls(store)).get("get", 0)

    async def done() -> bool:
        return (await command_calls(store)).get("get", 0) >= start + n

    await wait_for(done, f"{n} more polls")


async def test_paused_queue_claims_nothing_new_while_work_in_flight_finishes(
    store: Store, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="claimkit")
    deadline = int(await server_now(store)) + 600
    with trio.fail_after(60):
        async with trio.open_nursery() as sim:
            gateway = await sim.start(serve_sim, SimConfig(latency=(1.5, 1.5)))
            consumer = Consumer(consumer_config(redis_url, gateway), store)
            producer = Producer(store, Q)
            await producer.submit_many(requests(["slow"], deadline))
            async with trio.open_nursery() as nursery:
                await nursery.start(consumer.run)

                async def in_flight() -> bool:
                    return (await sim_calls(gateway)) == {"slow": 1}

                await wait_for(in_flight, "the slow request at the gateway")
                assert (await pause_queue(store, Q, reason="test")).changed

                async def seen_paused() -> bool:
                    return paused_gauge(consumer) == 1.0

                await wait_for(seen_paused, "the consumer to see the pause")
                later = [f"later-{i}" for i in range(5)]
                await producer.submit_many(requests(later, deadline + 1))

                async def slow_done() -> bool:
                    return (await counts(store))["records"] == 1

                await wait_for(slow_done, "the in-flight request's record")
                await polls_after(store, 10)
                assert await counts(store) == {"pending": 5, "claims": 0, "leases": 0, "records": 1}
                assert await sim_calls(gateway) == {"slow": 1}
                assert consumer.summary.claimed == 1
                assert consumer.summary.acked == 1

                assert await resume_queue(store, Q) is not None

                async def all_done() -> bool:
                    return (await counts(store))["records"] == 6

                await wait_for(all_done, "every record after the resume")
                assert paused_gauge(consumer) == 0.0
                consumer.request_stop()
            assert await sim_calls(gateway) == dict.fromkeys(["slow", *later], 1)
            sim.cancel_scope.cancel()
    got = await records(store)
    assert got[0]["id"] == "slow"
    assert sorted(r["id"] for r in got[1:]) == later  # served together: any order
    assert {r["status_code"] for r in got} == {200}
    assert await counts(store) == {"pending": 0, "claims": 0, "leases": 0, "records": 6}
    messages = [r.getMessage() for r in caplog.records if r.name == "claimkit"]
    assert (
        messages.count(
            f"queue {Q} is paused (test): claiming nothing new from it; work in flight goes on"
        )
        == 1
    )
    assert messages.count(f"queue {Q} is resumed: claiming again") == 1


async def test_a_paused_queue_drains_to_zero_claims_with_consumers_running(
    store: Store, redis_url: str
) -> None:
    """Two consumers hold 12 slow requests; the queue is paused, then drained: zero
    claims, all 12 pending, and nothing re-claimed over many polls (no request sent twice).
    The resume gives each request exactly one record; each released request is sent once
    more (a release means its work is redone)."""
    deadline = int(await server_now(store)) + 600
    ids = [f"r{i:02d}" for i in range(12)]
    with trio.fail_after(90):
        async with trio.open_nursery() as sim:
            # Slow enough that the work in flight is still at the gateway when the drain
            # releases it and the consumers drop it at their next heartbeat (within 1 s).
            gateway = await sim.start(serve_sim, SimConfig(latency=(5.0, 5.0)))
            # A free worker slot on each: a poller peeks (and sees the pause) only with one.
            config = consumer_config(redis_url, gateway, concurrency=16)
            consumers = [Consumer(config, store) for _ in range(2)]
            await Producer(store, Q).submit_many(requests(ids, deadline))
            async with trio.open_nursery() as nursery:
                for consumer in consumers:
                    await nursery.start(consumer.run)

                async def all_held() -> bool:
                    return (await counts(store))["claims"] == 12

                await wait_for(all_held, "every request claimed")
                assert sum(c.summary.claimed for c in consumers) == 12
                await pause_queue(store, Q, reason="planned restart")

                async def both_paused() -> bool:
                    return all(paused_gauge(c) == 1.0 for c in consumers)

                await wait_for(both_paused, "both consumers to see the pause")
                drained = await trio.to_thread.run_sync(
                    invoke, ["drain", "-q", Q, "--release-all"], redis_url
                )
                assert drained.exit_code == 0, drained.output
                assert drained.stdout.splitlines()[-1] == (
                    f"claimkit drain {Q}: released=12 of 12 claims gone=0 renewed=0 "
                    "other_owner=0 ghosts=0"
                )
                assert drained.stderr == ""

                async def dropped() -> bool:
                    return sum(c.summary.released_elsewhere for c in consumers) == 12

                await wait_for(dropped, "the heartbeats to drop the released work")
                await polls_after(store, 20)
                assert await counts(store) == {
                    "pending": 12,
                    "claims": 0,
                    "leases": 0,
                    "records": 0,
                }
                assert await sim_calls(gateway) == dict.fromkeys(ids, 1), "none sent twice"
                assert sum(c.summary.claimed for c in consumers) == 12, "none re-claimed"
                assert await read_pause(store, Q) is not None

                assert await resume_queue(store, Q) is not None

                async def every_record() -> bool:
                    return (await counts(store))["records"] == 12

                await wait_for(every_record, "every record after the resume")
                for consumer in consumers:
                    consumer.request_stop()
            assert await sim_calls(gateway) == dict.fromkeys(ids, 2)
            sim.cancel_scope.cancel()
    got = await records(store)
    assert sorted(r["id"] for r in got) == ids
    assert {r["status_code"] for r in got} == {200}
    assert sum(c.summary.claimed for c in consumers) == 24
    assert await counts(store) == {"pending": 0, "claims": 0, "leases": 0, "records": 12}
