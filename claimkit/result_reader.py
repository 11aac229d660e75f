"""A durable result reader that renews what it holds (docs/results.md#the-reader).

:class:`ResultReader` receives records of one result list under leases, keeps every
delivery it handed out and not yet acked renewed in the background (all of them in one
round trip per tick, every lease/3), and stops renewing a delivery once it is acked or
forgotten. Used by :meth:`claimkit.Producer.result_reader` and ``claimkit results
--follow``. The scripts it calls are the protocol layer's
(:class:`~claimkit.protocol.result_delivery.ResultClaims`).
"""

from __future__ import annotations

import enum
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import trio

from claimkit.protocol.result_delivery import (
    MAX_RESULT_LEASE_MS,
    ResultAckCode,
    ResultClaims,
    ResultDelivery,
    ResultOwnershipLost,
)
from claimkit.store import StoreUnavailable

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    from claimkit.store import Store

__all__ = [
    "DEFAULT_LEASE_SECONDS",
    "DEFAULT_POLL_SECONDS",
    "MAX_LEASE_SECONDS",
    "MAX_POLL_SECONDS",
    "MIN_LEASE_SECONDS",
    "ResultReader",
    "check_lease_seconds",
    "check_poll_seconds",
    "lease_ms",
    "open_result_reader",
]

DEFAULT_LEASE_SECONDS = 300.0
"""The reader's lease unless told otherwise: 5 minutes, in seconds."""

DEFAULT_POLL_SECONDS = 1.0
"""Seconds the reader waits before receiving again from an empty list."""


MIN_LEASE_SECONDS = 0.001
"""The shortest lease, seconds: one millisecond, the unit the scripts score leases in."""

MAX_LEASE_SECONDS = MAX_RESULT_LEASE_MS / 1000
"""The longest lease, seconds: 7 days (docs/results.md#lease-and-poll)."""

MAX_POLL_SECONDS = 3600.0
"""The longest wait between two receives of an empty list, seconds: an hour
(docs/results.md#lease-and-poll)."""


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def check_lease_seconds(seconds: float, name: str = "lease_seconds") -> float:
    """``seconds`` when it is a lease the scripts can hold: a number from
    :data:`MIN_LEASE_SECONDS` to :data:`MAX_LEASE_SECONDS` (7 days).

    Raises:
        ValueError: anything else (``inf``, ``nan``, 0, a negative, more than 7 days, not a
            number); the message starts with ``name``.
    """
    value = _number(seconds)
    if value is None or not MIN_LEASE_SECONDS <= value <= MAX_LEASE_SECONDS:
        raise ValueError(
            f"{name} must be a number of seconds from {MIN_LEASE_SECONDS:g} to "
            f"{MAX_LEASE_SECONDS:g} (7 days), got {seconds!r}"
        )
    return value


def check_poll_seconds(seconds: float, name: str = "poll_seconds") -> float:
    """``seconds`` when it is a poll interval: a number above 0 and at most
    :data:`MAX_POLL_SECONDS` (an hour).

    Raises:
        ValueError: anything else (``inf``, ``nan``, 0, a negative, not a number); the
            message starts with ``name``.
    """
    value = _number(seconds)
    if value is None or not 0 < value <= MAX_POLL_SECONDS:
        raise ValueError(
            f"{name} must be a number of seconds above 0 and at most {MAX_POLL_SECONDS:g} "
            f"(an hour), got {seconds!r}"
        )
    return value


def lease_ms(seconds: float) -> int:
    """A lease in seconds as the scripts' whole milliseconds (1 to 604,800,000).

    Raises:
        ValueError: ``seconds`` is not a lease :func:`check_lease_seconds` accepts.
    """
    return max(1, min(MAX_RESULT_LEASE_MS, round(check_lease_seconds(seconds) * 1000)))


class _State(enum.Enum):
    NEW = "new"
    OPEN = "open"
    CLOSED = "closed"


@asynccontextmanager
async def open_result_reader(
    store: Store,
    result_list: str,
    *,
    lease_seconds: float = DEFAULT_LEASE_SECONDS,
    poll_seconds: float = DEFAULT_POLL_SECONDS,
    batch: int = 1,
    on_renew_error: Callable[[BaseException], None] | None = None,
) -> AsyncIterator[ResultReader]:
    """Open a :class:`ResultReader` of ``result_list`` on ``store`` and renew what it holds
    in a background task until the block is left (arguments as for :class:`ResultReader`).

    Raises:
        ValueError: a lease, poll or batch out of range (before anything is sent); on a
            Redis Cluster, a list name whose keys cannot share its slot.
        StoreError: a renewal failed for another reason than Redis being unreachable: the
            block is cancelled and the error raised from it.

    Cancellation: leaving the block (an exception, a cancel, Ctrl-C) stops the renewals;
    every delivery not acked stays leased and comes back after its lease.
    """
    reader = ResultReader(
        ResultClaims(store, result_list),
        lease_seconds=lease_seconds,
        poll_seconds=poll_seconds,
        batch=batch,
        on_renew_error=on_renew_error,
    )
    # The renewals run in a nursery, which wraps anything raised in the block in an
    # ExceptionGroup. That group is an implementation detail: a lone error is unwrapped.
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader._renew_forever)
            reader._state = _State.OPEN
            try:
                yield reader
            finally:
                reader._state = _State.CLOSED
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1 and not isinstance(group.exceptions[0], BaseExceptionGroup):
            raise group.exceptions[0] from None
        raise


class ResultReader:
    """Durable reading of one result list: an async iterator of deliveries, opened by
    :func:`open_result_reader` (or :meth:`claimkit.Producer.result_reader`).

    ::

        async with producer.result_reader(lease_seconds=60) as reader:
            async for delivery in reader:
                handle(delivery.record)
                await reader.ack(delivery)

    Each delivery is received under a lease of ``lease_seconds`` (seconds; the scripts
    score it in server-clock milliseconds) and renewed every ``lease_seconds / 3`` until it
    is acked (:meth:`ack`) or forgotten (:meth:`forget`). Delivery is at least once: a
    record is delivered again after its lease when its reader dies or does not ack it, so
    deduplicate by :attr:`ResultDelivery.dedup_key` (docs/results.md#dedup).

    Args:
        claims: the protocol calls of the list (:class:`ResultClaims`).
        lease_seconds: the lease of each delivery, seconds (0.001 to 604800, 7 days).
        poll_seconds: seconds to wait before receiving again from an empty list (above 0,
            at most 3600).
        batch: records claimed per receive call (>= 1); those not yet handed out are held
            and renewed too.
        on_renew_error: called with the exception when a renewal tick could not reach Redis
            (:class:`StoreUnavailable`); the next tick tries again. Default: ignored.

    Raises:
        ValueError: a lease, poll or batch out of range.

    Cancellation: leaving the ``async with`` (an exception, a cancel, Ctrl-C) stops the
    renewals and receives nothing more; every delivery not acked stays leased and comes
    back, to any reader, after its lease (docs/results.md#receive). A reader is used once.
    """

    def __init__(
        self,
        claims: ResultClaims,
        *,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        poll_seconds: float = DEFAULT_POLL_SECONDS,
        batch: int = 1,
        on_renew_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        poll_seconds = check_poll_seconds(poll_seconds)
        if batch < 1:
            raise ValueError(f"batch must be at least 1, got {batch}")
        self.claims = claims
        self.lease_ms = lease_ms(lease_seconds)
        self.lease_seconds = float(lease_seconds)
        self.poll_seconds = poll_seconds
        self.batch = batch
        self.on_renew_error = on_renew_error
        self._held: dict[tuple[str, str], ResultDelivery] = {}
        self._lost: set[tuple[str, str]] = set()
        self._ready: list[ResultDelivery] = []
        self._state = _State.NEW

    @property
    def held(self) -> list[ResultDelivery]:
        """The deliveries this reader holds (received, not acked or forgotten), oldest
        first: the ones it renews."""
        return list(self._held.values())

    @property
    def renew_every(self) -> float:
        """Seconds between two renewal ticks: a third of the lease."""
        return self.lease_seconds / 3

    def __aiter__(self) -> ResultReader:
        return self

    async def __anext__(self) -> ResultDelivery:
        return await self.receive()

    async def receive(self) -> ResultDelivery:
        """The next delivery, waiting (``poll_seconds`` between tries) until one comes.

        An unparsable record is delivered too (:attr:`ResultDelivery.unparsable` says why):
        it stays leased and renewed until acked or forgotten, and is never deleted.

        Raises:
            RuntimeError: the reader is not open (outside its ``async with``).
            StoreUnavailable, StoreError: from the store; the reader stays usable, so a
                caller may wait and call again.

        Cancellation: a receive whose script ran but whose reply was lost leaves its
        records leased under a token never learned: they come back after the lease.
        """
        if self._state is not _State.OPEN:
            raise RuntimeError(
                "the ResultReader is not open: use it inside `async with open_result_reader()`"
            )
        while not self._ready:
            got = await self.claims.receive(self.batch, lease_ms=self.lease_ms)
            for delivery in got:
                self._held[_key(delivery)] = delivery
            self._ready.extend(got)
            if not got:
                await trio.sleep(self.poll_seconds)
        return self._ready.pop(0)

    async def ack(self, delivery: ResultDelivery) -> ResultAckCode:
        """Ack ``delivery`` and stop renewing it (docs/results.md#ack).

        Returns:
            :attr:`ResultAckCode.ACKED`, or :attr:`ResultAckCode.ALREADY_ACKED` for a repeated ack.

        Raises:
            ResultOwnershipLost: the lease expired or another owner holds the record (a
                renewal may have found that first): it was, or will be, delivered again.
            StoreUnavailable, StoreError: from the store; the delivery is still held and
                renewed, so the ack can be tried again.

        Cancellation: a cancelled ack may or may not have acked; the delivery is still
        held, and acking it again returns :attr:`ResultAckCode.ALREADY_ACKED` if it had.
        """
        key = _key(delivery)
        code = await self.claims.ack(delivery)
        self._held.pop(key, None)
        self._lost.discard(key)
        if code is ResultAckCode.LOST:
            raise ResultOwnershipLost(
                f"result {delivery.claim_id!r} of {delivery.result_list} is no longer this "
                "reader's (its lease expired or another reader holds it): not acked; it is "
                "delivered again (docs/results.md#ack)",
                delivery,
            )
        return code

    def forget(self, delivery: ResultDelivery) -> None:
        """Stop renewing ``delivery`` without acking it: it stays leased until its lease
        runs out, then comes back to a reader (this one included). Writes nothing."""
        key = _key(delivery)
        self._held.pop(key, None)
        self._lost.discard(key)
        if delivery in self._ready:
            self._ready.remove(delivery)

    def lost(self, delivery: ResultDelivery) -> bool:
        """Whether a renewal found ``delivery`` no longer this reader's (it is not renewed
        any more; its ack will raise :class:`ResultOwnershipLost`)."""
        return _key(delivery) in self._lost

    async def renew_now(self) -> list[ResultDelivery]:
        """Renew every held delivery now, in one round trip; returns those found lost (no
        longer held). Raises StoreUnavailable, StoreError."""
        held = list(self._held.values())
        if not held:
            return []
        alive = await self.claims.renew(held, lease_ms=self.lease_ms)
        lost = []
        for delivery, ok in zip(held, alive, strict=True):
            if not ok:
                key = _key(delivery)
                if self._held.pop(key, None) is not None:
                    self._lost.add(key)
                    lost.append(delivery)
        return lost

    async def _renew_forever(self) -> None:
        while True:
            await trio.sleep(self.renew_every)
            try:
                await self.renew_now()
            except StoreUnavailable as exc:
                if self.on_renew_error is not None:
                    self.on_renew_error(exc)


def _key(delivery: ResultDelivery) -> tuple[str, str]:
    return delivery.claim_id, delivery.owner
