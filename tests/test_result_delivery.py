"""Durable result delivery (docs/results.md): the scripts one rule at a time, the entries
llm-d-async's readers write and read, and the renewing reader.

Every test runs on a real Redis. Leases are moved into the past by rewriting the lease
index score (as time passing would), never by sleeping.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pytest
import trio
from support import Between, pairs, server_now, wait_for

from claimkit import Producer
from claimkit.protocol.keys import RESULT_TOMBSTONE_TTL_MS, ResultClaimKeys
from claimkit.protocol.models import TerminalRecord
from claimkit.protocol.result_delivery import (
    UNPARSABLE_PREFIX,
    ResultAckCode,
    ResultClaims,
    ResultListCounts,
    ResultOwnershipLost,
    ResultPopRefused,
    unparsable_reason,
)
from claimkit.result_reader import open_result_reader
from claimkit.store import StoreError

if TYPE_CHECKING:
    from claimkit.store import Arg, Store

L = "results"
K = ResultClaimKeys.for_list(L)
DAY_MS = 86_400_000


def rec(rid: str, token: str | None = None, body: str = "{}") -> bytes:
    doc: dict[str, Any] = {"id": rid, "status_code": 200, "payload": body}
    if token is not None:
        doc["request_token"] = token
    return json.dumps(doc, separators=(",", ":")).encode()


async def hash_of(store: Store, key: str) -> dict[bytes, bytes]:
    return dict(pairs(await store.command("HGETALL", key)))


async def zset_of(store: Store, key: str) -> dict[bytes, float]:
    return {m: float(s) for m, s in pairs(await store.command("ZRANGE", key, 0, -1, "WITHSCORES"))}


async def now_ms(store: Store) -> int:
    return int(await server_now(store) * 1000)


async def expire_lease(store: Store, claim_id: str) -> None:
    """Move a lease into the past (as if it ran out)."""
    await store.command("ZADD", K.index, 1, claim_id)


def test_the_key_names() -> None:
    assert K.all() == [
        "results",
        "results:result-claimed",
        "results:result-claim-owners",
        "results:result-claims-idx",
        "results:result-ack-tombstones",
    ]
    c = ResultClaimKeys.for_list("results", cluster=True)
    assert c.all()[1:] == [
        "{results}:result-claimed",
        "{results}:result-claim-owners",
        "{results}:result-claims-idx",
        "{results}:result-ack-tombstones",
    ]
    assert c.results == "results"
    tagged = ResultClaimKeys.for_list("{t}:r", cluster=True)
    assert tagged.claimed == "{t}:r:result-claimed"
    assert K.types() == {
        "results": "list",
        "results:result-claimed": "hash",
        "results:result-claim-owners": "hash",
        "results:result-claims-idx": "zset",
        "results:result-ack-tombstones": "zset",
    }
    with pytest.raises(ValueError, match="cannot be used in cluster mode"):
        ResultClaimKeys.for_list("a}b", cluster=True)


async def test_receive_claims_the_oldest_under_a_lease_in_server_milliseconds(
    store: Store,
) -> None:
    with trio.fail_after(10):
        await store.command("LPUSH", L, rec("r1", "g1"), rec("r2"))  # r1 is the oldest
        before = await now_ms(store)
        (got,) = await ResultClaims(store, L).receive(lease_ms=60_000)
        after = await now_ms(store)
        assert (got.raw, got.claim_id, got.id, got.request_token) == (
            rec("r1", "g1"),
            "r1\0g1",
            "r1",
            "g1",
        )
        assert got.record == TerminalRecord.http("r1", 200, "{}", request_token="g1")
        assert got.unparsable is None
        assert got.dedup_key == ("r1", "g1")
        assert await store.command("LRANGE", L, 0, -1) == [rec("r2")]
        assert await hash_of(store, K.claimed) == {b"r1\0g1": rec("r1", "g1")}
        assert await hash_of(store, K.owners) == {b"r1\0g1": got.owner.encode()}
        index = await zset_of(store, K.index)
        assert index == {b"r1\0g1": Between(before + 60_000, after + 60_000)}
        assert index[b"r1\0g1"] == int(index[b"r1\0g1"])  # whole milliseconds
        # The next receive takes r2, claim id = id alone (no token).
        (second,) = await ResultClaims(store, L).receive(lease_ms=60_000)
        assert (second.claim_id, second.request_token) == ("r2", None)
        assert await ResultClaims(store, L).receive() == []


async def test_claim_id_falls_back_to_the_id_for_an_empty_token(store: Store) -> None:
    await store.command("LPUSH", L, rec("r1", ""))
    (got,) = await ResultClaims(store, L).receive()
    assert (got.claim_id, got.request_token, got.dedup_key) == ("r1", None, ("r1", None))


async def test_count_claims_several_each_as_one_would(store: Store) -> None:
    await store.command("LPUSH", L, *(rec(f"r{i}") for i in range(5)))
    got = await ResultClaims(store, L).receive(3)
    assert [d.claim_id for d in got] == ["r0", "r1", "r2"]
    assert len({d.owner for d in got}) == 1
    assert sorted(await hash_of(store, K.owners)) == [b"r0", b"r1", b"r2"]
    assert await store.command("LLEN", L) == 2


async def test_an_expired_lease_goes_back_to_the_read_end(store: Store) -> None:
    with trio.fail_after(10):
        claims = ResultClaims(store, L)
        await store.command("LPUSH", L, rec("a"), rec("b"))
        a, b = await claims.receive(2)
        await store.command("LPUSH", L, rec("c"))
        await store.command("ZADD", K.index, 2, "a", 1, "b")  # both expired, b the oldest
        got = await claims.receive(1)
        # b expired first: it is read first; a is next, then c (the oldest of the list).
        assert [d.claim_id for d in got] == ["b"]
        assert await store.command("LRANGE", L, 0, -1) == [rec("c"), rec("a")]
        assert await hash_of(store, K.claimed) == {b"b": rec("b")}
        assert [d.claim_id for d in await claims.receive(5)] == ["a", "c"]
        # The old owners are fenced off.
        assert await claims.renew([a, b]) == [False, False]
        assert await claims.ack(a) is ResultAckCode.LOST


async def test_a_tombstone_drops_a_duplicate_of_an_acked_generation(store: Store) -> None:
    with trio.fail_after(10):
        claims = ResultClaims(store, L)
        await store.command("LPUSH", L, rec("r1", "g1"))
        (got,) = await claims.receive()
        before = await now_ms(store)
        assert await claims.ack(got) is ResultAckCode.ACKED
        after = await now_ms(store)
        assert await zset_of(store, K.tombstones) == {
            b"r1\0g1": Between(before + RESULT_TOMBSTONE_TTL_MS, after + RESULT_TOMBSTONE_TTL_MS)
        }
        ttl = await store.command("PTTL", K.tombstones)
        assert RESULT_TOMBSTONE_TTL_MS - 10_000 <= ttl <= RESULT_TOMBSTONE_TTL_MS
        for key in (K.claimed, K.owners, K.index):
            assert await store.command("EXISTS", key) == 0
        # A duplicate (even other bytes) of the acked generation is dropped; a new
        # generation of the id is delivered.
        await store.command("LPUSH", L, rec("r1", "g1", body="again"), rec("r1", "g2"))
        (fresh,) = await claims.receive()
        assert fresh.claim_id == "r1\0g2"
        assert await store.command("EXISTS", L) == 0


async def test_an_expired_tombstone_counts_as_none(store: Store) -> None:
    await store.command("ZADD", K.tombstones, 1, "r1", 2, "r2")
    await store.command("LPUSH", L, rec("r1"))
    (got,) = await ResultClaims(store, L).receive()
    assert got.claim_id == "r1"
    assert await zset_of(store, K.tombstones) == {}  # both removed: r1 met, r2 cleaned up


async def test_a_duplicate_of_a_leased_generation_is_dropped(store: Store) -> None:
    claims = ResultClaims(store, L)
    await store.command("LPUSH", L, rec("r1"))
    (held,) = await claims.receive()
    await store.command("LPUSH", L, rec("r1", body="dup"), rec("r2"))
    (got,) = await claims.receive()
    assert got.claim_id == "r2"
    assert await hash_of(store, K.claimed) == {b"r1": rec("r1"), b"r2": rec("r2")}
    assert await store.command("EXISTS", L) == 0
    assert await claims.ack(held) is ResultAckCode.ACKED


async def test_a_scan_of_only_duplicates_is_repeated(store: Store) -> None:
    """150 duplicates ahead of a record: the first call drops 100 and answers {0}; the
    caller calls again at once and gets the record."""
    claims = ResultClaims(store, L)
    await store.command("LPUSH", L, rec("d"))
    (held,) = await claims.receive()
    await store.command("LPUSH", L, *([rec("d")] * 150), rec("x"))
    (got,) = await claims.receive()
    assert got.claim_id == "x"
    assert await store.command("EXISTS", L) == 0
    assert held.claim_id == "d"


async def test_stale_owners_are_fenced_and_a_repeated_ack_is_fine(store: Store) -> None:
    with trio.fail_after(10):
        claims = ResultClaims(store, L)
        await store.command("LPUSH", L, rec("r1"))
        (got,) = await claims.receive(lease_ms=1_000)
        before = await now_ms(store)
        assert await claims.renew([got], lease_ms=DAY_MS) == [True]
        assert await zset_of(store, K.index) == {
            b"r1": Between(before + DAY_MS, before + DAY_MS + 5000)
        }
        # Another owner took it: renew and ack are fenced off.
        await store.command("HSET", K.owners, "r1", "someone-else")
        assert await claims.renew([got]) == [False]
        assert await claims.ack(got) is ResultAckCode.LOST
        producer = Producer(store, "q", result_list=L)
        with pytest.raises(ResultOwnershipLost, match="no longer this reader's") as lost:
            await producer.ack_result(got)
        assert lost.value.delivery is got
        with pytest.raises(ResultOwnershipLost):
            await producer.renew_result(got)
        # Its own again, but the lease ran out: an expired lease is never revived.
        await store.command("HSET", K.owners, "r1", got.owner)
        await expire_lease(store, "r1")
        assert await claims.renew([got]) == [False]
        assert await claims.ack(got) is ResultAckCode.LOST
        assert await hash_of(store, K.claimed) == {b"r1": rec("r1")}  # untouched
        # Live again: acked, then acked again.
        await store.command("ZADD", K.index, before + DAY_MS, "r1")
        assert await producer.ack_result(got) is ResultAckCode.ACKED
        assert await producer.ack_result(got) is ResultAckCode.ALREADY_ACKED


async def test_an_unparsable_record_stays_leased_under_its_own_claim_id(store: Store) -> None:
    with trio.fail_after(10):
        claims = ResultClaims(store, L)
        bad = [b"not json", b'{"id":7}', b'{"id":"r","request_token":5}', b"[1]", b'{"id":""}']
        await store.command("LPUSH", L, rec("ok"), *bad)  # `ok` is read first
        got = await claims.receive(10)
        assert [d.claim_id for d in got] == ["ok", UNPARSABLE_PREFIX + got[1].owner]
        u = got[1]
        assert (u.raw, u.record, u.id, u.dedup_key) == (b"not json", None, None, None)
        assert u.unparsable == "not JSON (Expecting value: line 1 column 1 (char 0))"
        assert (await hash_of(store, K.claimed))[u.claim_id.encode()] == b"not json"
        assert (await hash_of(store, K.owners))[u.claim_id.encode()] == u.owner.encode()
        # One unparsable record per call (a second would reuse the claim id).
        rest = [await claims.receive(10) for _ in range(4)]
        assert [len(r) for r in rest] == [1, 1, 1, 1]
        assert [r[0].unparsable for r in rest] == [
            "`id` is a number, not a string",
            "`request_token` is a number, not a string",
            "JSON an array, not an object",
            "`id` is empty",
        ]
        assert await store.command("HLEN", K.claimed) == 6  # nothing deleted
        assert unparsable_reason(b'{"x":1}') == "no `id` field"
        assert unparsable_reason(b"\xff") == "not UTF-8 text"


async def test_interop_claimkit_reads_what_upstream_wrote(store: Store) -> None:
    """Entries written as llm-d-async's scripts write them (raw HSET/ZADD): a claim whose
    lease ran out, a live claim and a tombstone keyed id + NUL + request_token."""
    with trio.fail_after(10):
        now = await now_ms(store)
        expired, live, acked = rec("e", "ge"), rec("l", "gl"), rec("a", "ga")
        await store.pipeline(
            [
                ["HSET", K.claimed, "e\0ge", expired, "l\0gl", live],
                ["HSET", K.owners, "e\0ge", "upstream-owner-1", "l\0gl", "upstream-owner-2"],
                ["ZADD", K.index, now - 1000, "e\0ge", now + 60_000, "l\0gl"],
                ["ZADD", K.tombstones, now + RESULT_TOMBSTONE_TTL_MS, "a\0ga"],
                ["LPUSH", K.results, acked, live, rec("n", "gn")],
            ],
            transaction=True,
        )
        got = await ResultClaims(store, L).receive(10)
        # The expired claim came back first; the duplicates of the acked and the leased
        # generation were dropped.
        assert [d.claim_id for d in got] == ["e\0ge", "n\0gn"]
        assert await store.command("EXISTS", L) == 0
        assert await hash_of(store, K.owners) == {
            b"e\0ge": got[0].owner.encode(),
            b"n\0gn": got[0].owner.encode(),
            b"l\0gl": b"upstream-owner-2",
        }


async def test_interop_upstream_reads_what_claimkit_wrote(store: Store) -> None:
    """The exact entries claimkit writes, as upstream's scripts read them: claim id as the
    field and member, the record's bytes, integer millisecond scores."""
    with trio.fail_after(10):
        claims = ResultClaims(store, L)
        await store.command("LPUSH", L, rec("r1", "g1"))
        (got,) = await claims.receive(lease_ms=5_000)
        assert await store.command("HGET", K.claimed, "r1\0g1") == rec("r1", "g1")
        assert await store.command("HGET", K.owners, "r1\0g1") == got.owner.encode()
        score = await store.command("ZSCORE", K.index, "r1\0g1")
        assert float(score) == int(float(score))
        await claims.ack(got)
        assert float(await store.command("ZSCORE", K.tombstones, "r1\0g1")) == int(
            float(await store.command("ZSCORE", K.tombstones, "r1\0g1"))
        )


async def test_a_pop_is_refused_while_durable_readers_have_state(store: Store) -> None:
    producer = Producer(store, "q", result_list=L)
    await store.command("LPUSH", L, rec("r1"), rec("r2"))
    assert await producer.results(1, pop=True) == [TerminalRecord.http("r1", 200, "{}")]
    seeds: list[tuple[str, list[Arg]]] = [
        (K.claimed, ["HSET", K.claimed, "x", "y"]),
        (K.owners, ["HSET", K.owners, "x", "y"]),
        (K.index, ["ZADD", K.index, 1, "x"]),
        (K.tombstones, ["ZADD", K.tombstones, 1, "x"]),
    ]
    for key, seed in seeds:
        await store.command(*seed)
        with pytest.raises(ResultPopRefused, match="has durable readers"):
            await producer.results(10, pop=True)
        assert await store.command("LRANGE", L, 0, -1) == [rec("r2")]
        await store.command("DEL", key)
    assert await producer.results(10, pop=True) == [TerminalRecord.http("r2", 200, "{}")]


async def test_the_reader_renews_what_it_holds_until_acked(store: Store) -> None:
    with trio.fail_after(20):
        await store.command("LPUSH", L, rec("r1"), rec("r2"))
        producer = Producer(store, "q", result_list=L)
        async with producer.result_reader(lease_seconds=1.5, poll_seconds=0.01) as reader:
            first = await reader.receive()
            second = await reader.receive()
            start = await zset_of(store, K.index)

            async def renewed() -> bool:
                now = await zset_of(store, K.index)
                return all(now[m] > start[m] for m in start)

            await wait_for(renewed, "both leases renewed")
            assert await reader.ack(first) is ResultAckCode.ACKED
            assert reader.held == [second]
            reader.forget(second)
            assert reader.held == []
            kept = (await zset_of(store, K.index))[b"r2"]

            async def lapsed() -> bool:
                return await now_ms(store) > kept

            await wait_for(lapsed, "the forgotten lease to run out")
            assert (await zset_of(store, K.index))[b"r2"] == kept  # never renewed again
            again = await reader.receive()  # it came back after its lease
            assert (again.claim_id, again.raw) == ("r2", rec("r2"))
            assert again.owner != second.owner
            with pytest.raises(ResultOwnershipLost):
                await reader.ack(second)
            assert await reader.ack(again) is ResultAckCode.ACKED
        assert await store.command("EXISTS", K.claimed, K.owners, K.index) == 0


async def test_leaving_the_reader_leaves_deliveries_leased(store: Store) -> None:
    await store.command("LPUSH", L, rec("r1"))
    with trio.fail_after(10):
        async with open_result_reader(store, L, lease_seconds=60) as reader:
            async for delivery in reader:
                assert delivery.claim_id == "r1"
                break
    assert await hash_of(store, K.claimed) == {b"r1": rec("r1")}
    with pytest.raises(RuntimeError, match="not open"):
        await reader.receive()
    with pytest.raises(ValueError, match="lease_seconds must be a number of seconds from"):
        async with open_result_reader(store, L, lease_seconds=0):
            pass


async def test_the_calls_pass_the_keys_each_script_header_documents(store: Store) -> None:
    from test_scripts import RecordingStore, header_keys

    from claimkit.store.scripts import script

    with trio.fail_after(10):
        recording = RecordingStore(store)
        claims = ResultClaims(recording, L)
        await store.command("LPUSH", L, rec("r1"))
        (got,) = await claims.receive()
        await claims.renew([got])
        await claims.ack(got)
        assert await claims.counts() == ResultListCounts(0, 0, 0, 1)
        with pytest.raises(ResultPopRefused):  # the tombstone is durable-reader state
            await claims.pop(1)
        called = {name for name, _ in recording.runs}
        assert called == {
            "result-receive",
            "result-renew",
            "result-ack",
            "result-inspect",
            "result-pop",
        }
        for name, keys in recording.runs:
            documented = [
                p.replace("L", L, 1) for _, p in sorted(header_keys(script(name).source).items())
            ]
            assert keys == documented, name


def test_inspect_shows_the_durable_readers_of_the_result_list(redis_url: str) -> None:
    from support import config_json, do, invoke

    transport = config_json(redis_url, queue="q", result_queue_name=L)
    plain = invoke(["inspect", "-q", "q", "--transport-config", transport])
    assert plain.exit_code == 0, plain.output
    assert "tombstones" not in plain.stdout  # nobody reads it durably: no line
    do(
        redis_url,
        ("LPUSH", L, rec("p1"), rec("p2")),
        ("HSET", K.owners, "a", "o", "b", "o"),
        ("ZADD", K.index, 1, "a", 9_999_999_999_999, "b"),
        ("ZADD", K.tombstones, 9_999_999_999_999, "t1", 1, "old"),
    )
    shown = invoke(["inspect", "-q", "q", "--transport-config", transport])
    assert shown.exit_code == 0, shown.output
    assert shown.stdout.splitlines()[-1] == (
        "result list results: pending 2, leased 2 (1 past their lease), tombstones 1"
    )
    doc = json.loads(
        invoke(["inspect", "-q", "q", "--json", "--transport-config", transport]).stdout
    )
    assert doc["result_readers"] == {
        "list": L,
        "pending": 2,
        "leased": 2,
        "expired": 1,
        "tombstones": 1,
    }


async def test_an_error_in_the_reader_block_comes_out_unwrapped(store: Store) -> None:
    async def fails(reader_error: type[BaseException]) -> None:
        async with open_result_reader(store, L) as reader:
            if reader_error is KeyError:
                raise KeyError("mine")
            await reader.receive()

    with trio.fail_after(10):
        with pytest.raises(KeyError, match="mine"):
            await fails(KeyError)
        await store.command("SET", K.claimed, "a string")  # a key of the wrong type
        with pytest.raises(StoreError, match="wrong kind of value"):
            await fails(StoreError)
        assert await store.command("GET", K.claimed) == b"a string"
