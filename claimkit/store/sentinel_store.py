"""The Sentinel store: the primary that Redis Sentinel names for ``master_name``, followed
across a failover (docs/topology.md#sentinel).

coredis's sentinel-managed pool asks the sentinels where the primary is each time it opens
a connection, checks with ``ROLE`` that the server it reached is a primary, and drops every
pooled connection once the sentinels name another address. claimkit adds three things:

- a call that met a server which is no longer the primary (``READONLY``, a stale primary)
  drops the pool's connections, so the next call asks the sentinels again instead of
  reusing connections to a demoted server;
- one ``WARNING`` log line when the primary's address changes,
  ``claimkit: Redis primary for <master_name> is now host:port (was host:port)``;
- :attr:`SentinelStore.topology_changes`, counting those changes, for a caller that reruns
  its checks after a failover (``serve``'s preflight).
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import coredis
import coredis.exceptions as cx
import trio
from coredis.connection import TCPLocation
from coredis.retry import NoRetryPolicy

from claimkit.store.coredis_store import CoredisStore
from claimkit.store.interface import Arg, ScriptCall, StoreError, StoreUnavailable
from claimkit.store.script_calls import NO_WAIT, ReplicaWait
from claimkit.store.server_checks import SentinelMismatch
from claimkit.store.tls import tls_file_error

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

    from claimkit.store.scripts import Script
    from claimkit.store.topology import Topology

__all__ = ["SentinelStore", "open_sentinel_store"]

log = logging.getLogger("claimkit")

# The server reached is not the primary (any more): the sentinels must be asked again.
_STALE = (cx.ReadOnlyError, cx.StalePrimaryError, cx.PrimaryNotFoundError)
# A data server's reply to the question for the primary: url or addrs is no sentinel.
_NOT_A_SENTINEL = "unknown command 'SENTINEL'"


def _name(location: TCPLocation | None) -> str:
    return "unknown" if location is None else f"{location.host}:{location.port}"


class SentinelStore(CoredisStore):
    """:class:`claimkit.store.Store` on the sentinel-managed primary of ``master_name``
    (``mode == "sentinel"``).

    Attributes:
        master_name: the name the sentinels know the primary by.
        primary: ``"host:port"`` of the primary last connected to, or ``None`` before
            the first connection.
        topology_changes: how many times the primary's address changed since the store
            opened (0 until a failover).
    """

    def __init__(
        self,
        client: coredis.Redis[bytes],
        url: str,
        *,
        master_name: str,
        wait: ReplicaWait,
        sentinels: Sequence[coredis.Redis[bytes]] = (),
        sentinel_addrs: str = "",
    ) -> None:
        super().__init__(client, url, mode="sentinel", wait=wait)
        self.master_name = master_name
        self._sentinels = sentinels
        self._sentinel_addrs = sentinel_addrs
        self.primary: str | None = None
        self.topology_changes = 0
        self._changed = trio.Event()

    async def topology_changed(self, seen: int) -> int:
        """Wait until :attr:`topology_changes` is above ``seen`` (at once if it is
        already); return it. A caller keeps the value returned as its next ``seen``, so no
        change is missed between two waits.

        Cancellation: nothing to undo."""
        while self.topology_changes <= seen:
            await self._changed.wait()
        return self.topology_changes

    def _noticed(self) -> None:
        """Compare the pool's primary with the one last seen; log a change once."""
        now = self._client.connection_pool.location
        if now is None:
            return
        name = _name(now)
        if self.primary is not None and name != self.primary:
            log.warning(
                "claimkit: Redis primary for %s is now %s (was %s)",
                self.master_name,
                name,
                self.primary,
            )
            self.topology_changes += 1
            self._changed.set()
            self._changed = trio.Event()
        self.primary = name

    def _failed(self, exc: BaseException) -> None:
        if isinstance(exc.__cause__, _STALE) or "READONLY" in str(exc):
            self._client.connection_pool.disconnect()

    async def _follow(self, call: Callable[[], Awaitable[Any]]) -> Any:
        try:
            return await call()
        except (StoreUnavailable, StoreError) as exc:
            self._failed(exc)
            if isinstance(exc, StoreError) and str(exc).startswith(_NOT_A_SENTINEL):
                # A data server asked SENTINEL GET-MASTER-ADDR-BY-NAME: url or addrs.
                raise SentinelMismatch.not_a_sentinel(self.url, str(exc)) from exc
            if isinstance(exc.__cause__, cx.PrimaryNotFoundError):
                raise await self._no_primary() from exc
            raise
        finally:
            self._noticed()

    async def _no_primary(self) -> StoreUnavailable:
        """Why the sentinels named no primary: none of them answered, or they know no
        primary by :attr:`master_name` (coredis says ``No primary found`` for both)."""
        for sentinel in list(self._sentinels):
            try:
                await sentinel.ping()
            except (cx.RedisError, TimeoutError, OSError):
                continue
            return StoreUnavailable(
                f"the sentinels at {self._sentinel_addrs} know no primary named "
                f"{self.master_name!r}"
            )
        return StoreUnavailable(f"no sentinel answered at {self._sentinel_addrs}")

    async def command(self, *args: Arg) -> Any:
        return await self._follow(lambda: CoredisStore.command(self, *args))

    async def pipeline(self, commands: Sequence[Sequence[Arg]], *, transaction: bool) -> list[Any]:
        replies: list[Any] = await self._follow(
            lambda: CoredisStore.pipeline(self, commands, transaction=transaction)
        )
        return replies

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[Arg]) -> Any:
        return await self._follow(lambda: CoredisStore.run(self, script, keys, args))

    async def run_many(self, script: Script, calls: Sequence[ScriptCall]) -> list[Any]:
        replies: list[Any] = await self._follow(lambda: CoredisStore.run_many(self, script, calls))
        return replies


@asynccontextmanager
async def open_sentinel_store(
    url: str,
    *,
    timeout: float,
    topology: Topology,
    shown: str | None = None,
    wait: ReplicaWait = NO_WAIT,
) -> AsyncIterator[SentinelStore]:
    """A :class:`SentinelStore` asking the sentinels at ``url``'s host:port and
    ``topology.addrs`` for ``topology.master_name``'s primary. The data connection takes
    its credentials, TLS settings and database from ``url``; the sentinels are asked
    without them (with ``url``'s timeouts). A primary that cannot be found at start is not
    an error here: the first call reports it (:class:`StoreUnavailable`)."""
    master_name = topology.master_name or ""
    try:
        # Only parsed, never entered: the URL's credentials, TLS context and db as
        # connection arguments, exactly as the standalone store reads them.
        parsed: coredis.Redis[bytes] = coredis.Redis.from_url(
            url,
            decode_responses=False,
            decode_components=True,
            connect_timeout=timeout,
            stream_timeout=timeout,
        )
    except OSError as exc:
        error = tls_file_error(url)
        if error is None:
            raise
        raise error from exc
    kwargs: dict[str, Any] = {
        k: v
        for k, v in parsed.connection_pool.connection_kwargs.items()
        if k not in ("processing_budget", "decode_responses") and v is not None
    }
    seeds = topology.seeds(url)
    sentinel: coredis.Sentinel[bytes] = coredis.Sentinel(
        [TCPLocation(host, port) for host, port in seeds],
        sentinel_kwargs={"connect_timeout": timeout, "stream_timeout": timeout},
        decode_responses=False,
        retry_policy=NoRetryPolicy(),
        **kwargs,
    )
    client = sentinel.primary_for(master_name)
    client.verify_version = False
    store = SentinelStore(
        client,
        shown or url,
        master_name=master_name,
        wait=wait,
        sentinels=sentinel.sentinels,
        sentinel_addrs=", ".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in seeds),
    )
    async with sentinel, client:
        yield store
