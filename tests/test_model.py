"""Model-based test of the claim protocol (SPEC §3) against a real Redis.

A hypothesis state machine drives the Lua scripts, through :class:`QueueOps` exactly as the
consumer calls them, with random interleavings of claim (fresh and stale candidates), renew
(right and wrong tokens), ack, park, the retry mover, release, reclaim, cancel and jumps
of the server clock, and compares every reply and, after every step, the whole protocol
state in Redis with a small pure-Python model of SPEC §3 (:class:`Model`).

The clock is never slept on. A lease "lapses" by writing a past score into the lease index
(what the passing of time would do), a parked retry becomes due by writing a past score
into the retry set, and a dedup marker "expires" by being deleted. Deadlines are either far
in the future or long past, so the lease a script computes is known to be live or lapsed.

Hypothesis runs deterministically (``derandomize``), a modest number of examples, with no
example database, so CI runs the same cases every time.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import trio
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
from support import pairs

from claimkit.protocol.keys import QueueKeys
from claimkit.protocol.models import (
    Envelope,
    TerminalRecord,
    max_deliveries_message,
    parse_member,
    retry_member,
)
from claimkit.protocol.ops import AckItem, QueueOps, move_retries
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


@dataclass
class Claim:
    member: bytes
    score: float
    token: str
    lapsed_at: float | None = None  # the past lease expiry written, once it lapsed

    @property
    def lapsed(self) -> bool:
        return self.lapsed_at is not None


@dataclass(frozen=True)
class Ticket:
    """A claim some caller was given: it may since have been stolen, acked or reclaimed."""

    id: str
    token: str
    member: bytes


@dataclass
class Model:
    """SPEC §3 in plain Python: where every member is, and what each script must answer."""

    pending: dict[bytes, float] = field(default_factory=dict)
    claims: dict[str, Claim] = field(default_factory=dict)
    deliveries: dict[str, int] = field(default_factory=dict)
    dead: set[bytes] = field(default_factory=set)
    retry: dict[bytes, bool] = field(default_factory=dict)  # member -> due
    results: list[dict[str, Any]] = field(default_factory=list)
    markers: dict[str, str] = field(default_factory=dict)
    cancels: dict[str, str] = field(default_factory=dict)

    def claimed_fields(self) -> set[str]:
        return {f for rid in self.claims for f in (rid, rid + ":score")}

    # -- one script each ---------------------------------------------------------------------

    def claim(self, member: bytes, token: str) -> int:
        env = envelope(member)
        if member not in self.pending:
            return 0
        if (
            env.id in self.claims
            or env.id in self.claimed_fields()
            or (env.id + ":score" in self.claimed_fields())
        ):
            return 3
        score = self.pending.pop(member)
        self.claims[env.id] = Claim(member, score, token)
        if env.request_token and self.cancels.get(env.id) == env.request_token:
            return 2
        return 1

    def renew(self, rid: str, token: str, deadline: int) -> int:
        claim = self.claims.get(rid)
        if claim is None:
            return 0
        if claim.token != token:
            return -1
        # The lease rule (lua/_lease.lua): min(now + ttl, deadline + 30), never less than
        # now + min(ttl, 30), so a renew leaves every claim live, a long-past deadline too.
        claim.lapsed_at = None
        return 1

    def push(self, rid: str, gen: str, record: dict[str, Any]) -> bool:
        prev = self.markers.get(rid)
        if prev is not None and (prev == "1" or gen == "" or prev == gen):
            return False
        self.results.append(record)
        self.markers[rid] = gen or "1"
        return True

    def ack(self, t: Ticket, record: dict[str, Any]) -> tuple[bool, bool]:
        """A record goes in only with the removal of the request's one live copy: the
        caller's claim, or its exact member back in pending. Anything else is a late result
        of a request that lives on (another owner, the retry set) or is done: suppressed."""
        gen = envelope(t.member).request_token
        claim = self.claims.get(t.id)
        if claim is not None and claim.token == t.token:
            del self.claims[t.id]
            self.deliveries.pop(t.id, None)
            return self.push(t.id, gen, record), True
        if t.member in self.pending:
            del self.pending[t.member]
            self.deliveries.pop(t.id, None)
            return self.push(t.id, gen, record), False
        return False, False

    def park(self, t: Ticket, due: bool) -> int:
        claim = self.claims.get(t.id)
        if claim is None or claim.token != t.token:
            return 0
        del self.claims[t.id]
        self.retry[retry_member(t.member, Q)] = due
        return 1

    def move_retries(self) -> int:
        moved = 0
        for member, due in list(self.retry.items()):
            if due:
                del self.retry[member]
                self.pending[member] = float(envelope(member).deadline)
                moved += 1
        return moved

    def release(self, t: Ticket, check_expiry: bool) -> int:
        claim = self.claims.get(t.id)
        if claim is None:
            return 0
        if claim.token != t.token:
            return -1
        if check_expiry:
            return -2  # the expiry the caller read is never the one in Redis here
        del self.claims[t.id]
        self.pending[claim.member] = claim.score
        return 1

    def reclaim(self, max_deliveries: int) -> tuple[int, int]:
        redelivered = dead = 0
        lapsed = sorted(
            (c.lapsed_at, rid.encode(), rid) for rid, c in self.claims.items() if c.lapsed
        )  # the lease index order: expiry, then id
        for _at, _key, rid in lapsed:
            claim = self.claims.pop(rid)
            n = self.deliveries.get(rid, 0) + 1
            self.deliveries[rid] = n
            if max_deliveries > 0 and n >= max_deliveries:
                self.dead.add(claim.member)
                del self.deliveries[rid]
                message = max_deliveries_message(n, max_deliveries)
                gen = envelope(claim.member).request_token
                self.push(rid, gen, {
                    "id": rid,
                    "payload": json.dumps({"error": message}, separators=(",", ":")),
                    "error_code": "MAX_DELIVERIES_EXCEEDED",
                    "error_message": message,
                })  # fmt: skip
                dead += 1
            else:
                self.pending[claim.member] = claim.score
                redelivered += 1
        return redelivered, dead


class ProtocolMachine(RuleBasedStateMachine):
    """Random interleavings of the scripts, checked against :class:`Model` after each step."""

    store: Store
    now: int

    def __init__(self) -> None:
        super().__init__()
        self.model = Model()
        self.ops = QueueOps(self.store, Q, default_result_list=RESULTS, dedup_ttl=0)
        self.tickets: list[Ticket] = []
        self.members: list[bytes] = []
        self.serial = 0

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        return trio.from_thread.run(fn, *args)

    def redis(self, *args: Any) -> Any:
        return self.call(self.store.command, *args)

    @initialize()
    def clean(self) -> None:
        self.redis("FLUSHDB")

    # -- producers and the clock ---------------------------------------------------------------

    @rule(
        rid=st.sampled_from(IDS),
        gen=st.sampled_from(GENS),
        far=st.booleans(),
    )
    def add(self, rid: str, gen: str, far: bool) -> None:
        deadline = self.now + 100_000 if far else PAST
        raw = make_member(rid, gen, deadline)
        self.redis("ZADD", Q, deadline, raw)
        self.model.pending[raw] = float(deadline)
        if raw not in self.members:
            self.members.append(raw)

    @rule(rid=st.sampled_from(IDS), gen=st.sampled_from(GENS))
    def cancel(self, rid: str, gen: str) -> None:
        self.redis("SET", f"request-cancel:{rid}", gen or "1")
        self.model.cancels[rid] = gen or "1"

    @precondition(lambda self: bool(self.model.claims))
    @rule(data=st.data())
    def lease_lapses(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.model.claims)))
        self.redis("ZADD", K.index, "XX", 1, rid)
        self.model.claims[rid].lapsed_at = 1.0

    @precondition(lambda self: any(not due for due in self.model.retry.values()))
    @rule(data=st.data())
    def retry_falls_due(self, data: st.DataObject) -> None:
        member = data.draw(st.sampled_from([m for m, due in self.model.retry.items() if not due]))
        self.redis("ZADD", RETRY, "XX", 1, member)
        self.model.retry[member] = True

    @precondition(lambda self: bool(self.model.markers))
    @rule(data=st.data())
    def marker_expires(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.model.markers)))
        self.redis("DEL", f"result-terminal:{rid}")
        del self.model.markers[rid]

    # -- the scripts -------------------------------------------------------------------------

    @precondition(lambda self: bool(self.members))
    @rule(data=st.data())
    def claim(self, data: st.DataObject) -> None:
        # Candidates as a poller would pass them (pending, earliest deadline first), or
        # stale ones (a member it peeked that another consumer took since), in any mix.
        candidates = data.draw(
            st.lists(st.sampled_from(self.members), min_size=1, max_size=4, unique=True)
        )
        pairs = []
        for raw in candidates:
            self.serial += 1
            pairs.append((envelope(raw), f"{self.serial:032x}"))
        _now, codes = self.call(self.ops.claim, pairs, LEASE)
        expected = [self.model.claim(env.raw, token) for env, token in pairs]
        assert codes == expected
        for (env, token), code in zip(pairs, codes, strict=True):
            if code in (1, 2):
                self.tickets.append(Ticket(env.id, token, env.raw))

    @precondition(lambda self: bool(self.tickets))
    @rule(data=st.data(), wrong=st.booleans())
    def renew(self, data: st.DataObject, wrong: bool) -> None:
        t = data.draw(st.sampled_from(self.tickets))
        token = "f" * 32 if wrong else t.token
        deadline = envelope(t.member).deadline
        _now, codes = self.call(self.ops.renew, [(t.id, token, deadline)], LEASE)
        assert codes == [self.model.renew(t.id, token, deadline)]

    @precondition(lambda self: bool(self.tickets))
    @rule(data=st.data())
    def ack(self, data: st.DataObject) -> None:
        t = data.draw(st.sampled_from(self.tickets))
        self.serial += 1
        record = TerminalRecord.http(t.id, 200, f"answer {self.serial}")
        gen = envelope(t.member).request_token
        item = AckItem(t.id, t.token, gen, RESULTS, record.to_json(), t.member)
        (reply,) = self.call(self.ops.ack, [item])
        assert reply == self.model.ack(t, json.loads(record.to_json()))

    @precondition(lambda self: bool(self.tickets))
    @rule(data=st.data(), due=st.booleans())
    def park(self, data: st.DataObject, due: bool) -> None:
        t = data.draw(st.sampled_from(self.tickets))
        delay = 0.0 if due else 100_000.0
        _now, codes = self.call(
            self.ops.park, [(t.id, t.token, delay, retry_member(t.member, Q))], RETRY
        )
        assert codes == [self.model.park(t, due)]

    @rule()
    def mover(self) -> None:
        moved, dead = self.call(move_retries, self.store, RETRY)
        assert (moved, dead) == (self.model.move_retries(), 0)

    @precondition(lambda self: bool(self.tickets))
    @rule(data=st.data(), check_expiry=st.booleans())
    def release(self, data: st.DataObject, check_expiry: bool) -> None:
        t = data.draw(st.sampled_from(self.tickets))
        expected_expiry = 12345.0 if check_expiry else None
        codes = self.call(self.ops.release, [(t.id, t.token, expected_expiry)])
        assert codes == [self.model.release(t, check_expiry)]

    @rule(max_deliveries=st.sampled_from([0, 2, 3]), limit=st.sampled_from([1, 500]))
    def reclaim(self, max_deliveries: int, limit: int) -> None:
        counts = self.call(self.ops.reclaim, max_deliveries, limit)
        assert (counts.redelivered, counts.dead, counts.ghosts) == (
            *self.model.reclaim(max_deliveries),
            0,
        )

    # -- the whole state, after every step ---------------------------------------------------

    @invariant()
    def redis_matches_the_model(self) -> None:
        self.call(self._compare)

    async def _compare(self) -> None:
        m, s = self.model, self.store
        sec, usec = await s.command("TIME")
        now = int(sec) + int(usec) / 1e6
        pending = pairs(await s.command("ZRANGE", Q, 0, -1, "WITHSCORES"))
        assert {k: float(v) for k, v in pending} == m.pending
        claimed = dict(pairs(await s.command("HGETALL", K.claimed)))
        assert claimed.keys() == {f.encode() for f in m.claimed_fields()}
        for rid, claim in m.claims.items():
            assert claimed[rid.encode()] == claim.member
            assert float(claimed[(rid + ":score").encode()]) == claim.score
        owners = dict(pairs(await s.command("HGETALL", K.owners)))
        assert owners == {rid.encode(): c.token.encode() for rid, c in m.claims.items()}
        index = {
            k.decode(): float(v)
            for k, v in pairs(await s.command("ZRANGE", K.index, 0, -1, "WITHSCORES"))
        }
        assert {rid: expiry <= now for rid, expiry in index.items()} == {
            rid: c.lapsed for rid, c in m.claims.items()
        }
        deliveries = dict(pairs(await s.command("HGETALL", K.deliveries)))
        assert {k.decode(): int(v) for k, v in deliveries.items()} == m.deliveries
        assert set(await s.command("ZRANGE", K.dead, 0, -1)) == m.dead
        retry = pairs(await s.command("ZRANGE", RETRY, 0, -1, "WITHSCORES"))
        assert {k: float(v) <= now for k, v in retry} == m.retry
        results = await s.command("LRANGE", RESULTS, 0, -1)
        assert [json.loads(r) for r in reversed(results)] == m.results
        for rid in IDS:
            marker = await s.command("GET", f"result-terminal:{rid}")
            assert marker == (m.markers[rid].encode() if rid in m.markers else None)
        assert await s.command("EXISTS", "retry-sortedset:dead") == 0


async def test_claim_protocol_matches_the_model(store: Store) -> None:
    sec, _usec = await store.command("TIME")

    class Machine(ProtocolMachine):
        pass

    Machine.store = store
    Machine.now = int(sec)
    with trio.fail_after(120):
        await trio.to_thread.run_sync(lambda: run_state_machine_as_test(Machine, settings=SETTINGS))
