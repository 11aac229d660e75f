"""What claimkit checks about the Redis server itself: the mode it was told, and not
evicting.

Every command opens Redis through :func:`claimkit.store.open_store`. In standalone and
sentinel mode it wraps the store in :class:`StandaloneOnly`: before the first command
reaches Redis it asks ``INFO`` whether the server is a Redis Cluster node, and refuses with
:class:`ClusterUnsupported` (one line) when it is: standalone key names are not the cluster
layout, and a script failing on a cluster keeps its earlier writes
(docs/topology.md#configuration). A cluster reply met later (``MOVED``, ``ASK``,
``CLUSTERDOWN``, ``CROSSSLOT``, ``TRYAGAIN``) is the same refusal. In cluster mode the
cluster store itself refuses a server that is no cluster node
(:class:`~claimkit.store.cluster_store.NotACluster`).

``claimkit serve`` also reads the server's ``maxmemory-policy`` (:func:`eviction_policy`),
on every primary of a cluster: claimkit's guarantees assume ``noeviction``
(docs/operations.md, "Eviction").
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol, cast

from claimkit.store.interface import (
    Arg,
    ScriptCall,
    StoreError,
    StorePermissionError,
    reply_text,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from claimkit.store.interface import Store
    from claimkit.store.scripts import Script

__all__ = [
    "CLUSTER_REPLIES",
    "MIN_REDIS_VERSION",
    "ClusterUnsupported",
    "NotACluster",
    "SentinelMismatch",
    "ServerTooOld",
    "StandaloneOnly",
    "eviction_policy",
    "info_fields",
    "server_uptime",
]

log = logging.getLogger("claimkit")

CLUSTER_REPLIES = ("MOVED ", "ASK ", "CLUSTERDOWN", "CROSSSLOT", "TRYAGAIN")
"""How the error replies of a Redis Cluster node begin."""


class ClusterUnsupported(StoreError):
    """The Redis claimkit was pointed at is a Redis Cluster node, and ``mode`` is not
    ``"cluster"``; nothing was written.

    ``str(err)`` is one line: the URL (password masked), how it was told, and what to do.
    """

    @classmethod
    def for_url(cls, url: str, how: str) -> ClusterUnsupported:
        return cls(
            f'Redis at {url} is a Redis Cluster node ({how}): set "mode": "cluster" in '
            "the transport config to use it (docs/topology.md#configuration)"
        )


class SentinelMismatch(StoreError):
    """A Sentinel where the config expects a data server, or a data server where it
    expects sentinels; nothing was written. ``str(err)`` is one line: the URL (password
    masked), what it is, what to do (docs/topology.md#configuration)."""

    @classmethod
    def is_a_sentinel(cls, url: str) -> SentinelMismatch:
        """``mode`` standalone or cluster, and ``url`` is a sentinel."""
        return cls(
            f'Redis at {url} is a Sentinel: set "mode": "sentinel" and "master_name" '
            "(docs/topology.md#configuration)"
        )

    @classmethod
    def not_a_sentinel(cls, url: str, answered: str) -> SentinelMismatch:
        """``mode`` sentinel, and a server asked for the primary is no sentinel."""
        return cls(
            f"Redis at {url} is not a Sentinel (it answered {answered.strip()}): point url "
            "and addrs at the sentinels (docs/topology.md#configuration)"
        )


MIN_REDIS_VERSION = (7, 0)
"""The oldest server claimkit's scripts run on (``INFO``'s ``redis_version``; Valkey 7.2 and
later report 7.2 there): every script starts with a ``#!lua`` line (docs/compatibility.md)."""


class ServerTooOld(StoreError):
    """The server is older than :data:`MIN_REDIS_VERSION`; nothing was written.
    ``str(err)`` is one line: the URL (password masked), the version, what claimkit needs."""

    @classmethod
    def for_url(cls, url: str, version: str) -> ServerTooOld:
        return cls(
            f"Redis at {url} is version {version}: claimkit needs Redis 7.0 or later, or "
            "Valkey 7.2 or later (docs/compatibility.md#sharing-queues)"
        )


def too_old(version: str) -> bool:
    """Whether ``redis_version`` (``"6.2.14"``) is older than :data:`MIN_REDIS_VERSION`;
    ``False`` for a version that cannot be read."""
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) < MIN_REDIS_VERSION


class NotACluster(StoreError):
    """``mode`` is ``"cluster"`` but the server is not a Redis Cluster node; nothing was
    written. ``str(err)`` is one line: the URL (password masked), what it answered, what
    to do (docs/topology.md#configuration). Raised by
    :class:`~claimkit.store.cluster_store.ClusterStore`."""

    @classmethod
    def for_url(cls, url: str, how: str) -> NotACluster:
        return cls(
            f'Redis at {url} is not a Redis Cluster node ({how}): set "mode": '
            '"standalone" in the transport config, or point url at a cluster node '
            "(docs/topology.md#configuration)"
        )


def info_fields(reply: Any) -> dict[str, str]:
    """``INFO``'s ``name:value`` lines as a dict (section headers and blanks skipped)."""
    text = reply_text(reply)
    out: dict[str, str] = {}
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and not line.startswith("#"):
            out[name.strip()] = value.strip()
    return out


def _refused(exc: StoreError) -> bool:
    """Whether Redis refused the command itself (ACL, a renamed or disabled command)."""
    text = str(exc).lower()
    return "permission" in text or "noperm" in text or "unknown command" in text


class StandaloneOnly:
    """A :class:`~claimkit.store.Store` that refuses to talk to a Redis Cluster node.

    The first call (of any method) first runs ``INFO``; ``cluster_enabled:1`` raises
    :class:`ClusterUnsupported` before that call is sent, and so does every later call; a
    server older than Redis 7.0 raises :class:`ServerTooOld` the same way.
    A Sentinel (``INFO``'s ``redis_mode:sentinel``, Valkey's ``server_mode:sentinel``)
    raises :class:`SentinelMismatch`.
    When Redis is unreachable the check is tried again on the next call. When ``INFO`` is
    refused (an ACL without ``+info``) claimkit says so once and carries on; a cluster's
    ``MOVED``/``ASK``/``CLUSTERDOWN``/``CROSSSLOT``/``TRYAGAIN`` reply is still refused.

    Attributes:
        info: ``INFO``'s fields once read, else ``None`` (not yet, or refused).
    """

    def __init__(self, inner: Store) -> None:
        self._inner = inner
        self.url = inner.url
        self.mode = inner.mode
        self.info: dict[str, str] | None = None
        self._checked = False
        self._refusal: StoreError | None = None
        self._checked_at = self.topology_changes

    def __getattr__(self, name: str) -> Any:
        # What the inner store has beyond the Store protocol (a sentinel store's
        # topology_changes and topology_changed) passes through.
        if name.startswith("__") or name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)

    @property
    def topology_changes(self) -> int:
        """How often the inner store's server changed (a sentinel failover), else 0."""
        return int(getattr(self._inner, "topology_changes", 0))

    async def _check(self) -> None:
        if self._refusal is not None:
            raise self._refusal
        if self._checked_at != self.topology_changes:
            # Another server since the check (a failover): check the new one.
            self._checked_at = self.topology_changes
            self._checked = False
            self.info = None
        if self._checked:
            return
        try:
            info = info_fields(await self._inner.command("INFO"))
        except StoreError as exc:
            self._raise_if_cluster(exc)
            if isinstance(exc, SentinelMismatch):
                self._refusal = exc
                raise
            if not _refused(exc):
                raise
            self._checked = True
            log.warning(
                "claimkit: warning: cannot tell whether Redis at %s is a cluster: INFO was "
                "refused (%s); claimkit needs a standalone Redis",
                self.url,
                exc,
            )
            return
        self._checked = True
        if "sentinel" in (info.get("redis_mode"), info.get("server_mode")):  # Redis, Valkey
            self._refusal = SentinelMismatch.is_a_sentinel(self.url)
            raise self._refusal
        if info.get("cluster_enabled") == "1":
            self._refusal = ClusterUnsupported.for_url(self.url, "INFO says cluster_enabled:1")
            raise self._refusal
        version = info.get("redis_version", "")
        if too_old(version):
            self._refusal = ServerTooOld.for_url(self.url, version)
            raise self._refusal
        self.info = info

    def _raise_if_cluster(self, exc: StoreError) -> None:
        text = str(exc)
        if text.startswith(CLUSTER_REPLIES):
            self._refusal = ClusterUnsupported.for_url(self.url, f"it answered {text}")
            raise self._refusal from exc

    async def command(self, *args: Arg) -> Any:
        await self._check()
        try:
            return await self._inner.command(*args)
        except StoreError as exc:
            self._raise_if_cluster(exc)
            raise

    async def pipeline(self, commands: Sequence[Sequence[Arg]], *, transaction: bool) -> list[Any]:
        await self._check()
        try:
            return await self._inner.pipeline(commands, transaction=transaction)
        except StoreError as exc:
            self._raise_if_cluster(exc)
            raise

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[Arg]) -> Any:
        await self._check()
        try:
            return await self._inner.run(script, keys, args)
        except StoreError as exc:
            self._raise_if_cluster(exc)
            raise

    async def run_many(self, script: Script, calls: Sequence[ScriptCall]) -> list[Any]:
        await self._check()
        try:
            return await self._inner.run_many(script, calls)
        except StoreError as exc:
            self._raise_if_cluster(exc)
            raise


class _EachPrimary(Protocol):
    async def each_primary(self, *args: Arg) -> dict[str, Any]: ...


def _danger(policy: str) -> int:
    """How dangerous a policy is to claimkit's keys (docs/operations.md, "Eviction")."""
    return 0 if policy == "noeviction" else 1 if policy.startswith("volatile-") else 2


async def eviction_policy(store: Store) -> tuple[str | None, str]:
    """The server's ``maxmemory-policy``, from ``INFO`` (``maxmemory_policy``), else from
    ``CONFIG GET`` (which managed Redis services and narrow ACLs often refuse). On a
    cluster store, every primary's, and the most dangerous of them is returned.

    Returns:
        ``(policy, "")`` when read; ``(None, why)`` when neither could be read, ``why``
        saying what Redis answered (on a cluster: which node).

    Raises:
        StoreUnavailable: Redis is unreachable. StoreError: any other refusal than a
        refused command (a cluster node, a wrong password).
    """
    if store.mode == "cluster" and hasattr(store, "each_primary"):
        return await _cluster_eviction_policy(cast("_EachPrimary", store))
    return await _eviction_policy(store)


async def _cluster_eviction_policy(store: _EachPrimary) -> tuple[str | None, str]:
    found: dict[str, str] = {}
    unread: list[str] = []
    for node, reply in (await store.each_primary("INFO", "memory")).items():
        if isinstance(reply, BaseException):
            if not isinstance(reply, StoreError) or not _refused(reply):
                raise reply
            unread.append(node)
            continue
        policy = info_fields(reply).get("maxmemory_policy")
        if policy:
            found[node] = policy
        else:
            unread.append(node)
    if unread:
        replies = await store.each_primary("CONFIG", "GET", "maxmemory-policy")
        for node in unread:
            policy, why = _config_policy(replies.get(node))
            if policy is None:
                return None, f"on {node}: {why}"
            found[node] = policy
    if not found:
        return None, "the cluster has no primary"
    return max(found.values(), key=_danger), ""


def _config_policy(reply: Any) -> tuple[str | None, str]:
    """``CONFIG GET maxmemory-policy``'s reply (or the exception it raised) as
    :func:`eviction_policy` returns it."""
    if isinstance(reply, BaseException):
        if not isinstance(reply, StoreError) or not _refused(reply):
            raise reply
        return None, f"CONFIG GET maxmemory-policy was refused: {reply}"
    if reply is None:
        return None, "CONFIG GET maxmemory-policy answered nothing"
    values = list(reply.values()) if isinstance(reply, dict) else list(reply)[1::2]
    if not values:
        return None, "CONFIG GET maxmemory-policy answered nothing"
    return reply_text(values[0]), ""


async def _eviction_policy(store: Store) -> tuple[str | None, str]:
    info = store.info if isinstance(store, StandaloneOnly) else None
    if info is None:
        try:
            info = info_fields(await store.command("INFO", "memory"))
        except StoreError as exc:
            if not _refused(exc):
                raise
            info = {}
    policy = info.get("maxmemory_policy")
    if policy:
        return policy, ""
    try:
        reply = await store.command("CONFIG", "GET", "maxmemory-policy")
    except StoreError as exc:
        reply = exc
    return _config_policy(reply)


async def server_uptime(store: Store) -> float | None:
    """How long the Redis server has been up, seconds (``INFO server``'s
    ``uptime_in_seconds``); on a Redis Cluster the least of its primaries' (the most
    recently restarted). ``None`` when it cannot be told: ``INFO`` refused (an ACL, a
    renamed command) or the field missing.

    Raises:
        StoreUnavailable: Redis is unreachable. StoreError: any other refusal than a
        refused command.
    """
    if store.mode == "cluster" and hasattr(store, "each_primary"):
        replies = list((await cast("_EachPrimary", store).each_primary("INFO", "server")).values())
    else:
        try:
            replies = [await store.command("INFO", "server")]
        except StoreError as exc:
            replies = [exc]
    found: list[float] = []
    for reply in replies:
        if isinstance(reply, BaseException):
            if not isinstance(reply, StorePermissionError) and not (
                isinstance(reply, StoreError) and _refused(reply)
            ):
                raise reply
            return None
        value = info_fields(reply).get("uptime_in_seconds", "")
        if not value.isdigit():
            return None
        found.append(float(value))
    return min(found) if found else None
