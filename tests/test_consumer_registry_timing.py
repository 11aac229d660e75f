"""The consumer registry's timing on trio's ``autojump_clock``, through the fake protocol
(tests/fake_ops.py, checked against the real scripts by tests/test_model.py): when the
heartbeat renews the liveness entry, when the reclaimer may hand a dead consumer's claims
on (never within one liveness TTL of Redis answering, after a start or an outage), and that
a live consumer whose requests are slow keeps its claims (docs/protocol.md#consumers,
docs/protocol.md#fast-failover). Every time below is trio time; the consumer starts at 0.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
from fake_ops import START, Call, FakeClaim, FakeServer
from test_consumer_timing import NO_STORE, Blocking, running, submit, times

from claimkit.config import Config, load_config
from claimkit.consumer.consumer import Consumer
from claimkit.consumer.upkeep import RETRY_LOOK_MAX_SECONDS
from claimkit.protocol.models import retry_member
from claimkit.protocol.tokens import new_token
from claimkit.store import StoreUnavailable

Q = "requests"
FAR = int(START) + 100_000
TTL = 6.0  # consumer_liveness_ttl_seconds: liveness renewed every 2 s
RECLAIM = 1.0  # claim_reclaim_interval, seconds


def make_config(consumer_id: str, **overrides: Any) -> Config:
    doc: dict[str, Any] = {
        "url": "redis://127.0.0.1:1",
        "poll_interval_ms": 1000,
        "claim_lease_ttl_seconds": 300,
        "claim_reclaim_interval_ms": int(RECLAIM * 1000),
        "consumer_liveness_ttl_seconds": TTL,
        "drain_timeout_seconds": 0.25,
        "metrics_port": 0,
        "health_port": 0,
        "queues": [{"queue_name": Q, "igw_base_url": "http://127.0.0.1:9"}],
    }
    doc.update(overrides)
    return load_config(inline=json.dumps(doc), flags={"consumer_id": consumer_id})


def dead_consumers_claim(server: FakeServer, rid: str = "orphaned") -> FakeClaim:
    """A claim held by consumer ``dead``, whose liveness entry lapsed long ago."""
    q = server.queue(Q)
    member = server.submit(Q, rid, FAR)
    del q.pending[member]
    claim = FakeClaim(member, float(FAR), new_token("dead", now=START), START + 300)
    q.claims[rid] = claim
    q.consumers["dead"] = START - 100.0
    return claim


async def test_the_heartbeat_registers_then_renews_the_liveness_entry_every_third_of_the_ttl(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Registered at 0, then the liveness entry alone renewed at 2, 4, 6 s (no claims
    held, and the claims tick is 100 s / 3 clamped to 30 s away), each to server time +
    TTL; the shutdown removes the entry."""
    server = FakeServer()
    config = make_config("pod-a")
    async with running(server, config, Blocking()) as run:
        await trio.sleep_until(0.5)
        assert server.queue(Q).consumers == {"pod-a": START + TTL}
        assert server.queue(Q).consumer_info["pod-a"]["started"] == START
        await trio.sleep_until(7)
        assert server.queue(Q).consumers == {"pod-a": START + 6 + TTL}
        run.consumer.request_stop()
    assert [c.at for c in server.log("register")] == [0.0]
    assert times(server.log("renew_liveness")) == [2.0, 4.0, 6.0]
    assert server.log("renew") == []
    assert server.queue(Q).consumers == {}
    assert server.queue(Q).consumer_info == {}
    assert len(server.log("forget_self")) == 1


# -- the two heartbeat cadences (docs/protocol.md#heartbeat) ---------------------------------


async def test_claims_every_third_of_the_lease_liveness_alone_every_third_of_the_ttl(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Lease 15 s (claims every 5 s from the start), TTL 6 s (liveness every 2 s after the
    last tick): the liveness entry alone at 2, 4, 7, 9, 12, 14 s; the claims with the
    liveness in one call at 5, 10, 15 s, and no liveness call of their own around them.
    Each claims call sets every lease to now + 15 s, each call the entry to now + TTL."""
    server = FakeServer()
    submit(server, 2)
    config = make_config("pod-a", claim_lease_ttl_seconds=15, drain_timeout_seconds=0.25)
    async with running(server, config, Blocking()) as run:
        await trio.sleep_until(14.5)
        q = server.queue(Q)
        assert q.consumers == {"pod-a": START + 14 + TTL}
        assert {rid: c.expiry for rid, c in q.claims.items()} == {
            "r0": START + 10 + 15,
            "r1": START + 10 + 15,
        }
        await trio.sleep_until(15.5)
        assert q.consumers == {"pod-a": START + 15 + TTL}
        run.consumer.request_stop()
    assert times(server.log("renew_liveness")) == [2.0, 4.0, 7.0, 9.0, 12.0, 14.0]
    assert [(c.at, c.ids) for c in server.log("renew")] == [
        (5.0, ("r0", "r1")),
        (10.0, ("r0", "r1")),
        (15.0, ("r0", "r1")),
    ]


async def test_at_the_defaults_the_claims_tick_is_every_ninth_liveness_tick_in_one_call(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The default lease (300 s: claims every 30 s) and TTL (10 s: liveness every 10/3 s),
    two queues: each tick is one call per queue, the liveness alone at k·10/3 s, the
    claims (with the liveness) at 30 and 60 s, where the two cadences meet."""
    server = FakeServer()
    for i in range(2):
        server.submit(Q, f"a{i}", FAR + i)
        server.submit("other", f"b{i}", FAR + i)
    queues = [{"queue_name": n, "igw_base_url": "http://127.0.0.1:9"} for n in (Q, "other")]
    config = make_config(
        "pod-a",
        consumer_liveness_ttl_seconds=10,
        claim_lease_ttl_seconds=300,
        drain_timeout_seconds=0.25,
        queues=queues,
    )
    async with running(server, config, Blocking()) as run:
        await trio.sleep_until(61)
        run.consumer.request_stop()
    live = [k * 10 / 3 for k in range(1, 18) if k % 9]
    for name, prefix in ((Q, "a"), ("other", "b")):
        mine = [c for c in server.calls if c.queue == name]
        assert [c.at for c in mine if c.op == "renew_liveness"] == pytest.approx(live, abs=1e-6)
        renews = [c for c in mine if c.op == "renew"]
        assert [c.at for c in renews] == pytest.approx([30.0, 60.0], abs=1e-6)
        assert {c.ids for c in renews} == {(f"{prefix}0", f"{prefix}1")}
        heartbeat = [c.at for c in mine if c.op in ("renew", "renew_liveness")]
        assert len(heartbeat) == len(set(heartbeat)) == 18  # one call per queue per tick


async def test_a_claim_taken_over_is_found_at_the_next_claims_tick_not_a_liveness_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Lease 15 s, TTL 6 s. Taken over at 5.5 s: the liveness ticks at 7 and 9 s do not
    look at claims; the 10 s claims tick finds it and cancels its work then (the detection
    delay is up to one claims interval, 5 s here)."""
    server = FakeServer()
    submit(server, 2)
    handler = Blocking()
    config = make_config("pod-a", claim_lease_ttl_seconds=15, drain_timeout_seconds=0.25)
    async with running(server, config, handler) as run:
        await trio.sleep_until(5.5)
        server.queue(Q).claims["r0"].token = "someone-else"
        await trio.sleep_until(12.5)
        run.consumer.request_stop()
    assert handler.cancelled == {"r0": 10.0, "r1": 12.75}
    assert [(c.at, c.ids) for c in server.log("renew")] == [
        (5.0, ("r0", "r1")),
        (10.0, ("r0", "r1")),
    ]
    assert times(server.log("renew_liveness")) == [2.0, 4.0, 7.0, 9.0, 12.0]
    assert (run.summary.taken_over, run.summary.released_elsewhere) == (1, 0)


async def test_a_failed_claims_renewal_is_made_again_at_the_next_liveness_tick(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Lease 15 s, TTL 6 s; Redis refuses the 5 s claims tick: the next tick, a liveness
    one at 7 s, renews the claims with the liveness in one call instead; the 9 s tick is
    the liveness alone again, and the claims schedule holds (10 s)."""
    server = FakeServer()
    submit(server, 2)

    async def away(call: Call) -> None:
        if call.at == 5.0:
            raise StoreUnavailable("connection refused")

    server.hooks["renew"] = away
    config = make_config("pod-a", claim_lease_ttl_seconds=15, drain_timeout_seconds=0.25)
    async with running(server, config, Blocking()) as run:
        await trio.sleep_until(10.5)
        leases = {rid: c.expiry for rid, c in server.queue(Q).claims.items()}
        run.consumer.request_stop()
    assert times(server.log("renew")) == [5.0, 7.0, 10.0]
    assert times(server.log("renew_liveness")) == [2.0, 4.0, 9.0]
    assert leases == dict.fromkeys(("r0", "r1"), START + 10 + 15)


async def test_fast_failover_waits_one_ttl_after_the_start(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The reclaimer runs at 0, 1, 2, ... s, but hands the dead consumer's claim on only
    from the first run at least one TTL after Redis first answered (0 s): at 6 s. The
    reclaim of that same run redelivers it, as a delivery."""
    server = FakeServer()
    dead_consumers_claim(server)
    config = make_config("pod-a")
    async with running(server, config, Blocking()) as run:
        await trio.sleep_until(TTL + 0.5)
        run.consumer.request_stop()
    assert [c.at for c in server.log("expire_owners")] == [TTL]
    assert [c.at for c in server.log("reclaim")][: int(TTL) + 1] == [float(t) for t in range(7)]
    q = server.queue(Q)
    assert q.deliveries == {"orphaned": 1}
    assert q.consumers["dead"] == -(START - 100.0)  # marked: handed on, kept for the view
    assert "orphaned" not in q.claims or q.claims["orphaned"].token.startswith("pod-a/")


async def test_after_a_redis_outage_fast_failover_waits_one_ttl_more(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Redis away from 3 s to 20 s (longer than the TTL: no live consumer could renew).
    The failover ran once Redis had answered for a TTL after the start, found nothing; once
    Redis answers again it runs only a TTL after the first answer, never before."""
    server = FakeServer()
    answered: list[float] = []

    async def away(call: Call) -> None:
        if 3 <= call.at < 20:
            raise StoreUnavailable("connection refused")
        if call.at >= 20:
            answered.append(call.at)

    for op in ("peek", "register", "renew", "renew_liveness", "reclaim", "expire_owners"):
        server.hooks[op] = away
    config = make_config("pod-a")
    async with running(server, config, Blocking()) as run:
        await trio.sleep_until(19)
        dead_consumers_claim(server)  # its entry lapsed during the outage
        await trio.sleep_until(40)
        run.consumer.request_stop()
    back = min(answered)
    runs = [c.at for c in server.log("expire_owners")]
    assert all(t < 3 or t >= back + TTL for t in runs), (back, runs)
    after = [t for t in runs if t >= 20]
    assert after
    assert back + TTL <= after[0] < back + TTL + RECLAIM + 1e-9
    assert server.queue(Q).deliveries == {"orphaned": 1}


async def test_a_live_consumer_whose_requests_are_slow_keeps_its_claims(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Consumer ``slow`` takes 60 s per request, ``peer`` reclaims every second: ``slow``
    renews its liveness every 2 s, so none of its claims is handed on; its requests finish
    at 60 s and their records are its own (no delivery counted). Meanwhile a dead
    consumer's claim is handed on by ``peer`` within TTL + one reclaim interval."""
    server = FakeServer()
    submit(server, 2, prefix="s")
    slow_config = make_config("slow", batch_size=2)
    peer_config = make_config("peer")
    slow = Blocking(finish_at={"s0": 60.0, "s1": 60.0})
    peer_handler = Blocking()
    async with running(server, slow_config, slow) as run:
        await trio.sleep_until(0.5)
        assert sorted(server.queue(Q).claims) == ["s0", "s1"]
        dead_consumers_claim(server)
        peer = Consumer(
            peer_config, NO_STORE, handler=peer_handler, ops_factory=server.factory(peer_config)
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(peer.run)
            await trio.sleep_until(70)
            peer.request_stop()
        run.consumer.request_stop()
    # Whichever consumer's poll came first claimed the handed-on request again; it never
    # finishes, so the shutdown at 70 s cancels it there. slow's own two were never cut.
    assert slow.cancelled.keys() <= {"orphaned"}
    assert {**slow.cancelled, **peer_handler.cancelled}.keys() == {"orphaned"}
    assert (run.summary.taken_over, run.summary.released_elsewhere) == (0, 0)
    assert (peer.summary.taken_over, peer.summary.released_elsewhere) == (0, 0)
    assert sorted(r["id"] for r in server.records()) == ["s0", "s1"]
    q = server.queue(Q)
    # Only the dead consumer's claim was handed on (a delivery), by slow's reclaimer at
    # 6 s (a TTL after its start), and claimed again by the next poll; swept at the end.
    assert q.deliveries == {"orphaned": 1}
    started = {**slow.started, **peer_handler.started}
    assert TTL <= started["orphaned"] <= TTL + RECLAIM + 1e-9
    assert [json.loads(m)["data"]["id"] for m in q.pending] == ["orphaned"]
    assert q.consumers == {"dead": -(START - 100.0)}  # both live ones left at shutdown


@pytest.mark.parametrize("ttl", [0])
async def test_with_the_registry_off_nothing_is_registered_or_expired(
    autojump_clock: trio.testing.MockClock, ttl: float
) -> None:
    server = FakeServer()
    dead_consumers_claim(server)
    config = make_config("pod-a", consumer_liveness_ttl_seconds=ttl)
    async with running(server, config, Blocking()) as run:
        await trio.sleep_until(30)
        run.consumer.request_stop()
    assert server.log("register") == []
    assert server.log("expire_owners") == []
    assert server.log("renew") == []  # no claims held, no liveness to renew
    assert server.log("renew_liveness") == []
    assert server.queue(Q).consumers == {"dead": START - 100.0}
    assert "orphaned" in server.queue(Q).claims  # waits out its lease (300 s)


# -- the retry mover (docs/protocol.md#retry-mover) -----------------------------------------


async def test_the_retry_mover_looks_without_its_script_until_a_member_is_due(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Poll interval 50 ms, empty retry set (the consumer's server clock is set by its
    registration at 0 s and its liveness renewals): the mover only looks (``next_retry_due``), at
    0, 0.1, 0.3, 0.7, 1.5 and then every ``RETRY_LOOK_MAX_SECONDS``, and runs no mover
    script. A member parked at 2.6 s due at 4.2 s: the 3.5 s look sees it ahead, the next
    look is at 4.2 s (to the float precision of Unix times), and one script then moves
    it back to pending; the look after that is one poll interval later."""
    server = FakeServer()
    raw = server.submit(Q, "late", FAR)
    del server.queue(Q).pending[raw]
    member = retry_member(raw, Q)
    config = make_config("pod-a", poll_interval_ms=50)
    async with running(server, config, Blocking()) as run:
        await trio.sleep_until(2.6)
        assert server.log("move_retries") == []
        server.retry.setdefault("retry-sortedset", {})[member] = START + 4.2
        await trio.sleep_until(5)
        run.consumer.request_stop()
    assert RETRY_LOOK_MAX_SECONDS == 1.0
    looks = times(server.log("next_retry_due"))
    assert looks[:9] == pytest.approx([0.0, 0.1, 0.3, 0.7, 1.5, 2.5, 3.5, 4.2, 4.25], abs=1e-6)
    assert times(server.log("move_retries")) == pytest.approx([4.2], abs=1e-6)
    assert member in server.queue(Q).pending or "late" in server.queue(Q).claims
