"""One full reclaim run over every configured queue (``claimkit reclaim --once``,
docs/cli.md; the rules: docs/protocol.md, "Reclaim")."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from claimkit.ops.inspect import check_key_types, cluster_layout, queue_key_types
from claimkit.protocol.consumers import lapsed_consumers
from claimkit.store.server_checks import server_uptime

if TYPE_CHECKING:
    from collections.abc import Mapping

    from claimkit.config import Config
    from claimkit.protocol.ops import ReclaimCounts
    from claimkit.store import Store

__all__ = ["ReclaimRun", "failover_skipped_lines", "reclaim_all", "reclaim_json", "reclaim_line"]

NO_ONE_ALIVE = (
    "no consumer of the queue is alive (every liveness entry lapsed: a Redis outage or "
    "failover, not one dead consumer)"
)
"""Why a queue's fast failover was skipped when no consumer of it is alive."""


@dataclasses.dataclass(frozen=True, slots=True)
class ReclaimRun:
    """What :func:`reclaim_all` did.

    Attributes:
        per_queue: the counts by queue name, in config order (``handed_on``: leases the
            fast failover cut).
        failover_skipped: queue name -> why its fast failover was skipped, for the queues
            where it would have handed claims on (they then wait for their leases).
    """

    per_queue: dict[str, ReclaimCounts]
    failover_skipped: dict[str, str]


async def reclaim_all(store: Store, config: Config) -> ReclaimRun:
    """Redeliver (or dead-letter) every expired claim of every queue of ``config``, with
    full scans until none is left; returns the counts by queue name, in config order. On a
    Redis Cluster each queue's run ends by finishing its outbox (``replayed``).

    Unless the consumer registry is off (``consumer_liveness_ttl_seconds`` = 0), each
    queue's run starts with the fast failover (docs/protocol.md#fast-failover): the claims
    of consumers whose liveness entry lapsed get their lease cut to now, so this run
    redelivers them too (counted in ``redelivered``, and in ``handed_on``). Right after a
    Redis restart live consumers could not renew either, so the failover is skipped (the
    lease-based reclaim still runs) on every queue while Redis's ``uptime_in_seconds`` is
    below one liveness TTL, and on a queue none of whose consumers is alive (the
    signature of an outage or of a failover that kept the uptime); ``INFO`` refused, only
    the second rule applies (docs/protocol.md#fast-failover). A claim handed on from a
    live consumer all the same is fenced: that consumer's heartbeat drops it and cancels
    its work, and at most one record is written (docs/operations.md#consumers).

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
    ttl = config.consumer_liveness_ttl_seconds
    young = None
    if ttl > 0:
        uptime = await server_uptime(store)
        if uptime is not None and uptime < ttl:
            young = (
                f"Redis has been up {uptime:g} s, less than one liveness TTL ({ttl:g} s): "
                "live consumers may not have renewed yet"
            )
    out: dict[str, ReclaimCounts] = {}
    skipped: dict[str, str] = {}
    for q in config.queues:
        ops = config.ops_for(store, q)
        cut: int | None = 0
        if ttl > 0 and young is not None:
            if await lapsed_consumers(store, ops.keys):
                skipped[q.queue_name] = young
        elif ttl > 0:
            _, cut = await ops.expire_owners(require_alive=True)
            if cut is None:
                skipped[q.queue_name] = NO_ONE_ALIVE
        counts = await ops.reclaim(config.max_deliveries, full_scan=True)
        out[q.queue_name] = dataclasses.replace(counts, handed_on=cut or 0)
    return ReclaimRun(out, skipped)


def failover_skipped_lines(run: ReclaimRun) -> list[str]:
    """One line per queue whose fast failover :func:`reclaim_all` skipped, saying why."""
    return [
        f"claimkit reclaim: {name}: fast failover skipped: {why}; "
        "the queue's claims wait for their leases"
        for name, why in run.failover_skipped.items()
    ]


def _counts_json(c: ReclaimCounts, *, cluster: bool) -> dict[str, int]:
    doc = {
        "redelivered": c.redelivered,
        "dead_lettered": c.dead,
        "ghosts": c.ghosts,
        "orphans": c.orphans,
        "leases_restored": c.leases_restored,
        "handed_on": c.handed_on,
    }
    if cluster:
        doc["replayed"] = c.replayed
    return doc


def reclaim_json(
    per_queue: Mapping[str, ReclaimCounts],
    total: ReclaimCounts,
    *,
    cluster: bool = False,
    failover_skipped: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The ``reclaim --once --json`` document: counts by queue, then the totals, then
    ``failover_skipped`` (queue name -> why its fast failover was skipped; ``{}``: none).
    ``handed_on`` counts the leases the fast failover cut (among ``redelivered``). On a
    Redis Cluster (``cluster``) each has ``replayed`` too: outbox entries the run finished
    (docs/topology.md#acks-across-slots)."""
    return {
        "queues": {name: _counts_json(c, cluster=cluster) for name, c in per_queue.items()},
        **_counts_json(total, cluster=cluster),
        "failover_skipped": dict(failover_skipped or {}),
    }


def reclaim_line(queues: int, total: ReclaimCounts, *, cluster: bool = False) -> str:
    """The ``reclaim --once`` summary line; ``handed_on=N`` counts the leases the fast
    failover cut (those claims are among ``redelivered``); on a Redis Cluster it ends with
    ``replayed=N`` (outbox entries the run finished, docs/topology.md#acks-across-slots)."""
    line = (
        f"claimkit reclaim: queues={queues} redelivered={total.redelivered} "
        f"dead_lettered={total.dead} ghosts={total.ghosts} "
        f"leases_restored={total.leases_restored} handed_on={total.handed_on}"
    )
    return f"{line} replayed={total.replayed}" if cluster else line
