"""Claims without a lease entry are recovered (issue 8, defect 13; docs/protocol.md).

A claim whose ``<q>:claims-idx`` entry is gone (evicted, a partial restore, a hand edit)
while ``<q>:claimed`` / ``<q>:claim-owners`` keep it was never looked at by a reclaimer.
The reclaimer now finds such orphans with a bounded ``HSCAN`` and handles them as expired;
``inspect`` counts what is really claimed and shows the orphans.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import trio
from held_gateway import held_gateway
from support import (
    command_calls,
    config_json,
    do,
    member,
    pairs,
    redis,
    server_now,
    server_now_sync,
    snapshot,
    zrange,
)
from typer.testing import CliRunner

from claimkit.cli.app import app
from claimkit.ops.inspect import snapshot as inspect_snapshot
from claimkit.producer import Producer
from claimkit.protocol.keys import QueueKeys
from claimkit.protocol.models import Envelope, parse_member
from claimkit.protocol.ops import QueueOps, new_token

if TYPE_CHECKING:
    from claimkit.store import Store

Q = "orphans"
K = QueueKeys.for_queue(Q)
DEAD_TOKEN = "d0" * 16  # the owner: a consumer that died long ago
LIVE_TOKEN = "a1" * 16  # the owner: a consumer that may be alive
CLAIMKIT = Path(sys.executable).with_name("claimkit")


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


def reclaim_once(transport: str, *flags: str) -> Any:
    result = CliRunner().invoke(app, ["reclaim", "--once", *flags, "--transport-config", transport])
    assert result.exit_code == 0, result.output
    return result


ONE_ORPHAN_WARNING = (
    "claimkit reclaim: warning: orphans: 1 claim had no lease entry (evicted, partly restored "
    "or edited by hand?); its lease was given back; see docs/operations.md, "
    '"Eviction"\n'
)


def test_reclaim_once_gives_a_live_owners_claim_its_lease_back(redis_url: str) -> None:
    """The issue's case through the CLI: one of two claims loses its index entry while its
    owner may be alive. ``reclaim --once`` does not redeliver it: the claim keeps its owner
    and token and gets the lease a claim taken now would get (now + the lease TTL)."""
    now = int(server_now_sync(redis_url))
    a, b = member("a", now + 3600), member("b", now + 700)
    do(
        redis_url,
        ("HSET", K.claimed, "a", a, "a:score", now + 600, "b", b, "b:score", now + 700),
        ("HSET", K.owners, "a", LIVE_TOKEN, "b", DEAD_TOKEN),
        ("ZADD", K.index, now + 300, "b"),  # "a" has no lease entry
        ("HSET", K.deliveries, "a", 2),
    )
    transport = config_json(redis_url, queue=Q, claim_lease_ttl_seconds=120)
    before = server_now_sync(redis_url)
    result = reclaim_once(transport)
    after = server_now_sync(redis_url)
    assert result.stdout == (
        "claimkit reclaim: queues=1 redelivered=0 dead_lettered=0 ghosts=0 leases_restored=1 "
        "handed_on=0\n"
    )
    assert result.stderr == ONE_ORPHAN_WARNING
    state = redis(redis_url, snapshot)
    (a_lease,) = [score for rid, score in state[K.index] if rid == b"a"]
    assert before + 120 <= a_lease <= after + 120
    assert state == {
        K.claimed: {
            b"a": a,
            b"a:score": str(now + 600).encode(),
            b"b": b,
            b"b:score": str(now + 700).encode(),
        },
        K.owners: {b"a": LIVE_TOKEN.encode(), b"b": DEAD_TOKEN.encode()},
        K.index: [(b"a", a_lease), (b"b", float(now + 300))],
        K.deliveries: {b"a": b"2"},  # no delivery counted, nothing pending
    }
    # The lease is there now: a second run finds nothing.
    again = reclaim_once(transport, "--json")
    doc = json.loads(again.stdout)
    assert (doc["orphans"], doc["leases_restored"], doc["redelivered"]) == (0, 0, 0)
    assert doc["queues"][Q] == {
        "redelivered": 0,
        "dead_lettered": 0,
        "ghosts": 0,
        "orphans": 0,
        "leases_restored": 0,
        "handed_on": 0,
    }
    assert again.stderr == ""


@pytest.mark.slow
def test_reclaim_once_does_not_run_a_live_consumers_request_twice(
    redis_url: str, tmp_path: Path
) -> None:
    """A real ``claimkit serve`` holds a claim whose gateway call is in flight (the gateway
    answers nothing until released); its lease entry is deleted and ``reclaim --once`` runs.
    The claim stays with the live consumer: the gateway sees the request once, one record."""
    deadline = int(server_now_sync(redis_url)) + 600

    async def submit(store: Store) -> None:
        await Producer(store, Q).submit(
            {"id": "live", "deadline": deadline, "payload": {"id": "live", "prompt": "x"}}
        )

    redis(redis_url, submit)
    with held_gateway() as gateway:
        serve_doc = {
            "url": redis_url,
            "queues": [{"queue_name": Q, "igw_base_url": gateway.url}],
            "metrics_port": 0,
            "health_port": 0,
            "poll_interval_ms": 50,
            "claim_lease_ttl_seconds": 90,  # first heartbeat 30 s on: long after the test
            "claim_reclaim_interval_ms": 3_600_000,  # its own reclaimer stays out of the way
        }
        transport = json.dumps(serve_doc)
        err = (tmp_path / "serve.err").open("wb")
        serve = subprocess.Popen(
            [str(CLAIMKIT), "serve", "--transport-config", transport],
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
        err.close()
        try:
            assert gateway.wait_arrivals(1, 20.0) == {"live": 1}
            ((token,),) = do(redis_url, ("HMGET", K.owners, "live"))
            assert do(redis_url, ("ZREM", K.index, "live")) == [1]

            reclaimed = subprocess.run(
                [str(CLAIMKIT), "reclaim", "--once", "--transport-config", transport],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert reclaimed.returncode == 0, reclaimed.stderr
            assert reclaimed.stdout == (
                "claimkit reclaim: queues=1 redelivered=0 dead_lettered=0 ghosts=0 "
                "leases_restored=1 handed_on=0\n"
            )
            assert reclaimed.stderr == ONE_ORPHAN_WARNING
            # Still the live consumer's claim, under its lease; nothing pending.
            assert do(
                redis_url,
                ("HGET", K.owners, "live"),
                ("ZCARD", K.index),
                ("EXISTS", Q, K.deliveries),
            ) == [token, 1, 0]

            gateway.release()
            finish = time.monotonic() + 60
            while do(redis_url, ("LLEN", "result-list"), ("EXISTS", K.claimed)) != [1, 0]:
                assert serve.poll() is None, (tmp_path / "serve.err").read_text()
                assert time.monotonic() < finish, "the request never finished"
                time.sleep(0.05)
            serve.send_signal(signal.SIGTERM)
            assert serve.wait(timeout=30) == 0, (tmp_path / "serve.err").read_text()
        finally:
            if serve.poll() is None:
                serve.kill()
                serve.wait(timeout=10)
        assert gateway.calls() == {"live": 1}
    (records,) = do(redis_url, ("LRANGE", "result-list", 0, -1))
    assert [json.loads(r)["id"] for r in records] == ["live"]
    assert do(redis_url, ("EXISTS", Q, K.claimed, K.owners, K.index, K.dead)) == [0]


def test_a_dead_owners_orphan_comes_back_one_lease_later(redis_url: str) -> None:
    """An orphan whose owner is dead: the first run gives it a (short) lease; once that
    lease passed, the next run redelivers it through the expired path, delivery counted."""
    now = int(server_now_sync(redis_url))
    a = member("a", now + 600)
    do(
        redis_url,
        ("HSET", K.claimed, "a", a, "a:score", now + 600),
        ("HSET", K.owners, "a", DEAD_TOKEN),
        ("HSET", K.deliveries, "a", 2),
    )
    transport = config_json(redis_url, queue=Q, claim_lease_ttl_seconds=1.5)
    first = reclaim_once(transport, "--json")
    assert json.loads(first.stdout)["leases_restored"] == 1
    assert json.loads(first.stdout)["redelivered"] == 0
    (reply,) = do(redis_url, ("ZRANGE", K.index, 0, -1, "WITHSCORES"))
    ((rid, raw_lease),) = pairs(reply)
    assert rid == b"a"
    lease = float(raw_lease)
    deadline = time.monotonic() + 30
    while server_now_sync(redis_url) <= lease:
        assert time.monotonic() < deadline, "the restored lease never passed"
        time.sleep(0.05)
    second = reclaim_once(transport)
    assert second.stdout == (
        "claimkit reclaim: queues=1 redelivered=1 dead_lettered=0 ghosts=0 leases_restored=0 "
        "handed_on=0\n"
    )
    assert second.stderr == ""
    assert redis(redis_url, snapshot) == {
        K.pending: [(a, float(now + 600))],
        K.deliveries: {b"a": b"3"},
    }


async def test_every_kind_of_orphan_is_handled_and_no_payload_is_dropped(store: Store) -> None:
    with trio.fail_after(40):
        now = int(await server_now(store))
        keep = await claim(store, [("kept", now + 900)])  # a normal leased claim: untouched
        owner_only = "owner-only"  # owner entry, no payload, no lease: a ghost
        loose = member("loose", now + 610)  # payload and score, no owner, no lease
        no_score = member("no-score", now + 620)  # payload, no score field, no lease
        bad_score = member("bad-score", now + 630)  # a score field that is not a number
        colon = member("x:score", now + 640)  # an id ending in ":score" is an id too
        claimed_fields = {
            b"loose": loose,
            b"loose:score": str(now + 610.25).encode(),
            b"no-score": no_score,
            b"bad-score": bad_score,
            b"bad-score:score": b"soon",
            b"x:score": colon,
            b"x:score:score": str(now + 640).encode(),
        }
        await store.command(
            "HSET",
            K.claimed,
            *(v for kv in claimed_fields.items() for v in kv),
            "stray:score",
            "12345",  # a score field whose payload is gone
        )
        await store.command("HSET", K.owners, owner_only, DEAD_TOKEN, "no-score", DEAD_TOKEN)
        (kept_idx,) = pairs(await store.command("ZRANGE", K.index, 0, -1, "WITHSCORES"))

        ops = QueueOps(store, Q, lease_ttl=1.0)
        before = await server_now(store)
        counts = await ops.reclaim(max_deliveries=10, full_scan=True)
        after = await server_now(store)
        assert (counts.redelivered, counts.dead, counts.ghosts) == (0, 0, 2)
        assert (counts.orphans, counts.leases_restored) == (6, 4)
        state = await snapshot(store)
        index = state.pop(K.index)
        assert index[-1] == (kept_idx[0], float(kept_idx[1]))
        restored = dict(index[:-1])
        assert sorted(restored) == [b"bad-score", b"loose", b"no-score", b"x:score"]
        assert all(before + 1.0 <= s <= after + 1.0 for s in restored.values()), restored
        assert state == {
            # Only the ghosts are gone: the owner entry alone and the stray score field.
            K.claimed: {b"kept": keep[0], b"kept:score": str(now + 900).encode(), **claimed_fields},
            K.owners: {b"kept": state[K.owners][b"kept"], b"no-score": DEAD_TOKEN.encode()},
        }

        # One lease later nobody renewed them: the expired path redelivers each.
        with trio.fail_after(30):
            while await server_now(store) <= max(restored.values()):
                await trio.sleep(0.05)
        counts = await ops.reclaim(max_deliveries=10, full_scan=True)
        assert (counts.redelivered, counts.dead, counts.ghosts, counts.orphans) == (4, 0, 0, 0)
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
            K.index: [(kept_idx[0], float(kept_idx[1]))],
        }


async def test_the_restored_lease_follows_the_claim_rule(store: Store) -> None:
    """The lease given back is claim-4.lua's: capped at deadline + 30 s, and never less
    than now + min(ttl, 30 s) for a request whose deadline already passed."""
    with trio.fail_after(10):
        now = int(await server_now(store))
        await claim(store, [("near", now + 60), ("past", now - 100)])
        await store.command("DEL", K.index)
        before = await server_now(store)
        counts = await QueueOps(store, Q, lease_ttl=600).reclaim(10, full_scan=True)
        after = await server_now(store)
        assert (counts.orphans, counts.leases_restored, counts.redelivered) == (2, 2, 0)
        leases = dict(await zrange(store, K.index))
        assert leases[b"near"] == float(now + 90)  # deadline + 30 s, under now + 600
        assert before + 30 <= leases[b"past"] <= after + 30  # the floor: now + min(600, 30)


async def test_an_orphan_at_max_deliveries_is_dead_lettered_with_its_record(store: Store) -> None:
    """The orphan gets its lease back first; when that passes unrenewed, the expired path
    dead-letters it at max_deliveries with its record."""
    with trio.fail_after(40):
        now = int(await server_now(store))
        (raw,) = await claim(store, [("p", now + 600)])
        await store.command("ZREM", K.index, "p")
        await store.command("HSET", K.deliveries, "p", 2)
        ops = QueueOps(store, Q, lease_ttl=1.0)
        counts = await ops.reclaim(max_deliveries=3, full_scan=True)
        assert (counts.redelivered, counts.dead, counts.orphans, counts.leases_restored) == (
            0,
            0,
            1,
            1,
        )
        ((_, lease),) = await zrange(store, K.index)
        with trio.fail_after(30):
            while await server_now(store) <= lease:
                await trio.sleep(0.05)
        counts = await ops.reclaim(max_deliveries=3, full_scan=True)
        assert (counts.redelivered, counts.dead, counts.orphans) == (0, 1, 0)
        assert [m for m, _ in await zrange(store, K.dead)] == [raw]
        (record,) = await store.command("LRANGE", "result-list", 0, -1)
        assert json.loads(record)["error_code"] == "MAX_DELIVERIES_EXCEEDED"
        assert await store.command("EXISTS", K.claimed, K.owners, K.index, K.deliveries) == 0


async def test_the_orphan_scan_is_bounded_per_call(store: Store) -> None:
    """Many claims, all without a lease entry: one reclaim call reads one HSCAN page and
    handles at most ``scan_count`` of them; never a whole-hash read."""
    with trio.fail_after(60):
        now = int(await server_now(store))
        n, bound = 600, 25
        await claim(store, [(f"r{i}", now + 1000 + i) for i in range(n)])
        owners = await store.command("HGETALL", K.owners)
        await store.command("DEL", K.index)
        ops = QueueOps(store, Q)
        await store.command("CONFIG", "RESETSTAT")
        handled: list[int] = []
        for _ in range(10 * n):
            before = await command_calls(store)
            counts, _more = await ops.reclaim_pass(100, 10, scan_count=bound)
            after = await command_calls(store)
            assert counts.orphans <= bound
            assert counts.leases_restored == counts.orphans
            assert counts.redelivered == 0
            assert after.get("hscan", 0) - before.get("hscan", 0) == 1
            handled.append(counts.orphans)
            if await store.command("ZCARD", K.index) == n:
                break
        assert sum(handled) == n
        assert len(handled) >= n // bound
        stats = await command_calls(store)
        assert not {"hgetall", "hkeys", "hvals"} & set(stats)
        assert await store.command("EXISTS", K.pending, K.deliveries) == 0
        assert await store.command("HGETALL", K.owners) == owners  # every claim kept


async def test_a_consumer_run_advances_the_scan_and_finds_the_orphan(store: Store) -> None:
    """Periodic runs (``full_scan`` False) walk the hashes a page per run: an orphan among
    many leased claims is found within one cycle of runs, and given its lease back."""
    with trio.fail_after(60):
        now = int(await server_now(store))
        await claim(store, [(f"r{i}", now + 1000 + i) for i in range(400)])
        await store.command("ZREM", K.index, "r123")
        ops = QueueOps(store, Q)
        found = 0
        for _ in range(100):
            counts = await ops.reclaim(max_deliveries=10, scan_count=20)
            assert counts.leases_restored == counts.orphans
            found += counts.orphans
            if found:
                break
        assert found == 1
        assert await store.command("ZSCORE", K.index, "r123") is not None
        assert await store.command("EXISTS", K.pending, K.deliveries) == 0


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


async def test_drain_releases_an_orphan_without_counting_a_delivery(store: Store) -> None:
    from claimkit.ops.drain import drain_claims

    with trio.fail_after(10):
        now = int(await server_now(store))
        raw_a, raw_b = await claim(store, [("a", now + 600), ("b", now + 700)])
        await store.command("ZREM", K.index, "a")
        report = await drain_claims(store, Q)
        assert (report.seen, report.released, report.gone, report.ghosts) == (2, 2, 0, 0)
        assert await snapshot(store) == {
            K.pending: [(raw_a, float(now + 600)), (raw_b, float(now + 700))]
        }
