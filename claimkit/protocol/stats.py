"""Queue-wide figures read from Redis itself (docs/metrics.md#queue-wide-gauges): what every
consumer of a queue sees alike, read in one read-only script call (``lua/queue-stats-7.lua``)
on one instant of the Redis server clock.

:func:`read_queue_stats` is what ``claimkit serve`` runs each
:data:`~claimkit.consumer.upkeep.QUEUE_STATS_INTERVAL_SECONDS` per queue, and what
``claimkit reclaim --once --textfile/--pushgateway`` exports after its run. On a Redis
Cluster the seven keys are the queue's own, in its slot (docs/topology.md#cluster-key-layout);
standalone, the retry set and its dead set are the ones every queue shares
(:class:`~claimkit.protocol.keys.QueueKeys`), so every queue reports the same sizes for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Gauge

from claimkit.store import reply_text
from claimkit.store.scripts import script

if TYPE_CHECKING:
    from collections.abc import Sequence

    from claimkit.protocol.keys import QueueKeys
    from claimkit.store import Store

__all__ = [
    "OLDEST_SAMPLE",
    "QUEUE_GAUGES",
    "QueueGauges",
    "QueueStats",
    "is_exporter",
    "read_queue_stats",
    "stats_keys",
]

OLDEST_SAMPLE = 16
"""How many of the lowest-scored pending members the script reads for the oldest
``data.created`` (the earliest deadlines first): bounded work whatever the queue's size."""


@dataclass(frozen=True, slots=True)
class QueueStats:
    """One queue's state in one instant of the Redis server clock.

    Attributes:
        server_now: the Redis server clock, Unix seconds.
        pending: requests in the pending set (``ZCARD <q>``).
        claimed: claims held by any consumer (owner entries, ``HLEN <q>:claim-owners``).
        expired: claims whose lease expired (expiry <= ``server_now``) and that no reclaim
            has redelivered yet.
        oldest_pending_age: seconds since the oldest ``data.created`` among the
            :data:`OLDEST_SAMPLE` lowest-scored pending members; 0.0 when nothing is
            pending; NaN when none of them carries a ``data.created`` (it is optional,
            docs/protocol.md#envelope).
        pending_deadline_headroom: seconds from ``server_now`` to the earliest pending
            deadline (the lowest score's whole part; negative once it passed); NaN when
            nothing is pending.
        lease_headroom: seconds from ``server_now`` to the earliest lease expiry (negative
            when a lease expired unreclaimed); NaN when no claim is held.
        retry_set: members of the retry set the queue parks into.
        retry_dead: members of that retry set's dead set (``<retry set>:dead``).
        dead: members of the dead set (``<q>:dead``).
        consumers_alive: registered consumers whose liveness entry has not lapsed
            (``ZCOUNT <q>:consumers <now> +inf``).
        exporter: the smallest alive consumer id (bytewise), the one that publishes the
            queue-wide gauges (docs/metrics.md#one-exporter-per-queue); ``None`` when no
            consumer is alive.
    """

    server_now: float
    pending: int
    claimed: int
    expired: int
    oldest_pending_age: float
    pending_deadline_headroom: float
    lease_headroom: float
    retry_set: int
    retry_dead: int
    dead: int
    consumers_alive: int
    exporter: str | None

    @classmethod
    def from_reply(cls, reply: Sequence[Any]) -> QueueStats:
        """Parse ``lua/queue-stats-7.lua``'s reply (its header gives the layout)."""
        now = float(reply_text(reply[0]))
        pending = int(reply[1])
        lowest = _float(reply[4])
        oldest = _float(reply[5])
        lease = _float(reply[6])
        if pending == 0:
            age = 0.0
        elif oldest is None:
            age = math.nan
        else:
            age = now - oldest
        return cls(
            server_now=now,
            pending=pending,
            claimed=int(reply[2]),
            expired=int(reply[3]),
            oldest_pending_age=age,
            pending_deadline_headroom=math.nan if lowest is None else math.floor(lowest) - now,
            lease_headroom=math.nan if lease is None else lease - now,
            retry_set=int(reply[7]),
            retry_dead=int(reply[8]),
            dead=int(reply[9]),
            consumers_alive=int(reply[10]),
            exporter=None if reply[11] is None else reply_text(reply[11]),
        )


def _float(value: Any) -> float | None:
    return None if value is None else float(reply_text(value))


def is_exporter(exporter: str | None, consumer_id: str | None) -> bool:
    """Whether a process with ``consumer_id`` publishes a queue's queue-wide gauges, given the
    queue's elected ``exporter`` (:attr:`QueueStats.exporter`,
    docs/metrics.md#one-exporter-per-queue): when it is the exporter, when no consumer is
    alive (``exporter`` is ``None``), or when it has no consumer id. In the last two cases
    every process publishes the same figures: aggregate them with ``max by (queue_name)``."""
    return exporter is None or consumer_id is None or exporter == consumer_id


def stats_keys(keys: QueueKeys) -> list[str]:
    """The seven keys of ``lua/queue-stats-7.lua``, in its order."""
    return [
        keys.pending,
        keys.owners,
        keys.index,
        keys.dead,
        keys.retry_set,
        keys.retry_dead,
        keys.consumers,
    ]


async def read_queue_stats(
    store: Store, keys: QueueKeys, *, sample: int = OLDEST_SAMPLE
) -> QueueStats:
    """Read one queue's :class:`QueueStats` in one round trip, writing nothing.

    Args:
        store: where the queue lives.
        keys: the queue's keys in the store's layout
            (:meth:`QueueKeys.for_queue <claimkit.protocol.keys.QueueKeys.for_queue>`).
        sample: how many lowest-scored pending members are read for the oldest age (>= 1).

    Raises:
        ValueError: ``sample`` is below 1 (nothing is sent).
        StoreUnavailable, StoreError: from the store (a key of another type: ``WRONGTYPE``).

    Cancellation: nothing is written, so a cancelled call leaves no trace.
    """
    if sample < 1:
        raise ValueError(f"sample must be at least 1, got {sample}")
    reply = await store.run(script("queue-stats"), stats_keys(keys), [sample])
    return QueueStats.from_reply(reply)


QUEUE_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("pending", "async_queue_pending", "Requests in the queue's pending set (Redis)"),
    ("claimed", "async_queue_claimed", "Claims held by any consumer of the queue (Redis)"),
    (
        "expired",
        "async_queue_claims_expired",
        "Claims whose lease expired and that no reclaim has redelivered yet (Redis)",
    ),
    (
        "oldest_pending_age",
        "async_queue_oldest_pending_age_seconds",
        "Seconds since data.created of the oldest of the earliest-deadline pending requests;"
        " 0 when none is pending, NaN when none carries data.created",
    ),
    (
        "pending_deadline_headroom",
        "async_queue_pending_deadline_headroom_seconds",
        "Seconds until the earliest deadline of a pending request (negative once passed);"
        " NaN when none is pending",
    ),
    (
        "lease_headroom",
        "async_queue_lease_headroom_seconds",
        "Seconds until the earliest lease expiry of a held claim (negative: expired,"
        " not reclaimed yet); NaN when no claim is held",
    ),
    (
        "consumers_alive",
        "async_queue_consumers_alive",
        "Registered consumers of the queue whose liveness entry has not lapsed",
    ),
    ("retry_set", "async_retry_set_size", "Members of the retry set the queue parks into"),
    ("retry_dead", "async_retry_dead_size", "Members of that retry set's dead set"),
    ("dead", "async_dead_set_size", "Members of the queue's dead set"),
)
"""``(QueueStats attribute, metric name without the namespace, help)`` of every queue-wide
gauge (docs/metrics.md#queue-wide-gauges), in the order docs/metrics.md lists them."""


class QueueGauges:
    """The queue-wide gauges (:data:`QUEUE_GAUGES`) on ``registry``, labelled ``queue_name``
    only: they describe Redis, not a process (docs/metrics.md#queue-wide-gauges).

    Args:
        registry: where to register them.
        namespace: metric name prefix (``llm_d_async``: ``llm_d_async_async_queue_pending``).
    """

    def __init__(self, registry: CollectorRegistry, namespace: str = "llm_d_async") -> None:
        self._gauges = {
            attr: Gauge(name, doc, ("queue_name",), namespace=namespace, registry=registry)
            for attr, name, doc in QUEUE_GAUGES
        }

    def publish(self, queue_name: str, stats: QueueStats) -> None:
        """Set every gauge of ``queue_name`` from ``stats``."""
        for attr, gauge in self._gauges.items():
            gauge.labels(queue_name).set(float(getattr(stats, attr)))

    def withdraw(self, queue_name: str) -> None:
        """Stop exporting ``queue_name``'s gauges (another process is its exporter); a queue
        not exported is left alone."""
        for gauge in self._gauges.values():
            try:
                gauge.remove(queue_name)
            except KeyError:
                pass

    def exported(self, queue_name: str) -> bool:
        """Whether this registry exports ``queue_name``'s gauges now."""
        samples = (s for m in self._gauges["pending"].collect() for s in m.samples)
        return any(s.labels.get("queue_name") == queue_name for s in samples)
