"""Dead letters of a queue (``<q>:dead``, SPEC §1): list, requeue, purge (``claimkit dead``).

A member lands in ``<q>:dead`` when it cannot be parsed (SPEC §3.1) or was redelivered
``max_deliveries`` times (SPEC §3.7); its score is the server time it died. The member
bytes are kept, so a dead letter can be put back exactly as the producer wrote it.

Requeue runs ``lua/requeue-dead-3.lua``: back to pending at ``data.deadline``, delivery
count reset, atomically per batch. Members are found by their ``data.id`` by reading the
dead set in pages of :data:`~claimkit._protocol.CHUNK` (never a keyspace scan).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import _keys
from ._inspect import with_scores
from ._protocol import CHUNK
from ._scripts import script

if TYPE_CHECKING:
    from ._store import Arg, Store

__all__ = [
    "DeadLetter",
    "RequeueReport",
    "find_dead",
    "list_dead",
    "purge_dead",
    "requeue_dead",
]


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One member of ``<q>:dead``.

    Attributes:
        member: the exact member bytes.
        dead_at: when it was dead-lettered, Unix seconds (server clock; the ZSET score).
        id: ``data.id`` when readable, else ``None``.
        deadline: ``data.deadline`` (Unix seconds) when it is a positive number, else
            ``None``: such a member cannot be requeued.
    """

    member: bytes
    dead_at: float
    id: str | None
    deadline: float | None

    @classmethod
    def parse(cls, member: bytes, dead_at: float) -> DeadLetter:
        rid: str | None = None
        deadline: float | None = None
        try:
            doc = json.loads(member)
        except (ValueError, UnicodeDecodeError):
            doc = None
        data = doc.get("data") if isinstance(doc, dict) else None
        if isinstance(data, dict):
            value = data.get("id")
            rid = value if isinstance(value, str) and value else None
            dl = data.get("deadline")
            if isinstance(dl, int | float) and not isinstance(dl, bool) and dl > 0:
                deadline = float(dl)
        return cls(member, dead_at, rid, deadline)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "dead_at": self.dead_at,
            "deadline": self.deadline,
            "member": self.member.decode("utf-8", errors="replace"),
        }


@dataclass
class RequeueReport:
    """What :func:`requeue_dead` did.

    Attributes:
        requeued: ids (``"?"`` when unreadable) moved back to pending.
        stuck: dead letters left dead because they have no readable ``data.deadline``.
        not_found: requested ids with no dead letter.
    """

    requeued: list[str] = field(default_factory=list)
    stuck: list[DeadLetter] = field(default_factory=list)
    not_found: list[str] = field(default_factory=list)


async def list_dead(store: Store, queue: str, *, limit: int = 50) -> tuple[int, list[DeadLetter]]:
    """The dead set's size and up to ``limit`` dead letters, oldest death first (0 = all).

    One ``MULTI``/``EXEC`` of ``ZCARD`` and ``ZRANGE ... WITHSCORES``; nothing is changed.
    """
    dead = _keys.QueueKeys.for_queue(queue).dead
    total, raw = await store.pipeline(
        [("ZCARD", dead), ("ZRANGE", dead, 0, limit - 1, "WITHSCORES")], transaction=True
    )
    return int(total), _parse_page(raw)


def _parse_page(raw: Sequence[Any]) -> list[DeadLetter]:
    return [DeadLetter.parse(member, score) for member, score in with_scores(raw)]


async def _pages(store: Store, dead_key: str) -> AsyncIterator[list[DeadLetter]]:
    """The dead set in pages of :data:`CHUNK`, by rank. A concurrent change may shift a
    member across a page boundary; callers tolerate seeing one twice or missing one."""
    start = 0
    while True:
        raw = await store.command("ZRANGE", dead_key, start, start + CHUNK - 1, "WITHSCORES")
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
    async for page in _pages(store, _keys.QueueKeys.for_queue(queue).dead):
        found += [d for d in page if d.id is not None and d.id in wanted]
    return found


async def _requeue(
    store: Store, queue: str, members: Sequence[bytes], *, keep_marker: bool
) -> list[int]:
    k = _keys.QueueKeys.for_queue(queue)
    args: list[Arg] = [_keys.RESULT_TERMINAL_PREFIX, "1" if keep_marker else "0", *members]
    reply = await store.run(script("requeue-dead"), [k.dead, k.pending, k.deliveries], args)
    return [int(code) for code in reply]


def _tally(report: RequeueReport, page: Sequence[DeadLetter], codes: Sequence[int]) -> None:
    for dead, code in zip(page, codes, strict=True):
        if code == 1:
            report.requeued.append(dead.id or "?")
        elif code == -1:
            report.stuck.append(dead)


async def requeue_dead(
    store: Store, queue: str, ids: Sequence[str] | None = None, *, keep_marker: bool = False
) -> RequeueReport:
    """Move dead letters back to pending at score ``data.deadline`` and reset their
    delivery count (``HDEL <q>:deliveries <id>``), by exact bytes.

    Unless ``keep_marker``, each requeued request's dedup marker (``result-terminal:<id>``)
    is deleted when it belongs to that member's generation, so the rerun's terminal record
    reaches the result list. The request's earlier record (``MAX_DELIVERIES_EXCEEDED`` or
    ``INVALID_REQUEST``) is then followed by a second one: requeueing is an operator's
    deliberate exception to "one record per generation" (SPEC §3.4). With ``keep_marker``
    the guarantee holds and the rerun's record is suppressed as a duplicate.

    Args:
        store: an open store.
        queue: ``<q>``.
        ids: the request ids to requeue (every generation found); ``None`` = all.
        keep_marker: keep the dedup markers.

    Returns:
        A :class:`RequeueReport`. A member without a readable ``data.deadline`` stays dead
        and is listed in ``stuck``.

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
            _tally(
                report,
                page,
                await _requeue(store, queue, [d.member for d in page], keep_marker=keep_marker),
            )
        return report
    # All: members that stay dead keep their rank at the front, so the next page starts
    # after them; requeued members leave the set.
    dead_key = _keys.QueueKeys.for_queue(queue).dead
    offset = 0
    while True:
        raw = await store.command("ZRANGE", dead_key, offset, offset + CHUNK - 1, "WITHSCORES")
        page = _parse_page(raw)
        if not page:
            return report
        codes = await _requeue(store, queue, [d.member for d in page], keep_marker=keep_marker)
        _tally(report, page, codes)
        offset += sum(1 for code in codes if code != 1)


async def purge_dead(
    store: Store,
    queue: str,
    *,
    ids: Sequence[str] | None = None,
    older_than: float | None = None,
) -> int:
    """Delete dead letters for good. Returns how many were removed.

    Exactly one selector: ``ids`` (every dead letter with one of these ``data.id``),
    ``older_than`` (seconds: dead letters that died at least that long ago by the server
    clock), or neither for all of them (``ZCARD`` and ``DEL`` in one ``MULTI``/``EXEC``,
    so the count is exact).

    Raises:
        ValueError: both ``ids`` and ``older_than`` given, or ``older_than`` negative.
    """
    dead_key = _keys.QueueKeys.for_queue(queue).dead
    if ids is not None and older_than is not None:
        raise ValueError("give ids or older_than, not both")
    if ids is not None:
        found = await find_dead(store, queue, ids)
        removed = 0
        for start in range(0, len(found), CHUNK):
            chunk = [d.member for d in found[start : start + CHUNK]]
            removed += int(await store.command("ZREM", dead_key, *chunk))
        return removed
    if older_than is not None:
        if older_than < 0:
            raise ValueError("older_than must be non-negative seconds")
        secs, micros = await store.command("TIME")
        cutoff = int(secs) + int(micros) / 1_000_000 - older_than
        return int(await store.command("ZREMRANGEBYSCORE", dead_key, "-inf", repr(cutoff)))
    count, _ = await store.pipeline([("ZCARD", dead_key), ("DEL", dead_key)], transaction=True)
    return int(count)
