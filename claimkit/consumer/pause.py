"""Whether the consumer sees a queue paused (docs/protocol.md#pause), with its log lines
and its gauge.

The poller reads ``<q>:paused`` with every peek
(:meth:`~claimkit.protocol.ops.QueueOps.peek_unless_paused`) and hands the mark to
:meth:`PauseWatch.see`; while it is there the poller claims nothing from that queue.
Heartbeats, acks, in-flight work, the reclaimer and the retry mover go on.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client import Gauge

    from claimkit.protocol.pause import PauseMark

__all__ = ["PauseWatch"]

log = logging.getLogger("claimkit")


class PauseWatch:
    """One queue's pause state as its poller last read it; the owner of the
    ``async_queue_paused`` gauge of that queue (docs/metrics.md).

    Args:
        queue: ``<q>``, for the log lines.
        gauge: the queue's ``async_queue_paused`` child: set to 1 or 0 at each :meth:`see`.

    Attributes:
        mark: the mark last seen, ``None`` while the queue is not paused.
    """

    def __init__(self, queue: str, gauge: Gauge) -> None:
        self._queue = queue
        self._gauge = gauge
        self.mark: PauseMark | None = None

    @property
    def paused(self) -> bool:
        """Whether the last read found the queue paused."""
        return self.mark is not None

    def see(self, mark: PauseMark | None) -> bool:
        """Take what a poll read (``None``: no pause key); whether the queue is paused.
        Logs one INFO line when the queue becomes paused and one when it is resumed, never
        one per poll."""
        if mark is not None and self.mark is None:
            why = f" ({mark.reason})" if mark.reason else ""
            log.info(
                "queue %s is paused%s: claiming nothing new from it; work in flight goes on",
                self._queue,
                why,
            )
        elif mark is None and self.mark is not None:
            log.info("queue %s is resumed: claiming again", self._queue)
        self.mark = mark
        self._gauge.set(1 if mark is not None else 0)
        return mark is not None
