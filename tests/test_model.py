"""The fake protocol (tests/fake_ops.py) checked against the real scripts on a real Redis.

A hypothesis state machine makes every call twice, through :class:`QueueOps` (the Lua
scripts, exactly as the consumer calls them) and through :class:`FakeQueueOps` (the fake the
consumer's timing tests run on), with random interleavings of peek, dead-letter, claim
(fresh and stale candidates), renew (right and wrong tokens), ack, park, the retry mover,
release (with the expiry read, a stale one, or none), reclaim, cancel, the consumer
registry (register, a consumer's heartbeat with its liveness, its liveness renewed alone,
leaving, a liveness entry lapsing and the fast failover; claims are taken under tokens of
two consumers and bare ones) and jumps of the server clock. The two replies must agree, and
after every step the whole protocol state in Redis must be the fake's
(docs/protocol.md#claim-protocol), every lease expiry and retry due time to the
millisecond: a divergence of the fake fails here.

The clock is never slept on. A lease "lapses" by writing a past score into the lease index,
a parked retry becomes due by writing a past score into the retry set, and a dedup marker
"expires" by being deleted; each is done to the fake alike. The fake's clock is driven by
Redis's: each fake call runs at the ``server_now`` the script replied (claim, renew, park,
register, expire-owners), else at the Redis time read just before. Deadlines are drawn
against that clock (far ahead, long past, just past, within the lease) and ttls under and
over 30 s, so each bound of ``lua/_lease.lua`` binds: the ``deadline + 30`` cap and the
``now + min(ttl, 30)`` floor.

Hypothesis runs deterministically (``derandomize``, no example database): CI runs the same
cases every time. Nothing may lapse on the wall clock within an example (the shortest lease
is 25 s, a consumer's liveness far longer), or which steps are drawn would depend on the
machine's speed. At the end every reply code of claim, renew, release and park, each bound
of the lease rule, and a move by dead-letter, the mover and reclaim must have been seen;
the outcomes that need a lapse (a stalled owner turned away, its late ack keeping the
payload key, a failover that cut a lease) are produced at every example's start as well
(:meth:`ProtocolMachine.stale_ack_keeps_the_payload`), so no run depends on drawing them.
"""

from __future__ import annotations

import functools
import json
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import trio
from fake_ops import FakeServer
from hypothesis import HealthCheck, Phase, settings
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

from claimkit.protocol.keys import QueueKeys, request_payload
from claimkit.protocol.models import (
    Envelope,
    Invalid,
    TerminalRecord,
    parse_member,
    retry_member,
)
from claimkit.protocol.ops import AckItem, ConsumerIdentity, QueueOps
from claimkit.protocol.replies import ClaimCode, ParkCode, ReleaseCode, RenewCode

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from claimkit.store import Store

T = TypeVar("T")

Q = "{m}:q"
K = QueueKeys.for_queue(Q)
RESULTS = "result-list"
RETRY = "retry-sortedset"
# Lease ttls: under 30 s (the floor is now + ttl), and over it (the floor is now + 30).
LEASES = [25.0, 60.0, 120.0]
# "a" and "a:score" share the claimed hash ("a:score" is also a's score field), so they
# collide; the others are odd ids from SPEC §1's point of view (":", "{", unicode).
IDS = ["a", "a:score", "{t}:b", "ü é"]
GENS = ["", "7" * 32, "e" * 32]
PAST = 1000  # a deadline long gone: lease = now + min(ttl, 30), at claim and renew alike
# Deadlines: far ahead (lease = now + ttl), long gone (PAST), or seconds from the server clock
# when the member is added: just past (the floor binds over the cap) and within the lease
# (the cap deadline + 30 binds; a renew with a longer ttl extends a lease up to it).
DEADLINES: list[str | int] = ["far", "past", -10, 5, 20]
# Lease expiries and retry due times agree to this (seconds): the fake computes them from the
# server_now the script replied, printed to the microsecond. A dead-set score is the script's
# clock, the fake's the Redis time read just before the call: DEAD_SLACK.
SLACK, DEAD_SLACK = 0.001, 1.0
# Replies whose first element is the script's server_now: the fake call runs at that time.
STAMPED = {"claim", "renew", "park", "expire_owners"}
# What a run must see at least once, over all its examples (ProtocolMachine.seen): every
# reply code, a move by each mover, and each bound of lua/_lease.lua (lease_kind) setting a
# lease at a claim ("grant") and at a renew ("renewal").
CODES = {"claim": ClaimCode, "renew": RenewCode, "release": ReleaseCode, "park": ParkCode}
MOVES = {"dead_letter": "moved pushed", "move_retries": "moved", "reclaim": "redelivered dead"}
MOVES |= {"grant": "ttl cap floor", "renewal": "ttl cap kept", "poll_peek": "paused open"}
MOVES |= {"ack_payload": "deleted kept"}  # an ack that ended the request, and a late one
# The consumer registry (docs/protocol.md#consumers): a failover that handed claims on, one
# that found nothing to do and one held back for want of a live consumer; consumers that
# registered, renewed and left.
MOVES |= {"expire_owners": "cut none held", "registry": "register renew live forget"}
# Consumers of the registry rules, and who each claim's token names ("": a bare token).
CONSUMERS = ["ca", "cb"]
# Their liveness ttl (seconds): far beyond any example, so an entry lapses only when the
# failover rule writes a past score. A few seconds would let entries lapse on the wall clock
# in a slow run, and the failover then cut their claims: the run would depend on the machine.
LIVENESS_TTL = 100_000.0
OWNERS = ["ca", "cb", ""]
REQUIRED: set[tuple[str, Any]] = {(op, c) for op, cs in CODES.items() for c in cs}
REQUIRED |= {(op, what) for op, whats in MOVES.items() for what in whats.split()}


def lease_kind(now: float, ttl: float, deadline: int, held: float | None = None) -> str:
    """The term of ``lua/_lease.lua`` a grant (``held=None``) or a renew over ``held`` took:
    ``"ttl"``, ``"cap"`` (deadline + 30), ``"floor"`` or ``"kept"`` (not extended)."""
    bound = min(now + ttl, deadline + 30)
    if held is not None and bound <= held:
        return "kept"
    if held is None and now + min(ttl, 30) > bound:
        return "floor"
    return "cap" if deadline + 30 < now + ttl else "ttl"


# Malformed members: no id (dead-lettered without a record), and an id with a bad deadline
# (an INVALID_REQUEST record under the dedup marker of "a", which valid members share).
INVALID = [
    b"not json",
    json.dumps({"request_kind": "plain", "data": {"id": "a", "deadline": "soon"}}).encode(),
]

SETTINGS = settings(
    max_examples=40,
    stateful_step_count=40,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    # No shrinking: on a real Redis it can take minutes. A failure reports its whole run of
    # steps at once; add Phase.shrink here to have hypothesis minimise it locally.
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)


def make_member(rid: str, gen: str, deadline: int) -> bytes:
    internal = {"request_token": gen} if gen else {}
    data = {"id": rid, "deadline": deadline, "payload": {"p": "é"}}
    doc = {"internal": internal, "request_kind": "plain", "data": data, "x-unknown": [1, 2.50]}
    return json.dumps(doc, ensure_ascii=False).encode()


async def zscores(store: Store, key: str) -> dict[bytes, float]:
    return {k: float(v) for k, v in pairs(await store.command("ZRANGE", key, 0, -1, "WITHSCORES"))}


def diverged(real: dict[Any, float], fake: dict[Any, float], slack: float) -> dict[Any, Any]:
    """``key -> (Redis's, the fake's)`` for each key missing on a side or off by ``slack``."""
    far = {k for k in real.keys() & fake.keys() if abs(real[k] - fake[k]) > slack}
    return {k: (real.get(k), fake.get(k)) for k in far | (real.keys() ^ fake.keys())}


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
    seen: Counter[tuple[str, Any]]  # reply codes (and moves) seen, over every example

    def __init__(self) -> None:
        super().__init__()
        self.now = self.server_time()  # the fake server clock: Redis's, as the last call ran
        self.fake = FakeServer(clock=lambda: self.now)
        self.fq = self.fake.queue(Q)
        kwargs: dict[str, Any] = {
            "default_result_list": RESULTS,
            "dedup_ttl": 0,
            "retry_set": RETRY,
        }
        self.ops = QueueOps(self.store, Q, **kwargs)
        self.fops = self.fake.ops(Q, **kwargs)
        self.cops = {
            cid: (
                QueueOps(self.store, Q, consumer=identity, **kwargs),
                self.fake.ops(Q, consumer=identity, **kwargs),
            )
            for cid in CONSUMERS
            for identity in [ConsumerIdentity(cid, LIVENESS_TTL, "host", 7, "0.1.0")]
        }
        self.tickets: list[Ticket] = []
        self.members: list[bytes] = []
        self.serial = 0
        # Deadlines count from the example's first second, not from each add's: two adds of
        # one member a second boundary apart must write the same bytes, or the draws that
        # follow (which members exist, in which order) would depend on the wall clock.
        self.base = int(self.now)
        self.far = self.base + 100_000  # a deadline far ahead

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        return trio.from_thread.run(fn, *args)

    def server_time(self) -> float:
        return self.call(server_now, self.store)

    def both(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """``QueueOps.<name>(*args)`` on Redis, then ``FakeQueueOps.<name>(*args)`` at the
        same server time: the ``server_now`` the script replied, else the Redis time read
        just before the script ran."""
        return self.both_on(self.ops, self.fops, name, *args, **kwargs)

    def both_on(
        self, real_ops: Any, fake_ops: Any, name: str, *args: Any, **kwargs: Any
    ) -> tuple[Any, Any]:
        """:meth:`both` on another pair (a consumer's ops: ``self.cops``)."""
        before = self.server_time()
        real = self.call(functools.partial(getattr(real_ops, name), **kwargs), *args)
        if name == "register":
            self.now = real[0]  # the server time the script read
        elif name == "renew_liveness":
            self.now = real
        else:
            self.now = real[0] if name in STAMPED and real[0] else before
        return real, self.call(functools.partial(getattr(fake_ops, name), **kwargs), *args)

    def saw(self, op: str, codes: list[Any]) -> None:
        self.seen.update((op, code) for code in codes)

    def redis(self, *args: Any) -> Any:
        return self.call(self.store.command, *args)

    @initialize(
        seed=st.lists(
            st.tuples(st.sampled_from(GENS), st.sampled_from(DEADLINES), st.booleans()),
            min_size=4,
            max_size=4,
        ),
        invalid=st.lists(st.booleans(), min_size=len(INVALID), max_size=len(INVALID)),
        ttl=st.sampled_from(LEASES),
    )
    def start(
        self, seed: list[tuple[str, str | int, bool]], invalid: list[bool], ttl: float
    ) -> None:
        """An empty keyspace, then one member per id (some cancelled), all claimed at once,
        and some malformed members pending: every example starts with claims to renew, ack,
        park, release and let lapse, and members to dead-letter."""
        self.redis("FLUSHDB")
        self.stale_ack_keeps_the_payload()
        for rid, (gen, when, cancelled) in zip(IDS, seed, strict=True):
            self.add(rid, gen, when)
            if cancelled:
                self.cancel(rid, gen)
        self.claim_pending(ttl)
        for raw, pending in zip(INVALID, invalid, strict=True):
            if pending:
                self.add_invalid(raw)

    def stale_ack_keeps_the_payload(self) -> None:
        """A request with a payload key, claimed under a registered consumer's token; the
        consumer's liveness entry lapses, the failover cuts the lease, a reclaim redelivers
        the request and another token claims it. The stalled first owner wakes: its
        heartbeat, release and park are turned away, and its ack is a late duplicate that
        keeps the payload key (the request lives on); the new owner's ack ends the request
        and deletes it.

        Every example starts with this, each call made on Redis and on the fake and the
        whole state compared after each step, as the rules do. These outcomes need a lease
        or a liveness entry to lapse; whether the drawn steps reach one depends on the
        state they find, so a run must not count on them for its coverage: here the lapses
        are written, and the outcomes are seen on any machine, however slow."""
        rid, gen, ttl = IDS[2], GENS[2], LEASES[1]
        ref = request_payload(rid, gen)
        cid = OWNERS[(self.serial + 1) % len(OWNERS)]  # whom the next claim's token names
        assert cid in CONSUMERS
        self.consumer_acts(cid, "register", ttl)
        self.add(rid, gen, "far")
        self.claim_pending(ttl)
        stalled = self.tickets[-1]
        assert stalled.token.startswith(cid + "/")
        self.redis_matches_the_fake()
        # The owner's liveness entry lapses: the failover cuts its lease, a reclaim redelivers.
        self.redis("ZADD", K.consumers, "XX", 1, cid)
        self.fq.consumers[cid] = 1.0
        real, fake = self.both("expire_owners")
        assert real == fake
        assert real[1], real
        self.saw("expire_owners", ["cut"])
        self.redis_matches_the_fake()
        self.reclaim(0, 500)
        self.claim_pending(ttl)
        owner = self.tickets[-1]
        assert owner.token != stalled.token
        assert self.stolen_tickets() == [stalled]
        self.redis_matches_the_fake()
        self.stalled_owner_wakes_of(stalled, ttl)
        self.redis_matches_the_fake()
        self.ack_ticket(stalled)
        assert ref in self.fake.payloads
        self.redis_matches_the_fake()
        self.ack_ticket(owner)
        assert ref not in self.fake.payloads
        self.redis_matches_the_fake()

    def claim_pending(self, ttl: float) -> None:
        """Claim every valid pending member, earliest deadline first, as a poller would."""
        pending = [raw for raw in self.fq.ordered() if raw in self.members]
        if pending:
            self.claim_members(pending, ttl)

    def draw_ticket(self, data: st.DataObject) -> Ticket:
        """A ticket whose claim is still live, one whose id another token has claimed since,
        or any (stale ones test the fencing)."""
        kind = data.draw(st.sampled_from(["live", "stolen", "any"]))
        chosen = self.live_tickets() if kind == "live" else self.stolen_tickets()
        if kind == "any" or not chosen:
            chosen = self.tickets
        return data.draw(st.sampled_from(chosen))

    def live_tickets(self) -> list[Ticket]:
        """The tickets whose claim is still the holder's."""
        claims = self.fq.claims
        return [t for t in self.tickets if t.id in claims and claims[t.id].token == t.token]

    def stolen_tickets(self) -> list[Ticket]:
        """The tickets whose id is claimed again, under another token."""
        claims = self.fq.claims
        return [t for t in self.tickets if t.id in claims and claims[t.id].token != t.token]

    # -- producers and the clock ---------------------------------------------------------------

    @rule(rid=st.sampled_from(IDS), gen=st.sampled_from(GENS), when=st.sampled_from(DEADLINES))
    def add(self, rid: str, gen: str, when: str | int) -> None:
        fixed = {"far": self.far, "past": PAST}
        deadline = fixed[when] if isinstance(when, str) else self.base + when
        raw = make_member(rid, gen, deadline)
        self.redis("ZADD", Q, deadline, raw)
        self.fq.pending[raw] = float(deadline)
        if gen:  # its payload key (docs/protocol.md#payload-references): only an ack ends it
            self.redis("SET", request_payload(rid, gen), "payload")
            self.fake.payloads[request_payload(rid, gen)] = b"payload"
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

    @rule(count=st.sampled_from([1, 3, 100]))
    def poll_peek(self, count: int) -> None:
        real, fake = self.both("peek_unless_paused", count)
        assert real == fake
        self.saw("poll_peek", ["paused" if real[0] is not None else "open"])

    @rule(value=st.sampled_from([None, b"1", b'{"since":1.5,"reason":"r"}']))
    def pause_or_resume(self, value: bytes | None) -> None:
        # `claimkit pause` / `resume`, or a key set by hand: any value pauses.
        if value is None:
            self.redis("DEL", K.paused)
        else:
            self.redis("SET", K.paused, value)
        self.fq.paused = value

    @rule(data=st.data())
    def dead_letter(self, data: st.DataObject) -> None:
        # Malformed members as a poller finds them, or stale ones another consumer moved.
        raws = data.draw(st.lists(st.sampled_from(INVALID), min_size=1, max_size=3, unique=True))
        invalid = [parse_member(raw) for raw in raws]
        assert all(isinstance(bad, Invalid) for bad in invalid)
        real, fake = self.both("dead_letter", invalid)
        assert real == fake
        moved, pushed = real
        self.saw("dead_letter", ["moved"] * moved + ["pushed"] * pushed)

    @precondition(lambda self: bool(self.members))
    @rule(data=st.data(), ttl=st.sampled_from(LEASES), poll=st.booleans())
    def claim(self, data: st.DataObject, ttl: float, poll: bool) -> None:
        # Candidates as a poller would pass them (pending, earliest deadline first), or
        # stale ones (a member it peeked that another consumer took since), in any mix.
        if poll:
            self.claim_pending(ttl)
            return
        candidates = data.draw(
            st.lists(st.sampled_from(self.members), min_size=1, max_size=4, unique=True)
        )
        self.claim_members(candidates, ttl)

    def claim_members(self, candidates: list[bytes], ttl: float) -> None:
        pairs = []
        for raw in candidates:
            self.serial += 1
            owner = OWNERS[self.serial % len(OWNERS)]
            token = f"{self.serial:032x}"
            pairs.append((envelope(raw), f"{owner}/{token}" if owner else token))
        real, fake = self.both("claim", pairs, ttl)
        assert real == fake
        now, codes = real
        self.saw("claim", codes)
        for (env, token), code in zip(pairs, codes, strict=True):
            if code in (1, 2):
                self.tickets.append(Ticket(env.id, token, env.raw))
                self.saw("grant", [lease_kind(now, ttl, env.deadline)])

    @precondition(lambda self: bool(self.tickets))
    @rule(data=st.data(), wrong=st.booleans(), ttl=st.sampled_from(LEASES))
    def renew(self, data: st.DataObject, wrong: bool, ttl: float) -> None:
        t = self.draw_ticket(data)
        self.renew_tickets([t], ttl, wrong)

    @precondition(lambda self: bool(self.live_tickets()))
    @rule(ttl=st.sampled_from(LEASES[1:]))
    def heartbeat(self, ttl: float) -> None:
        """An owner's heartbeat: one renew of every claim it holds (with a ttl over 30 s,
        so a lease granted for 25 s grows, to its ttl or to its deadline + 30)."""
        self.renew_tickets(self.live_tickets(), ttl)

    def renew_tickets(self, tickets: list[Ticket], ttl: float, wrong: bool = False) -> None:
        claims = [
            (t.id, "f" * 32 if wrong else t.token, envelope(t.member).deadline) for t in tickets
        ]
        held = {rid: self.fq.claims[rid].expiry for rid, _, _ in claims if rid in self.fq.claims}
        real, fake = self.both("renew", claims, ttl)
        assert real == fake
        now, codes = real
        self.saw("renew", codes)
        for (rid, _token, deadline), code in zip(claims, codes, strict=True):
            if code == RenewCode.RENEWED:
                self.saw("renewal", [lease_kind(now, ttl, deadline, held[rid])])

    @precondition(lambda self: bool(self.tickets))
    @rule(data=st.data())
    def ack(self, data: st.DataObject) -> None:
        self.ack_ticket(self.draw_ticket(data))

    def ack_ticket(self, t: Ticket) -> None:
        self.serial += 1
        record = TerminalRecord.http(t.id, 200, f"answer {self.serial}")
        gen = envelope(t.member).request_token
        ref = request_payload(t.id, gen) if gen else ""
        item = AckItem(t.id, t.token, gen, RESULTS, record.to_json(), t.member, ref)
        had = ref in self.fake.payloads
        real, fake = self.both("ack", [item])
        assert real == fake
        if had:
            self.saw("ack_payload", ["kept" if ref in self.fake.payloads else "deleted"])

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
        real, fake = self.both("park", items)
        assert real == fake
        self.saw("park", real[1])

    @rule()
    def mover(self) -> None:
        real, fake = self.both("move_retries")
        assert real == fake
        self.saw("move_retries", ["moved"] * real[0])

    @precondition(lambda self: bool(self.tickets))
    @rule(data=st.data(), expected=st.sampled_from([None, 12345.0, 1.0]))
    def release(self, data: st.DataObject, expected: float | None) -> None:
        # 1.0 is the expiry of a lease lease_lapses wrote: the same on both sides, so a
        # match releases and a mismatch is -2 (renewed since read).
        t = self.draw_ticket(data)
        real, fake = self.both("release", [(t.id, t.token, expected)])
        assert real == fake
        self.saw("release", real)

    @precondition(lambda self: bool(self.live_tickets()))
    @rule(data=st.data(), stale=st.booleans())
    def release_read(self, data: st.DataObject, stale: bool) -> None:
        """A drain's release of a live claim with the lease expiry it read (released), or
        with an expiry a heartbeat has since moved (left alone, renewed since). Each side is
        passed the expiry it holds: a lease is compared to the millisecond, not the bit."""
        t = data.draw(st.sampled_from(self.live_tickets()))
        shift = -1.0 if stale else 0.0
        read = float(self.redis("ZSCORE", K.index, t.id)) + shift
        real = self.call(self.ops.release, [(t.id, t.token, read)])
        fake_read = self.fq.claims[t.id].expiry + shift
        fake = self.call(self.fops.release, [(t.id, t.token, fake_read)])
        assert real == fake == [ReleaseCode.RENEWED_SINCE if stale else ReleaseCode.RELEASED]
        self.saw("release", real)

    @precondition(lambda self: bool(self.stolen_tickets()))
    @rule(data=st.data(), ttl=st.sampled_from(LEASES))
    def stalled_owner_wakes(self, data: st.DataObject, ttl: float) -> None:
        """An owner stalled past its lease, its request claimed since by another: its
        heartbeat, release and park are all turned away, and the new claim is untouched."""
        self.stalled_owner_wakes_of(data.draw(st.sampled_from(self.stolen_tickets())), ttl)

    def stalled_owner_wakes_of(self, t: Ticket, ttl: float) -> None:
        deadline = envelope(t.member).deadline
        real, fake = self.both("renew", [(t.id, t.token, deadline)], ttl)
        assert real == fake
        assert real[1] == [RenewCode.TAKEN]
        real, fake = self.both("release", [(t.id, t.token, None)])
        assert real == fake == [ReleaseCode.TAKEN]
        real, fake = self.both("park", [(t.id, t.token, 0.0, retry_member(t.member, Q))])
        assert real == fake
        assert real[1] == [ParkCode.NOT_OWNED]
        self.seen.update([("renew", -1), ("release", -1), ("park", 0)])

    @rule(max_deliveries=st.sampled_from([2, 3]), ttl=st.sampled_from(LEASES))
    def owner_dies(self, max_deliveries: int, ttl: float) -> None:
        """Every lease lapses, a reclaim redelivers (or dead-letters) them all, and another
        consumer claims what is pending: repeated, requests reach ``max_deliveries``."""
        for rid in sorted(self.fq.claims):
            self.lease_lapses_of(rid)
        self.reclaim(max_deliveries, 500)
        self.claim_pending(ttl)

    # -- the consumer registry ----------------------------------------------------------------

    @rule(
        cid=st.sampled_from(CONSUMERS),
        action=st.sampled_from(["register", "renew", "forget"]),
        ttl=st.sampled_from(LEASES),
    )
    def consumer_acts(self, cid: str, action: str, ttl: float) -> None:
        """A consumer registers, beats (its live claims, maybe none, and its liveness
        entry, in one call) or leaves at a graceful shutdown."""
        real_ops, fake_ops = self.cops[cid]
        if action == "register":
            real, fake = self.both_on(real_ops, fake_ops, "register")
        elif action == "forget":
            real, fake = self.both_on(real_ops, fake_ops, "forget_self")
        else:
            mine = [t for t in self.live_tickets() if t.token.startswith(cid + "/")]
            claims = [(t.id, t.token, envelope(t.member).deadline) for t in mine]
            held = {t.id: self.fq.claims[t.id].expiry for t in mine}
            real, fake = self.both_on(real_ops, fake_ops, "renew", claims, ttl)
            now, codes = real
            for (rid, _token, deadline), code in zip(claims, codes, strict=True):
                if code == RenewCode.RENEWED:
                    self.saw("renewal", [lease_kind(now, ttl, deadline, held[rid])])
        assert real == fake
        self.saw("registry", [action])

    @rule(cid=st.sampled_from(CONSUMERS))
    def consumer_lives(self, cid: str) -> None:
        """A consumer's heartbeat between two claims renewals: its liveness entry alone."""
        real, fake = self.both_on(*self.cops[cid], "renew_liveness")
        assert real == fake
        self.saw("registry", ["live"])

    @rule(data=st.data(), lapse=st.booleans())
    def failover(self, data: st.DataObject, lapse: bool) -> None:
        """A consumer's liveness entry lapses (or none does), then a reclaimer's fast
        failover runs, as every reclaimer runs it (``require_alive``): the lapsed consumers'
        claims get their lease cut to now, unless no consumer is alive (then nothing, and
        the cycle without that rule, as a test may run it, hands them on)."""
        alive = sorted(c for c, score in self.fq.consumers.items() if score > 0)
        if lapse and alive:
            cid = data.draw(st.sampled_from(alive))
            self.redis("ZADD", K.consumers, "XX", 1, cid)
            self.fq.consumers[cid] = 1.0
        real, fake = self.both("expire_owners", require_alive=True)
        assert real == fake
        if real[1] is None:
            self.saw("expire_owners", ["held"])
            real, fake = self.both("expire_owners")
            assert real == fake
        self.saw("expire_owners", ["cut" if real[1] else "none"])

    @rule(ttl=st.sampled_from(LEASES))
    def serve(self, ttl: float) -> None:
        """A working consumer: move due retries, claim what is pending, then ack every claim
        still held."""
        self.mover()
        self.claim_pending(ttl)
        for t in self.live_tickets():
            self.ack_ticket(t)

    @rule(max_deliveries=st.sampled_from([0, 2, 3]), limit=st.sampled_from([1, 500]))
    def reclaim(self, max_deliveries: int, limit: int) -> None:
        real, fake = self.both("reclaim", max_deliveries, limit)
        assert real == fake
        self.saw("reclaim", ["redelivered"] * real.redelivered + ["dead"] * real.dead)

    # -- the whole state, after every step ---------------------------------------------------

    @invariant()
    def redis_matches_the_fake(self) -> None:
        self.call(self._compare)

    async def _compare(self) -> None:
        f, q, s = self.fake, self.fq, self.store
        assert await zscores(s, Q) == q.pending
        claimed = dict(pairs(await s.command("HGETALL", K.claimed)))
        assert claimed.keys() == {field.encode() for field in q.claimed_fields()}
        for rid, claim in q.claims.items():
            assert claimed[rid.encode()] == claim.member
            assert float(claimed[(rid + ":score").encode()]) == claim.score
        owners = dict(pairs(await s.command("HGETALL", K.owners)))
        assert owners == {rid.encode(): c.token.encode() for rid, c in q.claims.items()}
        index = {k.decode(): v for k, v in (await zscores(s, K.index)).items()}
        expiries = {rid: c.expiry for rid, c in q.claims.items()}
        assert not (bad := diverged(index, expiries, SLACK)), f"lease expiries (Redis, fake): {bad}"
        deliveries = dict(pairs(await s.command("HGETALL", K.deliveries)))
        assert {k.decode(): int(v) for k, v in deliveries.items()} == q.deliveries
        dead = await zscores(s, K.dead)
        assert not (bad := diverged(dead, q.dead, DEAD_SLACK)), f"dead set (Redis, fake): {bad}"
        retry = await zscores(s, RETRY)
        bad = diverged(retry, f.retry.get(RETRY, {}), SLACK)
        assert not bad, f"retry due times (Redis, fake): {bad}"
        results = await s.command("LRANGE", RESULTS, 0, -1)
        assert [json.loads(r) for r in reversed(results)] == [
            json.loads(r) for r in f.results.get(RESULTS, [])
        ]
        assert f.results.keys() <= {RESULTS}
        for rid in IDS:
            marker = await s.command("GET", f"result-terminal:{rid}")
            expected = f.marker(rid)
            assert marker == (expected.encode() if expected is not None else None)
        assert await s.command("GET", K.paused) == q.paused
        consumers = {k.decode(): v for k, v in (await zscores(s, K.consumers)).items()}
        bad = diverged(consumers, q.consumers, SLACK)
        assert not bad, f"liveness expiries (Redis, fake): {bad}"
        info = {
            k.decode(): json.loads(v) for k, v in pairs(await s.command("HGETALL", K.consumer_info))
        }
        assert info.keys() == q.consumer_info.keys()
        for cid, doc in info.items():
            want = q.consumer_info[cid]
            assert abs(doc.pop("started") - want["started"]) <= SLACK
            assert doc == {k: v for k, v in want.items() if k != "started"}
        payloads = {k.decode() for k in await s.command("KEYS", "request-payload:*")}
        assert payloads == set(f.payloads)
        assert await s.command("EXISTS", "retry-sortedset:dead") == 0
        assert not f.retry_dead


async def test_claim_protocol_matches_the_fake(store: Store) -> None:
    class Machine(ProtocolMachine):
        pass

    Machine.store = store
    Machine.seen = Counter()
    # A bound against a hang, not a speed test: a loaded 2-core machine takes minutes.
    with trio.fail_after(900):
        await trio.to_thread.run_sync(lambda: run_state_machine_as_test(Machine, settings=SETTINGS))
    # Every reply code came up, and every mover moved something: the rules still reach them.
    assert REQUIRED - Machine.seen.keys() == set(), dict(Machine.seen)
