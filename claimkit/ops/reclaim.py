"""One full reclaim run over every configured queue (``claimkit reclaim --once``,
docs/cli.md; the rules: docs/protocol.md, "Reclaim")."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from claimkit.ops.inspect import check_key_types, cluster_layout, queue_key_types

if TYPE_CHECKING:
    from collections.abc import Mapping

    from claimkit.config import Config
    from claimkit.protocol.ops import ReclaimCounts
    from claimkit.store import Store

__all__ = ["reclaim_all", "reclaim_json", "reclaim_line"]


async def reclaim_all(store: Store, config: Config) -> dict[str, ReclaimCounts]:
    """Redeliver (or dead-letter) every expired claim of every queue of ``config``, with
    full scans until none is left; returns the counts by queue name, in config order. On a
    Redis Cluster each queue's run ends by finishing its outbox (``replayed``).

    Unless the consumer registry is off (``consumer_liveness_ttl_seconds`` = 0), each
    queue's run starts with the fast failover (docs/protocol.md#fast-failover): the claims
    of consumers whose liveness entry lapsed get their lease cut to now, so this run
    redelivers them too (counted in ``redelivered``). A one-shot run cannot tell whether
    Redis was just away (consumers then could not renew); a claim it hands on from a live
    consumer is fenced: that consumer's heartbeat drops it and cancels its work, and at
    most one record is written (docs/operations.md#consumers).

    Every queue's key types are checked before any script runs, in the store's key layout
    (on a Redis Cluster the queue's outbox and retry sets too,
    docs/topology.md#cluster-key-layout).

    Raises:
        WrongKeyType: a key holds another Redis type; nothing was changed.
        StoreError: Redis refused a command (:class:`StoreUnavailable`: unreachable).

    Cancellation: the queues already reclaimed stay reclaimed; each script call is atomic.
    """
    cluster = cluster_layout(store)
    types: dict[str, str] = {}
    for q in config.queues:
        types.update(
            queue_key_types(q.queue_name, cluster=cluster, retry_set=config.retry_queue_name)
        )
    await check_key_types(store, types)
    out: dict[str, ReclaimCounts] = {}
    for q in config.queues:
        ops = config.ops_for(store, q)
        if config.consumer_liveness_ttl_seconds > 0:
            await ops.expire_owners()
        out[q.queue_name] = await ops.reclaim(config.max_deliveries, full_scan=True)
    return out


def _counts_json(c: ReclaimCounts, *, cluster: bool) -> dict[str, int]:
    doc = {
        "redelivered": c.redelivered,
        "dead_lettered": c.dead,
        "ghosts": c.ghosts,
        "orphans": c.orphans,
        "leases_restored": c.leases_restored,
    }
    if cluster:
        doc["replayed"] = c.replayed
    return doc


def reclaim_json(
    per_queue: Mapping[str, ReclaimCounts], total: ReclaimCounts, *, cluster: bool = False
) -> dict[str, Any]:
    """The ``reclaim --once --json`` document: counts by queue, then the totals. On a Redis
    Cluster (``cluster``) each has ``replayed`` too: outbox entries the run finished
    (docs/topology.md#acks-across-slots)."""
    return {
        "queues": {name: _counts_json(c, cluster=cluster) for name, c in per_queue.items()},
        **_counts_json(total, cluster=cluster),
    }


def reclaim_line(queues: int, total: ReclaimCounts, *, cluster: bool = False) -> str:
    """The ``reclaim --once`` summary line; on a Redis Cluster it ends with ``replayed=N``
    (outbox entries the run finished, docs/topology.md#acks-across-slots)."""
    line = (
        f"claimkit reclaim: queues={queues} redelivered={total.redelivered} "
        f"dead_lettered={total.dead} ghosts={total.ghosts} "
        f"leases_restored={total.leases_restored}"
    )
    return f"{line} replayed={total.replayed}" if cluster else line
