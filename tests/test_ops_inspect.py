"""The read-only queue snapshot behind ``claimkit inspect`` (SPEC §1, §8).

State is seeded with raw Redis commands, the way another consumer of the same layout would
leave it, so the snapshot is checked against the layout itself rather than against
claimkit's own writers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import trio
from support import member, server_now

from claimkit.ops import inspect as _inspect
from claimkit.ops.inspect import (
    ClaimRow,
    WrongKeyType,
    check_key_types,
    queue_key_types,
    snapshot,
    with_scores,
)
from claimkit.protocol.ops import new_token
from claimkit.protocol.pause import PauseMark

if TYPE_CHECKING:
    from claimkit.store import Store

Q = "{tenant-a}:requests"
TOKEN_A = "a" * 32
TOKEN_B = "b" * 32
READ_ONLY_COMMANDS = {
    "evalsha",
    "eval",
    "script|load",
    "time",
    "zcard",
    "zrange",
    "zcount",
    "hlen",
    "hscan",
    "zscore",
    "hget",
    "get",
    "hexists",
    "llen",
    "type",
    "multi",
    "exec",
    "info",
    "config|resetstat",
}


async def seed_claim(
    store: Store, queue: str, rid: str, *, token: str, expiry: float, score: int
) -> bytes:
    """A claim exactly as SPEC §1 lays it out, written by hand."""
    raw = member(rid, score)
    await store.pipeline(
        [
            ("HSET", f"{queue}:claimed", rid, raw, f"{rid}:score", score),
            ("HSET", f"{queue}:claim-owners", rid, token),
            ("ZADD", f"{queue}:claims-idx", repr(expiry), rid),
        ],
        transaction=True,
    )
    return raw


async def dump_everything(store: Store) -> dict[bytes, bytes]:
    """Every key's DUMP (the test may scan; the product may not)."""
    keys = await store.command("KEYS", "*")
    return {key: await store.command("DUMP", key) for key in keys}


async def seed_scenario(store: Store) -> float:
    """Pending 3, claims 3 (one expired, one live, one ghost), dead 2, retry 4 (2 for Q),
    results 3 + 1. Returns the server time used as the base."""
    now = await server_now(store)
    base = int(now)
    for i in (300, 100, 200):
        await store.command("ZADD", Q, base + i, member(f"p{i}", base + i))
    await seed_claim(store, Q, "c-old", token=TOKEN_A, expiry=now - 50.25, score=base + 10)
    await seed_claim(store, Q, "c-live", token=TOKEN_B, expiry=now + 250.5, score=base + 20)
    await store.command("ZADD", f"{Q}:claims-idx", repr(now - 10), "ghost")
    await store.command("HSET", f"{Q}:deliveries", "c-old", 2, "p100", 1)
    await store.command("ZADD", f"{Q}:dead", 1000, b"not json", 2000, member("d1", base + 5))
    await store.command(
        "ZADD",
        "retry-sortedset",
        now + 5,
        member("r1", base + 50, request_queue_name=Q),
        now + 6,
        member("r2", base + 60, request_queue_name=Q),
        now + 7,
        member("r3", base + 70, request_queue_name="other"),
        now + 8,
        b"{broken",
    )
    await store.command("LPUSH", "result-list", b'{"id":"x1"}', b'{"id":"x2"}', b'{"id":"x3"}')
    await store.command("LPUSH", "custom-results", b'{"id":"y1"}')
    return now


async def test_snapshot_matches_the_seeded_state_exactly(store: Store) -> None:
    with trio.fail_after(10):
        now = await seed_scenario(store)
        base = int(now)
        snap = await snapshot(store, Q, result_lists=["result-list", "custom-results"], limit=0)

        assert snap.server_time >= now
        assert (snap.pending, snap.claimed, snap.expired, snap.dead, snap.redelivered) == (
            3,
            2,  # the ghost index entry is no claim
            2,
            2,
            2,
        )
        assert (snap.leases, snap.orphans, snap.claims_exact) == (3, 0, True)
        assert snap.oldest_pending_deadline == base + 100
        assert (snap.retry_set, snap.retry_total, snap.retrying, snap.retrying_exact) == (
            "retry-sortedset",
            4,
            2,
            True,
        )
        assert snap.results == {"result-list": 3, "custom-results": 1}
        assert snap.result_count == 4
        expiries = dict(
            with_scores(await store.command("ZRANGE", f"{Q}:claims-idx", 0, -1, "WITHSCORES"))
        )
        t = snap.server_time
        assert snap.claims == (
            ClaimRow(
                "c-old", TOKEN_A, expiries[b"c-old"], expiries[b"c-old"] - t, base + 10, 2, True
            ),
            ClaimRow("ghost", None, expiries[b"ghost"], expiries[b"ghost"] - t, None, 0, False),
            ClaimRow(
                "c-live", TOKEN_B, expiries[b"c-live"], expiries[b"c-live"] - t, base + 20, 0, True
            ),
        )
        assert [r.expired for r in snap.claims] == [True, True, False]
        assert [r.ghost for r in snap.claims] == [False, True, False]


async def test_limit_bounds_the_rows_not_the_counts(store: Store) -> None:
    with trio.fail_after(10):
        await seed_scenario(store)
        snap = await snapshot(store, Q, limit=1)
        assert [r.id for r in snap.claims] == ["c-old"]
        assert (snap.claimed, snap.leases) == (2, 3)
        doc = snap.to_json()
        assert doc["claims_truncated"] is True
        assert doc["limit"] == 1
        with pytest.raises(ValueError, match="limit"):
            await snapshot(store, Q, limit=-1)


async def test_an_empty_queue_is_all_zeros(store: Store) -> None:
    with trio.fail_after(10):
        snap = await snapshot(store, "nothing-here")
        assert (snap.pending, snap.claimed, snap.expired, snap.dead, snap.retrying) == (0,) * 5
        assert snap.oldest_pending_deadline is None
        assert snap.claims == ()
        assert snap.results == {"result-list": 0}
        assert await store.command("KEYS", "*") == [], "reading created nothing"


async def test_reading_changes_nothing_and_never_scans(store: Store) -> None:
    with trio.fail_after(10):
        await seed_scenario(store)
        before = await dump_everything(store)
        await store.command("CONFIG", "RESETSTAT")
        await check_key_types(store, queue_key_types(Q))
        await snapshot(store, Q, result_lists=["result-list"], limit=0)
        stats = await store.command("INFO", "commandstats")
        text = stats.decode() if isinstance(stats, bytes) else str(stats)
        called = {
            line.split(":", 1)[0].removeprefix("cmdstat_")
            for line in text.splitlines()
            if line.startswith("cmdstat_")
        }
        assert called <= READ_ONLY_COMMANDS, called - READ_ONLY_COMMANDS
        # HSCAN of the queue's own claim hashes counts orphans; the keyspace is never scanned.
        assert not called & {"keys", "scan", "zscan", "sscan"}
        assert await dump_everything(store) == before


async def test_held_time_is_tracked_across_snapshots(store: Store) -> None:
    with trio.fail_after(10):
        now = await server_now(store)
        await seed_claim(store, Q, "c1", token=TOKEN_A, expiry=now + 100, score=int(now) + 500)
        seen: dict[tuple[str, str], float] = {}
        first = await snapshot(store, Q, first_seen=seen)
        assert first.claims[0].held_seconds == 0.0
        assert seen == {("c1", TOKEN_A): first.server_time}
        second = await snapshot(store, Q, first_seen=seen)
        assert second.claims[0].held_seconds == second.server_time - first.server_time
        # A new claim on the same id (another token) is a new hold.
        await store.command("HSET", f"{Q}:claim-owners", "c1", TOKEN_B)
        third = await snapshot(store, Q, first_seen=seen)
        assert third.claims[0].held_seconds == 0.0
        assert set(seen) == {("c1", TOKEN_B)}
        assert (await snapshot(store, Q)).claims[0].held_seconds is None


async def test_held_time_of_a_claimkit_token_is_exact(store: Store) -> None:
    """claimkit's tokens carry their claim time (UUIDv7): held is exact, with or without a
    tracker; a stamp ahead of the server clock shows 0, never a negative hold."""
    with trio.fail_after(10):
        now = await server_now(store)
        stamped = new_token(now=now - 42.5)
        ahead = new_token(now=now + 60)  # the consumer's clock estimate was a little ahead
        far = new_token(now=now + 3600)  # not a claim time
        await seed_claim(store, Q, "c1", token=stamped, expiry=now + 100, score=int(now) + 500)
        await seed_claim(store, Q, "c2", token=ahead, expiry=now + 101, score=int(now) + 500)
        await seed_claim(store, Q, "c3", token=TOKEN_A, expiry=now + 102, score=int(now) + 500)
        await seed_claim(store, Q, "c4", token=far, expiry=now + 103, score=int(now) + 500)
        seen: dict[tuple[str, str], float] = {}
        for tracker in (None, seen, seen):
            snap = await snapshot(store, Q, first_seen=tracker)
            c1, c2, c3, c4 = snap.claims
            assert (c1.owner, c1.held_exact) == (stamped, True)
            assert c1.held_seconds == snap.server_time - int((now - 42.5) * 1000) / 1000
            assert (c2.held_seconds, c2.held_exact) == (0.0, True)
            assert c3.held_exact is False
            assert c4.held_exact is False
            if tracker is None:
                assert c3.held_seconds is None
                assert c4.held_seconds is None
            else:  # only tokens without a usable claim time need the lower bound
                assert c3.held_seconds == snap.server_time - seen[("c3", TOKEN_A)]
                assert c4.held_seconds == snap.server_time - seen[("c4", far)]
            assert c1.to_json()["held_exact"] is True


async def test_retry_counting_is_bounded(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    with trio.fail_after(10):
        await seed_scenario(store)
        monkeypatch.setattr(_inspect, "RETRY_SCAN_MAX", 2)
        snap = await snapshot(store, Q)
        assert (snap.retry_total, snap.retrying, snap.retrying_exact) == (4, 2, False)


async def test_key_types_are_checked_with_one_line(store: Store) -> None:
    with trio.fail_after(10):
        await check_key_types(store, queue_key_types(Q))  # nothing exists: fine
        await store.command("SET", f"{Q}:claimed", "oops")
        with pytest.raises(WrongKeyType) as info:
            await check_key_types(store, queue_key_types(Q))
        assert str(info.value) == (
            f"key '{Q}:claimed' holds a string, not a hash: is the queue or list name right?"
        )
        await store.command("RPUSH", "rl", "x")
        with pytest.raises(WrongKeyType, match="key 'rl' holds a list, not a sorted set"):
            await check_key_types(store, {"rl": "zset"})


def test_with_scores_reads_both_reply_shapes() -> None:
    assert with_scores([[b"a", 1.5], [b"b", 2.0]]) == [(b"a", 1.5), (b"b", 2.0)]
    assert with_scores([b"a", b"1.5", b"b", b"2"]) == [(b"a", 1.5), (b"b", 2.0)]
    assert with_scores([]) == []


def test_snapshot_json_document_shape() -> None:
    row = ClaimRow("r1", TOKEN_A, 110.0, -5.0, 200.0, 3, True, held_seconds=7.0)
    snap = _inspect.QueueSnapshot(
        queue="q",
        server_time=115.0,
        pending=1,
        oldest_pending_deadline=200.0,
        claimed=1,
        expired=1,
        dead=0,
        redelivered=1,
        retry_set="retry-sortedset",
        retry_total=0,
        retrying=0,
        retrying_exact=True,
        results={"result-list": 2},
        claims=(row,),
        limit=50,
        leases=1,
        paused=PauseMark(since=100.5, reason="redis move"),
    )
    assert snap.to_json(url="redis://u:***@h:1/0") == {
        "queue": "q",
        "redis_url": "redis://u:***@h:1/0",
        "server_time": 115.0,
        "paused": {"since": 100.5, "reason": "redis move", "until": None},
        "counts": {
            "pending": 1,
            "claimed": 1,
            "orphans": 0,
            "expired": 1,
            "retrying": 0,
            "dead": 0,
            "results": 2,
            "redelivered": 1,
        },
        "oldest_pending_deadline": 200.0,
        "retry_set": {"name": "retry-sortedset", "total": 0, "for_queue": 0, "exact": True},
        "result_lists": {"result-list": 2},
        "limit": 50,
        "claims_exact": True,
        "claims_truncated": False,
        "claims": [
            {
                "id": "r1",
                "owner": TOKEN_A,
                "consumer": None,
                "lease_expiry": 110.0,
                "lease_left_seconds": -5.0,
                "expired": True,
                "score": 200.0,
                "deliveries": 3,
                "ghost": False,
                "held_seconds": 7.0,
                "held_exact": False,
            }
        ],
    }
