"""The claim protocol's batched operations on one queue, over a :class:`Store`.

The protocol: docs/protocol.md#claim-protocol. Each method is one Lua script call per chunk
of at most :data:`CHUNK` items (a chunk keeps a single script well under ~5 ms of Redis
time), never a round trip per request. Lease maths happens inside the scripts, on the Redis
server clock.

This module knows the scripts' argument layouts (see each ``lua/*.lua`` header); the
consumer, the operator commands and the tests all call the protocol through it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from claimkit.protocol import keys as _keys
from claimkit.protocol.models import Envelope, ErrorCode, Invalid, TerminalRecord
from claimkit.protocol.replies import ClaimCode as ClaimCode
from claimkit.protocol.replies import ParkCode as ParkCode
from claimkit.protocol.replies import ReclaimCounts as ReclaimCounts
from claimkit.protocol.replies import ReleaseCode as ReleaseCode
from claimkit.protocol.replies import RenewCode as RenewCode
from claimkit.protocol.replies import RequeueCode as RequeueCode
from claimkit.protocol.replies import orphans_message as orphans_message
from claimkit.protocol.routing import ResultRouting
from claimkit.protocol.store_calls import CHUNK as CHUNK
from claimkit.protocol.store_calls import as_int as _int
from claimkit.protocol.store_calls import chunks as _chunks
from claimkit.protocol.store_calls import first_wrong_type as first_wrong_type
from claimkit.protocol.store_calls import move_retries as move_retries
from claimkit.protocol.tokens import new_token as new_token
from claimkit.protocol.tokens import token_time as token_time
from claimkit.store.scripts import script

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from claimkit.store import Arg, Store

__all__ = [
    "CHUNK",
    "ORPHAN_SCAN_COUNT",
    "RENEW_CHUNK",
    "AckItem",
    "ClaimCode",
    "ParkCode",
    "QueueOps",
    "QueueProtocol",
    "ReclaimCounts",
    "ReleaseCode",
    "RenewCode",
    "RequeueCode",
    "first_wrong_type",
    "move_retries",
    "new_token",
    "orphans_message",
    "token_time",
]

RENEW_CHUNK = 1000
"""Claims per renew script call. ``lua/renew-2.lua`` costs ~3.5-5 us of Redis time per claim
(half of it is only Redis building the script's ARGV), so 1000 claims stay near ~5 ms. A tick
for 10k held claims is 10 such calls sent in one round trip (docs/performance.md,
"Heartbeat")."""


@dataclass(frozen=True, slots=True)
class AckItem:
    """One terminal record to ack (docs/protocol.md#ack)."""

    id: str
    token: str
    request_token: str
    result_list: str
    record: bytes
    member: bytes


ORPHAN_SCAN_COUNT = CHUNK
"""``HSCAN ... COUNT`` of the orphan scan, and the most orphans one reclaim call handles."""

_SCAN_CLAIMED, _SCAN_OWNERS = 2, 3  # the KEYS index of the hash lua/reclaim-6.lua scans


@dataclass(slots=True)
class _OrphanScan:
    """Where the orphan scan of one queue stands: which hash, at which ``HSCAN`` cursor.

    A cycle reads ``<q>:claimed`` from cursor 0 to 0, then ``<q>:claim-owners`` likewise.
    """

    target: int = _SCAN_CLAIMED
    cursor: bytes = b"0"

    def advance(self, next_cursor: bytes, capped: bool) -> bool:
        """Take the cursor a call returned (``capped``: the same page is to be read again);
        whether a whole cycle just ended."""
        self.cursor = next_cursor
        if capped or next_cursor != b"0":
            return False
        if self.target == _SCAN_CLAIMED:
            self.target = _SCAN_OWNERS
            return False
        self.target = _SCAN_CLAIMED
        return True


class QueueOps:
    """The batched protocol operations of one queue.

    Args:
        store: where the queue lives.
        queue: the pending ZSET's name ``<q>``.
        result_list: the queue's configured ``result_queue_name`` or ``None`` (then the
            member's ``internal.result_queue_name``, then ``default_result_list``;
            docs/protocol.md#result-routing).
        default_result_list: the global ``result_queue_name``.
        dedup_ttl: ``result_dedup_ttl_seconds``, whole seconds, 0 = markers never expire.
        lease_ttl: ``claim_lease_ttl_seconds``, seconds (> 0): the lease a reclaim gives
            back to a claim without a lease entry (docs/protocol.md, "Claims without a
            lease entry").
        retry_set: ``retry_queue_name``, the retry ZSET every queue shares
            (docs/protocol.md#retry-mover); :meth:`move_retries` drains it.

    It satisfies :class:`QueueProtocol`, the part of it the consumer uses.

    Every method raises :class:`~claimkit.store.StoreUnavailable` or
    :class:`~claimkit.store.StoreError` as the store does. A chunk that raised may or may
    not have been applied; every script is safe to run again (docs/protocol.md#claim-protocol).
    """

    def __init__(
        self,
        store: Store,
        queue: str,
        *,
        result_list: str | None = None,
        default_result_list: str = _keys.DEFAULT_RESULT_LIST,
        dedup_ttl: int = _keys.DEFAULT_DEDUP_TTL_SECONDS,
        lease_ttl: float = _keys.DEFAULT_LEASE_TTL_SECONDS,
        retry_set: str = _keys.DEFAULT_RETRY_SET,
    ) -> None:
        self.store = store
        self.retry_set = retry_set
        self.queue = queue
        self.keys = _keys.QueueKeys.for_queue(queue)
        self.routing = ResultRouting(result_list, default_result_list)
        self.result_list = self.routing.queue_list
        self.default_result_list = default_result_list
        self.dedup_ttl = dedup_ttl
        self.lease_ttl = lease_ttl
        self._orphan_scan = _OrphanScan()

    def result_list_for(self, member_result_list: str | None) -> str:
        """The destination list of a request's record (docs/protocol.md#terminal-record):
        :meth:`ResultRouting.list_for`."""
        return self.routing.list_for(member_result_list)

    @property
    def fallback_result_list(self) -> str:
        """Where a record goes when the list a member names holds another type of key: the
        queue's list, else the global one (the scripts check the type as they push)."""
        return self.routing.fallback

    # -- peek (docs/protocol.md#peek) ----------------------------------------------------------

    async def peek(self, count: int) -> list[bytes]:
        """Up to ``count`` pending members, earliest deadline first; nothing is removed."""
        reply = await self.store.command(
            "ZRANGE", self.keys.pending, "-inf", "+inf", "BYSCORE", "LIMIT", 0, count
        )
        return list(reply)

    async def dead_letter(self, invalid: Sequence[Invalid]) -> tuple[int, int]:
        """Move malformed members to ``<q>:dead``; push an ``INVALID_REQUEST`` record for
        each whose id was readable. Returns ``(moved, records_pushed)``."""
        moved = pushed = 0
        for chunk in _chunks(invalid):
            args: list[Arg] = [self.dedup_ttl, self.fallback_result_list]
            for bad in chunk:
                if bad.id is None:
                    args += [bad.raw, "", "", "", ""]
                else:
                    record = TerminalRecord.error(bad.id, ErrorCode.INVALID_REQUEST, bad.reason)
                    args += [
                        bad.raw,
                        bad.request_token,
                        _keys.result_terminal(bad.id),
                        self.result_list_for(bad.result_queue_name),
                        record.to_json(),
                    ]
            reply = await self.store.run(
                script("dead-letter"), [self.keys.pending, self.keys.dead], args
            )
            moved += sum(_int(v) for v in reply[0::2])
            pushed += sum(_int(v) for v in reply[1::2])
        return moved, pushed

    # -- claim (docs/protocol.md#claim) --------------------------------------------------------

    async def claim(
        self, candidates: Sequence[tuple[Envelope, str]], lease_ttl: float
    ) -> tuple[float, list[ClaimCode]]:
        """Claim ``(envelope, token)`` pairs under a lease of ``lease_ttl`` seconds.

        Returns ``(server_now, codes)``: server time in Unix seconds and one
        :class:`ClaimCode` per candidate, in order.
        """
        now = 0.0
        codes: list[ClaimCode] = []
        for chunk in _chunks(candidates):
            args: list[Arg] = [repr(float(lease_ttl)), _keys.REQUEST_CANCEL_PREFIX]
            for env, token in chunk:
                args += [env.raw, env.id, token, env.deadline, env.request_token]
            reply = await self.store.run(script("claim"), self._claim_keys(), args)
            now = float(reply[0])
            codes += [ClaimCode(_int(v)) for v in reply[1:]]
        return now, codes

    def _claim_keys(self) -> list[str]:
        k = self.keys
        return [k.pending, k.claimed, k.owners, k.index]

    # -- renew (docs/protocol.md#heartbeat) ----------------------------------------------------

    async def renew(
        self, claims: Sequence[tuple[str, str, int]], lease_ttl: float
    ) -> tuple[float, list[RenewCode]]:
        """Renew ``(id, token, deadline)`` claims, fenced by token (docs/protocol.md#heartbeat).

        One round trip: a pipeline of one ``lua/renew-2.lua`` call per :data:`RENEW_CHUNK`
        claims, so no single script holds Redis for long. Renewing is idempotent, so a call
        that fails part-way is simply made again on the next tick.

        Args:
            claims: ``(id, token, deadline)``; ``deadline`` in Unix seconds.
            lease_ttl: seconds; each lease becomes what a claim taken now would get (the
                one lease rule, ``lua/_lease.lua``): ``min(now + lease_ttl, deadline + 30)``,
                never less than ``now + min(lease_ttl, 30)``, on the server clock.

        Returns:
            ``(server_now, codes)``: Unix seconds at the last call, and one
            :class:`RenewCode` per claim.
        """
        if not claims:
            return 0.0, []
        keys = [self.keys.owners, self.keys.index]
        calls: list[tuple[list[str], list[Arg]]] = []
        for chunk in _chunks(claims, RENEW_CHUNK):
            args: list[Arg] = [repr(float(lease_ttl))]
            for rid, token, deadline in chunk:
                args += [rid, token, deadline]
            calls.append((keys, args))
        now = 0.0
        codes: list[RenewCode] = []
        for reply in await self.store.run_many(script("renew"), calls):
            now = float(reply[0])
            codes += [RenewCode(_int(v)) for v in reply[1:]]
        return now, codes

    # -- ack (docs/protocol.md#ack) ------------------------------------------------------------

    async def ack(self, items: Sequence[AckItem]) -> list[tuple[bool, bool]]:
        """Push each record once and drop its claim. Returns ``(pushed, owned)`` per item:
        ``pushed`` False means a suppressed duplicate; ``owned`` False means the claim was
        no longer the caller's (it was left alone)."""
        out: list[tuple[bool, bool]] = []
        k = self.keys
        for chunk in _chunks(items):
            args: list[Arg] = [self.dedup_ttl, self.fallback_result_list]
            for it in chunk:
                args += [
                    it.id,
                    it.token,
                    it.request_token,
                    _keys.result_terminal(it.id),
                    it.result_list,
                    it.record,
                    it.member,
                ]
            reply = await self.store.run(
                script("ack"), [k.pending, k.claimed, k.owners, k.index, k.deliveries], args
            )
            out += [
                (bool(_int(p)), bool(_int(o)))
                for p, o in zip(reply[0::2], reply[1::2], strict=True)
            ]
        return out

    # -- park (docs/protocol.md#park-for-retry) ------------------------------------------------

    async def park(
        self, items: Sequence[tuple[str, str, float, bytes]]
    ) -> tuple[float, list[ParkCode]]:
        """Move ``(id, token, delay_seconds, retry_member)`` claims to :attr:`retry_set`,
        fenced; the retry mover (:meth:`move_retries`) reads the same set.
        Returns ``(server_now, codes)``: one :class:`ParkCode` per item."""
        now = 0.0
        codes: list[ParkCode] = []
        k = self.keys
        for chunk in _chunks(items):
            args: list[Arg] = []
            for rid, token, delay, member in chunk:
                args += [rid, token, repr(float(delay)), member]
            reply = await self.store.run(
                script("park"), [k.claimed, k.owners, k.index, self.retry_set], args
            )
            now = float(reply[0])
            codes += [ParkCode(_int(v)) for v in reply[1:]]
        return now, codes

    # -- release (docs/protocol.md#release-and-sweep) ------------------------------------------

    async def release(self, claims: Sequence[tuple[str, str, float | None]]) -> list[ReleaseCode]:
        """Hand ``(id, token, expected_expiry)`` claims back to pending at their original
        score. ``expected_expiry`` (Unix seconds, or ``None``) leaves alone a claim whose
        lease changed since it was read. One :class:`ReleaseCode` per claim."""
        codes: list[ReleaseCode] = []
        for chunk in _chunks(claims):
            args: list[Arg] = []
            for rid, token, expected in chunk:
                args += [rid, token, "" if expected is None else repr(float(expected))]
            reply = await self.store.run(script("release"), self._claim_keys(), args)
            codes += [ReleaseCode(_int(v)) for v in reply]
        return codes

    # -- reclaim (docs/protocol.md#reclaim) ----------------------------------------------------

    async def reclaim_pass(
        self, limit: int, max_deliveries: int, *, scan_count: int = ORPHAN_SCAN_COUNT
    ) -> tuple[ReclaimCounts, bool]:
        """One reclaim script call: up to ``limit`` expired claims, and one page (``HSCAN``
        ``COUNT scan_count``) of the orphan scan, handling at most ``scan_count`` claims
        without a lease entry. Returns the counts and whether more may be left at once
        (expired claims beyond ``limit``, or orphans beyond ``scan_count`` on that page).
        The scan's cursor is kept on this object, so successive calls walk the claim
        hashes (docs/protocol.md, "Claims without a lease entry")."""
        counts, more, _ = await self._reclaim_call(limit, max_deliveries, scan_count)
        return counts, more

    async def _reclaim_call(
        self, limit: int, max_deliveries: int, scan_count: int
    ) -> tuple[ReclaimCounts, bool, bool]:
        k = self.keys
        scan = self._orphan_scan
        reply = await self.store.run(
            script("reclaim"),
            [k.pending, k.claimed, k.owners, k.index, k.deliveries, k.dead],
            [
                limit,
                max_deliveries,
                *self.routing.lua_args(),
                _keys.RESULT_TERMINAL_PREFIX,
                self.dedup_ttl,
                scan.target,
                scan.cursor,
                scan_count,
                repr(float(self.lease_ttl)),
            ],
        )
        redelivered, dead, ghosts, more, orphans = (_int(v) for v in reply[:5])
        cursor = reply[5] if isinstance(reply[5], bytes) else str(reply[5]).encode()
        cycle_done = scan.advance(cursor, bool(_int(reply[6])))
        counts = ReclaimCounts(redelivered, dead, ghosts, orphans, _int(reply[7]))
        return counts, bool(more), cycle_done

    async def reclaim(
        self,
        max_deliveries: int,
        limit: int = CHUNK,
        *,
        full_scan: bool = False,
        scan_count: int = ORPHAN_SCAN_COUNT,
    ) -> ReclaimCounts:
        """A full reclaim run (docs/protocol.md, "Reclaim"): calls repeat until no expired
        claim is left, so a backlog of any size drains in one run.

        Each call also reads the next page of the orphan scan (claims without a lease
        entry: each is given its lease back, ``self.lease_ttl`` seconds under the claim
        rule, so a live owner goes on renewing it and a dead owner's claim expires one
        lease later). A consumer's periodic run advances the scan by at
        least one page per run; ``full_scan=True`` (``claimkit reclaim --once``) goes on
        until the scan has walked both claim hashes once, so every orphan present when it
        started is found. No call reads more than one page of ``scan_count`` fields.

        Raises:
            ValueError: ``limit`` or ``scan_count`` is below 1.
            StoreUnavailable, StoreError: from the store; calls made before stay applied.
        """
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        if scan_count < 1:
            raise ValueError(f"scan_count must be at least 1, got {scan_count}")
        if full_scan:
            self._orphan_scan = _OrphanScan()  # a cycle of its own, from the start
        total = ReclaimCounts()
        while True:
            counts, more, cycle_done = await self._reclaim_call(limit, max_deliveries, scan_count)
            total += counts
            if more:
                continue
            if not full_scan or cycle_done:
                return total

    # -- the consumer's other calls: retry mover, backlog, key types ---------------------------

    async def move_retries(self, *, limit: int = CHUNK) -> tuple[int, int]:
        """:func:`move_retries` on :attr:`retry_set` (shared by every queue: call it on one
        queue's ops only). Returns ``(moved, dead)``."""
        return await move_retries(self.store, self.retry_set, limit=limit)

    async def backlog(self) -> int:
        """How many requests are pending: ``ZCARD <q>``."""
        return _int(await self.store.command("ZCARD", self.keys.pending))

    async def first_wrong_type(self, expected: Mapping[str, str]) -> tuple[str, str, str] | None:
        """:func:`first_wrong_type` on this queue's store: any keys, not only this queue's."""
        return await first_wrong_type(self.store, expected)


class QueueProtocol(Protocol):
    """What the consumer needs of one queue's protocol layer (:class:`QueueOps` is the real
    one; a test may pass a fake through ``Consumer(ops_factory=...)``). Every Redis call the
    consumer makes goes through one of these, save a ``redis`` gate's own budget read.

    Attributes and methods, as on :class:`QueueOps`: ``queue``, ``routing`` (the queue's
    :class:`~claimkit.protocol.routing.ResultRouting`), ``result_list``,
    ``result_list_for``, ``peek``, ``dead_letter``, ``claim``, ``renew``, ``ack``,
    ``park``, ``release``, ``reclaim``, ``move_retries``, ``backlog``,
    ``first_wrong_type``. Times are Unix seconds on the Redis server clock; each call
    raises :class:`~claimkit.store.StoreUnavailable` or
    :class:`~claimkit.store.StoreError` as Redis fails.
    """

    @property
    def queue(self) -> str: ...

    @property
    def routing(self) -> ResultRouting: ...

    @property
    def result_list(self) -> str | None: ...

    def result_list_for(self, member_result_list: str | None) -> str: ...

    async def peek(self, count: int) -> list[bytes]: ...

    async def dead_letter(self, invalid: Sequence[Invalid]) -> tuple[int, int]: ...

    async def claim(
        self, candidates: Sequence[tuple[Envelope, str]], lease_ttl: float
    ) -> tuple[float, list[ClaimCode]]: ...

    async def renew(
        self, claims: Sequence[tuple[str, str, int]], lease_ttl: float
    ) -> tuple[float, list[RenewCode]]: ...

    async def ack(self, items: Sequence[AckItem]) -> list[tuple[bool, bool]]: ...

    async def park(
        self, items: Sequence[tuple[str, str, float, bytes]]
    ) -> tuple[float, list[ParkCode]]: ...

    async def release(
        self, claims: Sequence[tuple[str, str, float | None]]
    ) -> list[ReleaseCode]: ...

    async def reclaim(
        self,
        max_deliveries: int,
        limit: int = CHUNK,
        *,
        full_scan: bool = False,
        scan_count: int = ORPHAN_SCAN_COUNT,
    ) -> ReclaimCounts: ...

    async def move_retries(self, *, limit: int = CHUNK) -> tuple[int, int]: ...

    async def backlog(self) -> int: ...

    async def first_wrong_type(
        self, expected: Mapping[str, str]
    ) -> tuple[str, str, str] | None: ...
