"""Prometheus metrics (docs/metrics.md), on a registry of their own per consumer.

Names are those of docs/metrics.md under the namespace (default ``llm_d_async``), so the
claim depth is exported as ``llm_d_async_async_claim_depth``; counters get
prometheus-client's ``_total``. The per-process metrics have the labels ``queue_id``,
``queue_name`` and ``pool_name`` (the queue's ``labels.pool_name``, or ``""``); the
queue-wide gauges read from Redis (:class:`~claimkit.protocol.stats.QueueGauges`) only
``queue_name``; ``async_terminal_records_total`` ``queue_name``, ``error_code`` and
``status_code``.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from importlib import metadata
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from claimkit.protocol.stats import QueueGauges

if TYPE_CHECKING:
    from claimkit.config import QueueConfig

__all__ = ["Metrics", "QueueMetrics", "claimkit_version"]


def claimkit_version() -> str:
    """The installed claimkit's version (``"0.1.0"``), or ``"unknown"`` when it is run from
    a source tree without an install."""
    try:
        return metadata.version("claimkit")
    except metadata.PackageNotFoundError:
        return "unknown"


_LABELS = ("queue_id", "queue_name", "pool_name")
_LATENCY_BUCKETS_MS = (10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000, 300000)


@dataclass(frozen=True, slots=True)
class QueueMetrics:
    """The labelled children of every metric, for one queue."""

    claim_depth: Gauge
    claims_expired: Counter
    duplicates_suppressed: Counter
    requests: Counter
    retries: Counter
    successes: Counter
    failures: Counter
    deadline_exceeded: Counter
    shedded: Counter
    latency_ms: Histogram
    inflight: Gauge
    backlog: Gauge
    dead_lettered: Counter
    gateway_no_response: Counter
    gateway_unsent: Counter
    gateway_breaker_open: Gauge
    paused: Gauge
    terminal_records: Counter  # the parent: labelled per record by count_terminal
    queue_name: str
    # count_terminal's children by (error_code, status_code): one labels() lookup each
    _terminal_children: dict[tuple[str | None, int | None], Counter] = field(default_factory=dict)

    def count_terminal(self, error_code: str | None, status_code: int | None) -> None:
        """Count one terminal record written (``async_terminal_records_total``): its
        ``error_code`` (``""`` for an HTTP response's record) and ``status_code``
        (``""`` when it has none)."""
        key = (error_code, status_code)
        child = self._terminal_children.get(key)
        if child is None:
            status = "" if status_code is None else str(status_code)
            child = self.terminal_records.labels(self.queue_name, error_code or "", status)
            self._terminal_children[key] = child
        child.inc()


class Metrics:
    """All the metrics of docs/metrics.md on one :class:`CollectorRegistry`.

    Args:
        namespace: metric name prefix (default ``llm_d_async``, docs/metrics.md).
    """

    def __init__(self, namespace: str = "llm_d_async") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, ns = self.registry, namespace

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, _LABELS, namespace=ns, registry=r)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, _LABELS, namespace=ns, registry=r)

        self.claim_depth = gauge("async_claim_depth", "Claims this process holds")
        self.claims_expired = counter(
            "async_claims_expired", "Claims whose lease expired and were redelivered"
        )
        self.duplicates_suppressed = counter(
            "async_duplicate_results_suppressed", "Terminal records suppressed as duplicates"
        )
        self.requests = counter("async_request", "Requests claimed for processing")
        self.retries = counter("async_request_retries", "Requests parked for a retry")
        self.successes = counter("async_successful_requests", "Requests answered 2xx")
        self.failures = counter("async_failed_requests", "Requests ending in an error record")
        self.deadline_exceeded = counter(
            "async_exceeded_deadline_requests", "Requests whose deadline passed"
        )
        self.shedded = counter("async_shedded_requests", "Dispatches refused by a gate")
        self.latency_ms = Histogram(
            "async_inference_latency_time_millis",
            "Inference HTTP latency in milliseconds",
            _LABELS,
            namespace=ns,
            registry=r,
            buckets=_LATENCY_BUCKETS_MS,
        )
        self.inflight = gauge("async_inflight_requests", "Requests being dispatched now")
        self.backlog = gauge("async_broker_backlog", "Pending requests in the queue")
        self.dead_lettered = counter("async_dead_lettered", "Members moved to the dead set")
        self.gateway_no_response = counter(
            "async_gateway_no_response",
            "Requests written to the gateway that got no response (connection closed or reset,"
            " or request_timeout passed): INFERENCE_ERROR, never re-sent",
        )
        self.gateway_unsent = counter(
            "async_gateway_unsent",
            "Attempts that could not reach the gateway (DNS, connection refused, connect"
            " timeout, TLS handshake): nothing was sent, the claim was handed back to pending",
        )
        self.gateway_breaker_open = gauge(
            "async_gateway_breaker_open",
            "1 while this queue's gateway breaker is open (claiming paused until the gateway"
            " answers a probe), else 0",
        )
        self.paused = gauge(
            "async_queue_paused",
            "1 while this process sees the queue paused (claimkit pause): it claims nothing new",
        )
        self.terminal_records = Counter(
            "async_terminal_records",
            "Terminal records this process wrote, by error_code and status_code",
            ("queue_name", "error_code", "status_code"),
            namespace=ns,
            registry=r,
        )
        self.queue_gauges = QueueGauges(r, ns)
        self.build_info = Gauge(
            "claimkit_build_info",
            "Always 1; the labels name the claimkit and Python versions of this process",
            ("version", "python"),
            namespace=ns,
            registry=r,
        )
        self.build_info.labels(claimkit_version(), platform.python_version()).set(1)

    def for_queue(self, queue: QueueConfig) -> QueueMetrics:
        labels = (queue.queue_id, queue.queue_name, queue.labels.get("pool_name", ""))
        return QueueMetrics(
            claim_depth=self.claim_depth.labels(*labels),
            claims_expired=self.claims_expired.labels(*labels),
            duplicates_suppressed=self.duplicates_suppressed.labels(*labels),
            requests=self.requests.labels(*labels),
            retries=self.retries.labels(*labels),
            successes=self.successes.labels(*labels),
            failures=self.failures.labels(*labels),
            deadline_exceeded=self.deadline_exceeded.labels(*labels),
            shedded=self.shedded.labels(*labels),
            latency_ms=self.latency_ms.labels(*labels),
            inflight=self.inflight.labels(*labels),
            backlog=self.backlog.labels(*labels),
            dead_lettered=self.dead_lettered.labels(*labels),
            gateway_no_response=self.gateway_no_response.labels(*labels),
            gateway_unsent=self.gateway_unsent.labels(*labels),
            gateway_breaker_open=self.gateway_breaker_open.labels(*labels),
            paused=self.paused.labels(*labels),
            terminal_records=self.terminal_records,
            queue_name=queue.queue_name,
        )
