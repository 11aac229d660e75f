"""What the Lua scripts reply, as named values (docs/protocol.md#claim-protocol).

Each per-item reply code is an :class:`enum.IntEnum` (so it still compares equal to the
integer the script returns); :class:`ReclaimCounts` and :class:`InspectReply` are the
replies of ``lua/reclaim-6.lua`` and ``lua/inspect-6.lua``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from claimkit.store import reply_text

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "ClaimCode",
    "InspectClaim",
    "InspectReply",
    "MoveCode",
    "ParkCode",
    "PushCode",
    "ReclaimCounts",
    "ReleaseCode",
    "RenewCode",
    "RequeueCode",
    "orphans_message",
]


class ClaimCode(enum.IntEnum):
    """Per-candidate replies of the claim script (``lua/claim-4.lua``,
    docs/protocol.md#claim)."""

    NOT_PENDING = 0
    """No longer pending: another consumer claimed it first (or it was acked or moved)."""
    CLAIMED = 1
    CANCELLED = 2
    """Claimed, and its ``request-cancel:<id>`` marker holds its ``request_token``."""
    BUSY = 3
    """The id already has a live claim (a reused id): left pending."""


class MoveCode(enum.IntEnum):
    """Per-record replies of an ack across slots, step 1 (``lua/ack-outbox-6.lua``,
    docs/topology.md#acks-across-slots)."""

    SUPPRESSED = 0
    """Neither the caller's claim nor the exact member pending: nothing written."""
    MOVED_OWNED = 1
    """The caller's claim moved into the outbox (its entries deleted)."""
    MOVED_WITHDRAWN = 2
    """The exact member was pending again: withdrawn, its record into the outbox."""
    ALREADY_MOVED = 3
    """The outbox already held ``<id>\\0<token>`` (an earlier call's reply was lost)."""


class PushCode(enum.IntEnum):
    """Per-record replies of the push step (``lua/push-result-3.lua``,
    docs/topology.md#acks-across-slots)."""

    UNUSABLE = -1
    """The list (or one of its marker keys) holds another type: nothing was written."""
    SUPPRESSED = 0
    """Its marker says the record is already there."""
    PUSHED = 1
    """The record was pushed onto the list and its marker set."""


class RenewCode(enum.IntEnum):
    """Per-claim replies of the renew script (``lua/renew-4.lua``,
    docs/protocol.md#heartbeat)."""

    TAKEN = -1
    """``claim-owners[id]`` holds another token: the claim is another owner's now."""
    GONE = 0
    """No claim any more (acked, released, parked or reclaimed)."""
    RENEWED = 1


class ReleaseCode(enum.IntEnum):
    """Per-claim replies of the release script (``lua/release-4.lua``,
    docs/protocol.md#release-and-sweep)."""

    RENEWED_SINCE = -2
    """The lease is not the expiry the caller read: renewed since, left alone."""
    TAKEN = -1
    """Owned by another token: left alone."""
    GONE = 0
    RELEASED = 1


class ParkCode(enum.IntEnum):
    """Per-request replies of the park script (``lua/park-4.lua``,
    docs/protocol.md#park-for-retry)."""

    NOT_OWNED = 0
    PARKED = 1


class RequeueCode(enum.IntEnum):
    """Per-member replies of the requeue-dead script (``lua/requeue-dead-3.lua``)."""

    LEFT_DEAD = -1
    """No readable positive ``data.deadline``: the member stays dead."""
    NOT_DEAD = 0
    """Not in the dead set (any more)."""
    REQUEUED = 1


@dataclass(frozen=True, slots=True)
class ReclaimCounts:
    """What one reclaim run did (docs/protocol.md, "Reclaim").

    ``redelivered`` and ``dead`` count expired claims; ``ghosts`` the entries removed for
    want of a payload. ``orphans`` counts the claims found without a lease entry
    (docs/protocol.md, "Claims without a lease entry"); each of them is also counted in
    ``leases_restored`` (given its lease back, not redelivered) or ``ghosts``.
    ``replayed`` (Redis Cluster only, else 0) counts the outbox entries the run finished:
    records left half-way by an ack across slots, and the run's own dead letters' records
    (docs/topology.md#acks-across-slots). ``handed_on`` counts the leases the fast failover
    before the run cut (docs/protocol.md#fast-failover): those claims are among
    ``redelivered`` (or ``dead``); a reclaim alone leaves it 0.
    """

    redelivered: int = 0
    dead: int = 0
    ghosts: int = 0
    orphans: int = 0
    leases_restored: int = 0
    replayed: int = 0
    handed_on: int = 0

    def __add__(self, other: ReclaimCounts) -> ReclaimCounts:
        return ReclaimCounts(
            self.redelivered + other.redelivered,
            self.dead + other.dead,
            self.ghosts + other.ghosts,
            self.orphans + other.orphans,
            self.leases_restored + other.leases_restored,
            self.replayed + other.replayed,
            self.handed_on + other.handed_on,
        )


def orphans_message(counts: ReclaimCounts) -> str:
    """The operator's warning about claims found without a lease entry, e.g. ``"1 claim
    had no lease entry (evicted, partly restored or edited by hand?); its lease was given
    back"`` (docs/protocol.md, "Claims without a lease entry")."""
    n, restored = counts.orphans, counts.leases_restored
    head = "1 claim had" if n == 1 else f"{n} claims had"
    if restored == n:
        what = "its lease was given back" if n == 1 else "their leases were given back"
    else:
        what = f"leases given back: {restored}, removed for want of a payload: {n - restored}"
    return f"{head} no lease entry (evicted, partly restored or edited by hand?); {what}"


@dataclass(frozen=True, slots=True)
class InspectClaim:
    """One claim row of ``lua/inspect-6.lua``, read leniently (a hash field written by hand
    must not stop ``claimkit inspect``).

    Attributes:
        id: the request id (bytes that are not UTF-8 decoded with replacement characters).
        lease_expiry: Unix seconds, server clock (``<q>:claims-idx``).
        owner: the owner token (``<q>:claim-owners``), or ``None``.
        score: the original pending score (``<id>:score``), or ``None`` when absent or not
            a number.
        deliveries: ``<q>:deliveries[id]``; 0 when absent or not an integer.
        has_payload: whether ``<q>:claimed[id]`` exists.
    """

    id: str
    lease_expiry: float
    owner: str | None
    score: float | None
    deliveries: int
    has_payload: bool


@dataclass(frozen=True, slots=True)
class InspectReply:
    """``lua/inspect-6.lua``'s read-only snapshot of one queue's keys, one instant of the
    Redis server clock (its header documents each count).

    Attributes:
        server_now: Unix seconds.
        pending: ``ZCARD <q>``.
        oldest_pending_score: the lowest pending score, or ``None`` (empty or unreadable).
        leases: ``ZCARD <q>:claims-idx``.
        expired: lease entries with expiry <= ``server_now``.
        dead: ``ZCARD <q>:dead``.
        redelivered: ``HLEN <q>:deliveries``.
        claims: owner entries, plus payloads with neither an owner nor a lease entry.
        orphans: claims without a lease entry.
        claims_exact: False when a hash was larger than the scan bound (``claims`` and
            ``orphans`` are then lower bounds).
        rows: the claims with the earliest lease expiry first.
    """

    server_now: float
    pending: int
    oldest_pending_score: float | None
    leases: int
    expired: int
    dead: int
    redelivered: int
    claims: int
    orphans: int
    claims_exact: bool
    rows: tuple[InspectClaim, ...]

    @classmethod
    def from_reply(cls, reply: Sequence[Any]) -> InspectReply:
        """Parse the script's reply (its header gives the layout)."""
        raw_rows = reply[10:]
        rows = tuple(
            InspectClaim(
                id=reply_text(rid),
                lease_expiry=float(expiry),
                owner=None if owner is None else reply_text(owner),
                score=_lenient_float(score),
                deliveries=_lenient_int(deliveries),
                has_payload=bool(int(has_payload)),
            )
            for rid, expiry, owner, score, deliveries, has_payload in (
                raw_rows[i : i + 6] for i in range(0, len(raw_rows), 6)
            )
        )
        return cls(
            server_now=float(reply[0]),
            pending=int(reply[1]),
            oldest_pending_score=_lenient_float(reply[2]),
            leases=int(reply[3]),
            expired=int(reply[4]),
            dead=int(reply[5]),
            redelivered=int(reply[6]),
            claims=int(reply[7]),
            orphans=int(reply[8]),
            claims_exact=bool(int(reply[9])),
            rows=rows,
        )


def _lenient_float(value: Any) -> float | None:
    """A score read from a field someone else may have written: ``None`` when absent or
    not a number."""
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _lenient_int(value: Any) -> int:
    """A count read from a hash field: 0 when absent or not an integer."""
    try:
        return 0 if value is None else int(value)
    except (TypeError, ValueError):
        return 0
