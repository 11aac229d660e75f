"""Reading a result list for operators and producers (``claimkit results``, docs/cli.md).

:func:`read_results` reads (``LRANGE``) or pops (``RPOP``, refused while the list has
durable readers) a bounded batch, oldest first. :func:`follow_results` reads durably
(docs/results.md): each record is received under a lease, handed to the caller's
``handle`` while the lease is renewed, and acked only when ``handle`` says so; it rides out
a Redis restart. Nothing here prints: records go to ``handle``, status lines to
``notify``. The record format: docs/protocol.md#terminal-record.
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import TYPE_CHECKING

import trio

from claimkit.protocol.result_delivery import ResultClaims, ResultListCounts, ResultOwnershipLost
from claimkit.protocol.result_delivery import read_results as read_results
from claimkit.result_reader import DEFAULT_LEASE_SECONDS, DEFAULT_POLL_SECONDS, open_result_reader
from claimkit.store import StoreUnavailable

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from claimkit.protocol.result_delivery import ResultDelivery
    from claimkit.store import Store

__all__ = [
    "COMMAND_KILL_AFTER",
    "FOLLOW_RETRY_FIRST",
    "FOLLOW_RETRY_MAX",
    "follow_results",
    "read_results",
    "reader_counts",
    "reader_line",
    "run_command",
]

FOLLOW_RETRY_FIRST = 0.25
"""Seconds ``results --follow`` waits before its first retry after losing Redis; each
further retry waits twice as long, up to :data:`FOLLOW_RETRY_MAX`."""

FOLLOW_RETRY_MAX = 5.0
"""The longest wait between two retries of ``results --follow`` while Redis is away."""


class _Outage:
    """Whether Redis is away, the one line saying so, and the backoff while it is."""

    def __init__(
        self, store: Store, name: str, notify: Callable[[str], None], first: float, most: float
    ) -> None:
        self.store, self.name, self.notify = store, name, notify
        self.first, self.most = first, most
        self.delay = first
        self.away = False

    async def wait(self, exc: StoreUnavailable) -> None:
        if not self.away:
            self.notify(
                f"Redis at {self.store.url} is unavailable ({exc}); retrying with backoff "
                "until it is back (Ctrl-C to stop)"
            )
            self.away = True
        await trio.sleep(self.delay)
        self.delay = min(self.delay * 2, self.most)

    def answered(self) -> None:
        if self.away:
            self.notify(f"Redis at {self.store.url} is back; following {self.name} again")
            self.away, self.delay = False, self.first


async def follow_results(
    store: Store,
    name: str,
    *,
    handle: Callable[[ResultDelivery], Awaitable[bool]],
    notify: Callable[[str], None],
    count: int | None = None,
    lease_seconds: float = DEFAULT_LEASE_SECONDS,
    poll_seconds: float = DEFAULT_POLL_SECONDS,
    retry_first: float = FOLLOW_RETRY_FIRST,
    retry_max: float = FOLLOW_RETRY_MAX,
) -> int:
    """Read the list ``name`` durably, oldest first, until ``count`` records were acked
    (``None``: until cancelled). Returns how many were acked.

    Each record is received under a lease of ``lease_seconds`` (docs/results.md#receive),
    renewed every third of it while ``await handle(delivery)`` runs; when ``handle``
    returns ``True`` the record is acked, when ``False`` it is left leased without renewal
    and comes back after the lease, to this reader or another. An unparsable record is not
    handed to ``handle``: one ``notify`` line names the list, its size and why, and it stays
    leased (renewed while this reader runs, never acked or deleted;
    docs/results.md#unparsable-records). An ack that finds the lease lost says so in one
    line: the record is delivered again (at least once).

    While Redis is unreachable (:class:`StoreUnavailable`) this says so once through
    ``notify``, retries with a backoff from ``retry_first`` doubling up to ``retry_max``
    seconds, and says so again when Redis is back; an ack is retried until it is done or
    the lease is found lost. Other errors (a ``WRONGTYPE`` reply) are raised.

    Cancellation: the normal way out (Ctrl-C): nothing more is received and the renewals
    stop; a record being handled or not yet acked stays leased and comes back after the
    lease. A record can so be handled twice, never lost.
    """
    outage = _Outage(store, name, notify, retry_first, retry_max)
    acked = 0
    async with open_result_reader(
        store, name, lease_seconds=lease_seconds, poll_seconds=poll_seconds
    ) as reader:
        while count is None or acked < count:
            try:
                delivery = await reader.receive()
            except StoreUnavailable as exc:
                await outage.wait(exc)
                continue
            outage.answered()
            if delivery.unparsable is not None:
                notify(
                    f"{name}: unparsable record of {len(delivery.raw)} bytes "
                    f"({delivery.unparsable}), left leased as claim {delivery.claim_id!r}: "
                    "not acked, not deleted (docs/results.md#unparsable-records)"
                )
                continue
            if not await handle(delivery):
                reader.forget(delivery)
                continue
            while True:
                try:
                    await reader.ack(delivery)
                    acked += 1
                except ResultOwnershipLost:
                    notify(
                        f"{name}: result {delivery.id!r} lost its lease before the ack "
                        f"(handled for longer than the {lease_seconds:g} s lease, or Redis "
                        "was away): not acked; it is delivered again"
                    )
                except StoreUnavailable as exc:
                    await outage.wait(exc)
                    continue
                outage.answered()
                break
    return acked


async def run_command(command: str, raw: bytes) -> int:
    """Run ``command`` through ``/bin/sh -c`` with ``raw`` (a record's exact JSON) on its
    standard input, in a process group of its own; its standard output and error are this
    process's. Returns its exit status (negative: killed by that signal).

    Raises:
        OSError: the shell could not be started.

    Cancellation (Ctrl-C): the command's whole process group (the shell and whatever it
    started) is sent SIGTERM, and SIGKILL if the shell has not exited
    :data:`COMMAND_KILL_AFTER` seconds later; the cancellation waits for the shell to exit
    (docs/results.md#ctrl-c-and---exec).
    """
    done = await trio.run_process(
        command,
        shell=True,
        stdin=raw,
        check=False,
        process_group=0,
        deliver_cancel=_stop_group,
    )
    return done.returncode


COMMAND_KILL_AFTER = 5.0
"""Seconds a cancelled ``--exec`` command has between SIGTERM and SIGKILL."""


async def _stop_group(process: trio.Process) -> None:
    """SIGTERM to ``process``'s group, SIGKILL :data:`COMMAND_KILL_AFTER` seconds later
    (cancelled by trio as soon as the shell exits)."""
    _signal_group(process.pid, signal.SIGTERM)
    await trio.sleep(COMMAND_KILL_AFTER)
    _signal_group(process.pid, signal.SIGKILL)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


async def reader_counts(store: Store, name: str) -> ResultListCounts | None:
    """The durable-reader state of the list ``name`` (docs/results.md#keys), in one instant,
    or ``None`` when it has none (no lease, no tombstone: nobody reads it durably).

    Raises:
        ValueError: on a Redis Cluster, a list name whose keys cannot share its slot.
        StoreError: one of its keys holds another type; StoreUnavailable.

    Cancellation: nothing is written.
    """
    counts = await ResultClaims(store, name).counts()
    if counts.leased == 0 and counts.tombstones == 0:
        return None
    return counts


def reader_line(name: str, counts: ResultListCounts) -> str:
    """``claimkit inspect``'s one line about a durably read list: ``result list L: pending
    N, leased M (K past their lease), tombstones T``."""
    return (
        f"result list {name}: pending {counts.pending}, leased {counts.leased} "
        f"({counts.expired} past their lease), tombstones {counts.tombstones}"
    )
