"""Dead letters (``<q>:dead``, SPEC §1): list, requeue (``lua/requeue-dead-3.lua``), purge."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pytest
import trio
from support import zrange

from claimkit.ops.dead import (
    DeadLetter,
    PurgeReport,
    find_dead,
    list_dead,
    purge_dead,
    requeue_dead,
)
from claimkit.protocol.operator import OperatorScripts
from claimkit.protocol.ops import CHUNK, QueueOps

if TYPE_CHECKING:
    from claimkit.store import Store

Q = "{t}:jobs"
DEAD = f"{Q}:dead"
TOKEN = "c0ffee" * 5 + "00"


def member(rid: str | None, deadline: Any, token: str = TOKEN, **extra: Any) -> bytes:
    data: dict[str, Any] = {"deadline": deadline, **extra}
    if rid is not None:
        data["id"] = rid
    doc = {"internal": {"request_token": token}, "request_kind": "plain", "data": data}
    return json.dumps(doc, separators=(",", ":")).encode()


async def test_list_is_oldest_first_and_reads_what_it_can(store: Store) -> None:
    with trio.fail_after(10):
        good = member("a", 1_900_000_000)
        no_deadline = member("b", "soon")
        await store.command("ZADD", DEAD, 30, b"\xff not json", 10, good, 20, no_deadline)
        total, letters = await list_dead(store, Q, limit=0)
        assert total == 3
        assert letters == [
            DeadLetter(good, 10.0, "a", 1_900_000_000.0),
            DeadLetter(no_deadline, 20.0, "b", None),
            DeadLetter(b"\xff not json", 30.0, None, None),
        ]
        total, letters = await list_dead(store, Q, limit=2)
        assert (total, [d.id for d in letters]) == (3, ["a", "b"])
        assert letters[0].to_json() == {
            "id": "a",
            "dead_at": 10.0,
            "deadline": 1_900_000_000.0,
            "member": good.decode(),
            "cannot_requeue": None,
        }
        assert await zrange(store, DEAD) != [], "listing removed nothing"


async def test_requeue_by_id_restores_bytes_score_and_resets_deliveries(store: Store) -> None:
    with trio.fail_after(10):
        a = member("a", 1_900_000_123, note={"unknown": ["kept", 1]})
        b = member("b", 1_900_000_456)
        await store.command("ZADD", DEAD, 1, a, 2, b)
        await store.command("HSET", f"{Q}:deliveries", "a", 10, "b", 4)
        await store.command("SET", "result-terminal:a", TOKEN)  # a's MAX_DELIVERIES record

        report = await requeue_dead(store, Q, ["a", "zzz"])

        assert report.requeued == ["a"]
        assert report.not_found == ["zzz"]
        assert report.refused == []
        assert await zrange(store, Q) == [(a, 1_900_000_123.0)]
        assert await zrange(store, DEAD) == [(b, 2.0)]
        assert await store.command("HGETALL", f"{Q}:deliveries") == {b"b": b"4"}
        assert await store.command("EXISTS", "result-terminal:a") == 0


async def test_requeue_keeps_a_marker_of_another_generation_or_when_asked(store: Store) -> None:
    with trio.fail_after(10):
        old = member("a", 1_900_000_000, token="1" * 32)
        await store.command("ZADD", DEAD, 1, old)
        await store.command("SET", "result-terminal:a", "2" * 32)  # a newer generation's
        assert (await requeue_dead(store, Q, ["a"])).requeued == ["a"]
        assert await store.command("GET", "result-terminal:a") == b"2" * 32

        await store.command("DEL", Q)
        mine = member("b", 1_900_000_000)
        await store.command("ZADD", DEAD, 1, mine)
        await store.command("SET", "result-terminal:b", TOKEN)
        assert (await requeue_dead(store, Q, ["b"], keep_marker=True)).requeued == ["b"]
        assert await store.command("GET", "result-terminal:b") == TOKEN.encode()

        tokenless = member("c", 1_900_000_000, token="")
        await store.command("ZADD", DEAD, 1, tokenless)
        await store.command("SET", "result-terminal:c", "1")
        await requeue_dead(store, Q, ["c"])
        assert await store.command("EXISTS", "result-terminal:c") == 0


async def test_requeue_all_generations_of_an_id(store: Store) -> None:
    with trio.fail_after(10):
        g1 = member("a", 1_900_000_001, token="1" * 32)
        g2 = member("a", 1_900_000_002, token="2" * 32)
        await store.command("ZADD", DEAD, 1, g1, 2, g2)
        report = await requeue_dead(store, Q, ["a"])
        assert report.requeued == ["a", "a"]
        assert await zrange(store, Q) == [(g1, 1_900_000_001.0), (g2, 1_900_000_002.0)]


async def test_a_member_without_a_readable_deadline_stays_dead(store: Store) -> None:
    with trio.fail_after(10):
        bad = [member("x", "tomorrow"), member("y", 0), b"not json", member(None, -5)]
        await store.command("ZADD", DEAD, *[v for i, m in enumerate(bad) for v in (i, m)])
        report = await requeue_dead(store, Q, ["x", "y"])
        assert report.requeued == []
        assert [r.letter.id for r in report.refused] == ["x", "y"]
        report = await requeue_dead(store, Q)
        assert report.requeued == []
        assert [r.letter.member for r in report.refused] == bad
        assert [m for m, _ in await zrange(store, DEAD)] == bad
        assert await store.command("EXISTS", Q) == 0


async def test_requeue_all_pages_past_one_chunk_around_stuck_members(store: Store) -> None:
    with trio.fail_after(30):
        n = 2 * CHUNK + 37
        args: list[Any] = []
        expected: list[tuple[bytes, float]] = []
        stuck: list[bytes] = []
        for i in range(n):
            if i % 97 == 0:  # spread through every page, including the first member
                raw = member(f"bad{i}", "never")
                stuck.append(raw)
            else:
                raw = member(f"r{i:05d}", 1_800_000_000 + i)
                expected.append((raw, float(1_800_000_000 + i)))
            args += [i, raw]
        await store.command("ZADD", DEAD, *args)

        report = await requeue_dead(store, Q)

        assert len(report.requeued) == n - len(stuck)
        assert [r.letter.member for r in report.refused] == stuck
        assert await zrange(store, Q) == expected
        assert [m for m, _ in await zrange(store, DEAD)] == stuck


async def test_the_requeue_script_skips_members_no_longer_dead(store: Store) -> None:
    ops = OperatorScripts(store, Q)
    with trio.fail_after(10):
        raw = member("a", 1_900_000_000)
        assert await ops.requeue_dead([raw], keep_marker=False) == [0]
        await store.command("ZADD", DEAD, 5, raw)
        assert await ops.requeue_dead([raw, raw], keep_marker=False) == [1, 0]
        assert await zrange(store, Q) == [(raw, 1_900_000_000.0)]


async def test_a_requeued_poison_request_is_served_again(store: Store) -> None:
    """End to end with the protocol: reclaim dead-letters it, requeue brings it back."""
    with trio.fail_after(10):
        ops = QueueOps(store, Q)
        sec, _ = await store.command("TIME")
        deadline = int(sec) + 3600
        raw = member("p", deadline)
        await store.command("ZADD", Q, deadline, raw)
        await store.command("HSET", f"{Q}:deliveries", "p", 9)
        from claimkit.protocol.models import Envelope, parse_member

        env = parse_member(raw)
        assert isinstance(env, Envelope)
        await ops.claim([(env, "t1")], 0)  # expiry = server now: lapsed for the reclaim
        counts = await ops.reclaim(max_deliveries=10)
        assert counts.dead == 1
        assert await store.command("LLEN", "result-list") == 1

        report = await requeue_dead(store, Q, ["p"])

        assert report.requeued == ["p"]
        assert await zrange(store, Q) == [(raw, float(deadline))]
        assert await store.command("HEXISTS", f"{Q}:deliveries", "p") == 0
        assert await store.command("EXISTS", "result-terminal:p") == 0
        assert await ops.peek(10) == [raw]


async def test_purge_by_ids_by_age_and_all(store: Store) -> None:
    with trio.fail_after(10):
        sec, _ = await store.command("TIME")
        now = int(sec)
        a, b, c, d = (member(x, 1_900_000_000) for x in "abcd")
        a2 = member("a", 1_900_000_001, token="9" * 32)
        await store.command(
            "ZADD", DEAD, now - 1000, a, now - 900, a2, now - 500, b, now - 10, c, now, d
        )
        assert await purge_dead(store, Q, ids=["a", "nope"]) == PurgeReport(2, ["nope"])
        assert [m for m, _ in await zrange(store, DEAD)] == [b, c, d]
        assert await purge_dead(store, Q, older_than=100) == PurgeReport(1)
        assert [m for m, _ in await zrange(store, DEAD)] == [c, d]
        assert await purge_dead(store, Q) == PurgeReport(2)
        assert await store.command("EXISTS", DEAD) == 0
        assert await purge_dead(store, Q) == PurgeReport(0)
        with pytest.raises(ValueError, match="not both"):
            await purge_dead(store, Q, ids=["a"], older_than=1)
        with pytest.raises(ValueError, match="non-negative"):
            await purge_dead(store, Q, older_than=-1)


async def test_find_dead_reads_every_page(store: Store) -> None:
    with trio.fail_after(10):
        n = CHUNK + 3
        await store.command(
            "ZADD", DEAD, *[v for i in range(n) for v in (i, member(f"r{i}", 1_900_000_000))]
        )
        found = await find_dead(store, Q, [f"r{n - 1}", "r0"])
        assert [d.id for d in found] == ["r0", f"r{n - 1}"]


def test_the_cause_of_death_is_found_again_from_the_member() -> None:
    from claimkit.ops.dead import CAUSE_INVALID, CAUSE_MAX_DELIVERIES, DeathCause
    from claimkit.protocol.keys import reserved_keys

    reserved = reserved_keys([Q], "retry-sortedset")
    routed = json.dumps(
        {
            "internal": {"request_token": TOKEN, "result_queue_name": f"{Q}:claimed"},
            "request_kind": "plain",
            "data": {"id": "r", "deadline": 1_900_000_000},
        }
    ).encode()
    letter = DeadLetter.parse(routed, 1.0)
    # The consumer dead-letters a request whose records would land on a queue key...
    assert letter.cause_of_death(max_deliveries=3, reserved=reserved) == DeathCause(
        CAUSE_INVALID,
        f"Failed: internal.result_queue_name names a key claimkit uses: '{Q}:claimed'",
    )
    # ...unless the queue has a result list of its own: then only a reclaimer put it here.
    assert letter.cause_of_death(
        max_deliveries=1, reserved=reserved, result_list_configured=True
    ) == DeathCause(CAUSE_MAX_DELIVERIES, "lease expired 1 time without an ack (max_deliveries=1)")
    garbage = DeadLetter.parse(b"\xff not json", 1.0)
    found = garbage.cause_of_death(max_deliveries=3, reserved=reserved)
    assert found.cause == CAUSE_INVALID
    assert found.reason.startswith("Failed: request is not valid JSON: ")
