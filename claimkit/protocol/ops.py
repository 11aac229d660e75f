"""The claim protocol's batched operations on one queue, over a :class:`Store`.

The protocol: docs/protocol.md#claim-protocol. Each method is one Lua script call per chunk
of at most :data:`CHUNK` items (a chunk keeps a single script well under ~5 ms of Redis
time), never a round trip per request. Lease maths happens inside the scripts, on the Redis
server clock.

This module knows the scripts' argument layouts (see each ``lua/*.lua`` header); the
consumer, the operator commands and the tests all call the protocol through it.

On a Redis Cluster (``store.mode == "cluster"``) the same operations run on the cluster key
layout (docs/topology.md#cluster-key-layout): every script touches keys of one slot only.
The claim reads cancel markers after the script; an ack whose list lives in another slot
goes through the queue's outbox (:mod:`claimkit.protocol.outbox`); park and the retry
mover use the queue's own retry set.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from claimkit.protocol import consumers as _consumers
from claimkit.protocol import keys as _keys
from claimkit.protocol import outbox as _outbox
from claimkit.protocol.consumers import ConsumerIdentity as ConsumerIdentity
from claimkit.protocol.models import Envelope, ErrorCode, Invalid, TerminalRecord
from claimkit.protocol.pause import PauseMark, parse_pause
from claimkit.protocol.replies import ClaimCode as ClaimCode
from claimkit.protocol.replies import MoveCode as MoveCode
from claimkit.protocol.replies import ParkCode as ParkCode
from claimkit.protocol.replies import ReclaimCounts as ReclaimCounts
from claimkit.protocol.replies import ReleaseCode as ReleaseCode
from claimkit.protocol.replies import RenewCode as RenewCode
from claimkit.protocol.replies import RequeueCode as RequeueCode
from claimkit.protocol.replies import orphans_message as orphans_message
from claimkit.protocol.routing import ResultRouting
from claimkit.protocol.stats import QueueStats, read_queue_stats
from claimkit.protocol.store_calls import CHUNK as CHUNK
from claimkit.protocol.store_calls import as_int as _int
from claimkit.protocol.store_calls import chunks as _chunks
from claimkit.protocol.store_calls import first_wrong_type as first_wrong_type
from claimkit.protocol.store_calls import move_retries as move_retries
from claimkit.protocol.tokens import new_token as new_token
from claimkit.protocol.tokens import token_consumer as token_consumer
from claimkit.protocol.tokens import token_time as token_time
from claimkit.store import StoreError, StoreUnavailable
from claimkit.store.scripts import script

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Mapping, Sequence

    from claimkit.store import Arg, Store

__all__ = [
    "CHUNK",
    "ORPHAN_SCAN_COUNT",
    "RENEW_CHUNK",
    "AckItem",
    "ClaimCode",
    "ConsumerIdentity",
    "MoveCode",
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
    "token_consumer",
    "token_time",
]

_log = logging.getLogger("claimkit")

RENEW_CHUNK = 1000
"""Claims per renew script call. ``lua/renew-4.lua`` costs ~3.5-5 us of Redis time per claim
(half of it is only Redis building the script's ARGV), so 1000 claims stay near ~5 ms. A tick
for 10k held claims is 10 such calls sent in one round trip (docs/performance.md,
"Heartbeat")."""


@dataclass(frozen=True, slots=True)
class AckItem:
    """One terminal record to ack (docs/protocol.md#ack).

    ``payload_ref`` is the request's payload key (``Envelope.payload_ref``) or ``""``: the
    ack that ends the request deletes it (docs/protocol.md#payload-references)."""

    id: str
    token: str
    request_token: str
    result_list: str
    record: bytes
    member: bytes
    payload_ref: str = ""


ORPHAN_SCAN_COUNT = CHUNK
"""``HSCAN ... COUNT`` of the orphan scan, and the most orphans one reclaim call handles."""

_UNANSWERED_MOVES_MAX = 100_000
"""Outbox fields :class:`QueueOps` remembers from step-1 calls that raised (each is
forgotten at the next ack of its item; past this many, those of acks never retried go)."""

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
        retry_set: ``retry_queue_name``: standalone, the retry ZSET every queue shares
            (docs/protocol.md#retry-mover); on a cluster the queue's own
            ``{q}:<retry_queue_name>`` is used instead (:attr:`retry_set` says which).
            :meth:`move_retries` drains it.
        consumer: the consumer this protocol layer renews the liveness of
            (docs/protocol.md#consumers): :meth:`register`, every :meth:`renew` and
            :meth:`forget_self` write its registry entry. ``None``: no registry entry (the
            registry is off, or the caller is not a consumer: ``claimkit reclaim``).
        _after_outbox_step: tests only: awaited with 1 after step 1 of an ack across slots
            (the records are in the outbox) and with 2 after step 2 (pushed, fields not
            yet deleted), so a test can stop the ack between steps as a crash would.

    It satisfies :class:`QueueProtocol`, the part of it the consumer uses. The key layout
    follows ``store.mode`` (``"cluster"``: docs/topology.md#cluster-key-layout; any other
    mode, or a store without the attribute: docs/protocol.md#keys).

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
        consumer: ConsumerIdentity | None = None,
        _after_outbox_step: Callable[[int], Awaitable[None]] | None = None,
    ) -> None:
        self.store = store
        self.consumer = consumer
        self.cluster = _keys.cluster_layout(store)
        self.queue = queue
        self.keys = _keys.QueueKeys.for_queue(queue, cluster=self.cluster, retry_set=retry_set)
        self.retry_set = self.keys.retry_set
        self._slot = _keys.key_slot(queue)
        self._after_outbox_step = _after_outbox_step
        self.routing = ResultRouting(result_list, default_result_list)
        self.result_list = self.routing.queue_list
        self.default_result_list = default_result_list
        self.dedup_ttl = dedup_ttl
        self.lease_ttl = lease_ttl
        self._orphan_scan = _OrphanScan()
        self._unanswered_moves: set[bytes] = set()  # outbox fields of a step 1 that raised

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

    async def peek_unless_paused(self, count: int) -> tuple[PauseMark | None, list[bytes]]:
        """The poller's peek (docs/protocol.md#pause): ``GET <q>:paused`` and the
        :meth:`peek` ``ZRANGE`` in one pipelined round trip (both keys are in the queue's
        slot on a cluster). Returns ``(mark, [])`` while the queue is paused (the key
        exists, whatever it holds: :func:`~claimkit.protocol.pause.parse_pause`), else
        ``(None, up to count members)``. Nothing is written.

        Raises:
            StoreError: ``<q>:paused`` holds another type than a string (``WRONGTYPE``),
                or another refusal; StoreUnavailable as the store does.

        Cancellation: nothing is written, so a cancelled call leaves no trace.
        """
        raw, members = await self.store.pipeline(
            [
                ("GET", self.keys.paused),
                ("ZRANGE", self.keys.pending, "-inf", "+inf", "BYSCORE", "LIMIT", 0, count),
            ],
            transaction=False,
        )
        mark = parse_pause(raw)
        return (mark, []) if mark is not None else (None, list(members))

    async def dead_letter(self, invalid: Sequence[Invalid]) -> tuple[int, int]:
        """Move malformed members to ``<q>:dead``; push an ``INVALID_REQUEST`` record for
        each whose id was readable. Returns ``(moved, records_pushed)``.

        On a cluster the records go through the outbox (``lua/dead-letter-outbox-3.lua``,
        then :func:`~claimkit.protocol.outbox.push_entries`): their lists may live in
        another slot. A call that fails after the move leaves them for any reclaimer."""
        if self.cluster:
            return await self._dead_letter_cluster(invalid)
        moved = pushed = 0
        for chunk in _chunks(invalid):
            args: list[Arg] = [self.dedup_ttl, self.fallback_result_list]
            for bad in chunk:
                if bad.id is None:
                    args += [bad.raw, "", "", "", ""]
                else:
                    record = TerminalRecord.error(
                        bad.id, ErrorCode.INVALID_REQUEST, bad.reason, bad.request_token
                    )
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

    async def _dead_letter_cluster(self, invalid: Sequence[Invalid]) -> tuple[int, int]:
        k = self.keys
        assert k.outbox is not None
        moved = pushed = 0
        for chunk in _chunks(invalid):
            args: list[Arg] = []
            entries: list[_outbox.OutboxEntry | None] = []
            for bad in chunk:
                if bad.id is None:
                    args += [bad.raw, "", "", "", "", ""]
                    entries.append(None)
                    continue
                record = TerminalRecord.error(
                    bad.id, ErrorCode.INVALID_REQUEST, bad.reason, bad.request_token
                )
                entry = _outbox.OutboxEntry(
                    field=_keys.outbox_field(bad.id, new_token()).encode(),
                    list=self.result_list_for(bad.result_queue_name),
                    request_token=bad.request_token,
                    record=record.to_json(),
                    id=bad.id,
                )
                args += [bad.raw, bad.request_token, bad.id, entry.field, entry.list, entry.record]
                entries.append(entry)
            reply = await self.store.run(
                script("dead-letter-outbox"), [k.pending, k.dead, k.outbox], args
            )
            moved += sum(_int(v) for v in reply[0::2])
            queued = [
                e
                for e, q in zip(entries, reply[1::2], strict=True)
                if e is not None and _int(q) == 1
            ]
            pushed += sum((await self._finish(queued)).values())
        return moved, pushed

    async def _finish(self, entries: Sequence[_outbox.OutboxEntry]) -> dict[bytes, bool]:
        """Steps 2 and 3 for ``entries`` already in the outbox: ``field -> pushed`` as
        :func:`~claimkit.protocol.outbox.push_entries` answers (``False``: a duplicate)."""
        if not entries:
            return {}
        assert self.keys.outbox is not None
        done = await _outbox.push_entries(
            self.store,
            self.keys.outbox,
            entries,
            fallback=self.fallback_result_list,
            dedup_ttl=self.dedup_ttl,
        )
        if self._after_outbox_step is not None:
            await self._after_outbox_step(2)
        await _outbox.drop_entries(self.store, self.keys.outbox, list(done))
        return done

    async def replay_outbox(self, *, page: int = CHUNK) -> tuple[int, int]:
        """Finish the records left in this queue's outbox (cluster only; standalone has no
        outbox and this returns ``(0, 0)``): :func:`claimkit.protocol.outbox.replay`, one
        ``HSCAN`` cycle of ``page`` fields per round trip. Returns ``(finished, pushed)``."""
        if self.keys.outbox is None:
            return 0, 0
        return await _outbox.replay(
            self.store,
            self.keys.outbox,
            fallback=self.fallback_result_list,
            dedup_ttl=self.dedup_ttl,
            page=page,
        )

    # -- claim (docs/protocol.md#claim) --------------------------------------------------------

    async def claim(
        self, candidates: Sequence[tuple[Envelope, str]], lease_ttl: float
    ) -> tuple[float, list[ClaimCode]]:
        """Claim ``(envelope, token)`` pairs under a lease of ``lease_ttl`` seconds.

        Returns ``(server_now, codes)``: server time in Unix seconds and one
        :class:`ClaimCode` per candidate, in order.

        On a cluster the script reads no cancel marker (it lives in the request's own
        slot): the markers of the claimed candidates that have a ``request_token`` are read
        after it (``MGET`` per slot in one pipeline, no script), and a match turns
        ``CLAIMED`` into ``CANCELLED`` (docs/topology.md#retries-cancellation-and-the-producer).
        If that read fails the claims stand (held in Redis, unknown to the caller) and
        lapse like claims whose reply was lost.
        """
        now = 0.0
        codes: list[ClaimCode] = []
        prefix = "" if self.cluster else _keys.REQUEST_CANCEL_PREFIX
        for chunk in _chunks(candidates):
            args: list[Arg] = [repr(float(lease_ttl)), prefix]
            for env, token in chunk:
                args += [env.raw, env.id, token, env.deadline, env.request_token]
            reply = await self.store.run(script("claim"), self._claim_keys(), args)
            now = float(reply[0])
            chunk_codes = [ClaimCode(_int(v)) for v in reply[1:]]
            if self.cluster:
                chunk_codes = await self._cancelled_after_claim(chunk, chunk_codes)
            codes += chunk_codes
        return now, codes

    async def _cancelled_after_claim(
        self, chunk: Sequence[tuple[Envelope, str]], codes: list[ClaimCode]
    ) -> list[ClaimCode]:
        """Cluster: read the cancel markers of the claimed candidates that carry a
        ``request_token`` (``MGET`` per slot, one pipeline: reads only, no script) and turn
        ``CLAIMED`` into ``CANCELLED`` where a marker holds that token. A marker of another
        type than a string reads as missing (``MGET`` gives nil): not cancelled, as the
        standalone claim script's guarded read says."""
        asked = [
            i
            for i, ((env, _token), code) in enumerate(zip(chunk, codes, strict=True))
            if code == ClaimCode.CLAIMED and env.request_token
        ]
        if not asked:
            return codes
        markers = await self._mget([_keys.request_cancel(chunk[i][0].id) for i in asked])
        out = list(codes)
        for i, marker in zip(asked, markers, strict=True):
            token = chunk[i][0].request_token
            if marker is not None and token and marker == token.encode():
                out[i] = ClaimCode.CANCELLED
        return out

    # -- payloads (docs/protocol.md#payload-references) ---------------------------------------

    async def fetch_payloads(self, refs: Sequence[str]) -> list[bytes | None]:
        """The values of the payload keys ``refs`` (``request-payload:<id>:<token>``), in
        order: the exact stored bytes, or ``None`` for a key that is missing (or holds
        another type than a string, which ``MGET`` reads as missing).

        One round trip: standalone one ``MGET`` of every key; on a cluster, where each
        payload key hashes to its own slot, one ``MGET`` per slot, sent as one pipeline
        (docs/topology.md#payload-keys). Reads only; an empty ``refs`` sends nothing.

        Raises:
            StoreUnavailable, StoreError: as the store does; nothing was written.
        """
        if not refs:
            return []
        return await self._mget(refs)

    async def _mget(self, keys: Sequence[str]) -> list[bytes | None]:
        """The string values of ``keys`` in order (``None``: missing or another type): one
        ``MGET`` standalone; on a cluster one ``MGET`` per slot, sent as one pipeline."""
        if not self.cluster:
            return list(await self.store.command("MGET", *keys))
        by_slot: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            by_slot.setdefault(_keys.key_slot(key), []).append(i)
        groups = list(by_slot.values())
        replies = await self.store.pipeline(
            [["MGET", *(keys[i] for i in group)] for group in groups], transaction=False
        )
        out: list[bytes | None] = [None] * len(keys)
        for group, reply in zip(groups, replies, strict=True):
            for i, value in zip(group, reply, strict=True):
                out[i] = value
        return out

    async def _drop_payloads(
        self, items: Sequence[AckItem], results: Sequence[tuple[bool, bool]]
    ) -> None:
        """Cluster: delete the payload keys of the acked items whose ack ended the request
        (pushed, or the claim was the caller's), one ``DEL`` per slot in one pipeline. The
        keys live in other slots than the queue's, so no ack script can delete them. A
        failure is only logged: each key expires with its TTL
        (docs/topology.md#payload-keys)."""
        refs = [
            it.payload_ref
            for it, (pushed, owned) in zip(items, results, strict=True)
            if it.payload_ref and (pushed or owned)
        ]
        if not refs:
            return
        by_slot: dict[int, list[str]] = {}
        for ref in refs:
            by_slot.setdefault(_keys.key_slot(ref), []).append(ref)
        try:
            await self.store.pipeline(
                [["DEL", *group] for group in by_slot.values()], transaction=False
            )
        except (StoreUnavailable, StoreError) as exc:
            _log.warning(
                "ack %s: deleting %d payload keys failed (%s); they expire with their TTL",
                self.queue,
                len(refs),
                exc,
            )

    def _claim_keys(self) -> list[str]:
        k = self.keys
        return [k.pending, k.claimed, k.owners, k.index]

    # -- renew (docs/protocol.md#heartbeat) ----------------------------------------------------

    async def renew(
        self, claims: Sequence[tuple[str, str, int]], lease_ttl: float
    ) -> tuple[float, list[RenewCode]]:
        """Renew ``(id, token, deadline)`` claims, fenced by token, and this consumer's
        liveness entry (docs/protocol.md#heartbeat, docs/protocol.md#consumers).

        One round trip: a pipeline of one ``lua/renew-4.lua`` call per :data:`RENEW_CHUNK`
        claims, so no single script holds Redis for long; the first call also renews the
        liveness entry of :attr:`consumer` (server_now + its liveness TTL), and with no
        claims that call is made alone. Renewing is idempotent, so a call that fails
        part-way is simply made again on the next tick.

        Args:
            claims: ``(id, token, deadline)``; ``deadline`` in Unix seconds.
            lease_ttl: seconds; each lease becomes what a claim taken now would get (the
                one lease rule, ``lua/_lease.lua``): ``min(now + lease_ttl, deadline + 30)``,
                never less than ``now + min(lease_ttl, 30)``, on the server clock.

        Returns:
            ``(server_now, codes)``: Unix seconds at the last call (0.0 when nothing was
            sent: no claims and no consumer), and one :class:`RenewCode` per claim.
        """
        if not claims and self.consumer is None:
            return 0.0, []
        k = self.keys
        keys = [k.owners, k.index, k.consumers, k.consumer_info]
        idle: list[Arg] = ["", "", "", "", ""]
        liveness = idle if self.consumer is None else self.consumer.args()
        calls: list[tuple[list[str], list[Arg]]] = []
        for chunk in _chunks(claims, RENEW_CHUNK) if claims else [()]:
            args: list[Arg] = [repr(float(lease_ttl)), *(idle if calls else liveness)]
            for rid, token, deadline in chunk:
                args += [rid, token, deadline]
            calls.append((keys, args))
        now = 0.0
        codes: list[RenewCode] = []
        for reply in await self.store.run_many(script("renew"), calls):
            now = float(reply[0])
            codes += [RenewCode(_int(v)) for v in reply[1:]]
        return now, codes

    async def renew_liveness(self) -> float | None:
        """Renew only :attr:`consumer`'s liveness entry (server_now + its liveness TTL,
        its info written again if missing): one ``lua/renew-4.lua`` call with no claims,
        the call :meth:`renew` makes when it has no claims, on the queue's own slot
        (docs/protocol.md#heartbeat). The heartbeat makes it on the ticks where no claims
        renewal is due. Returns the server time (Unix seconds), or ``None`` without a
        consumer (nothing sent)."""
        if self.consumer is None:
            return None
        k = self.keys
        keys = [k.owners, k.index, k.consumers, k.consumer_info]
        args: list[Arg] = [repr(float(self.lease_ttl)), *self.consumer.args()]
        reply = await self.store.run(script("renew"), keys, args)
        return float(reply[0])

    # -- the consumer registry (docs/protocol.md#consumers) ------------------------------------

    async def register(self) -> tuple[float, dict[str, Any] | None] | None:
        """Enter :attr:`consumer` in this queue's registry (``lua/register-2.lua``) as it
        starts; returns the server time (Unix seconds) and the info of another live process
        that held the same consumer id (another host or pid; ``None``: none), or ``None``
        without a consumer (nothing sent)."""
        if self.consumer is None:
            return None
        return await _consumers.register(self.store, self.keys, self.consumer)

    async def forget_self(self) -> bool:
        """Remove :attr:`consumer`'s registry entry (``lua/forget-consumers-2.lua``), as a
        graceful shutdown does after its sweep; whether an entry was removed (``False``
        without a consumer: nothing sent)."""
        if self.consumer is None:
            return False
        gone = await _consumers.forget_consumers(
            self.store, self.keys, [self.consumer.id], dead_only=False
        )
        return bool(gone)

    async def expire_owners(self, *, require_alive: bool = False) -> tuple[float, int | None]:
        """Fast failover (docs/protocol.md#fast-failover): cut to now the leases of the
        claims of every consumer of this queue whose liveness lapsed, so the next reclaim
        redelivers them (:func:`claimkit.protocol.consumers.expire_owners`). Returns
        ``(server_now, leases cut)``; with ``require_alive``, ``(server_now, None)`` and
        nothing cut when no consumer of the queue is alive. Call it only once Redis has
        answered for a liveness TTL."""
        return await _consumers.expire_owners(self.store, self.keys, require_alive=require_alive)

    # -- ack (docs/protocol.md#ack) ------------------------------------------------------------

    async def ack(self, items: Sequence[AckItem]) -> list[tuple[bool, bool]]:
        """Push each record once and drop its claim. Returns ``(pushed, owned)`` per item:
        ``pushed`` False means a suppressed duplicate; ``owned`` False means the claim was
        no longer the caller's (it was left alone).

        On a cluster (docs/topology.md#acks-across-slots): the items whose list shares the
        queue's slot are acked by one script per list (``lua/ack-local-9.lua``); the others
        in three steps, each safe to repeat: one fenced script moves them into the
        outbox (``lua/ack-outbox-6.lua``), the push step writes each record under its
        list's markers (:func:`~claimkit.protocol.outbox.push_entries`), then the outbox
        fields are deleted. Once the first step has answered, the requests are no longer
        claimed, so none runs again, and their records wait in the outbox: a push step
        that finds the list's slot unavailable (``StoreUnavailable``) does not fail the
        call. Its records answer ``(True, owned)``, acked with the push pending, and any
        reclaimer's replay pushes them (:meth:`replay_outbox`); a record already there
        is then suppressed by the replay, not reported here. A call that fails in the
        first step may have moved some records; an ack retried after it answers
        "already moved" for them: ``owned`` True, ``pushed`` from its own push step. If a
        replay has finished such a record's entry before the retry, the retry's first step
        finds neither claim nor entry; as this object sent that record's first step in a
        call that raised, it answers ``(True, True)``: acked by its owner (were that call
        never applied and the claim lost during the outage, this miscounts a suppressed
        duplicate as acked; the records themselves are right either way)."""
        if self.cluster:
            results = await self._ack_cluster(items)
            await self._drop_payloads(items, results)
            return results
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
                    it.payload_ref,
                ]
            reply = await self.store.run(
                script("ack"), [k.pending, k.claimed, k.owners, k.index, k.deliveries], args
            )
            out += [
                (bool(_int(p)), bool(_int(o)))
                for p, o in zip(reply[0::2], reply[1::2], strict=True)
            ]
        return out

    async def _ack_cluster(self, items: Sequence[AckItem]) -> list[tuple[bool, bool]]:
        out: list[tuple[bool, bool] | None] = [None] * len(items)
        local: dict[str, list[int]] = {}
        remote: list[int] = []
        for i, it in enumerate(items):
            if _keys.key_slot(it.result_list) == self._slot:
                local.setdefault(it.result_list, []).append(i)
            else:
                remote.append(i)
        finish: list[tuple[int, _outbox.OutboxEntry]] = []
        for name, indexes in local.items():
            finish += await self._ack_local(items, name, indexes, out)
        owned: dict[int, bool] = {}
        for chunk in _chunks(remote):
            fields = [_keys.outbox_field(items[i].id, items[i].token).encode() for i in chunk]
            try:
                moved = await self._move_to_outbox([items[i] for i in chunk])
            except StoreUnavailable:
                if len(self._unanswered_moves) > _UNANSWERED_MOVES_MAX:
                    self._unanswered_moves.clear()
                self._unanswered_moves.update(fields)
                raise
            for i, code, f in zip(chunk, moved, fields, strict=True):
                unanswered = f in self._unanswered_moves
                self._unanswered_moves.discard(f)
                if code == MoveCode.SUPPRESSED and unanswered:
                    # An earlier call's step 1 moved it (its reply was lost) and a replay
                    # has finished the entry since: the owner's record, pushed.
                    out[i] = (True, True)
                elif code == MoveCode.SUPPRESSED:
                    out[i] = (False, False)
                else:
                    owned[i] = code != MoveCode.MOVED_WITHDRAWN
                    finish.append((i, self._entry(items[i], items[i].result_list)))
        if finish:
            done = await self._push_after_move([e for _, e in finish])
            for i, e in finish:
                # Not in `done`: another replayer re-aimed and finished it meanwhile.
                # `done` is None: the push did not answer; the record waits in the outbox.
                was = out[i]
                mine = owned[i] if i in owned else was is not None and was[1]
                out[i] = (True if done is None else done.get(e.field, False), mine)
        return [r if r is not None else (False, False) for r in out]

    async def _push_after_move(
        self, entries: Sequence[_outbox.OutboxEntry]
    ) -> dict[bytes, bool] | None:
        """Steps 2 and 3 of an ack whose step 1 has answered: ``field -> pushed`` as
        :meth:`_finish`, or ``None`` when the push step found the list's slot unavailable.

        Step 1 stands whatever follows: the requests are claimed by nobody and never run
        again, and each record waits in the outbox until a push or a replay finishes it.
        So a :class:`~claimkit.store.StoreUnavailable` from step 2 or 3 is not raised: a
        retried ack could only misreport (its push would find the marker of a push whose
        reply was lost, or its step 1 the entry a replay had finished meanwhile) and would
        hold up the caller's other acks for the length of that slot's failover. The
        reclaimers' replay pushes the records instead (``claimkit reclaim --once`` too).
        A :class:`~claimkit.store.StoreError` (a fallback list of another type) is raised:
        it has written nothing and no replay can mend it."""
        try:
            if self._after_outbox_step is not None:
                await self._after_outbox_step(1)
            assert self.keys.outbox is not None
            done = await _outbox.push_entries(
                self.store,
                self.keys.outbox,
                entries,
                fallback=self.fallback_result_list,
                dedup_ttl=self.dedup_ttl,
            )
        except StoreUnavailable:
            return None
        if self._after_outbox_step is not None:
            await self._after_outbox_step(2)
        with contextlib.suppress(StoreUnavailable):  # the replay drops them (pushing nothing)
            await _outbox.drop_entries(self.store, self.keys.outbox, list(done))
        return done

    def _entry(self, it: AckItem, result_list: str) -> _outbox.OutboxEntry:
        return _outbox.OutboxEntry(
            field=_keys.outbox_field(it.id, it.token).encode(),
            list=result_list,
            request_token=it.request_token,
            record=it.record,
            id=it.id,
        )

    async def _ack_local(
        self,
        items: Sequence[AckItem],
        name: str,
        indexes: Sequence[int],
        out: list[tuple[bool, bool] | None],
    ) -> list[tuple[int, _outbox.OutboxEntry]]:
        """``lua/ack-local-9.lua`` on the items ``indexes`` (all aimed at ``name``, in the
        queue's slot); fills ``out`` and returns the items it moved into the outbox for the
        fallback list instead (``name`` could not take records)."""
        k = self.keys
        assert k.outbox is not None
        r = _keys.ResultKeys.for_list(name)
        fallback = self.fallback_result_list
        keys = [k.pending, k.claimed, k.owners, k.index, k.deliveries, k.outbox, *r.types()]
        moved: list[tuple[int, _outbox.OutboxEntry]] = []
        for chunk in _chunks(indexes):
            args: list[Arg] = [self.dedup_ttl, "1" if name == fallback else "0", fallback]
            for i in chunk:
                it = items[i]
                field = _keys.outbox_field(it.id, it.token)
                args += [it.id, it.token, it.request_token, it.record, it.member, field]
            reply = await self.store.run(script("ack-local"), keys, args)
            for i, (p, o, m) in zip(
                chunk, zip(reply[0::3], reply[1::3], reply[2::3], strict=True), strict=True
            ):
                out[i] = (bool(_int(p)), bool(_int(o)))
                if _int(m):
                    moved.append((i, self._entry(items[i], fallback)))
        return moved

    async def _move_to_outbox(self, items: Sequence[AckItem]) -> list[MoveCode]:
        """Step 1 of an ack across slots (``lua/ack-outbox-6.lua``): one code per item."""
        k = self.keys
        assert k.outbox is not None
        args: list[Arg] = []
        for it in items:
            field = _keys.outbox_field(it.id, it.token)
            args += [it.id, it.token, it.request_token, it.result_list, it.record, it.member]
            args.append(field)
        reply = await self.store.run(
            script("ack-outbox"),
            [k.pending, k.claimed, k.owners, k.index, k.deliveries, k.outbox],
            args,
        )
        return [MoveCode(_int(v)) for v in reply]

    # -- park (docs/protocol.md#park-for-retry) ------------------------------------------------

    async def park(
        self, items: Sequence[tuple[str, str, float, bytes]]
    ) -> tuple[float, list[ParkCode]]:
        """Move ``(id, token, delay_seconds, retry_member)`` claims to :attr:`retry_set`
        (on a cluster the queue's own, in its slot), fenced; the retry mover
        (:meth:`move_retries`) reads the same set.
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
        keys = [k.pending, k.claimed, k.owners, k.index, k.deliveries, k.dead]
        if k.outbox is not None:
            keys.append(k.outbox)  # dead letters' records go through it (cluster)
        reply = await self.store.run(
            script("reclaim-cluster" if self.cluster else "reclaim"),
            keys,
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

        On a cluster the run ends by finishing the queue's outbox (:meth:`replay_outbox`,
        pages of ``scan_count`` fields): records an ack left half-way when its process died,
        and the run's own dead letters' records, whose lists may live in another slot.
        They count in ``replayed``.

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
                break
        if self.cluster:
            finished, _pushed = await self.replay_outbox(page=scan_count)
            total += ReclaimCounts(replayed=finished)
        return total

    # -- the consumer's other calls: retry mover, backlog, key types ---------------------------

    async def move_retries(self, *, limit: int = CHUNK) -> tuple[int, int]:
        """The retry mover on :attr:`retry_set` (docs/protocol.md#retry-mover). Standalone:
        :func:`move_retries`, the set every queue shares (call it once for all queues that
        share it). Cluster: the queue's own set, in its slot (``lua/move-retries-queue-3.lua``:
        a member naming another queue is unroutable there and goes to the dead set);
        call it for every queue. Calls repeat until none is due. Returns ``(moved, dead)``."""
        if not self.cluster:
            return await move_retries(self.store, self.retry_set, limit=limit)
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        k = self.keys
        moved = dead = 0
        more = True
        while more:
            reply = await self.store.run(
                script("move-retries-queue"), [k.retry_set, k.retry_dead, k.pending], [limit]
            )
            m, d, more_flag = (_int(v) for v in reply)
            moved, dead, more = moved + m, dead + d, bool(more_flag)
        return moved, dead

    async def next_retry_due(self) -> float | None:
        """When the earliest member of :attr:`retry_set` is due (its score: Unix seconds,
        server clock), or ``None`` when the set is empty: ``ZRANGE <retry set> 0 0
        WITHSCORES``, one read-only command, so the retry mover runs its script only when
        something is due (docs/protocol.md#retry-mover)."""
        reply = await self.store.command("ZRANGE", self.retry_set, 0, 0, "WITHSCORES")
        if not reply:
            return None
        first = reply[0]  # RESP3: [[member, score]]; RESP2: [member, score]
        return float(first[1] if isinstance(first, list | tuple) else reply[1])

    async def backlog(self) -> int:
        """How many requests are pending: ``ZCARD <q>``."""
        return _int(await self.store.command("ZCARD", self.keys.pending))

    async def queue_stats(self) -> QueueStats:
        """The queue-wide figures in one read-only round trip
        (:func:`~claimkit.protocol.stats.read_queue_stats`, docs/metrics.md#queue-wide-gauges)."""
        return await read_queue_stats(self.store, self.keys)

    async def first_wrong_type(self, expected: Mapping[str, str]) -> tuple[str, str, str] | None:
        """:func:`first_wrong_type` on this queue's store: any keys, not only this queue's."""
        return await first_wrong_type(self.store, expected)


class QueueProtocol(Protocol):
    """What the consumer needs of one queue's protocol layer (:class:`QueueOps` is the real
    one; a test may pass a fake through ``Consumer(ops_factory=...)``). Every Redis call the
    consumer makes goes through one of these, save a ``redis`` gate's own budget read.

    Attributes and methods, as on :class:`QueueOps`: ``queue``, ``routing`` (the queue's
    :class:`~claimkit.protocol.routing.ResultRouting`), ``result_list``, ``retry_set``
    (the retry set :meth:`move_retries` drains: queues with the same one need one mover),
    ``result_list_for``, ``peek``, ``peek_unless_paused`` (the poller's: the peek and the
    pause key in one round trip), ``dead_letter``, ``claim``, ``fetch_payloads``,
    ``renew`` (the claims and the consumer's liveness entry), ``renew_liveness`` (the
    liveness entry alone), ``register``,
    ``forget_self`` and ``expire_owners`` (the consumer registry,
    docs/protocol.md#consumers), ``ack``, ``park``, ``release``, ``reclaim``,
    ``move_retries``, ``next_retry_due`` (the mover's read-only look first), ``backlog``,
    ``queue_stats`` (the queue-wide gauges' one read),
    ``first_wrong_type``. Times are Unix seconds on the Redis server clock; each call
    raises :class:`~claimkit.store.StoreUnavailable` or :class:`~claimkit.store.StoreError`
    as Redis fails.
    """

    @property
    def queue(self) -> str: ...

    @property
    def routing(self) -> ResultRouting: ...

    @property
    def result_list(self) -> str | None: ...

    @property
    def retry_set(self) -> str: ...

    def result_list_for(self, member_result_list: str | None) -> str: ...

    async def peek(self, count: int) -> list[bytes]: ...

    async def peek_unless_paused(self, count: int) -> tuple[PauseMark | None, list[bytes]]: ...

    async def dead_letter(self, invalid: Sequence[Invalid]) -> tuple[int, int]: ...

    async def claim(
        self, candidates: Sequence[tuple[Envelope, str]], lease_ttl: float
    ) -> tuple[float, list[ClaimCode]]: ...

    async def fetch_payloads(self, refs: Sequence[str]) -> list[bytes | None]: ...

    async def renew(
        self, claims: Sequence[tuple[str, str, int]], lease_ttl: float
    ) -> tuple[float, list[RenewCode]]: ...

    async def renew_liveness(self) -> float | None: ...

    async def register(self) -> tuple[float, dict[str, Any] | None] | None: ...

    async def forget_self(self) -> bool: ...

    async def expire_owners(self, *, require_alive: bool = False) -> tuple[float, int | None]: ...

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

    async def next_retry_due(self) -> float | None: ...

    async def backlog(self) -> int: ...

    async def queue_stats(self) -> QueueStats: ...

    async def first_wrong_type(
        self, expected: Mapping[str, str]
    ) -> tuple[str, str, str] | None: ...
