"""The acker: terminal records, retry parks and hand-backs from every worker, batched per
queue into one script call (docs/protocol.md#ack, docs/protocol.md#park-for-retry,
docs/dispatch.md#the-gateway-is-unreachable)."""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import trio

from claimkit.consumer.runtime import until_answered
from claimkit.protocol.models import retry_member
from claimkit.protocol.ops import AckItem, ParkCode, ReleaseCode
from claimkit.store import StoreError

if TYPE_CHECKING:
    from claimkit.consumer.claims import Claim
    from claimkit.consumer.runtime import QueueRuntime, RedisHealth, ServerClock
    from claimkit.protocol.models import Envelope, TerminalRecord

__all__ = [
    "ACK_BATCH_MAX",
    "ACK_IDLE_SECONDS",
    "ACK_LINGER_SECONDS",
    "SWEEP_TIMEOUT_SECONDS",
    "Job",
    "Settler",
]

log = logging.getLogger("claimkit")

SWEEP_TIMEOUT_SECONDS = 10.0
"""The shielded sweep's own deadline (docs/protocol.md#tasks-and-shutdown). Claims it cannot
return lapse and are reclaimed by any instance (docs/protocol.md#reclaim): nothing is lost,
only delayed."""

ACK_BATCH_MAX = 2000

ACK_LINGER_SECONDS = 0.020
"""The longest the acker waits for more finished requests before it flushes a batch smaller
than ``batch_size``, seconds (docs/protocol.md#ack). It waits only while other claims of the
batch's queues are still being worked on (a lone request is acked at once) and while
results keep coming (:data:`ACK_IDLE_SECONDS`); a worker's slot is freed when it hands its
result over, so the wait adds to result latency, never to throughput."""

ACK_IDLE_SECONDS = 0.005
"""The acker stops waiting once no further result has arrived for this long, seconds: at
light traffic a result waits at most this (docs/protocol.md#ack)."""

OnSettled = Callable[["Envelope", "TerminalRecord | None"], None]


@dataclass(eq=False)
class Job:
    """A terminal record, a retry park or a hand-back (``release``) on its way to the
    acker."""

    queue: QueueRuntime
    claim: Claim
    record: TerminalRecord | None = None
    retry_delay: float = 0.0
    retry_last: TerminalRecord | None = None  # the attempt's HTTP response, parked with it
    release: bool = False  # nothing was sent: hand the claim back to pending
    done: trio.Event = field(default_factory=trio.Event)
    owned: bool = False


class Settler:
    """Acks and parks for every queue: workers hand jobs to :meth:`settle`, the acker task
    (:meth:`run`) flushes them in batches.

    Args:
        batch_size: ``batch_size`` of the config: the acker waits for that many jobs
            while more can come, up to :data:`ACK_LINGER_SECONDS` (:meth:`_gather`).
        health: notes answers, and stops the consumer on a fatal refusal.
        clock: takes the server time a park returns.
        on_settled: see ``Consumer``.
    """

    def __init__(
        self,
        *,
        batch_size: int,
        health: RedisHealth,
        clock: ServerClock,
        on_settled: OnSettled | None,
    ) -> None:
        self._batch_size = batch_size
        self._health = health
        self._clock = clock
        self._on_settled = on_settled
        self._send, self._recv = trio.open_memory_channel[Job](math.inf)
        self.done = trio.Event()
        """Set once the acker has ended (after :meth:`close`, every job handed over is
        flushed)."""

    def close(self) -> None:
        """No more jobs: the acker flushes what it has and ends."""
        self._send.close()

    async def settle(self, job: Job) -> None:
        """Hand ``job`` to the acker; if the acker is gone (shutdown), ack it here."""
        try:
            self._send.send_nowait(job)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            # The acker is gone (shutdown); this task outlived the drain. Ack directly: the
            # sweep may already have returned the claim, and the ack then withdraws that copy
            # or is suppressed as a duplicate (docs/protocol.md#release-and-sweep).
            with trio.CancelScope(shield=True), trio.move_on_after(SWEEP_TIMEOUT_SECONDS):
                await self.flush([job])
        # Not waiting for the ack: the worker slot bounds requests in flight to the gateway,
        # and the acker (which retries while Redis is away) owns the job from here. The
        # shutdown flushes the acker before the sweep, so the claim is acked, not released.

    async def run(self) -> None:
        """The acker task: until :meth:`close`, flush jobs in batches."""
        try:
            async with self._recv:
                async for first in self._recv:
                    await self.flush(await self._gather(first))
        finally:
            self.done.set()

    async def _gather(self, first: Job) -> list[Job]:
        """``first`` and what else is ready, then, while the batch is short of
        ``batch_size`` and more can come, the results that arrive (docs/protocol.md#ack):
        it stops at ``batch_size`` jobs, when no claim of the batch's queues is left
        outside the batch (nothing more can arrive), when no job has arrived for
        :data:`ACK_IDLE_SECONDS`, or :data:`ACK_LINGER_SECONDS` after ``first``."""
        batch = [first]
        self._take_ready(batch)
        give_up_at = trio.current_time() + ACK_LINGER_SECONDS
        while len(batch) < self._batch_size and self._more_can_come(batch):
            deadline = min(give_up_at, trio.current_time() + ACK_IDLE_SECONDS)
            with trio.move_on_at(deadline):
                try:
                    batch.append(await self._recv.receive())
                except trio.EndOfChannel:
                    break
            if trio.current_time() >= deadline:
                break
            self._take_ready(batch)
        return batch

    def _take_ready(self, batch: list[Job]) -> None:
        while len(batch) < ACK_BATCH_MAX:
            try:
                batch.append(self._recv.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel):
                break

    @staticmethod
    def _more_can_come(batch: list[Job]) -> bool:
        """Whether some queue of ``batch`` holds a claim whose job is not in it: that
        claim's work is still under way, so its result may come."""
        queues = {id(job.queue): job.queue for job in batch}
        for q in queues.values():
            inside = sum(1 for j in batch if j.queue is q and q.claims.holds(j.claim))
            if len(q.claims) > inside:
                return True
        return False

    async def flush(self, batch: list[Job]) -> None:
        """Ack, park or release a batch, one script call per queue and kind; retries while Redis is
        unavailable (the claims stay held and renewed meanwhile, docs/protocol.md#ack)."""
        groups: dict[tuple[int, str], list[Job]] = defaultdict(list)
        for job in batch:
            kind = "release" if job.release else "park" if job.record is None else "ack"
            groups[(id(job.queue), kind)].append(job)
        for (_qid, kind), jobs in groups.items():
            q = jobs[0].queue
            try:
                await self._settle_jobs(q, jobs, kind)
            finally:
                for job in jobs:
                    job.done.set()
            q.claims.show_depth()

    async def _settle_jobs(self, q: QueueRuntime, jobs: list[Job], verb: str) -> None:
        """Ack, park or release (``verb``) ``jobs`` of one queue in one script call. When
        Redis refuses it:

        - a fatal refusal (:meth:`RedisHealth.is_fatal`): the consumer stops, and the
          claims stay held for the shutdown sweep to return;
        - otherwise (out of memory, say: a refusal of the whole call, which retrying each
          job alone would only repeat) the jobs are given up: their claims leave the
          registry (or the heartbeat would renew them for ever with no task behind them)
          and lapse, and any instance's reclaimer redelivers them. They count in
          ``left_to_lapse``. Jobs a failed call had already acked are no longer claimed
          by anyone, so nothing of theirs lapses and their records stand.
        """
        settle = {"ack": self._ack, "park": self._park, "release": self._release}[verb]
        try:
            await settle(q, jobs)
        except StoreError as exc:
            if await self._health.is_fatal(exc):
                log.error(
                    "%s %s: %s; %d claims are kept for the shutdown sweep",
                    verb,
                    q.name,
                    exc,
                    len(jobs),
                )
            else:
                q.claims.give_up([job.claim for job in jobs], f"{verb} {q.name}: {exc}")

    async def _ack(self, q: QueueRuntime, jobs: list[Job]) -> None:
        """Ack ``jobs`` of one queue, retrying while Redis is unavailable. Their claims are
        marked ``acking`` first: the heartbeat goes on renewing them meanwhile, but one it
        finds gone (an ack across slots moves it into the outbox before it answers) is
        left for this ack's answer to count (:meth:`HeldClaims.drop_acking`)."""
        items = []
        for job in jobs:
            assert job.record is not None
            job.claim.acking = True
            env = job.claim.env
            # Every record carries the generation it ends (docs/protocol.md#terminal-record).
            job.record = job.record.for_generation(env.request_token)
            items.append(
                AckItem(
                    id=env.id,
                    token=job.claim.token,
                    request_token=env.request_token,
                    result_list=q.ops.result_list_for(env.result_queue_name),
                    record=job.record.to_json(),
                    member=env.raw,
                    payload_ref=env.payload_ref or "",
                )
            )
        results = await until_answered(f"ack {q.name}", partial(q.ops.ack, items))
        self._health.answered()
        for job, (pushed, owned) in zip(jobs, results, strict=True):
            job.owned = owned
            q.claims.acked(job.claim, job.record, pushed)
            if self._on_settled is not None:
                self._on_settled(job.claim.env, job.record)

    async def _release(self, q: QueueRuntime, jobs: list[Job]) -> None:
        """Hand ``jobs`` of one queue back to pending at their own score, fenced by their
        tokens (docs/protocol.md#release-and-sweep): not a delivery, not a retry."""
        claims = [(j.claim.env.id, j.claim.token, None) for j in jobs]
        codes = await until_answered(f"release {q.name}", partial(q.ops.release, claims))
        self._health.answered()
        for job, code in zip(jobs, codes, strict=True):
            job.owned = code == ReleaseCode.RELEASED
            q.claims.handed_back(job.claim, released=job.owned)

    async def _park(self, q: QueueRuntime, jobs: list[Job]) -> None:
        items = [
            (
                j.claim.env.id,
                j.claim.token,
                j.retry_delay,
                retry_member(j.claim.env.raw, q.name, j.retry_last),
            )
            for j in jobs
        ]
        server_now, codes = await until_answered(f"park {q.name}", partial(q.ops.park, items))
        self._clock.observe(server_now)
        for job, code in zip(jobs, codes, strict=True):
            job.owned = code == ParkCode.PARKED
            q.claims.parked(job.claim, moved=job.owned)
            if self._on_settled is not None:
                self._on_settled(job.claim.env, None)
