"""Test support: a minimal :class:`~claimkit.store.Store` on a real Redis Cluster.

The store layer's own cluster client comes with ``mode: cluster`` (docs/topology.md); until
then the protocol tests need a store whose ``mode`` is ``"cluster"``. This one is
:class:`claimkit.store.coredis_store.CoredisStore` on a ``coredis.RedisCluster``: each key
argument is marked as a key, so coredis sends the command to the node of its slot, and
commands without keys that concern the whole keyspace (``KEYS``, ``FLUSHALL``,
``FLUSHDB``, ``SCRIPT``, ``DBSIZE``) go to every primary. No transaction: nothing in
cluster mode uses one (a cross-slot MULTI is what cluster mode avoids).

``cluster_store(urls)`` is an async context manager; ``cluster_params`` gives the
``store`` fixture params (``standalone`` and ``cluster``) that test modules share.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import coredis
from coredis.commands.request import CommandRequest
from coredis.connection import TCPLocation
from coredis.response._callbacks import NoopCallback
from coredis.retry import NoRetryPolicy
from coredis.typing import Key

from claimkit.store.coredis_store import CoredisStore, _translated

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

    from claimkit.store import Arg

__all__ = ["ClusterStore", "cluster_store"]

_NOOP = NoopCallback()  # type: ignore[var-annotated]

# Commands whose keys are all their arguments; commands about the whole keyspace (sent to
# every primary); commands with no key that any one node answers.
_ALL_KEYS = {"DEL", "EXISTS", "MGET", "UNLINK", "TOUCH"}
_EVERY_PRIMARY = {"KEYS", "SCRIPT", "FLUSHALL", "FLUSHDB", "DBSIZE", "CONFIG"}
_ANY_NODE = {"TIME", "PING", "INFO", "CLUSTER", "ACL", "CLIENT", "MEMORY", "COMMAND"}
_NO_KEYS = _EVERY_PRIMARY | _ANY_NODE


def _marked(args: Sequence[Arg]) -> tuple[Any, ...]:
    """``args`` with its key arguments wrapped in ``coredis.typing.Key``."""
    name = str(args[0]).upper()
    rest: list[Any] = list(args[1:])
    if name in ("EVAL", "EVALSHA", "EVAL_RO", "EVALSHA_RO"):
        numkeys = int(rest[1])
        rest[2 : 2 + numkeys] = [Key(k) for k in rest[2 : 2 + numkeys]]
    elif name in _ALL_KEYS:
        rest = [Key(k) for k in rest]
    elif name not in _NO_KEYS and rest:
        rest[0] = Key(rest[0])
    return (name.encode(), *rest)


class ClusterStore(CoredisStore):
    """:class:`CoredisStore` on a ``coredis.RedisCluster``: ``mode == "cluster"``."""

    mode = "cluster"

    def _request(self, args: Sequence[Arg]) -> CommandRequest[Any]:
        name, *rest = _marked(args)
        return CommandRequest(name, *rest, callback=_NOOP, execution_parameters={})

    async def pipeline(self, commands: Sequence[Sequence[Arg]], *, transaction: bool) -> list[Any]:
        if transaction:
            raise AssertionError("no MULTI/EXEC in cluster mode")
        keyed = [i for i, c in enumerate(commands) if str(c[0]).upper() not in _NO_KEYS]
        replies: list[Any] = [None] * len(commands)
        if keyed:
            got = await super().pipeline([commands[i] for i in keyed], transaction=False)
            for i, reply in zip(keyed, got, strict=True):
                replies[i] = reply
        for i, c in enumerate(commands):
            if i not in keyed:
                replies[i] = await self.command(*c)
        return replies

    async def _pipelined(self, commands: Sequence[Sequence[Arg]]) -> list[Any]:
        import coredis.exceptions as cx

        async with self._client.pipeline(transaction=False, raise_on_error=False) as pipe:
            pending = []
            for c in commands:
                name, *rest = _marked(c)
                pending.append(pipe.create_request(name, *rest, callback=_NOOP))
        replies: list[Any] = []
        for p in pending:
            try:
                replies.append(await p)
            except cx.ResponseError as exc:
                replies.append(exc)
        return replies

    async def command(self, *args: Arg) -> Any:
        name = str(args[0]).upper()
        if name not in _NO_KEYS:
            return await super().command(*args)
        client: Any = self._client
        layout = client.connection_pool.cluster_layout
        nodes = layout.primaries if name in _EVERY_PRIMARY else [layout.random_node()]
        replies = []
        with _translated(self.url):
            for node in nodes:
                replies.append(
                    await client._execute_command_on_single_node(node, self._request(args))
                )
        if name == "KEYS":
            return [key for reply in replies for key in reply]
        if name == "DBSIZE":
            return sum(int(r) for r in replies)
        return replies[0]


@asynccontextmanager
async def cluster_store(
    urls: Sequence[str], *, timeout: float = 10.0
) -> AsyncIterator[ClusterStore]:
    """A :class:`ClusterStore` seeded with the nodes of ``urls`` (``redis://host:port/0``)."""
    seeds = [TCPLocation(str(urlsplit(u).hostname), int(urlsplit(u).port or 6379)) for u in urls]
    client: coredis.RedisCluster[bytes] = coredis.RedisCluster(
        startup_nodes=seeds,
        decode_responses=False,
        connect_timeout=timeout,
        stream_timeout=timeout,
        retry_policy=NoRetryPolicy(),
        verify_version=False,
    )
    with _translated(urls[0]):
        async with client:
            yield ClusterStore(client, urls[0])  # type: ignore[arg-type]
