"""The gateway breaker of one queue (docs/dispatch.md#the-gateway-is-unreachable).

An attempt that could not reach the gateway (DNS failure, connection refused, connect
timeout, TLS handshake failure; :class:`~claimkit.consumer.dispatch.Unsent`) sends nothing
and writes no record: its claim is handed back to pending. After
:data:`UNSENT_THRESHOLD` such attempts in a row on one queue the breaker **opens**: one
WARNING names the queue, the gateway's host and port and the reason; the queue's poller
stops peeking and claiming (work in flight carries on, held claims are still renewed);
``/readyz`` answers 503 ``gateway unreachable: <queue>`` and
``async_gateway_breaker_open`` is 1. The poller then probes the gateway with a bare
connection (TCP, and the TLS handshake for ``https``; nothing is sent), 0.5 s after the
opening, then doubling to every 5 s. The first probe that connects, or any attempt that
reached the gateway meanwhile (any HTTP status, or a request sent and not answered),
**closes** it: one INFO line, and claiming resumes.

An attempt that could not open a connection because no file descriptor was left
(``EMFILE``: this process's open-file limit; ``ENFILE``: the system's) is not the gateway
failing and does not count towards opening: its claim is handed back, the queue's poller
waits :data:`OUT_OF_FILES_WAIT_SECONDS` before claiming again (requests in flight finish
meanwhile and their connections are reused), and one WARNING names the limit and what to
change, repeated at most every :data:`OUT_OF_FILES_LOG_SECONDS` with the count of requests
handed back since (docs/dispatch.md#out-of-open-files).

One breaker per queue, even when queues share a gateway: its state, its metric and the
``/readyz`` reason are the queue's, as every other figure is, and the cost of not sharing is
at most :data:`UNSENT_THRESHOLD` more hand-backs per queue, never a record.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import trio

from claimkit.consumer import http as _http
from claimkit.consumer.dispatch import Retry, Unsent

if TYPE_CHECKING:
    from claimkit.consumer.dispatch import Outcome
    from claimkit.consumer.metrics import QueueMetrics

__all__ = [
    "OUT_OF_FILES_LOG_SECONDS",
    "OUT_OF_FILES_WAIT_SECONDS",
    "PROBE_FIRST_SECONDS",
    "PROBE_MAX_SECONDS",
    "PROBE_TIMEOUT_SECONDS",
    "UNSENT_THRESHOLD",
    "GatewayBreaker",
    "Probe",
    "host_port",
    "reached_gateway",
]

log = logging.getLogger("claimkit")

UNSENT_THRESHOLD = 3
"""Attempts in a row that could not reach the gateway before a queue's breaker opens. Not
configurable: a hand-back costs nothing but a claim, so a low fixed count is safe."""

PROBE_FIRST_SECONDS = 0.5
"""Seconds from the opening to the first probe; each failed probe doubles the wait."""

PROBE_MAX_SECONDS = 5.0
"""The longest wait between two probes, in seconds."""

PROBE_TIMEOUT_SECONDS = 5.0
"""How long one probe may take to connect (TCP and TLS), in seconds."""

OUT_OF_FILES_WAIT_SECONDS = 1.0
"""Seconds a queue's poller waits before claiming again after a connection could not be
opened for want of a file descriptor."""

OUT_OF_FILES_LOG_SECONDS = 60.0
"""The out-of-open-files WARNING of a queue is repeated at most this often, in seconds."""

Probe = Callable[[str, float], Awaitable[None]]
"""``(url, timeout seconds) -> None``: connect to ``url``'s host and port or raise
:class:`~claimkit.consumer.http.HttpError`."""


def reached_gateway(outcome: Outcome) -> bool:
    """Whether the attempt behind ``outcome`` reached the gateway: it had an HTTP response
    (any status; a retry always has one), or its request was written and got none."""
    if isinstance(outcome, Retry):
        return True
    if isinstance(outcome, Unsent):
        return False
    return outcome.record.status_code is not None or outcome.unanswered


def host_port(base_url: str) -> str:
    """``host:port`` of a gateway base URL (the default port of its scheme when it has
    none); never its user info or path."""
    parts = urlsplit(base_url)
    host = parts.hostname or "?"
    try:
        port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
    except ValueError:
        port = 0
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class GatewayBreaker:
    """The breaker of one queue: counts attempts that did not reach the gateway, opens after
    :data:`UNSENT_THRESHOLD` in a row, and probes until the gateway answers.

    Args:
        queue: the queue's name (log lines, the ``/readyz`` reason).
        base_url: the queue's ``igw_base_url``: what the probe connects to.
        metrics: the queue's metrics (``async_gateway_breaker_open``).
        threshold: attempts in a row that open it.
        probe: connects to a URL within a timeout in seconds, raising
            :class:`~claimkit.consumer.http.HttpError` when it cannot; default
            :func:`claimkit.consumer.http.probe`.

    Attributes:
        is_open: whether claiming from the queue is paused. Read from the health server's
            thread too (a plain bool).
        reason: why the last attempt or probe could not connect.
    """

    def __init__(
        self,
        queue: str,
        base_url: str,
        metrics: QueueMetrics,
        *,
        threshold: int = UNSENT_THRESHOLD,
        probe: Probe | None = None,
    ) -> None:
        self.queue = queue
        self.base_url = base_url
        self.where = host_port(base_url)
        self.is_open = False
        self.reason = ""
        self._metrics = metrics
        self._threshold = max(threshold, 1)
        self._probe = probe or _http.probe
        self._in_a_row = 0
        self._opened_at = 0.0
        self._hold_until = 0.0  # out of open files: no claim before this (trio clock)
        self._out_of_files = 0  # hand-backs for want of a file descriptor, since the last line
        self._out_of_files_logged: float | None = None
        metrics.gateway_breaker_open.set(0)

    def note(self, outcome: Outcome) -> None:
        """Count one attempt's ``outcome``: :class:`~claimkit.consumer.dispatch.Unsent`
        towards opening, unless it was for want of a file descriptor
        (:meth:`out_of_files`); one that reached the gateway (:func:`reached_gateway`)
        resets the count and closes the breaker; anything else (a deadline, a cancel) is
        neither."""
        if isinstance(outcome, Unsent):
            if outcome.out_of_files:
                self.out_of_files(outcome.reason)
            else:
                self.unsent(outcome.reason)
        elif reached_gateway(outcome):
            self.answered("a request was answered")

    def unsent(self, reason: str) -> None:
        """An attempt could not reach the gateway; the breaker opens at the threshold."""
        self.reason = reason
        self._in_a_row += 1
        if self.is_open or self._in_a_row < self._threshold:
            return
        self.is_open = True
        self._opened_at = trio.current_time()
        self._metrics.gateway_breaker_open.set(1)
        log.warning(
            "claimkit: gateway for queue %s (%s) is unreachable: %s; claiming from %s is "
            "paused until it answers",
            self.queue,
            self.where,
            reason,
            self.queue,
        )

    def out_of_files(self, reason: str) -> None:
        """A connection could not be opened for want of a file descriptor (``reason`` says
        which limit): not counted towards opening; claiming waits
        :data:`OUT_OF_FILES_WAIT_SECONDS`, and the WARNING goes out at most every
        :data:`OUT_OF_FILES_LOG_SECONDS`."""
        now = trio.current_time()
        self._hold_until = now + OUT_OF_FILES_WAIT_SECONDS
        self._out_of_files += 1
        last = self._out_of_files_logged
        if last is not None and now - last < OUT_OF_FILES_LOG_SECONDS:
            return
        log.warning(
            "claimkit: queue %s: %s; %d %s handed back (nothing was sent) and claiming waits "
            "%g s; raise the open-file limit (ulimit -n, systemd LimitNOFILE=) or lower "
            "--concurrency (docs/performance.md#how-to-size-concurrency)",
            self.queue,
            reason,
            self._out_of_files,
            "request" if self._out_of_files == 1 else "requests",
            OUT_OF_FILES_WAIT_SECONDS,
        )
        self._out_of_files_logged = now
        self._out_of_files = 0

    def answered(self, how: str = "a probe connected") -> None:
        """The gateway was reached: reset the count and close the breaker if it is open."""
        self._in_a_row = 0
        if not self.is_open:
            return
        self.is_open = False
        self._metrics.gateway_breaker_open.set(0)
        log.info(
            "claimkit: gateway for queue %s (%s) answers again (%s) after %.1f s; claiming resumes",
            self.queue,
            self.where,
            how,
            trio.current_time() - self._opened_at,
        )

    async def probe_until_answered(self) -> None:
        """While the breaker is open, probe the gateway with backoff
        (:data:`PROBE_FIRST_SECONDS` doubling to :data:`PROBE_MAX_SECONDS`, each probe
        bounded by :data:`PROBE_TIMEOUT_SECONDS`); return once it is closed, by a probe
        that connected or by an attempt that reached the gateway meanwhile. Returns at once
        when it is closed.

        First, while claiming waits after running out of file descriptors
        (:meth:`out_of_files`), it sleeps until that wait is over.

        Cancellation: at any point; a probe's half-open connection is closed and the
        breaker stays as it was.
        """
        if self._hold_until > trio.current_time():
            await trio.sleep_until(self._hold_until)
        wait = PROBE_FIRST_SECONDS
        while self.is_open:
            await trio.sleep(wait)
            if not self.is_open:
                break
            try:
                await self._probe(self.base_url, PROBE_TIMEOUT_SECONDS)
            except _http.HttpError as exc:
                self.reason = str(exc) or type(exc).__name__
                log.debug("gateway probe for queue %s: %s", self.queue, self.reason)
                wait = min(wait * 2, PROBE_MAX_SECONDS)
                continue
            self.answered()
