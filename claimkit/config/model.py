"""The configuration as claimkit uses it: :class:`Config` and one :class:`QueueConfig` per
queue (docs/configuration.md). :func:`claimkit.config.load_config` builds them."""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import metadata
from typing import TYPE_CHECKING, Any

from claimkit._errors import ConfigError
from claimkit.protocol import keys as _keys
from claimkit.protocol.consumers import (
    DEFAULT_LIVENESS_TTL_SECONDS,
    ConsumerIdentity,
    default_consumer_id,
)
from claimkit.protocol.ops import QueueOps
from claimkit.store.topology import Topology

if TYPE_CHECKING:
    from claimkit.store import Store

__all__ = ["DEFAULT_MAX_DELIVERIES", "MAX_NUMBER", "Config", "QueueConfig", "WrongKeyType"]


def _version() -> str:
    """claimkit's installed version, or ``"unknown"`` when run from a bare source tree."""
    try:
        return metadata.version("claimkit")
    except metadata.PackageNotFoundError:
        return "unknown"


DEFAULT_MAX_DELIVERIES = 10
MAX_NUMBER = 2**31 - 1
"""The largest value any numeric field takes (24.8 days in ms, 68 years in seconds)."""


class WrongKeyType(ConfigError):
    """A key claimkit reads holds another Redis type than the layout says (docs/protocol.md#keys).

    ``str(err)`` is one line naming the key, what it holds and what was expected. Raised by
    the operator commands (``claimkit.ops.inspect.check_key_types``) and by ``serve``'s
    preflight and consumer; defined here, below both.
    """


@dataclass(frozen=True, slots=True)
class QueueConfig:
    """One entry of ``queues[]`` (docs/configuration.md)."""

    queue_name: str
    igw_base_url: str
    id: str = ""
    request_path_url: str = "/v1/completions"
    inference_objective: str | None = None
    result_queue_name: str | None = None
    gate_type: str = "constant"
    gate_params: dict[str, Any] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def queue_id(self) -> str:
        return self.id or self.queue_name


@dataclass(frozen=True, slots=True)
class Config:
    """The whole consumer configuration. Units are in the field names (docs/configuration.md).

    ``max_deliveries`` follows docs/protocol.md#reclaim: 0 means unlimited (not "the default").
    """

    url: str
    queues: tuple[QueueConfig, ...]
    result_queue_name: str = _keys.DEFAULT_RESULT_LIST
    retry_queue_name: str = _keys.DEFAULT_RETRY_SET
    poll_interval_ms: int = 1000
    batch_size: int = 10
    claim_lease_ttl_seconds: float = _keys.DEFAULT_LEASE_TTL_SECONDS
    claim_reclaim_interval_ms: int = 15000
    result_dedup_ttl_seconds: int = _keys.DEFAULT_DEDUP_TTL_SECONDS
    max_deliveries: int = DEFAULT_MAX_DELIVERIES
    concurrency: int = 64
    request_timeout_seconds: float = 300.0
    drain_timeout_seconds: float = 10.0
    metrics_port: int = 9090
    health_port: int = 8081
    http_host: str = "0.0.0.0"
    """The IP address the metrics and health servers bind (docs/operations.md)."""
    http_idle_timeout_seconds: float = 5.0
    http_max_connections: int = 512
    mode: str = "standalone"
    """``standalone``, ``cluster`` or ``sentinel`` (docs/topology.md#configuration)."""
    addrs: tuple[str, ...] = ()
    """More ``host:port`` seed nodes (cluster) or sentinels (sentinel) after ``url``'s."""
    master_name: str | None = None
    """The name the sentinels know the primary by (sentinel only)."""
    wait_replicas: int = 0
    """Replicas each claim, ack, release, park and reclaim waits for (``WAIT``); 0: off
    (docs/topology.md#failover)."""
    wait_timeout_ms: int = 1000
    """Milliseconds that ``WAIT`` may block before the call counts as failed."""
    unknown_fields: tuple[str, ...] = ()
    """Fields of the JSON claimkit does not know (ignored; the CLI warns about each)."""
    consumer_liveness_ttl_seconds: float = DEFAULT_LIVENESS_TTL_SECONDS
    """How far ahead of the server clock each heartbeat puts this consumer's liveness entry;
    a consumer whose entry lapsed has its claims handed on at once
    (docs/protocol.md#fast-failover). 0: no registry entry, no fast failover."""
    consumer_id: str = field(default_factory=default_consumer_id)
    """This ``serve``'s consumer id (``--consumer-id``, ``$CLAIMKIT_CONSUMER_ID``,
    ``$POD_NAME``, else ``<host>-<pid>``; docs/cli.md#claimkit-serve): the first part of
    every ownership token it writes and its name in the consumer registry."""

    @property
    def topology(self) -> Topology:
        """:attr:`mode`, :attr:`addrs` and :attr:`master_name`, as ``open_store`` takes them."""
        return Topology(self.mode, self.addrs, self.master_name)

    @property
    def claim_renew_interval_seconds(self) -> float:
        """How often the heartbeat renews the held claims, seconds:
        ``clamp(claim_lease_ttl / 3, 1 s, 30 s)`` (docs/protocol.md#heartbeat)."""
        return min(30.0, max(1.0, self.claim_lease_ttl_seconds / 3))

    @property
    def liveness_renew_interval_seconds(self) -> float | None:
        """How often the heartbeat renews this consumer's liveness entry, seconds:
        ``consumer_liveness_ttl_seconds / 3``, or ``None`` while the registry is off. A
        claims renewal renews the entry too, so in effect it is renewed every
        ``min(this, claim_renew_interval_seconds)`` (docs/protocol.md#heartbeat)."""
        if self.consumer_liveness_ttl_seconds <= 0:
            return None
        return self.consumer_liveness_ttl_seconds / 3

    def consumer_identity(self) -> ConsumerIdentity | None:
        """This consumer as its registry entry names it (docs/protocol.md#consumers), or
        ``None`` while the registry is off (``consumer_liveness_ttl_seconds`` = 0).

        Raises:
            ValueError: :attr:`consumer_id` is not a valid consumer id.
        """
        if self.consumer_liveness_ttl_seconds <= 0:
            return None
        return ConsumerIdentity.here(
            self.consumer_id, self.consumer_liveness_ttl_seconds, _version()
        )

    def queue(self, name: str) -> QueueConfig:
        """The queue called ``name``. Raises :class:`ConfigError` if it is not configured."""
        for q in self.queues:
            if q.queue_name == name:
                return q
        known = ", ".join(q.queue_name for q in self.queues) or "none"
        raise ConfigError(f"unknown queue {name!r} (configured: {known})")

    def ops_for(self, store: Store, queue: QueueConfig, *, consumer: bool = False) -> QueueOps:
        """The protocol operations of ``queue`` on ``store``, with this config's routing,
        dedup TTL (seconds), lease (seconds) and retry set: what ``serve`` and
        ``reclaim --once`` both run (docs/protocol.md#claim-protocol). With ``consumer``
        (``serve``) they also keep this consumer's registry entry
        (:meth:`consumer_identity`)."""
        return QueueOps(
            store,
            queue.queue_name,
            result_list=queue.result_queue_name,
            default_result_list=self.result_queue_name,
            dedup_ttl=self.result_dedup_ttl_seconds,
            lease_ttl=self.claim_lease_ttl_seconds,
            retry_set=self.retry_queue_name,
            consumer=self.consumer_identity() if consumer else None,
        )
