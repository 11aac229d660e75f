"""The fake protocol (tests/fake_ops.py) checked against the real scripts on a real Redis.

A hypothesis state machine makes every call twice, through :class:`QueueOps` (the Lua
scripts, exactly as the consumer calls them) and through :class:`FakeQueueOps` (the fake the
consumer's timing tests run on), with random interleavings of peek, dead-letter, claim
(fresh and stale candidates), renew (right and wrong tokens), ack, park, the retry mover,
release (with and without the expiry read), reclaim, cancel and jumps of the server clock.
The two replies must agree, and after every step the whole protocol state in Redis must be
the fake's (docs/protocol.md#claim-protocol): a divergence of the fake fails here.

The clock is never slept on. A lease "lapses" by writing a past score into the lease index
(what the passing of time would do), a parked retry becomes due by writing a past score
into the retry set, and a dedup marker "expires" by being deleted; each is done to the fake
alike. The fake's clock follows the Redis server clock. Deadlines are either far in the
future or long past, so the lease a script computes is known to be live or lapsed.

Hypothesis runs deterministically (``derandomize``), a modest number of examples, with no
example database, so CI runs the same cases every time.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import trio
from fake_ops import FakeServer
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from support import pairs, server_now

from claimkit.protocol.keys import QueueKeys
from claimkit.protocol.models import (
    Envelope,
    Invalid,
    TerminalRecord,
    parse_member,
    retry_member,
)
from claimkit.protocol.ops import AckItem, QueueOps

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from claimkit.store import Store

T = TypeVar("T")

Q = "{m}:q"
K = QueueKeys.for_queue(Q)
RESULTS = "result-list"
RETRY = "retry-sortedset"
LEASE = 60.0
# "a" and "a:score" share the claimed hash ("a:score" is also a's score field), so they
# collide; the others are odd ids from SPEC §1's point of view (":", "{", unicode).
IDS = ["a", "a:score", "{t}:b", "ü é"]
GENS = ["", "7" * 32, "e" * 32]
PAST = 1000  # a deadline long gone: lease = now + min(ttl, 30), at claim and renew alike
# Malformed members: no id (dead-lettered without a record), and an id with a bad deadline
# (an INVALID_REQUEST record under the dedup marker of "a", which valid members share).
INVALID = [
    b"not json",
    json.dumps({"request_kind": "plain", "data": {"id": "a", "deadline": "soon"}}).encode(),
]

SETTINGS = settings(
    max_examples=40,
    stateful_step_count=30,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def make_member(rid: str, gen: str, deadline: int) -> bytes:
    internal = {"request_token": gen} if gen else {}
    return json.dumps(
        {
            "internal": internal,
            "request_kind": "plain",
            "data": {"id": rid, "deadline": deadline, "payload": {"p": "é"}},
            "x-unknown": [1, 2.50],
        },
        ensure_ascii=False,
    ).encode()


def envelope(raw: bytes) -> Envelope:
    parsed = parse_member(raw)
    assert isinstance(parsed, Envelope), parsed
    return parsed


@dataclass(frozen=True)
class Ticket:
    """A claim some caller was given: it may since have been stolen, acked or reclaimed."""

    id: str
    token: str
    member: bytes


class ProtocolMachine(RuleBasedStateMachine):
    """Random interleavings of the scripts, each call made on Redis and on the fake alike;
    the replies must agree, and after each step the whole state too."""

    store: Store
    clock: Callable[[], float]  # the fake server clock: Redis's, as this machine reads it

    def __init__(self) -> None:
        super().__init__()
        self.fake = FakeServer(clock=type(self).clock)
        self.fq = self.fake.queue(Q)
        kwargs: dict[str, Any] = {
            "default_result_list": RESULTS,
            "dedup_ttl": 0,
            "retry_set": RETRY,
        }
        self.ops = QueueOps(self.store, Q, **kwargs)
        self.fops = self.fake.ops(Q, **kwargs)
        self.tickets: list[Ticket] = []
        self.members: list[bytes] = []
        self.serial = 0
        self.far = int(self.fake.now()) + 100_000  # a deadline far ahead

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        return trio.from_thread.run(fn, *args)

    def both(self, name: str, *args: Any) -> tuple[Any, Any]:
        """``QueueOps.<name>(*args)`` on Redis, then ``FakeQueueOps.<name>(*args)``."""
        return self.call(getattr(self.ops, name), *args), self.call(getattr(self.fops, name), *args)

    def redis(self, *args: Any) -> Any:
        return self.call(self.store.command, *args)

    @initialize(
        seed=st.lists(
            st.tuples(st.sampled_from(GENS), st.booleans(), st.booleans()), min_size=4, max_size=4
        )
    )
    def start(self, seed: list[tuple[str, bool, bool]]) -> None:
        """An empty keyspace, then one member per id (some cancelled), all claimed at once:
        every example starts with claims to renew, ack, park, release and let lapse."""
        self.redis("FLUSHDB")
        for rid, (gen, far, cancelled) in zip(IDS, seed, strict=True):
            self.add(rid, gen, far)
            if cancelled:
                self.cancel(rid, gen)
        self.claim_pending()

    def claim_pending(self) -> None:
        """Claim every valid pending member, earliest deadline first, as a poller would."""
        pending = [raw for raw in self.fq.ordered() if raw in self.members]
        if pending:
            self.claim_members(pending)

    def draw_ticket(self, data: st.DataObject) -> Ticket:
        """A ticket whose claim is still live, or any (stale ones test the fencing)."""
        live = self.live_tickets()
        prefer_live: bool = data.draw(st.booleans())
        if live and prefer_live:
            return data.draw(st.sampled_from(live))
        return data.draw(st.sampled_from(self.tickets))

    def live_tickets(self) -> list[Ticket]:
        """The tickets whose claim is still the holder's."""
        claims = self.fq.claims
        return [t for t in self.tickets if t.id in claims and claims[t.id].token == t.token]

    # -- producers and the clock ---------------------------------------------------------------

    @rule(
        rid=st.sampled_from(IDS),
        gen=st.sampled_from(GENS),
        far=st.booleans(),
    )
    def add(self, rid: str, gen: str, far: bool) -> None:
        deadline = self.far if far else PAST
        raw = make_member(rid, gen, deadline)
        self.redis("ZADD", Q, deadline, raw)
        self.fq.pending[raw] = float(deadline)
        if raw not in self.members:
            self.members.append(raw)

    @rule(raw=st.sampled_from(INVALID))
    def add_invalid(self, raw: bytes) -> None:
        self.redis("ZADD", Q, 5, raw)
        self.fq.pending[raw] = 5.0

    @rule(rid=st.sampled_from(IDS), gen=st.sampled_from(GENS))
    def cancel(self, rid: str, gen: str) -> None:
        self.redis("SET", f"request-cancel:{rid}", gen or "1")
        self.fake.cancels[rid] = gen or "1"

    @precondition(lambda self: bool(self.fq.claims))
    @rule(data=st.data())
    def lease_lapses(self, data: st.DataObject) -> None:
        self.lease_lapses_of(data.draw(st.sampled_from(sorted(self.fq.claims))))

    def lease_lapses_of(self, rid: str) -> None:
        self.redis("ZADD", K.index, "XX", 1, rid)
        self.fq.claims[rid].expiry = 1.0

    @precondition(lambda self: bool(self.not_due()))
    @rule(data=st.data())
    def retry_falls_due(self, data: st.DataObject) -> None:
        member = data.draw(st.sampled_from(self.not_due()))
        self.redis("ZADD", RETRY, "XX", 1, member)
        self.fake.retry[RETRY][member] = 1.0

    def not_due(self) -> list[bytes]:
        now = self.fake.now()
        return [m for m, due in self.fake.retry.get(RETRY, {}).items() if due > now]

    @precondition(lambda self: bool(self.fake.markers))
    @rule(data=st.data())
    def marker_expires(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.fake.markers)))
        self.redis("DEL", f"result-terminal:{rid}")
        del self.fake.markers[rid]

    # -- the scripts -------------------------------------------------------------------------

    @rule(count=st.sampled_from([1, 3, 100]))
    def peek(self, count: int) -> None:
        real, fake = self.both("peek", count)
        assert real == fake

    @rule(data=st.data())
    def dead_letter(self, data: st.DataObject) -> None:
        # Malformed members as a poller finds them, or stale ones another consumer moved.
        raws = data.draw(st.lists(st.sampled_from(INVALID), min_size=1, max_size=3, unique=True))
        invalid = [parse_member(raw) for raw in raws]
        assert all(isinstance(bad, Invalid) for bad in invalid)
        real, fake = self.both("dead_letter", invalid)
        assert real == fake

    @precondition(lambda self: bool(self.members))
    @rule(data=st.data())
    def claim(self, data: st.DataObject) -> None:
        # Candidates as a poller would pass them (pending, earliest deadline first), or
        # stale ones (a member it peeked that another consumer took since), in any mix.
        candidates = data.draw(
            st.lists(st.sampled_from(self.members), min_size=1, max_size=4, unique=True)
        )
        self.claim_members(candidates)

    def claim_members(self, candidates: list[bytes]) -> None:
        pairs = []
        for raw in candidates:
            self.serial += 1
            pairs.append((envelope(raw), f"{self.serial:032x}"))
        (_now, codes), (_fake_now, expected) = self.both("claim", pairs, LEASE)
        assert codes == expected
        for (env, token), code in zip(pairs, codes, strict=True):
            if code in (1, 2):
                self.tickets.append(Ticket(env.id, token, env.raw))

    @precondition(lambda self: bool(self.tickets))
    @rule(data=st.data(), wrong=st.booleans())
    def renew(self, data: st.DataObject, wrong: bool) -> None:
        t = self.draw_ticket(data)
        token = "f" * 32 if wrong else t.token
        deadline = envelope(t.member).deadline
        (_now, codes), (_fake_now, expected) = self.both("renew", [(t.id, token, deadline)], LEASE)
        assert codes == expected

    @precondition(lambda self: bool(self.tickets))
    @rule(data=st.data())
    def ack(self, data: st.DataObject) -> None:
        self.ack_ticket(self.draw_ticket(data))

    def ack_ticket(self, t: Ticket) -> None:
        self.serial += 1
        record = TerminalRecord.http(t.id, 200, f"answer {self.serial}")
        gen = envelope(t.member).request_token
        item = AckItem(t.id, t.token, gen, RESULTS, record.to_json(), t.member)
        real, fake = self.both("ack", [item])
        assert real == fake

    @precondition(lambda self: bool(self.swept_tickets()))
    @rule(data=st.data())
    def late_ack(self, data: st.DataObject) -> None:
        """A stalled owner's result after its claim was swept, drained or reclaimed back to
        pending: the ack withdraws that pending copy (docs/protocol.md#ack)."""
        self.ack_ticket(data.draw(st.sampled_from(self.swept_tickets())))

    def swept_tickets(self) -> list[Ticket]:
        live = self.live_tickets()
        return [t for t in self.tickets if t not in live and t.member in self.fq.pending]

    @precondition(lambda self: bool(self.tickets))
    @rule(data=st.data(), due=st.booleans())
    def park(self, data: st.DataObject, due: bool) -> None:
        t = self.draw_ticket(data)
        delay = 0.0 if due else 100_000.0
        items = [(t.id, t.token, delay, retry_member(t.member, Q))]
        (_now, codes), (_fake_now, expected) = self.both("park", items)
        assert codes == expected

    @rule()
    def mover(self) -> None:
        real, fake = self.both("move_retries")
        assert real == fake

    @precondition(lambda self: bool(self.tickets))
    @rule(data=st.data(), expected=st.sampled_from([None, 12345.0, 1.0]))
    def release(self, data: st.DataObject, expected: float | None) -> None:
        # 1.0 is the expiry of a lease lease_lapses wrote: the same on both sides, so a
        # match releases and a mismatch is -2 (renewed since read).
        t = self.draw_ticket(data)
        real, fake = self.both("release", [(t.id, t.token, expected)])
        assert real == fake

    @rule(max_deliveries=st.sampled_from([2, 3]))
    def owner_dies(self, max_deliveries: int) -> None:
        """Every lease lapses, a reclaim redelivers (or dead-letters) them all, and another
        consumer claims what is pending: repeated, requests reach ``max_deliveries``."""
        for rid in sorted(self.fq.claims):
            self.lease_lapses_of(rid)
        self.reclaim(max_deliveries, 500)
        self.claim_pending()

    @rule()
    def serve(self) -> None:
        """A working consumer: claim what is pending, then ack every claim still held."""
        self.claim_pending()
        for t in self.live_tickets():
            self.ack_ticket(t)

    @rule(max_deliveries=st.sampled_from([0, 2, 3]), limit=st.sampled_from([1, 500]))
    def reclaim(self, max_deliveries: int, limit: int) -> None:
        real, fake = self.both("reclaim", max_deliveries, limit)
        assert real == fake

    # -- the whole state, after every step ---------------------------------------------------

    @invariant()
    def redis_matches_the_fake(self) -> None:
        self.call(self._compare)

    async def _compare(self) -> None:
        f, q, s = self.fake, self.fq, self.store
        now, fake_now = await server_now(s), f.now()
        pending = pairs(await s.command("ZRANGE", Q, 0, -1, "WITHSCORES"))
        assert {k: float(v) for k, v in pending} == q.pending
        claimed = dict(pairs(await s.command("HGETALL", K.claimed)))
        assert claimed.keys() == {field.encode() for field in q.claimed_fields()}
        for rid, claim in q.claims.items():
            assert claimed[rid.encode()] == claim.member
            assert float(claimed[(rid + ":score").encode()]) == claim.score
        owners = dict(pairs(await s.command("HGETALL", K.owners)))
        assert owners == {rid.encode(): c.token.encode() for rid, c in q.claims.items()}
        index = {
            k.decode(): float(v)
            for k, v in pairs(await s.command("ZRANGE", K.index, 0, -1, "WITHSCORES"))
        }
        assert {rid: expiry <= now for rid, expiry in index.items()} == {
            rid: c.expiry <= fake_now for rid, c in q.claims.items()
        }
        deliveries = dict(pairs(await s.command("HGETALL", K.deliveries)))
        assert {k.decode(): int(v) for k, v in deliveries.items()} == q.deliveries
        assert set(await s.command("ZRANGE", K.dead, 0, -1)) == set(q.dead)
        retry = pairs(await s.command("ZRANGE", RETRY, 0, -1, "WITHSCORES"))
        assert {k: float(v) <= now for k, v in retry} == {
            m: due <= fake_now for m, due in f.retry.get(RETRY, {}).items()
        }
        results = await s.command("LRANGE", RESULTS, 0, -1)
        assert [json.loads(r) for r in reversed(results)] == [
            json.loads(r) for r in f.results.get(RESULTS, [])
        ]
        assert f.results.keys() <= {RESULTS}
        for rid in IDS:
            marker = await s.command("GET", f"result-terminal:{rid}")
            expected = f.marker(rid)
            assert marker == (expected.encode() if expected is not None else None)
        assert await s.command("EXISTS", "retry-sortedset:dead") == 0
        assert not f.retry_dead


async def test_claim_protocol_matches_the_fake(store: Store) -> None:
    # The fake server clock follows Redis's: its time at the start, plus the time passed.
    offset = await server_now(store) - time.time()

    class Machine(ProtocolMachine):
        pass

    Machine.store = store
    Machine.clock = staticmethod(lambda: time.time() + offset)
    with trio.fail_after(120):
        await trio.to_thread.run_sync(lambda: run_state_machine_as_test(Machine, settings=SETTINGS))
