"""Opening a store: :func:`open_store`, the one way every claimkit command connects."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from claimkit.store.tls import tls_settings
from claimkit.store.urls import check_url

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from claimkit.store.interface import Store

__all__ = ["open_store"]


@asynccontextmanager
async def open_store(
    url: str, *, backend: str = "coredis", timeout: float = 10.0
) -> AsyncIterator[Store]:
    """Open a store on ``url`` for the duration of the ``async with`` block.

    Args:
        url: ``redis://[user:password@]host:port/db`` (or ``rediss://``, ``unix://``).
        backend: ``"coredis"`` (default) or ``"redispy"`` (the optional extra).
        timeout: seconds allowed for connecting and for each reply; a hung Redis then
            surfaces as :class:`StoreUnavailable` instead of a stuck task.

    The store refuses a Redis Cluster node: its first call checks ``INFO`` first and
    raises :class:`~claimkit.store.server_checks.ClusterUnsupported` (one line) before anything
    is sent (docs/operations.md, "Redis Cluster").

    Raises:
        ValueError: a malformed URL or an unknown backend, before anything connects.
    """
    from claimkit.store.server_checks import StandaloneOnly

    check_url(url)
    shown, url = url, tls_settings(url)
    if backend == "coredis":
        from claimkit.store.coredis_store import open_coredis_store

        # coredis runs its pool in a task group, which wraps anything raised in the block
        # in an ExceptionGroup. That group is an implementation detail: unwrap a lone error.
        try:
            async with open_coredis_store(url, timeout=timeout, shown=shown) as store:
                yield StandaloneOnly(store)
        except BaseExceptionGroup as group:
            if len(group.exceptions) == 1 and not isinstance(
                group.exceptions[0], BaseExceptionGroup
            ):
                raise group.exceptions[0] from None
            raise
    elif backend == "redispy":
        from claimkit.store.redispy_store import open_redispy_store

        async with open_redispy_store(url, timeout=timeout, shown=shown) as store:
            yield StandaloneOnly(store)
    else:
        raise ValueError(f"unknown store backend {backend!r}: use 'coredis' or 'redispy'")
