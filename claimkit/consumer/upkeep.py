"""The consumer's periodic tasks: the heartbeat (docs/protocol.md#heartbeat), the reclaimer
(docs/protocol.md#reclaim), the retry mover (docs/protocol.md#retry-mover) and the queue
stats sampler (docs/metrics.md#queue-wide-gauges). Each runs until cancelled; a failed call
is tried again on its next tick (Redis going away never ends one)."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import trio

from claimkit.protocol.ops import RenewCode, orphans_message
from claimkit.protocol.stats import is_exporter
from claimkit.store import StoreError, StoreUnavailable

if TYPE_CHECKING:
    from collections.abc import Sequence

    from claimkit.config import Config
    from claimkit.consumer.claims import Claim
    from claimkit.consumer.runtime import QueueRuntime, RedisHealth, ServerClock
    from claimkit.protocol.stats import QueueGauges

__all__ = [
    "QUEUE_STATS_INTERVAL_SECONDS",
    "RETRY_LOOK_MAX_SECONDS",
    "RETRY_LOOK_MIN_SECONDS",
    "SAME_TICK_SECONDS",
    "Upkeep",
]

log = logging.getLogger("claimkit")

QUEUE_STATS_INTERVAL_SECONDS = 5.0
"""How often each queue's figures are read from Redis (``lua/queue-stats-7.lua``, one round
trip per queue) for the ``backlog`` gauge and the queue-wide gauges, seconds."""


SAME_TICK_SECONDS = 0.001
"""A claims renewal due within this of a liveness renewal is made in its place, seconds: the
two cadences meet (30 s is nine liveness ticks of 10 s / 3 at the defaults) without two
round trips a float rounding apart (docs/protocol.md#heartbeat)."""


RETRY_LOOK_MAX_SECONDS = 1.0
"""The longest the retry mover waits between two looks at a retry set, seconds: a retry due
at T moves by T + this (docs/protocol.md#retry-mover)."""

RETRY_LOOK_MIN_SECONDS = 0.01
"""The shortest wait before looking again at a retry set whose earliest member is not yet
due, seconds (the server clock is an estimate between replies)."""


class Upkeep:
    """The periodic tasks over every queue (start each of ``heartbeat``, ``reclaimer``,
    ``retry_mover`` and ``queue_stats_sampler`` in a nursery; cancel to end them).

    Args:
        config: the whole configuration (intervals, lease, ``max_deliveries``).
        queues: every queue; the retry mover drains each distinct retry set once, through
            the first queue's ops that parks into it.
        health: notes answers and failures; stops the consumer on a fatal refusal.
        clock: takes the server time each renew returns.
        gauges: the queue-wide gauges to publish (``None``: only ``backlog`` is set).
        consumer_id: this process's consumer id, for the exporter election
            (docs/metrics.md#one-exporter-per-queue); ``None``: it publishes every queue.
    """

    def __init__(
        self,
        config: Config,
        queues: Sequence[QueueRuntime],
        health: RedisHealth,
        clock: ServerClock,
        *,
        gauges: QueueGauges | None = None,
        consumer_id: str | None = None,
    ) -> None:
        self._config = config
        self._queues = queues
        self._health = health
        self._clock = clock
        self._gauges = gauges
        self._consumer_id = consumer_id
        self._retire = trio.Event()
        self.retired = trio.Event()
        """Set once the heartbeat has ended for good after :meth:`retire`."""
        self.heartbeat_running = False
        self._warned_same_id = False

    def retire(self) -> None:
        """Ask the heartbeat to end: it forgets this consumer's registry entry on every
        queue (``forget-consumers``), sets :attr:`retired` and returns. The graceful
        shutdown calls it after its sweep: doing it from the heartbeat's own task means no
        renewal can re-create the entry afterwards."""
        self._retire.set()

    # -- heartbeat (docs/protocol.md#heartbeat) ----------------------------------------------

    async def heartbeat(self) -> None:
        """Register this consumer on every queue (docs/protocol.md#consumers), then renew on
        two cadences until :meth:`retire` (then forget the entry) or cancellation
        (docs/protocol.md#heartbeat):

        - every ``claim_renew_interval_seconds`` (``clamp(lease / 3, 1 s, 30 s)``, counted
          from the start), a **claims tick**: each queue's held claims and the consumer's
          liveness entry in one round trip (:meth:`renew`);
        - every ``liveness_renew_interval_seconds`` (the liveness TTL / 3) after the last
          tick, a **liveness tick**: only the liveness entry, one small call per queue
          (:meth:`renew_liveness`). A claims tick due within :data:`SAME_TICK_SECONDS`
          of it is made in its place, so one tick is one round trip per queue.

        A queue whose claims renewal failed has its claims renewed at the next tick of
        either kind; a queue whose registration failed is registered again next tick. A
        tick that ends after the next claims tick was due pushes the claims schedule back:
        the next one is a whole interval after that tick ended."""
        claims_every = self._config.claim_renew_interval_seconds
        live_every = self._config.liveness_renew_interval_seconds
        self.heartbeat_running = True
        try:
            unregistered = list(self._queues)
            owed: set[str] = set()  # queues whose claims renewal failed
            now = trio.current_time()
            next_claims = now + claims_every
            while True:
                unregistered = [q for q in unregistered if not await self._register(q)]
                next_live = math.inf if live_every is None else now + live_every
                with trio.move_on_at(min(next_claims, next_live)):
                    await self._retire.wait()
                if self._retire.is_set():
                    await self._forget_all()
                    return
                now = trio.current_time()
                claims_due = next_claims - now <= SAME_TICK_SECONDS
                for q in self._queues:
                    with_claims = claims_due or q.name in owed
                    try:
                        if with_claims:
                            await self.renew(q)
                        else:
                            await self.renew_liveness(q)
                    except (StoreUnavailable, StoreError) as exc:
                        if with_claims:
                            owed.add(q.name)
                        await self._health.failed(
                            f"heartbeat {q.name} (claims are renewed once it answers)", exc
                        )
                    else:
                        if with_claims:
                            owed.discard(q.name)
                if claims_due:
                    next_claims += claims_every
                    ended = trio.current_time()
                    if next_claims <= ended:
                        next_claims = ended + claims_every
        finally:
            self.heartbeat_running = False
            self.retired.set()

    async def _register(self, q: QueueRuntime) -> bool:
        try:
            registered = await q.ops.register()
        except (StoreUnavailable, StoreError) as exc:
            await self._health.failed(f"register {q.name} (registered once it answers)", exc)
            return False
        if registered is not None:
            server_now, other = registered
            self._health.answered()
            self._clock.observe(server_now)
            if other is not None and not self._warned_same_id:
                self._warned_same_id = True
                log.warning(
                    "consumer id %s is in use by another live process too (host %s, pid %s, "
                    "on %s): the two share one liveness entry, so if one dies the other keeps "
                    "it alive and the dead one's claims wait for their whole lease; give each "
                    "process its own id (--consumer-id; docs/operations.md#consumers)",
                    self._config.consumer_id,
                    other.get("host", "?"),
                    other.get("pid", "?"),
                    q.name,
                )
        return True

    async def _forget_all(self) -> None:
        """Remove this consumer's registry entry on every queue; a failure is logged (the
        entry then lapses and shows dead until forgotten, docs/operations.md#consumers)."""
        for q in self._queues:
            try:
                await q.ops.forget_self()
            except (StoreUnavailable, StoreError) as exc:
                why = await self._health.describe(exc)
                log.warning("forget %s: %s; the consumer's entry will lapse", q.name, why)

    async def renew(self, q: QueueRuntime) -> None:
        """Renew ``q``'s held claims in one round trip; a claim found taken over (-1) or
        released elsewhere (0) is dropped and its work cancelled: its result would be a
        duplicate. A claim whose ack is under way is only dropped (its work is done, and
        the ack counts it): an ack across slots has moved it into the outbox before it
        answers (docs/topology.md#acks-across-slots), so the renew finds no claim. The tick's
        lost claims are logged together (:meth:`HeldClaims.drop_lost`): one WARNING per
        kind with the count and the first few ids."""
        held = q.claims.all()
        if not held and self._config.consumer_liveness_ttl_seconds <= 0:
            return
        server_now, codes = await q.ops.renew(
            [(c.env.id, c.token, c.env.deadline) for c in held],
            self._config.claim_lease_ttl_seconds,
        )
        self._health.answered()
        self._clock.observe(server_now)
        taken: list[Claim] = []
        released: list[Claim] = []
        for claim, code in zip(held, codes, strict=True):
            if code == RenewCode.RENEWED or not q.claims.holds(claim):
                continue
            if claim.acking:
                q.claims.drop_acking(claim)
            elif code == RenewCode.TAKEN:
                taken.append(claim)
            else:
                released.append(claim)
        q.claims.drop_lost(taken, released)
        q.claims.show_depth()

    async def renew_liveness(self, q: QueueRuntime) -> None:
        """Renew only this consumer's liveness entry on ``q`` (one small call,
        :meth:`QueueOps.renew_liveness`); nothing while the registry is off."""
        server_now = await q.ops.renew_liveness()
        if server_now is None:
            return
        self._health.answered()
        self._clock.observe(server_now)

    # -- reclaim (docs/protocol.md#reclaim) --------------------------------------------------

    async def reclaimer(self) -> None:
        """Each ``claim_reclaim_interval_ms``, a full reclaim run on every queue, preceded by
        the fast failover (docs/protocol.md#fast-failover) once Redis has answered for one
        liveness TTL (:meth:`may_expire_owners`) and while some consumer of the queue is
        alive."""
        interval = self._config.claim_reclaim_interval_ms / 1000
        while True:
            for q in self._queues:
                await self._reclaim(q)
            await trio.sleep(interval)

    def may_expire_owners(self) -> bool:
        """Whether the fast failover may run now: the registry is on and Redis has answered
        this process for at least ``consumer_liveness_ttl_seconds`` without an outage in
        between (:attr:`RedisHealth.answering_since`). Right after an outage every
        consumer's entry may have lapsed for want of Redis, not because it died; one TTL
        later every live one has renewed (docs/protocol.md#fast-failover)."""
        ttl = self._config.consumer_liveness_ttl_seconds
        since = self._health.answering_since
        return ttl > 0 and since is not None and trio.current_time() - since >= ttl

    async def _reclaim(self, q: QueueRuntime) -> None:
        try:
            if self.may_expire_owners():
                # No consumer alive (this one's entry lapsed too): an outage, not a death.
                server_now, cut = await q.ops.expire_owners(require_alive=True)
                self._clock.observe(server_now)
                if cut:
                    log.warning(
                        "reclaim %s: %d claims of dead consumers handed on "
                        "(their liveness entries lapsed)",
                        q.name,
                        cut,
                    )
            counts = await q.ops.reclaim(self._config.max_deliveries)
        except (StoreUnavailable, StoreError) as exc:
            if not await self._health.is_fatal(exc):
                log.warning("reclaim %s: %s; retrying next interval", q.name, exc)
            return
        if counts.orphans:
            log.warning(
                'reclaim %s: %s; see docs/operations.md, "Eviction"',
                q.name,
                orphans_message(counts),
            )
        if counts.redelivered or counts.dead or counts.leases_restored:
            log.info(
                "reclaim %s: redelivered=%d dead_lettered=%d ghosts=%d leases_restored=%d",
                q.name,
                counts.redelivered,
                counts.dead,
                counts.ghosts,
                counts.leases_restored,
            )
        self._health.answered()
        q.claims.count_reclaimed(counts)

    # -- retry mover (docs/protocol.md#retry-mover) ------------------------------------------

    async def retry_mover(self) -> None:
        """Move every due retry member back to its queue: one mover per retry set
        (standalone: the set every queue shares, drained through the first queue's ops;
        Redis Cluster: each queue's own set,
        docs/topology.md#retries-cancellation-and-the-producer).

        Each look is one read-only ``ZRANGE <set> 0 0 WITHSCORES``
        (:meth:`QueueOps.next_retry_due`); the mover script runs only when the earliest
        member is due on the server clock (docs/protocol.md#retry-mover). An empty set is
        looked at again after ``min(1 s, poll_interval)``, doubling each time it is still
        empty up to :data:`RETRY_LOOK_MAX_SECONDS`; a set whose earliest member is not yet
        due is looked at again when it is, at most that long ahead. So a member due at T
        moves by T + :data:`RETRY_LOOK_MAX_SECONDS` (Redis answering)."""
        base = min(RETRY_LOOK_MAX_SECONDS, self._config.poll_interval_ms / 1000)
        movers: dict[str, QueueRuntime] = {}
        for q in self._queues:
            movers.setdefault(q.ops.retry_set, q)
        waits = dict.fromkeys(movers, base)
        next_look = dict.fromkeys(movers, trio.current_time())
        while True:
            now = trio.current_time()
            for name, q in movers.items():
                if next_look[name] > now:
                    continue
                waits[name] = await self._look_and_move(q, waits[name], base)
                next_look[name] = trio.current_time() + waits[name]
            await trio.sleep_until(min(next_look.values()))

    async def _look_and_move(self, q: QueueRuntime, wait: float, base: float) -> float:
        """One look at ``q``'s retry set, and a move when something is due; returns how
        long to wait before the next look, seconds."""
        try:
            due = await q.ops.next_retry_due()
            if due is None:
                return min(RETRY_LOOK_MAX_SECONDS, wait * 2)
            ahead = due - self._clock.now()
            if ahead > 0:
                return min(RETRY_LOOK_MAX_SECONDS, max(ahead, RETRY_LOOK_MIN_SECONDS))
            _moved, dead = await q.ops.move_retries()
            if dead:
                log.warning(
                    "retry mover: %d unroutable members moved to %s:dead", dead, q.ops.retry_set
                )
        except (StoreUnavailable, StoreError) as exc:
            await self._health.failed("retry mover", exc)
        return base

    # -- queue stats (docs/metrics.md#queue-wide-gauges) -------------------------------------

    async def queue_stats_sampler(self) -> None:
        """Each :data:`QUEUE_STATS_INTERVAL_SECONDS`, :meth:`sample_queue_stats`."""
        while True:
            await self.sample_queue_stats()
            await trio.sleep(QUEUE_STATS_INTERVAL_SECONDS)

    async def sample_queue_stats(self) -> None:
        """Read each queue's figures (one round trip per queue), set its ``backlog`` gauge
        (every process: upstream's per-process gauge) and, when this process is the queue's
        exporter (:func:`~claimkit.protocol.stats.is_exporter`), publish its queue-wide
        gauges; else withdraw them, so one process exports each queue. A failed read keeps
        the last values: the pollers report Redis trouble, and a missed sample is harmless."""
        for q in self._queues:
            try:
                stats = await q.ops.queue_stats()
            except (StoreUnavailable, StoreError):
                continue
            q.metrics.backlog.set(stats.pending)
            if self._gauges is None:
                continue
            if is_exporter(stats.exporter, self._consumer_id):
                self._gauges.publish(q.name, stats)
            else:
                self._gauges.withdraw(q.name)
