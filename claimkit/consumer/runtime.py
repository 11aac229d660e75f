"""What the consumer's tasks share: each queue as it runs, the server clock estimate, and
whether Redis answers (with the refusals that stop the consumer)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import trio
from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential_jitter

from claimkit.config import WrongKeyType
from claimkit.consumer.preflight import check_key_roles
from claimkit.store import StoreError, StorePermissionError, StoreUnavailable

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Mapping

    from claimkit.config import QueueConfig
    from claimkit.consumer.breaker import GatewayBreaker
    from claimkit.consumer.claims import HeldClaims
    from claimkit.consumer.dispatch import Target
    from claimkit.consumer.gates import Gate
    from claimkit.consumer.metrics import QueueMetrics
    from claimkit.consumer.pause import PauseWatch
    from claimkit.consumer.preflight import KeyRole, WrongTypeProbe
    from claimkit.protocol.ops import QueueProtocol

__all__ = ["QueueRuntime", "RedisHealth", "ServerClock", "until_answered"]

log = logging.getLogger("claimkit")

T = TypeVar("T")


@dataclass(eq=False)
class QueueRuntime:
    """One configured queue as the consumer runs it."""

    config: QueueConfig
    ops: QueueProtocol
    gate: Gate
    target: Target
    metrics: QueueMetrics
    claims: HeldClaims
    breaker: GatewayBreaker  # docs/dispatch.md#the-gateway-is-unreachable
    pause: PauseWatch  # whether its poller last found it paused (docs/protocol.md#pause)
    inflight: int = 0
    gate_error: str = ""  # the last gate error logged, so a stuck gate is logged once

    @property
    def name(self) -> str:
        return self.config.queue_name


class ServerClock:
    """The consumer's estimate of the Redis server clock (Unix seconds).

    Each script reply that carries the server's time sets it (:meth:`observe`); between
    replies it advances with trio's clock (:func:`trio.current_time`), so under a test's
    ``autojump_clock`` it moves with virtual time. Before the first reply it starts from
    this machine's clock (``time.time()``, read once). Needs a running trio loop.
    """

    def __init__(self) -> None:
        self._server: float | None = None  # the server's time at the last reply
        self._local = 0.0  # trio.current_time() at that moment

    def observe(self, server_now: float) -> None:
        """Take the server time a script just returned."""
        self._server, self._local = server_now, trio.current_time()

    def now(self) -> float:
        """The server clock as estimated now, Unix seconds."""
        if self._server is None:
            self.observe(time.time())
        assert self._server is not None
        return self._server + (trio.current_time() - self._local)


async def until_answered(what: str, call: Callable[[], Awaitable[T]]) -> T:
    """``await call()`` again while Redis is unavailable, with capped jittered backoff
    (0.05 s doubling to 2 s), saying so on the 1st, 10th and every 50th failure. The one
    retry idiom of the consumer: the periodic tasks instead try again on their next tick.

    Raises:
        StoreError: from ``call``, at once (a refusal: retrying would repeat it).
        Cancellation ends the wait at once.
    """

    def say(state: Any) -> None:
        exc = state.outcome.exception() if state.outcome else None
        if state.attempt_number in (1, 10) or state.attempt_number % 50 == 0:
            log.warning("%s: Redis unavailable (%s); retrying", what, exc)

    retrying = AsyncRetrying(
        retry=retry_if_exception_type(StoreUnavailable),
        wait=wait_exponential_jitter(multiplier=0.05, max=2.0),
        sleep=trio.sleep,
        before_sleep=say,
        reraise=True,
    )
    async for attempt in retrying:
        with attempt:
            result = await call()
    return result


def _is_wrongtype(exc: StoreError) -> bool:
    """Redis refused a command for a key of another type. coredis drops the ``WRONGTYPE``
    code from its message; redis-py keeps it."""
    text = str(exc)
    return "WRONGTYPE" in text or "wrong kind of value" in text


class RedisHealth:
    """Whether Redis answers (for ``/readyz`` and the pollers' backoff), and the refusals
    that stop the consumer.

    Args:
        first_wrong: the key-type probe (:data:`~claimkit.consumer.preflight.WrongTypeProbe`).
        roles: every key the consumer uses and its type
            (:func:`~claimkit.consumer.preflight.key_roles`).
        stop: called once a refusal turns out fatal (``Consumer.request_stop``).

    Attributes:
        ok: ``None`` until the first call answers or fails.
        answering_since: ``trio.current_time()`` of the first answer after the start or
            after the last failure (``None`` until then): how long Redis has been answering
            without a break, which gates the fast failover
            (docs/protocol.md#fast-failover).
        fatal: the fatal error, raised by ``Consumer.run`` at the end.
    """

    def __init__(
        self, first_wrong: WrongTypeProbe, roles: Mapping[str, KeyRole], stop: Callable[[], None]
    ) -> None:
        self.ok: bool | None = None
        self.answering_since: float | None = None
        self.fatal: WrongKeyType | StorePermissionError | None = None
        self._first_wrong = first_wrong
        self._roles = roles
        self._stop = stop

    def answered(self) -> None:
        """Note a Redis call that answered; say so once after an outage."""
        if self.ok is False:
            log.info("claimkit: Redis answers again")
        if self.ok is not True:
            self.answering_since = trio.current_time()
        self.ok = True

    def note_failure(self, where: str, exc: Exception) -> None:
        """Note a failed Redis call; say so once per outage, not once per retry."""
        if self.ok is not False or isinstance(exc, StoreError):
            log.warning("%s: %s; retrying with backoff", where, exc)
        self.ok = False
        self.answering_since = None

    async def failed(self, where: str, exc: Exception) -> None:
        """A call of ``where`` failed with ``exc``: stop if it is fatal (:meth:`is_fatal`),
        else note the failure (:meth:`note_failure`)."""
        if not await self.is_fatal(exc):
            self.note_failure(where, exc)

    async def describe(self, exc: Exception) -> str:
        """``exc`` in claimkit's words for a log line: a WRONGTYPE refusal (whose text is
        Redis's, with the script's name and line) becomes the key, what it holds and what it
        should hold (:func:`~claimkit.consumer.preflight.check_key_roles`, one pipeline of
        ``TYPE`` calls; the fatal error already found, when it is one); anything else, and a
        check that finds every key right or fails, is ``str(exc)`` without Redis's script
        text."""
        if not isinstance(exc, StoreError) or not _is_wrongtype(exc):
            return str(exc)
        if isinstance(self.fatal, WrongKeyType):
            return str(self.fatal)
        try:
            await check_key_roles(self._first_wrong, self._roles)
        except WrongKeyType as wrong:
            return str(wrong)
        except (StoreUnavailable, StoreError):
            pass
        return "Redis refused it: a key holds another type than claimkit expects"

    async def is_fatal(self, exc: Exception) -> bool:
        """After Redis refused a call with ``exc``: whether retrying cannot mend it, so the
        consumer stops as if asked to and ``Consumer.run`` raises the one-line error.

        Two refusals are of that kind:

        - an ACL refusal (:class:`~claimkit.store.StorePermissionError`, ``NOPERM``): the
          user may not run a command or touch a key the consumer needs; every retry would
          be refused the same way, with claims renewed and never finished. The line names
          the user, the command and the key (docs/security.md).
        - a key the consumer uses (:func:`~claimkit.consumer.preflight.key_roles`) now
          holding another type: each lease would run the same requests again and fail the
          same way.

        Only a WRONGTYPE refusal is looked into (one pipeline of ``TYPE`` calls): out of
        memory, READONLY or a lost connection say nothing about key types, and checking on
        each of them would load a Redis already in trouble. ``False`` when ``exc`` is
        neither, every key is right, or the check itself failed. ``True`` for anything
        once the consumer is stopping on a fatal error."""
        if self.fatal is not None:
            return True
        if isinstance(exc, StorePermissionError):
            self.fatal = exc
            log.error("claimkit: Redis refused a command under its ACL: %s; stopping", exc)
            self._stop()
            return True
        if not isinstance(exc, StoreError) or not _is_wrongtype(exc):
            return False
        try:
            await check_key_roles(self._first_wrong, self._roles)
        except WrongKeyType as wrong:
            self.fatal = wrong
            log.error("claimkit: %s; stopping", wrong)
            self._stop()
            return True
        except (StoreUnavailable, StoreError):
            pass
        return False
