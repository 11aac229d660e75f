"""Test support: claimkit's cluster store (``open_store(topology=Topology("cluster"))``) with
the whole keyspace in view, for tests that compare every key of a cluster.

The store sends a command without keys to one node; a test's ``KEYS *``, ``FLUSHALL``,
``FLUSHDB`` and ``DBSIZE`` must see every primary. :class:`WholeCluster` delegates
everything to the real store and sends those four to each primary itself (by its own
connection, :meth:`tests.cluster.RedisCluster.call`), so ``support.snapshot`` shows the
whole cluster. :func:`cluster_store` opens one on a :class:`tests.cluster.RedisCluster`;
:func:`flushed_store` is the ``store`` fixture of the tests that run on a cluster (import it
beside ``redis_cluster``).
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import pytest
import trio
from support import StoreWrapper

from claimkit.store import Topology, open_store

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from cluster import RedisCluster

    from claimkit.store import Arg, Store

__all__ = ["WholeCluster", "cluster_store", "flushed_store"]

_EVERY_PRIMARY = {"KEYS", "FLUSHALL", "FLUSHDB", "DBSIZE"}


def topology(cluster: RedisCluster) -> Topology:
    """The topology of ``cluster``: mode cluster, every node after the first as a seed."""
    return Topology(mode="cluster", addrs=tuple(f"127.0.0.1:{n.port}" for n in cluster.nodes[1:]))


class WholeCluster(StoreWrapper):
    """The cluster store ``inner`` of ``cluster``; keyspace-wide commands reach every
    primary (``KEYS`` answers every primary's keys, ``DBSIZE`` their sum)."""

    def __init__(self, inner: Store, cluster: RedisCluster) -> None:
        super().__init__(inner)
        self.cluster = cluster

    def reopen(self) -> Any:
        """Another store on the same cluster (another instance)."""
        return cluster_store(self.cluster)

    def _primaries(self) -> list[int]:
        return [
            i
            for i in range(len(self.cluster.nodes))
            if (role := self.cluster.call(i, "ROLE")) and role[0] == b"master"
        ]

    async def command(self, *args: Arg) -> Any:
        name = str(args[0]).upper()
        if name not in _EVERY_PRIMARY:
            return await self.inner.command(*args)
        text = [a.decode() if isinstance(a, bytes) else str(a) for a in args]

        def each() -> list[Any]:
            return [self.cluster.call(i, *text) for i in self._primaries()]

        replies = await trio.to_thread.run_sync(each)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        if name == "KEYS":
            return [key for reply in replies for key in reply]
        if name == "DBSIZE":
            return sum(int(r) for r in replies)
        return replies[0]


@asynccontextmanager
async def cluster_store(cluster: RedisCluster) -> AsyncIterator[WholeCluster]:
    """A :class:`WholeCluster` on ``cluster`` for the ``async with`` block."""
    async with open_store(cluster.url, topology=topology(cluster)) as store:
        yield WholeCluster(store, cluster)


@pytest.fixture(name="store")
async def flushed_store(redis_cluster: RedisCluster) -> AsyncIterator[WholeCluster]:
    """``store``: a :class:`WholeCluster` on an empty cluster keyspace."""
    async with cluster_store(redis_cluster) as opened:
        await opened.command("FLUSHALL")
        yield opened
