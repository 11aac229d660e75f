"""The claims a consumer holds, and the one place that counts what becomes of them.

:class:`HeldClaims` is the registry of one queue's live claims (docs/protocol.md#claim-protocol):
every add and removal goes through it, and each of its methods also counts the outcome in the
process's :class:`Summary` (the exit line) and the queue's metrics (docs/metrics.md), so the
two never drift apart.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from claimkit.protocol.models import ErrorCode
from claimkit.protocol.ops import ReleaseCode

if TYPE_CHECKING:
    from collections.abc import Sequence

    import trio

    from claimkit.consumer.metrics import QueueMetrics
    from claimkit.protocol.models import Envelope, TerminalRecord
    from claimkit.protocol.ops import ReclaimCounts

__all__ = ["LOST_NAMED", "Claim", "HeldClaims", "Summary"]

log = logging.getLogger("claimkit")

LOST_NAMED = 5
"""How many ids one heartbeat tick's warning about lost claims names (the rest at DEBUG)."""
_TAKEN = (
    "taken over by another owner (after its lease lapsed, its consumer's liveness entry "
    "lapsed, or a drain released it)"
)
_RELEASED = (
    "released elsewhere (by drain, or by a reclaimer after its lease or its consumer's "
    "liveness entry lapsed)"
)


@dataclass
class Summary:
    """Counts for the exit line (docs/protocol.md#tasks-and-shutdown), for this process only."""

    claimed: int = 0
    acked: int = 0
    retried: int = 0
    released: int = 0
    duplicates_suppressed: int = 0
    redelivered: int = 0
    dead_lettered: int = 0
    taken_over: int = 0
    """Claims a heartbeat found held by another owner (the lease had lapsed and another
    consumer claimed the request): their work here is cancelled; the request is not lost."""
    released_elsewhere: int = 0
    """Claims a heartbeat found no longer claimed: handed back to pending by someone else
    (``claimkit drain``, or a reclaimer after the lease lapsed) or finished by another
    owner. Their work here is cancelled; the request is not lost."""
    left_to_lapse: int = 0
    """Claims this process gave up on without releasing them: an ack or park Redis refused
    (dropped from the registry then), and claims still held at exit (the sweep could not
    return them). Their leases lapse and any instance's reclaimer redelivers them."""

    def line(self) -> str:
        return (
            f"claimkit: claimed={self.claimed} acked={self.acked} retried={self.retried} "
            f"released={self.released} duplicates_suppressed={self.duplicates_suppressed} "
            f"redelivered={self.redelivered} dead_lettered={self.dead_lettered} "
            f"taken_over={self.taken_over} released_elsewhere={self.released_elsewhere} "
            f"left_to_lapse={self.left_to_lapse}"
        )


@dataclass(eq=False)
class Claim:
    """A claim this process holds: the claimed envelope and the claim's ownership token."""

    env: Envelope
    token: str
    cancelled: bool = False  # the claim script found a cancel marker
    scope: trio.CancelScope | None = None  # the work's scope, while it runs
    ours: bool = True  # False once found taken over or released elsewhere: work is moot
    acking: bool = False  # its ack script call is under way: the ack's answer counts it
    # The payload fetched through env.payload_ref (docs/protocol.md#payload-references),
    # held only from the fetch until its worker takes it for the dispatch; or why it could
    # not be had (the PAYLOAD_UNAVAILABLE record's message).
    payload: bytes | None = None
    payload_unavailable: str | None = None


class HeldClaims:
    """The claims this process holds on one queue, by request id.

    Args:
        queue: the queue's name (for log lines).
        summary: the process's exit counts, shared by every queue.
        metrics: the queue's metrics.

    Attributes:
        given_up: claims dropped unreleased because Redis refused their ack or park
            (counted in ``Summary.left_to_lapse`` at exit).
    """

    def __init__(self, queue: str, summary: Summary, metrics: QueueMetrics) -> None:
        self.queue = queue
        self.summary = summary
        self.metrics = metrics
        self.given_up = 0
        self._by_id: dict[str, Claim] = {}
        self._stale: list[Claim] = []  # replaced by add(), logged by count_claimed()

    def __len__(self) -> int:
        return len(self._by_id)

    def all(self) -> list[Claim]:
        """The claims held now, oldest first (a copy: safe to keep across awaits)."""
        return list(self._by_id.values())

    def holds(self, claim: Claim) -> bool:
        """Whether ``claim`` (this very one, not only its id) is still held."""
        return self._by_id.get(claim.env.id) is claim

    def _forget(self, claim: Claim) -> bool:
        if self._by_id.get(claim.env.id) is claim:
            del self._by_id[claim.env.id]
            return True
        return False

    def show_depth(self) -> None:
        """Set the ``claim_depth`` gauge to the claims held."""
        self.metrics.claim_depth.set(len(self._by_id))

    # -- claim (docs/protocol.md#claim) ------------------------------------------------------

    def add(self, env: Envelope, token: str, *, cancelled: bool) -> Claim:
        """Hold a claim the claim script just granted (``cancelled``: it found a cancel
        marker). An earlier claim of ours on the same id was handed back (drain) and won
        again: that one counts as released elsewhere, since its result would be a duplicate."""
        claim = Claim(env, token, cancelled=cancelled)
        stale = self._by_id.get(env.id)
        if stale is not None:
            self._lose(stale)
            self._stale.append(stale)
        self._by_id[env.id] = claim
        return claim

    def count_claimed(self, n: int) -> None:
        """Count ``n`` claims granted by one claim call, and the earlier claims they
        replaced (:meth:`add`) as released elsewhere, in one warning (:meth:`drop_lost`)."""
        stale, self._stale = self._stale, []
        self.drop_lost([], stale)
        self.summary.claimed += n
        self.metrics.requests.inc(n)
        self.show_depth()

    def count_dead_lettered(self, n: int) -> None:
        """Count ``n`` members moved to ``<q>:dead`` by a poll (malformed) or a reclaim."""
        self.summary.dead_lettered += n
        self.metrics.dead_lettered.inc(n)

    def count_invalid_records(self, n: int) -> None:
        """Count ``n`` ``INVALID_REQUEST`` records a poll's dead-lettering pushed."""
        for _ in range(n):
            self.metrics.count_terminal(ErrorCode.INVALID_REQUEST, None)

    def count_shed(self, n: int) -> None:
        """Count ``n`` candidates the gate did not admit (they stay pending)."""
        self.metrics.shedded.inc(n)

    # -- heartbeat (docs/protocol.md#heartbeat) ----------------------------------------------

    def drop_taken_over(self, claim: Claim) -> None:
        """The heartbeat found ``claim`` held by another owner: forget it, cancel its work."""
        self.drop_lost([claim], [])

    def drop_released_elsewhere(self, claim: Claim) -> None:
        """``claim`` is no longer claimed (handed back by a drain or a reclaimer): forget it,
        cancel its work."""
        self.drop_lost([], [claim])

    def drop_lost(self, taken: Sequence[Claim], released: Sequence[Claim]) -> None:
        """One heartbeat tick's lost claims: ``taken`` held by another owner, ``released``
        no longer claimed (handed back by a drain or a reclaimer). Each is forgotten and its
        work cancelled. Logged as one WARNING per kind naming the claim, or, for several,
        their count and the first :data:`LOST_NAMED` ids (the others at DEBUG, one line
        each): a ``drain --release-all`` of 500 claims is one line, not 500."""
        self.summary.taken_over += len(taken)
        self.summary.released_elsewhere += len(released)
        for claims, how in ((taken, _TAKEN), (released, _RELEASED)):
            for claim in claims:
                self._lose(claim)
            self._log_lost(claims, how)

    def _lose(self, claim: Claim) -> None:
        claim.ours = False
        self._forget(claim)
        if claim.scope is not None:
            claim.scope.cancel()

    def _log_lost(self, claims: Sequence[Claim], how: str) -> None:
        if len(claims) == 1:
            log.warning(
                "claim on %s in %s was %s; its work here is cancelled",
                claims[0].env.id,
                self.queue,
                how,
            )
        elif claims:
            ids = [c.env.id for c in claims]
            named = ", ".join(ids[:LOST_NAMED])
            more = f" and {len(ids) - LOST_NAMED} more" if len(ids) > LOST_NAMED else ""
            log.warning(
                "%d claims in %s were %s (%s%s); their work here is cancelled",
                len(ids),
                self.queue,
                how,
                named,
                more,
            )
            for rid in ids[LOST_NAMED:]:
                log.debug(
                    "claim on %s in %s was %s; its work here is cancelled", rid, self.queue, how
                )

    def drop_acking(self, claim: Claim) -> None:
        """The heartbeat found ``claim``, whose ack is under way, no longer held: forget it,
        count nothing and log nothing. The ack itself took it out of the claim hashes (an
        ack across slots moves it into the outbox at its first step,
        docs/topology.md#acks-across-slots), or the claim was taken or handed back
        meanwhile; either way its work is done, and the ack's answer (:meth:`acked`) is
        the one count of it, so the exit line adds up to ``claimed``."""
        self._forget(claim)

    # -- ack and park (docs/protocol.md#ack, docs/protocol.md#park-for-retry) -----------------

    def acked(self, claim: Claim, record: TerminalRecord | None, pushed: bool) -> None:
        """An ack script ran for ``claim``: ``pushed`` False means a suppressed duplicate."""
        self._forget(claim)
        if not pushed:
            self.summary.duplicates_suppressed += 1
            self.metrics.duplicates_suppressed.inc()
            return
        self.summary.acked += 1
        if record is None:
            return
        self.metrics.count_terminal(record.error_code, record.status_code)
        if record.error_code == ErrorCode.DEADLINE_EXCEEDED:
            self.metrics.deadline_exceeded.inc()
        elif record.status_code is not None and 200 <= record.status_code < 300:
            self.metrics.successes.inc()
        else:
            self.metrics.failures.inc()

    def parked(self, claim: Claim, *, moved: bool) -> None:
        """A park script ran for ``claim``: ``moved`` False means it was not ours any more."""
        self._forget(claim)
        if moved:
            self.summary.retried += 1
            self.metrics.retries.inc()

    def handed_back(self, claim: Claim, *, released: bool) -> None:
        """A release script ran for ``claim``, whose attempt could not reach the gateway
        (docs/dispatch.md#the-gateway-is-unreachable): ``released`` False means it was not
        ours any more. A hand-back is not a delivery nor a retry; it counts as released
        and in ``async_gateway_unsent_total``."""
        self._forget(claim)
        if released:
            self.summary.released += 1
            self.metrics.gateway_unsent.inc()

    def give_up(self, claims: Sequence[Claim], why: str) -> None:
        """Drop claims Redis refused to settle, counted in ``left_to_lapse``: their leases
        lapse and any instance's reclaimer redelivers them. Logs ``why``."""
        dropped = sum(1 for claim in claims if self._forget(claim))
        self.given_up += dropped
        log.error("%s; %d claims left to lapse", why, dropped)

    # -- sweep and reclaim (docs/protocol.md#release-and-sweep, docs/protocol.md#reclaim) -----

    def swept(self, claims: Sequence[Claim], codes: Sequence[ReleaseCode]) -> None:
        """The release script answered ``codes`` for ``claims`` (the sweep's, or a hand-back
        after their payloads could not be fetched): none of them is held any more, whatever
        the code; those released count as released."""
        for claim, code in zip(claims, codes, strict=True):
            self._by_id.pop(claim.env.id, None)
            if code == ReleaseCode.RELEASED:
                self.summary.released += 1
        self.show_depth()

    def count_reclaimed(self, counts: ReclaimCounts) -> None:
        """Count what a reclaim run did (expired claims of any consumer, not only ours)."""
        self.summary.redelivered += counts.redelivered
        self.summary.dead_lettered += counts.dead
        self.metrics.claims_expired.inc(counts.redelivered)
        self.metrics.dead_lettered.inc(counts.dead)
        for _ in range(counts.dead):
            self.metrics.count_terminal(ErrorCode.MAX_DELIVERIES_EXCEEDED, None)
