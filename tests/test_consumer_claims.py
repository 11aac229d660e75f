"""The consumer's claim registry and clock estimate (no Redis): HeldClaims counts every
outcome in the Summary and the queue's metrics at once; ServerClock follows trio's clock.
And the QueueOps methods that replaced the consumer's own Redis calls (real Redis)."""

from __future__ import annotations

import json
import platform
import time
from dataclasses import replace
from typing import TYPE_CHECKING, cast

import pytest
import trio
from support import make_config, pairs

from claimkit.config import ConfigError
from claimkit.consumer.claims import HeldClaims, Summary
from claimkit.consumer.consumer import Consumer
from claimkit.consumer.metrics import Metrics, claimkit_version
from claimkit.consumer.runtime import ServerClock
from claimkit.protocol.models import Envelope, ErrorCode, TerminalRecord, parse_member
from claimkit.protocol.ops import QueueOps, ReclaimCounts, ReleaseCode

if TYPE_CHECKING:
    from claimkit.store import Store

Q = "requests"


def envelope(rid: str) -> Envelope:
    raw = json.dumps({"request_kind": "plain", "data": {"id": rid, "deadline": 4_000_000_000}})
    parsed = parse_member(raw.encode())
    assert isinstance(parsed, Envelope)
    return parsed


def registry() -> tuple[HeldClaims, Summary, Metrics]:
    config = make_config("redis://127.0.0.1:1", queue=Q, gateway="http://x")
    metrics, summary = Metrics(), Summary()
    return HeldClaims(Q, summary, metrics.for_queue(config.queues[0])), summary, metrics


def sample(metrics: Metrics, name: str) -> float | None:
    """The value of metric ``llm_d_async_<name>`` for queue ``Q``."""
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name == f"llm_d_async_{name}" and s.labels.get("queue_name") == Q:
                return s.value
    return None


def test_claiming_again_drops_the_earlier_claim_as_released_elsewhere() -> None:
    claims, summary, metrics = registry()
    first = claims.add(envelope("a"), "t1", cancelled=False)
    scope = trio.CancelScope()
    first.scope = scope
    second = claims.add(envelope("a"), "t2", cancelled=True)
    claims.count_claimed(2)
    assert (first.ours, second.ours, second.cancelled) == (False, True, True)
    assert scope.cancel_called
    assert claims.holds(second)
    assert not claims.holds(first)
    assert len(claims) == 1
    assert (summary.claimed, summary.released_elsewhere, summary.taken_over) == (2, 1, 0)
    assert sample(metrics, "async_request_total") == 2.0
    assert sample(metrics, "async_claim_depth") == 1.0


async def test_a_claim_gone_while_its_ack_is_under_way_is_counted_by_the_ack_alone() -> None:
    """The heartbeat finds no claim for one whose ack is under way (an ack across slots
    has moved it into the outbox): it leaves the registry, nothing is counted or
    cancelled, and the ack's answer is its one count."""
    claims, summary, _metrics = registry()
    claim = claims.add(envelope("a"), "t", cancelled=False)
    claims.count_claimed(1)
    scope = trio.CancelScope()
    claim.scope = scope
    claim.acking = True
    claims.drop_acking(claim)
    assert (len(claims), claim.ours, scope.cancel_called) == (0, True, False)
    claims.acked(claim, TerminalRecord.http("a", 200, "{}"), pushed=True)
    assert summary.line() == (
        "claimkit: claimed=1 acked=1 retried=0 released=0 duplicates_suppressed=0 "
        "redelivered=0 dead_lettered=0 taken_over=0 released_elsewhere=0 left_to_lapse=0"
    )


def test_each_outcome_counts_once_in_the_summary_and_the_metrics() -> None:
    claims, summary, metrics = registry()
    a, b, c, d, e, f = (claims.add(envelope(x), "t", cancelled=False) for x in "abcdef")
    claims.drop_taken_over(a)
    claims.acked(b, TerminalRecord.http("b", 200, "{}"), pushed=True)
    claims.acked(c, TerminalRecord.http("c", 500, "{}"), pushed=False)
    claims.parked(d, moved=True)
    claims.give_up([e, a], "ack requests: OOM")  # a is no longer held: not counted again
    claims.swept([f], [ReleaseCode.RELEASED])
    claims.count_reclaimed(ReclaimCounts(redelivered=3, dead=2))
    claims.count_dead_lettered(1)
    assert len(claims) == 0
    assert a.ours is False
    assert claims.given_up == 1
    assert summary == Summary(
        acked=1,
        retried=1,
        released=1,
        duplicates_suppressed=1,
        redelivered=3,
        dead_lettered=3,
        taken_over=1,
    )
    assert sample(metrics, "async_successful_requests_total") == 1.0
    assert sample(metrics, "async_failed_requests_total") == 0.0
    assert sample(metrics, "async_duplicate_results_suppressed_total") == 1.0
    assert sample(metrics, "async_request_retries_total") == 1.0
    assert sample(metrics, "async_claims_expired_total") == 3.0
    assert sample(metrics, "async_dead_lettered_total") == 3.0
    assert sample(metrics, "async_claim_depth") == 0.0
    # Terminal records by error_code and status_code: the pushed ack's and the reclaim's two
    # dead letters' (a suppressed duplicate wrote none).
    assert terminal(metrics) == {("", "200"): 1.0, ("MAX_DELIVERIES_EXCEEDED", ""): 2.0}


def test_terminal_records_count_each_outcome_under_its_codes() -> None:
    claims, _summary, metrics = registry()
    a, b, c, d = (claims.add(envelope(x), "t", cancelled=False) for x in "abcd")
    claims.acked(a, TerminalRecord.http("a", 503, "{}"), pushed=True)
    claims.acked(b, TerminalRecord.error("b", ErrorCode.INFERENCE_ERROR, "reset"), pushed=True)
    claims.acked(c, TerminalRecord.error("c", ErrorCode.DEADLINE_EXCEEDED, "late"), pushed=True)
    claims.acked(d, TerminalRecord.http("d", 503, "{}"), pushed=True)
    claims.count_invalid_records(2)
    assert terminal(metrics) == {
        ("", "503"): 2.0,
        ("INFERENCE_ERROR", ""): 1.0,
        ("DEADLINE_EXCEEDED", ""): 1.0,
        ("INVALID_REQUEST", ""): 2.0,
    }
    # async_failed_requests_total keeps its meaning (docs/metrics.md): no error_code label.
    assert sample(metrics, "async_failed_requests_total") == 3.0


def test_build_info_names_the_versions() -> None:
    metrics = Metrics()
    found = [
        s
        for family in metrics.registry.collect()
        for s in family.samples
        if s.name == "llm_d_async_claimkit_build_info"
    ]
    assert len(found) == 1
    assert found[0].value == 1.0
    assert found[0].labels == {"version": claimkit_version(), "python": platform.python_version()}
    assert claimkit_version() == "0.1.0"


def terminal(metrics: Metrics) -> dict[tuple[str, str], float]:
    """``async_terminal_records_total`` of queue ``Q`` by ``(error_code, status_code)``."""
    return {
        (s.labels["error_code"], s.labels["status_code"]): s.value
        for family in metrics.registry.collect()
        for s in family.samples
        if s.name == "llm_d_async_async_terminal_records_total" and s.labels["queue_name"] == Q
    }


async def test_the_server_clock_estimate_follows_trio_s_clock(
    autojump_clock: trio.abc.Clock,
) -> None:
    clock = ServerClock()
    before = time.time()
    start = clock.now()  # no reply yet: this machine's clock, read once
    assert before <= start <= time.time()
    await trio.sleep(7)
    assert clock.now() == pytest.approx(start + 7, abs=1e-6)
    clock.observe(1_000.0)
    await trio.sleep(2.5)
    assert clock.now() == pytest.approx(1_002.5, abs=1e-9)


async def test_the_consumer_s_other_calls_go_through_queue_ops(store: Store) -> None:
    ops = QueueOps(store, Q, retry_set="retry-set")
    assert await ops.backlog() == 0
    await store.command("ZADD", Q, 1, b"m1", 2, b"m2")
    assert await ops.backlog() == 2
    assert await ops.move_retries() == (0, 0)
    await store.command("RPUSH", "rl", b"x")
    assert await ops.first_wrong_type({"rl": "list", "nope": "hash"}) is None
    assert await ops.first_wrong_type({Q: "zset", "rl": "zset"}) == ("rl", "list", "zset")


def test_a_consumer_without_queues_is_a_config_error() -> None:
    config = replace(make_config("redis://127.0.0.1:9/0"), queues=())
    with pytest.raises(ConfigError, match=r"^queues must list at least one queue$"):
        Consumer(config, cast("Store", None))


def test_lost_claims_of_one_tick_are_one_warning_per_kind(
    caplog: pytest.LogCaptureFixture,
) -> None:
    claims, summary, _ = registry()
    held = [claims.add(envelope(f"p{i}"), "t", cancelled=False) for i in range(9)]
    scopes = [trio.CancelScope() for _ in held]
    for claim, scope in zip(held, scopes, strict=True):
        claim.scope = scope
    caplog.set_level("DEBUG", logger="claimkit")
    claims.drop_lost(held[:1], held[1:])
    assert len(claims) == 0
    assert all(scope.cancel_called for scope in scopes)
    assert (summary.taken_over, summary.released_elsewhere) == (1, 8)
    how = (
        "released elsewhere (by drain, or by a reclaimer after its lease or its consumer's "
        "liveness entry lapsed)"
    )
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        (
            "WARNING",
            f"claim on p0 in {Q} was taken over by another owner (after its lease lapsed, its "
            "consumer's liveness entry lapsed, or a drain released it); its "
            "work here is cancelled",
        ),
        (
            "WARNING",
            f"8 claims in {Q} were {how} (p1, p2, p3, p4, p5 and 3 more); their work here is "
            "cancelled",
        ),
        *[
            ("DEBUG", f"claim on p{i} in {Q} was {how}; its work here is cancelled")
            for i in (6, 7, 8)
        ],
    ]


async def test_a_release_all_of_a_live_consumer_is_one_warning_per_tick(
    store: Store, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A real consumer holds 12 claims on a gateway call that never ends; every claim is
    released behind its back (as ``drain --release-all`` does) and it claims them again
    before its next heartbeat (or the heartbeat finds them gone): one warning for the 12,
    their first work cancelled."""
    from claimkit.producer import Producer

    ids = [f"p{i:02d}" for i in range(12)]
    for rid in ids:
        await Producer(store, Q).submit({"id": rid, "deadline": 4_000_000_000})
    started: list[str] = []
    cancelled: list[str] = []

    async def handler(q: object, env: Envelope, now: float) -> object:
        started.append(env.id)
        try:
            await trio.sleep_forever()
        finally:
            cancelled.append(env.id)

    config = make_config(redis_url, queue=Q, gateway="http://x", batch_size=20)
    consumer = Consumer(config, store, handler=handler)  # type: ignore[arg-type]
    ops = QueueOps(store, Q)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(consumer.run)
            while len(started) < len(ids):
                await trio.sleep(0.02)
            owners = dict(pairs(await store.command("HGETALL", ops.keys.owners)))
            codes = await ops.release([(rid, owners[rid.encode()].decode(), None) for rid in ids])
            assert codes == [ReleaseCode.RELEASED] * len(ids)
            while len(cancelled) < len(ids):
                await trio.sleep(0.02)
            consumer.request_stop()
            nursery.cancel_scope.cancel()
    lost = [r.getMessage() for r in caplog.records if "elsewhere" in r.getMessage()]
    assert [(r.levelname) for r in caplog.records if "elsewhere" in r.getMessage()] == ["WARNING"]
    assert lost == [
        f"12 claims in {Q} were released elsewhere (by drain, or by a reclaimer after its lease "
        "or its consumer's liveness entry lapsed) "
        f"({', '.join(ids[:5])} and 7 more); their work here is cancelled"
    ]
    assert consumer.summary.released_elsewhere == 12
