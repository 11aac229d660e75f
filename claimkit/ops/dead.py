"""Dead letters of a queue (``<q>:dead``): list, requeue, purge (``claimkit dead``).

A member lands in ``<q>:dead`` (docs/protocol.md#keys) when it cannot be parsed
(docs/protocol.md#peek) or its lease expired ``max_deliveries`` times without an ack
(docs/protocol.md#reclaim); its score is the server time it died. The member bytes are
kept, so a dead letter can be put back exactly as the producer wrote it, and the cause of
its death found again (:meth:`DeadLetter.cause_of_death`).

Requeue moves only members the consumer would accept (:func:`~claimkit.protocol.models.parse_member`
returns an :class:`~claimkit.protocol.models.Envelope`); any other is refused with the consumer's
own reason and stays dead, since putting it back would only dead-letter it again. The
accepted ones go through ``lua/requeue-dead-3.lua``: back to pending at their queue score
(``data.deadline`` and enqueue order, docs/protocol.md#enqueue-order), delivery count
reset, atomically per batch. Members are found by their ``data.id`` by reading the dead set
in pages of :data:`~claimkit.protocol.ops.CHUNK` (never a keyspace scan).

On a Redis Cluster the dead set is ``{q}:dead``, in the queue's slot
(docs/topology.md#cluster-key-layout); every ``MULTI`` here reads that one key.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from claimkit.ops.inspect import json_float, with_scores
from claimkit.protocol import keys as _keys
from claimkit.protocol.models import Invalid, max_deliveries_message, parse_member, utf8_text
from claimkit.protocol.operator import OperatorScripts, cluster_layout
from claimkit.protocol.ops import CHUNK, RequeueCode
from claimkit.protocol.routing import reserved_destination

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

    from claimkit.protocol.routing import ResultRouting
    from claimkit.store import Store

__all__ = [
    "CAUSE_INVALID",
    "CAUSE_MAX_DELIVERIES",
    "DeadLetter",
    "DeathCause",
    "PurgeReport",
    "Refusal",
    "RequeueReport",
    "dead_key",
    "find_dead",
    "list_dead",
    "purge_dead",
    "requeue_dead",
]

CAUSE_INVALID = "invalid"
"""Dead-lettered when the consumer peeked it: it cannot be served (its record is
``INVALID_REQUEST``)."""

CAUSE_MAX_DELIVERIES = "max_deliveries"
"""Dead-lettered by a reclaimer: its lease expired ``max_deliveries`` times without an ack
(its record is ``MAX_DELIVERIES_EXCEEDED``)."""


@dataclass(frozen=True, slots=True)
class DeathCause:
    """Why a member is in ``<q>:dead``: :data:`CAUSE_INVALID` or
    :data:`CAUSE_MAX_DELIVERIES`, and the reason: the ``error_message`` of the terminal
    record it got when it died (``INVALID_REQUEST`` or ``MAX_DELIVERIES_EXCEEDED``)."""

    cause: str
    reason: str


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One member of ``<q>:dead``.

    Attributes:
        member: the exact member bytes.
        dead_at: when it was dead-lettered, Unix seconds (server clock; the ZSET score;
            ``inf`` when someone wrote that score).
        id: ``data.id`` when it is a non-empty string that UTF-8 can carry, else ``None``.
        deadline: ``data.deadline`` (Unix seconds) when it is a positive number, else
            ``None``. It may be huge or infinite (``1e400`` reads as ``inf``): whether the
            member can be requeued is :attr:`problem`, not this.
    """

    member: bytes
    dead_at: float
    id: str | None
    deadline: float | None

    @classmethod
    def parse(cls, member: bytes, dead_at: float) -> DeadLetter:
        """Read what can be read of ``member``; never raises."""
        rid: str | None = None
        deadline: float | None = None
        try:
            doc = json.loads(member)
        except (ValueError, UnicodeDecodeError, RecursionError):
            doc = None
        data = doc.get("data") if isinstance(doc, dict) else None
        if isinstance(data, dict):
            value = data.get("id")
            rid = utf8_text(value) or None
            dl = data.get("deadline")
            if isinstance(dl, int | float) and not isinstance(dl, bool):
                try:
                    number = float(dl)
                except OverflowError:  # an integer beyond any float
                    number = float("inf")
                if number > 0:
                    deadline = number
        return cls(member, dead_at, rid, deadline)

    @property
    def problem(self) -> str | None:
        """Why requeueing this member would only dead-letter it again, or ``None`` when the
        consumer would accept it: the reason :func:`~claimkit.protocol.models.parse_member` gives
        (its ``INVALID_REQUEST`` message without the leading ``Failed: ``)."""
        parsed = parse_member(self.member)
        if isinstance(parsed, Invalid):
            return parsed.reason.removeprefix("Failed: ")
        return None

    def cause_of_death(
        self,
        *,
        max_deliveries: int | None,
        reserved: frozenset[str] = frozenset(),
        result_list_configured: bool = False,
        cluster: bool = False,
    ) -> DeathCause:
        """Why this member died, found again from its bytes by the consumer's own checks.

        Only two paths lead into ``<q>:dead``, and the member's bytes tell them apart:
        the consumer dead-letters what :func:`~claimkit.protocol.models.parse_member` refuses (or
        a request whose ``internal.result_queue_name`` names one of the ``reserved``
        keys, unless the queue has a ``result_list_configured``), and a reclaimer
        dead-letters a request it could claim, so one the consumer accepts. The member is
        kept byte for byte, so nothing else needs storing. The count of lease expiries is
        not kept (``<q>:deliveries`` drops it at death), but a request dies when it reaches
        ``max_deliveries``: the reason gives that of the consumer's config, which is the
        count unless the config changed since. ``max_deliveries=None`` (no config given:
        the default would be a guess) names no number.
        """
        parsed = parse_member(self.member)
        if isinstance(parsed, Invalid):
            return DeathCause(CAUSE_INVALID, parsed.reason)
        decides = None if result_list_configured else parsed.result_queue_name or None
        misrouted = reserved_destination(decides, reserved, cluster=cluster)
        if misrouted is not None:
            return DeathCause(CAUSE_INVALID, misrouted)
        if max_deliveries is None:  # no config given: no number that may not have happened
            reason = (
                "lease expired max_deliveries times without an ack (give the consumer's "
                "config for the count)"
            )
        elif max_deliveries > 0:
            reason = max_deliveries_message(max_deliveries, max_deliveries)
        else:
            reason = "lease expired too many times without an ack (max_deliveries is 0 now)"
        return DeathCause(CAUSE_MAX_DELIVERIES, reason)

    def to_json(self, cause: DeathCause | None = None) -> dict[str, Any]:
        """This dead letter in ``dead list --json``: strict JSON, the member exact.

        ``member`` is the member text when its bytes are valid UTF-8; otherwise ``member``
        is ``None`` and ``member_base64`` holds the bytes (standard base64). Non-finite
        numbers are the strings ``"inf"``, ``"-inf"``, ``"nan"``. ``cannot_requeue`` is
        :attr:`problem` (``None`` when it can be requeued). With ``cause``, ``cause`` and
        ``reason`` say why it died (:meth:`cause_of_death`), the reason in full.
        """
        doc: dict[str, Any] = {
            "id": self.id,
            "dead_at": json_float(self.dead_at),
            "deadline": json_float(self.deadline),
        }
        if cause is not None:
            doc["cause"] = cause.cause
            doc["reason"] = cause.reason
        try:
            doc["member"] = self.member.decode("utf-8")
        except UnicodeDecodeError:
            doc["member"] = None
            doc["member_base64"] = base64.b64encode(self.member).decode("ascii")
        doc["cannot_requeue"] = self.problem
        return doc

    def label(self) -> str:
        """How a report names it: its id, or ``?`` with when it died when it has none."""
        if self.id is not None:
            return self.id
        return f"? (no readable id, dead_at={self.dead_at!r}, {len(self.member)} bytes)"


@dataclass(frozen=True, slots=True)
class Refusal:
    """A dead letter :func:`requeue_dead` left dead, and why (:attr:`DeadLetter.problem`,
    or the requeue script's own refusal)."""

    letter: DeadLetter
    reason: str


@dataclass
class RequeueReport:
    """What :func:`requeue_dead` did.

    Attributes:
        requeued: ids (``"?"`` when unreadable) moved back to pending.
        refused: dead letters left dead because the consumer would dead-letter them again,
            each with the reason.
        not_found: requested ids with no dead letter.
    """

    requeued: list[str] = field(default_factory=list)
    refused: list[Refusal] = field(default_factory=list)
    not_found: list[str] = field(default_factory=list)


@dataclass
class PurgeReport:
    """What :func:`purge_dead` did.

    Attributes:
        purged: dead letters removed (every generation of a named id counts).
        not_found: requested ids with no dead letter (only when purging by ids).
    """

    purged: int = 0
    not_found: list[str] = field(default_factory=list)


async def list_dead(store: Store, queue: str, *, limit: int = 50) -> tuple[int, list[DeadLetter]]:
    """The dead set's size and up to ``limit`` dead letters, oldest death first (0 = all).

    One ``MULTI``/``EXEC`` of ``ZCARD`` and ``ZRANGE ... WITHSCORES``; nothing is changed.
    """
    dead = dead_key(store, queue)
    total, raw = await store.pipeline(
        [("ZCARD", dead), ("ZRANGE", dead, 0, limit - 1, "WITHSCORES")], transaction=True
    )
    return int(total), _parse_page(raw)


def dead_key(store: Store, queue: str) -> str:
    """The name of ``queue``'s dead set on ``store``: ``<q>:dead``, or ``{q}:dead`` on a
    Redis Cluster (:func:`~claimkit.protocol.operator.cluster_layout`,
    docs/topology.md#cluster-key-layout)."""
    return _keys.QueueKeys.for_queue(queue, cluster=cluster_layout(store)).dead


def _parse_page(raw: Sequence[Any]) -> list[DeadLetter]:
    return [DeadLetter.parse(member, score) for member, score in with_scores(raw)]


async def _pages(store: Store, key: str) -> AsyncIterator[list[DeadLetter]]:
    """The dead set in pages of :data:`CHUNK`, by rank. A concurrent change may shift a
    member across a page boundary; callers tolerate seeing one twice or missing one."""
    start = 0
    while True:
        raw = await store.command("ZRANGE", key, start, start + CHUNK - 1, "WITHSCORES")
        page = _parse_page(raw)
        if not page:
            return
        yield page
        start += len(page)


async def find_dead(store: Store, queue: str, ids: Sequence[str]) -> list[DeadLetter]:
    """Every dead letter of ``queue`` whose ``data.id`` is in ``ids`` (all generations).

    Reads the whole dead set in pages of :data:`CHUNK` members; changes nothing.
    """
    wanted = set(ids)
    found: list[DeadLetter] = []
    async for page in _pages(store, dead_key(store, queue)):
        found += [d for d in page if d.id is not None and d.id in wanted]
    return found


_SCRIPT_REFUSED = "the requeue script found no positive numeric data.deadline"


def _tally(report: RequeueReport, page: Sequence[DeadLetter], codes: Sequence[RequeueCode]) -> None:
    for dead, code in zip(page, codes, strict=True):
        if code == RequeueCode.REQUEUED:
            report.requeued.append(dead.id or "?")
        elif code == RequeueCode.LEFT_DEAD:
            report.refused.append(Refusal(dead, _SCRIPT_REFUSED))


async def _requeue_page(
    store: Store,
    queue: str,
    page: Sequence[DeadLetter],
    report: RequeueReport,
    *,
    keep: bool,
    routing: ResultRouting | None,
) -> int:
    """Requeue the acceptable members of ``page`` (one script call), refuse the others.
    Returns how many of ``page`` are still in the dead set (refused or left by the script)."""
    accepted: list[DeadLetter] = []
    for dead in page:
        problem = dead.problem
        if problem is None:
            accepted.append(dead)
        else:
            report.refused.append(Refusal(dead, problem))
    codes = (
        await OperatorScripts(store, queue).requeue_dead(
            [d.member for d in accepted], keep_marker=keep, routing=routing
        )
        if accepted
        else []
    )
    _tally(report, accepted, codes)
    return len(page) - len(accepted) + sum(1 for code in codes if code != RequeueCode.REQUEUED)


async def requeue_dead(
    store: Store,
    queue: str,
    ids: Sequence[str] | None = None,
    *,
    keep_marker: bool = False,
    routing: ResultRouting | None = None,
) -> RequeueReport:
    """Move dead letters the consumer would accept back to pending at their queue score
    (``data.deadline`` and enqueue order, docs/protocol.md#enqueue-order) and reset their
    delivery count (``HDEL <q>:deliveries <id>``), by exact bytes.

    A member is requeued only when :func:`~claimkit.protocol.models.parse_member` accepts it (the
    consumer's own check: JSON, ``request_kind``, ``data.id``, an integer ``data.deadline``
    in range...). Any other is refused, stays dead and is listed in ``refused`` with the
    reason: requeueing it would only dead-letter it again (and at a score of ``inf`` for a
    deadline like ``1e400``).

    Unless ``keep_marker``, each requeued request's dedup marker (``result-terminal:<id>``)
    is deleted when it belongs to that member's generation, so the rerun's terminal record
    reaches the result list. The request's earlier record (``MAX_DELIVERIES_EXCEEDED`` or
    ``INVALID_REQUEST``) is then followed by a second one: requeueing is an operator's
    deliberate exception to "one record per generation" (docs/protocol.md#ack). With
    ``keep_marker`` the guarantee holds and the rerun's record is suppressed as a duplicate.
    On a Redis Cluster a marker is kept per result list, in the list's slot
    (docs/topology.md#cluster-key-layout): those of the list ``routing`` sends the
    request's record to and of its fallback list are deleted, just before the batch moves.

    Args:
        store: an open store.
        queue: ``<q>``.
        ids: the request ids to requeue (every generation found); ``None`` = all.
        keep_marker: keep the dedup markers.
        routing: the queue's result routing (the lists whose markers are deleted on a
            Redis Cluster); ``None``: the default global list alone.

    Returns:
        A :class:`RequeueReport`.

    Cancellation: each batch is one atomic script; a cancelled call leaves earlier batches
    requeued and later ones dead. Running it again finishes the job.
    """
    report = RequeueReport()
    if ids is not None:
        found = await find_dead(store, queue, ids)
        seen = {d.id for d in found}
        report.not_found = [rid for rid in dict.fromkeys(ids) if rid not in seen]
        for start in range(0, len(found), CHUNK):
            page = found[start : start + CHUNK]
            await _requeue_page(store, queue, page, report, keep=keep_marker, routing=routing)
        return report
    # All: members that stay dead keep their rank at the front, so the next page starts
    # after them; requeued members leave the set.
    dead = dead_key(store, queue)
    offset = 0
    while True:
        raw = await store.command("ZRANGE", dead, offset, offset + CHUNK - 1, "WITHSCORES")
        page = _parse_page(raw)
        if not page:
            return report
        offset += await _requeue_page(store, queue, page, report, keep=keep_marker, routing=routing)


async def purge_dead(
    store: Store,
    queue: str,
    *,
    ids: Sequence[str] | None = None,
    older_than: float | None = None,
) -> PurgeReport:
    """Delete dead letters for good. Returns a :class:`PurgeReport`: how many were removed
    and, when purging by ``ids``, the ids that had no dead letter.

    Exactly one selector: ``ids`` (every dead letter with one of these ``data.id``),
    ``older_than`` (seconds: dead letters that died at least that long ago by the server
    clock), or neither for all of them (``ZCARD`` and ``DEL`` in one ``MULTI``/``EXEC``,
    so the count is exact).

    Raises:
        ValueError: both ``ids`` and ``older_than`` given, or ``older_than`` negative.
    """
    dead = dead_key(store, queue)
    if ids is not None and older_than is not None:
        raise ValueError("give ids or older_than, not both")
    if ids is not None:
        found = await find_dead(store, queue, ids)
        seen = {d.id for d in found}
        report = PurgeReport(not_found=[rid for rid in dict.fromkeys(ids) if rid not in seen])
        for start in range(0, len(found), CHUNK):
            chunk = [d.member for d in found[start : start + CHUNK]]
            report.purged += int(await store.command("ZREM", dead, *chunk))
        return report
    if older_than is not None:
        if older_than < 0:
            raise ValueError("older_than must be non-negative seconds")
        secs, micros = await store.command("TIME")
        cutoff = int(secs) + int(micros) / 1_000_000 - older_than
        removed = await store.command("ZREMRANGEBYSCORE", dead, "-inf", repr(cutoff))
        return PurgeReport(purged=int(removed))
    count, _ = await store.pipeline([("ZCARD", dead), ("DEL", dead)], transaction=True)
    return PurgeReport(purged=int(count))
