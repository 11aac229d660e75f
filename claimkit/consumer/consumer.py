"""``claimkit serve``: the durable consumer's tasks in one trio nursery.

Inside :meth:`Consumer.run` run, scoped together (docs/protocol.md#claim-protocol,
docs/protocol.md#tasks-and-shutdown):

- a **poller** per queue: peek -> validate (dead-letter what is malformed) -> gate -> claim;
  each claimed request starts a **worker** task (at most ``concurrency`` at once)
  (:mod:`claimkit.consumer.poll`);
- the **acker**: terminal records and retry parks from every worker, batched per queue into
  one script call (docs/protocol.md#ack, docs/protocol.md#park-for-retry;
  :mod:`claimkit.consumer.settle`);
- the **heartbeat**: renews every held claim each ``clamp(ttl/3, 1, 30)`` seconds and
  cancels the work of any claim found taken over or released elsewhere, and the consumer's
  liveness entry alone each ``consumer_liveness_ttl_seconds / 3`` between those
  (docs/protocol.md#heartbeat); the **reclaimer** (docs/protocol.md#reclaim), the **retry
  mover** (docs/protocol.md#retry-mover) and the queue stats sampler
  (:mod:`claimkit.consumer.upkeep`).

The claims held and what becomes of them: :mod:`claimkit.consumer.claims`. Shutdown
(docs/protocol.md#tasks-and-shutdown) runs in phases: stop claiming; give in-flight work
``drain_timeout`` seconds; cancel it; flush the acker; then the **sweep** hands every claim
still held back to pending, shielded under its own deadline. Redis going away never ends the
process: each task retries with backoff and carries on.
"""

from __future__ import annotations

import enum
import logging
import random
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING

import trio

from claimkit.config import ConfigError
from claimkit.consumer.breaker import GatewayBreaker
from claimkit.consumer.claims import HeldClaims, Summary
from claimkit.consumer.dispatch import Outcome, Target, dispatch, open_http_client
from claimkit.consumer.gates import make_gate
from claimkit.consumer.metrics import Metrics
from claimkit.consumer.pause import PauseWatch
from claimkit.consumer.poll import Handler, Poller
from claimkit.consumer.preflight import (
    KeyRole,
    WrongTypeProbe,
    check_key_roles,
    key_roles,
)
from claimkit.consumer.runtime import QueueRuntime, RedisHealth, ServerClock, until_answered
from claimkit.consumer.settle import SWEEP_TIMEOUT_SECONDS, Settler
from claimkit.consumer.upkeep import Upkeep
from claimkit.protocol.ops import QueueProtocol, ReleaseCode
from claimkit.store import StoreError, StoreUnavailable

if TYPE_CHECKING:
    from claimkit.config import Config, QueueConfig
    from claimkit.consumer.http import HttpClient
    from claimkit.protocol.models import Envelope, TerminalRecord
    from claimkit.store import Store

__all__ = [
    "CANCEL_GRACE_SECONDS",
    "HURRY_SECONDS",
    "SWEEP_TIMEOUT_SECONDS",
    "Consumer",
    "Handler",
    "KeyRole",
    "OpsFactory",
    "QueueRuntime",
    "ServerClock",
    "Summary",
    "WrongTypeProbe",
    "check_key_roles",
    "key_roles",
]

log = logging.getLogger("claimkit")

HURRY_SECONDS = 1.0
"""After a second SIGTERM/SIGINT, how long the remaining shutdown steps may still take."""

CANCEL_GRACE_SECONDS = 1.0
"""After in-flight work is cancelled, how long the shutdown waits for it to unwind before
sweeping claims whose task ignores cancellation."""

OpsFactory = Callable[["QueueConfig"], QueueProtocol]
"""``(queue config) -> protocol layer of that queue``: how :class:`Consumer` gets the object it
reaches Redis through (:class:`~claimkit.protocol.ops.QueueProtocol`). The default builds a
:class:`~claimkit.protocol.ops.QueueOps` on the consumer's store; tests pass a fake."""


class _Phase(enum.Enum):
    RUNNING = "running"
    DRAINING = "draining"
    STOPPED = "stopped"


class Consumer:
    """The durable consumer of every configured queue.

    Args:
        config: the whole configuration (docs/configuration.md).
        store: an open store on ``config.url``.
        handler: what to do with a claimed request; default HTTP dispatch (docs/dispatch.md).
        http_client: the client the default handler uses (one is opened if ``None``).
        metrics: where to count (a fresh registry if ``None``).
        rng: randomness for backoff jitter and the redis gate (seeded in tests).
        on_settled: called (synchronously, from the acker) once per request whose outcome
            was written: ``(envelope, record)`` after its ack script ran (``record`` is what
            was acked; a suppressed duplicate too), ``(envelope, None)`` after it was parked
            for retry. A claim handed back because the gateway could not be reached is no
            outcome and is not reported. For benchmarks and embedding; it must not block or raise.
        ops_factory: builds each queue's protocol layer (:data:`OpsFactory`); default a
            :class:`~claimkit.protocol.ops.QueueOps` on ``store``. The consumer reaches Redis
            only through these objects (the retry mover and the key-type check through the
            first queue's), except a ``redis`` gate, which reads its budget key on ``store``.
            A fake must provide what :class:`~claimkit.protocol.ops.QueueProtocol` lists.

    Raises:
        ConfigError: ``config.queues`` is empty (``load_config`` refuses that too).
        ValueError: a queue's ``gate_params`` are unusable (one line).

    Timing (heartbeat cadence, drain grace, hurry, acker linger, reclaim and retry-mover
    cadence, queue stats sampling) runs on trio's clock, and so does :meth:`now` between script
    replies (:class:`ServerClock`): a test may run the consumer under ``autojump_clock``.
    :meth:`now` is therefore called from inside a trio run only.
    """

    def __init__(
        self,
        config: Config,
        store: Store,
        *,
        handler: Handler | None = None,
        http_client: HttpClient | None = None,
        metrics: Metrics | None = None,
        rng: random.Random | None = None,
        on_settled: Callable[[Envelope, TerminalRecord | None], None] | None = None,
        ops_factory: OpsFactory | None = None,
    ) -> None:
        if not config.queues:
            raise ConfigError("queues must list at least one queue")
        self.config = config
        self.store = store
        self.metrics = metrics or Metrics()
        self.summary = Summary()
        self.clock = ServerClock()
        self._rng = rng or random.Random()
        self._http = http_client
        self._own_http = http_client is None and handler is None

        def real_ops(q: QueueConfig) -> QueueProtocol:
            return config.ops_for(store, q, consumer=True)

        make_ops = ops_factory or real_ops
        self.queues = [self._queue(q, make_ops(q), store) for q in config.queues]
        self._phase = _Phase.RUNNING
        self._stop = trio.Event()
        self._hurry = trio.Event()
        self._swept = False
        self._budget_end: float | None = None
        # a key found of another type, or an ACL refusal, stops the consumer (RedisHealth)
        self._health = RedisHealth(
            self.queues[0].ops.first_wrong_type, key_roles(config), self.request_stop
        )
        self._settler = Settler(
            batch_size=config.batch_size,
            health=self._health,
            clock=self.clock,
            on_settled=on_settled,
        )
        self._poller = Poller(
            config,
            self.queues,
            handler=handler or self._dispatch,
            settler=self._settler,
            health=self._health,
            clock=self.clock,
        )
        self._upkeep = Upkeep(
            config,
            self.queues,
            self._health,
            self.clock,
            gauges=self.metrics.queue_gauges,
            # Without a registry entry (liveness TTL 0) this process takes no part in the
            # exporter election and publishes every queue (docs/metrics.md).
            consumer_id=config.consumer_id if config.consumer_liveness_ttl_seconds > 0 else None,
        )

    def _queue(self, q: QueueConfig, ops: QueueProtocol, store: Store) -> QueueRuntime:
        metrics = self.metrics.for_queue(q)
        return QueueRuntime(
            config=q,
            ops=ops,
            gate=make_gate(q, store, self._rng),
            target=Target(q.igw_base_url, q.request_path_url, q.inference_objective),
            metrics=metrics,
            claims=HeldClaims(q.queue_name, self.summary, metrics),
            breaker=GatewayBreaker(q.queue_name, q.igw_base_url, metrics),
            pause=PauseWatch(q.queue_name, metrics.paused),
        )

    # -- public ------------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Begin the graceful shutdown (docs/protocol.md#tasks-and-shutdown). A second call
        skips the drain wait."""
        if self._stop.is_set():
            self._hurry.set()
        self._stop.set()

    def ready(self) -> tuple[bool, str]:
        """For ``/readyz``: ready while Redis answers, no shutdown has begun and no queue's
        gateway breaker is open (``gateway unreachable: <queue>[, <queue>...]``,
        docs/metrics.md#endpoints). Called from the health server's thread."""
        if self._phase is not _Phase.RUNNING:
            return False, "shutting down"
        if not self._health.ok:
            return False, "redis unavailable"
        broken = [q.name for q in self.queues if q.breaker.is_open]
        if broken:
            return False, "gateway unreachable: " + ", ".join(broken)
        return True, "ok"

    def held_count(self) -> int:
        """Claims held now, over every queue."""
        return sum(len(q.claims) for q in self.queues)

    def now(self) -> float:
        """The Redis server clock, estimated from the last script reply (Unix seconds;
        :class:`ServerClock`). Call it inside trio."""
        return self.clock.now()

    async def run(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> Summary:
        """Consume until :meth:`request_stop` (or cancellation), then shut down
        (docs/protocol.md#tasks-and-shutdown).

        Returns:
            The :class:`Summary` of this process.

        Raises:
            WrongKeyType: Redis refused a call and a key the consumer uses turned out to
                hold another type than the key layout says (docs/protocol.md#keys; one line
                naming it). Retrying cannot mend that, so the consumer stopped (an
                unrecoverable error, docs/protocol.md#tasks-and-shutdown), with the same
                shutdown and sweep as :meth:`request_stop`.
            StorePermissionError: likewise, for a command or key Redis's ACL refuses
                (docs/security.md).

        Cancellation: if the caller cancels instead of calling :meth:`request_stop`, the
        sweep still runs (shielded, ``SWEEP_TIMEOUT_SECONDS``) and returns every held claim.
        """
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._settler.run)
                nursery.start_soon(self._upkeep.heartbeat)
                nursery.start_soon(self._upkeep.reclaimer)
                nursery.start_soon(self._upkeep.retry_mover)
                nursery.start_soon(self._upkeep.queue_stats_sampler)
                await nursery.start(self._poller.run)
                task_status.started()
                await self._stop.wait()
                await self._shutdown()
                # Sweep before the nursery closes: a task that ignores cancellation keeps the
                # nursery open, but must not keep its claim (docs/protocol.md#release-and-sweep).
                await self._within_budget(self._sweep)
                nursery.cancel_scope.cancel()
        finally:
            await self._finish()
        if self._health.fatal is not None:
            log.info("%s", self.summary.line())
            raise self._health.fatal from None
        log.debug("%s", self.summary.line())
        return self.summary

    async def _finish(self) -> None:
        self._phase = _Phase.STOPPED
        if not self._swept:  # an error or a cancellation skipped the orderly shutdown
            await self._within_budget(self._sweep)
        held = self.held_count()
        # Claims given up after a refused ack were logged then; count them too.
        self.summary.left_to_lapse = held + sum(q.claims.given_up for q in self.queues)
        if held:
            log.error(
                "claimkit: %d claims could not be returned; their leases will lapse and "
                "any instance's reclaimer will redeliver them",
                held,
            )
        if self._http is not None and self._own_http:
            with trio.CancelScope(shield=True), trio.move_on_after(2):
                await self._http.aclose()

    # -- shutdown ----------------------------------------------------------------------------

    async def _shutdown(self) -> None:
        self._phase = _Phase.DRAINING
        self._poller.stop_claiming()
        log.info(
            "claimkit: stopping: %d claims held, draining up to %.1fs",
            self.held_count(),
            self.config.drain_timeout_seconds,
        )
        with trio.move_on_after(self.config.drain_timeout_seconds):
            async with trio.open_nursery() as wait:

                async def hurry() -> None:
                    await self._hurry.wait()
                    wait.cancel_scope.cancel()

                wait.start_soon(hurry)
                await self._poller.workers_done.wait()
                wait.cancel_scope.cancel()
        self._poller.cancel_work()
        with trio.move_on_after(CANCEL_GRACE_SECONDS):
            await self._poller.workers_done.wait()
        # Acks already handed to the acker are flushed before the sweep, so a finished
        # request is acked rather than released and run again.
        self._settler.close()
        await self._within_budget(self._settler.done.wait)

    async def _within_budget(self, fn: Callable[[], Awaitable[object]]) -> None:
        """Run a shutdown step shielded from cancellation, until it finishes or the shutdown
        budget runs out: ``SWEEP_TIMEOUT_SECONDS`` from the first step, cut to ``HURRY_SECONDS``
        from the moment a second signal arrives (docs/protocol.md#tasks-and-shutdown)."""
        if self._budget_end is None:
            self._budget_end = trio.current_time() + SWEEP_TIMEOUT_SECONDS
        with trio.CancelScope(shield=True, deadline=self._budget_end) as scope:
            async with trio.open_nursery() as nursery:

                async def hurry() -> None:
                    await self._hurry.wait()
                    scope.deadline = min(scope.deadline, trio.current_time() + HURRY_SECONDS)

                nursery.start_soon(hurry)
                await fn()
                nursery.cancel_scope.cancel()

    async def _sweep(self) -> None:
        """Hand every claim this process still holds back to pending
        (docs/protocol.md#release-and-sweep), then remove this consumer's registry entry
        (docs/protocol.md#consumers): through the heartbeat while it runs, so no renewal
        can bring the entry back, else directly."""
        self._swept = True
        for q in self.queues:
            held = q.claims.all()
            if not held:
                continue
            claims = [(c.env.id, c.token, None) for c in held]
            try:
                codes = await until_answered(f"sweep {q.name}", partial(q.ops.release, claims))
            except (StoreUnavailable, StoreError) as exc:
                log.error(
                    "sweep %s: %s; %d claims will lapse and be reclaimed", q.name, exc, len(claims)
                )
                continue
            q.claims.swept(held, codes)
            log.info(
                "sweep %s: released %d of %d claims",
                q.name,
                codes.count(ReleaseCode.RELEASED),
                len(codes),
            )
        if self._upkeep.heartbeat_running:
            self._upkeep.retire()
            await self._upkeep.retired.wait()
            return
        for q in self.queues:
            try:
                await q.ops.forget_self()
            except (StoreUnavailable, StoreError) as exc:
                log.warning("forget %s: %s; the consumer's entry will lapse", q.name, exc)

    # -- the default handler -----------------------------------------------------------------

    async def _dispatch(self, q: QueueRuntime, env: Envelope, now: float) -> Outcome:
        if self._http is None:
            self._http = open_http_client(self.config.concurrency)
        return await dispatch(
            self._http,
            env,
            q.target,
            request_timeout=self.config.request_timeout_seconds,
            now=now,
            rng=self._rng,
        )
