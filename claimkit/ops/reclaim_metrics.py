"""What one ``claimkit reclaim --once`` run did, where Prometheus can see it
(docs/metrics.md#reclaim-once-metrics, docs/cli.md): a
node-exporter textfile (``--textfile``) or a Pushgateway push (``--pushgateway``), the way
cron jobs report.

A registry of its own holds, per queue (label ``queue_name``), what the run did (last-run
gauges: a cron job's counts are replaced by each run, so they are gauges, not counters),
when it finished, and the queue-wide gauges read right after it
(:class:`~claimkit.protocol.stats.QueueGauges`, the same names ``serve`` exports).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.error import HTTPError
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, Gauge, generate_latest, push_to_gateway

from claimkit.protocol.stats import QueueGauges

if TYPE_CHECKING:
    from collections.abc import Mapping

    from claimkit.config import Config
    from claimkit.protocol.ops import ReclaimCounts
    from claimkit.protocol.stats import QueueStats
    from claimkit.store import Store

__all__ = [
    "DEFAULT_PUSH_JOB",
    "PUSH_TIMEOUT_SECONDS",
    "RECLAIM_GAUGES",
    "ExportError",
    "push_metrics",
    "pushgateway_problem",
    "queue_stats_all",
    "reclaim_registry",
    "textfile_problem",
    "write_textfile",
]

DEFAULT_PUSH_JOB = "claimkit-reclaim"
"""The Pushgateway ``job`` a push goes under unless ``--push-job`` names another."""

PUSH_TIMEOUT_SECONDS = 10.0
"""How long a push may take (connect and answer), seconds."""

RECLAIM_GAUGES: tuple[tuple[str, str, str], ...] = (
    (
        "redelivered",
        "async_reclaim_last_run_redelivered",
        "Expired claims the last reclaim --once run put back in pending",
    ),
    (
        "dead",
        "async_reclaim_last_run_dead_lettered",
        "Requests the last reclaim --once run dead-lettered at max_deliveries",
    ),
    (
        "leases_restored",
        "async_reclaim_last_run_leases_restored",
        "Claims without a lease entry the last reclaim --once run gave their lease back",
    ),
    (
        "handed_on",
        "async_reclaim_last_run_handed_on",
        "Claims of dead consumers the last reclaim --once run's fast failover handed on",
    ),
)
"""``(ReclaimCounts attribute, metric name without the namespace, help)`` of the last-run
gauges."""

LAST_RUN = "async_reclaim_last_run_timestamp_seconds"
"""The gauge holding when the run finished (Unix seconds, Redis server clock; this
machine's clock when the queue-wide figures could not be read)."""


class ExportError(Exception):
    """The metrics could not be written or pushed; the message is one line naming the file
    or the Pushgateway and why. The reclaim itself is done by then and stays done."""


async def queue_stats_all(store: Store, config: Config) -> dict[str, QueueStats]:
    """Every configured queue's queue-wide figures, one read-only round trip per queue
    (:meth:`~claimkit.protocol.ops.QueueOps.queue_stats`), by queue name.

    Raises:
        StoreError: Redis refused a command (:class:`~claimkit.store.StoreUnavailable`:
            unreachable).
    """
    return {q.queue_name: await config.ops_for(store, q).queue_stats() for q in config.queues}


def reclaim_registry(
    per_queue: Mapping[str, ReclaimCounts],
    stats: Mapping[str, QueueStats],
    finished_at: float,
    *,
    namespace: str = "llm_d_async",
) -> CollectorRegistry:
    """A registry with what the run did per queue, when it finished and the queue-wide
    gauges of ``stats`` (read after the run; a queue missing from ``stats`` has none).

    ``finished_at`` (Unix seconds) is the finish time of a queue without ``stats``; a queue
    with them finished at their ``server_now`` (the Redis server clock)."""
    registry = CollectorRegistry(auto_describe=True)
    gauges = {
        attr: Gauge(name, doc, ("queue_name",), namespace=namespace, registry=registry)
        for attr, name, doc in RECLAIM_GAUGES
    }
    last_run = Gauge(
        LAST_RUN,
        "When the last reclaim --once run finished, Unix seconds (Redis server clock)",
        ("queue_name",),
        namespace=namespace,
        registry=registry,
    )
    queue_gauges = QueueGauges(registry, namespace)
    for name, counts in per_queue.items():
        for attr, gauge in gauges.items():
            gauge.labels(name).set(getattr(counts, attr))
        queue_stats = stats.get(name)
        last_run.labels(name).set(finished_at if queue_stats is None else queue_stats.server_now)
        if queue_stats is not None:
            queue_gauges.publish(name, queue_stats)
    return registry


def textfile_problem(path: str) -> str | None:
    """Why ``path`` cannot be a ``--textfile``, before anything runs, or ``None``: the node
    exporter's textfile collector reads only ``*.prom`` files."""
    if not path.endswith(".prom") or Path(path).name == ".prom":
        return (
            "--textfile must name a file ending in .prom (the node exporter reads only "
            f"those), got {path!r}"
        )
    return None


def pushgateway_problem(url: str) -> str | None:
    """Why ``url`` cannot be a ``--pushgateway``, before anything runs, or ``None``: an
    ``http://`` or ``https://`` URL with a host, or a bare ``host:port``."""
    target = url if "://" in url else "http://" + url
    parts = urlsplit(target)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"--pushgateway must be an http:// or https:// URL with a host, got {url!r}"
    return None


def write_textfile(path: str, registry: CollectorRegistry) -> None:
    """Write ``registry`` to ``path`` in the Prometheus text format, atomically: a temporary
    file in the same folder (its name starts with ``.``, and does not end in ``.prom``, so
    the collector never reads it half-written), flushed to disk, then renamed over ``path``.

    Raises:
        ExportError: the folder is missing or not writable (the temporary file is removed).
    """
    target = Path(path)
    data = generate_latest(registry)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as exc:
        raise ExportError(f"cannot write --textfile {path}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)  # the node exporter may run as another user
        os.replace(tmp, target)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise ExportError(f"cannot write --textfile {path}: {exc.strerror or exc}") from None


def push_metrics(url: str, job: str, registry: CollectorRegistry) -> None:
    """Push ``registry`` to the Pushgateway at ``url`` under ``job`` (HTTP ``PUT``: the
    job's earlier metrics are replaced), waiting at most :data:`PUSH_TIMEOUT_SECONDS`.

    Raises:
        ExportError: the Pushgateway could not be reached or refused the push.
    """
    try:
        push_to_gateway(url, job=job, registry=registry, timeout=PUSH_TIMEOUT_SECONDS)
    except OSError as exc:  # URLError and HTTPError are OSErrors
        if isinstance(exc, HTTPError):
            exc.close()  # it holds the refusal's open response
        reason = getattr(exc, "reason", None) or exc.strerror or exc
        code = getattr(exc, "code", None)
        why = f"HTTP {code} {reason}" if code else str(reason)
        raise ExportError(f"cannot push to --pushgateway {url}: {why}") from None
