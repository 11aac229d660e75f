"""The consumer view of a queue (``claimkit consumers``, the per-consumer summary of
``claimkit inspect``; docs/operations.md#consumers).

Who consumes the queue, whether each consumer is alive, and what it holds, read in one
instant of the Redis server clock by the read-only registry script
(:func:`claimkit.protocol.consumers.read_registry`). :func:`forget_dead` removes the
entries of dead consumers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from claimkit.protocol import keys as _keys
from claimkit.protocol.consumers import forget_consumers, read_registry
from claimkit.protocol.operator import cluster_layout

if TYPE_CHECKING:
    from claimkit.protocol.consumers import ConsumerEntry
    from claimkit.store import Store

__all__ = [
    "CONSUMER_SCAN_MAX",
    "FAR_AHEAD_SECONDS",
    "ConsumerRow",
    "ConsumersView",
    "consumers_view",
    "forget_dead",
    "forget_named",
]

CONSUMER_SCAN_MAX = 100_000
"""At most this many owner entries are read to count each consumer's claims (as inspect's
``CLAIM_SCAN_MAX``); beyond it the counts are lower bounds (``exact`` False)."""

ALIVE, DEAD, HANDED_ON, UNREGISTERED = "alive", "dead", "dead, claims handed on", "unregistered"
ALIVE_TOO_FAR = "alive (expiry too far ahead)"

FAR_AHEAD_SECONDS = 86_400.0
"""A liveness expiry more than this far ahead of the server clock (or the configured
liveness TTL, when longer) is no renewal's: the row says ``alive (expiry too far ahead)``.
Such an entry (a score set by hand, ``inf``) never lapses; ``claimkit consumers --forget``
removes it."""


@dataclass(frozen=True, slots=True)
class ConsumerRow:
    """One consumer of a queue. Times are Unix seconds on the Redis server clock.

    Attributes:
        id: the consumer id; ``None`` for the claims whose token names no consumer
            (from before consumer ids, or another program's).
        state: ``"alive"`` (its liveness entry is ahead of the clock), ``"alive (expiry too
            far ahead)"`` (further ahead than any renewal puts it), ``"dead"`` (it
            lapsed; the next reclaim hands its claims on), ``"dead, claims handed on"`` (a
            reclaimer did), ``"unregistered"`` (no entry: forgotten, the registry is off,
            or unknown claims).
        expires: when its liveness entry runs (or ran) out, ``None`` without one: one
            liveness TTL after its last heartbeat.
        claims: the claims its tokens name.
        oldest_age: seconds since its oldest claim was taken, ``None`` when unknown.
        host, pid, started, version: from its info (``None`` when missing).
        info_error: why its info could not be read (``None`` when missing or fine).
    """

    id: str | None
    state: str
    expires: float | None
    claims: int
    oldest_age: float | None
    host: str | None = None
    pid: int | None = None
    started: float | None = None
    version: str | None = None
    info_error: str | None = None

    @property
    def alive(self) -> bool:
        return self.state in (ALIVE, ALIVE_TOO_FAR)

    def to_json(self, now: float) -> dict[str, Any]:
        """This row in ``--json`` (``expires_in_seconds`` negative: lapsed that long ago;
        ``info_error`` only when its info is unreadable)."""
        doc: dict[str, Any] = {
            "consumer": self.id,
            "state": self.state,
            "alive": self.alive,
            "expires": self.expires,
            "expires_in_seconds": None if self.expires is None else round(self.expires - now, 6),
            "claims": self.claims,
            "oldest_claim_age_seconds": None
            if self.oldest_age is None
            else round(self.oldest_age, 6),
            "host": self.host,
            "pid": self.pid,
            "started": self.started,
            "version": self.version,
        }
        if self.info_error is not None:
            doc["info_error"] = self.info_error
        return doc


@dataclass(frozen=True, slots=True)
class ConsumersView:
    """The consumers of one queue: :attr:`rows` in registry order (earliest expiry first),
    then consumers holding claims without an entry, then one row (``id`` ``None``) for
    claims no consumer is named in, when there are any."""

    queue: str
    server_time: float
    rows: tuple[ConsumerRow, ...]
    exact: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "queue": self.queue,
            "server_time": self.server_time,
            "exact": self.exact,
            "consumers": [row.to_json(self.server_time) for row in self.rows],
        }


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _row(entry: ConsumerEntry, now: float, far_ahead: float) -> ConsumerRow:
    if entry.expires is None:
        state = UNREGISTERED
    elif entry.marked_dead:
        state = HANDED_ON
    elif entry.expires > now + far_ahead or math.isnan(entry.expires):
        state = ALIVE_TOO_FAR
    else:
        state = ALIVE if entry.expires > now else DEAD
    pid = entry.info.get("pid")
    return ConsumerRow(
        id=entry.id,
        state=state,
        expires=entry.expires,
        claims=entry.claims,
        oldest_age=None if entry.oldest_claim is None else max(0.0, now - entry.oldest_claim),
        host=_text(entry.info.get("host")),
        pid=pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
        started=_number(entry.info.get("started")),
        version=_text(entry.info.get("version")),
        info_error=entry.info_error,
    )


async def consumers_view(store: Store, queue: str, *, liveness_ttl: float = 0.0) -> ConsumersView:
    """Read the consumers of ``queue`` without changing anything (one script call, one
    instant of the server clock; in the store's key layout). An entry further ahead than
    :data:`FAR_AHEAD_SECONDS`, or ``liveness_ttl`` seconds when that is longer, is
    ``alive (expiry too far ahead)``.

    Raises:
        StoreUnavailable, StoreError: from the store.

    Cancellation: nothing is written, so a cancelled call leaves no trace.
    """
    keys = _keys.QueueKeys.for_queue(queue, cluster=cluster_layout(store))
    view = await read_registry(store, keys, scan_max=CONSUMER_SCAN_MAX)
    now = view.server_now
    far_ahead = max(FAR_AHEAD_SECONDS, liveness_ttl)
    rows = [_row(entry, now, far_ahead) for entry in view.consumers]
    if view.unknown_claims:
        oldest = view.unknown_oldest
        age = None if oldest is None or oldest > now + 300 else max(0.0, now - oldest)
        rows.append(ConsumerRow(None, UNREGISTERED, None, view.unknown_claims, age))
    return ConsumersView(queue, now, tuple(rows), view.exact)


async def forget_dead(store: Store, queue: str) -> list[str]:
    """Remove the registry entries (and info) of ``queue``'s dead consumers: those whose
    liveness lapsed, whether or not a reclaimer handed their claims on yet. Returns their
    ids. A dead consumer's claims not yet handed on then wait out their lease
    (docs/operations.md#consumers).

    Raises:
        StoreUnavailable, StoreError: from the store.
    """
    keys = _keys.QueueKeys.for_queue(queue, cluster=cluster_layout(store))
    return await forget_consumers(store, keys)


async def forget_named(store: Store, queue: str, ids: list[str], *, any_state: bool) -> list[str]:
    """Remove the registry entries (and info) of the consumers ``ids`` of ``queue``: with
    ``any_state`` whatever their state, else only those whose liveness lapsed (checked
    atomically by the script). Returns the ids whose entries were removed.

    Raises:
        StoreUnavailable, StoreError: from the store.
    """
    keys = _keys.QueueKeys.for_queue(queue, cluster=cluster_layout(store))
    return await forget_consumers(store, keys, ids, dead_only=not any_state)
