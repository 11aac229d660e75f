"""Read-only views of a queue for operators (``claimkit inspect``, docs/cli.md).

:func:`snapshot` reads one queue's keys (docs/protocol.md#keys) with the read-only
``inspect`` script, so its counts and claim rows describe one instant of the Redis server
clock, then the retry set and the result lists with one pipeline (and on a Redis Cluster the
queue's outbox, docs/topology.md#cluster-key-layout). Nothing is written and nothing scans
the keyspace (no ``KEYS``/``SCAN``): every key read is named by the queue.

:func:`check_key_types` turns a key of the wrong Redis type (a ``--queue`` that names a
string, say) into one :class:`WrongKeyType` line before any script meets it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from claimkit.config import WrongKeyType
from claimkit.ops.consumers import consumers_view
from claimkit.protocol import keys as _keys
from claimkit.protocol.models import retry_queue_name
from claimkit.protocol.operator import OperatorScripts, cluster_layout
from claimkit.protocol.ops import first_wrong_type, token_consumer, token_time
from claimkit.protocol.pause import PauseMark, parse_pause

if TYPE_CHECKING:
    from collections.abc import Mapping, MutableMapping, Sequence

    from claimkit.ops.consumers import ConsumersView
    from claimkit.store import Store

__all__ = [
    "CLAIM_SCAN_MAX",
    "RETRY_SCAN_MAX",
    "ClaimRow",
    "QueueSnapshot",
    "WrongKeyType",
    "check_key_types",
    "cluster_layout",
    "json_float",
    "json_safe",
    "queue_key_types",
    "snapshot",
    "with_scores",
]

RETRY_SCAN_MAX = 1000
"""At most this many retry-set members are read to count the ones routed to a queue. A
larger retry set is counted as a lower bound (``retrying_exact`` False)."""

CLAIM_SCAN_MAX = 100_000
"""At most this many fields of each claim hash are read to count claims without a lease
entry (a few ms of Redis time per 10,000). Beyond it ``claimed`` and ``orphans`` are lower
bounds (``claims_exact`` False)."""


def queue_key_types(
    queue: str, *, cluster: bool = False, retry_set: str = _keys.DEFAULT_RETRY_SET
) -> dict[str, str]:
    """The Redis type of every per-queue key of ``queue`` (docs/protocol.md#keys), by key
    name: the nine standalone keys, or with ``cluster`` the cluster layout's names, the
    queue's outbox and its own retry sets (``{q}:<retry_set>``) included
    (:meth:`QueueKeys.types <claimkit.protocol.keys.QueueKeys.types>`,
    docs/topology.md#cluster-key-layout)."""
    return _keys.QueueKeys.for_queue(queue, cluster=cluster, retry_set=retry_set).types()


async def check_key_types(store: Store, expected: Mapping[str, str]) -> None:
    """Check that every existing key of ``expected`` (key -> ``TYPE`` name) has that type.

    Missing keys are fine (an empty queue). One pipelined round trip of ``TYPE`` calls.

    Raises:
        WrongKeyType: the first key holding another type, as one line.
        StoreUnavailable, StoreError: from the store.
    """
    wrong = await first_wrong_type(store, expected)
    if wrong is not None:
        name, found, want = wrong
        raise WrongKeyType(
            f"key {name!r} holds {_keys.type_name(found)}, not "
            f"{_keys.type_name(want)}: is the queue or list name right?"
        )


_STAMP_AHEAD_MAX = 300.0
"""Seconds a token's claim time may lead the server clock (a consumer's clock estimate is
off by far less); a stamp further ahead is not trusted."""


@dataclass(frozen=True, slots=True)
class ClaimRow:
    """One claim of ``<q>:claims-idx`` (docs/protocol.md#keys) as the snapshot saw it.

    Attributes:
        id: the request id (the index member).
        owner: the ownership token, or ``None`` for a ghost index entry with no owner.
        lease_expiry: Unix seconds, Redis server clock.
        lease_left: ``lease_expiry - server_time``, seconds; ``<= 0`` means expired.
        score: the original pending score (``<id>:score``), Unix seconds, or ``None``.
        deliveries: ``<q>:deliveries[id]``, 0 when absent.
        has_payload: whether ``<q>:claimed[id]`` holds the member bytes (a claim without
            them is a ghost, removed by the next reclaim run, docs/protocol.md#reclaim).
        held_seconds: how long this claim has been held, seconds, or ``None`` when not
            known. Exact when the owner token is claimkit's (a UUIDv7 stamped with the
            claim time, :func:`claimkit.protocol.ops.token_time`); otherwise how long the
            caller's ``first_seen`` tracker (``--watch``) has seen the same id and token
            held, a lower bound.
        held_exact: ``held_seconds`` comes from the token's claim time, not a lower bound.
        consumer: the consumer the owner token names (docs/protocol.md#ownership-tokens),
            ``None`` when it names none (a token from before consumer ids, another
            program's, or no owner).
    """

    id: str
    owner: str | None
    lease_expiry: float
    lease_left: float
    score: float | None
    deliveries: int
    has_payload: bool
    held_seconds: float | None = None
    held_exact: bool = False
    consumer: str | None = None

    @property
    def expired(self) -> bool:
        """The lease has lapsed by the server clock; any reclaimer may redeliver it."""
        return self.lease_left <= 0

    @property
    def ghost(self) -> bool:
        """An index entry without an owner or a payload (a ghost, docs/protocol.md#reclaim)."""
        return self.owner is None or not self.has_payload

    def to_json(self) -> dict[str, Any]:
        """This row in ``inspect --json`` (non-finite numbers as strings, :func:`json_float`)."""
        return {
            "id": self.id,
            "owner": self.owner,
            "consumer": self.consumer,
            "lease_expiry": json_float(self.lease_expiry),
            "lease_left_seconds": json_float(round(self.lease_left, 6)),
            "expired": self.expired,
            "score": json_float(self.score),
            "deliveries": self.deliveries,
            "ghost": self.ghost,
            "held_seconds": None if self.held_seconds is None else round(self.held_seconds, 6),
            "held_exact": self.held_exact,
        }


@dataclass(frozen=True, slots=True)
class QueueSnapshot:
    """What :func:`snapshot` read. Times are Unix seconds on the Redis server clock.

    Attributes:
        queue: ``<q>``.
        server_time: the instant the queue's keys were read.
        pending: ``ZCARD <q>``.
        oldest_pending_deadline: the deadline of the next request to be served: the lowest
            pending score's whole seconds (its enqueue-order fraction dropped,
            docs/protocol.md#enqueue-order), Unix seconds; ``None`` when nothing is pending.
        claimed: the claims held: ``HLEN <q>:claim-owners``, plus payloads in
            ``<q>:claimed`` that have neither an owner nor a lease entry.
        expired: lease entries whose expiry is ``<= server_time``.
        dead: ``ZCARD <q>:dead``.
        redelivered: requests with a delivery count (``HLEN <q>:deliveries``).
        retry_set: the retry ZSET's name: the shared ``retry_queue_name``, on a Redis
            Cluster the queue's own ``{q}:<retry_queue_name>``.
        retry_total: ``ZCARD`` of the retry set (every queue's members).
        retrying: members of the retry set routed to this queue.
        retrying_exact: ``False`` when the retry set was larger than
            :data:`RETRY_SCAN_MAX`; ``retrying`` is then a lower bound.
        results: ``LLEN`` of each result list this queue writes to, by name.
        claims: up to ``limit`` claim rows, earliest lease expiry first.
        limit: the row bound asked for (0 = all).
        leases: ``ZCARD <q>:claims-idx`` (lease entries, ghosts included): the rows there
            are to show.
        orphans: claims without a lease entry (docs/protocol.md, "Claims without a lease
            entry"); the reclaimer handles them as expired.
        claims_exact: ``False`` when a claim hash was larger than :data:`CLAIM_SCAN_MAX`
            fields; ``claimed`` and ``orphans`` are then lower bounds.
        outbox: on a Redis Cluster, the records on their way to a result list of another
            slot (``HLEN {q}:outbox``, docs/topology.md#cluster-key-layout): acked claims
            whose record is not pushed yet; any reclaimer pushes them. ``None`` standalone,
            which has no outbox.
        paused: the queue's pause mark (``<q>:paused``, docs/protocol.md#pause), read
            with the retry set; ``None`` when it is not paused.
        consumers: the per-consumer summary (docs/operations.md#consumers): who holds the
            claims, alive or dead, read by the registry script; ``None`` when not read.
    """

    queue: str
    server_time: float
    pending: int
    oldest_pending_deadline: float | None
    claimed: int
    expired: int
    dead: int
    redelivered: int
    retry_set: str
    retry_total: int
    retrying: int
    retrying_exact: bool
    results: dict[str, int]
    claims: tuple[ClaimRow, ...]
    limit: int
    leases: int = 0
    orphans: int = 0
    claims_exact: bool = True
    outbox: int | None = None
    paused: PauseMark | None = None
    consumers: ConsumersView | None = None

    @property
    def result_count(self) -> int:
        """Records waiting in this queue's result lists."""
        return sum(self.results.values())

    def to_json(self, *, url: str | None = None) -> dict[str, Any]:
        """The ``inspect --json`` document. ``url`` must already be redacted.

        Strict JSON: a non-finite time or score (a pending score of ``inf``, say) is the
        string ``"inf"``, ``"-inf"`` or ``"nan"`` (:func:`json_float`). ``counts`` has an
        ``outbox`` entry on a Redis Cluster only (:attr:`outbox`).
        """
        doc: dict[str, Any] = {"queue": self.queue}
        if url is not None:
            doc["redis_url"] = url
        counts: dict[str, int] = {
            "pending": self.pending,
            "claimed": self.claimed,
            "orphans": self.orphans,
            "expired": self.expired,
            "retrying": self.retrying,
            "dead": self.dead,
        }
        if self.outbox is not None:
            counts["outbox"] = self.outbox
        counts["results"] = self.result_count
        counts["redelivered"] = self.redelivered
        doc.update(
            {
                "server_time": self.server_time,
                "paused": None if self.paused is None else self.paused.to_json(),
                "counts": counts,
                "oldest_pending_deadline": json_float(self.oldest_pending_deadline),
                "retry_set": {
                    "name": self.retry_set,
                    "total": self.retry_total,
                    "for_queue": self.retrying,
                    "exact": self.retrying_exact,
                },
                "result_lists": dict(self.results),
                "limit": self.limit,
                "claims_exact": self.claims_exact,
                "claims_truncated": len(self.claims) < self.leases,
                "claims": [row.to_json() for row in self.claims],
            }
        )
        if self.consumers is not None:
            doc["consumers"] = [
                row.to_json(self.consumers.server_time) for row in self.consumers.rows
            ]
        return doc


def json_float(value: float | None) -> float | str | None:
    """``value`` as strict JSON allows it: a finite float as is, ``None`` as is, and a
    non-finite one as the string ``"inf"``, ``"-inf"`` or ``"nan"`` (Redis's own spelling
    of an infinite score). JSON has no Infinity or NaN; ``json.dumps`` would write them
    anyway, and strict parsers (``jq``, Go, JavaScript) then reject the whole document."""
    if value is None or math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def json_safe(doc: Any) -> Any:
    """``doc`` (dicts, lists, tuples, scalars) with every float passed through
    :func:`json_float`, so ``json.dumps(..., allow_nan=False)`` cannot fail on it."""
    if isinstance(doc, float):
        return json_float(doc)
    if isinstance(doc, dict):
        return {key: json_safe(value) for key, value in doc.items()}
    if isinstance(doc, list | tuple):
        return [json_safe(value) for value in doc]
    return doc


def with_scores(reply: Sequence[Any]) -> list[tuple[bytes, float]]:
    """``(member, score)`` pairs of a ``... WITHSCORES`` reply, in either shape: RESP3's
    list of pairs (coredis) or RESP2's flat ``member, score, ...`` list."""
    if reply and isinstance(reply[0], list | tuple):
        return [(member, float(score)) for member, score in reply]
    return [(reply[i], float(reply[i + 1])) for i in range(0, len(reply), 2)]


async def snapshot(
    store: Store,
    queue: str,
    *,
    result_lists: Sequence[str] = (_keys.DEFAULT_RESULT_LIST,),
    retry_set: str = _keys.DEFAULT_RETRY_SET,
    limit: int = 50,
    first_seen: MutableMapping[tuple[str, str], float] | None = None,
) -> QueueSnapshot:
    """Read one queue's state without changing it (``claimkit inspect``, docs/cli.md).

    Three round trips: the read-only ``inspect`` script for the queue's own keys
    (docs/protocol.md#keys; one consistent instant), then one pipeline for the retry set,
    the result lists and the pause key (a ``MULTI``; on a Redis Cluster, whose keys here
    span slots, a plain pipeline that also reads the queue's outbox,
    docs/topology.md#cluster-key-layout), then the read-only consumer registry script
    (:func:`claimkit.ops.consumers.consumers_view`).

    Args:
        store: an open store; its mode picks the key layout (:func:`cluster_layout`).
        queue: ``<q>``.
        result_lists: the lists whose ``LLEN`` is reported as ``results``.
        retry_set: ``retry_queue_name``: the retry ZSET, on a Redis Cluster the name the
            queue's own ``{q}:<retry_set>`` is made of.
        limit: at most this many claim rows, earliest lease expiry first; 0 = all.
        first_seen: a tracker kept across calls (``--watch``): ``(id, token)`` -> the
            server time the claim was first seen. It is updated here (claims gone are
            forgotten) and gives a lower-bound ``held_seconds`` to rows whose token carries
            no claim time. ``None``: not tracked.

    Returns:
        A :class:`QueueSnapshot`.

    Raises:
        ValueError: ``limit`` is negative.
        StoreUnavailable, StoreError: from the store.

    Cancellation: nothing is written, so a cancelled call leaves no trace.
    """
    if limit < 0:
        raise ValueError("limit must be 0 (all) or more")
    scripts = OperatorScripts(store, queue)
    found = await scripts.inspect(limit, CLAIM_SCAN_MAX)
    now = found.server_now
    rows: list[ClaimRow] = []
    for claim in found.rows:
        claimed_at = None if claim.owner is None else token_time(claim.owner)
        if claimed_at is not None and claimed_at > now + _STAMP_AHEAD_MAX:
            claimed_at = None  # not a claim time: a foreign token that matched by chance
        rows.append(
            ClaimRow(
                id=claim.id,
                owner=claim.owner,
                lease_expiry=claim.lease_expiry,
                lease_left=claim.lease_expiry - now,
                score=claim.score,
                deliveries=claim.deliveries,
                has_payload=claim.has_payload,
                # The stamp is the consumer's estimate of the server clock: never negative.
                held_seconds=None if claimed_at is None else max(0.0, now - claimed_at),
                held_exact=claimed_at is not None,
                consumer=None if claim.owner is None else token_consumer(claim.owner),
            )
        )
    if first_seen is not None:
        rows = _track_held(rows, now, first_seen)

    keys = _keys.QueueKeys.for_queue(queue, cluster=scripts.cluster, retry_set=retry_set)
    lists = list(dict.fromkeys(result_lists))
    calls: list[tuple[Any, ...]] = [
        ("ZCARD", keys.retry_set),
        ("ZRANGE", keys.retry_set, 0, RETRY_SCAN_MAX - 1),
        *(("LLEN", name) for name in lists),
        ("GET", keys.paused),
    ]
    if keys.outbox is not None:
        calls.append(("HLEN", keys.outbox))
    # A MULTI must not span slots: on a cluster the lists are anywhere (CROSSSLOT).
    extra = await store.pipeline(calls, transaction=not scripts.cluster)
    retry_total = int(extra[0])
    retrying = sum(1 for member in extra[1] if retry_queue_name(member) == queue)
    list_lengths = extra[2 : 2 + len(lists)]
    paused = parse_pause(extra[2 + len(lists)])
    consumers = await consumers_view(store, queue)
    return QueueSnapshot(
        queue=queue,
        server_time=now,
        pending=found.pending,
        oldest_pending_deadline=_whole_seconds(found.oldest_pending_score),
        claimed=found.claims,
        expired=found.expired,
        dead=found.dead,
        redelivered=found.redelivered,
        retry_set=keys.retry_set,
        retry_total=retry_total,
        retrying=retrying,
        retrying_exact=retry_total <= RETRY_SCAN_MAX,
        results={name: int(n) for name, n in zip(lists, list_lengths, strict=True)},
        claims=tuple(rows),
        limit=limit,
        leases=found.leases,
        orphans=found.orphans,
        claims_exact=found.claims_exact,
        outbox=None if keys.outbox is None else int(extra[-1]),
        paused=paused,
        consumers=consumers,
    )


def _track_held(
    rows: list[ClaimRow], now: float, first_seen: MutableMapping[tuple[str, str], float]
) -> list[ClaimRow]:
    current: set[tuple[str, str]] = set()
    out: list[ClaimRow] = []
    for row in rows:
        if row.owner is None:
            out.append(row)
            continue
        key = (row.id, row.owner)
        current.add(key)
        since = first_seen.setdefault(key, now)
        out.append(row if row.held_exact else replace(row, held_seconds=now - since))
    for key in [key for key in first_seen if key not in current]:
        del first_seen[key]
    return out


def _whole_seconds(score: float | None) -> float | None:
    """A pending score's deadline: its whole seconds (an infinite score stays as it is)."""
    if score is None or not math.isfinite(score):
        return score
    return float(math.floor(score))
