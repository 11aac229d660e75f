"""Claims without a lease entry are recovered (issue 8, defect 13; docs/protocol.md).

A claim whose ``<q>:claims-idx`` entry is gone (evicted, a partial restore, a hand edit)
while ``<q>:claimed`` / ``<q>:claim-owners`` keep it was never looked at by a reclaimer.
The reclaimer now finds such orphans with a bounded ``HSCAN`` and handles them as expired;
``inspect`` counts what is really claimed and shows the orphans.
"""

from __future__ import annotations

import json
from typing import Any

import trio
from redis_state import command_calls, do, server_now, snapshot
from typer.testing import CliRunner

from claimkit._cli import app
from claimkit._inspect import snapshot as inspect_snapshot
from claimkit._keys import QueueKeys
from claimkit._models import Envelope, parse_member
from claimkit._protocol import QueueOps, new_token
from claimkit._store import Store

Q = "orphans"
K = QueueKeys.for_queue(Q)
DEAD_TOKEN = "d0" * 16  # the owner: a consumer that died long ago


def member(rid: str, deadline: int) -> bytes:
    return json.dumps(
        {"data": {"id": rid, "deadline": deadline}, "request_kind": "plain", "internal": {}},
        separators=(",", ":"),
    ).encode()


def env(raw: bytes) -> Envelope:
    parsed = parse_member(raw)
    assert isinstance(parsed, Envelope)
    return parsed


async def claim(store: Store, pairs: list[tuple[str, int]], ttl: float = 300) -> list[bytes]:
    """Submit and claim ``(id, deadline)`` requests under a long lease; their members."""
    raws = [member(rid, deadline) for rid, deadline in pairs]
    args: list[Any] = []
    for raw, (_, deadline) in zip(raws, pairs, strict=True):
        args += [deadline, raw]
    await store.command("ZADD", K.pending, *args)
    ops = QueueOps(store, Q)
    _, codes = await ops.claim([(env(r), new_token()) for r in raws], ttl)
    assert set(codes) == {1}
    return raws


def test_reclaim_once_redelivers_a_claim_whose_lease_entry_was_deleted(redis_url: str) -> None:
    """The issue's case through the CLI: one of two live-looking claims loses its index
    entry; its owner is dead. ``reclaim --once`` redelivers exactly that one."""
    now = int(server_now_sync(redis_url))
    a, b = member("a", now + 600), member("b", now + 700)
    do(
        redis_url,
        ("HSET", K.claimed, "a", a, "a:score", now + 600, "b", b, "b:score", now + 700),
        ("HSET", K.owners, "a", DEAD_TOKEN, "b", DEAD_TOKEN),
        ("ZADD", K.index, now + 300, "b"),  # "a" has no lease entry
        ("HSET", K.deliveries, "a", 2),
    )
    transport = json.dumps(
        {"url": redis_url, "queues": [{"queue_name": Q, "igw_base_url": "http://127.0.0.1:9"}]}
    )
    result = CliRunner().invoke(app, ["reclaim", "--once", "--transport-config", transport])
    assert result.exit_code == 0, result.output
    assert result.stdout == "claimkit reclaim: queues=1 redelivered=1 dead_lettered=0 ghosts=0\n"
    assert result.stderr == (
        "claimkit reclaim: warning: 1 claims of orphans had no lease entry (evicted, partly "
        "restored or edited by hand?) and were handled as expired; see docs/operations.md, "
        '"Eviction"\n'
    )
    state = _run(redis_url, snapshot)
    assert state == {
        K.pending: [(a, float(now + 600))],
        K.claimed: {b"b": b, b"b:score": str(now + 700).encode()},
        K.owners: {b"b": DEAD_TOKEN.encode()},
        K.index: [(b"b", float(now + 300))],
        K.deliveries: {b"a": b"3"},
    }
    # Nothing is left to find: a second run reports nothing.
    again = CliRunner().invoke(
        app, ["reclaim", "--once", "--json", "--transport-config", transport]
    )
    assert json.loads(again.stdout)["orphans"] == 0
    assert again.stderr == ""


async def test_every_kind_of_orphan_is_handled_and_no_payload_is_dropped(store: Store) -> None:
    with trio.fail_after(10):
        now = int(await server_now(store))
        keep = await claim(store, [("kept", now + 900)])  # a normal leased claim: untouched
        owner_only = "owner-only"  # owner entry, no payload, no lease: a ghost
        loose = member("loose", now + 610)  # payload and score, no owner, no lease
        no_score = member("no-score", now + 620)  # payload, no score field, no lease
        bad_score = member("bad-score", now + 630)  # a score field that is not a number
        colon = member("x:score", now + 640)  # an id ending in ":score" is an id too
        await store.command(
            "HSET",
            K.claimed,
            "loose",
            loose,
            "loose:score",
            now + 610.25,
            "no-score",
            no_score,
            "bad-score",
            bad_score,
            "bad-score:score",
            "soon",
            "x:score",
            colon,
            "x:score:score",
            now + 640,
            "stray:score",
            "12345",  # a score field whose payload is gone
        )
        await store.command("HSET", K.owners, owner_only, DEAD_TOKEN, "no-score", DEAD_TOKEN)
        idx_before = await store.command("ZRANGE", K.index, 0, -1, "WITHSCORES")

        counts = await QueueOps(store, Q).reclaim(max_deliveries=10, full_scan=True)
        assert (counts.redelivered, counts.dead, counts.ghosts, counts.orphans) == (4, 0, 2, 6)
        state = await snapshot(store)
        assert state.pop(K.pending) == [
            (loose, now + 610.25),
            (no_score, float(now + 620)),  # back at its data.deadline
            (bad_score, float(now + 630)),
            (colon, float(now + 640)),
        ]
        assert state.pop(K.deliveries) == {
            b"loose": b"1",
            b"no-score": b"1",
            b"bad-score": b"1",
            b"x:score": b"1",
        }
        assert state == {
            K.claimed: {b"kept": keep[0], b"kept:score": str(now + 900).encode()},
            K.owners: {b"kept": state[K.owners][b"kept"]},
            K.index: [(b"kept", state[K.index][0][1])],
        }
        assert await store.command("ZRANGE", K.index, 0, -1, "WITHSCORES") == idx_before


async def test_an_orphan_at_max_deliveries_is_dead_lettered_with_its_record(store: Store) -> None:
    with trio.fail_after(10):
        now = int(await server_now(store))
        (raw,) = await claim(store, [("p", now + 600)])
        await store.command("ZREM", K.index, "p")
        await store.command("HSET", K.deliveries, "p", 2)
        counts = await QueueOps(store, Q).reclaim(max_deliveries=3, full_scan=True)
        assert (counts.redelivered, counts.dead, counts.orphans) == (0, 1, 1)
        assert [m for m, _ in await _zrange(store, K.dead)] == [raw]
        (record,) = await store.command("LRANGE", "result-list", 0, -1)
        assert json.loads(record)["error_code"] == "MAX_DELIVERIES_EXCEEDED"
        assert await store.command("EXISTS", K.claimed, K.owners, K.index, K.deliveries) == 0


async def test_the_orphan_scan_is_bounded_per_call(store: Store) -> None:
    """Many claims, all without a lease entry: one reclaim call reads one HSCAN page and
    handles at most ``scan_count`` of them; never a whole-hash read."""
    with trio.fail_after(60):
        now = int(await server_now(store))
        n, bound = 600, 25
        raws = await claim(store, [(f"r{i}", now + 1000 + i) for i in range(n)])
        await store.command("DEL", K.index)
        ops = QueueOps(store, Q)
        await store.command("CONFIG", "RESETSTAT")
        handled: list[int] = []
        for _ in range(10 * n):
            before = await command_calls(store)
            counts, _more = await ops.reclaim_pass(100, 10, scan_count=bound)
            after = await command_calls(store)
            assert counts.orphans <= bound
            assert counts.redelivered == counts.orphans
            assert after.get("hscan", 0) - before.get("hscan", 0) == 1
            handled.append(counts.orphans)
            if await store.command("HLEN", K.owners) == 0:
                break
        assert sum(handled) == n
        assert len(handled) >= n // bound
        stats = await command_calls(store)
        assert not {"hgetall", "hkeys", "hvals"} & set(stats)
        assert await store.command("ZCARD", K.pending) == n
        assert await store.command("EXISTS", K.claimed, K.owners, K.index) == 0
        assert sorted(m for m, _ in await _zrange(store, K.pending)) == sorted(raws)


async def test_a_consumer_run_advances_the_scan_and_finds_the_orphan(store: Store) -> None:
    """Periodic runs (``full_scan`` False) walk the hashes a page per run: an orphan among
    many leased claims is found within one cycle of runs."""
    with trio.fail_after(60):
        now = int(await server_now(store))
        await claim(store, [(f"r{i}", now + 1000 + i) for i in range(400)])
        await store.command("ZREM", K.index, "r123")
        ops = QueueOps(store, Q)
        found = 0
        for _ in range(100):
            counts = await ops.reclaim(max_deliveries=10, scan_count=20)
            found += counts.orphans
            if found:
                break
        assert found == 1
        assert await store.command("ZRANGE", K.pending, 0, -1) == [member("r123", now + 1123)]


async def test_inspect_counts_real_claims_and_orphans(store: Store) -> None:
    with trio.fail_after(10):
        now = int(await server_now(store))
        await claim(store, [("a", now + 600), ("b", now + 700), ("c", now + 800)])
        snap = await inspect_snapshot(store, Q)
        assert (snap.claimed, snap.orphans, snap.leases, snap.claims_exact) == (3, 0, 3, True)

        await store.command("ZREM", K.index, "a")  # an owner without a lease entry
        await store.command("HDEL", K.owners, "b")  # a payload without owner ...
        await store.command("ZREM", K.index, "b")  # ... and without lease entry
        await store.command("ZADD", K.index, 1, "ghost")  # a lease entry of nothing
        snap = await inspect_snapshot(store, Q)
        assert (snap.claimed, snap.orphans, snap.leases, snap.claims_exact) == (3, 2, 2, True)
        assert snap.to_json()["counts"]["orphans"] == 2


def test_inspect_shows_the_orphan_count(redis_url: str) -> None:
    now = int(server_now_sync(redis_url))
    a = member("a", now + 600)
    do(
        redis_url,
        ("HSET", K.claimed, "a", a, "a:score", now + 600),
        ("HSET", K.owners, "a", DEAD_TOKEN),
    )
    result = CliRunner().invoke(
        app, ["inspect", "-q", Q, "--redis-url", redis_url], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 0, result.output
    assert "claimed 1  orphans 1  expired 0" in result.stdout


# -- helpers ---------------------------------------------------------------------------------


async def _zrange(store: Store, key: str) -> list[tuple[bytes, float]]:
    from redis_state import pairs

    return [
        (m, float(s)) for m, s in pairs(await store.command("ZRANGE", key, 0, -1, "WITHSCORES"))
    ]


def _run(url: str, fn: Any) -> Any:
    from redis_state import redis

    return redis(url, fn)


def server_now_sync(url: str) -> float:
    return float(_run(url, server_now))


async def test_drain_releases_an_orphan_without_counting_a_delivery(store: Store) -> None:
    from claimkit._drain import drain_claims

    with trio.fail_after(10):
        now = int(await server_now(store))
        raw_a, raw_b = await claim(store, [("a", now + 600), ("b", now + 700)])
        await store.command("ZREM", K.index, "a")
        report = await drain_claims(store, Q)
        assert (report.seen, report.released, report.gone, report.ghosts) == (2, 2, 0, 0)
        assert await snapshot(store) == {
            K.pending: [(raw_a, float(now + 600)), (raw_b, float(now + 700))]
        }
