"""Enqueue order (docs/protocol.md#enqueue-order) and the producer's payload references
(docs/protocol.md#payload-references), on a real Redis.

Requests of one deadline are served in the order they were submitted, and keep that order
through a release, a redelivery and a retry; members written byte for byte as llm-d-async's
producers write them (``internal.enqueue_seq``, or the older ``internal.enqueued_at_ms``)
are claimed, released, redelivered and retried at the score upstream gives them. Every
test that takes ``store`` runs again on a Redis Cluster (tests/test_enqueue_order_cluster.py).
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

import pytest
import trio
from support import (
    invoke,
    is_cluster,
    make_config,
    redis,
    server_now,
    snapshot,
    wait_for,
    zrange,
)

from claimkit.consumer.consumer import Consumer
from claimkit.consumer.dispatch import Done
from claimkit.ops.inspect import snapshot as inspect_snapshot
from claimkit.producer import INVALID_PAYLOAD_MESSAGE, Producer, SubmitError
from claimkit.protocol import keys as _keys
from claimkit.protocol.models import Envelope, TerminalRecord, parse_member, retry_member
from claimkit.protocol.ops import ClaimCode, QueueOps, new_token
from claimkit.protocol.replies import ParkCode, ReleaseCode

if TYPE_CHECKING:
    from claimkit.consumer.consumer import QueueRuntime
    from claimkit.consumer.dispatch import Outcome
    from claimkit.store import Store

Q = "eq"
STEP = 1 / 2**21
# Submission order on purpose unlike the ids' byte order and their tokens'.
IDS = ["r-7", "r-2", "r-9", "r-0", "r-5", "r-1", "r-8", "r-3", "r-6", "r-4"]


def seq_key(store: Store, deadline: int, queue: str = Q) -> str:
    return _keys.request_seq(queue, deadline, cluster=is_cluster(store))


def envelope(raw: bytes) -> Envelope:
    parsed = parse_member(raw)
    assert isinstance(parsed, Envelope), parsed
    return parsed


def ids_of(members: list[bytes]) -> list[str]:
    return [envelope(m).id for m in members]


async def future(store: Store, seconds: int = 3600) -> int:
    return int(await server_now(store)) + seconds


async def submit_one_by_one(store: Store, deadline: int, ids: list[str] = IDS) -> list[str]:
    producer = Producer(store, Q)
    return [await producer.submit({"id": rid, "deadline": deadline}) for rid in ids]


async def claim_all(ops: QueueOps, lease_ttl: float = 60) -> dict[str, str]:
    """Peek and claim every pending member, in peek order; ``{id: ownership token}``."""
    envs = [envelope(m) for m in await ops.peek(100)]
    pairs = [(env, new_token()) for env in envs]
    _, codes = await ops.claim(pairs, lease_ttl)
    assert codes == [ClaimCode.CLAIMED] * len(pairs)
    return {env.id: token for env, token in pairs}


# -- submission order ---------------------------------------------------------------------------


async def test_ten_requests_of_one_deadline_are_claimed_in_submission_order(store: Store) -> None:
    with trio.fail_after(20):
        d = await future(store)
        tokens = await submit_one_by_one(store, d)
        pending = await zrange(store, Q)
        assert ids_of([m for m, _ in pending]) == IDS
        assert [s for _, s in pending] == [d + k * STEP for k in range(1, 11)]
        for k, (raw, _) in enumerate(pending, start=1):
            env = envelope(raw)
            assert (env.enqueue_seq, env.request_token) == (k, tokens[k - 1])
            assert json.loads(raw)["internal"] == {"request_token": tokens[k - 1], "enqueue_seq": k}
        assert await store.command("GET", seq_key(store, d)) == b"10"
        assert await store.command("EXPIRETIME", seq_key(store, d)) == d + 3600

        ops = QueueOps(store, Q)
        assert ids_of(await ops.peek(10)) == IDS
        held = await claim_all(ops)
        assert list(held) == IDS
        # Each claim remembers its score, the one a release or reclaim puts back.
        for k, rid in enumerate(IDS, start=1):
            field = _keys.claimed_score_field(rid)
            assert float(await store.command("HGET", ops.keys.claimed, field)) == d + k * STEP


async def test_inspect_gives_the_next_deadline_without_the_fraction(store: Store) -> None:
    with trio.fail_after(20):
        d = await future(store)
        await submit_one_by_one(store, d, ["a", "b"])
        shown = await inspect_snapshot(store, Q)
        assert (shown.pending, shown.oldest_pending_deadline) == (2, float(d))


async def test_one_batch_is_ordered_as_given(store: Store) -> None:
    with trio.fail_after(20):
        d = await future(store)
        await Producer(store, Q).submit_many([{"id": rid, "deadline": d} for rid in IDS])
        assert ids_of(await QueueOps(store, Q).peek(10)) == IDS
        assert [s for _, s in await zrange(store, Q)] == [d + k * STEP for k in range(1, 11)]


async def run_until_all_recorded(consumer: Consumer, store: Store) -> None:
    """Run ``consumer`` until the result list holds a record for each of IDS, then stop it."""
    async with trio.open_nursery() as nursery:
        await nursery.start(consumer.run)

        async def done() -> bool:
            return bool(await store.command("LLEN", "result-list") == len(IDS))

        await wait_for(done, "ten records")
        consumer.request_stop()


async def test_a_consumer_dispatches_in_submission_order(redis_url: str, store: Store) -> None:
    seen: list[str] = []

    async def handler(q: QueueRuntime, env: Envelope, now: float) -> Outcome:
        seen.append(env.id)
        return Done(TerminalRecord.http(env.id, 200, "{}"))

    with trio.fail_after(20):
        d = await future(store)
        await submit_one_by_one(store, d)
        await run_until_all_recorded(
            Consumer(make_config(redis_url, queue=Q), store, handler=handler), store
        )
        assert seen == IDS


async def test_workers_keep_dispatch_order_and_are_reused(redis_url: str, store: Store) -> None:
    """With fewer worker slots than requests, each poll batch still enters the handler in
    submission order, and the requests run on at most ``concurrency`` worker tasks, which
    take one request after another."""
    seen: list[str] = []
    tasks: set[int] = set()

    async def handler(q: QueueRuntime, env: Envelope, now: float) -> Outcome:
        seen.append(env.id)
        tasks.add(id(trio.lowlevel.current_task()))
        await trio.sleep(0.01)
        return Done(TerminalRecord.http(env.id, 200, "{}"))

    with trio.fail_after(20):
        d = await future(store)
        await submit_one_by_one(store, d)
        config = make_config(redis_url, queue=Q, concurrency=3, batch_size=3)
        await run_until_all_recorded(Consumer(config, store, handler=handler), store)
        assert seen == IDS
        assert 1 <= len(tasks) <= 3


# -- the order survives a release, a redelivery and a retry ---------------------------------------


async def _drop_score_fields(store: Store, ops: QueueOps) -> None:
    """Delete every ``<id>:score`` field (a hand edit): the scripts then fall back to the
    member's own queue score."""
    for rid in IDS:
        assert await store.command("HDEL", ops.keys.claimed, _keys.claimed_score_field(rid)) == 1


@pytest.mark.parametrize("broken", [False, True], ids=["score-field", "fallback"])
async def test_the_order_survives_a_release(store: Store, broken: bool) -> None:
    with trio.fail_after(20):
        d = await future(store)
        await submit_one_by_one(store, d)
        before = await zrange(store, Q)
        ops = QueueOps(store, Q)
        held = await claim_all(ops)
        if broken:
            await _drop_score_fields(store, ops)
        # Handed back last first, as a sweep may: the scores put them back in order.
        codes = await ops.release([(rid, held[rid], None) for rid in reversed(IDS)])
        assert codes == [ReleaseCode.RELEASED] * len(IDS)
        assert await zrange(store, Q) == before
        assert ids_of(await ops.peek(10)) == IDS


@pytest.mark.parametrize("broken", [False, True], ids=["score-field", "fallback"])
async def test_the_order_survives_a_redelivery(store: Store, broken: bool) -> None:
    with trio.fail_after(20):
        d = await future(store)
        await submit_one_by_one(store, d)
        before = await zrange(store, Q)
        ops = QueueOps(store, Q)
        await claim_all(ops, lease_ttl=0.05)  # the owner "dies": nothing renews
        if broken:
            await _drop_score_fields(store, ops)
        redelivered = 0

        async def all_back() -> bool:
            nonlocal redelivered
            redelivered += (await ops.reclaim(max_deliveries=10)).redelivered
            return redelivered == len(IDS)

        await wait_for(all_back, "the leases to lapse")
        assert await zrange(store, Q) == before
        assert ids_of(await ops.peek(10)) == IDS


async def test_the_order_survives_a_retry(store: Store) -> None:
    with trio.fail_after(20):
        d = await future(store)
        await submit_one_by_one(store, d)
        before = await zrange(store, Q)
        ops = QueueOps(store, Q)
        held = await claim_all(ops)
        copies = {m: retry_member(m, Q) for m, _ in before}
        by_id = {envelope(m).id: copy for m, copy in copies.items()}
        _, codes = await ops.park([(rid, held[rid], 0.0, by_id[rid]) for rid in reversed(IDS)])
        assert codes == [ParkCode.PARKED] * len(IDS)
        assert await ops.move_retries() == (len(IDS), 0)
        # The retry copies (retry_count 1) stand where their requests stood.
        assert await zrange(store, Q) == [(copies[m], score) for m, score in before]
        assert [envelope(m).retry_count for m in await ops.peek(10)] == [1] * len(IDS)
        assert ids_of(await ops.peek(10)) == IDS


# -- the counters -------------------------------------------------------------------------------


async def test_each_queue_and_deadline_counts_from_one(store: Store) -> None:
    with trio.fail_after(20):
        d1 = await future(store)
        d2 = d1 + 60
        other = "eq-other"
        await Producer(store, Q).submit_many(
            [{"id": "a", "deadline": d1}, {"id": "b", "deadline": d2}, {"id": "c", "deadline": d1}]
        )
        await Producer(store, other).submit({"id": "x", "deadline": d1})
        pending = await zrange(store, Q)
        assert [(envelope(m).id, envelope(m).enqueue_seq, s) for m, s in pending] == [
            ("a", 1, d1 + STEP),
            ("c", 2, d1 + 2 * STEP),
            ("b", 1, d2 + STEP),
        ]
        assert [(envelope(m).enqueue_seq, s) for m, s in await zrange(store, other)] == [
            (1, d1 + STEP)
        ]
        for queue, d, count in ((Q, d1, b"2"), (Q, d2, b"1"), (other, d1, b"1")):
            key = seq_key(store, d, queue)
            assert await store.command("GET", key) == count
            assert await store.command("EXPIRETIME", key) == d + 3600


async def test_a_tagged_queue_keeps_its_counter_in_its_own_slot(store: Store) -> None:
    with trio.fail_after(20):
        queue = "{tenant}:eq"
        d = await future(store)
        await Producer(store, queue).submit({"id": "a", "deadline": d})
        key = f"request-seq:{queue}:{d}"  # a tagged name is not wrapped again
        assert _keys.request_seq(queue, d, cluster=is_cluster(store)) == key
        assert _keys.key_slot(key) == _keys.key_slot(queue)
        assert await store.command("GET", key) == b"1"


async def test_the_count_caps_below_the_next_second(store: Store) -> None:
    with trio.fail_after(20):
        d = await future(store)
        await store.command("SET", seq_key(store, d), 2097149, "EXAT", d + 3600)
        await Producer(store, Q).submit_many([{"id": rid, "deadline": d} for rid in "abcd"])
        got = [(envelope(m).id, envelope(m).enqueue_seq, s) for m, s in await zrange(store, Q)]
        top = d + 2097151 * STEP
        assert top < d + 1
        assert got[0] == ("a", 2097150, d + 2097150 * STEP)
        # From the cap on the scores tie (their order is then the members' bytes'), but each
        # member still carries its exact count.
        assert sorted(got[1:]) == [("b", 2097151, top), ("c", 2097152, top), ("d", 2097153, top)]


async def test_an_expired_deadline_creates_no_counter(store: Store) -> None:
    with trio.fail_after(20):
        d = int(await server_now(store)) - 1
        with pytest.raises(SubmitError, match=r"^deadline has already expired$"):
            await Producer(store, Q).submit({"id": "a", "deadline": d})
        assert await store.command("KEYS", "*") == []


@pytest.mark.parametrize(
    ("seed", "what"),
    [
        (["HSET", "KEY", "f", "1"], "holds a hash, not a count"),
        (["RPUSH", "KEY", "1"], "holds a list, not a count"),
        (["SET", "KEY", "abc"], "holds a string that is not a count"),
        (["SET", "KEY", "-3"], "holds a string that is not a count"),
        (["SET", "KEY", "1.5"], "holds a string that is not a count"),
        (["SET", "KEY", "007"], "holds a string that is not a count"),
        (["SET", "KEY", "1" * 16], "holds a string that is not a count"),
    ],
)
async def test_a_counter_that_cannot_count_refuses_before_any_write(
    store: Store, seed: list[Any], what: str
) -> None:
    with trio.fail_after(20):
        d = await future(store)
        key = seq_key(store, d)
        await store.command(*[key if a == "KEY" else a for a in seed])
        before = await snapshot(store)
        with pytest.raises(SubmitError) as info:
            await Producer(store, Q).submit_many(
                [{"id": "a", "deadline": d + 1}, {"id": "b", "deadline": d}]
            )
        assert str(info.value) == (
            f"{key} {what}: the queue's enqueue-order counter "
            "(docs/protocol.md#enqueue-order); delete it to submit again"
        )
        assert info.value.index == 1
        after = await snapshot(store)
        if not is_cluster(store):
            assert after == before  # one script: all or none
        else:
            # The markers go first, the queue per deadline last: "a" is queued, "b" is not.
            assert [envelope(m).id for m, _ in after.pop(Q)] == ["a"]
            assert after.pop(seq_key(store, d + 1))[0] == b"1"
            active = sorted(k for k in after if k.startswith("request-active:"))
            assert active == ["request-active:a", "request-active:b"]
            for k in active:
                del after[k]
            assert after == before


# -- members as llm-d-async writes them -----------------------------------------------------------

TOKEN = "0123456789abcdef0123456789abcdef"
D = 1900000000


def upstream(rid: str, internal: str) -> bytes:
    """A member as Go's json.Marshal writes it (field order of upstream's structs)."""
    return (
        '{"internal":{"request_token":"' + TOKEN + '","request_queue_name":"' + Q + '",'
        '"result_queue_name":"results"' + internal + '},"request_kind":"plain",'
        '"data":{"id":"' + rid + '","created":1899990000,"deadline":' + str(D) + ","
        '"payload":{"prompt":"x"}}}'
    ).encode()


# (member, the score string llm-d-async writes it at: Go's %.17g, printed by Go itself)
UPSTREAM = [
    (upstream("bare", ""), "1900000000"),
    (upstream("s1", ',"enqueue_seq":1'), "1900000000.0000005"),
    (upstream("s2", ',"enqueue_seq":2'), "1900000000.000001"),
    (upstream("p1", ',"enqueue_seq":3'), "1900000000.0000014"),
    (upstream("s4", ',"enqueue_seq":4'), "1900000000.0000019"),
    (upstream("old", ',"enqueued_at_ms":1899999990000'), "1900000000.9999237"),
]
UPSTREAM_IDS = ["bare", "s1", "s2", "p1", "s4", "old"]


def test_the_brief_example_is_byte_exact() -> None:
    assert UPSTREAM[3][0] == (
        b'{"internal":{"request_token":"0123456789abcdef0123456789abcdef",'
        b'"request_queue_name":"eq","result_queue_name":"results","enqueue_seq":3},'
        b'"request_kind":"plain","data":{"id":"p1","created":1899990000,"deadline":1900000000,'
        b'"payload":{"prompt":"x"}}}'
    )
    for raw, score in UPSTREAM:
        assert envelope(raw).score == float(score)


async def _seed_upstream(store: Store) -> list[tuple[bytes, float]]:
    args: list[Any] = []
    for raw, score in reversed(UPSTREAM):
        args += [score, raw]
    await store.command("ZADD", Q, *args)
    pending = await zrange(store, Q)
    assert pending == [(raw, float(score)) for raw, score in UPSTREAM]
    return pending


@pytest.mark.parametrize("broken", [False, True], ids=["score-field", "fallback"])
async def test_upstream_members_are_released_and_redelivered_at_their_score(
    store: Store, broken: bool
) -> None:
    with trio.fail_after(20):
        before = await _seed_upstream(store)
        ops = QueueOps(store, Q)
        assert ids_of(await ops.peek(10)) == UPSTREAM_IDS
        held = await claim_all(ops)
        if broken:
            for rid in UPSTREAM_IDS:
                await store.command("HDEL", ops.keys.claimed, _keys.claimed_score_field(rid))
        await ops.release([(rid, held[rid], None) for rid in reversed(UPSTREAM_IDS)])
        assert await zrange(store, Q) == before

        await claim_all(ops, lease_ttl=0.05)
        if broken:
            for rid in UPSTREAM_IDS:
                await store.command("HDEL", ops.keys.claimed, _keys.claimed_score_field(rid))
        back = 0

        async def all_back() -> bool:
            nonlocal back
            back += (await ops.reclaim(max_deliveries=10)).redelivered
            return back == len(UPSTREAM)

        await wait_for(all_back, "the leases to lapse")
        assert await zrange(store, Q) == before


async def test_upstream_members_are_retried_at_their_score(store: Store) -> None:
    with trio.fail_after(20):
        before = await _seed_upstream(store)
        ops = QueueOps(store, Q)
        held = await claim_all(ops)
        copies = [(retry_member(raw, Q), score) for raw, score in before]
        parked = [(envelope(c).id, c) for c, _ in copies]
        _, codes = await ops.park([(rid, held[rid], 0.0, c) for rid, c in reversed(parked)])
        assert codes == [ParkCode.PARKED] * len(UPSTREAM)
        assert await ops.move_retries() == (len(UPSTREAM), 0)
        assert await zrange(store, Q) == copies


# -- payload references (the producer's side) --------------------------------------------------


async def test_payload_refs_keep_the_payload_apart(store: Store) -> None:
    with trio.fail_after(20):
        d = await future(store)
        payload = {"prompt": 'ü <&> "enqueue_seq":-1', "n": [1, 2.5, None], "nested": {}}
        producer = Producer(store, Q, payload_refs=True)
        tokens = await producer.submit_many(
            [
                {
                    "internal": {"queue_id": "qid", "result_queue_name": "mine"},
                    "request_kind": "plain",
                    "data": {"id": "a", "deadline": d, "payload": payload, "endpoint": "/x"},
                },
                {"id": "b", "deadline": d},  # no payload: the key holds null
            ]
        )
        ref_a = f"request-payload:a:{tokens[0]}"
        ref_b = f"request-payload:b:{tokens[1]}"
        expected_a = (
            '{"internal":{"queue_id":"qid","result_queue_name":"mine","payload_ref":"'
            + ref_a
            + '","request_token":"'
            + tokens[0]
            + '","enqueue_seq":1},"request_kind":"plain","data":{"id":"a","deadline":'
            + str(d)
            + ',"payload":null,"endpoint":"/x"}}'
        ).encode()
        expected_b = (
            '{"internal":{"request_token":"'
            + tokens[1]
            + '","payload_ref":"'
            + ref_b
            + '","enqueue_seq":2},"request_kind":"plain","data":{"id":"b","deadline":'
            + str(d)
            + ',"payload":null}}'
        ).encode()
        assert await zrange(store, Q) == [(expected_a, d + STEP), (expected_b, d + 2 * STEP)]
        assert envelope(expected_a).payload is None
        assert await store.command("GET", ref_a) == json.dumps(
            payload, separators=(",", ":"), ensure_ascii=False
        ).encode("utf-8")
        assert await store.command("GET", ref_b) == b"null"
        for rid, ref, token in (("a", ref_a, tokens[0]), ("b", ref_b, tokens[1])):
            assert await store.command("PEXPIRETIME", ref) == d * 1000 + 600_000
            assert await store.command("PEXPIRETIME", f"request-active:{rid}") == d * 1000
            assert await store.command("GET", f"request-active:{rid}") == token.encode()


async def test_payload_refs_are_off_by_default_and_the_member_carries_the_payload(
    store: Store,
) -> None:
    with trio.fail_after(20):
        d = await future(store)
        # An unknown nested field spelling the placeholder does not move the count.
        request = {
            "internal": {"x": {"enqueue_seq": -1}},
            "request_kind": "plain",
            "data": {"id": "a", "deadline": d, "payload": {"t": '"enqueue_seq":-1'}},
        }
        (token,) = await Producer(store, Q).submit_many([request])
        ((raw, score),) = await zrange(store, Q)
        assert json.loads(raw) == {
            "internal": {"x": {"enqueue_seq": -1}, "request_token": token, "enqueue_seq": 1},
            "request_kind": "plain",
            "data": {"id": "a", "deadline": d, "payload": {"t": '"enqueue_seq":-1'}},
        }
        assert (envelope(raw).enqueue_seq, score) == (1, d + STEP)
        assert not [k for k in await store.command("KEYS", "*") if b"request-payload" in k]


@pytest.mark.parametrize("refs", [False, True])
async def test_a_payload_ref_of_the_callers_own_is_refused(store: Store, refs: bool) -> None:
    with trio.fail_after(20):
        d = await future(store)
        request = {
            "internal": {"payload_ref": "request-payload:a:old"},
            "request_kind": "plain",
            "data": {"id": "a", "deadline": d, "payload": None},
        }
        with pytest.raises(SubmitError) as info:
            await Producer(store, Q, payload_refs=refs).submit_many([request])
        assert str(info.value) == (
            "internal.payload_ref is the producer's to set: give the payload in data.payload "
            "(docs/protocol.md#payload-references)"
        )
        assert info.value.index == 0
        with pytest.raises(SubmitError, match=rf"^{re.escape(INVALID_PAYLOAD_MESSAGE)}$"):
            await Producer(store, Q, payload_refs=refs).submit(
                {"id": "a", "deadline": d, "payload": [1]}
            )
        assert await store.command("KEYS", "*") == []


def test_cli_submit_payload_ref(redis_url: str) -> None:
    result = invoke(
        ["submit", "-q", Q, "--payload-ref", '{"id":"a","deadline":4102444800,"payload":{"p":1}}'],
        redis_url,
    )
    assert result.exit_code == 0, result.output
    token = result.stdout.strip()

    async def read(store: Store) -> tuple[Any, Any]:
        ((raw, _),) = await zrange(store, Q)
        return json.loads(raw), await store.command("GET", f"request-payload:a:{token}")

    doc, payload = redis(redis_url, read)
    assert doc["internal"] == {
        "request_token": token,
        "payload_ref": f"request-payload:a:{token}",
        "enqueue_seq": 1,
    }
    assert doc["data"] == {"id": "a", "deadline": 4102444800, "payload": None}
    assert payload == b'{"p":1}'


async def test_a_queue_named_like_a_per_request_key_is_refused(store: Store) -> None:
    with trio.fail_after(20):
        d = await future(store)
        for queue in ("request-active:x", "request-seq:q:1", "request-payload:a:b"):
            with pytest.raises(SubmitError) as info:
                await Producer(store, queue).submit({"id": "x", "deadline": d})
            assert str(info.value) == (
                f"queue name {queue!r} is the name of a per-request key (docs/protocol.md#keys): "
                "choose another"
            )
        assert await store.command("KEYS", "*") == []
