"""Opening a store: :func:`open_store`, the one way every claimkit command connects."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from claimkit._errors import ConfigError
from claimkit.store.script_calls import ReplicaWait
from claimkit.store.tls import tls_settings
from claimkit.store.topology import Topology
from claimkit.store.urls import check_url

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from claimkit.store.interface import Store

__all__ = ["open_store"]

_STANDALONE = Topology()


@asynccontextmanager
async def open_store(
    url: str,
    *,
    backend: str = "coredis",
    timeout: float = 10.0,
    topology: Topology | None = None,
    wait_replicas: int = 0,
    wait_timeout_ms: int = 1000,
) -> AsyncIterator[Store]:
    """Open a store on ``url`` for the duration of the ``async with`` block.

    Args:
        url: ``redis://[user:password@]host:port/db`` (or ``rediss://``, ``unix://``). In
            cluster and sentinel mode its host and port are the first seed node or sentinel;
            its credentials, TLS settings (and database, sentinel) are the data connection's.
        backend: ``"coredis"`` (default) or ``"redispy"`` (the optional extra; standalone
            only).
        timeout: seconds allowed for connecting and for each reply; a hung Redis then
            surfaces as :class:`StoreUnavailable` instead of a stuck task.
        topology: standalone (``None``, the default), cluster or sentinel
            (docs/topology.md#configuration).
        wait_replicas: when above 0, every call of a writing script is followed on its
            connection by ``WAIT wait_replicas wait_timeout_ms``; fewer confirmations raise
            :class:`StoreUnavailable` (docs/topology.md#failover).
        wait_timeout_ms: milliseconds ``WAIT`` may block.

    The store's mode must match the server (docs/topology.md#configuration): in standalone
    and sentinel mode the first call checks ``INFO`` and a Redis Cluster node is refused
    (:class:`~claimkit.store.server_checks.ClusterUnsupported`, one line, nothing sent); in
    cluster mode a server that is no cluster node is refused
    (:class:`~claimkit.store.cluster_store.NotACluster`).

    Raises:
        ValueError: a malformed URL or an unknown backend, before anything connects.
        ConfigError: an invalid topology (one line), or a topology the backend cannot
            serve (redispy: standalone only).
    """
    from claimkit.store.server_checks import StandaloneOnly

    topology = topology or _STANDALONE
    check_url(url)
    topology.validate(url)
    if wait_replicas < 0 or wait_timeout_ms < 0:
        raise ConfigError("wait_replicas and wait_timeout_ms must be non-negative")
    wait = ReplicaWait(wait_replicas, wait_timeout_ms)
    shown, url = url, tls_settings(url)
    if backend == "coredis":
        # coredis runs its pool in a task group, which wraps anything raised in the block
        # in an ExceptionGroup. That group is an implementation detail: unwrap a lone error.
        try:
            async with _open_coredis(url, shown, timeout, topology, wait) as store:
                yield store
        except BaseExceptionGroup as group:
            if len(group.exceptions) == 1 and not isinstance(
                group.exceptions[0], BaseExceptionGroup
            ):
                raise group.exceptions[0] from None
            raise
    elif backend == "redispy":
        if topology.mode != "standalone":
            raise ConfigError(
                f'mode "{topology.mode}" needs the coredis store backend: the redispy '
                "backend serves a standalone Redis only (docs/store-backends.md)"
            )
        from claimkit.store.redispy_store import open_redispy_store

        async with open_redispy_store(url, timeout=timeout, shown=shown, wait=wait) as store:
            yield StandaloneOnly(store)
    else:
        raise ValueError(f"unknown store backend {backend!r}: use 'coredis' or 'redispy'")


@asynccontextmanager
async def _open_coredis(
    url: str, shown: str, timeout: float, topology: Topology, wait: ReplicaWait
) -> AsyncIterator[Store]:
    from claimkit.store.server_checks import StandaloneOnly

    if topology.mode == "cluster":
        from claimkit.store.cluster_store import open_cluster_store

        seeds = topology.seeds(url)
        async with open_cluster_store(
            url, timeout=timeout, seeds=seeds, shown=shown, wait=wait
        ) as cluster:
            yield cluster
    elif topology.mode == "sentinel":
        from claimkit.store.sentinel_store import open_sentinel_store

        async with open_sentinel_store(
            url, timeout=timeout, topology=topology, shown=shown, wait=wait
        ) as primary:
            yield StandaloneOnly(primary)
    else:
        from claimkit.store.coredis_store import open_coredis_store

        async with open_coredis_store(url, timeout=timeout, shown=shown, wait=wait) as store:
            yield StandaloneOnly(store)
