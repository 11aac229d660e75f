"""The Redis Cluster store: coredis's ``RedisCluster`` behind the same :class:`Store`
protocol (docs/topology.md).

Every command goes to the primary of its keys' slot; coredis follows ``MOVED`` and ``ASK``
and refreshes its map of the cluster. A command without keys (``TIME``, ``WAIT``) goes to
the node of the keyed command before it in a pipeline (a lone one to slot 0's primary). A
pipeline is split per node by coredis; a transaction is sent only when all its keys share
one slot; a script's keys must share one slot too (else ``CROSSSLOT``, nothing sent).
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any

import coredis
import coredis.exceptions as cx
import trio
from coredis.commands.request import CommandRequest
from coredis.connection import TCPLocation
from coredis.pool import ClusterConnectionPool
from coredis.retry import NoRetryPolicy
from coredis.typing import Key

from claimkit.store.coredis_store import _NOOP, CoredisStore, _replies, _translate, _translated
from claimkit.store.interface import Arg, ScriptCall, StoreError, StoreUnavailable, reply_text
from claimkit.store.script_calls import NO_WAIT, ReplicaWait, run_pipelined
from claimkit.store.server_checks import NotACluster, SentinelMismatch
from claimkit.store.slots import key_positions, key_slot
from claimkit.store.tls import tls_file_error

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Collection, Iterator, Sequence

    from claimkit.store.scripts import Script

__all__ = ["ClusterStore", "NotACluster", "open_cluster_store"]

log = logging.getLogger("claimkit")

_RETRY_FIRST = 0.25  # seconds before the layout is read again after a failure; doubles
_RETRY_MAX = 5.0
_REFRESH_PAUSE = 0.25  # seconds at least between two reads of the map after failures
_CLUSTER_DISABLED = "cluster support disabled"
_NO_CLUSTER_COMMAND = "unknown command 'CLUSTER'"


def _wrap(args: Sequence[Arg]) -> tuple[Any, ...]:
    """``args[1:]`` with the keys wrapped in coredis's ``Key``, so coredis routes by them."""
    positions = set(key_positions(args))
    return tuple(
        Key(a if isinstance(a, str | bytes) else str(a)) if i in positions else a
        for i, a in enumerate(args)
        if i
    )


def _first_slot(args: Sequence[Arg]) -> int | None:
    positions = key_positions(args)
    return key_slot(reply_text(args[positions[0]])) if positions else None


class ClusterStore(CoredisStore):
    """:class:`claimkit.store.Store` on a ``coredis.RedisCluster`` (``mode == "cluster"``).

    The cluster's map is read in the background (:func:`open_cluster_store`): until it has
    been read, calls raise :class:`StoreUnavailable` saying why; a server that is no
    cluster node makes every call raise :class:`NotACluster`.
    """

    _cluster = True

    def __init__(self, client: coredis.RedisCluster[bytes], url: str, *, wait: ReplicaWait) -> None:
        super().__init__(client, url, mode="cluster", wait=wait)  # type: ignore[arg-type]
        self._ready = False
        self._down: BaseException = StoreUnavailable(f"Redis Cluster at {self.url}: not read yet")
        self._refusal: NotACluster | SentinelMismatch | None = None
        self._refresh_wanted = trio.Event()

    # -- the cluster's map, read in the background ------------------------------------------

    async def keep_open(self, *, task_status: trio.TaskStatus[None]) -> None:
        """Enter the cluster client (which reads the cluster's map), retrying with backoff
        while no seed answers, and hold it open until cancelled. Reports started after the
        first attempt, whatever its outcome."""
        delay = _RETRY_FIRST
        started = False
        while True:
            try:
                async with self._client:
                    self._ready = True
                    if not started:
                        started = True
                        task_status.started()
                    await self._refresh_after_failures()
            except (cx.RedisError, TimeoutError, OSError) as exc:
                self._ready = False
                self._down = self._init_error(exc)
                if isinstance(self._down, NotACluster | SentinelMismatch):
                    self._refusal = self._down
                if not started:
                    started = True
                    task_status.started()
                if self._refusal is not None:
                    await trio.sleep_forever()
            await trio.sleep(delay)
            delay = min(_RETRY_MAX, delay * 2)

    async def _refresh_after_failures(self) -> None:
        """Read the cluster's map again whenever a call found a node unreachable or the
        cluster in motion (a primary died and a replica took its slots over, a resharding):
        coredis alone re-reads it only after many errors, and until then every call to the
        dead primary's slots fails (docs/topology.md#failover). At most one read per
        ``_REFRESH_PAUSE`` seconds; a read that fails is tried again after the pause."""
        layout = self._client.connection_pool.cluster_layout
        while True:
            await self._refresh_wanted.wait()
            self._refresh_wanted = trio.Event()
            try:
                await layout.initialize()
            except (cx.RedisError, TimeoutError, OSError):
                self._refresh_wanted.set()
            await trio.sleep(_REFRESH_PAUSE)

    def _translated(self) -> AbstractContextManager[None]:
        return self._refreshing_on_failure()

    @contextmanager
    def _refreshing_on_failure(self) -> Iterator[None]:
        try:
            with _translated(self.url, cluster=True):
                yield
        except StoreUnavailable:
            self._refresh_wanted.set()
            raise

    def _init_error(self, exc: BaseException) -> BaseException:
        # Only what a seed answered (coredis puts the last seed's error in __cause__): an
        # exception merely being handled nearby (__context__) is no answer of this cluster.
        for cause in (exc, exc.__cause__):
            if cause is not None and _CLUSTER_DISABLED in str(cause):
                return NotACluster.for_url(self.url, f"it answered {cause}")
            if cause is not None and str(cause).startswith(_NO_CLUSTER_COMMAND):
                # A data server knows CLUSTER even without cluster support; a sentinel not.
                return SentinelMismatch.is_a_sentinel(self.url)

        file_error = tls_file_error(self.url)
        if file_error is not None:
            return file_error
        translated = _translate(exc.__cause__ or exc, self.url, cluster=True)
        if isinstance(translated, StoreError) and not isinstance(translated, StoreUnavailable):
            return translated  # a wrong password, a TLS problem: retrying will not help
        if isinstance(exc, cx.RedisClusterError) and exc.__cause__ is not None:
            # "Redis Cluster cannot be connected. Please provide at least one reachable
            # node.": say so, with the last seed's own error.
            why = f"no seed node answered ({exc.__cause__})"
        else:
            why = str(exc)
        return StoreUnavailable(f"Redis Cluster at {self.url} cannot be reached: {why}")

    def _check_ready(self) -> None:
        if self._refusal is not None:
            raise self._refusal
        if not self._ready:
            raise self._down

    # -- routing ----------------------------------------------------------------------------

    def _request(self, args: Sequence[Arg]) -> CommandRequest[Any]:
        """A command coredis routes by its keys; one without keys goes to slot 0's primary."""
        name = str(args[0]).upper().encode()
        request = CommandRequest(name, *_wrap(args), callback=_NOOP, execution_parameters={})
        if not key_positions(args):
            request.route(0)
        return request

    async def _acl_log(self) -> Any:
        return await self._client.execute_command(self._request(("ACL", "LOG", 32)))

    async def _execute(self, args: Sequence[Arg]) -> Any:
        """One command, routed by coredis (a redirection followed, the layout refreshed)."""
        return await self._client.execute_command(self._request(args))

    async def command(self, *args: Arg) -> Any:
        self._check_ready()
        return await super().command(*args)

    async def pipeline(self, commands: Sequence[Sequence[Arg]], *, transaction: bool) -> list[Any]:
        self._check_ready()
        return await super().pipeline(commands, transaction=transaction)

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[Arg]) -> Any:
        self._check_ready()
        return await super().run(script, keys, args)

    async def run_many(self, script: Script, calls: Sequence[ScriptCall]) -> list[Any]:
        self._check_ready()
        return await super().run_many(script, calls)

    async def _transaction_connection(self, commands: Sequence[Sequence[Arg]]) -> Any:
        """A connection to the primary of the one slot every key of ``commands`` is in.

        Raises:
            StoreError: the keys span slots (one line; nothing was sent).
        """
        slots: dict[int, str] = {}
        for command in commands:
            for i in key_positions(command):
                key = reply_text(command[i])
                slots.setdefault(key_slot(key), key)
        if len(slots) > 1:
            shown = ", ".join(f"{key!r} (slot {slot})" for slot, key in sorted(slots.items()))
            raise StoreError(
                f"CROSSSLOT a transaction's keys must share one hash slot in Redis Cluster, "
                f"these do not: {shown}; nothing was written "
                "(docs/topology.md#cluster-key-layout)"
            )
        slot = next(iter(slots), 0)
        pool = self._client.connection_pool
        return await pool.get_connection(pool.cluster_layout.node_for_slot(slot))

    async def _refused(
        self, message: str, commands: Sequence[Sequence[Arg]]
    ) -> StoreError | StoreUnavailable:
        if message.startswith(("MOVED ", "ASK ", "TRYAGAIN", "CLUSTERDOWN")):
            # The slot moved between the map and the transaction: retrying helps.
            return StoreUnavailable(f"{message} (the transaction was refused; nothing was written)")
        return await super()._refused(message, commands)

    async def _run_pipelined(self, script: Script, calls: Sequence[ScriptCall]) -> list[Any]:
        if not self._wait.applies(script):
            return await run_pipelined(script, calls, self._pipelined, cx.NoScriptError)
        # A call coredis resends elsewhere after MOVED/ASK is not followed by a WAIT there:
        # such a call (a slot that moved since the map was read) is not confirmed.
        return await run_pipelined(
            script,
            calls,
            self._pipelined,
            cx.NoScriptError,
            wait=self._wait,
            wait_after=self._last_call_per_node,
        )

    def _last_call_per_node(self, calls: Sequence[ScriptCall]) -> Collection[int]:
        """The index of the last call for each node: a ``WAIT`` there covers that node's
        calls (they share the node's one connection of the pipeline)."""
        layout = self._client.connection_pool.cluster_layout
        last: dict[str, int] = {}
        for i, (keys, _) in enumerate(calls):
            node = layout.node_for_slot(key_slot(keys[0])).name if keys else ""
            last[node] = i
        return set(last.values())

    async def _pipelined(self, commands: Sequence[Sequence[Arg]]) -> list[Any]:
        """As the standalone store's, on coredis's cluster pipeline (one batch per node); a
        command without keys goes to the node of the keyed command before it."""
        slot = next((s for s in map(_first_slot, commands) if s is not None), 0)
        async with self._client.pipeline(transaction=False, raise_on_error=False) as pipe:
            pending = []
            for command in commands:
                request = pipe.create_request(
                    str(command[0]).upper().encode(), *_wrap(command), callback=_NOOP
                )
                found = _first_slot(command)
                if found is None:
                    request.route(slot)
                else:
                    slot = found
                pending.append(request)
        return await _replies(pending)

    # -- every primary ------------------------------------------------------------------------

    async def each_primary(self, *args: Arg) -> dict[str, Any]:
        """Run one command on every primary of the cluster (``INFO``, ``CONFIG GET``).

        Returns:
            ``"host:port"`` -> the raw reply, or the :class:`StoreError` /
            :class:`StoreUnavailable` that node's call raised.
        """
        self._check_ready()
        pool = self._client.connection_pool
        out: dict[str, Any] = {}
        for node in pool.cluster_layout.primaries:
            try:
                with self._translated():
                    connection = await pool.get_connection(node)
                    try:
                        request = connection.create_request(
                            str(args[0]).upper().encode(), *args[1:], decode=False
                        )
                        out[node.name] = await request
                    finally:
                        pool.release(connection)
            except (StoreError, StoreUnavailable) as exc:
                out[node.name] = exc
        return out


@asynccontextmanager
async def open_cluster_store(
    url: str,
    *,
    timeout: float,
    seeds: Sequence[tuple[str, int]],
    shown: str | None = None,
    wait: ReplicaWait = NO_WAIT,
) -> AsyncIterator[ClusterStore]:
    """A :class:`ClusterStore` on the cluster the ``seeds`` belong to, credentials and TLS
    from ``url``. A cluster that cannot be reached at start is not an error here: calls
    raise :class:`StoreUnavailable` until its map has been read."""
    try:
        pool = ClusterConnectionPool.from_url(
            url,
            decode_components=True,
            startup_nodes=[TCPLocation(host, port) for host, port in seeds],
            connect_timeout=timeout,
            stream_timeout=timeout,
            # The check asks every node CONFIG GET, which managed services and narrow ACLs
            # refuse (a warning each time); a cluster with slots missing answers CLUSTERDOWN.
            skip_full_coverage_check=True,
        )
    except OSError as exc:
        error = tls_file_error(url)
        if error is None:
            raise
        raise error from exc
    client: coredis.RedisCluster[bytes] = coredis.RedisCluster(
        connection_pool=pool,
        decode_responses=False,
        retry_policy=NoRetryPolicy(),
        verify_version=False,
        # A multi-key command across slots is refused (CROSSSLOT), never split.
        non_atomic_cross_slot=False,
    )
    store = ClusterStore(client, shown or url, wait=wait)
    async with trio.open_nursery() as nursery:
        await nursery.start(store.keep_open)
        try:
            yield store
        finally:
            nursery.cancel_scope.cancel()
