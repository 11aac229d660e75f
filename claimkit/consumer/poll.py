"""The pollers and their workers (docs/protocol.md#peek, docs/protocol.md#claim).

A poller per queue: peek -> validate (dead-letter what is malformed) -> gate -> claim; each
claimed request goes to a worker task (at most ``concurrency`` at once), whose outcome goes
to the acker (:mod:`claimkit.consumer.settle`).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import trio

from claimkit.consumer.dispatch import Done, Outcome, Retry, Unsent
from claimkit.consumer.gates import GateError
from claimkit.consumer.settle import Job
from claimkit.protocol import keys as _keys
from claimkit.protocol.models import (
    PAYLOAD_MISSING_MESSAGE,
    Envelope,
    ErrorCode,
    Invalid,
    TerminalRecord,
    deadline_passed,
    deadline_record,
    parse_member,
    payload_problem,
)
from claimkit.protocol.ops import CHUNK, ClaimCode, new_token
from claimkit.protocol.routing import reserved_destination
from claimkit.store import StoreError, StoreUnavailable

if TYPE_CHECKING:
    from collections.abc import Sequence

    from claimkit.config import Config
    from claimkit.consumer.claims import Claim
    from claimkit.consumer.runtime import QueueRuntime, RedisHealth, ServerClock
    from claimkit.consumer.settle import Settler

__all__ = ["ROUND_MAX", "Handler", "Poller"]

log = logging.getLogger("claimkit")

ROUND_MAX = CHUNK
"""The most requests one poll round peeks and claims when more than ``batch_size`` worker
slots are free: one claim script call (the claim script takes at most
:data:`claimkit.protocol.ops.CHUNK` per call)."""

Handler = Callable[["QueueRuntime", Envelope, float], Awaitable[Outcome]]
"""``(queue, envelope, server_now) -> Outcome``: what to do with one claimed request.
The default sends it to the inference gateway (docs/dispatch.md)."""


class Poller:
    """Every queue's poller and the workers they start, under two cancel scopes the shutdown
    uses: :meth:`stop_claiming` (the pollers) and :meth:`cancel_work` (the workers).

    Args:
        config: the whole configuration (``batch_size``, ``poll_interval_ms``, the lease,
            ``concurrency``).
        queues: every queue.
        handler: what a worker does with its request.
        settler: where a worker's outcome goes.
        health: notes answers and failures; stops the consumer on a fatal refusal.
        clock: the server clock estimate (deadline checks, tokens, claim replies).
    """

    def __init__(
        self,
        config: Config,
        queues: Sequence[QueueRuntime],
        *,
        handler: Handler,
        settler: Settler,
        health: RedisHealth,
        clock: ServerClock,
    ) -> None:
        self._config = config
        self._queues = queues
        self._handler = handler
        self._settler = settler
        self._health = health
        self._clock = clock
        self._slots = trio.CapacityLimiter(config.concurrency)
        self._cluster = config.mode == "cluster"
        self._reserved = _keys.reserved_keys(
            [q.queue_name for q in config.queues],
            config.retry_queue_name,
            cluster=config.mode == "cluster",  # the cluster layout's names, outboxes too
        )
        self._poll_scope = trio.CancelScope()
        self._work_scope = trio.CancelScope()
        self._crew = _Crew(self._work)
        self.workers_done = trio.Event()
        """Set once every poller and worker has ended."""

    def stop_claiming(self) -> None:
        """Cancel the pollers; workers carry on."""
        self._poll_scope.cancel()

    def cancel_work(self) -> None:
        """Cancel the workers still running."""
        self._work_scope.cancel()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Host the pollers and workers; started once every poller has been started."""
        try:
            with self._work_scope:
                async with trio.open_nursery() as workers:
                    self._crew.nursery = workers
                    try:
                        with self._poll_scope:
                            async with trio.open_nursery() as pollers:
                                for q in self._queues:
                                    pollers.start_soon(self._poll, q)
                                task_status.started()
                    finally:
                        self._crew.close()  # no more claims: idle workers end
        finally:
            for _q, _claim, slot in self._crew.drop_unstarted():
                # Cancelled before a worker took it: the claim stays held, and the
                # shutdown sweep returns it.
                self._slots.release_on_behalf_of(slot)
            self.workers_done.set()

    async def _reserve(self, batch_size: int) -> list[object]:
        """Wait for one free worker slot, then take more without waiting: up to
        ``batch_size``, or, when more slots are free, this queue's share of them (free
        slots / queues) up to :data:`ROUND_MAX` (docs/protocol.md#peek). At thousands in
        flight, completions free hundreds of slots between two rounds; taking only
        ``batch_size`` per round would need a round per ``batch_size`` of them."""
        first = object()
        await self._slots.acquire_on_behalf_of(first)
        slots = [first]
        share = (int(self._slots.available_tokens) + 1) // len(self._queues)
        wanted = max(batch_size, min(share, ROUND_MAX))
        while len(slots) < wanted:
            extra = object()
            try:
                self._slots.acquire_on_behalf_of_nowait(extra)
            except trio.WouldBlock:
                break
            slots.append(extra)
        return slots

    async def _poll(self, q: QueueRuntime) -> None:
        interval = self._config.poll_interval_ms / 1000
        while True:
            # An open gateway breaker: no peek, no claim, only probes until the gateway
            # answers (docs/dispatch.md#the-gateway-is-unreachable).
            await q.breaker.probe_until_answered()
            slots = await self._reserve(self._config.batch_size)
            try:
                if q.breaker.is_open:  # it opened while this poller waited for a slot
                    continue
                busy_head = await self._poll_once(q, slots)
            except StoreUnavailable as exc:
                self._health.note_failure(f"poll {q.name}", exc)
                busy_head = True
            except StoreError as exc:
                await self._health.failed(f"poll {q.name}", exc)
                busy_head = True
            finally:
                for slot in slots:
                    self._slots.release_on_behalf_of(slot)
            if busy_head:
                await trio.sleep(interval if self._health.ok else max(interval, 0.25))

    async def _poll_once(self, q: QueueRuntime, slots: list[object]) -> bool:
        """One peek -> check -> claim round; no claim while the queue is paused. Takes
        ownership of the slots it uses (removes them from ``slots``). Returns True when the
        poller should wait ``poll_interval``."""
        paused, members = await q.ops.peek_unless_paused(len(slots))
        self._health.answered()
        if q.pause.see(paused):
            return True  # claim nothing new; look again next poll (docs/protocol.md#pause)
        if not members:
            return True
        valid = await self._sort(q, members)
        candidates = await self._admit(q, valid)
        if not candidates:
            return True  # everything was refused by the gate or dead-lettered: wait
        batch, codes = await self._claim(q, candidates, slots)
        claimed = len(batch)
        batch, failure = await self._fetch_payloads(q, batch, slots)
        self._crew.hand(q, batch)
        if failure is not None:
            raise failure  # the poller's own handling: note it (or stop), then wait
        if len(members) < len(slots) + claimed:
            return True  # the queue had fewer than we asked for: it is drained for now
        # Claims won by another consumer: poll again at once. Busy ids (a live claim on
        # the same id) stay pending until that claim ends: wait rather than spin on them.
        return ClaimCode.BUSY in codes and claimed == 0

    async def _sort(self, q: QueueRuntime, members: list[bytes]) -> list[Envelope]:
        """Parse peeked members; dead-letter the malformed and misrouted ones (one call)."""
        valid: list[Envelope] = []
        invalid: list[Invalid] = []
        for raw in members:
            parsed = self._misrouted(q, parse_member(raw))
            if isinstance(parsed, Envelope):
                valid.append(parsed)
            else:
                invalid.append(parsed)
        if invalid:
            moved, pushed = await q.ops.dead_letter(invalid)
            q.claims.count_dead_lettered(moved)
            q.claims.count_invalid_records(pushed)
            for bad in invalid:
                log.warning(
                    "dead-lettered a malformed member of %s (id %s): %s", q.name, bad.id, bad.reason
                )
        return valid

    async def _admit(self, q: QueueRuntime, valid: list[Envelope]) -> list[Envelope]:
        """The candidates to claim: every expired one (it gets its record), and the live ones
        the gate admits, in deadline order."""
        now = self._clock.now()
        expired = [e for e in valid if deadline_passed(e.deadline, now)]
        live = [e for e in valid if not deadline_passed(e.deadline, now)]
        try:
            admitted = await q.gate.admit(len(live), q.inflight)
            q.gate_error = ""
        except GateError as exc:
            if str(exc) != q.gate_error:  # once per distinct error, not once per poll
                log.warning("gate of %s: %s; candidates stay pending", q.name, exc)
            q.gate_error = str(exc)
            admitted = 0
        if admitted < len(live):
            q.claims.count_shed(len(live) - admitted)
        return expired + live[:admitted]

    async def _claim(
        self, q: QueueRuntime, candidates: list[Envelope], slots: list[object]
    ) -> tuple[list[tuple[Claim, object]], list[ClaimCode]]:
        """Claim ``candidates`` in one call; each claim granted takes a slot from ``slots``.
        Returns the claims with their slots, and the claim codes."""
        stamp = self._clock.now()
        pairs = [(env, new_token(self._config.consumer_id, now=stamp)) for env in candidates]
        try:
            server_now, codes = await q.ops.claim(pairs, self._config.claim_lease_ttl_seconds)
        except StoreUnavailable as exc:
            # The script may have run and only its reply been lost (the connection dropped or
            # the call timed out on the way back): those claims are then Redis's, under
            # tokens this consumer never learns, so it neither holds nor counts them. They
            # are not lost: their leases lapse and a reclaimer redelivers them.
            log.warning(
                "claim %s: %s; up to %d requests may have been claimed without this consumer "
                "learning it: their leases lapse and a reclaimer redelivers them",
                q.name,
                exc,
                len(pairs),
            )
            raise
        self._clock.observe(server_now)
        batch: list[tuple[Claim, object]] = []
        for (env, token), code in zip(pairs, codes, strict=True):
            if code not in (ClaimCode.CLAIMED, ClaimCode.CANCELLED):
                continue
            claim = q.claims.add(env, token, cancelled=code == ClaimCode.CANCELLED)
            batch.append((claim, slots.pop()))
        q.claims.count_claimed(len(batch))
        return batch, codes

    async def _fetch_payloads(
        self, q: QueueRuntime, batch: list[tuple[Claim, object]], slots: list[object]
    ) -> tuple[list[tuple[Claim, object]], StoreError | StoreUnavailable | None]:
        """Fetch the payloads of the claims in ``batch`` whose member names a payload key,
        in one call (docs/protocol.md#payload-references); a claim that is cancelled or
        past its deadline is not sent, so its payload is not fetched. Each fetched claim
        gets its payload, or the reason it has none (missing, or not a JSON object or
        null: its request ends with ``PAYLOAD_UNAVAILABLE``).

        Returns the batch to start and ``None``; or, when the fetch failed (Redis away, or
        refused it), the batch without those claims and the error: they are handed back
        to pending at once (a fenced release, as the sweep does; their slots go back to
        ``slots``), or, should that fail too, left to lapse and be reclaimed. No record
        is written for them."""
        now = self._clock.now()
        wanted = [
            (claim, slot)
            for claim, slot in batch
            if claim.env.payload_ref is not None
            and not claim.cancelled
            and not deadline_passed(claim.env.deadline, now)
        ]
        if not wanted:
            return batch, None
        refs = [claim.env.payload_ref or "" for claim, _slot in wanted]
        try:
            values = await q.ops.fetch_payloads(refs)
        except (StoreUnavailable, StoreError) as exc:
            claims = [claim for claim, _slot in wanted]
            slots += [slot for _claim, slot in wanted]
            await self._hand_back(q, claims, exc)
            fetched = {id(claim) for claim in claims}
            return [entry for entry in batch if id(entry[0]) not in fetched], exc
        for (claim, _slot), value in zip(wanted, values, strict=True):
            if value is None:
                claim.payload_unavailable = PAYLOAD_MISSING_MESSAGE
            elif (problem := payload_problem(value)) is not None:
                claim.payload_unavailable = problem
            else:
                claim.payload = value
        return batch, None

    async def _hand_back(
        self, q: QueueRuntime, claims: list[Claim], why: StoreError | StoreUnavailable
    ) -> None:
        """Release ``claims`` whose payloads could not be fetched (``why``); when the
        release fails too, give them up to lapse (docs/protocol.md#payload-references)."""
        try:
            codes = await q.ops.release([(c.env.id, c.token, None) for c in claims])
        except (StoreUnavailable, StoreError) as exc:
            q.claims.give_up(claims, f"payloads {q.name}: {why}; handing back failed: {exc}")
            return
        q.claims.swept(claims, codes)
        log.warning("payloads %s: %s; %d claims handed back to pending", q.name, why, len(claims))

    def _misrouted(self, q: QueueRuntime, parsed: Envelope | Invalid) -> Envelope | Invalid:
        """Keep records off keys claimkit uses for other things (``internal.result_queue_name``
        may name any key, docs/protocol.md#terminal-record; pushing a record onto an empty
        queue key would re-create it as a list and break it for every request). Such a
        request is dead-lettered; its record, and that of an invalid member naming such a
        key, goes to the queue's or the global list."""
        name = q.ops.routing.member_list(parsed.result_queue_name)
        reason = reserved_destination(name, self._reserved, cluster=self._cluster)
        if reason is None:
            return parsed
        if isinstance(parsed, Invalid):
            return replace(parsed, result_queue_name=None)
        return Invalid(parsed.raw, reason, parsed.id, parsed.request_token)

    # -- workers -----------------------------------------------------------------------------

    async def _work(self, q: QueueRuntime, claim: Claim, slot: object) -> None:
        try:
            # No checkpoint between here and the handler's first one (see _Crew).
            outcome = await self._outcome(q, claim)
            if outcome is None or not claim.ours:
                # taken over or released elsewhere: a result would be a duplicate
                # (docs/protocol.md#heartbeat)
                return
            await self._settler.settle(self._job(q, claim, outcome))
        finally:
            self._slots.release_on_behalf_of(slot)

    async def _outcome(self, q: QueueRuntime, claim: Claim) -> Outcome | None:
        """What becomes of ``claim``'s request: ``None`` when its work was cancelled."""
        env = claim.env
        now = self._clock.now()
        # The claim outlives the dispatch (heartbeat, ack, sweep); its payload must not.
        payload, claim.payload = claim.payload, None
        # A payload key is read only for a request whose deadline was ahead at the fetch
        # (_fetch_payloads): one not read (and not missing) was past it then.
        unfetched = env.payload_ref is not None and payload is None
        outcome: Outcome | None = None
        with trio.CancelScope() as scope:
            claim.scope = scope
            if claim.cancelled:
                outcome = Done(TerminalRecord.error(env.id, ErrorCode.CANCELLED, "cancelled"))
            elif deadline_passed(env.deadline, now) or (
                unfetched and claim.payload_unavailable is None
            ):
                # Past the deadline the last HTTP response it had is its record.
                outcome = Done(deadline_record(env))
            elif claim.payload_unavailable is not None:
                outcome = Done(
                    TerminalRecord.error(
                        env.id, ErrorCode.PAYLOAD_UNAVAILABLE, claim.payload_unavailable
                    )
                )
            else:
                if payload is not None:
                    env = replace(env, body=payload)  # this copy lives only as long as the call
                q.inflight += 1
                q.metrics.inflight.inc()
                started = trio.current_time()
                try:
                    outcome = await self._handler(q, env, now)
                finally:
                    q.inflight -= 1
                    q.metrics.inflight.dec()
                    q.metrics.latency_ms.observe((trio.current_time() - started) * 1000)
        claim.scope = None
        return outcome

    def _job(self, q: QueueRuntime, claim: Claim, outcome: Outcome) -> Job:
        job = Job(q, claim)
        q.breaker.note(outcome)
        if isinstance(outcome, Unsent):
            # Nothing was sent: no record, the claim goes back to pending.
            log.debug("%s in %s is handed back: %s", claim.env.id, q.name, outcome.reason)
            job.release = True
            return job
        if isinstance(outcome, Retry):
            job.retry_delay, job.retry_last = outcome.delay, outcome.last
            return job
        if outcome.unanswered:
            q.metrics.gateway_no_response.inc()
        job.record = outcome.record
        if outcome.record.error_code is not None:
            log.info(
                "%s in %s ends %s: %s",
                claim.env.id,
                q.name,
                outcome.record.error_code,
                outcome.record.error_message,
            )
        return job


_Entry = tuple["QueueRuntime", "Claim", object]  # a claimed request, with its worker slot


class _Crew:
    """Worker tasks that outlive a request: each takes the oldest claimed request handed
    over (:meth:`hand`), works it, and takes the next, or waits idle for one. There are at
    most ``concurrency`` (each entry holds a worker slot), started as needed.

    Dispatch order: a poll batch is dispatched in deadline order (docs/protocol.md#peek).
    A worker takes an entry and enters its handler with no checkpoint in between, so the
    handlers are entered in the order the entries were handed over, whichever worker trio
    runs first (trio runs tasks woken together in either order). This costs one wake-up per
    request, where a task per request, started one at a time so that each entered its
    dispatch before the next was started, cost a spawn, a nursery and a round trip of the
    poller through the scheduler.
    """

    def __init__(self, work: Callable[[QueueRuntime, Claim, object], Awaitable[None]]) -> None:
        self._work = work
        self.nursery: trio.Nursery | None = None
        self._entries: deque[_Entry] = deque()
        self._idle = trio.lowlevel.ParkingLot()
        self._woken = 0  # workers woken or started that have not yet looked for an entry
        self._closed = False

    def hand(self, q: QueueRuntime, batch: Sequence[tuple[Claim, object]]) -> None:
        """Queue ``batch`` (claims with their slots, in dispatch order) and wake or start a
        worker for each entry no woken worker will take."""
        assert self.nursery is not None and not self._closed
        self._entries.extend((q, claim, slot) for claim, slot in batch)
        short = len(self._entries) - self._woken
        if short <= 0:
            return
        self._woken += short
        for _ in range(short - len(self._idle.unpark(count=short))):
            self.nursery.start_soon(self._worker)

    def close(self) -> None:
        """No more entries: each worker ends once none is left."""
        self._closed = True
        self._idle.unpark_all()

    def drop_unstarted(self) -> list[_Entry]:
        """The entries no worker took (the workers were cancelled); empties the queue."""
        left = list(self._entries)
        self._entries.clear()
        return left

    async def _worker(self) -> None:
        entries = self._entries
        while True:
            self._woken -= 1
            while entries:
                await self._work(*entries.popleft())
            if self._closed:
                return
            await self._idle.park()
