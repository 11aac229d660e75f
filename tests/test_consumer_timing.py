"""The consumer's timing on trio's ``autojump_clock``, through the fake protocol.

``Consumer(ops_factory=...)`` runs on :class:`fake_ops.FakeQueueOps` (checked against the
real scripts by tests/test_model.py), whose server clock is ``START + trio.current_time()``.
No real time passes and nothing polls: each test asserts the exact fake time at which the
consumer renews, cancels, sweeps, acks and reclaims (docs/protocol.md#heartbeat,
docs/protocol.md#tasks-and-shutdown, docs/protocol.md#ack, docs/protocol.md#reclaim).

The consumer starts at trio time 0; every time below is trio time.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, NoReturn, cast

import pytest
import trio
from fake_ops import START, Call, FakeClaim, FakeServer

from claimkit.config import Config, load_config
from claimkit.consumer.consumer import (
    CANCEL_GRACE_SECONDS,
    HURRY_SECONDS,
    SWEEP_TIMEOUT_SECONDS,
    Consumer,
    QueueRuntime,
    Summary,
)
from claimkit.consumer.dispatch import Done, Outcome
from claimkit.consumer.settle import ACK_IDLE_SECONDS, ACK_LINGER_SECONDS
from claimkit.protocol.models import Envelope, TerminalRecord
from claimkit.store import Store, StoreUnavailable

Q = "requests"
FAR = int(START) + 100_000  # a deadline far ahead of everything below
EPS = 1e-9  # float sums of trio deadlines: 1.0 + 0.002 is not exactly 1.002
DRAIN = 0.25  # a short drain_timeout_seconds, for tests about something else

Handler = Callable[[QueueRuntime, Envelope, float], Awaitable[Outcome]]


class _NoStore:
    """The consumer's store: with the fake protocol nothing may reach it."""

    url = "redis://127.0.0.1:1"

    def __getattr__(self, name: str) -> NoReturn:
        raise AssertionError(f"the consumer used its store ({name}) past the fake protocol")


NO_STORE = cast("Store", _NoStore())


def make_config(**overrides: Any) -> Config:
    doc: dict[str, Any] = {
        "url": "redis://127.0.0.1:1",
        "poll_interval_ms": 1000,
        "claim_lease_ttl_seconds": 30,
        "drain_timeout_seconds": 10,
        "metrics_port": 0,
        "health_port": 0,
        # The lease cadence alone; the consumer registry's timing has tests of its own
        # (tests/test_consumer_registry.py).
        "consumer_liveness_ttl_seconds": 0,
        "queues": [{"queue_name": Q, "igw_base_url": "http://127.0.0.1:9"}],
    }
    doc.update(overrides)
    return load_config(inline=json.dumps(doc))


class Run:
    """A consumer on ``server`` and when its :meth:`Consumer.run` returned."""

    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer
        self.ended_at: float | None = None

    @property
    def summary(self) -> Summary:
        return self.consumer.summary


@asynccontextmanager
async def running(server: FakeServer, config: Config, handler: Handler) -> AsyncIterator[Run]:
    """Run a consumer on the fake from trio time 0 until the body has stopped it (the
    block ends once :meth:`Consumer.run` returned)."""
    assert trio.current_time() == 0.0
    consumer = Consumer(config, NO_STORE, handler=handler, ops_factory=server.factory(config))
    run = Run(consumer)

    async def consume(task_status: trio.TaskStatus[None]) -> None:
        await consumer.run(task_status=task_status)
        run.ended_at = trio.current_time()

    async with trio.open_nursery() as nursery:
        await nursery.start(consume)
        yield run


def submit(server: FakeServer, n: int, prefix: str = "r") -> dict[bytes, float]:
    """``n`` requests, deadlines far ahead and distinct; returns the pending set after."""
    for i in range(n):
        server.submit(Q, f"{prefix}{i}", FAR + i)
    return dict(server.queue(Q).pending)


def ok(env: Envelope) -> Outcome:
    return Done(TerminalRecord.http(env.id, 200, "ok"))


class Blocking:
    """A handler that holds each request until cancelled (or until ``finish_at[id]``),
    noting when each was cancelled."""

    def __init__(self, finish_at: dict[str, float] | None = None) -> None:
        self.finish_at = finish_at or {}
        self.started: dict[str, float] = {}
        self.cancelled: dict[str, float] = {}

    async def __call__(self, q: QueueRuntime, env: Envelope, now: float) -> Outcome:
        self.started[env.id] = trio.current_time()
        try:
            if env.id in self.finish_at:
                await trio.sleep_until(self.finish_at[env.id])
                return ok(env)
            await trio.sleep_forever()
        except trio.Cancelled:
            self.cancelled[env.id] = trio.current_time()
            raise
        raise AssertionError("unreachable")


def times(calls: list[Call]) -> list[float]:
    return [c.at for c in calls]


# -- heartbeat (docs/protocol.md#heartbeat) ---------------------------------------------------


@pytest.mark.parametrize(
    ("lease", "interval"),
    [(300, 30.0), (60, 20.0), (30, 10.0), (1.5, 1.0), (3, 1.0)],
)
async def test_heartbeat_renews_every_claim_each_third_of_the_lease_clamped(
    autojump_clock: trio.testing.MockClock, lease: float, interval: float
) -> None:
    """Renewals at exactly ``clamp(ttl / 3, 1, 30)`` s, each of every held claim in one
    call, each setting the lease to ``now + ttl`` (the deadline is far). A short drain at
    the end keeps the count of ticks exact."""
    server = FakeServer()
    submit(server, 3)
    handler = Blocking()
    ticks = 4
    config = make_config(claim_lease_ttl_seconds=lease, drain_timeout_seconds=DRAIN)
    stop = ticks * interval + interval / 2
    async with running(server, config, handler) as run:
        await trio.sleep_until(stop)
        leases = {rid: c.expiry for rid, c in server.queue(Q).claims.items()}
        run.consumer.request_stop()
    assert times(server.log("claim")) == [0.0]
    renews = server.log("renew")
    assert times(renews) == [interval * k for k in range(1, ticks + 1)]
    assert {c.ids for c in renews} == {("r0", "r1", "r2")}
    assert leases == dict.fromkeys(("r0", "r1", "r2"), START + ticks * interval + lease)
    assert handler.cancelled == dict.fromkeys(("r0", "r1", "r2"), stop + DRAIN)
    assert run.summary.released == 3


async def test_a_claim_taken_over_is_dropped_at_the_next_heartbeat(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Taken over at 12 s: the 20 s heartbeat finds it, cancels its work then, writes no
    record and leaves the other owner's claim alone; later ticks renew only the rest."""
    server = FakeServer()
    submit(server, 2)
    handler = Blocking()
    config = make_config(claim_lease_ttl_seconds=30, drain_timeout_seconds=DRAIN)
    async with running(server, config, handler) as run:
        await trio.sleep_until(12)
        server.queue(Q).claims["r0"].token = "someone-else"
        await trio.sleep_until(35)
        run.consumer.request_stop()
    assert handler.cancelled == {"r0": 20.0, "r1": 35.0 + DRAIN}
    assert [(c.at, c.ids) for c in server.log("renew")] == [
        (10.0, ("r0", "r1")),
        (20.0, ("r0", "r1")),
        (30.0, ("r1",)),
    ]
    assert (run.summary.taken_over, run.summary.released_elsewhere) == (1, 0)
    assert run.summary.released == 1  # r1, by the sweep
    assert server.records() == []
    assert server.queue(Q).claims["r0"].token == "someone-else"
    assert [(c.at, c.ids) for c in server.log("release")] == [(35.0 + DRAIN, ("r1",))]


async def test_a_heartbeat_redis_refuses_is_tried_again_at_the_next_tick(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Redis away for the 10 s tick: the claims stay held (no work cancelled), and the
    cadence holds: the 20 s tick renews them (the lease taken at 0 s lapses at 30 s), and so
    does the 30 s one, to ``30 + ttl``."""
    server = FakeServer()
    submit(server, 2)
    handler = Blocking()

    async def away(call: Call) -> None:
        if call.at < 15:
            raise StoreUnavailable("connection refused")

    server.hooks["renew"] = away
    config = make_config(claim_lease_ttl_seconds=30, drain_timeout_seconds=DRAIN)
    async with running(server, config, handler) as run:
        await trio.sleep_until(35)
        leases = {rid: c.expiry for rid, c in server.queue(Q).claims.items()}
        run.consumer.request_stop()
    assert times(server.log("renew")) == [10.0, 20.0, 30.0]
    assert leases == dict.fromkeys(("r0", "r1"), START + 30 + 30)
    assert handler.cancelled == dict.fromkeys(("r0", "r1"), 35.0 + DRAIN)
    assert (run.summary.taken_over, run.summary.released_elsewhere, run.summary.released) == (
        0,
        0,
        2,
    )


# -- drain grace, cancel grace and the sweep (docs/protocol.md#tasks-and-shutdown) -----------


async def test_drain_waits_drain_timeout_then_cancels_and_sweeps_exactly_the_held_claims(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Stop at 5 s with 3 claims held, drain 7 s: r0 finishes within the drain (acked at
    7 s + ``ACK_IDLE_SECONDS``: r1 and r2 are still under way, and nothing else came);
    the others are cancelled at exactly 12 s and swept back at their
    original scores at once; ``run`` returns then."""
    server = FakeServer()
    before = submit(server, 3)
    handler = Blocking(finish_at={"r0": 7.0})
    config = make_config(drain_timeout_seconds=7)
    async with running(server, config, handler) as run:
        await trio.sleep_until(5)
        run.consumer.request_stop()
    assert handler.cancelled == {"r1": 12.0, "r2": 12.0}
    assert [(c.at, c.ids) for c in server.log("ack")] == [(7.0 + ACK_IDLE_SECONDS, ("r0",))]
    assert [(c.at, c.ids) for c in server.log("release")] == [(12.0, ("r1", "r2"))]
    assert run.ended_at == 12.0
    r0 = next(m for m in before if b'"r0"' in m)
    assert server.queue(Q).pending == {m: s for m, s in before.items() if m != r0}
    assert server.queue(Q).claims == {}
    assert [r["id"] for r in server.records()] == ["r0"]
    assert (run.summary.claimed, run.summary.acked, run.summary.released) == (3, 1, 2)
    assert run.summary.left_to_lapse == 0


async def test_drain_ends_as_soon_as_the_last_request_is_acked(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Nothing is kept waiting for the rest of ``drain_timeout``: r0 is acked at 6 s plus
    ``ACK_IDLE_SECONDS`` (r1 is still under way); r1, the last, finishes at 8 s, which
    ends the drain and closes the acker,
    so its ack goes out at once (no linger) and ``run`` returns then, with nothing for the
    sweep to release."""
    server = FakeServer()
    submit(server, 2)
    handler = Blocking(finish_at={"r0": 6.0, "r1": 8.0})
    async with running(server, make_config(drain_timeout_seconds=30), handler) as run:
        await trio.sleep_until(5)
        run.consumer.request_stop()
    acks = server.log("ack")
    assert [c.ids for c in acks] == [("r0",), ("r1",)]
    assert times(acks) == pytest.approx([6.0 + ACK_IDLE_SECONDS, 8.0], abs=EPS)
    assert run.ended_at == 8.0
    assert server.log("release") == []
    assert (run.summary.acked, run.summary.released) == (2, 0)


async def test_a_task_ignoring_cancellation_is_swept_after_the_cancel_grace(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Drain 2 s from a stop at 5 s: the work is cancelled at 7 s but ignores it; after
    ``CANCEL_GRACE_SECONDS`` (at 8 s) the sweep returns its claim anyway. When the task
    finishes at 20 s its late ack withdraws the swept copy: exactly one record, nothing
    left pending (docs/protocol.md#release-and-sweep). ``run`` returns once that task
    has ended."""
    server = FakeServer()
    before = submit(server, 1, prefix="slow")

    async def stubborn(q: QueueRuntime, env: Envelope, now: float) -> Outcome:
        with trio.CancelScope(shield=True):
            await trio.sleep_until(20)
        return Done(TerminalRecord.http(env.id, 200, '{"late":true}'))

    async with running(server, make_config(drain_timeout_seconds=2), stubborn) as run:
        await trio.sleep_until(5)
        run.consumer.request_stop()
        await trio.sleep_until(8.5)
        assert server.queue(Q).pending == before  # swept back while the task is stuck
        assert server.queue(Q).claims == {}
    assert [(c.at, c.ids) for c in server.log("release")] == [
        (7.0 + CANCEL_GRACE_SECONDS, ("slow0",))
    ]
    assert [(c.at, c.ids) for c in server.log("ack")] == [(20.0, ("slow0",))]
    assert run.ended_at == 20.0
    assert [r["id"] for r in server.records()] == ["slow0"]
    assert server.queue(Q).pending == {}
    assert server.queue(Q).claims == {}
    assert run.summary.released == 1


# -- the second signal (docs/protocol.md#shutdown) --------------------------------------------


async def test_a_second_signal_skips_the_rest_of_the_drain(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Stop at 5 s with a 30 s drain; the second signal at 9 s cancels the work at once and
    the sweep returns every claim then."""
    server = FakeServer()
    before = submit(server, 2)
    handler = Blocking()
    async with running(server, make_config(drain_timeout_seconds=30), handler) as run:
        await trio.sleep_until(5)
        run.consumer.request_stop()
        await trio.sleep_until(9)
        run.consumer.request_stop()
    assert handler.cancelled == {"r0": 9.0, "r1": 9.0}
    assert [(c.at, c.ids) for c in server.log("release")] == [(9.0, ("r0", "r1"))]
    assert run.ended_at == 9.0
    assert server.queue(Q).pending == before  # the same bytes at the same scores
    assert server.queue(Q).claims == {}
    assert server.records() == []
    assert (run.summary.claimed, run.summary.acked, run.summary.released) == (2, 0, 2)


@pytest.mark.parametrize(
    ("second_signal_at", "ended_at"),
    [
        (None, 5.0 + SWEEP_TIMEOUT_SECONDS),  # the whole budget: 10 s from the first step
        (8.0, 8.0 + HURRY_SECONDS),  # cut to 1 s from the second signal
        (14.5, 5.0 + SWEEP_TIMEOUT_SECONDS),  # a late second signal never extends it
    ],
)
async def test_a_second_signal_cuts_the_rest_of_the_shutdown_to_hurry_seconds(
    autojump_clock: trio.testing.MockClock, second_signal_at: float | None, ended_at: float
) -> None:
    """Redis stops answering the sweep (its release hangs): the shutdown budget starts at
    the first shielded step (5 s: no drain, the work ends at once) and is
    ``SWEEP_TIMEOUT_SECONDS``; a second signal cuts what is left to ``HURRY_SECONDS``.
    The claims it could not return are counted as left to lapse."""
    server = FakeServer()
    submit(server, 3)

    async def hang(call: Call) -> None:
        await trio.sleep_forever()

    async def quick(q: QueueRuntime, env: Envelope, now: float) -> Outcome:
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async with running(server, make_config(drain_timeout_seconds=0.5), quick) as run:
        await trio.sleep_until(4.5)
        server.hooks["release"] = hang
        run.consumer.request_stop()
        if second_signal_at is not None:
            await trio.sleep_until(second_signal_at)
            run.consumer.request_stop()
    assert times(server.log("release")) == [5.0]
    assert run.ended_at == ended_at
    assert run.summary.released == 0
    assert run.summary.left_to_lapse == 3
    assert len(server.queue(Q).claims) == 3  # left in Redis: their leases lapse


# -- the acker's linger (docs/protocol.md#ack) ------------------------------------------------


async def test_the_acker_batches_what_finishes_close_together_into_one_ack(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """r0 finishes at 1 s with r1..r3 still under way: the acker waits while results keep
    coming, so r1 and r2 (1 ms and 1.5 ms later) go in the same call, sent
    ``ACK_IDLE_SECONDS`` after r2; r3, the last claim held, is acked the moment it
    finishes: nothing else can come."""
    server = FakeServer()
    submit(server, 4)
    finish = {"r0": 1.0, "r1": 1.001, "r2": 1.0015, "r3": 1.02}
    handler = Blocking(finish_at=finish)
    async with running(server, make_config(), handler) as run:
        await trio.sleep_until(2)
        run.consumer.request_stop()
    acks = server.log("ack")
    assert [c.ids for c in acks] == [("r0", "r1", "r2"), ("r3",)]
    assert times(acks) == pytest.approx([1.0015 + ACK_IDLE_SECONDS, 1.02], abs=EPS)
    assert [r["id"] for r in server.records()] == ["r0", "r1", "r2", "r3"]
    assert run.summary.acked == 4


async def test_a_lone_result_is_acked_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """One request in flight (``batch_size`` 10): its result is acked the moment it
    finishes, in a call of its own; no batch is waited for."""
    server = FakeServer()
    submit(server, 1)
    handler = Blocking(finish_at={"r0": 1.5})
    async with running(server, make_config(batch_size=10), handler) as run:
        await trio.sleep_until(2)
        run.consumer.request_stop()
    assert [(c.at, c.ids) for c in server.log("ack")] == [(1.5, ("r0",))]
    assert run.summary.acked == 1


async def test_results_arriving_together_go_in_one_ack_call(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Ten results finishing at the same instant (``batch_size`` 10, two more claims
    still under way): one ack call carrying all ten, sent at that instant (a full batch
    is not held back)."""
    server = FakeServer()
    submit(server, 12)
    handler = Blocking(finish_at={f"r{i}": 1.0 for i in range(10)})
    config = make_config(batch_size=10, drain_timeout_seconds=DRAIN)
    async with running(server, config, handler) as run:
        await trio.sleep_until(2)
        run.consumer.request_stop()
    acks = server.log("ack")
    assert [(c.at, sorted(c.ids)) for c in acks] == [(1.0, sorted(f"r{i}" for i in range(10)))]
    assert run.summary.acked == 10


async def test_the_acker_waits_at_most_its_linger_bound(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Results every 3 ms (closer than ``ACK_IDLE_SECONDS``) with another claim still
    under way and ``batch_size`` 100: the first call goes ``ACK_LINGER_SECONDS`` after the
    first result with all that arrived by then; the rest after the stream pauses."""
    server = FakeServer()
    submit(server, 11)
    step = 0.003
    finish = {f"r{k}": 1.0 + step * k for k in range(10)}  # r10 blocks until the drain
    handler = Blocking(finish_at=finish)
    config = make_config(batch_size=100, drain_timeout_seconds=DRAIN)
    async with running(server, config, handler) as run:
        await trio.sleep_until(2)
        run.consumer.request_stop()
    acks = server.log("ack")
    inside = [f"r{k}" for k in range(10) if finish[f"r{k}"] < 1.0 + ACK_LINGER_SECONDS]
    assert [sorted(c.ids) for c in acks[:2]] == [
        sorted(inside),
        sorted(f"r{k}" for k in range(len(inside), 10)),
    ]
    assert times(acks[:2]) == pytest.approx(
        [1.0 + ACK_LINGER_SECONDS, finish["r9"] + ACK_IDLE_SECONDS], abs=EPS
    )
    assert run.summary.acked == 10


async def test_a_full_batch_is_acked_without_lingering(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """With ``batch_size`` 2, two records finished together are acked at once (no linger);
    the third, 1 ms later and the last claim held, is acked at once too."""
    server = FakeServer()
    submit(server, 3)
    handler = Blocking(finish_at={"r0": 1.0, "r1": 1.0, "r2": 1.001})
    async with running(server, make_config(batch_size=2), handler) as run:
        await trio.sleep_until(2)
        run.consumer.request_stop()
    acks = server.log("ack")
    assert [(c.at, set(c.ids)) for c in acks[:1]] == [(1.0, {"r0", "r1"})]
    assert [c.ids for c in acks[1:]] == [("r2",)]
    assert times(acks[1:]) == pytest.approx([1.001], abs=EPS)
    assert run.summary.acked == 3


# -- reclaim (docs/protocol.md#reclaim) -------------------------------------------------------


async def test_the_reclaimer_runs_at_start_then_every_interval_and_redelivers_lapsed_claims(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Reclaims at 0 s and every 15.25 s. A dead owner's claim lapsing at 20 s is
    redelivered by the 30.5 s run (not before), and this consumer's next poll (31 s)
    claims it; this consumer's own claim, renewed each second, is never reclaimed."""
    server = FakeServer()
    submit(server, 1, prefix="mine")
    dead = server.submit(Q, "orphan", FAR)
    q = server.queue(Q)
    q.claims["orphan"] = FakeClaim(dead, q.pending.pop(dead), "dead-owner", START + 20)
    handler = Blocking()
    config = make_config(
        claim_reclaim_interval_ms=15250, claim_lease_ttl_seconds=3, drain_timeout_seconds=DRAIN
    )
    async with running(server, config, handler) as run:
        await trio.sleep_until(30.4)
        assert q.claims["orphan"].token == "dead-owner"  # lapsed, but not reclaimed yet
        await trio.sleep_until(50)
        run.consumer.request_stop()
    assert times(server.log("reclaim")) == [0.0, 15.25, 30.5, 45.75]
    assert handler.started == {"mine0": 0.0, "orphan": 31.0}
    assert run.summary.redelivered == 1
    assert q.deliveries == {"orphan": 1}
    assert run.summary.released == 2


# -- pause (docs/protocol.md#pause) -----------------------------------------------------------


async def test_a_pause_is_honoured_at_the_next_poll_and_a_resume_too(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Paused at 2.5 s: the 3 s poll claims nothing, nor does any poll after, while the
    request claimed at 0 s is renewed and acked at 12 s. Resumed at 20.5 s: the 21 s poll
    claims the rest. One INFO line each way, the gauge 1 then 0, every peek one call."""
    caplog.set_level("INFO", logger="claimkit")
    server = FakeServer()
    server.submit(Q, "r0", FAR)
    handler = Blocking(finish_at={"r0": 12.0, "r1": 22.0, "r2": 22.5})
    config = make_config(drain_timeout_seconds=DRAIN)
    labels = {"queue_id": Q, "queue_name": Q, "pool_name": ""}
    gauge = "llm_d_async_async_queue_paused"
    async with running(server, config, handler) as run:
        registry = run.consumer.metrics.registry
        await trio.sleep_until(2.5)
        assert registry.get_sample_value(gauge, labels) == 0.0
        server.queue(Q).paused = b'{"since":1.0,"reason":"redis move"}'
        server.submit(Q, "r1", FAR + 1)
        server.submit(Q, "r2", FAR + 2)
        await trio.sleep_until(20.5)
        assert registry.get_sample_value(gauge, labels) == 1.0
        assert sorted(server.queue(Q).pending.values()) == [FAR + 1, FAR + 2]
        server.queue(Q).paused = None
        await trio.sleep_until(23.5)
        assert registry.get_sample_value(gauge, labels) == 0.0
        run.consumer.request_stop()
    claims = server.log("claim")
    assert [(c.at, c.ids) for c in claims] == [(0.0, ("r0",)), (21.0, ("r1", "r2"))]
    assert [r["id"] for r in server.records()] == ["r0", "r1", "r2"]
    assert handler.started == {"r0": 0.0, "r1": 21.0, "r2": 21.0}
    assert [(c.at, c.ids) for c in server.log("renew")] == [(10.0, ("r0",))]
    peeks = times(server.log("peek"))
    assert [t for t in peeks if 2.5 < t < 20.5] == [float(s) for s in range(3, 21)]
    lines = [r.getMessage() for r in caplog.records if "is paused" in r.getMessage()]
    assert lines == [
        "queue requests is paused (redis move): claiming nothing new from it; "
        "work in flight goes on"
    ]
    resumed = [r for r in caplog.records if "is resumed" in r.getMessage()]
    assert [(r.levelname, r.getMessage()) for r in resumed] == [
        ("INFO", "queue requests is resumed: claiming again")
    ]


async def test_a_round_takes_every_free_slot_up_to_500_when_more_than_batch_size_are_free(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``concurrency`` 700, ``batch_size`` 10, 1,000 pending: the first round claims 500
    (the most one round takes, one claim script call), the next the 200 slots left, in
    deadline order; once 30 requests finish together, one round refills all 30
    (docs/protocol.md#peek)."""
    server = FakeServer()
    submit(server, 1000)
    handler = Blocking(finish_at={f"r{i}": 5.0 for i in range(30)})
    config = make_config(batch_size=10, concurrency=700, drain_timeout_seconds=DRAIN)
    async with running(server, config, handler) as run:
        await trio.sleep_until(7)
        run.consumer.request_stop()
    claims = [c.ids for c in server.log("claim")]
    assert [len(ids) for ids in claims] == [500, 200, 30]
    assert [rid for ids in claims for rid in ids] == [f"r{i}" for i in range(730)]
    assert list(handler.started) == [f"r{i}" for i in range(730)]
