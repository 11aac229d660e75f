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

__all__ = ["reclaim_all", "reclaim_json"]


async def reclaim_all(store: Store, config: Config) -> dict[str, ReclaimCounts]:
    """Redeliver (or dead-letter) every expired claim of every queue of ``config``, with
    full scans until none is left; returns the counts by queue name, in config order.

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
        out[q.queue_name] = await ops.reclaim(config.max_deliveries, full_scan=True)
    return out


def _counts_json(c: ReclaimCounts) -> dict[str, int]:
    return {
        "redelivered": c.redelivered,
        "dead_lettered": c.dead,
        "ghosts": c.ghosts,
        "orphans": c.orphans,
        "leases_restored": c.leases_restored,
    }


def reclaim_json(per_queue: Mapping[str, ReclaimCounts], total: ReclaimCounts) -> dict[str, Any]:
    """The ``reclaim --once --json`` document: counts by queue, then the totals."""
    return {
        "queues": {name: _counts_json(c) for name, c in per_queue.items()},
        **_counts_json(total),
    }
