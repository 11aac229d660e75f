"""Operator hand-back of every claim of a queue (``claimkit drain --release-all``).

Each claim goes back to pending (docs/protocol.md#release-and-sweep) at its original score
through the fenced release script
(:meth:`QueueOps.release <claimkit.protocol.ops.QueueOps.release>`), with the owner token and
the lease expiry read just before: a claim acked, released, reclaimed or renewed since it
was read is left alone. Safe to run while consumers run, and safe to run twice: a second run
finds nothing (or only claims taken since) to release.

The consumer that held a released claim learns it at its next heartbeat (the claim is gone,
docs/protocol.md#heartbeat) and cancels the work; if the work finishes first, its ack still
pushes the one terminal record and withdraws the pending copy (docs/protocol.md#ack), so
nothing runs to two records.

On a Redis Cluster the claim keys are ``{q}:claimed``... (docs/topology.md#cluster-key-layout),
all in the queue's slot, so each batch's ``MULTI`` and release script stay in one slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from claimkit.protocol.ops import CHUNK, QueueOps, ReleaseCode

if TYPE_CHECKING:
    from collections.abc import Callable

    from claimkit.store import Store

__all__ = ["DrainReport", "drain_claims", "list_claim_ids"]


@dataclass
class DrainReport:
    """What one drain did, per claim outcome.

    Attributes:
        seen: claims listed in ``<q>:claims-idx`` when the drain started.
        released: handed back to pending at their original score.
        gone: acked, released or reclaimed by someone else before their turn.
        renewed: renewed since read (lease expiry changed); left alone.
        other_owner: re-claimed by another token since read; left alone.
        ghosts: index entries without an owner (the next reclaim run removes them).
    """

    seen: int = 0
    released: int = 0
    gone: int = 0
    renewed: int = 0
    other_owner: int = 0
    ghosts: int = 0

    def line(self, queue: str, *, dry_run: bool = False) -> str:
        """The final count line."""
        if dry_run:
            return (
                f"claimkit drain {queue}: dry run: would release {self.released} of "
                f"{self.seen} claims ({self.ghosts} ghosts skipped); nothing changed"
            )
        return (
            f"claimkit drain {queue}: released={self.released} of {self.seen} claims "
            f"gone={self.gone} renewed={self.renewed} other_owner={self.other_owner} "
            f"ghosts={self.ghosts}"
        )


async def list_claim_ids(store: Store, queue: str) -> list[str]:
    """Every id in ``<q>:claims-idx``, earliest lease expiry first (one ``ZRANGE``), then
    the ids of ``<q>:claim-owners`` that have no lease entry (orphans, docs/protocol.md,
    "Claims without a lease entry"), in one ``MULTI``."""
    keys = QueueOps(store, queue).keys
    indexed, owned = await store.pipeline(
        [("ZRANGE", keys.index, 0, -1), ("HKEYS", keys.owners)], transaction=True
    )
    seen = set(indexed)
    return [rid.decode() for rid in [*indexed, *(o for o in owned if o not in seen)]]


async def drain_claims(
    store: Store,
    queue: str,
    *,
    batch_size: int = CHUNK,
    dry_run: bool = False,
    progress: Callable[[int], None] | None = None,
    on_start: Callable[[int], None] | None = None,
) -> DrainReport:
    """Release every claim of ``queue`` back to pending, fenced per claim
    (docs/protocol.md#release-and-sweep).

    The claims are listed once; then, per batch of ``batch_size`` ids, one ``MULTI``
    reads their owner tokens (``HMGET``) and lease expiries (``ZMSCORE``) and one release
    script call hands them back, each only if its owner and expiry are still the ones read.

    Args:
        store: an open store.
        queue: ``<q>``.
        batch_size: ids per batch (at least 1).
        dry_run: read and count what would be released; change nothing.
        progress: called with the number of claims handled after each batch.
        on_start: called once with the number of claims listed.

    Returns:
        A :class:`DrainReport`.

    Raises:
        ValueError: ``batch_size`` < 1.
        StoreUnavailable, StoreError: from the store; batches already done stay done. A
            user without ``MULTI`` gets :class:`~claimkit.store.StorePermissionError` at
            the first batch's read, before any claim is released.

    Cancellation: each batch is atomic in Redis; a cancelled drain leaves earlier batches
    released and later claims untouched. Running it again finishes the job.
    """
    if batch_size < 1:
        raise ValueError("batch size must be at least 1")
    ops = QueueOps(store, queue)
    ids = await list_claim_ids(store, queue)
    report = DrainReport(seen=len(ids))
    if on_start is not None:
        on_start(len(ids))
    for start in range(0, len(ids), batch_size):
        batch = ids[start : start + batch_size]
        owners, expiries = await store.pipeline(
            [("HMGET", ops.keys.owners, *batch), ("ZMSCORE", ops.keys.index, *batch)],
            transaction=True,
        )
        claims = _fenced_claims(batch, owners, expiries, report)
        if dry_run:
            report.released += len(claims)
        elif claims:
            _count_released(await ops.release(claims), report)
        if progress is not None:
            progress(len(batch))
    return report


def _fenced_claims(
    batch: list[str], owners: list[Any], expiries: list[Any], report: DrainReport
) -> list[tuple[str, str, float | None]]:
    """The ``(id, owner token, lease expiry)`` of each claim of ``batch`` still held, as
    read in one ``MULTI``; ids whose claim is gone or a ghost are counted in ``report``."""
    claims: list[tuple[str, str, float | None]] = []
    for rid, owner, expiry in zip(batch, owners, expiries, strict=True):
        if expiry is None and owner is not None:
            claims.append((rid, owner.decode(), None))  # an orphan: fenced by token only
        elif expiry is None:
            report.gone += 1
        elif owner is None:
            report.ghosts += 1
        else:
            claims.append((rid, owner.decode(), float(expiry)))
    return claims


def _count_released(codes: list[ReleaseCode], report: DrainReport) -> None:
    """Count the release script's reply per claim (docs/protocol.md#release-and-sweep)."""
    for code in codes:
        if code == ReleaseCode.RELEASED:
            report.released += 1
        elif code == ReleaseCode.GONE:
            report.gone += 1
        elif code == ReleaseCode.TAKEN:
            report.other_owner += 1
        else:
            report.renewed += 1
