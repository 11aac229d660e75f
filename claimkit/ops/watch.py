"""The read loop of ``claimkit inspect --watch`` (docs/cli.md): what to show, and when.

:func:`watch_queue` reads a queue's :class:`~claimkit.ops.inspect.QueueSnapshot` every
``interval`` seconds and hands a :class:`WatchFrame` to its ``show`` callback after each
read and at least once a second in between, so a hung read still ages the view on screen.
It draws nothing itself: the CLI turns each frame into its live view.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from claimkit.ops.inspect import check_key_types, snapshot
from claimkit.store import StoreUnavailable

if TYPE_CHECKING:
    from collections.abc import Callable

    from claimkit.ops.inspect import QueueSnapshot
    from claimkit.store import Store

__all__ = ["WATCH_STALE_AFTER", "WatchFrame", "watch_queue"]

WATCH_STALE_AFTER = 2.0
"""Seconds a read of ``inspect --watch`` may go unanswered before the view on screen is
marked STALE (a read takes milliseconds; the store gives up on a reply only after 10 s)."""


@dataclass(frozen=True, slots=True)
class WatchFrame:
    """What the watch knows at one redraw. Times are Unix seconds of the watch's clock.

    ``snapshot`` is the last successful read (``None`` before the first), read at
    ``read_at``. ``failure`` says why the last read failed (Redis unreachable), else
    ``None``; ``hung`` is true while a read has gone unanswered for longer than the
    stale limit; ``trouble_since`` is when the reads started failing or hanging
    (``None`` when neither).
    """

    snapshot: QueueSnapshot | None
    read_at: float
    now: float
    failure: str | None
    hung: bool
    trouble_since: float | None


class _WatchState:
    """The one owner of the watch's mutable state: the last read and the trouble since."""

    def __init__(self, clock: Callable[[], float], stale_after: float) -> None:
        self.clock, self.stale_after = clock, stale_after
        self.last: QueueSnapshot | None = None
        self.read_at = 0.0
        self.asking_since: float | None = None  # a read is in flight since then
        self.trouble_since: float | None = None  # reads failing since then
        self.failure: str | None = None
        self.reads = 0

    def frame(self) -> WatchFrame:
        now = self.clock()
        asking = self.asking_since
        hung = asking is not None and now - asking > self.stale_after
        since = self.trouble_since if self.trouble_since is not None else asking
        return WatchFrame(self.last, self.read_at, now, self.failure, hung, since)

    def asking(self) -> None:
        self.asking_since = self.clock()

    def failed(self, exc: StoreUnavailable) -> None:
        if self.trouble_since is None:
            self.trouble_since = self.asking_since
        self.failure = str(exc)
        self._answered()

    def read(self, snap: QueueSnapshot) -> None:
        self.last, self.read_at = snap, self.clock()
        self.trouble_since = self.failure = None
        self._answered()

    def _answered(self) -> None:
        self.asking_since = None
        self.reads += 1


async def watch_queue(
    store: Store,
    queue: str,
    *,
    show: Callable[[WatchFrame], None],
    key_types: dict[str, str],
    result_lists: list[str],
    retry_set: str,
    limit: int,
    interval: float,
    refreshes: int | None = None,
    stale_after: float = WATCH_STALE_AFTER,
    clock: Callable[[], float] = time.time,
) -> None:
    """Read ``queue`` until cancelled (or ``refreshes`` reads, for tests), calling ``show``
    after every read and at least every second (every ``interval`` seconds when shorter).

    Each read checks ``key_types`` first (:func:`~claimkit.ops.inspect.check_key_types`),
    then takes a :func:`~claimkit.ops.inspect.snapshot` (``result_lists``, ``retry_set``,
    at most ``limit`` claim rows); the held times of foreign tokens are tracked across
    reads. A read that fails with :class:`StoreUnavailable` is noted in the next frames
    and retried after ``interval`` seconds; one unanswered for ``stale_after`` seconds
    makes the frames ``hung``. ``clock`` gives Unix seconds (tests).

    Raises:
        WrongKeyType: a key holds another Redis type; ends the watch.

    Cancellation: the normal way out; nothing is written to Redis.
    """
    state = _WatchState(clock, stale_after)
    first_seen: dict[tuple[str, str], float] = {}

    async def read_forever(cancel_scope: trio.CancelScope) -> None:
        while True:
            state.asking()
            try:
                await check_key_types(store, key_types)
                snap = await snapshot(
                    store,
                    queue,
                    result_lists=result_lists,
                    retry_set=retry_set,
                    limit=limit,
                    first_seen=first_seen,
                )
            except StoreUnavailable as exc:
                state.failed(exc)
            else:
                state.read(snap)
            show(state.frame())
            if refreshes is not None and state.reads >= refreshes:
                cancel_scope.cancel()
                return
            await trio.sleep(interval)

    async def redraw_forever() -> None:
        # A hung read must not freeze the screen: "3.0s ago" keeps counting and an
        # overdue read turns the view STALE while the read itself still waits.
        while True:
            await trio.sleep(min(interval, 1.0))
            show(state.frame())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_forever, nursery.cancel_scope)
        nursery.start_soon(redraw_forever)
