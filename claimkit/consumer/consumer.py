"""``claimkit serve``: the durable consumer's tasks in one trio nursery.

Inside :meth:`Consumer.run` run, scoped together (docs/protocol.md#claim-protocol,
docs/protocol.md#tasks-and-shutdown):

- a **poller** per queue: peek -> validate (dead-letter what is malformed) -> gate -> claim;
  each claimed request starts a **worker** task (at most ``concurrency`` at once);
- the **acker**: terminal records and retry parks from every worker, batched per queue into
  one script call (docs/protocol.md#ack, docs/protocol.md#park-for-retry);
- the **heartbeater**: renews every held claim each ``clamp(ttl/3, 1, 30)`` seconds and
  cancels the work of any claim found stolen or gone (docs/protocol.md#heartbeat);
- the **reclaimer** (docs/protocol.md#reclaim) and the **retry mover**
  (docs/protocol.md#retry-mover).

Shutdown (docs/protocol.md#tasks-and-shutdown) runs in phases: stop claiming; give in-flight
work ``drain_timeout`` seconds; cancel it; flush the acker; then the **sweep** hands every
claim still held back to pending, shielded under its own deadline. Redis going away never
ends the process: each task retries with backoff and carries on.
"""

from __future__ import annotations

import enum
import logging
import math
import random
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import trio
from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential_jitter

from claimkit.config import ConfigError
from claimkit.consumer.dispatch import Done, Outcome, Retry, Target, dispatch, open_http_client
from claimkit.consumer.gates import Gate, GateError, budget_key, make_gate
from claimkit.consumer.metrics import Metrics, QueueMetrics
from claimkit.ops.inspect import WrongKeyType, first_wrong_type
from claimkit.protocol import keys as _keys
from claimkit.protocol.models import (
    Envelope,
    ErrorCode,
    Invalid,
    TerminalRecord,
    parse_member,
    retry_member,
)
from claimkit.protocol.ops import (
    AckItem,
    ClaimCode,
    QueueOps,
    move_retries,
    new_token,
    orphans_message,
)
from claimkit.store import StoreError, StorePermissionError, StoreUnavailable

if TYPE_CHECKING:
    from claimkit.config import Config, QueueConfig
    from claimkit.consumer.http import HttpClient
    from claimkit.store import Store

__all__ = ["Consumer", "Handler", "KeyRole", "QueueRuntime", "Summary", "check_keys", "key_roles"]

log = logging.getLogger("claimkit")

SWEEP_TIMEOUT_SECONDS = 10.0
"""The shielded sweep's own deadline (docs/protocol.md#tasks-and-shutdown). Claims it cannot
return lapse and are reclaimed by any instance (docs/protocol.md#reclaim): nothing is lost,
only delayed."""

HURRY_SECONDS = 1.0
"""After a second SIGTERM/SIGINT, how long the remaining shutdown steps may still take."""

CANCEL_GRACE_SECONDS = 1.0
"""After in-flight work is cancelled, how long the shutdown waits for it to unwind before
sweeping claims whose task ignores cancellation."""

ACK_BATCH_MAX = 2000

ACK_LINGER_SECONDS = 0.002
"""How long the acker waits for more finished requests before it flushes a batch smaller
than ``batch_size``. Without it, at ~1.5k requests/s an ack carries 2-3 records (0.4 ack
scripts per request); with it, about ``batch_size``. Adds at most this to result latency
(see docs/performance.md)."""

Handler = Callable[["QueueRuntime", Envelope, float], Awaitable[Outcome]]
"""``(queue, envelope, server_now) -> Outcome``: what to do with one claimed request.
The default sends it to the inference gateway (docs/dispatch.md)."""


class _Phase(enum.Enum):
    RUNNING = "running"
    DRAINING = "draining"
    STOPPED = "stopped"


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
class _Held:
    """A claim this process holds."""

    env: Envelope
    token: str
    cancelled: bool = False  # the claim script found a cancel marker
    scope: trio.CancelScope | None = None
    lost: bool = False  # the heartbeat found it stolen or gone


@dataclass(eq=False)
class _Job:
    """A terminal record or a retry park on its way to the acker."""

    queue: QueueRuntime
    held: _Held
    record: TerminalRecord | None = None
    retry_delay: float = 0.0
    retry_last: TerminalRecord | None = None  # the attempt's HTTP response, parked with it
    done: trio.Event = field(default_factory=trio.Event)
    owned: bool = False


@dataclass(eq=False)
class QueueRuntime:
    """One configured queue as the consumer runs it."""

    config: QueueConfig
    ops: QueueOps
    gate: Gate
    target: Target
    metrics: QueueMetrics
    held: dict[str, _Held] = field(default_factory=dict)
    inflight: int = 0
    gate_error: str = ""  # the last gate error logged, so a stuck gate is logged once

    @property
    def name(self) -> str:
        return self.config.queue_name


@dataclass(frozen=True, slots=True)
class KeyRole:
    """What a key is to ``serve``: its Redis ``TYPE`` name (docs/protocol.md#keys) and a
    description for one-line errors, with ``{}`` where the key's name goes
    (``"result list {} of queue 'q'"``)."""

    kind: str
    what: str

    def name(self, key: str) -> str:
        return self.what.format(repr(key))


def key_roles(config: Config) -> dict[str, KeyRole]:
    """Every key ``serve`` uses whose Redis type the config tells (docs/protocol.md#keys), by
    name: each queue's own keys, the retry set and its dead set, each queue's result list, the
    global result list, and a ``redis`` gate's budget key. Per-request keys are not among them.

    Raises:
        ConfigError: one name would have to be two types at once (a queue's result list
            named like another queue's dead set, say), as one line.
    """
    roles: dict[str, KeyRole] = {}

    def want(key: str, kind: str, what: str) -> None:
        seen = roles.setdefault(key, KeyRole(kind, what))
        if seen.kind != kind:
            raise ConfigError(
                f"{KeyRole(kind, what).name(key)} is also the {seen.name(key)}: one key "
                f"cannot be both {_keys.type_name(seen.kind)} and {_keys.type_name(kind)}"
            )

    for q in config.queues:
        k = _keys.QueueKeys.for_queue(q.queue_name)
        of = f"of queue {q.queue_name!r}"
        want(k.pending, "zset", "queue key {}")
        want(k.claimed, "hash", f"claimed hash {{}} {of}")
        want(k.owners, "hash", f"claim-owners hash {{}} {of}")
        want(k.index, "zset", f"claims index {{}} {of}")
        want(k.deliveries, "hash", f"deliveries hash {{}} {of}")
        want(k.dead, "zset", f"dead set {{}} {of}")
    want(config.retry_queue_name, "zset", "retry set {}")
    want(_keys.retry_dead(config.retry_queue_name), "zset", "retry dead set {}")
    for q in config.queues:
        if q.result_queue_name:
            want(q.result_queue_name, "list", f"result list {{}} of queue {q.queue_name!r}")
    want(config.result_queue_name, "list", "global result list {}")
    for q in config.queues:
        try:
            key = budget_key(q)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if key:
            want(key, "string", f"gate budget key {{}} of queue {q.queue_name!r}")
    return roles


async def check_keys(store: Store, roles: dict[str, KeyRole]) -> None:
    """Check that every existing key of ``roles`` has its type; a missing key is fine.
    One pipelined round trip of ``TYPE`` calls.

    Raises:
        WrongKeyType: the first key holding another type, as one line naming the key, what
            it holds and what it should hold.
        StoreUnavailable, StoreError: from the store.
    """
    wrong = await first_wrong_type(store, {name: role.kind for name, role in roles.items()})
    if wrong is not None:
        name, found, want = wrong
        raise WrongKeyType(
            f"{roles[name].name(name)} holds {_keys.type_name(found)}, not {_keys.type_name(want)}"
        )


def _is_wrongtype(exc: StoreError) -> bool:
    """Redis refused a command for a key of another type. coredis drops the ``WRONGTYPE``
    code from its message; redis-py keeps it."""
    text = str(exc)
    return "WRONGTYPE" in text or "wrong kind of value" in text


def _retrying(what: str) -> AsyncRetrying:
    """Retry a Redis call while Redis is unavailable, with capped jittered backoff."""

    def say(state: Any) -> None:
        exc = state.outcome.exception() if state.outcome else None
        if state.attempt_number in (1, 10) or state.attempt_number % 50 == 0:
            log.warning("%s: Redis unavailable (%s); retrying", what, exc)

    return AsyncRetrying(
        retry=retry_if_exception_type(StoreUnavailable),
        wait=wait_exponential_jitter(multiplier=0.05, max=2.0),
        sleep=trio.sleep,
        before_sleep=say,
        reraise=True,
    )


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
            for retry. For benchmarks and embedding; it must not block or raise.
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
    ) -> None:
        self.config = config
        self._on_settled = on_settled
        self.store = store
        self.metrics = metrics or Metrics()
        self.summary = Summary()
        self._rng = rng or random.Random()
        self._handler = handler or self._dispatch
        self._http = http_client
        self.queues = [
            QueueRuntime(
                config=q,
                ops=QueueOps(
                    store,
                    q.queue_name,
                    result_list=q.result_queue_name,
                    default_result_list=config.result_queue_name,
                    dedup_ttl=config.result_dedup_ttl_seconds,
                    lease_ttl=config.claim_lease_ttl_seconds,
                ),
                gate=make_gate(q, store, self._rng),
                target=Target(q.igw_base_url, q.request_path_url, q.inference_objective),
                metrics=self.metrics.for_queue(q),
            )
            for q in config.queues
        ]
        self._phase = _Phase.RUNNING
        self._stop = trio.Event()
        self._hurry = trio.Event()
        self._slots = trio.CapacityLimiter(config.concurrency)
        self._offset = 0.0  # server clock - local clock, seconds
        self._redis_ok: bool | None = None  # None until the first call answers or fails
        self._swept = False
        self._budget_end: float | None = None
        self._ack_send, self._ack_recv = trio.open_memory_channel[_Job](math.inf)
        self._poll_scope = trio.CancelScope()
        self._work_scope = trio.CancelScope()
        self._workers_done = trio.Event()
        self._acker_done = trio.Event()
        self._own_http = http_client is None and handler is None
        self._reserved = _keys.reserved_keys(
            [q.queue_name for q in config.queues], config.retry_queue_name
        )
        self._key_roles = key_roles(config)
        # a key found of another type, or an ACL refusal: stop (see _wrong_key_type)
        self._fatal: WrongKeyType | StorePermissionError | None = None
        self._given_up = 0  # claims dropped unreleased after Redis refused their ack

    # -- public ------------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Begin the graceful shutdown (docs/protocol.md#tasks-and-shutdown). A second call
        skips the drain wait."""
        if self._stop.is_set():
            self._hurry.set()
        self._stop.set()

    def ready(self) -> tuple[bool, str]:
        """For ``/readyz``: ready while Redis answers and no shutdown has begun."""
        if self._phase is not _Phase.RUNNING:
            return False, "shutting down"
        return (True, "ok") if self._redis_ok else (False, "redis unavailable")

    def held_count(self) -> int:
        return sum(len(q.held) for q in self.queues)

    def now(self) -> float:
        """The Redis server clock, estimated from the last script reply (Unix seconds)."""
        return time.time() + self._offset

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

        Cancellation: if the caller cancels instead of calling :meth:`request_stop`, the
        sweep still runs (shielded, ``SWEEP_TIMEOUT_SECONDS``) and returns every held claim.
        """
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._acker)
                nursery.start_soon(self._heartbeater)
                nursery.start_soon(self._reclaimer)
                nursery.start_soon(self._retry_mover)
                nursery.start_soon(self._backlog_sampler)
                await nursery.start(self._work_host)
                task_status.started()
                await self._stop.wait()
                await self._shutdown()
                # Sweep before the nursery closes: a task that ignores cancellation keeps the
                # nursery open, but must not keep its claim (docs/protocol.md#release-and-sweep).
                await self._within_budget(self._sweep)
                nursery.cancel_scope.cancel()
        finally:
            self._phase = _Phase.STOPPED
            if not self._swept:  # an error or a cancellation skipped the orderly shutdown
                await self._within_budget(self._sweep)
            held = self.held_count()
            # Claims given up after a refused ack were logged then; count them too.
            self.summary.left_to_lapse = held + self._given_up
            if held:
                log.error(
                    "claimkit: %d claims could not be returned; their leases will lapse and "
                    "any instance's reclaimer will redeliver them",
                    held,
                )
            if self._http is not None and self._own_http:
                with trio.CancelScope(shield=True), trio.move_on_after(2):
                    await self._http.aclose()
        if self._fatal is not None:
            log.info("%s", self.summary.line())
            raise self._fatal from None
        log.debug("%s", self.summary.line())
        return self.summary

    # -- shutdown ----------------------------------------------------------------------------

    async def _shutdown(self) -> None:
        self._phase = _Phase.DRAINING
        self._poll_scope.cancel()
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
                await self._workers_done.wait()
                wait.cancel_scope.cancel()
        self._work_scope.cancel()
        with trio.move_on_after(CANCEL_GRACE_SECONDS):
            await self._workers_done.wait()
        # Acks already handed to the acker are flushed before the sweep, so a finished
        # request is acked rather than released and run again.
        self._ack_send.close()
        await self._within_budget(self._acker_done.wait)

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
        (docs/protocol.md#release-and-sweep)."""
        self._swept = True
        for q in self.queues:
            items = list(q.held.items())
            if not items:
                continue
            claims = [(rid, h.token, None) for rid, h in items]
            try:
                async for attempt in _retrying(f"sweep {q.name}"):
                    with attempt:
                        codes = await q.ops.release(claims)
            except (StoreUnavailable, StoreError) as exc:
                log.error(
                    "sweep %s: %s; %d claims will lapse and be reclaimed", q.name, exc, len(claims)
                )
                continue
            for (rid, _h), code in zip(items, codes, strict=True):
                q.held.pop(rid, None)
                if code == 1:
                    self.summary.released += 1
            q.metrics.claim_depth.set(len(q.held))
            log.info("sweep %s: released %d of %d claims", q.name, codes.count(1), len(codes))

    # -- polling and claiming ------------------------------------------------------------------

    async def _work_host(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        try:
            with self._work_scope:
                async with trio.open_nursery() as workers:
                    self._workers = workers
                    with self._poll_scope:
                        async with trio.open_nursery() as pollers:
                            for q in self.queues:
                                pollers.start_soon(self._poller, q)
                            task_status.started()
        finally:
            self._workers_done.set()

    async def _reserve(self, wanted: int) -> list[object]:
        """Wait for one free worker slot, then take up to ``wanted`` without waiting."""
        first = object()
        await self._slots.acquire_on_behalf_of(first)
        slots = [first]
        while len(slots) < wanted:
            extra = object()
            try:
                self._slots.acquire_on_behalf_of_nowait(extra)
            except trio.WouldBlock:
                break
            slots.append(extra)
        return slots

    async def _poller(self, q: QueueRuntime) -> None:
        interval = self.config.poll_interval_ms / 1000
        while True:
            slots = await self._reserve(self.config.batch_size)
            try:
                busy_head = await self._poll_once(q, slots)
            except StoreUnavailable as exc:
                self._redis_failed(f"poll {q.name}", exc)
                busy_head = True
            except StoreError as exc:
                if not await self._wrong_key_type(exc):
                    self._redis_failed(f"poll {q.name}", exc)
                busy_head = True
            finally:
                for slot in slots:
                    self._slots.release_on_behalf_of(slot)
            if busy_head:
                await trio.sleep(interval if self._redis_ok else max(interval, 0.25))

    def _redis_failed(self, where: str, exc: Exception) -> None:
        """Note a failed Redis call; say so once per outage, not once per retry."""
        if self._redis_ok is not False or isinstance(exc, StoreError):
            log.warning("%s: %s; retrying with backoff", where, exc)
        self._redis_ok = False

    async def _wrong_key_type(self, exc: Exception) -> bool:
        """After Redis refused a call with ``exc``: whether retrying cannot mend it, so the
        consumer stops as if asked to and :meth:`run` raises the one-line error.

        Two refusals are of that kind:

        - an ACL refusal (:class:`~claimkit.store.StorePermissionError`, ``NOPERM``): the
          user may not run a command or touch a key the consumer needs; every retry would
          be refused the same way, with claims renewed and never finished. The line names
          the user, the command and the key (docs/security.md).
        - a key the consumer uses (:func:`key_roles`) now holding another type: each lease
          would run the same requests again and fail the same way.

        Only a WRONGTYPE refusal is looked into (one pipeline of ``TYPE`` calls): out of
        memory, READONLY or a lost connection say nothing about key types, and checking on
        each of them would load a Redis already in trouble. ``False`` when ``exc`` is
        neither, every key is right, or the check itself failed."""
        if self._fatal is not None:
            return True
        if isinstance(exc, StorePermissionError):
            self._fatal = exc
            log.error("claimkit: Redis refused a command under its ACL: %s; stopping", exc)
            self.request_stop()
            return True
        if not isinstance(exc, StoreError) or not _is_wrongtype(exc):
            return False
        try:
            await check_keys(self.store, self._key_roles)
        except WrongKeyType as wrong:
            self._fatal = wrong
            log.error("claimkit: %s; stopping", wrong)
            self.request_stop()
            return True
        except (StoreUnavailable, StoreError):
            pass
        return False

    def _redis_answered(self) -> None:
        if self._redis_ok is False:
            log.info("claimkit: Redis answers again")
        self._redis_ok = True

    async def _poll_once(self, q: QueueRuntime, slots: list[object]) -> bool:
        """One peek -> check -> claim round. Takes ownership of the slots it uses (removes
        them from ``slots``). Returns True when the poller should wait ``poll_interval``."""
        members = await q.ops.peek(len(slots))
        self._redis_answered()
        if not members:
            return True
        valid: list[Envelope] = []
        invalid: list[Invalid] = []
        for raw in members:
            parsed = parse_member(raw)
            parsed = self._misrouted(q, parsed)
            if isinstance(parsed, Envelope):
                valid.append(parsed)
            else:
                invalid.append(parsed)
        if invalid:
            moved, _pushed = await q.ops.dead_letter(invalid)
            self.summary.dead_lettered += moved
            q.metrics.dead_lettered.inc(moved)
            for bad in invalid:
                log.warning(
                    "dead-lettered a malformed member of %s (id %s): %s", q.name, bad.id, bad.reason
                )
        now = self.now()
        expired = [e for e in valid if e.deadline <= now]
        live = [e for e in valid if e.deadline > now]
        try:
            admitted = await q.gate.admit(len(live), q.inflight)
            q.gate_error = ""
        except GateError as exc:
            if str(exc) != q.gate_error:  # once per distinct error, not once per poll
                log.warning("gate of %s: %s; candidates stay pending", q.name, exc)
            q.gate_error = str(exc)
            admitted = 0
        if admitted < len(live):
            q.metrics.shedded.inc(len(live) - admitted)
        candidates = expired + live[:admitted]
        if not candidates:
            return True  # everything was refused by the gate or dead-lettered: wait
        stamp = self.now()
        pairs = [(env, new_token(stamp)) for env in candidates]
        server_now, codes = await q.ops.claim(pairs, self.config.claim_lease_ttl_seconds)
        self._offset = server_now - time.time()
        batch: list[tuple[_Held, object]] = []
        for (env, token), code in zip(pairs, codes, strict=True):
            if code not in (ClaimCode.CLAIMED, ClaimCode.CANCELLED):
                continue
            held = _Held(env, token, cancelled=code == ClaimCode.CANCELLED)
            stale = q.held.get(env.id)
            if stale is not None:
                # Our earlier claim on this id was handed back (drain) and we won it again:
                # the earlier task's result would be a duplicate, like a stolen claim's.
                self._drop_lost(q, stale, taken_over=False)
            q.held[env.id] = held
            batch.append((held, slots.pop()))
        claimed = len(batch)
        self.summary.claimed += claimed
        q.metrics.requests.inc(claimed)
        q.metrics.claim_depth.set(len(q.held))
        # One worker at a time, each entering its dispatch before the next is started, so a
        # poll batch is dispatched in deadline order (docs/protocol.md#peek). With start_soon
        # trio runs tasks started together in either order: half the batches went out reversed.
        for i, (held, slot) in enumerate(batch):
            try:
                await self._workers.start(self._work, q, held, slot)
            except BaseException:
                for _later, unused in batch[i + 1 :]:
                    self._slots.release_on_behalf_of(unused)
                raise  # the claims not started stay held: the shutdown sweep returns them
        if len(members) < len(slots) + claimed:
            return True  # the queue had fewer than we asked for: it is drained for now
        # Claims lost to another consumer: poll again at once. Busy ids (a live claim on
        # the same id) stay pending until that claim ends: wait rather than spin on them.
        return ClaimCode.BUSY in codes and claimed == 0

    def _misrouted(self, q: QueueRuntime, parsed: Envelope | Invalid) -> Envelope | Invalid:
        """Keep records off keys claimkit uses for other things (``internal.result_queue_name``
        may name any key, docs/protocol.md#terminal-record; pushing a record onto an empty
        queue key would re-create it as a list and break it for every request). Such a
        request is dead-lettered; its record, and that of an invalid member naming such a
        key, goes to the queue's or the global list."""
        name = parsed.result_queue_name
        if q.ops.result_list is not None or not name or not _keys.is_reserved(name, self._reserved):
            return parsed
        if isinstance(parsed, Invalid):
            return replace(parsed, result_queue_name=None)
        reason = f"Failed: internal.result_queue_name names a key claimkit uses: {name!r}"
        return Invalid(parsed.raw, reason, parsed.id, parsed.request_token)

    # -- workers -------------------------------------------------------------------------------

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

    async def _work(
        self,
        q: QueueRuntime,
        held: _Held,
        slot: object,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        env = held.env
        try:
            # No checkpoint between here and the handler's first one: the poller resumes,
            # and starts the next worker of the batch, only once this one is dispatching.
            task_status.started()
            now = self.now()
            outcome: Outcome | None = None
            with trio.CancelScope() as scope:
                held.scope = scope
                if held.cancelled:
                    outcome = Done(TerminalRecord.error(env.id, ErrorCode.CANCELLED, "cancelled"))
                elif env.deadline <= now:
                    # Past the deadline the last HTTP response it had is its record.
                    outcome = Done(
                        env.last_response
                        or TerminalRecord.error(
                            env.id, ErrorCode.DEADLINE_EXCEEDED, "deadline exceeded"
                        )
                    )
                else:
                    q.inflight += 1
                    q.metrics.inflight.inc()
                    started = time.perf_counter()
                    try:
                        outcome = await self._handler(q, env, now)
                    finally:
                        q.inflight -= 1
                        q.metrics.inflight.dec()
                        q.metrics.latency_ms.observe((time.perf_counter() - started) * 1000)
            held.scope = None
            if outcome is None or held.lost:
                return  # stolen or gone: a result would be a duplicate (docs/protocol.md#heartbeat)
            job = _Job(q, held)
            if isinstance(outcome, Retry):
                job.retry_delay, job.retry_last = outcome.delay, outcome.last
            else:
                if outcome.unanswered:
                    q.metrics.gateway_no_response.inc()
                job.record = outcome.record
                if outcome.record.error_code is not None:
                    log.info(
                        "%s in %s ends %s: %s",
                        env.id,
                        q.name,
                        outcome.record.error_code,
                        outcome.record.error_message,
                    )
            await self._settle(job)
        finally:
            self._slots.release_on_behalf_of(slot)

    async def _settle(self, job: _Job) -> None:
        try:
            self._ack_send.send_nowait(job)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            # The acker is gone (shutdown); this task outlived the drain. Ack directly: the
            # sweep may already have returned the claim, and the ack then withdraws that copy
            # or is suppressed as a duplicate (docs/protocol.md#release-and-sweep).
            with trio.CancelScope(shield=True), trio.move_on_after(SWEEP_TIMEOUT_SECONDS):
                await self._flush([job])
        # Not waiting for the ack: the worker slot bounds requests in flight to the gateway,
        # and the acker (which retries while Redis is away) owns the job from here. The
        # shutdown flushes the acker before the sweep, so the claim is acked, not released.

    # -- acker -----------------------------------------------------------------------------

    async def _acker(self) -> None:
        try:
            async with self._ack_recv:
                async for first in self._ack_recv:
                    batch = [first]
                    # Linger briefly for a fuller batch: one script call per batch_size
                    # records rather than one per 2-3 (docs/performance.md).
                    with trio.move_on_after(ACK_LINGER_SECONDS):
                        while len(batch) < self.config.batch_size:
                            try:
                                batch.append(await self._ack_recv.receive())
                            except trio.EndOfChannel:
                                break
                    while len(batch) < ACK_BATCH_MAX:
                        try:
                            batch.append(self._ack_recv.receive_nowait())
                        except (trio.WouldBlock, trio.EndOfChannel):
                            break
                    await self._flush(batch)
        finally:
            self._acker_done.set()

    async def _flush(self, batch: list[_Job]) -> None:
        """Ack or park a batch, one script call per queue and kind; retries while Redis is
        unavailable (the claims stay held and renewed meanwhile, docs/protocol.md#ack)."""
        groups: dict[tuple[int, bool], list[_Job]] = defaultdict(list)
        for job in batch:
            groups[(id(job.queue), job.record is None)].append(job)
        for (_qid, is_park), jobs in groups.items():
            q = jobs[0].queue
            try:
                await self._settle_jobs(q, jobs, is_park)
            finally:
                for job in jobs:
                    job.done.set()
            q.metrics.claim_depth.set(len(q.held))

    async def _settle_jobs(self, q: QueueRuntime, jobs: list[_Job], is_park: bool) -> None:
        """Ack or park ``jobs`` of one queue in one script call. When Redis refuses it:

        - a key of the wrong type (:meth:`_wrong_key_type`): the consumer stops, and the
          claims stay held for the shutdown sweep to return;
        - otherwise (out of memory, say: a refusal of the whole call, which retrying each
          job alone would only repeat) the jobs are given up: their claims leave the
          registry (or the heartbeat would renew them for ever with no task behind them)
          and lapse, and any instance's reclaimer redelivers them. They count in
          ``left_to_lapse``. Jobs a failed call had already acked are no longer claimed
          by anyone, so nothing of theirs lapses and their records stand.
        """
        settle = self._park if is_park else self._ack
        verb = "park" if is_park else "ack"
        try:
            await settle(q, jobs)
        except StoreError as exc:
            if await self._wrong_key_type(exc):
                log.error(
                    "%s %s: %s; %d claims are kept for the shutdown sweep",
                    verb,
                    q.name,
                    exc,
                    len(jobs),
                )
            else:
                self._give_up(q, jobs, f"{verb} {q.name}: {exc}")

    def _give_up(self, q: QueueRuntime, jobs: list[_Job], why: str) -> None:
        """Drop claims Redis refused to settle from the registry, counted in
        ``left_to_lapse``: their leases lapse and any instance's reclaimer redelivers them."""
        dropped = 0
        for job in jobs:
            if q.held.get(job.held.env.id) is job.held:
                del q.held[job.held.env.id]
                dropped += 1
        self._given_up += dropped
        log.error("%s; %d claims left to lapse", why, dropped)

    async def _ack(self, q: QueueRuntime, jobs: list[_Job]) -> None:
        items = []
        for job in jobs:
            assert job.record is not None
            env = job.held.env
            items.append(
                AckItem(
                    id=env.id,
                    token=job.held.token,
                    request_token=env.request_token,
                    result_list=q.ops.result_list_for(env.result_queue_name),
                    record=job.record.to_json(),
                    member=env.raw,
                )
            )
        async for attempt in _retrying(f"ack {q.name}"):
            with attempt:
                results = await q.ops.ack(items)
        self._redis_answered()
        for job, (pushed, owned) in zip(jobs, results, strict=True):
            job.owned = owned
            if q.held.get(job.held.env.id) is job.held:
                del q.held[job.held.env.id]
            self._count_record(q, job.record, pushed)
            if self._on_settled is not None:
                self._on_settled(job.held.env, job.record)

    def _count_record(self, q: QueueRuntime, record: TerminalRecord | None, pushed: bool) -> None:
        if not pushed:
            self.summary.duplicates_suppressed += 1
            q.metrics.duplicates_suppressed.inc()
            return
        self.summary.acked += 1
        if record is None:
            return
        if record.error_code == ErrorCode.DEADLINE_EXCEEDED:
            q.metrics.deadline_exceeded.inc()
        elif record.status_code is not None and 200 <= record.status_code < 300:
            q.metrics.successes.inc()
        else:
            q.metrics.failures.inc()

    async def _park(self, q: QueueRuntime, jobs: list[_Job]) -> None:
        items = [
            (
                j.held.env.id,
                j.held.token,
                j.retry_delay,
                retry_member(j.held.env.raw, q.name, j.retry_last),
            )
            for j in jobs
        ]
        async for attempt in _retrying(f"park {q.name}"):
            with attempt:
                server_now, codes = await q.ops.park(items, self.config.retry_queue_name)
        self._offset = server_now - time.time()
        for job, code in zip(jobs, codes, strict=True):
            job.owned = code == 1
            if q.held.get(job.held.env.id) is job.held:
                del q.held[job.held.env.id]
            if code == 1:
                self.summary.retried += 1
                q.metrics.retries.inc()
            if self._on_settled is not None:
                self._on_settled(job.held.env, None)

    # -- heartbeat, reclaim, retry mover -----------------------------------------------------

    async def _heartbeater(self) -> None:
        interval = self.config.heartbeat_interval_seconds
        while True:
            await trio.sleep(interval)
            for q in self.queues:
                try:
                    await self._renew(q)
                except (StoreUnavailable, StoreError) as exc:
                    if await self._wrong_key_type(exc):
                        continue
                    self._redis_failed(
                        f"heartbeat {q.name} (claims are renewed once it answers)", exc
                    )

    async def _renew(self, q: QueueRuntime) -> None:
        held = list(q.held.values())
        if not held:
            return
        server_now, codes = await q.ops.renew(
            [(h.env.id, h.token, h.env.deadline) for h in held], self.config.claim_lease_ttl_seconds
        )
        self._redis_answered()
        self._offset = server_now - time.time()
        for h, code in zip(held, codes, strict=True):
            if code == 1 or q.held.get(h.env.id) is not h:
                continue
            # Taken by another owner (-1) or gone (0): the work would produce a duplicate.
            self._drop_lost(q, h, taken_over=code == -1)
        q.metrics.claim_depth.set(len(q.held))

    def _drop_lost(self, q: QueueRuntime, h: _Held, *, taken_over: bool) -> None:
        """Forget a claim no longer ours and cancel its work (docs/protocol.md#heartbeat)."""
        h.lost = True
        if q.held.get(h.env.id) is h:
            del q.held[h.env.id]
        if taken_over:
            self.summary.taken_over += 1
            how = "taken over by another owner after its lease lapsed"
        else:
            self.summary.released_elsewhere += 1
            how = "released elsewhere (by drain, or a reclaimer after its lease lapsed)"
        if h.scope is not None:
            h.scope.cancel()
        log.warning("claim on %s in %s was %s; its work here is cancelled", h.env.id, q.name, how)

    async def _reclaimer(self) -> None:
        interval = self.config.claim_reclaim_interval_ms / 1000
        while True:
            for q in self.queues:
                try:
                    counts = await q.ops.reclaim(self.config.max_deliveries)
                except (StoreUnavailable, StoreError) as exc:
                    if await self._wrong_key_type(exc):
                        continue
                    log.warning("reclaim %s: %s; retrying next interval", q.name, exc)
                    continue
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
                self.summary.redelivered += counts.redelivered
                self.summary.dead_lettered += counts.dead
                q.metrics.claims_expired.inc(counts.redelivered)
                q.metrics.dead_lettered.inc(counts.dead)
            await trio.sleep(interval)

    async def _retry_mover(self) -> None:
        interval = min(1.0, self.config.poll_interval_ms / 1000)
        while True:
            try:
                _moved, dead = await move_retries(self.store, self.config.retry_queue_name)
                if dead:
                    log.warning(
                        "retry mover: %d unroutable members moved to %s:dead",
                        dead,
                        self.config.retry_queue_name,
                    )
            except (StoreUnavailable, StoreError) as exc:
                if not await self._wrong_key_type(exc):
                    self._redis_failed("retry mover", exc)
            await trio.sleep(interval)

    async def _backlog_sampler(self) -> None:
        while True:
            for q in self.queues:
                try:
                    q.metrics.backlog.set(await self.store.command("ZCARD", q.name))
                except (StoreUnavailable, StoreError):
                    pass  # the pollers report Redis trouble; a missed sample is harmless
            await trio.sleep(5)
