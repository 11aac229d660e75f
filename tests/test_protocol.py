"""Each claim-protocol script on its own against a real Redis (SPEC §1, §3).

Every test ends by comparing the *whole* keyspace with what the SPEC says it must hold:
which keys exist, every hash field, every sorted-set member with its score, every list
element, every string with its TTL. Lease and due times come from the Redis server clock,
so they are compared with the ``server_now`` a script returns (or bracketed by ``TIME``).
Expired leases are made by writing small index scores, never by sleeping.

``tests/test_protocol_cluster.py`` runs every test here that takes ``store`` again on a real
Redis Cluster, in the cluster key layout (docs/topology.md#cluster-key-layout): the queue
``{tenant-a}:requests`` keeps its claim keys' names there, and ``result-list`` lives in
another slot, so every ack goes through the outbox. What differs by layout (the dedup
markers, the retry set) is built by ``support.markers`` and ``support.retry_keys``.
"""

from __future__ import annotations

import json
import random
import re
import uuid
from typing import TYPE_CHECKING, Any

import pytest
import trio
from support import (
    Between,
    StoreWrapper,
    is_cluster,
    markers,
    retry_keys,
    server_now,
    set_marker,
    snapshot,
)

from claimkit.protocol.keys import QueueKeys
from claimkit.protocol.models import (
    DEADLINE_INVALID_MESSAGE,
    Envelope,
    ErrorCode,
    Invalid,
    TerminalRecord,
    max_deliveries_message,
    parse_member,
    retry_member,
)
from claimkit.protocol.ops import (
    CHUNK,
    RENEW_CHUNK,
    AckItem,
    ClaimCode,
    QueueOps,
    RenewCode,
    move_retries,
    new_token,
    token_time,
)
from claimkit.store import Arg, ScriptCall, Store, StoreError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from claimkit.store.scripts import Script

Q = "{tenant-a}:requests"
K = QueueKeys.for_queue(Q)
RESULTS = "result-list"
RETRY = "retry-sortedset"
RETRY_DEAD = "retry-sortedset:dead"
DEDUP = 100
TOKEN_A = "a1" * 16
TOKEN_B = "b2" * 16
ODD_IDS = ["a:b:c", "{x}y", "ünï/çødé 1"]

approx = pytest.approx


# -- helpers ---------------------------------------------------------------------------------


def member(
    rid: str,
    deadline: int,
    token: str = "",
    *,
    internal: dict[str, Any] | None = None,
) -> bytes:
    """An envelope whose bytes no serialiser would produce (field order, spacing, ``2.50``,
    unknown fields), so any re-serialisation shows."""
    inner: dict[str, Any] = {"request_token": token} if token else {}
    inner.update(internal or {})
    rid_json, inner_json = (
        json.dumps(rid, ensure_ascii=False),
        json.dumps(inner, ensure_ascii=False),
    )
    return (
        f'{{"data": {{"id": {rid_json}, "deadline": {deadline}, '
        '"payload": {"prompt": "héllo", "t": 0.50}}, '
        '"zz_unknown": [1, 2.50, {"k": null}], "request_kind": "plain", '
        f'"internal": {inner_json}}}'
    ).encode()


def env(raw: bytes) -> Envelope:
    parsed = parse_member(raw)
    assert isinstance(parsed, Envelope), parsed
    return parsed


async def zadd(store: Store, key: str, pairs: Sequence[tuple[float, bytes]]) -> None:
    args: list[Arg] = []
    for score, raw in pairs:
        args += [repr(score) if isinstance(score, float) else score, raw]
    await store.command("ZADD", key, *args)


async def claim_all(
    ops: QueueOps, raws: Sequence[bytes], ttl: float = 60.0
) -> tuple[float, list[ClaimCode], list[str]]:
    tokens = [new_token() for _ in raws]
    now, codes = await ops.claim([(env(r), t) for r, t in zip(raws, tokens, strict=True)], ttl)
    return now, codes, tokens


def claimed_hash(*entries: tuple[str, bytes, bytes]) -> dict[bytes, bytes]:
    """``<q>:claimed`` for ``(id, member, score string)`` entries."""
    out: dict[bytes, bytes] = {}
    for rid, raw, score in entries:
        out[rid.encode()] = raw
        out[(rid + ":score").encode()] = score
    return out


def parse_records(raw_list: Sequence[bytes]) -> list[dict[str, Any]]:
    """Records in the order a consumer RPOPs them (oldest first)."""
    return [json.loads(r) for r in reversed(raw_list)]


def error_record(rid: str, code: str, message: str, token: str = "") -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(TerminalRecord.error(rid, code, message, token).to_json())
    return doc


ERROR_ORDER = ["id", "payload", "error_code", "error_message"]


def ack_item(rid: str, token: str, raw: bytes, record: bytes, gen: str = "") -> AckItem:
    return AckItem(rid, token, gen, RESULTS, record, raw)


def ok_record(rid: str, body: str = '{"ok":true}') -> bytes:
    return TerminalRecord.http(rid, 200, body).to_json()


async def expire(store: Store, *ids: str) -> None:
    """Make leases lapse by writing a tiny index score (no sleeping)."""
    for rid in ids:
        await store.command("ZADD", K.index, "XX", 1, rid)


# -- §3.1 peek -------------------------------------------------------------------------------


async def test_peek_is_earliest_deadline_first_and_removes_nothing(store: Store) -> None:
    with trio.fail_after(10):
        now = int(await server_now(store))
        raws = [member(f"r{i}", now + 100 - i) for i in range(5)]
        await zadd(store, Q, [(now + 100 - i, r) for i, r in enumerate(raws)])
        before = await snapshot(store)
        ops = QueueOps(store, Q)
        assert await ops.peek(3) == [raws[4], raws[3], raws[2]]
        assert await ops.peek(10) == list(reversed(raws))
        assert await snapshot(store) == before


# -- §3.2 claim ------------------------------------------------------------------------------


async def test_claim_moves_exact_bytes_and_records_the_claim(store: Store) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, Q)
        t0 = await server_now(store)
        far, near = int(t0) + 3600, int(t0) + 5
        raws = [member(ODD_IDS[0], far, TOKEN_A), member(ODD_IDS[1], near), member(ODD_IDS[2], far)]
        # The original pending score need not be an integer: it is kept as Redis wrote it.
        await zadd(store, Q, [(far, raws[0]), (near + 0.25, raws[1]), (1234567.125, raws[2])])

        now, codes, tokens = await claim_all(ops, raws, ttl=60.0)
        t1 = await server_now(store)

        assert codes == [ClaimCode.CLAIMED] * 3
        assert t0 <= now <= t1
        lease = approx(now + 60, abs=1e-5)
        assert await snapshot(store) == {
            K.claimed: claimed_hash(
                (ODD_IDS[0], raws[0], str(far).encode()),
                (ODD_IDS[1], raws[1], f"{near}.25".encode()),
                (ODD_IDS[2], raws[2], b"1234567.125"),
            ),
            K.owners: {i.encode(): t.encode() for i, t in zip(ODD_IDS, tokens, strict=True)},
            # min(now + ttl, deadline + 30): the near deadline caps its lease.
            K.index: [
                (ODD_IDS[1].encode(), near + 30),
                (ODD_IDS[0].encode(), lease),
                (ODD_IDS[2].encode(), lease),
            ],
        }


async def test_claim_lost_race_writes_nothing(store: Store) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, Q)
        now = int(await server_now(store))
        here, gone = member("here", now + 60), member("gone", now + 60)
        await zadd(store, Q, [(now + 60, here)])
        _, codes, tokens = await claim_all(ops, [gone, here])
        assert codes == [ClaimCode.NOT_PENDING, ClaimCode.CLAIMED]
        state = await snapshot(store)
        assert state[K.claimed] == claimed_hash(("here", here, str(now + 60).encode()))
        assert state[K.owners] == {b"here": tokens[1].encode()}
        assert [m for m, _ in state[K.index]] == [b"here"]

        # A member a ZPOPMIN consumer took between peek and claim: nothing at all is written.
        await store.command("FLUSHDB")
        _, codes, _ = await claim_all(ops, [gone])
        assert codes == [ClaimCode.NOT_PENDING]
        assert await snapshot(store) == {}


async def test_a_second_claim_of_a_claimed_member_is_lost(store: Store) -> None:
    with trio.fail_after(10):
        ops, rival = QueueOps(store, Q), QueueOps(store, Q)
        now = int(await server_now(store))
        raw = member("a", now + 60)
        await zadd(store, Q, [(now + 60, raw)])
        _, codes, _ = await claim_all(ops, [raw])
        assert codes == [ClaimCode.CLAIMED]
        before = await snapshot(store)
        _, codes, _ = await claim_all(rival, [raw])
        assert codes == [
            ClaimCode.NOT_PENDING
        ]  # the rival lost the race: it may poll again at once
        assert await snapshot(store) == before


async def test_busy_id_stays_pending(store: Store) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, Q)
        now = int(await server_now(store))
        gen1, gen2 = member("a", now + 60, TOKEN_A), member("a", now + 90, TOKEN_B)
        await zadd(store, Q, [(now + 60, gen1)])
        _, _, (tok1,) = await claim_all(ops, [gen1])
        await zadd(store, Q, [(now + 90, gen2)])  # a second generation of the reused id
        before = await snapshot(store)

        _, codes, _ = await claim_all(ops, [gen2])
        assert codes == [ClaimCode.BUSY]
        assert await snapshot(store) == before
        assert before[Q] == [(gen2, now + 90)]
        assert before[K.owners] == {b"a": tok1.encode()}


@pytest.mark.parametrize(
    ("request_token", "cancel_value", "code"),
    [
        (TOKEN_A, TOKEN_A, ClaimCode.CANCELLED),
        (TOKEN_A, TOKEN_B, ClaimCode.CLAIMED),  # a cancel of another generation
        ("", "", ClaimCode.CLAIMED),  # no request_token: never cancelled
        ("", "1", ClaimCode.CLAIMED),
    ],
)
async def test_claim_reports_cancellation(
    store: Store, request_token: str, cancel_value: str, code: int
) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, Q)
        now = int(await server_now(store))
        raw = member("c:1", now + 60, request_token)
        await zadd(store, Q, [(now + 60, raw)])
        await store.command("SET", "request-cancel:c:1", cancel_value, "EX", 604800)

        server, codes, (token,) = await claim_all(ops, [raw])
        assert codes == [code]
        # Cancelled or not, it is claimed (then acked with CANCELLED, SPEC §3.2).
        assert await snapshot(store) == {
            "request-cancel:c:1": (cancel_value.encode(), 604800),
            K.claimed: claimed_hash(("c:1", raw, str(now + 60).encode())),
            K.owners: {b"c:1": token.encode()},
            K.index: [(b"c:1", approx(min(server + 60, now + 90), abs=1e-5))],
        }


async def test_claim_with_a_claims_index_of_another_type_writes_nothing(store: Store) -> None:
    """A claim without its index entry would never be reclaimed: the script must refuse
    before its first write, not after ZREM and HSET."""
    with trio.fail_after(10):
        now = int(await server_now(store))
        raws = [member("a", now + 60), member("b", now + 61)]
        await zadd(store, Q, [(now + 60, raws[0]), (now + 61, raws[1])])
        await store.command("SET", K.index, "oops")
        before = await snapshot(store)
        with pytest.raises(StoreError, match="wrong kind of value"):
            await claim_all(QueueOps(store, Q), raws)
        assert await snapshot(store) == before


async def test_a_cancel_key_of_another_type_is_not_a_cancellation(store: Store) -> None:
    """It cannot hold the request's token; reading it must not fail a half-done batch."""
    with trio.fail_after(10):
        now = int(await server_now(store))
        gen = "ab" * 16
        raws = [member("a", now + 60, gen), member("b", now + 61, gen)]
        await zadd(store, Q, [(now + 60, raws[0]), (now + 61, raws[1])])
        await store.command("RPUSH", "request-cancel:a", gen)
        _, codes, tokens = await claim_all(QueueOps(store, Q), raws)
        assert codes == [ClaimCode.CLAIMED, ClaimCode.CLAIMED]
        state = await snapshot(store)
        assert state[K.owners] == {b"a": tokens[0].encode(), b"b": tokens[1].encode()}
        assert Q not in state
        assert [m for m, _ in state[K.index]] == [b"a", b"b"]
        assert await store.command("LRANGE", "request-cancel:a", 0, -1) == [gen.encode()]


async def test_claim_of_an_expired_deadline_gets_a_floor_lease(store: Store) -> None:
    """deadline + 30 is already past: the lease is server_now + min(ttl, 30) instead, so the
    claim is not reclaimable before its DEADLINE_EXCEEDED ack."""
    with trio.fail_after(10):
        ops = QueueOps(store, Q)
        now = int(await server_now(store))
        raw = member("late", now - 100)
        await zadd(store, Q, [(now - 100, raw)])
        snow, codes, _ = await claim_all(ops, [raw], ttl=300)
        assert codes == [ClaimCode.CLAIMED]
        assert (await snapshot(store))[K.index] == [(b"late", pytest.approx(snow + 30, abs=1e-5))]
        snow, codes, _ = await claim_all(ops, [member("late2", now - 100)], ttl=5)
        assert codes == [ClaimCode.NOT_PENDING]  # not pending at all


async def test_claim_batches_larger_than_a_chunk(store: Store) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, Q)
        now = int(await server_now(store))
        n = 2 * CHUNK + 7
        raws = [member(f"bulk-{i}", now + 600 + i) for i in range(n)]
        await zadd(store, Q, [(now + 600 + i, r) for i, r in enumerate(raws)])
        _, codes, tokens = await claim_all(ops, raws)
        assert codes == [ClaimCode.CLAIMED] * n
        state = await snapshot(store)
        assert Q not in state
        assert state[K.claimed] == claimed_hash(
            *((f"bulk-{i}", r, str(now + 600 + i).encode()) for i, r in enumerate(raws))
        )
        assert state[K.owners] == {f"bulk-{i}".encode(): t.encode() for i, t in enumerate(tokens)}
        assert len(state[K.index]) == n


async def test_ids_ending_in_score_do_not_collide(store: Store) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, Q)
        now = int(await server_now(store))
        x, xs = member("x", now + 100), member("x:score", now + 200)
        await zadd(store, Q, [(now + 100, x), (now + 200, xs)])
        _, _, tokens = await claim_all(ops, [x, xs])
        await ops.release([("x", tokens[0], None), ("x:score", tokens[1], None)])
        assert await snapshot(store) == {Q: [(x, now + 100), (xs, now + 200)]}
        # And the same through lease expiry: both come back, byte for byte.
        await store.command("FLUSHDB")
        await zadd(store, Q, [(now + 100, x), (now + 200, xs)])
        await claim_all(ops, [xs, x])
        await expire(store, "x", "x:score")  # only leases that exist
        await ops.reclaim(max_deliveries=0)
        state = await snapshot(store)
        assert state.get(Q) == [(x, now + 100), (xs, now + 200)]


# -- ownership tokens (§1) ---------------------------------------------------------------------


def test_tokens_are_uuid7_stamped_with_the_claim_time() -> None:
    tokens = {new_token(now=1_796_000_000.1234) for _ in range(2000)}
    assert len(tokens) == 2000  # 66 random bits each: no repeats
    for token in tokens:
        assert re.fullmatch(r"[0-9a-f]{32}", token)
        parsed = uuid.UUID(token)
        assert (parsed.version, parsed.variant) == (7, uuid.RFC_4122)
        assert token[13:15] == "c1"  # claimkit's tag
        assert token_time(token) == 1_796_000_000.123  # milliseconds, truncated
    # The random bits vary in every position they occupy.
    assert len({t[15] for t in tokens}) == 16
    assert len({t[17:] for t in tokens}) == 2000


GOOD = new_token(now=1_796_000_000)


@pytest.mark.parametrize(
    "foreign",
    [
        "a" * 32,  # hex, but no version, variant or tag
        "ab" * 16,
        GOOD[:12] + "4" + GOOD[13:],  # another UUID version
        GOOD[:16] + "c" + GOOD[17:],  # another variant (110)
        GOOD[:13] + "c2" + GOOD[15:],  # a UUIDv7, but not claimkit's tag
        GOOD.upper(),  # claimkit writes lower case
        GOOD[:-1],  # 31 chars
        "0x" + GOOD[2:],  # int(x, 16) would read this
        new_token(now=1_500_000_000),  # stamped before 2020: not a claim time
        "",
    ],
)
def test_token_time_is_none_for_tokens_that_are_not_ours(foreign: str) -> None:
    assert token_time(foreign) is None


def test_a_random_token_passes_for_ours_rarely() -> None:
    """Old random tokens or another consumer's: at most ~1 in 16,384 has the layout, and
    then its stamp must also fall after 2020 (and, in inspect, not ahead of the clock)."""
    rng = random.Random(7)  # seeded: the count is fixed, the test cannot flake
    matched = sum(token_time(f"{rng.getrandbits(128):032x}") is not None for _ in range(50_000))
    assert matched <= 10


# -- §3.3 renew ------------------------------------------------------------------------------


async def test_renew_moves_the_lease_forward_only_for_the_owner(store: Store) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, Q)
        now = int(await server_now(store))
        deadline = now + 3600
        raws = [member("mine", deadline), member("stolen", deadline)]
        await zadd(store, Q, [(deadline, r) for r in raws])
        claimed_at, _, (mine, stolen) = await claim_all(ops, raws, ttl=10)
        before = await snapshot(store)

        server, codes = await ops.renew(
            [("mine", mine, deadline), ("stolen", TOKEN_B, deadline), ("gone", mine, deadline)],
            lease_ttl=100,
        )
        assert codes == [1, -1, 0]
        assert server >= claimed_at
        assert stolen.encode() == before[K.owners][b"stolen"]
        after = await snapshot(store)
        # Only the owner's lease moved, to server_now + ttl; nothing else changed at all.
        assert after == before | {
            K.index: [
                (b"stolen", approx(claimed_at + 10, abs=1e-5)),
                (b"mine", approx(server + 100, abs=1e-5)),
            ]
        }


async def test_renew_wrong_token_or_gone_changes_nothing(store: Store) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, Q)
        now = int(await server_now(store))
        raw = member("a", now + 600)
        await zadd(store, Q, [(now + 600, raw)])
        await claim_all(ops, [raw])
        before = await snapshot(store)
        _, codes = await ops.renew([("a", TOKEN_B, now + 600)], 100)
        assert codes == [-1]
        _, codes = await ops.renew([("nobody", TOKEN_B, now + 600)], 100)
        assert codes == [0]
        assert await snapshot(store) == before  # no index entry created for "nobody"


class CountingStore(StoreWrapper):
    """Delegates to a real store; records each round trip and each script call."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.trips: list[tuple[str, int]] = []  # (method, commands or script calls sent)
        self.runs: list[str] = []  # script names, one per script call

    async def command(self, *args: Arg) -> Any:
        self.trips.append(("command", 1))
        return await self.inner.command(*args)

    async def pipeline(self, commands: Sequence[Sequence[Arg]], *, transaction: bool) -> list[Any]:
        self.trips.append(("pipeline", len(commands)))
        return await self.inner.pipeline(commands, transaction=transaction)

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[Arg]) -> Any:
        self.trips.append(("run", 1))
        self.runs.append(script.name)
        return await self.inner.run(script, keys, args)

    async def run_many(self, script: Script, calls: Sequence[ScriptCall]) -> list[Any]:
        self.trips.append(("run_many", len(calls)))
        self.runs += [script.name] * len(calls)
        return await self.inner.run_many(script, calls)


async def test_a_renew_tick_is_one_round_trip_of_bounded_calls(store: Store) -> None:
    """More claims than two chunks: one pipelined round trip of three script calls renews
    every lease; a stolen claim in the last chunk is reported at its position."""
    with trio.fail_after(20):
        n = 2 * RENEW_CHUNK + 5
        now = int(await server_now(store))
        raws = [member(f"h-{i}", now + 3600) for i in range(n)]
        await zadd(store, Q, [(now + 3600, r) for r in raws])
        claimed_at, codes, tokens = await claim_all(QueueOps(store, Q), raws, ttl=10)
        assert codes == [ClaimCode.CLAIMED] * n
        await store.command("HSET", K.owners, f"h-{n - 1}", TOKEN_B)  # stolen meanwhile
        counting = CountingStore(store)

        server, renewed = await QueueOps(counting, Q).renew(
            [(f"h-{i}", t, now + 3600) for i, t in enumerate(tokens)], lease_ttl=100
        )

        assert counting.trips == [("run_many", 3)]
        assert renewed == [1] * (n - 1) + [-1]
        index = dict((await snapshot(store))[K.index])
        assert index[f"h-{n - 1}".encode()] == approx(claimed_at + 10, abs=1e-5)
        # Each chunk runs at its own server instant, never later than the reply's.
        leases = [index[f"h-{i}".encode()] for i in range(n - 1)]
        assert all(claimed_at + 100 < lease <= server + 100 + 1e-5 for lease in leases)


async def test_renew_is_capped_at_deadline_plus_30(store: Store) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, Q)
        now = int(await server_now(store))
        raw = member("soon", now + 5)
        await zadd(store, Q, [(now + 5, raw)])
        _, _, (token,) = await claim_all(ops, [raw], ttl=1)
        _, codes = await ops.renew([("soon", token, now + 5)], 1000)
        assert codes == [1]
        assert (await snapshot(store))[K.index] == [(b"soon", now + 35)]


async def test_renew_of_a_passed_deadline_keeps_the_claim_floor_and_no_more(store: Store) -> None:
    """One lease rule (lua/_lease.lua): the claim of a request whose deadline + 30 already
    passed gets the floor server_now + min(ttl, 30), so its DEADLINE_EXCEEDED ack cannot be
    overtaken by a reclaimer; a heartbeat neither shortens that lease nor carries it past
    the floor, so a worker stuck past its deadline loses the claim when the floor lapses."""
    with trio.fail_after(10):
        ops = QueueOps(store, Q)
        now = int(await server_now(store))
        raw = member("late", now - 100)
        await zadd(store, Q, [(now - 100, raw)])
        cnow, _, (token,) = await claim_all(ops, [raw], ttl=300)
        floor = (await snapshot(store))[K.index]
        assert floor == [(b"late", pytest.approx(cnow + 30, abs=1e-5))]
        _, codes = await ops.renew([("late", token, now - 100)], 300)
        assert codes == [RenewCode.RENEWED]
        assert (await snapshot(store))[K.index] == floor  # not shortened, not extended
        # The floor has lapsed (as if 31 s later): a renewal does not bring it back.
        await store.command("ZADD", K.index, now - 5, "late")
        _, codes = await ops.renew([("late", token, now - 100)], 300)
        assert codes == [RenewCode.RENEWED]
        assert (await snapshot(store))[K.index] == [(b"late", float(now - 5))]


# -- §3.4 ack --------------------------------------------------------------------------------


async def test_ack_pushes_the_record_and_drops_the_claim(store: Store) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, Q, dedup_ttl=DEDUP)
        now = int(await server_now(store))
        raw = member(ODD_IDS[2], now + 600, TOKEN_A)
        await zadd(store, Q, [(now + 600, raw)])
        _, _, (token,) = await claim_all(ops, [raw])
        await store.command("HSET", K.deliveries, ODD_IDS[2], 2)
        record = ok_record(ODD_IDS[2], '{"text":"ünï"}')

        assert await ops.ack([ack_item(ODD_IDS[2], token, raw, record, TOKEN_A)]) == [(True, True)]
        acked = {RESULTS: [record], **markers(store, (ODD_IDS[2], TOKEN_A, DEDUP))}
        assert await snapshot(store) == acked

        # A second ack of the same generation is a suppressed duplicate: nothing is pushed.
        assert await ops.ack([ack_item(ODD_IDS[2], token, raw, record, TOKEN_A)]) == [
            (False, False)
        ]
        assert await snapshot(store) == acked


async def test_ack_without_a_request_token_marks_1_and_ttl_0_never_expires(store: Store) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, Q, dedup_ttl=0)
        now = int(await server_now(store))
        raw = member("plain", now + 600)
        await zadd(store, Q, [(now + 600, raw)])
        _, _, (token,) = await claim_all(ops, [raw])
        assert await ops.ack([ack_item("plain", token, raw, ok_record("plain"))]) == [(True, True)]
        assert await snapshot(store) == {
            RESULTS: [ok_record("plain")],
            **markers(store, ("plain", "1", 0)),
        }


async def test_ack_of_a_new_generation_is_pushed_again(store: Store) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, Q, dedup_ttl=DEDUP)
        now = int(await server_now(store))
        gen1, gen2 = member("r", now + 600, TOKEN_A), member("r", now + 700, TOKEN_B)
        await zadd(store, Q, [(now + 600, gen1)])
        _, _, (tok1,) = await claim_all(ops, [gen1])
        rec1, rec2 = ok_record("r", "first"), ok_record("r", "second")
        assert await ops.ack([ack_item("r", tok1, gen1, rec1, TOKEN_A)]) == [(True, True)]

        await zadd(store, Q, [(now + 700, gen2)])
        _, _, (tok2,) = await claim_all(ops, [gen2])
        assert await ops.ack([ack_item("r", tok2, gen2, rec2, TOKEN_B)]) == [(True, True)]
        assert await snapshot(store) == {
            RESULTS: [rec2, rec1],
            **markers(store, ("r", TOKEN_B, DEDUP)),
        }


async def test_marker_1_suppresses_every_generation(store: Store) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, Q, dedup_ttl=DEDUP)
        now = int(await server_now(store))
        await set_marker(store, "r", "1", DEDUP)
        gen = member("r", now + 600, TOKEN_B)
        await zadd(store, Q, [(now + 600, gen)])
        _, _, (token,) = await claim_all(ops, [gen])
        assert await ops.ack([ack_item("r", token, gen, ok_record("r"), TOKEN_B)]) == [
            (False, True)
        ]
        # Suppressed, but the owner's claim is still deleted.
        assert await snapshot(store) == markers(store, ("r", "1", DEDUP))


async def test_ack_without_a_token_is_suppressed_by_any_marker(store: Store) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, Q, dedup_ttl=DEDUP)
        now = int(await server_now(store))
        await set_marker(store, "r", TOKEN_A)
        raw = member("r", now + 600)
        await zadd(store, Q, [(now + 600, raw)])
        _, _, (token,) = await claim_all(ops, [raw])
        assert await ops.ack([ack_item("r", token, raw, ok_record("r"))]) == [(False, True)]
        assert await snapshot(store) == markers(store, ("r", TOKEN_A, 0))


async def test_late_ack_of_a_stolen_claim_is_suppressed_and_leaves_the_owner_alone(
    store: Store,
) -> None:
    """A stalled owner's late result while another instance holds the request: pushing it
    would leave the request both recorded and claimed (and run on). It is suppressed, and
    the current owner's ack writes the one record (chaos harness, SIGSTOP past the lease)."""
    with trio.fail_after(10):
        ops = QueueOps(store, Q, dedup_ttl=DEDUP)
        now = int(await server_now(store))
        raw = member("r", now + 600, TOKEN_A)
        await zadd(store, Q, [(now + 600, raw)])
        _, _, (tok_a,) = await claim_all(ops, [raw])
        await expire(store, "r")
        assert (await ops.reclaim(max_deliveries=10)).redelivered == 1
        server_b, _, (tok_b,) = await claim_all(ops, [raw])  # instance B holds it now
        b_holds = {
            K.claimed: claimed_hash(("r", raw, str(now + 600).encode())),
            K.owners: {b"r": tok_b.encode()},
            K.index: [(b"r", approx(server_b + 60, abs=1e-5))],
            K.deliveries: {b"r": b"1"},
        }

        late = ok_record("r", "A")
        assert await ops.ack([ack_item("r", tok_a, raw, late, TOKEN_A)]) == [(False, False)]
        assert await snapshot(store) == b_holds
        # B finishes: its record is the one record, and B's claim ends.
        rec = ok_record("r", "B")
        assert await ops.ack([ack_item("r", tok_b, raw, rec, TOKEN_A)]) == [(True, True)]
        assert await snapshot(store) == {RESULTS: [rec], **markers(store, ("r", TOKEN_A, DEDUP))}


async def test_late_ack_of_a_request_parked_by_its_new_owner_is_suppressed(store: Store) -> None:
    """The new owner parked the request for a retry: the retry set is its one home, so the
    stalled owner's late result is suppressed rather than recorded beside it."""
    with trio.fail_after(10):
        ops = QueueOps(store, Q, dedup_ttl=DEDUP)
        now = int(await server_now(store))
        raw = member("r", now + 600, TOKEN_A)
        await zadd(store, Q, [(now + 600, raw)])
        _, _, (tok_a,) = await claim_all(ops, [raw])
        await expire(store, "r")
        await ops.reclaim(max_deliveries=10)
        _, _, (tok_b,) = await claim_all(ops, [raw])
        retry = retry_member(raw, Q)
        server, codes = await ops.park([("r", tok_b, 30.0, retry)])
        assert codes == [1]
        parked = {
            retry_keys(store, Q)[0]: [(retry, approx(server + 30, abs=1e-5))],
            K.deliveries: {b"r": b"1"},
        }
        assert await snapshot(store) == parked

        assert await ops.ack([ack_item("r", tok_a, raw, ok_record("r"), TOKEN_A)]) == [
            (False, False)
        ]
        assert await snapshot(store) == parked


async def test_late_ack_withdraws_the_redelivered_pending_copy(store: Store) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, Q, dedup_ttl=DEDUP)
        now = int(await server_now(store))
        raw = member("r", now + 600, TOKEN_A)
        await zadd(store, Q, [(now + 600, raw)])
        _, _, (token,) = await claim_all(ops, [raw])
        await expire(store, "r")
        await ops.reclaim(max_deliveries=10)
        assert await snapshot(store) == {Q: [(raw, now + 600)], K.deliveries: {b"r": b"1"}}

        rec = ok_record("r")
        assert await ops.ack([ack_item("r", token, raw, rec, TOKEN_A)]) == [(True, False)]
        assert await snapshot(store) == {RESULTS: [rec], **markers(store, ("r", TOKEN_A, DEDUP))}


async def test_ack_routes_each_record_to_its_list(store: Store) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, Q, dedup_ttl=DEDUP)
        now = int(await server_now(store))
        raws = [member("a", now + 600), member("b", now + 600)]
        await zadd(store, Q, [(now + 600, r) for r in raws])
        _, _, tokens = await claim_all(ops, raws)
        items = [
            AckItem("a", tokens[0], "", "list-a", ok_record("a"), raws[0]),
            AckItem("b", tokens[1], "", "list-b", ok_record("b"), raws[1]),
        ]
        assert await ops.ack(items) == [(True, True), (True, True)]
        assert await snapshot(store) == {
            "list-a": [ok_record("a")],
            "list-b": [ok_record("b")],
            **markers(store, ("a", "1", DEDUP), result_list="list-a"),
            **markers(store, ("b", "1", DEDUP), result_list="list-b"),
        }


# -- §3.5 park and the retry mover -----------------------------------------------------------


async def test_park_moves_the_claim_to_the_retry_set(store: Store) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, Q)
        now = int(await server_now(store))
        raw = member("p:1", now + 600, TOKEN_A, internal={"retry_count": 2, "x-keep": {"a": 1}})
        await zadd(store, Q, [(now + 600, raw)])
        _, _, (token,) = await claim_all(ops, [raw])
        await store.command("HSET", K.deliveries, "p:1", 1)
        retry = retry_member(raw, Q)

        server, codes = await ops.park([("p:1", token, 7.5, retry)])
        assert codes == [1]
        assert await snapshot(store) == {
            retry_keys(store, Q)[0]: [(retry, approx(server + 7.5, abs=1e-5))],
            # The redelivery count is about the request, not the claim: it survives retries.
            K.deliveries: {b"p:1": b"1"},
        }
        doc, original = json.loads(retry), json.loads(raw)
        assert doc["internal"] == original["internal"] | {
            "retry_count": 3,
            "request_queue_name": Q,
        }
        assert list(doc) == list(original)  # unknown fields and their order kept
        assert {k: v for k, v in doc.items() if k != "internal"} == {
            k: v for k, v in original.items() if k != "internal"
        }


async def test_park_is_fenced(store: Store) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, Q)
        now = int(await server_now(store))
        raw = member("p", now + 600)
        await zadd(store, Q, [(now + 600, raw)])
        await claim_all(ops, [raw])
        before = await snapshot(store)
        retry = retry_member(raw, Q)
        _, codes = await ops.park([("p", TOKEN_B, 1.0, retry), ("gone", TOKEN_B, 1.0, retry)])
        assert codes == [0, 0]
        assert await snapshot(store) == before


def retry_doc(rid: str, deadline: Any, queue: str | None) -> bytes:
    internal: dict[str, Any] = {"retry_count": 1, "x": "ü"}
    if queue is not None:
        internal["request_queue_name"] = queue
    return json.dumps(
        {"internal": internal, "request_kind": "plain", "data": {"id": rid, "deadline": deadline}},
        ensure_ascii=False,
    ).encode()


async def move_due(store: Store, *, limit: int = CHUNK) -> tuple[int, int]:
    """The retry mover as the consumer runs it: standalone on the shared set, on a cluster
    on ``Q``'s own set."""
    if is_cluster(store):
        return await QueueOps(store, Q).move_retries(limit=limit)
    return await move_retries(store, RETRY, limit=limit)


async def test_move_retries_routes_due_members_and_dead_letters_the_rest(store: Store) -> None:
    """On a cluster the set is the queue's own: a member naming another queue (written by
    hand) cannot be routed from the queue's slot and is dead-lettered too."""
    with trio.fail_after(10):
        retry, retry_dead = retry_keys(store, Q)
        now = int(await server_now(store))
        due = retry_doc("due", now + 500, Q)
        other = retry_doc("other", now + 400, "other-queue")
        later = retry_doc("later", now + 500, Q)
        bad_json = b"{not json"
        no_queue = retry_doc("nq", now + 500, None)
        str_deadline = retry_doc("sd", str(now + 500), Q)
        await zadd(
            store,
            retry,
            [
                (1.0, due),
                (2.0, other),
                (now + 3600.0, later),
                (3.0, bad_json),
                (4.0, no_queue),
                (5.0, str_deadline),
            ],
        )
        await zadd(store, Q, [(now + 450, member("x", now + 450))])
        t0 = await server_now(store)

        unroutable = [bad_json, no_queue, str_deadline]
        routed: dict[str, Any] = {"other-queue": [(other, now + 400)]}
        if is_cluster(store):
            unroutable, routed = [*unroutable, other], {}
        assert await move_due(store) == (1 + len(routed), len(unroutable))
        t1 = await server_now(store)
        assert await snapshot(store) == {
            Q: [(member("x", now + 450), now + 450), (due, now + 500)],
            **routed,
            retry: [(later, now + 3600)],
            # One server time for the batch; equal scores sort by member bytes.
            retry_dead: [(m, Between(t0, t1)) for m in sorted(unroutable)],
        }


async def test_move_retries_drains_a_backlog_larger_than_its_limit(store: Store) -> None:
    with trio.fail_after(10):
        now = int(await server_now(store))
        members = [retry_doc(f"m{i}", now + 1000 + i, Q) for i in range(25)]
        await zadd(
            store, retry_keys(store, Q)[0], [(float(i + 1), m) for i, m in enumerate(members)]
        )
        counting = CountingStore(store)
        assert await move_due(counting, limit=10) == (25, 0)
        mover = "move-retries-queue" if is_cluster(store) else "move-retries"
        assert counting.runs == [mover] * 3
        assert await snapshot(store) == {Q: [(m, now + 1000 + i) for i, m in enumerate(members)]}


async def test_move_retries_never_loses_a_member_routed_to_a_wrong_type_key(store: Store) -> None:
    with trio.fail_after(10):
        now = int(await server_now(store))
        retry, retry_dead = retry_keys(store, Q)
        await store.command("RPUSH", "not-a-zset", "x")
        bad = retry_doc("wt", now + 500, "not-a-zset")
        await zadd(store, retry, [(1.0, bad)])
        try:
            await move_due(store)
        finally:
            state = await snapshot(store)
            assert bad in [m for m, _ in state.get(retry, []) + state.get(retry_dead, [])]


async def test_move_retries_dead_letters_a_nan_deadline(store: Store) -> None:
    """Redis's cjson reads ``nan`` as a number; a ZADD at NaN would fail after the ZREM and
    lose the member. lua/_member.lua reads no NaN deadline, so it is dead-lettered."""
    with trio.fail_after(10):
        bad = b'{"request_kind":"plain","data":{"id":"n","deadline":nan},"internal":'
        bad += b'{"request_queue_name":"' + Q.encode() + b'"}}'
        retry, retry_dead = retry_keys(store, Q)
        await zadd(store, retry, [(1.0, bad)])
        t0 = await server_now(store)
        assert await move_due(store) == (0, 1)
        t1 = await server_now(store)
        assert await snapshot(store) == {retry_dead: [(bad, Between(t0, t1))]}


# -- §3.6 release ----------------------------------------------------------------------------


async def test_release_returns_the_exact_bytes_at_the_original_score(store: Store) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, Q)
        now = int(await server_now(store))
        raws = [member(i, now + 600, TOKEN_A) for i in ODD_IDS]
        scores = [now + 600.5, now + 601.0, 17.25]
        await zadd(store, Q, list(zip(scores, raws, strict=True)))
        _, _, tokens = await claim_all(ops, raws)
        await store.command("HSET", K.deliveries, ODD_IDS[0], 3)

        codes = await ops.release([(i, t, None) for i, t in zip(ODD_IDS, tokens, strict=True)])
        assert codes == [1, 1, 1]
        assert await snapshot(store) == {
            Q: [(raws[2], 17.25), (raws[0], now + 600.5), (raws[1], now + 601)],
            K.deliveries: {ODD_IDS[0].encode(): b"3"},  # release is not a redelivery
        }
        # Idempotent: a second sweep finds them gone.
        assert await ops.release([(i, t, None) for i, t in zip(ODD_IDS, tokens, strict=True)]) == [
            0,
            0,
            0,
        ]
        assert (await snapshot(store))[Q] == [
            (raws[2], 17.25),
            (raws[0], now + 600.5),
            (raws[1], now + 601),
        ]


async def test_release_is_fenced_by_token_and_expected_expiry(store: Store) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, Q)
        now = int(await server_now(store))
        raw = member("r", now + 600)
        await zadd(store, Q, [(now + 600, raw)])
        _, _, (token,) = await claim_all(ops, [raw])
        before = await snapshot(store)
        expiry = float(await store.command("ZSCORE", K.index, "r"))

        assert await ops.release([("r", TOKEN_B, None)]) == [-1]
        assert await ops.release([("r", TOKEN_B, expiry)]) == [-1]
        assert await ops.release([("r", token, expiry - 1)]) == [-2]  # renewed since read
        assert await ops.release([("gone", token, None)]) == [0]
        assert await snapshot(store) == before

        assert await ops.release([("r", token, expiry)]) == [1]
        assert await snapshot(store) == {Q: [(raw, now + 600)]}
        assert await ops.release([("r", token, expiry)]) == [0]


# -- §3.7 reclaim ----------------------------------------------------------------------------


async def test_reclaim_takes_only_expired_leases(store: Store) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, Q)
        now = await server_now(store)
        d = int(now) + 600
        raws = [member(i, d + n) for n, i in enumerate(["old", "just", "live"])]
        await zadd(store, Q, [(d + n + 0.5, r) for n, r in enumerate(raws)])
        _, _, tokens = await claim_all(ops, raws)
        # Leases by the server clock: one long past, one a second ago, one in the future.
        await store.command(
            "ZADD", K.index, 1, "old", repr(now - 1), "just", repr(now + 30), "live"
        )

        counts = await ops.reclaim(max_deliveries=10)
        assert (counts.redelivered, counts.dead, counts.ghosts) == (2, 0, 0)
        assert await snapshot(store) == {
            Q: [(raws[0], d + 0.5), (raws[1], d + 1.5)],
            K.claimed: claimed_hash(("live", raws[2], f"{d + 2}.5".encode())),
            K.owners: {b"live": tokens[2].encode()},
            K.index: [(b"live", approx(now + 30, abs=1e-6))],
            K.deliveries: {b"old": b"1", b"just": b"1"},
        }


async def test_reclaim_dead_letters_at_max_deliveries(store: Store) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, Q, dedup_ttl=DEDUP)
        now = int(await server_now(store))
        rid = "tenant/a:1"  # cjson escapes "/": the record must still parse to this id
        raw = member(rid, now + 600, TOKEN_A)
        await zadd(store, Q, [(now + 600, raw)])

        for n in (1, 2):  # the first two lapses are redelivered
            await claim_all(ops, [raw])
            await expire(store, rid)
            counts = await ops.reclaim(max_deliveries=3)
            assert (counts.redelivered, counts.dead) == (1, 0)
            assert await snapshot(store) == {
                Q: [(raw, now + 600)],
                K.deliveries: {rid.encode(): str(n).encode()},
            }

        await claim_all(ops, [raw])
        await expire(store, rid)
        t0 = await server_now(store)
        counts = await ops.reclaim(max_deliveries=3)
        t1 = await server_now(store)
        assert (counts.redelivered, counts.dead, counts.ghosts) == (0, 1, 0)
        state = await snapshot(store)
        assert state == {
            K.dead: [(raw, Between(t0, t1))],
            RESULTS: [state[RESULTS][0]],
            **markers(store, (rid, TOKEN_A, DEDUP)),
        }
        assert counts.replayed == (1 if is_cluster(store) else 0)  # through the outbox
        message = "lease expired 3 times without an ack (max_deliveries=3)"
        assert message == max_deliveries_message(3, 3)
        (record,) = parse_records(state[RESULTS])
        assert list(record) == [*ERROR_ORDER, "request_token"]
        assert record == {
            "id": rid,
            "payload": json.dumps({"error": message}, separators=(",", ":")),
            "error_code": "MAX_DELIVERIES_EXCEEDED",
            "error_message": message,
            "request_token": TOKEN_A,
        }
        # The exact bytes the Python serialiser (and llm-d-async's Go) writes.
        assert state[RESULTS] == [
            TerminalRecord.error(rid, ErrorCode.MAX_DELIVERIES_EXCEEDED, message, TOKEN_A).to_json()
        ]


@pytest.mark.parametrize(
    ("queue_list", "member_list", "expected"),
    [
        ("queue-list", "member-list", "queue-list"),
        (None, "member-list", "member-list"),
        (None, None, "global-list"),
        (None, "", "global-list"),
    ],
)
async def test_max_deliveries_record_destination(
    store: Store, queue_list: str | None, member_list: str | None, expected: str
) -> None:
    with trio.fail_after(10):
        ops = QueueOps(
            store, Q, result_list=queue_list, default_result_list="global-list", dedup_ttl=0
        )
        now = int(await server_now(store))
        internal = {} if member_list is None else {"result_queue_name": member_list}
        raw = member("d", now + 600, internal=internal)
        await zadd(store, Q, [(now + 600, raw)])
        await claim_all(ops, [raw])
        await expire(store, "d")
        counts = await ops.reclaim(max_deliveries=1)
        assert counts.dead == 1
        state = await snapshot(store)
        message = "lease expired 1 time without an ack (max_deliveries=1)"
        assert message == max_deliveries_message(1, 1)
        assert parse_records(state.pop(expected)) == [
            error_record("d", ErrorCode.MAX_DELIVERIES_EXCEEDED, message)
        ]
        assert state == {
            K.dead: state[K.dead],
            **markers(store, ("d", "1", 0), result_list=expected),
        }


async def test_max_deliveries_record_is_pushed_once_per_generation(store: Store) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, Q, dedup_ttl=DEDUP)
        now = int(await server_now(store))
        raw = member("d", now + 600, TOKEN_A)
        await set_marker(store, "d", TOKEN_A, DEDUP)
        await zadd(store, Q, [(now + 600, raw)])
        await claim_all(ops, [raw])
        await expire(store, "d")
        assert (await ops.reclaim(max_deliveries=1)).dead == 1
        state = await snapshot(store)
        # It already had its record: none is pushed.
        assert state == {K.dead: state[K.dead], **markers(store, ("d", TOKEN_A, DEDUP))}


async def test_max_deliveries_0_is_unlimited(store: Store) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, Q)
        now = int(await server_now(store))
        raw = member("u", now + 600)
        await zadd(store, Q, [(now + 600, raw)])
        await claim_all(ops, [raw])
        await store.command("HSET", K.deliveries, "u", 1000)
        await expire(store, "u")
        counts = await ops.reclaim(max_deliveries=0)
        assert (counts.redelivered, counts.dead) == (1, 0)
        assert await snapshot(store) == {Q: [(raw, now + 600)], K.deliveries: {b"u": b"1001"}}


async def test_a_marker_key_of_another_type_is_no_marker(store: Store) -> None:
    """``result-terminal:<id>`` holding a hash (claimkit only SETs strings there): the ack
    pushes and replaces it, and a reclaim pass that dead-letters such a request goes on to
    redeliver the rest, instead of failing every pass of the queue from then on.
    (Standalone's marker keys; the cluster's marker hash of another type is
    tests/test_cluster_protocol.py's.)"""
    if is_cluster(store):
        pytest.skip("standalone's per-request marker keys")
    with trio.fail_after(10):
        ops = QueueOps(store, Q, dedup_ttl=DEDUP)
        now = int(await server_now(store))
        acked, poison, other = (member(r, now + 600, TOKEN_A) for r in ("k1", "k2", "k3"))
        await zadd(store, Q, [(now + 600, acked), (now + 601, poison), (now + 602, other)])
        for rid in ("k1", "k2"):
            await store.command("HSET", f"result-terminal:{rid}", "f", "v")
        _, _, (t1, _, _) = await claim_all(ops, [acked, poison, other])

        record = ok_record("k1")
        assert await ops.ack([ack_item("k1", t1, acked, record, TOKEN_A)]) == [(True, True)]

        await store.command("HSET", K.deliveries, "k2", 2)  # its third lapse is its last
        await expire(store, "k2", "k3")
        counts = await ops.reclaim(max_deliveries=3)
        assert (counts.redelivered, counts.dead) == (1, 1)
        state = await snapshot(store)
        dead_record = state[RESULTS][0]
        assert state == {
            Q: [(other, now + 602)],
            K.deliveries: {b"k3": b"1"},
            K.dead: [(poison, state[K.dead][0][1])],
            RESULTS: [dead_record, record],
            "result-terminal:k1": (TOKEN_A.encode(), DEDUP),
            "result-terminal:k2": (TOKEN_A.encode(), DEDUP),
        }
        assert json.loads(dead_record)["error_code"] == "MAX_DELIVERIES_EXCEEDED"


@pytest.mark.parametrize("wrong", ["pending", "deliveries", "dead"])
async def test_reclaim_with_a_key_of_another_type_drops_no_claim(store: Store, wrong: str) -> None:
    """An expired claim whose way back (pending, the deliveries count, the dead set) is a
    key of another type: the reclaim script fails before its first write, so the claim
    stays whole for a later run, instead of being dropped with the request put nowhere."""
    with trio.fail_after(10):
        ops = QueueOps(store, Q, dedup_ttl=DEDUP)
        now = int(await server_now(store))
        raw = member("l1", now + 600, TOKEN_A)
        await zadd(store, Q, [(now + 600, raw)])
        await claim_all(ops, [raw])
        await expire(store, "l1")
        await store.command("HSET", K.deliveries, "l1", 9)  # its last lapse: dead-lettered
        key = {"pending": Q, "deliveries": K.deliveries, "dead": K.dead}[wrong]
        await store.command("DEL", key)
        await store.command("SET", key, "oops")
        before = await snapshot(store)
        with pytest.raises(StoreError, match="wrong kind of value"):
            await ops.reclaim(max_deliveries=10 if wrong == "dead" else 0)
        assert await snapshot(store) == before


async def test_reclaim_removes_ghost_index_entries(store: Store) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, Q)
        now = int(await server_now(store))
        raw = member("real", now + 600)
        await zadd(store, Q, [(now + 600, raw)])
        await claim_all(ops, [raw])
        # Ghosts: index entries whose payload is gone (one still has an owner entry).
        await store.command("ZADD", K.index, 1, "ghost-1", 2, "ghost-2", 3, "real")
        await store.command("HSET", K.owners, "ghost-2", TOKEN_B)
        # A live-leased ghost is left for a later run.
        await store.command("ZADD", K.index, now + 3600, "ghost-later")

        counts = await ops.reclaim(max_deliveries=10)
        assert (counts.redelivered, counts.dead, counts.ghosts) == (1, 0, 2)
        assert await snapshot(store) == {
            Q: [(raw, now + 600)],
            K.index: [(b"ghost-later", now + 3600)],
            K.deliveries: {b"real": b"1"},
        }


async def test_reclaim_drains_a_backlog_beyond_one_chunk_in_one_run(store: Store) -> None:
    with trio.fail_after(30):
        ops_store = CountingStore(store)
        ops = QueueOps(ops_store, Q)
        now = int(await server_now(store))
        n = 1234
        raws = [member(f"b{i}", now + 600 + i) for i in range(n)]
        pending = [(now + 600 + i + 0.5, r) for i, r in enumerate(raws)]
        await zadd(store, Q, pending)
        _, codes, _ = await claim_all(ops, raws)
        assert codes == [1] * n
        args: list[Arg] = []
        for i in range(n):
            args += [1, f"b{i}"]
        await store.command("ZADD", K.index, *args)
        ops_store.runs.clear()

        counts = await ops.reclaim(max_deliveries=10)
        assert (counts.redelivered, counts.dead, counts.ghosts) == (n, 0, 0)
        reclaim = "reclaim-cluster" if is_cluster(store) else "reclaim"
        assert ops_store.runs == [reclaim] * 3  # 500 + 500 + 234
        assert await snapshot(store) == {
            Q: [(r, s) for s, r in pending],
            K.deliveries: {f"b{i}".encode(): b"1" for i in range(n)},
        }


# -- §3.1 dead letters -----------------------------------------------------------------------


def bad(body: str) -> bytes:
    return body.encode()


async def test_dead_letter_moves_malformed_members_byte_exact(store: Store) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, Q, dedup_ttl=DEDUP)

        def js(doc: Any) -> bytes:
            return json.dumps(doc).encode()  # spaced separators: bytes no claimkit code writes

        kind, dl = {"request_kind": "plain"}, {"deadline": 1900000000}
        cases: list[tuple[bytes, str | None, str | None]] = [
            # (member, id of its INVALID_REQUEST record or None, field the message names)
            (b"not json {", None, None),
            (js({"data": {"id": "no-kind", **dl}}), "no-kind", "`request_kind`"),
            (js(kind), None, None),
            (js({**kind, "data": dl}), None, None),
            (js({**kind, "data": {"id": "", **dl}}), None, None),
            (js({**kind, "data": {"id": "s", "deadline": "1900000000"}}), "s", None),
            (js({**kind, "data": {"id": "zero", "deadline": 0}}), "zero", None),
            (js({**kind, "data": {"id": "neg", "deadline": -5}}), "neg", None),
            (js({**kind, "data": {"id": "flt", "deadline": 1900000000.5}}), "flt", None),
            (js({**kind, "data": {"id": "none"}}), "none", None),
        ]
        await zadd(store, Q, [(float(n), raw) for n, (raw, _, _) in enumerate(cases)])
        invalid = [p for raw, _, _ in cases if isinstance(p := parse_member(raw), Invalid)]
        assert len(invalid) == len(cases)
        t0 = await server_now(store)

        moved, pushed = await ops.dead_letter(invalid)
        t1 = await server_now(store)
        with_id = [(rid, hint) for _, rid, hint in cases if rid is not None]
        assert (moved, pushed) == (len(cases), len(with_id))

        state = await snapshot(store)
        records = parse_records(state.pop(RESULTS))
        expected: dict[str, Any] = {
            K.dead: [(raw, Between(t0, t1)) for raw in sorted(raw for raw, _, _ in cases)]
        }
        expected |= markers(store, *sorted((rid, "1", DEDUP) for rid, _ in with_id))
        assert state == expected
        assert [r["id"] for r in records] == [rid for rid, _ in with_id]
        for record, (rid, hint) in zip(records, with_id, strict=True):
            assert list(record) == ERROR_ORDER
            if hint is None:  # every deadline problem has the one SPEC message
                assert record == error_record(
                    rid, ErrorCode.INVALID_REQUEST, DEADLINE_INVALID_MESSAGE
                )
                assert record["error_message"] == (
                    "Failed: deadline is missing or invalid (Unix seconds)."
                )
            else:  # another precise reason, naming the field
                assert record["error_code"] == ErrorCode.INVALID_REQUEST
                assert record["error_message"].startswith("Failed: ")
                assert hint in record["error_message"]
                assert record == error_record(
                    rid, ErrorCode.INVALID_REQUEST, record["error_message"]
                )


async def test_dead_letter_keeps_the_generation_and_result_list(store: Store) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, Q, dedup_ttl=DEDUP)
        raw = json.dumps(
            {
                "internal": {"request_token": TOKEN_A, "result_queue_name": "mine"},
                "request_kind": "plain",
                "data": {"id": "g", "deadline": 0},
            }
        ).encode()
        await zadd(store, Q, [(1.0, raw)])
        invalid = parse_member(raw)
        assert isinstance(invalid, Invalid)
        assert await ops.dead_letter([invalid]) == (1, 1)
        state = await snapshot(store)
        # The record carries the generation salvaged from the bytes, last, as Go writes it.
        assert state.pop("mine") == [
            TerminalRecord.error(
                "g", ErrorCode.INVALID_REQUEST, DEADLINE_INVALID_MESSAGE, TOKEN_A
            ).to_json()
        ]
        assert state == {
            K.dead: [(raw, Between(0, float("inf")))],
            **markers(store, ("g", TOKEN_A, DEDUP), result_list="mine"),
        }


async def test_dead_letter_pushes_one_record_per_generation(store: Store) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, Q, dedup_ttl=DEDUP)
        first = bad('{"request_kind": "plain", "data": {"id": "same", "deadline": 0}}')
        second = bad('{"request_kind": "plain", "data": {"id": "same", "deadline": -1}}')
        await zadd(store, Q, [(1.0, first), (2.0, second)])
        invalid = [p for raw in (first, second) if isinstance(p := parse_member(raw), Invalid)]
        assert await ops.dead_letter(invalid) == (2, 1)
        state = await snapshot(store)
        assert len(state[RESULTS]) == 1
        assert [m for m, _ in state[K.dead]] == sorted([first, second])


async def test_dead_letter_of_a_member_another_consumer_moved(store: Store) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, Q, dedup_ttl=DEDUP)
        raw = bad('{"request_kind": "plain", "data": {"id": "m", "deadline": 0}}')
        invalid = parse_member(raw)
        assert isinstance(invalid, Invalid)
        await zadd(store, Q, [(1.0, raw)])
        assert await ops.dead_letter([invalid]) == (1, 1)
        before = await snapshot(store)
        assert await ops.dead_letter([invalid]) == (0, 0)
        assert await snapshot(store) == before
        # And from a clean slate: nothing at all is written.
        await store.command("FLUSHDB")
        assert await ops.dead_letter([invalid]) == (0, 0)
        assert await snapshot(store) == {}
