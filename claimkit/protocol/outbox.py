"""The outbox of a queue in a Redis Cluster: records on their way to a result list of
another slot (docs/topology.md#acks-across-slots).

An ack whose list lives in another slot than its queue takes three steps, each safe to
repeat: a fenced script in the queue's slot moves the claim into ``{q}:outbox`` with its
record (``lua/ack-outbox-6.lua``); :func:`push_entries` pushes the record in the list's
slot under the list's dedup markers (``lua/push-result-3.lua``, which suppresses a record
already there); :func:`drop_entries` deletes the outbox field. :func:`replay` finishes the
entries a crashed caller left behind, one bounded ``HSCAN`` page at a time: any reclaimer
(and ``claimkit reclaim --once``) runs it. Reclaim's ``MAX_DELIVERIES_EXCEEDED`` records and
the peek's ``INVALID_REQUEST`` records take the same path.

Entries are written by the scripts as cjson ``{"list", "request_token", "record", "id"}``
under ``<id>\\0<token>`` (:func:`claimkit.protocol.keys.outbox_field`).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from claimkit.protocol import keys as _keys
from claimkit.protocol.replies import PushCode
from claimkit.protocol.store_calls import CHUNK, as_int, chunks
from claimkit.store.scripts import script

if TYPE_CHECKING:
    from collections.abc import Sequence

    from claimkit.store import Arg, ScriptCall, Store

__all__ = ["OutboxEntry", "drop_entries", "push_entries", "reaim", "replay"]

_TEXT = "surrogateescape"  # entry text round-trips byte for byte, even bytes not UTF-8


@dataclass(frozen=True, slots=True)
class OutboxEntry:
    """One record in a queue's outbox.

    Attributes:
        field: the outbox field ``<id>\\0<token>`` (bytes as Redis holds them).
        list: the destination list.
        request_token: the generation's ``internal.request_token``, or ``""``.
        record: the record's JSON bytes.
        id: the request id.
    """

    field: bytes
    list: str
    request_token: str
    record: bytes
    id: str

    def to_json(self) -> bytes:
        """The entry as the outbox holds it (``{"list", "request_token", "record", "id"}``)."""
        doc = {
            "list": self.list,
            "request_token": self.request_token,
            "record": self.record.decode(errors=_TEXT),
            "id": self.id,
        }
        return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode(errors=_TEXT)

    @classmethod
    def from_json(cls, field: bytes, raw: bytes) -> OutboxEntry | None:
        """The entry ``raw`` found under ``field``, or ``None`` when it cannot be read (not
        cjson of that shape; or a list name that is not UTF-8, which no key argument can
        carry). An unreadable entry is left where it is, never deleted."""
        try:
            doc = json.loads(raw.decode(errors=_TEXT))
        except (ValueError, RecursionError):
            return None
        if not isinstance(doc, dict):
            return None
        name, request_token, record, rid = (
            doc.get(key) for key in ("list", "request_token", "record", "id")
        )
        if not (
            isinstance(name, str)
            and isinstance(request_token, str)
            and isinstance(record, str)
            and isinstance(rid, str)
        ):
            return None
        try:
            name.encode()
        except UnicodeEncodeError:
            return None
        return cls(field, name, request_token, record.encode(errors=_TEXT), rid)


def _arg(text: str) -> bytes:
    return text.encode(errors=_TEXT)


async def reaim(
    store: Store, outbox: str, entries: Sequence[OutboxEntry], target: str
) -> list[OutboxEntry]:
    """Aim ``entries`` at list ``target`` in the outbox (``lua/outbox-aim-1.lua``); returns
    those re-aimed (an entry already gone was finished by someone else: left alone)."""
    out: list[OutboxEntry] = []
    for chunk in chunks(entries):
        moved = [replace(e, list=target) for e in chunk]
        args: list[Arg] = []
        for e in moved:
            args += [e.field, e.to_json()]
        reply = await store.run(script("outbox-aim"), [outbox], args)
        out += [e for e, code in zip(moved, reply, strict=True) if as_int(code) == 1]
    return out


async def push_entries(
    store: Store,
    outbox: str,
    entries: Sequence[OutboxEntry],
    *,
    fallback: str,
    dedup_ttl: int,
) -> dict[bytes, bool]:
    """Step 2 of an ack across slots: push each entry's record onto its list under that
    list's dedup markers, one ``lua/push-result-3.lua`` call per list and chunk, all in one
    pipelined round trip. A list that cannot take records (another type of key) is
    reported by the script; its entries are re-aimed at ``fallback`` (:func:`reaim`) and
    pushed there, so a crash in between replays them to ``fallback``.

    Returns ``field -> pushed`` for every entry pushed or suppressed as a duplicate (an
    entry re-aimed after someone else finished it is left out).

    Raises:
        StoreError: ``WRONGTYPE`` when ``fallback`` itself holds another type (nothing
            was written for its entries; they stay in the outbox). StoreUnavailable:
            as the store does; any call may have run (each is safe to run again).
    """
    done: dict[bytes, bool] = {}
    todo = list(entries)
    while todo:
        groups: dict[str, list[OutboxEntry]] = defaultdict(list)
        for e in todo:
            groups[e.list].append(e)
        calls: list[ScriptCall] = []
        sent: list[list[OutboxEntry]] = []
        for name, group in groups.items():
            r = _keys.ResultKeys.for_list(name)
            for chunk in chunks(group):
                args: list[Arg] = [dedup_ttl, "1" if name == fallback else "0"]
                for e in chunk:
                    args += [_arg(e.id), _arg(e.request_token), e.record]
                calls.append(([r.results, r.terminal, r.expiry], args))
                sent.append(list(chunk))
        replies = await store.run_many(script("push-result"), calls)
        unusable: list[OutboxEntry] = []
        for chunk, reply in zip(sent, replies, strict=True):
            for e, code in zip(chunk, reply, strict=True):
                if as_int(code) == PushCode.UNUSABLE:
                    unusable.append(e)
                else:
                    done[e.field] = as_int(code) == PushCode.PUSHED
        todo = await reaim(store, outbox, unusable, fallback) if unusable else []
    return done


async def drop_entries(store: Store, outbox: str, fields: Sequence[bytes]) -> None:
    """Step 3 of an ack across slots: delete the finished entries' fields (``HDEL``)."""
    for chunk in chunks(fields):
        if chunk:
            await store.command("HDEL", outbox, *chunk)


def _flat_pairs(reply: Any) -> list[tuple[bytes, bytes]]:
    if isinstance(reply, dict):
        return list(reply.items())
    return list(zip(reply[0::2], reply[1::2], strict=True))


async def replay(
    store: Store, outbox: str, *, fallback: str, dedup_ttl: int, page: int = CHUNK
) -> tuple[int, int]:
    """Finish every entry of ``outbox`` (docs/topology.md#acks-across-slots): one ``HSCAN``
    cycle, ``COUNT page`` per round trip; each page's entries are pushed
    (:func:`push_entries`: a record already there is suppressed, so an entry whose push had
    happened before a crash pushes nothing) and their fields deleted. An entry written
    while the cycle runs may wait for the next one.

    Returns ``(finished, pushed)``: entries finished, of which records pushed (the others
    were duplicates). Unreadable entries are left in the outbox and not counted.

    Raises:
        ValueError: ``page`` is below 1.
        StoreError, StoreUnavailable: as :func:`push_entries`; pages done stay done.
    """
    if page < 1:
        raise ValueError(f"page must be at least 1, got {page}")
    cursor: bytes = b"0"
    finished = pushed = 0
    while True:
        reply = await store.command("HSCAN", outbox, cursor, "COUNT", page)
        cursor = reply[0] if isinstance(reply[0], bytes) else str(reply[0]).encode()
        entries = [
            e for f, v in _flat_pairs(reply[1]) if (e := OutboxEntry.from_json(f, v)) is not None
        ]
        if entries:
            done = await push_entries(
                store, outbox, entries, fallback=fallback, dedup_ttl=dedup_ttl
            )
            await drop_entries(store, outbox, list(done))
            finished += len(done)
            pushed += sum(done.values())
        if cursor == b"0":
            return finished, pushed
