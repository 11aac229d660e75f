"""A fake of the claim protocol: :class:`FakeQueueOps` over an in-memory :class:`FakeServer`.

The fake answers every :class:`~claimkit.protocol.ops.QueueOps` call the consumer makes,
with the same arguments and the same replies, applying docs/protocol.md#claim-protocol to
plain Python state instead of running the Lua scripts. Each call is atomic (it yields once,
then applies its whole effect without another checkpoint), as a script is.

- **Timing tests** (tests/test_consumer_timing.py): the server clock is
  ``START + trio.current_time()``, so under ``autojump_clock`` leases lapse in fake time;
  every call is logged with its trio time (:attr:`FakeServer.calls`), and
  :attr:`FakeServer.hooks` make an operation hang or fail (Redis away) before it applies.
- **Its own check** (tests/test_model.py): a hypothesis state machine drives the fake side
  by side with the real scripts on a real Redis, comparing every reply and the whole state
  after every step, so the fake cannot drift from the scripts unnoticed.

The consumer registry (docs/protocol.md#consumers) is modelled too: ``register``, the
liveness part of ``renew``, ``renew_liveness`` (the liveness alone), ``forget_self`` and
``expire_owners`` (a whole cycle at once).

What the fake leaves out: key types (no key of another type exists here), the orphan scan
(every claim here has its lease entry, so ``orphans`` and ``leases_restored`` stay 0) and
ghosts (no index entry without a payload).
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from claimkit.protocol.models import (
    Envelope,
    ErrorCode,
    Invalid,
    TerminalRecord,
    max_deliveries_message,
    parse_member,
)
from claimkit.protocol.ops import CHUNK, ORPHAN_SCAN_COUNT, AckItem, ConsumerIdentity
from claimkit.protocol.pause import PauseMark, parse_pause
from claimkit.protocol.replies import ClaimCode, ParkCode, ReclaimCounts, ReleaseCode, RenewCode
from claimkit.protocol.routing import ResultRouting
from claimkit.protocol.stats import QueueStats

if TYPE_CHECKING:
    from claimkit.config import Config, QueueConfig

START = 1_800_000_000.0
"""What the fake server clock reads at trio time 0 (Unix seconds, January 2027)."""

GRACE = 30.0
"""While a request's deadline is ahead, its lease never runs more than this past it."""


# -- the lease rule (docs/protocol.md#claim, docs/protocol.md#heartbeat) ----------------------


def lease_bound(now: float, lease_ttl: float, deadline: float) -> float:
    """How far a lease may reach at ``now`` (``lua/_lease.lua``): ``min(now + ttl,
    deadline + 30)``. A heartbeat renews to it and never shortens a lease."""
    return min(now + lease_ttl, deadline + GRACE)


def lease_expiry(now: float, lease_ttl: float, deadline: float) -> float:
    """The expiry of a lease granted at ``now`` (a claim taken; ``lua/_lease.lua``):
    :func:`lease_bound`, never earlier than ``now + min(ttl, 30)``."""
    return max(lease_bound(now, lease_ttl, deadline), now + min(lease_ttl, GRACE))


# -- the server ------------------------------------------------------------------------------


@dataclass
class FakeClaim:
    """One claim: ``<q>:claimed`` (member, score), ``<q>:claim-owners`` and ``<q>:claims-idx``."""

    member: bytes
    score: float
    token: str
    expiry: float


@dataclass
class FakeQueue:
    """The keys of one queue ``<q>``."""

    pending: dict[bytes, float] = field(default_factory=dict)
    claims: dict[str, FakeClaim] = field(default_factory=dict)
    deliveries: dict[str, int] = field(default_factory=dict)
    dead: dict[bytes, float] = field(default_factory=dict)
    paused: bytes | None = None  # <q>:paused, absent when None (docs/protocol.md#pause)
    consumers: dict[str, float] = field(default_factory=dict)  # <q>:consumers: id -> score
    consumer_info: dict[str, dict[str, Any]] = field(default_factory=dict)  # <q>:consumer-info

    def claimed_fields(self) -> set[str]:
        """The fields of ``<q>:claimed``: ``<id>`` and ``<id>:score`` per claim."""
        return {f for rid in self.claims for f in (rid, rid + ":score")}

    def ordered(self) -> list[bytes]:
        """Pending members in ZSET order: score, then bytes."""
        return [m for m, _ in sorted(self.pending.items(), key=lambda kv: (kv[1], kv[0]))]


@dataclass(frozen=True)
class Call:
    """One protocol call as the fake received it: ``at`` is ``trio.current_time()``,
    ``ids`` the request ids (or members) it was about, in order."""

    at: float
    op: str
    queue: str
    ids: tuple[str, ...] = ()


Hook = Callable[[Call], Awaitable[None]]


class FakeServer:
    """The keyspace the fake protocol runs on, shared by every queue's :class:`FakeQueueOps`.

    Args:
        clock: the server clock, Unix seconds; ``START + trio.current_time()`` by default.

    Attributes:
        queues: per queue name, its keys (:meth:`queue` creates them).
        retry: per retry set name, ``member -> due`` (Unix seconds).
        retry_dead: per retry set name, the members the mover could not route.
        results: per result list name, the records pushed, oldest first.
        markers: ``id -> (value, expires_at or None)``: ``result-terminal:<id>``.
        cancels: ``id -> token``: ``request-cancel:<id>``.
        payloads: ``key -> bytes``: the payload keys (``request-payload:<id>:<token>``)
            members name in ``internal.payload_ref``.
        key_types: ``key -> TYPE`` of keys a test made hold another type than the layout
            says (none by default); :meth:`FakeQueueOps.first_wrong_type` reads it.
        calls: every call made, in order (:class:`Call`).
        hooks: ``op -> async fn(call)``, awaited before that operation applies: sleep in it
            to make Redis slow, raise ``StoreUnavailable`` in it to make Redis away.
    """

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self.clock = clock or (lambda: START + trio.current_time())
        self.queues: dict[str, FakeQueue] = {}
        self.retry: dict[str, dict[bytes, float]] = {}
        self.retry_dead: dict[str, dict[bytes, float]] = {}
        self.results: dict[str, list[bytes]] = {}
        self.markers: dict[str, tuple[str, float | None]] = {}
        self.cancels: dict[str, str] = {}
        self.payloads: dict[str, bytes] = {}
        self.key_types: dict[str, str] = {}
        self.calls: list[Call] = []
        self.hooks: dict[str, Hook] = {}

    def now(self) -> float:
        return self.clock()

    def queue(self, name: str) -> FakeQueue:
        return self.queues.setdefault(name, FakeQueue())

    def ops(self, queue: str, **kwargs: Any) -> FakeQueueOps:
        """A :class:`FakeQueueOps` of ``queue`` on this server (keywords as ``QueueOps``)."""
        return FakeQueueOps(self, queue, **kwargs)

    def factory(self, config: Config) -> Callable[[QueueConfig], FakeQueueOps]:
        """An ``ops_factory`` for ``Consumer``: each queue's fake ops, configured as the
        consumer's default ``QueueOps`` would be."""

        def make(q: QueueConfig) -> FakeQueueOps:
            return self.ops(
                q.queue_name,
                result_list=q.result_queue_name,
                default_result_list=config.result_queue_name,
                dedup_ttl=config.result_dedup_ttl_seconds,
                lease_ttl=config.claim_lease_ttl_seconds,
                retry_set=config.retry_queue_name,
                consumer=config.consumer_identity(),
            )

        return make

    def submit(self, queue: str, rid: str, deadline: int, gen: str = "") -> bytes:
        """Add a request to ``queue``'s pending set at score ``deadline``, as a producer
        would (docs/protocol.md#producer); returns its member bytes."""
        internal = {"request_token": gen} if gen else {}
        data = {"id": rid, "deadline": deadline}
        member = json.dumps({"internal": internal, "request_kind": "plain", "data": data}).encode()
        self.queue(queue).pending[member] = float(deadline)
        return member

    def records(self, result_list: str = "result-list") -> list[dict[str, Any]]:
        """The records pushed onto ``result_list``, oldest first, parsed."""
        return [json.loads(r) for r in self.results.get(result_list, [])]

    def log(self, op: str, queue: str = "") -> list[Call]:
        """The calls of one operation (of one queue, when given), in order."""
        return [c for c in self.calls if c.op == op and (not queue or c.queue == queue)]

    async def enter(self, op: str, queue: str, ids: Sequence[str] = ()) -> None:
        """Log a call, run its hook, and yield once, as a round trip would."""
        call = Call(trio.current_time(), op, queue, tuple(ids))
        self.calls.append(call)
        hook = self.hooks.get(op)
        if hook is not None:
            await hook(call)
        await trio.lowlevel.checkpoint()

    # -- what the scripts share --------------------------------------------------------------

    def marker(self, rid: str) -> str | None:
        """``result-terminal:<id>``, or ``None`` when absent or expired."""
        value = self.markers.get(rid)
        if value is None:
            return None
        text, expires = value
        if expires is not None and expires <= self.now():
            del self.markers[rid]
            return None
        return text

    def push(self, rid: str, gen: str, result_list: str, record: bytes, dedup_ttl: int) -> bool:
        """``lua/_push-terminal.lua``: push ``record`` once per request generation."""
        prev = self.marker(rid)
        if prev is not None and (prev == "1" or gen == "" or prev == gen):
            return False
        self.results.setdefault(result_list, []).append(record)
        expires = self.now() + dedup_ttl if dedup_ttl > 0 else None
        self.markers[rid] = (gen or "1", expires)
        return True

    def move_retries(self, retry_set: str, limit: int = CHUNK) -> tuple[int, int, bool]:
        """``lua/move-retries-2.lua``: one call. Returns ``(moved, dead, more)``."""
        now = self.now()
        members = self.retry.get(retry_set, {})
        due = sorted((score, m) for m, score in members.items() if score <= now)[:limit]
        moved = dead = 0
        for _score, member in due:
            del members[member]
            queue, score = _route(member)
            if queue is not None and score is not None:
                self.queue(queue).pending[member] = score
                moved += 1
            else:
                self.retry_dead.setdefault(retry_set, {})[member] = now
                dead += 1
        return moved, dead, len(due) == limit


def _route(member: bytes) -> tuple[str | None, float | None]:
    """A retry member's ``internal.request_queue_name`` and its queue score: its deadline
    and enqueue order (``queue_score``) when it parses, else its numeric ``data.deadline``."""
    try:
        doc = json.loads(member)
        queue, deadline = doc["internal"].get("request_queue_name"), doc["data"].get("deadline")
    except (ValueError, TypeError, KeyError, AttributeError):
        return None, None
    if not isinstance(queue, str) or not queue:
        queue = None
    if isinstance(deadline, bool) or not isinstance(deadline, int | float):
        deadline = None
    env = parse_member(member)
    if deadline is not None and isinstance(env, Envelope):
        return queue, env.score
    return queue, None if deadline is None else float(deadline)


# -- one queue's operations ------------------------------------------------------------------


class FakeQueueOps:
    """What :class:`~claimkit.protocol.ops.QueueOps` does, on a :class:`FakeServer`: it
    satisfies :class:`~claimkit.protocol.ops.QueueProtocol`, so ``Consumer(ops_factory=...)``
    takes it.

    Same constructor keywords, same methods, same replies; ``server_now`` in a reply is the
    fake server clock.
    """

    def __init__(
        self,
        server: FakeServer,
        queue: str,
        *,
        result_list: str | None = None,
        default_result_list: str = "result-list",
        dedup_ttl: int = 21600,
        lease_ttl: float = 300.0,
        retry_set: str = "retry-sortedset",
        consumer: ConsumerIdentity | None = None,
    ) -> None:
        self.server = server
        self.consumer = consumer
        self.retry_set = retry_set
        self.queue = queue
        self.q = server.queue(queue)
        self.routing = ResultRouting(result_list, default_result_list)
        self.result_list = self.routing.queue_list
        self.dedup_ttl = dedup_ttl
        self.lease_ttl = lease_ttl

    def result_list_for(self, member_result_list: str | None) -> str:
        return self.routing.list_for(member_result_list)

    @property
    def fallback_result_list(self) -> str:
        return self.routing.fallback

    async def _enter(self, op: str, ids: Sequence[str] = ()) -> float:
        await self.server.enter(op, self.queue, ids)
        return self.server.now()

    def _push(self, rid: str, gen: str, result_list: str, record: bytes) -> bool:
        return self.server.push(rid, gen, result_list, record, self.dedup_ttl)

    # -- peek, dead-letter -------------------------------------------------------------------

    async def peek(self, count: int) -> list[bytes]:
        await self._enter("peek")
        return self.q.ordered()[:count]

    async def peek_unless_paused(self, count: int) -> tuple[PauseMark | None, list[bytes]]:
        await self._enter("peek")
        mark = parse_pause(self.q.paused)
        return (mark, []) if mark is not None else (None, self.q.ordered()[:count])

    async def dead_letter(self, invalid: Sequence[Invalid]) -> tuple[int, int]:
        now = await self._enter("dead_letter", [bad.id or "" for bad in invalid])
        moved = pushed = 0
        for bad in invalid:
            if self.q.pending.pop(bad.raw, None) is None:
                continue
            self.q.dead[bad.raw] = now
            moved += 1
            if bad.id is not None:
                record = TerminalRecord.error(
                    bad.id, ErrorCode.INVALID_REQUEST, bad.reason, bad.request_token
                )
                target = self.result_list_for(bad.result_queue_name)
                pushed += self._push(bad.id, bad.request_token, target, record.to_json())
        return moved, pushed

    # -- claim, renew --------------------------------------------------------------------------

    async def claim(
        self, candidates: Sequence[tuple[Envelope, str]], lease_ttl: float
    ) -> tuple[float, list[ClaimCode]]:
        if not candidates:
            return 0.0, []
        now = await self._enter("claim", [env.id for env, _ in candidates])
        return now, [self._claim_one(env, token, now, lease_ttl) for env, token in candidates]

    def _claim_one(self, env: Envelope, token: str, now: float, lease_ttl: float) -> ClaimCode:
        q = self.q
        if env.raw not in q.pending:
            return ClaimCode.NOT_PENDING
        fields = q.claimed_fields()
        if env.id in q.claims or env.id in fields or env.id + ":score" in fields:
            return ClaimCode.BUSY
        score = q.pending.pop(env.raw)
        q.claims[env.id] = FakeClaim(
            env.raw, score, token, lease_expiry(now, lease_ttl, env.deadline)
        )
        if env.request_token and self.server.cancels.get(env.id) == env.request_token:
            return ClaimCode.CANCELLED
        return ClaimCode.CLAIMED

    async def fetch_payloads(self, refs: Sequence[str]) -> list[bytes | None]:
        """``MGET`` of the payload keys (one call, logged with the keys as its ids)."""
        if not refs:
            return []
        await self._enter("fetch_payloads", list(refs))
        return [self.server.payloads.get(ref) for ref in refs]

    async def renew(
        self, claims: Sequence[tuple[str, str, int]], lease_ttl: float
    ) -> tuple[float, list[RenewCode]]:
        if not claims and self.consumer is None:
            return 0.0, []
        now = await self._enter("renew", [rid for rid, _, _ in claims])
        if self.consumer is not None:
            self._mark_alive(self.consumer, now, replace_info=False)
        codes: list[RenewCode] = []
        for rid, token, deadline in claims:
            claim = self.q.claims.get(rid)
            if claim is None:
                codes.append(RenewCode.GONE)
            elif claim.token != token:
                codes.append(RenewCode.TAKEN)
            else:
                claim.expiry = max(claim.expiry, lease_bound(now, lease_ttl, deadline))
                codes.append(RenewCode.RENEWED)
        return now, codes

    async def renew_liveness(self) -> float | None:
        """``lua/renew-4.lua`` with no claims: the liveness entry alone."""
        if self.consumer is None:
            return None
        now = await self._enter("renew_liveness")
        self._mark_alive(self.consumer, now, replace_info=False)
        return now

    # -- the consumer registry (lua/register-2.lua, lua/expire-owners-3.lua, ...) ----------

    def _mark_alive(self, c: ConsumerIdentity, now: float, *, replace_info: bool) -> None:
        self.q.consumers[c.id] = round(now + c.liveness_ttl, 6)
        if replace_info or c.id not in self.q.consumer_info:
            info = {"host": c.host, "pid": c.pid, "started": now, "version": c.version}
            self.q.consumer_info[c.id] = info

    async def register(self) -> tuple[float, dict[str, Any] | None] | None:
        if self.consumer is None:
            return None
        now = await self._enter("register")
        c = self.consumer
        info = self.q.consumer_info.get(c.id)
        other = None
        if self.q.consumers.get(c.id, 0) > now and info is not None:
            if (info.get("host"), info.get("pid")) != (c.host, c.pid):
                other = dict(info)
        self._mark_alive(c, now, replace_info=True)
        return now, other

    async def forget_self(self) -> bool:
        if self.consumer is None:
            return False
        await self._enter("forget_self")
        self.q.consumer_info.pop(self.consumer.id, None)
        return self.q.consumers.pop(self.consumer.id, None) is not None

    async def expire_owners(self, *, require_alive: bool = False) -> tuple[float, int | None]:
        """A whole ``lua/expire-owners-3.lua`` cycle: the leases of lapsed consumers' claims
        cut to now (never lengthened), those consumers marked (score negated); with
        ``require_alive`` and no consumer alive, nothing (``None``)."""
        now = await self._enter("expire_owners")
        lapsed = {cid for cid, score in self.q.consumers.items() if 0 < score < now}
        if require_alive and lapsed and not any(s >= now for s in self.q.consumers.values()):
            return now, None
        if not lapsed:
            return now, 0
        cut = 0
        for claim in self.q.claims.values():
            owner, sep, _ = claim.token.rpartition("/")
            if sep and owner in lapsed and claim.expiry > now:
                claim.expiry = round(now, 6)
                cut += 1
        for cid in lapsed:
            self.q.consumers[cid] = -self.q.consumers[cid]
        return now, cut

    # -- ack, park, release ----------------------------------------------------------------

    async def ack(self, items: Sequence[AckItem]) -> list[tuple[bool, bool]]:
        if not items:
            return []
        await self._enter("ack", [it.id for it in items])
        return [self._ack_one(it) for it in items]

    def _ack_one(self, it: AckItem) -> tuple[bool, bool]:
        q = self.q
        claim = q.claims.get(it.id)
        if claim is not None and claim.token == it.token:
            del q.claims[it.id]
            q.deliveries.pop(it.id, None)
            self.server.payloads.pop(it.payload_ref, None)
            return self._push(it.id, it.request_token, it.result_list, it.record), True
        if q.pending.pop(it.member, None) is not None:
            q.deliveries.pop(it.id, None)
            self.server.payloads.pop(it.payload_ref, None)
            return self._push(it.id, it.request_token, it.result_list, it.record), False
        return False, False

    async def park(
        self, items: Sequence[tuple[str, str, float, bytes]]
    ) -> tuple[float, list[ParkCode]]:
        if not items:
            return 0.0, []
        now = await self._enter("park", [rid for rid, *_ in items])
        codes: list[ParkCode] = []
        retry = self.server.retry.setdefault(self.retry_set, {})
        for rid, token, delay, member in items:
            claim = self.q.claims.get(rid)
            if claim is None or claim.token != token:
                codes.append(ParkCode.NOT_OWNED)
                continue
            del self.q.claims[rid]
            retry[member] = now + delay
            codes.append(ParkCode.PARKED)
        return now, codes

    async def release(self, claims: Sequence[tuple[str, str, float | None]]) -> list[ReleaseCode]:
        if not claims:
            return []
        await self._enter("release", [rid for rid, _, _ in claims])
        codes: list[ReleaseCode] = []
        for rid, token, expected in claims:
            claim = self.q.claims.get(rid)
            if claim is None:
                codes.append(ReleaseCode.GONE)
            elif claim.token != token:
                codes.append(ReleaseCode.TAKEN)
            elif expected is not None and claim.expiry != expected:
                codes.append(ReleaseCode.RENEWED_SINCE)
            else:
                del self.q.claims[rid]
                self.q.pending[claim.member] = claim.score
                codes.append(ReleaseCode.RELEASED)
        return codes

    # -- reclaim -------------------------------------------------------------------------------

    async def reclaim(
        self,
        max_deliveries: int,
        limit: int = CHUNK,
        *,
        full_scan: bool = False,
        scan_count: int = ORPHAN_SCAN_COUNT,
    ) -> ReclaimCounts:
        """A full run, logged as one ``"reclaim"`` call; passes repeat while ``more``."""
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        if scan_count < 1:
            raise ValueError(f"scan_count must be at least 1, got {scan_count}")
        await self._enter("reclaim")
        total = ReclaimCounts()
        more = True
        while more:
            counts, more = self._reclaim_call(limit, max_deliveries)
            total += counts
        return total

    def _reclaim_call(self, limit: int, max_deliveries: int) -> tuple[ReclaimCounts, bool]:
        """``lua/reclaim-6.lua``, one call: up to ``limit`` lapsed claims in lease index
        order (expiry, then id bytes)."""
        q, now = self.q, self.server.now()
        lapsed = sorted(
            (c.expiry, rid.encode(), rid) for rid, c in q.claims.items() if c.expiry <= now
        )[:limit]
        redelivered = dead = 0
        for _expiry, _key, rid in lapsed:
            claim = q.claims.pop(rid)
            n = q.deliveries.get(rid, 0) + 1
            q.deliveries[rid] = n
            if max_deliveries > 0 and n >= max_deliveries:
                del q.deliveries[rid]
                q.dead[claim.member] = now
                self._max_deliveries_record(rid, claim.member, n, max_deliveries)
                dead += 1
            else:
                q.pending[claim.member] = claim.score
                redelivered += 1
        return ReclaimCounts(redelivered, dead), len(lapsed) == limit

    def _max_deliveries_record(self, rid: str, member: bytes, n: int, max_deliveries: int) -> None:
        message = max_deliveries_message(n, max_deliveries)
        parsed = parse_member(member)
        gen = parsed.request_token  # an Invalid one's too: the script reads it from the JSON
        record = TerminalRecord.error(rid, ErrorCode.MAX_DELIVERIES_EXCEEDED, message, gen)
        routed = parsed.result_queue_name if isinstance(parsed, Envelope) else None
        self._push(rid, gen, self.result_list_for(routed), record.to_json())

    # -- the retry mover -----------------------------------------------------------------------

    # -- the consumer's other calls: retry mover, backlog, key types ---------------------------

    async def move_retries(self, *, limit: int = CHUNK) -> tuple[int, int]:
        """The retry mover on :attr:`retry_set`: calls repeat until no member is due.
        Returns ``(moved, dead)``."""
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        await self._enter("move_retries")
        moved = dead = 0
        more = True
        while more:
            m, d, more = self.server.move_retries(self.retry_set, limit)
            moved, dead = moved + m, dead + d
        return moved, dead

    async def next_retry_due(self) -> float | None:
        """``ZRANGE <retry set> 0 0 WITHSCORES``: the earliest score, or ``None``."""
        await self._enter("next_retry_due")
        members = self.server.retry.get(self.retry_set, {})
        return min(members.values()) if members else None

    async def backlog(self) -> int:
        await self._enter("backlog")
        return len(self.q.pending)

    async def queue_stats(self) -> QueueStats:
        """``lua/queue-stats-7.lua`` on the fake's state (no consumer registry here: no
        consumer is alive; ``data.created`` is not read: the oldest age is NaN)."""
        now = await self._enter("queue_stats")
        expiries = [c.expiry for c in self.q.claims.values()]
        ordered = self.q.ordered()
        return QueueStats(
            server_now=now,
            pending=len(ordered),
            claimed=len(self.q.claims),
            expired=sum(1 for e in expiries if e <= now),
            oldest_pending_age=math.nan if ordered else 0.0,
            pending_deadline_headroom=(
                math.floor(self.q.pending[ordered[0]]) - now if ordered else math.nan
            ),
            lease_headroom=min(expiries) - now if expiries else math.nan,
            retry_set=len(self.server.retry.get(self.retry_set, {})),
            retry_dead=len(self.server.retry_dead.get(self.retry_set, {})),
            dead=len(self.q.dead),
            consumers_alive=0,
            exporter=None,
        )

    async def first_wrong_type(self, expected: Mapping[str, str]) -> tuple[str, str, str] | None:
        """The first key of ``expected`` that :attr:`FakeServer.key_types` says holds another
        type, as ``(key, found, expected)``; ``None`` when there is none."""
        await self._enter("first_wrong_type")
        for key, want in expected.items():
            found = self.server.key_types.get(key, "none")
            if found not in ("none", want):
                return key, found, want
        return None
