"""Process wiring of ``claimkit serve``: store, consumer, signals, HTTP servers.

Its tasks and their shutdown: docs/protocol.md#tasks-and-shutdown.
"""

from __future__ import annotations

import logging
import resource
import signal
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, cast

import trio

from claimkit.config import Config, ConfigError
from claimkit.consumer.consumer import Consumer, Summary, check_key_roles, key_roles
from claimkit.consumer.health import HttpBindError, serve_http
from claimkit.protocol.ops import first_wrong_type
from claimkit.store import Store, StoreError, StoreUnavailable, open_store
from claimkit.store.server_checks import eviction_policy

if TYPE_CHECKING:
    from collections.abc import Iterator
    from types import FrameType

__all__ = ["FD_RESERVE", "fds_needed", "raise_open_file_limit", "serve_forever"]

log = logging.getLogger("claimkit")


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class _EarlySignals:
    """SIGTERM/SIGINT that arrived while ``serve`` started (Redis connection, preflight,
    HTTP servers), remembered so that a stop sent then is a graceful stop, not SIGTERM's
    default action killing the process. :func:`_signals` acts on them once it listens."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, Any] = {}

    def _remember(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)

    def install(self) -> None:
        self._previous = {s: signal.signal(s, self._remember) for s in _STOP_SIGNALS}

    def restore(self) -> None:
        """Put back the handlers found at :meth:`install` (idempotent). Called once the
        consumer has stopped, so a signal during teardown acts at once (Ctrl-C
        interrupts it) instead of being remembered for no one."""
        previous, self._previous = self._previous, {}
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextmanager
def _signals_while_starting() -> Iterator[_EarlySignals]:
    early = _EarlySignals()
    early.install()
    try:
        yield early
    finally:
        early.restore()


async def _signals(
    consumer: Consumer, early: _EarlySignals, *, task_status: trio.TaskStatus[None]
) -> None:
    with trio.open_signal_receiver(*_STOP_SIGNALS) as received:
        task_status.started()
        for signum in early.received:
            log.info("claimkit: %s received while starting", signal.Signals(signum).name)
            consumer.request_stop()
        async for signum in received:
            log.info("claimkit: %s received", signal.Signals(signum).name)
            consumer.request_stop()


async def _preflight(store: Store, config: Config, *, allow_eviction: bool = False) -> None:
    """Refuse to start on a mistake that retrying cannot mend: a wrong password (StoreError)
    or any key serve uses holding another type than the one docs/protocol.md#keys gives it
    (:func:`key_roles`: each queue's own keys, the retry set and its dead set, the result
    lists, a gate's budget key; keys that do not exist are fine), a server of another mode
    than the config's (a Redis Cluster node in standalone mode, or no cluster node in
    cluster mode; docs/topology.md#configuration), or a server that may evict any key
    (:func:`_check_eviction`; on a cluster, any primary). Redis merely unreachable is not one
    of them: the consumer starts and retries until it answers
    (docs/protocol.md#tasks-and-shutdown). After a sentinel failover it runs again against
    the promoted primary (:class:`_AfterFailovers`, docs/topology.md#sentinel).

    Raises:
        WrongKeyType: one line naming the key, the type it holds and the type expected.
        ConfigError: one key would have to be two types (:func:`key_roles`), or Redis
            evicts any key and ``allow_eviction`` is false.
        ClusterUnsupported, NotACluster, SentinelMismatch: the server's mode is not the
            config's.
    """
    roles = key_roles(config)
    try:
        await check_key_roles(partial(first_wrong_type, store), roles)
        await _check_eviction(store, allow_eviction=allow_eviction)
    except StoreUnavailable as exc:
        log.warning("claimkit: Redis is unavailable at start (%s); retrying until it answers", exc)


class _FollowsFailovers(Protocol):
    """A store whose server can change under it (a sentinel store, docs/topology.md#sentinel)."""

    topology_changes: int

    async def topology_changed(self, seen: int) -> int: ...


class _AfterFailovers:
    """Reruns the preflight (:func:`_preflight`) once after each failover of a sentinel
    store, while the consumer runs: the new primary gets the same checks as the first one
    (key types, eviction policy). A refusal there stops the consumer, and :meth:`raise_refusal`
    raises it after the shutdown, as the start-up refusal would have been raised."""

    def __init__(self, store: Store, config: Config, allow_eviction: bool) -> None:
        self._store = store
        self._config = config
        self._allow_eviction = allow_eviction
        self.refusal: Exception | None = None

    def applies(self) -> bool:
        return callable(getattr(self._store, "topology_changed", None))

    async def run(self, consumer: Consumer, *, task_status: trio.TaskStatus[None]) -> None:
        store = cast("_FollowsFailovers", self._store)
        seen = store.topology_changes
        task_status.started()
        while True:
            seen = await store.topology_changed(seen)
            try:
                await _preflight(self._store, self._config, allow_eviction=self._allow_eviction)
            except (ConfigError, StoreError) as exc:
                self.refusal = exc
                log.error("claimkit: after the failover: %s; stopping", exc)
                consumer.request_stop()
                return

    def raise_refusal(self) -> None:
        if self.refusal is not None:
            raise self.refusal


def _bind_error_line(exc: HttpBindError, config: Config) -> str:
    """One line naming the address, the port, and the flag and config field that set it."""
    if config.metrics_port == config.health_port:
        knobs = "--metrics-port and --health-port (config metrics_port, health_port)"
    elif exc.paths == "/metrics":
        knobs = "--metrics-port (config metrics_port)"
    else:
        knobs = "--health-port (config health_port)"
    if "assign requested address" in exc.reason:  # EADDRNOTAVAIL: not this host's address
        return f"{exc}; set --http-host (config http_host) to an address of this host"
    return f"{exc}; set {knobs} to a free port, or 0 to turn that server off"


_VOLATILE_POLICIES = frozenset({"volatile-lru", "volatile-lfu", "volatile-random", "volatile-ttl"})


async def _check_eviction(store: Store, *, allow_eviction: bool) -> None:
    """claimkit's guarantees assume ``maxmemory-policy noeviction`` (docs/operations.md,
    "Eviction"). A ``volatile-*`` policy evicts only keys with a TTL (dedup and cancel
    markers): a warning. Any other policy (``allkeys-*``) can evict pending and claimed
    requests: a refusal, unless ``allow_eviction`` (then a warning). A policy that cannot be
    read (``CONFIG`` refused) is said in one line, and serve carries on."""
    policy, why = await eviction_policy(store)
    if policy is None:
        log.warning(
            "claimkit: warning: cannot read Redis's maxmemory-policy (%s); claimkit needs "
            'noeviction (docs/operations.md, "Eviction")',
            why,
        )
    elif policy in _VOLATILE_POLICIES:
        log.warning(
            "claimkit: warning: Redis at %s has maxmemory-policy %s: under memory pressure "
            "it evicts keys with a TTL, claimkit's dedup and cancel markers (a record pushed "
            'twice, a cancel lost); set noeviction (docs/operations.md, "Eviction")',
            store.url,
            policy,
        )
    elif policy != "noeviction":
        if not allow_eviction:
            raise ConfigError(
                f"Redis at {store.url} has maxmemory-policy {policy}, which can evict queued "
                "and claimed requests: set maxmemory-policy noeviction (docs/operations.md, "
                '"Eviction"), or pass --allow-eviction to serve anyway'
            )
        log.warning(
            "claimkit: WARNING: Redis at %s has maxmemory-policy %s, which can evict queued "
            "and claimed requests; serving anyway (--allow-eviction)",
            store.url,
            policy,
        )


FD_RESERVE = 64
"""File descriptors ``serve`` needs besides its gateway and probe connections: the Redis
pool's connections, the listening sockets, stdio, trio's wake-up socket pair, logs."""


def fds_needed(config: Config) -> int:
    """How many file descriptors ``serve`` may hold at once with ``config``: one gateway
    connection per request in flight (``concurrency``), ``http_max_connections`` when the
    metrics or health server is on, and :data:`FD_RESERVE`
    (docs/performance.md#how-to-size-concurrency)."""
    probes = config.http_max_connections if (config.metrics_port or config.health_port) else 0
    return config.concurrency + probes + FD_RESERVE


def raise_open_file_limit(config: Config) -> tuple[int, int]:
    """Raise this process's soft open-file limit (``RLIMIT_NOFILE``) to its hard limit, and
    warn in one line when it is still below :func:`fds_needed`.

    Most Linux systems start processes with a soft limit of 1024, which 1,000 gateway
    connections in flight exhaust: each further connect fails (``EMFILE``) as if the
    gateway were unreachable (docs/dispatch.md#the-gateway-is-unreachable). Any process may
    raise its soft limit up to the hard one; past that only the operator can (``ulimit
    -Hn``, systemd ``LimitNOFILE=``, the container runtime's ``nofile`` ulimit). A hard limit of
    ``RLIM_INFINITY`` raises the soft one to what ``config`` needs (Linux refuses an
    infinite soft limit). A refused raise is a warning, never an error.

    Returns:
        ``(before, after)``: the soft limit found and the one in force now.
    """
    needed = fds_needed(config)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = max(soft, needed) if hard == resource.RLIM_INFINITY else hard
    after = soft
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            after = target
        except (OSError, ValueError) as exc:
            log.warning("claimkit: cannot raise the open-file limit from %d: %s", soft, exc)
        else:
            log.info("claimkit: open-file limit (RLIMIT_NOFILE) raised from %d to %d", soft, after)
    if after != resource.RLIM_INFINITY and after < needed:
        log.warning(
            "claimkit: warning: the open-file limit is %d (hard limit %s), below the %d that "
            "--concurrency %d needs (one gateway connection per request in flight, plus %d); "
            "past it a request that cannot open a connection is handed back and claiming "
            "waits (docs/dispatch.md#out-of-open-files): raise the hard limit "
            "(ulimit -Hn, systemd LimitNOFILE=, the container's nofile ulimit; "
            "docs/performance.md#how-to-size-concurrency) or lower --concurrency",
            after,
            "unlimited" if hard == resource.RLIM_INFINITY else hard,
            needed,
            config.concurrency,
            needed - config.concurrency,
        )
    return soft, after


async def serve_forever(
    config: Config, *, backend: str = "coredis", allow_eviction: bool = False
) -> Summary:
    """Run the consumer until SIGTERM/SIGINT and return its summary.

    A SIGTERM or SIGINT received while it starts is acted on as soon as the consumer runs:
    it stops at once, through the same shutdown. First the open-file limit is raised to
    what ``config.concurrency`` needs, as far as the hard limit allows
    (:func:`raise_open_file_limit`).

    Args:
        config: the loaded config.
        backend: the store backend, ``"coredis"`` or ``"redispy"``.
        allow_eviction: serve even when Redis's ``maxmemory-policy`` can evict any key
            (``allkeys-*``); a loud warning instead of the refusal (docs/operations.md,
            "Eviction").

    Raises:
        ConfigError: a port is taken, a gate is misconfigured, or Redis may evict any key
            (one line).
        ClusterUnsupported, NotACluster, SentinelMismatch: the server's mode is not the
            config's (one line).
        ConfigError, StoreError: the preflight rerun after a sentinel failover refused the
            promoted primary (one line; the consumer stopped first).
    """
    raise_open_file_limit(config)
    with _signals_while_starting() as early:
        return await _serve(config, backend, early, allow_eviction)


async def _serve(
    config: Config, backend: str, early: _EarlySignals, allow_eviction: bool = False
) -> Summary:
    async with open_store(
        config.url,
        backend=backend,
        topology=config.topology,
        wait_replicas=config.wait_replicas,
        wait_timeout_ms=config.wait_timeout_ms,
    ) as store:
        await _preflight(store, config, allow_eviction=allow_eviction)
        try:
            consumer = Consumer(config, store)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        servers = serve_http(
            metrics_port=config.metrics_port,
            health_port=config.health_port,
            registry=consumer.metrics.registry,
            ready=consumer.ready,
            host=config.http_host,
            idle_timeout=config.http_idle_timeout_seconds,
            max_connections=config.http_max_connections,
        )
        try:
            bound = servers.__enter__()
        except HttpBindError as exc:
            raise ConfigError(_bind_error_line(exc, config)) from exc
        try:
            log.info(
                "claimkit: serving %s on %s as consumer %s (metrics %s, health %s%s)",
                ", ".join(q.queue_name for q in config.queues),
                store.url,
                config.consumer_id,
                bound.get("metrics", "off"),
                bound.get("health", "off"),
                f", on {config.http_host}" if bound else "",
            )
            failovers = _AfterFailovers(store, config, allow_eviction)
            async with trio.open_nursery() as nursery:
                await nursery.start(_signals, consumer, early)
                if failovers.applies():
                    await nursery.start(failovers.run, consumer)
                summary = await consumer.run()
                nursery.cancel_scope.cancel()
            early.restore()  # the claims are swept: a signal now may end the teardown
            failovers.raise_refusal()
            return summary
        finally:
            servers.__exit__(None, None, None)
