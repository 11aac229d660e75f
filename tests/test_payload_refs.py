"""Payload references (docs/protocol.md#payload-references): a member naming
``request-payload:<id>:<token>`` instead of carrying its payload, as llm-d-async's producer
writes it with ``WithPayloadKeys``.

The protocol tests (``store``) run again on a real Redis Cluster in
tests/test_payload_refs_cluster.py; the consumer tests run a real consumer against the real
gateway simulator (``claimkit sim``'s app) on a private standalone Redis.
"""

from __future__ import annotations

import json
from functools import partial
from typing import TYPE_CHECKING, Any

import pytest
import trio
import trio.testing
from fake_ops import START, Call, FakeServer
from support import StoreWrapper, command_calls, is_cluster, make_config, server_now, wait_for
from test_consumer_timing import running

from claimkit.config import load_config
from claimkit.consumer.consumer import Consumer, QueueRuntime
from claimkit.consumer.dispatch import Done, Outcome
from claimkit.dev.sim import SimApp, SimConfig, serve_sim
from claimkit.protocol.keys import key_slot, request_payload
from claimkit.protocol.models import (
    PAYLOAD_MISSING_MESSAGE,
    PAYLOAD_NOT_JSON_MESSAGE,
    Envelope,
    ErrorCode,
    Invalid,
    TerminalRecord,
    max_deliveries_message,
    parse_member,
    payload_problem,
    retry_member,
)
from claimkit.protocol.ops import AckItem, ClaimCode, QueueOps, ReleaseCode, new_token
from claimkit.store import StoreUnavailable, open_store

if TYPE_CHECKING:
    from collections.abc import Sequence

    from conftest import RedisFactory

    from claimkit.store import Arg, Store

Q = "q"
RESULTS = "results"
FAR = int(START) + 100_000
TOKEN = "0123456789abcdef0123456789abcdef"
DEDUP = 100

UPSTREAM_MEMBER = (
    b'{"internal":{"request_token":"0123456789abcdef0123456789abcdef","request_queue_name":"q",'
    b'"result_queue_name":"results","payload_ref":"request-payload:p1:'
    b'0123456789abcdef0123456789abcdef"},"request_kind":"plain","data":{"id":"p1",'
    b'"created":1899990000,"deadline":1900000000,"payload":null}}'
)
"""A member exactly as llm-d-async's producer writes it with ``WithPayloadKeys``
(``SplitPayload``: ``"payload":null``, the routing with its ``payload_ref``)."""

UPSTREAM_MISSING = (
    b'{"id":"p1","payload":"{\\"error\\":\\"request payload is missing\\"}",'
    b'"error_code":"PAYLOAD_UNAVAILABLE","error_message":"request payload is missing",'
    b'"request_token":"0123456789abcdef0123456789abcdef"}'
)
"""llm-d-async's record of that request when its payload key holds nothing."""

# Stored as a producer wrote it: spacing and key order of its own, HTML characters, UTF-8.
PAYLOAD = b'{"id": "p1",  "prompt": "<b>&</b> caf\xc3\xa9", "max_tokens": 4}'


def ref_member(rid: str, token: str, deadline: int, **internal: Any) -> bytes:
    """A member in upstream's layout naming its own payload key (``internal`` adds or
    replaces routing fields; ``payload_ref=None`` leaves the ref out)."""
    routing: dict[str, Any] = {
        "request_token": token,
        "request_queue_name": Q,
        "result_queue_name": RESULTS,
        "payload_ref": request_payload(rid, token),
    }
    routing.update(internal)
    routing = {k: v for k, v in routing.items() if v is not None}
    doc = {
        "internal": routing,
        "request_kind": "plain",
        "data": {"id": rid, "created": deadline - 60, "deadline": deadline, "payload": None},
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def envelope(raw: bytes) -> Envelope:
    parsed = parse_member(raw)
    assert isinstance(parsed, Envelope), parsed
    return parsed


async def claimed(ops: QueueOps, store: Store, raw: bytes) -> tuple[Envelope, str]:
    """``raw`` added to pending and claimed by a fresh token."""
    env = envelope(raw)
    await store.command("ZADD", Q, env.deadline, raw)
    token = new_token()
    _now, codes = await ops.claim([(env, token)], 30)
    assert codes == [ClaimCode.CLAIMED]
    return env, token


def ack_item(env: Envelope, token: str, record: TerminalRecord) -> AckItem:
    return AckItem(
        env.id,
        token,
        env.request_token,
        RESULTS,
        record.for_generation(env.request_token).to_json(),
        env.raw,
        env.payload_ref or "",
    )


async def exists(store: Store, key: str) -> bool:
    return bool(await store.command("EXISTS", key))


# -- the member ---------------------------------------------------------------------------------


def test_upstreams_member_names_its_payload_key() -> None:
    env = envelope(UPSTREAM_MEMBER)
    assert (env.id, env.request_token, env.deadline) == ("p1", TOKEN, 1900000000)
    assert env.payload_ref == "request-payload:p1:0123456789abcdef0123456789abcdef"
    assert env.payload is None
    assert env.body is None
    assert env.body_bytes() == b"null"
    # An empty ref names nothing (upstream's omitempty never writes one).
    assert envelope(ref_member("p1", TOKEN, 1900000000, payload_ref="")).payload_ref is None


@pytest.mark.parametrize(
    ("ref", "token", "reason"),
    [
        (
            "q:claimed",
            TOKEN,
            "Failed: invalid request: internal.payload_ref must be "
            "request-payload:p1:0123456789abcdef0123456789abcdef (the key of this "
            "request's id and request_token), got q:claimed",
        ),
        (
            "request-payload:p2:0123456789abcdef0123456789abcdef",  # another request's
            TOKEN,
            "Failed: invalid request: internal.payload_ref must be "
            "request-payload:p1:0123456789abcdef0123456789abcdef (the key of this "
            "request's id and request_token), got "
            "request-payload:p2:0123456789abcdef0123456789abcdef",
        ),
        (
            "request-payload:p1:",
            None,
            "Failed: invalid request: internal.payload_ref needs an internal.request_token",
        ),
        (
            7,
            TOKEN,
            "Failed: invalid request: Expected `str | null`, got `int` - at "
            "`$.internal.payload_ref`",
        ),
    ],
)
async def test_a_member_naming_another_key_is_dead_lettered(
    store: Store, ref: object, token: str | None, reason: str
) -> None:
    """The one key a member may name is its own; anything else is ``INVALID_REQUEST`` with
    the reason, the record carrying the token, and the named key is neither read nor
    touched."""
    raw = ref_member("p1", TOKEN, 1900000000, payload_ref=ref, request_token=token)
    with trio.fail_after(10):
        ops = QueueOps(store, Q, dedup_ttl=DEDUP)
        await store.command("SET", "q:claimed", "not yours")
        await store.command("ZADD", Q, 1900000000, raw)
        (peeked,) = await ops.peek(10)
        invalid = parse_member(peeked)
        assert isinstance(invalid, Invalid)
        assert invalid.reason == reason
        assert await ops.dead_letter([invalid]) == (1, 1)
        record = TerminalRecord.error("p1", ErrorCode.INVALID_REQUEST, reason, token).to_json()
        assert await store.command("LRANGE", RESULTS, 0, -1) == [record]
        assert await store.command("GET", "q:claimed") == b"not yours"


def test_a_stored_payload_must_be_a_json_object_or_null() -> None:
    for good in (PAYLOAD, b"null", b" \n{}", b'{"a":[1,2]}'):
        assert payload_problem(good) is None, good
    for bad in (b"", b"not json", b"[1,2]", b'"text"', b"3", b"{bad", b'{"a":1} x', b"\xff"):
        assert payload_problem(bad) == PAYLOAD_NOT_JSON_MESSAGE, bad


# -- fetch (docs/protocol.md#payload-references, docs/topology.md#payload-keys) ----------------


class Commands(StoreWrapper):
    """Records every plain command and every pipeline the protocol sends."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.commands: list[list[Arg]] = []
        self.pipelines: list[list[list[Arg]]] = []

    async def command(self, *args: Arg) -> Any:
        self.commands.append(list(args))
        return await self.inner.command(*args)

    async def pipeline(self, commands: Sequence[Sequence[Arg]], *, transaction: bool) -> list[Any]:
        self.pipelines.append([list(c) for c in commands])
        return await self.inner.pipeline(commands, transaction=transaction)


async def test_fetch_reads_every_payload_in_one_round_trip(store: Store) -> None:
    """Standalone: one ``MGET`` of every key. Cluster: the keys hash to different slots,
    so one ``MGET`` per slot, all in one pipeline. A missing key and a key of another type
    read as ``None``; values are the exact stored bytes."""
    refs = [request_payload(f"p{i}", TOKEN) for i in range(6)]
    values: list[bytes | None] = [PAYLOAD, b"null", None, b"\x00\xff raw", None, b"{}"]
    with trio.fail_after(10):
        for ref, value in zip(refs, values, strict=True):
            if value is not None:
                await store.command("SET", ref, value)
        await store.command("HSET", refs[4], "f", "v")  # another type: no payload
        recording = Commands(store)
        ops = QueueOps(recording, Q)
        assert await ops.fetch_payloads(refs) == values
        assert await ops.fetch_payloads([]) == []
    if not is_cluster(store):
        assert recording.commands == [["MGET", *refs]]
        assert recording.pipelines == []
        return
    assert recording.commands == []
    (pipeline,) = recording.pipelines
    slots: dict[int, list[str]] = {}
    for ref in refs:
        slots.setdefault(key_slot(ref), []).append(ref)
    assert len(slots) > 1  # the test means something: the keys are spread over slots
    assert pipeline == [["MGET", *group] for group in slots.values()]


# -- the ack deletes it; nothing else does ------------------------------------------------------


async def test_the_owners_ack_deletes_the_payload_key(store: Store) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, Q, dedup_ttl=DEDUP)
        now = int(await server_now(store))
        env, token = await claimed(ops, store, ref_member("p1", TOKEN, now + 600))
        ref = request_payload("p1", TOKEN)
        await store.command("SET", ref, PAYLOAD, "EX", 3600)
        record = TerminalRecord.http("p1", 200, '{"ok":true}')
        assert await ops.ack([ack_item(env, token, record)]) == [(True, True)]
        assert not await exists(store, ref)
        assert await store.command("LRANGE", RESULTS, 0, -1) == [
            b'{"id":"p1","status_code":200,"payload":"{\\"ok\\":true}",'
            b'"request_token":"0123456789abcdef0123456789abcdef"}'
        ]
        assert await store.command("HLEN", ops.keys.claimed) == 0


async def test_a_stale_ack_leaves_the_payload_key(store: Store) -> None:
    """The first owner lost its claim (handed back, then claimed by another token): its
    late ack is suppressed and deletes nothing, the new owner still needs the payload.
    The new owner's ack deletes it."""
    with trio.fail_after(10):
        ops = QueueOps(store, Q, dedup_ttl=DEDUP)
        now = int(await server_now(store))
        env, stale = await claimed(ops, store, ref_member("p1", TOKEN, now + 600))
        ref = request_payload("p1", TOKEN)
        await store.command("SET", ref, PAYLOAD, "EX", 3600)
        assert await ops.release([("p1", stale, None)]) == [ReleaseCode.RELEASED]
        owner = new_token()
        _now, codes = await ops.claim([(env, owner)], 30)
        assert codes == [ClaimCode.CLAIMED]
        late = TerminalRecord.http("p1", 200, "late")
        assert await ops.ack([ack_item(env, stale, late)]) == [(False, False)]
        assert await store.command("GET", ref) == PAYLOAD
        assert await store.command("LLEN", RESULTS) == 0
        mine = TerminalRecord.http("p1", 200, "mine")
        assert await ops.ack([ack_item(env, owner, mine)]) == [(True, True)]
        assert not await exists(store, ref)


async def test_an_ack_that_withdraws_the_pending_copy_deletes_the_payload_key(
    store: Store,
) -> None:
    """An owner whose claim was handed back (drain, sweep) and not claimed again acks: the
    pending copy is withdrawn and the record pushed, so the request is over and its
    payload key goes too."""
    with trio.fail_after(10):
        ops = QueueOps(store, Q, dedup_ttl=DEDUP)
        now = int(await server_now(store))
        env, token = await claimed(ops, store, ref_member("p1", TOKEN, now + 600))
        ref = request_payload("p1", TOKEN)
        await store.command("SET", ref, PAYLOAD, "EX", 3600)
        assert await ops.release([("p1", token, None)]) == [ReleaseCode.RELEASED]
        record = TerminalRecord.http("p1", 200, "done")
        assert await ops.ack([ack_item(env, token, record)]) == [(True, False)]
        assert await store.command("ZCARD", Q) == 0
        assert not await exists(store, ref)


async def test_release_reclaim_retry_and_dead_letters_keep_the_payload_key(store: Store) -> None:
    """Release, reclaim and a park for retry leave the key alone; the retry copy keeps
    ``"payload":null`` and the ref; reclaim's ``MAX_DELIVERIES_EXCEEDED`` dead letter
    (whose record carries the token) leaves it too, so a requeue can still serve it."""
    ref = request_payload("p1", TOKEN)
    with trio.fail_after(20):
        ops = QueueOps(store, Q, dedup_ttl=DEDUP, default_result_list=RESULTS)
        now = int(await server_now(store))
        raw = ref_member("p1", TOKEN, now + 600)
        env, token = await claimed(ops, store, raw)
        await store.command("SET", ref, PAYLOAD, "EX", 3600)

        assert await ops.release([("p1", token, None)]) == [ReleaseCode.RELEASED]
        assert await store.command("GET", ref) == PAYLOAD

        token = new_token()
        assert (await ops.claim([(env, token)], 30))[1] == [ClaimCode.CLAIMED]
        await store.command("ZADD", ops.keys.index, "XX", 1, "p1")  # the lease lapsed
        counts = await ops.reclaim(max_deliveries=0)
        assert counts.redelivered == 1
        assert await store.command("ZRANGE", Q, 0, -1) == [raw]
        assert await store.command("GET", ref) == PAYLOAD

        token = new_token()
        assert (await ops.claim([(env, token)], 30))[1] == [ClaimCode.CLAIMED]
        parked = retry_member(raw, Q)
        _now, codes = await ops.park([("p1", token, 0.0, parked)])
        assert list(codes) == [1]
        assert await store.command("GET", ref) == PAYLOAD
        doc = json.loads(parked)
        assert doc["data"]["payload"] is None
        assert doc["internal"]["payload_ref"] == ref
        assert doc["internal"]["retry_count"] == 1
        assert await ops.move_retries() == (1, 0)
        assert await store.command("ZRANGE", Q, 0, -1) == [parked]
        assert await store.command("GET", ref) == PAYLOAD

        back = envelope(parked)
        token = new_token()
        assert (await ops.claim([(back, token)], 30))[1] == [ClaimCode.CLAIMED]
        await store.command("ZADD", ops.keys.index, "XX", 1, "p1")
        counts = await ops.reclaim(max_deliveries=1)
        assert counts.dead == 1
        assert await store.command("ZRANGE", ops.keys.dead, 0, -1) == [parked]
        assert await store.command("GET", ref) == PAYLOAD
        message = max_deliveries_message(2, 1)  # the first reclaim counted one already
        assert await store.command("LRANGE", RESULTS, 0, -1) == [
            TerminalRecord.error("p1", ErrorCode.MAX_DELIVERIES_EXCEEDED, message, TOKEN).to_json()
        ]


# -- the consumer, against the real gateway simulator ------------------------------------------


def consumer_config(url: str, gateway: str, **fields: Any) -> Any:
    return make_config(
        url,
        queue=Q,
        gateway=gateway,
        poll_interval_ms=20,
        claim_lease_ttl_seconds=30,
        metrics_port=0,
        health_port=0,
        drain_timeout_seconds=2,
        **fields,
    )


async def run_until(store: Store, consumer: Consumer, records: int) -> None:
    async def done() -> bool:
        return int(await store.command("LLEN", RESULTS)) >= records

    async with trio.open_nursery() as nursery:
        await nursery.start(consumer.run)
        await wait_for(done, f"{records} records")
        consumer.request_stop()


async def test_the_consumer_sends_the_stored_payload_or_ends_with_payload_unavailable(
    store: Store, redis_url: str
) -> None:
    """Upstream's member with its payload key: the gateway gets the stored bytes exactly,
    the record carries the token, and the ack deletes the key. The same member with no
    key, or a key holding something that is not a JSON object, is never sent: exactly
    one ``PAYLOAD_UNAVAILABLE`` record each, upstream's bytes."""
    sim = SimApp(SimConfig(), keep_bodies=True)
    missing, not_json = "m1", "n1"
    with trio.fail_after(30):
        now = int(await server_now(store))
        await store.command("ZADD", Q, 1900000000, UPSTREAM_MEMBER)
        await store.command("SET", request_payload("p1", TOKEN), PAYLOAD, "EX", 3600)
        for rid in (missing, not_json):
            await store.command("ZADD", Q, now + 600, ref_member(rid, TOKEN, now + 600))
        await store.command("SET", request_payload(not_json, TOKEN), b"[1,2]", "EX", 3600)
        async with trio.open_nursery() as nursery:
            gateway = await nursery.start(partial(serve_sim, SimConfig(), app=sim))
            consumer = Consumer(consumer_config(redis_url, gateway), store)
            await run_until(store, consumer, 3)
            nursery.cancel_scope.cancel()
        assert sim.bodies == {"p1": PAYLOAD}
        assert sim.stats()["requests"] == 1
        by_id = {json.loads(r)["id"]: r for r in await store.command("LRANGE", RESULTS, 0, -1)}
        assert set(by_id) == {"p1", missing, not_json}
        ok = json.loads(by_id["p1"])
        assert by_id["p1"] == TerminalRecord.http("p1", 200, ok["payload"], TOKEN).to_json()
        assert json.loads(ok["payload"])["id"] == "p1"
        assert by_id[missing] == UPSTREAM_MISSING.replace(b'"p1"', b'"m1"')
        assert (
            by_id[not_json]
            == TerminalRecord.error(
                not_json, ErrorCode.PAYLOAD_UNAVAILABLE, PAYLOAD_NOT_JSON_MESSAGE, TOKEN
            ).to_json()
        )
        for rid in ("p1", not_json):
            assert not await exists(store, request_payload(rid, TOKEN))
        assert await store.command("ZCARD", Q) == 0
        assert await store.command("HLEN", f"{Q}:claimed") == 0
        s = consumer.summary
        assert (s.claimed, s.acked, s.released) == (3, 3, 0)


def test_upstreams_missing_payload_record_is_claimkits() -> None:
    record = TerminalRecord.error("p1", ErrorCode.PAYLOAD_UNAVAILABLE, PAYLOAD_MISSING_MESSAGE)
    assert record.for_generation(TOKEN).to_json() == UPSTREAM_MISSING


async def test_cancelled_and_expired_requests_are_not_fetched(
    redis_factory: RedisFactory,
) -> None:
    """One poll batch of a cancelled, an expired and a live request, all three naming
    payload keys that exist: the one ``MGET`` (counted by the private server's
    ``INFO commandstats``) reads only the live one's key. The cancelled and the expired
    one get their records without being sent; every ack ended its request, so all three
    keys are gone."""
    server = redis_factory()
    sim = SimApp(SimConfig(), keep_bodies=True)
    with trio.fail_after(30):
        async with open_store(server.url) as store:
            now = int(await server_now(store))
            cancelled, expired, live = "c1", "e1", "l1"
            for rid, deadline in ((cancelled, now + 600), (expired, now - 5), (live, now + 600)):
                await store.command("ZADD", Q, deadline, ref_member(rid, TOKEN, deadline))
                body = b'{"id":"%s"}' % rid.encode()
                await store.command("SET", request_payload(rid, TOKEN), body, "EX", 3600)
            await store.command("SET", f"request-cancel:{cancelled}", TOKEN)
            before = (await command_calls(store)).get("mget", 0)
            recording = Commands(store)
            async with trio.open_nursery() as nursery:
                gateway = await nursery.start(partial(serve_sim, SimConfig(), app=sim))
                consumer = Consumer(consumer_config(server.url, gateway), recording)
                await run_until(store, consumer, 3)
                nursery.cancel_scope.cancel()
            assert (await command_calls(store)).get("mget", 0) - before == 1
            assert [c for c in recording.commands if c[0] == "MGET"] == [
                ["MGET", request_payload(live, TOKEN)]
            ]
            assert sim.bodies == {live: b'{"id":"l1"}'}
            by_id = {json.loads(r)["id"]: r for r in await store.command("LRANGE", RESULTS, 0, -1)}
            assert (
                by_id[cancelled]
                == TerminalRecord.error(
                    cancelled, ErrorCode.CANCELLED, "cancelled", TOKEN
                ).to_json()
            )
            assert (
                by_id[expired]
                == TerminalRecord.error(
                    expired, ErrorCode.DEADLINE_EXCEEDED, "deadline exceeded", TOKEN
                ).to_json()
            )
            assert json.loads(by_id[live])["status_code"] == 200
            for rid in (cancelled, expired, live):
                assert not await exists(store, request_payload(rid, TOKEN))


async def test_a_retried_request_keeps_its_ref_and_is_sent_its_payload_again(
    store: Store, redis_url: str
) -> None:
    """A 503 parks the request: the retry copy keeps ``"payload":null`` and the ref, the
    key stays, and the second attempt sends the same stored bytes; its ack deletes the
    key."""
    sim = SimApp(SimConfig(rate_5xx=1.0), keep_bodies=True)
    ref = request_payload("p1", TOKEN)
    with trio.fail_after(30):
        await store.command("ZADD", Q, 1900000000, UPSTREAM_MEMBER)
        await store.command("SET", ref, PAYLOAD, "EX", 3600)
        async with trio.open_nursery() as nursery:
            gateway = await nursery.start(partial(serve_sim, SimConfig(), app=sim))
            consumer = Consumer(consumer_config(redis_url, gateway), store)
            async with trio.open_nursery() as inner:
                await inner.start(consumer.run)

                async def parked() -> bool:
                    return bool(await store.command("ZCARD", "retry-sortedset"))

                await wait_for(parked, "the 503 parked")
                (member,) = await store.command("ZRANGE", "retry-sortedset", 0, -1)
                assert await store.command("GET", ref) == PAYLOAD
                doc = json.loads(member)
                assert doc["data"]["payload"] is None
                assert doc["internal"]["payload_ref"] == ref
                sim.config.rate_5xx = 0.0  # the gateway recovers
                sim.bodies.clear()
                await store.command("ZADD", "retry-sortedset", "XX", 0, member)  # due now

                async def recorded() -> bool:
                    return bool(await store.command("LLEN", RESULTS))

                await wait_for(recorded, "the record")
                consumer.request_stop()
            nursery.cancel_scope.cancel()
        assert sim.bodies == {"p1": PAYLOAD}
        assert not await exists(store, ref)
        (raw,) = await store.command("LRANGE", RESULTS, 0, -1)
        assert json.loads(raw)["status_code"] == 200
        assert json.loads(raw)["request_token"] == TOKEN


# -- a fetch Redis fails, on the fake protocol (tests/fake_ops.py) ------------------------------


def fake_config(**fields: Any) -> Any:
    """A config for the fake protocol (tests/test_consumer_timing.py's): poll every 1 s."""
    doc: dict[str, Any] = {
        "url": "redis://127.0.0.1:1",
        "poll_interval_ms": 1000,
        "claim_lease_ttl_seconds": 30,
        "metrics_port": 0,
        "health_port": 0,
        "queues": [{"queue_name": Q, "igw_base_url": "http://127.0.0.1:9"}],
    }
    doc.update(fields)
    return load_config(inline=json.dumps(doc))


def fake_ref_request(server: FakeServer, rid: str) -> bytes:
    member = ref_member(rid, TOKEN, FAR)
    server.queue(Q).pending[member] = float(FAR)
    server.payloads[request_payload(rid, TOKEN)] = b'{"id":"%s"}' % rid.encode()
    return member


class Sending:
    """A handler noting the body each request is sent with, and that no claim still holds
    a payload while it is sent (the worker took it)."""

    def __init__(self) -> None:
        self.bodies: list[tuple[float, str, bytes | None]] = []

    async def __call__(self, q: QueueRuntime, env: Envelope, now: float) -> Outcome:
        assert all(c.payload is None for c in q.claims.all())
        self.bodies.append((trio.current_time(), env.id, env.body))
        return Done(TerminalRecord.http(env.id, 200, "ok"))


async def test_a_fetch_redis_fails_hands_the_claims_back_and_writes_no_record(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The first fetch fails (Redis away): the claim is released at once, no record is
    written, and the poller waits its poll interval; the next poll claims it again,
    fetches it and sends it."""
    server = FakeServer()
    member = fake_ref_request(server, "r0")
    failures = [StoreUnavailable("redis away")]

    async def away(call: Call) -> None:
        if failures:
            raise failures.pop()

    server.hooks["fetch_payloads"] = away
    handler = Sending()
    async with running(server, fake_config(), handler) as run:
        await trio.sleep_until(5)
        run.consumer.request_stop()
    fetches = server.log("fetch_payloads")
    assert [(c.at, c.ids) for c in fetches] == [
        (0.0, (request_payload("r0", TOKEN),)),
        (1.0, (request_payload("r0", TOKEN),)),
    ]
    assert [(c.at, c.ids) for c in server.log("release")] == [(0.0, ("r0",))]
    assert handler.bodies == [(1.0, "r0", b'{"id":"r0"}')]
    assert server.records(RESULTS) == [
        {"id": "r0", "status_code": 200, "payload": "ok", "request_token": TOKEN}
    ]
    assert member not in server.queue(Q).pending
    assert request_payload("r0", TOKEN) not in server.payloads  # the ack deleted it
    s = run.summary
    assert (s.claimed, s.released, s.acked, s.left_to_lapse) == (2, 1, 1, 0)


async def test_when_the_hand_back_fails_too_the_claim_lapses(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Fetch and release both fail: the claim is given up (nothing renews it), its lease
    lapses and a reclaim redelivers it; then it is fetched and sent. No record before."""
    server = FakeServer()
    fake_ref_request(server, "r0")
    failing = {"fetch_payloads": 1, "release": 1}

    def once(op: str) -> Any:
        async def hook(call: Call) -> None:
            if failing[op]:
                failing[op] -= 1
                raise StoreUnavailable("redis away")

        return hook

    for op in failing:
        server.hooks[op] = once(op)
    handler = Sending()
    config = fake_config(claim_lease_ttl_seconds=30, claim_reclaim_interval_ms=10_000)
    async with running(server, config, handler) as run:
        await trio.sleep_until(60)
        run.consumer.request_stop()
    assert [c.at for c in server.log("release")] == [0.0]
    # Given up: not renewed while it lapsed (the heartbeat renews the consumer's liveness
    # alone, with no claim).
    assert [c for c in server.log("renew") if c.ids] == []
    (sent,) = handler.bodies
    assert sent[1:] == ("r0", b'{"id":"r0"}')
    assert 30.0 <= sent[0] <= 41.0  # after the lease (30 s), at a reclaim (every 10 s)
    assert [r["id"] for r in server.records(RESULTS)] == ["r0"]
    s = run.summary
    assert (s.claimed, s.acked, s.redelivered, s.left_to_lapse) == (2, 1, 1, 1)
