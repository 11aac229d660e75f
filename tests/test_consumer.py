"""The consumer in-process, on a private Redis and the real HTTP simulator (SPEC §3, §5).

Its timing (heartbeat cadence, drain and cancel grace, the sweep, the second signal, the
acker's linger, reclaim cadence) is tested on trio's ``autojump_clock`` through the fake
protocol instead, in tests/test_consumer_timing.py; tests/test_model.py checks that fake
against the real scripts."""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any

import pytest
import trio
from support import StoreWrapper, wait_for

from claimkit.config import load_config
from claimkit.consumer.consumer import Consumer, QueueRuntime
from claimkit.consumer.dispatch import Done, Outcome, Retry
from claimkit.dev.sim import SimConfig, serve_sim
from claimkit.producer import Producer
from claimkit.protocol.models import Envelope, TerminalRecord
from claimkit.store import Store, StoreUnavailable, open_store

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from claimkit.store import Arg
    from claimkit.store.scripts import Script

Q = "requests"


def make_config(redis_url: str, gateway: str, **overrides: Any) -> Any:
    doc: dict[str, Any] = {
        "url": redis_url,
        "poll_interval_ms": 20,
        "claim_lease_ttl_seconds": 3,
        "claim_reclaim_interval_ms": 100,
        "metrics_port": 0,
        "health_port": 0,
        "drain_timeout_seconds": 2,
        "queues": [{"queue_name": Q, "igw_base_url": gateway}],
    }
    doc.update(overrides)
    return load_config(inline=json.dumps(doc))


async def records(store: Store, key: str = "result-list") -> list[dict[str, Any]]:
    raw = await store.command("LRANGE", key, 0, -1)
    return [json.loads(r) for r in reversed(raw)]


async def claim_state(store: Store) -> dict[str, Any]:
    return {
        "pending": await store.command("ZCARD", Q),
        "claimed": await store.command("HLEN", f"{Q}:claimed"),
        "owners": await store.command("HLEN", f"{Q}:claim-owners"),
        "index": await store.command("ZCARD", f"{Q}:claims-idx"),
    }


EMPTY = {"pending": 0, "claimed": 0, "owners": 0, "index": 0}


def deadline(seconds: int = 600) -> int:
    return int(time.time()) + seconds


async def test_requests_end_with_one_record_each(store: Store, redis_url: str) -> None:
    with trio.fail_after(20):
        async with trio.open_nursery() as sim:
            gateway = await sim.start(serve_sim, SimConfig(latency=(0.0, 0.01), seed=1))
            consumer = Consumer(make_config(redis_url, gateway), store)
            producer = Producer(store, Q)
            ids = [f"req-{i:03d}" for i in range(60)]
            await producer.submit_many(
                [
                    {"id": rid, "deadline": deadline(), "payload": {"id": rid, "prompt": "hi"}}
                    for rid in ids
                ]
            )
            async with trio.open_nursery() as nursery:
                await nursery.start(consumer.run)

                async def all_done() -> bool:
                    return bool(await store.command("LLEN", "result-list") == len(ids))

                await wait_for(all_done, "60 records")
                consumer.request_stop()
            sim.cancel_scope.cancel()
        got = await records(store)
        assert sorted(r["id"] for r in got) == ids
        assert {r["status_code"] for r in got} == {200}
        assert all(json.loads(r["payload"])["id"] == r["id"] for r in got)
        assert list(got[0]) == ["id", "status_code", "payload", "request_token"]
        tokens = {r["id"]: r["request_token"] for r in got}
        for raw in await store.command("LRANGE", "result-list", 0, -1):
            doc = json.loads(raw)  # the exact bytes: the serialiser's, with the token last
            assert (
                raw
                == TerminalRecord.http(doc["id"], 200, doc["payload"], tokens[doc["id"]]).to_json()
            )
        assert all(len(t) == 32 for t in tokens.values())
        assert await claim_state(store) == EMPTY
        assert consumer.summary.claimed == 60
        assert consumer.summary.acked == 60
        assert consumer.summary.released == 0
        for rid in ids:
            assert await store.command("GET", f"result-terminal:{rid}") is not None


async def _blocking_handler(
    release: trio.Event,
) -> Callable[[QueueRuntime, Envelope, float], Awaitable[Outcome]]:
    async def handler(q: QueueRuntime, env: Envelope, now: float) -> Outcome:
        await release.wait()
        return Done(TerminalRecord.http(env.id, 200, "{}"))

    return handler


async def test_stolen_claim_cancels_work_and_writes_no_record(store: Store, redis_url: str) -> None:
    started = trio.Event()
    cancelled = trio.Event()

    async def handler(q: QueueRuntime, env: Envelope, now: float) -> Outcome:
        started.set()
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()
        raise AssertionError("unreachable")

    with trio.fail_after(20):
        await Producer(store, Q).submit({"id": "x1", "deadline": deadline()})
        consumer = Consumer(make_config(redis_url, "http://127.0.0.1:9"), store, handler=handler)
        async with trio.open_nursery() as nursery:
            await nursery.start(consumer.run)
            await started.wait()
            await store.command("HSET", f"{Q}:claim-owners", "x1", "someone-else")
            await cancelled.wait()  # the next heartbeat (1 s) finds the claim taken
            consumer.request_stop()
        assert consumer.summary.taken_over == 1
        assert consumer.summary.released_elsewhere == 0
        assert consumer.summary.released == 0
        assert await records(store) == []
        # The other owner's claim is untouched.
        assert await store.command("HGET", f"{Q}:claim-owners", "x1") == b"someone-else"


async def test_a_drained_claim_counts_as_released_elsewhere_not_taken_over(
    store: Store, redis_url: str
) -> None:
    """The summary tells a claim another owner took from one handed back to pending by
    someone else (here ``drain``): after a drain nothing was taken over, nothing lost."""
    from claimkit.ops.drain import drain_claims

    started = trio.Event()
    cancelled = trio.Event()

    async def handler(q: QueueRuntime, env: Envelope, now: float) -> Outcome:
        started.set()
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()
        raise AssertionError("unreachable")

    with trio.fail_after(20):
        await Producer(store, Q).submit({"id": "x1", "deadline": deadline()})
        consumer = Consumer(make_config(redis_url, "http://127.0.0.1:9"), store, handler=handler)
        async with trio.open_nursery() as nursery:
            await nursery.start(consumer.run)
            await started.wait()
            report = await drain_claims(store, Q)
            assert report.released == 1
            await cancelled.wait()  # a heartbeat, or claiming it again, finds it released
            consumer.request_stop()
        assert consumer.summary.released_elsewhere == 1
        assert consumer.summary.taken_over == 0
        assert "taken_over=0 released_elsewhere=1 " in consumer.summary.line()
        assert "lost" not in consumer.summary.line()


async def test_malformed_members_are_dead_lettered_and_the_rest_served(
    store: Store, redis_url: str
) -> None:
    bad = [
        b"not json",
        json.dumps({"request_kind": "plain", "data": {"deadline": deadline()}}).encode(),
        json.dumps({"data": {"id": "no-kind", "deadline": deadline()}}).encode(),
        json.dumps({"request_kind": "plain", "data": {"id": "strdl", "deadline": "soon"}}).encode(),
    ]
    with trio.fail_after(20):
        for i, member in enumerate(bad):
            await store.command("ZADD", Q, i + 1, member)
        await Producer(store, Q).submit({"id": "good", "deadline": deadline()})
        async with trio.open_nursery() as sim:
            gateway = await sim.start(serve_sim, SimConfig())
            consumer = Consumer(make_config(redis_url, gateway), store)
            async with trio.open_nursery() as nursery:
                await nursery.start(consumer.run)

                async def good_done() -> bool:
                    return any(r["id"] == "good" for r in await records(store))

                await wait_for(good_done, "good served")
                consumer.request_stop()
            sim.cancel_scope.cancel()
        dead = await store.command("ZRANGE", f"{Q}:dead", 0, -1)
        assert sorted(dead) == sorted(bad)
        by_id = {r["id"]: r for r in await records(store)}
        assert set(by_id) == {"good", "no-kind", "strdl"}
        assert by_id["good"]["status_code"] == 200
        assert by_id["strdl"]["error_code"] == "INVALID_REQUEST"
        assert (
            by_id["strdl"]["error_message"]
            == "Failed: deadline is missing or invalid (Unix seconds)."
        )
        assert by_id["no-kind"]["error_code"] == "INVALID_REQUEST"
        assert consumer.summary.dead_lettered == 4


async def test_retry_parks_then_serves_with_retry_count(store: Store, redis_url: str) -> None:
    seen: list[int] = []

    async def flaky(q: QueueRuntime, env: Envelope, now: float) -> Outcome:
        seen.append(env.retry_count)
        if env.retry_count < 2:
            return Retry(delay=0.05, last=TerminalRecord.http(env.id, 503, "busy"))
        return Done(TerminalRecord.http(env.id, 200, "fine"))

    with trio.fail_after(20):
        await Producer(store, Q).submit({"id": "f1", "deadline": deadline(), "extra": {"keep": 1}})
        consumer = Consumer(make_config(redis_url, "http://127.0.0.1:9"), store, handler=flaky)
        async with trio.open_nursery() as nursery:
            await nursery.start(consumer.run)

            async def done() -> bool:
                return bool(await store.command("LLEN", "result-list") == 1)

            await wait_for(done, "record")
            consumer.request_stop()
        assert seen == [0, 1, 2]
        token = (await store.command("GET", "request-active:f1")).decode()
        assert await store.command("LRANGE", "result-list", 0, -1) == [
            b'{"id":"f1","status_code":200,"payload":"fine","request_token":"%s"}' % token.encode()
        ]
        assert consumer.summary.retried == 2
        assert await store.command("ZCARD", "retry-sortedset") == 0
        assert await claim_state(store) == EMPTY


async def test_cancelled_and_expired_requests_get_their_records(
    store: Store, redis_url: str
) -> None:
    calls: list[str] = []

    async def handler(q: QueueRuntime, env: Envelope, now: float) -> Outcome:
        calls.append(env.id)
        return Done(TerminalRecord.http(env.id, 200, "ok"))

    with trio.fail_after(20):
        producer = Producer(store, Q)
        await producer.submit({"id": "c1", "deadline": deadline()})
        assert await producer.cancel("c1") is True
        assert await producer.cancel("never-submitted") is False
        expired = {"request_kind": "plain", "data": {"id": "e1", "deadline": 1000}}
        await store.command("ZADD", Q, 1000, json.dumps(expired))
        consumer = Consumer(make_config(redis_url, "http://127.0.0.1:9"), store, handler=handler)
        async with trio.open_nursery() as nursery:
            await nursery.start(consumer.run)

            async def done() -> bool:
                return bool(await store.command("LLEN", "result-list") == 2)

            await wait_for(done, "2 records")
            consumer.request_stop()
        by_id = {r["id"]: r for r in await records(store)}
        token = await store.command("GET", "request-cancel:c1")
        assert by_id["c1"] == {
            "id": "c1",
            "payload": '{"error":"cancelled"}',
            "error_code": "CANCELLED",
            "error_message": "cancelled",
            "request_token": token.decode(),
        }
        assert b'{"id":"c1","payload":"{\\"error\\":\\"cancelled\\"}","error_code":"CANCELLED",' + (
            b'"error_message":"cancelled","request_token":"' + token + b'"}'
        ) in await store.command("LRANGE", "result-list", 0, -1)
        assert by_id["e1"] == {  # no internal.request_token: no request_token
            "id": "e1",
            "payload": '{"error":"deadline exceeded"}',
            "error_code": "DEADLINE_EXCEEDED",
            "error_message": "deadline exceeded",
        }
        assert calls == []
        assert await claim_state(store) == EMPTY


async def test_gate_refusal_leaves_member_pending_byte_for_byte(
    store: Store, redis_url: str
) -> None:
    calls: list[str] = []

    async def handler(q: QueueRuntime, env: Envelope, now: float) -> Outcome:
        calls.append(env.id)
        return Done(TerminalRecord.http(env.id, 200, "ok"))

    cfg_queue = {
        "queue_name": Q,
        "igw_base_url": "http://127.0.0.1:9",
        "gate_type": "redis",
        "gate_params": {"key": "budget"},
    }
    with trio.fail_after(20):
        await store.command("SET", "budget", "0")
        await Producer(store, Q).submit({"id": "g1", "deadline": deadline()})
        before = await store.command("ZRANGE", Q, 0, -1, "WITHSCORES")
        consumer = Consumer(
            make_config(redis_url, "http://127.0.0.1:9", queues=[cfg_queue]), store, handler=handler
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(consumer.run)
            # Several poll rounds pass with the gate closed.
            await trio.sleep(0.3)
            assert await store.command("ZRANGE", Q, 0, -1, "WITHSCORES") == before
            assert await claim_state(store) == {**EMPTY, "pending": 1}
            await store.command("SET", "budget", "bogus")  # a gate error: still pending
            await trio.sleep(0.2)
            assert await store.command("ZRANGE", Q, 0, -1, "WITHSCORES") == before
            await store.command("SET", "budget", "1")

            async def done() -> bool:
                return bool(await store.command("LLEN", "result-list") == 1)

            await wait_for(done, "record once the gate opens")
            consumer.request_stop()
        assert calls == ["g1"]


@pytest.mark.slow
async def test_redis_crash_mid_run_loses_nothing(redis_factory: Any) -> None:
    """Redis (AOF always) is SIGKILLed and restarted while the consumer runs."""
    server = redis_factory(aof="always")
    n = 120
    with trio.fail_after(60):
        async with open_store(server.url, timeout=2) as store, trio.open_nursery() as sim:
            gateway = await sim.start(serve_sim, SimConfig(latency=(0.01, 0.05), seed=3))
            ids = [f"k{i:03d}" for i in range(n)]
            await Producer(store, Q).submit_many(
                [{"id": rid, "deadline": deadline(), "payload": {"id": rid}} for rid in ids]
            )
            consumer = Consumer(make_config(server.url, gateway), store)
            async with trio.open_nursery() as nursery:
                await nursery.start(consumer.run)

                async def some_done() -> bool:
                    return bool(await store.command("LLEN", "result-list") >= 20)

                await wait_for(some_done, "first records")
                await trio.to_thread.run_sync(server.kill)
                await trio.sleep(0.5)
                await trio.to_thread.run_sync(server.restart)

                async def all_done() -> bool:
                    try:
                        return bool(await store.command("LLEN", "result-list") == n)
                    except ConnectionError:
                        return False

                await wait_for(all_done, "every record after the restart")
                consumer.request_stop()
            sim.cancel_scope.cancel()
        async with open_store(server.url) as store:
            got = await records(store)
            assert sorted(r["id"] for r in got) == ids  # each exactly once
            assert await claim_state(store) == EMPTY


@pytest.mark.slow
async def test_shutdown_with_redis_gone_is_bounded_and_counts_what_will_lapse(
    redis_factory: Any,
) -> None:
    """Redis dies while claims are held: a second signal cuts the shutdown short (SPEC §5),
    and the summary says how many claims were left to lapse (they are redelivered later)."""
    server = redis_factory()
    never = trio.Event()
    async with open_store(server.url, timeout=0.5) as store:
        await Producer(store, Q).submit_many(
            [{"id": f"z{i}", "deadline": deadline()} for i in range(4)]
        )
        consumer = Consumer(
            make_config(server.url, "http://127.0.0.1:9", drain_timeout_seconds=30),
            store,
            handler=await _blocking_handler(never),
        )
        # Without the hurry this would take a 30 s drain plus a 10 s shutdown budget.
        with trio.fail_after(15):
            async with trio.open_nursery() as nursery:
                await nursery.start(consumer.run)

                # The consumer's own view, not only Redis's: the claim script may have run
                # (HLEN 4) while its reply is still on the way to the poller, and a claim
                # whose reply the consumer never reads is not one it holds or can count.
                async def all_claimed() -> bool:
                    held = await store.command("HLEN", f"{Q}:claim-owners")
                    return consumer.held_count() == 4 and held == 4

                await wait_for(all_claimed, "4 claims, held by the consumer")
                await trio.to_thread.run_sync(server.kill)
                consumer.request_stop()
                consumer.request_stop()  # the second signal: skip the drain, hurry the rest
    assert consumer.summary.left_to_lapse == 4
    assert consumer.summary.released == 0


class LosesFirstClaimReply(StoreWrapper):
    """A store whose first claim reply is lost after Redis ran the script (the connection
    dies on the way back, or the call times out under load)."""

    lost = False

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[Arg]) -> Any:
        reply = await self.inner.run(script, keys, args)
        if script.name == "claim" and not self.lost:
            self.lost = True
            raise StoreUnavailable("Connection lost while receiving response")
        return reply


async def test_a_claim_whose_reply_was_lost_is_said_and_redelivered(
    store: Store, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Claims granted by a call whose reply never came back are Redis's, under tokens the
    consumer never learned: it holds and counts none of them, says so, and their leases
    lapse; its reclaimer redelivers them and each request gets one record."""
    await Producer(store, Q).submit_many(
        [{"id": f"l{i}", "deadline": deadline()} for i in range(2)]
    )

    async def handler(q: QueueRuntime, env: Envelope, now: float) -> Outcome:
        return Done(TerminalRecord.http(env.id, 200, "{}"))

    lossy = LosesFirstClaimReply(store)
    consumer = Consumer(make_config(redis_url, "http://127.0.0.1:9"), lossy, handler=handler)
    with caplog.at_level(logging.WARNING, logger="claimkit"), trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(consumer.run)
            await wait_for(lambda: _count(store, "result-list", 2), "2 records")
            consumer.request_stop()
    assert lossy.lost
    assert sorted(r["id"] for r in await records(store)) == ["l0", "l1"]
    assert await claim_state(store) == {"pending": 0, "claimed": 0, "owners": 0, "index": 0}
    summary = consumer.summary
    assert (summary.claimed, summary.acked, summary.redelivered) == (2, 2, 2)
    assert summary.left_to_lapse == 0
    warnings = [r.getMessage() for r in caplog.records if r.name == "claimkit"]
    assert any(
        m.startswith(f"claim {Q}: Connection lost while receiving response; up to 2 requests")
        for m in warnings
    ), warnings


async def _count(store: Store, key: str, n: int) -> bool:
    return bool(await store.command("LLEN", key) == n)
