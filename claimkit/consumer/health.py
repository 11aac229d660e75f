"""The metrics and health HTTP servers of ``claimkit serve`` (docs/operations.md, "Ports and
probes").

``/metrics`` is prometheus-client's ASGI app; ``/healthz`` is 200 while the process runs;
``/readyz`` is 200 while the consumer reaches Redis and is not shutting down, else 503. A port
of 0 turns that server off.

Both are served by hypercorn on trio in a thread of their own (its own event loop), so a busy
consumer loop never delays a scrape or a probe, and connections are served concurrently: a
client that connects and sends nothing, or sends half a request, holds only its own
connection. Each connection is closed once it has gone ``idle_timeout`` seconds without a
complete request (from its opening, or from its last answer), and when a read or a write
waits longer than that. A request head over 16 KiB is answered 431 and closed, bytes that
are not HTTP 400 and closed. Only ``GET`` and ``HEAD`` on a served path are answered;
another path is 404, another method on a served path 405 (``Allow: GET, HEAD``).

At most ``max_connections`` are open at once over both servers. When all are taken, a new
connection is admitted and an open one is closed (its handler cancelled, its socket closed
forcefully), never the new one, and nothing waits in the listen backlog: the oldest that
has sent nothing yet, else the oldest of all. The rule serves the probes: the kubelet's
probe and Prometheus's scrape send their request the moment they connect, while a client
hoarding connections holds silent or old ones, so a flood of hoarded connections, however
fast it reconnects, costs the flooder its own connections, not the liveness probe.

hypercorn has no bound on connections, so the listener wrapper here adds one and runs
hypercorn's own per-connection server (``hypercorn.trio.tcp_server.TCPServer``).
"""

from __future__ import annotations

import ipaddress
import logging
import math
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from prometheus_client import CollectorRegistry, make_asgi_app

__all__ = [
    "DEFAULT_HTTP_HOST",
    "DEFAULT_IDLE_TIMEOUT_SECONDS",
    "DEFAULT_MAX_CONNECTIONS",
    "HttpBindError",
    "serve_http",
]

DEFAULT_HTTP_HOST = "0.0.0.0"
DEFAULT_IDLE_TIMEOUT_SECONDS = 5.0
DEFAULT_MAX_CONNECTIONS = 512
_MAX_HEAD_BYTES = 16 * 1024
_FULL_WARNING_EVERY_SECONDS = 60.0

log = logging.getLogger("claimkit.http")

_Scope = dict[str, Any]
_Receive = Callable[[], Awaitable[dict[str, Any]]]
_Send = Callable[[dict[str, Any]], Awaitable[None]]
_App = Callable[[_Scope, _Receive, _Send], Awaitable[None]]


class HttpBindError(Exception):
    """A server's address cannot be bound.

    Attributes:
        paths: what that server answers (``"/metrics"``, ``"/healthz and /readyz"`` or all).
        host: the address given to bind.
        port: the port given.
        reason: the system's words, lower case (``"address already in use"``).
    """

    def __init__(self, paths: str, host: str, port: int, reason: str) -> None:
        super().__init__(f"cannot listen on {_hostport(host, port)} for {paths}: {reason}")
        self.paths, self.host, self.port, self.reason = paths, host, port, reason


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _close_other_scopes(scope: _Scope, send: _Send) -> None:
    """Answer what is not HTTP (a WebSocket upgrade: refused, hypercorn sends 403)."""
    if scope["type"] == "websocket":
        await send({"type": "websocket.close"})


def _head_too_large(scope: _Scope) -> bool:
    """Whether the request head is over :data:`_MAX_HEAD_BYTES`. h11 refuses such a head only
    when it arrives in pieces; one that arrives in one read is refused here, the same way."""
    size = len(scope.get("raw_path", b"")) + len(scope.get("query_string", b""))
    return size + sum(len(k) + len(v) + 4 for k, v in scope["headers"]) > _MAX_HEAD_BYTES


def _bounded_head(app: _App) -> _App:
    async def bounded(scope: _Scope, receive: _Receive, send: _Send) -> None:
        if scope["type"] == "http" and _head_too_large(scope):
            await _plain(send, 431, b"request head too large\n")
        else:
            await app(scope, receive, send)

    return bounded


async def _plain(
    send: _Send, status: int, body: bytes, extra: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"text/plain; charset=utf-8"),
                (b"content-length", str(len(body)).encode()),
                *extra,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _routes(paths: dict[str, _App]) -> _App:
    """An app answering ``GET`` and ``HEAD`` on exactly the given paths; another path is
    404, another method on one of them 405 with ``Allow: GET, HEAD``."""

    async def app(scope: _Scope, receive: _Receive, send: _Send) -> None:
        if scope["type"] != "http":  # prometheus-client's app asserts on anything else
            await _close_other_scopes(scope, send)
            return
        route = paths.get(scope["path"])
        if route is None:
            await _plain(send, 404, b"not found\n")
        elif scope["method"] not in ("GET", "HEAD"):
            await _plain(send, 405, b"method not allowed\n", [(b"allow", b"GET, HEAD")])
        else:
            await route(scope, receive, send)

    return app


def _health_paths(ready: Callable[[], tuple[bool, str]]) -> dict[str, _App]:
    async def healthz(scope: _Scope, receive: _Receive, send: _Send) -> None:
        await _plain(send, 200, b"ok\n")

    async def readyz(scope: _Scope, receive: _Receive, send: _Send) -> None:
        ok, why = ready()
        await _plain(send, 200 if ok else 503, (why + "\n").encode())

    return {"/healthz": healthz, "/readyz": readyz}


def _metrics_paths(registry: CollectorRegistry) -> dict[str, _App]:
    prometheus_app: _App = make_asgi_app(registry)
    return {"/metrics": prometheus_app}


class _Slots:
    """The connections open over all servers, at most ``limit``, oldest first.

    A connection is admitted by :meth:`admit` when accepted; if all slots are taken, one
    open connection is closed to make room: the oldest that has sent nothing yet (idle
    sockets of a flood, a scanner), else the oldest of all (the rule: see the module
    docstring). A probe's connection sends its request at once, so a flood of silent
    connections, however fast it reconnects, never pushes a probe out. Its handler, once
    started, attaches its cancel scope (:meth:`attach`), reports the first bytes it reads
    (:meth:`heard`) and frees the slot on its way out (:meth:`release`). An evicted
    connection's slot is freed by the eviction itself: a handler that has not started yet
    finds its connection gone and returns, and a handler's release frees only its own."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        # Insertion order is admission order; the value is the handler's scope once started.
        self._open: dict[trio.SocketStream, trio.CancelScope | None] = {}
        self._silent: dict[trio.SocketStream, None] = {}  # admitted, no byte read yet
        self._warned_at = -math.inf

    async def admit(self, stream: trio.SocketStream, where: str) -> None:
        if len(self._open) < self.limit:
            self._open[stream] = self._silent[stream] = None
            return
        victim = self._victim()
        scope = self._open.pop(victim)
        self._silent.pop(victim, None)
        self._open[stream] = self._silent[stream] = None  # before the close's await
        now = time.monotonic()
        if now - self._warned_at >= _FULL_WARNING_EVERY_SECONDS:
            self._warned_at = now
            log.warning(
                "claimkit: %s has %d connections open, its bound "
                "(--http-max-connections); closed the oldest to admit a new one",
                where,
                self.limit,
            )
        if scope is not None:
            scope.cancel()
        await trio.aclose_forcefully(victim)

    def _victim(self) -> trio.SocketStream:
        """The oldest silent connection, else the oldest. A connection whose handler has
        not read yet may have sent its request already (a probe, while the servers are busy
        admitting a flood): the kernel's buffer is peeked, so it is not taken for silent."""
        for stream in list(self._silent):
            if not _has_bytes_waiting(stream):
                return stream
            self._silent.pop(stream)
        return next(iter(self._open))

    def attach(self, stream: trio.SocketStream, scope: trio.CancelScope) -> bool:
        """Give ``stream``'s handler scope; ``False`` when it was evicted already."""
        if stream not in self._open:
            return False
        self._open[stream] = scope
        return True

    def heard(self, stream: trio.SocketStream) -> None:
        """``stream`` sent its first bytes: it is closed only when no silent one is left."""
        self._silent.pop(stream, None)

    def release(self, stream: trio.SocketStream) -> None:
        self._open.pop(stream, None)
        self._silent.pop(stream, None)


def _has_bytes_waiting(stream: trio.SocketStream) -> bool:
    """Whether the peer of ``stream`` has sent bytes not read yet (a non-blocking peek of
    the kernel's receive buffer, on a duplicate of the descriptor). A closed or broken
    connection has none: it is as good a connection to close as a silent one."""
    sock = stream.socket
    try:
        with socket.fromfd(sock.fileno(), sock.family, sock.type) as dup:
            return bool(dup.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except OSError:  # BlockingIOError (nothing sent) or a broken connection
        return False


class _WriteBoundedStream(trio.abc.HalfCloseableStream):
    """A :class:`trio.SocketStream` whose writes give up after ``timeout`` seconds.

    hypercorn writes inside a shielded cancel scope and never times a write out, so a client
    that sends requests but never reads the answers would hold its connection (and its
    slot) forever, and stall the servers' stop. A write that takes longer than ``timeout``
    closes the connection and calls ``stalled`` (which cancels the connection's task: its
    reader may be parked until the answer is written, where no close reaches it)."""

    def __init__(
        self,
        inner: trio.SocketStream,
        timeout: float,
        stalled: Callable[[], None],
        heard: Callable[[], None],
    ):
        self._inner, self._timeout, self._stalled = inner, timeout, stalled
        self._heard: Callable[[], None] | None = heard
        self.socket = inner.socket  # hypercorn reads the peer's address from it

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        with trio.move_on_after(self._timeout) as scope:  # a deadline of its own beats a shield
            await self._inner.send_all(data)
        if scope.cancelled_caught:
            await trio.aclose_forcefully(self._inner)
            self._stalled()
            raise trio.BrokenResourceError(f"the client read nothing for {self._timeout} s")

    async def wait_send_all_might_not_block(self) -> None:
        await self._inner.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self._inner.send_eof()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        data = await self._inner.receive_some(max_bytes)
        if data and self._heard is not None:
            self._heard()  # once: the connection is no longer a silent one
            self._heard = None
        return data

    async def aclose(self) -> None:
        await self._inner.aclose()


class _BoundedListener(trio.abc.Listener[trio.SocketStream]):
    """A :class:`trio.SocketListener` that admits every connection at once (never leaving it
    queued in the kernel's backlog), closing the oldest open one when all slots are taken."""

    def __init__(self, inner: trio.SocketListener, slots: _Slots, where: str) -> None:
        self._inner, self._slots, self._where = inner, slots, where

    async def accept(self) -> trio.SocketStream:
        stream = await self._inner.accept()
        await self._slots.admit(stream, self._where)
        return stream

    async def aclose(self) -> None:
        await self._inner.aclose()


@dataclass(frozen=True, slots=True)
class _Bound:
    sock: socket.socket
    app: _App
    where: str


class _TCPServer(TCPServer):
    """hypercorn's connection server, freeing its slot as soon as the client has gone:
    stock, it keeps the closed connection (and its descriptor) until the idle timer ends."""

    async def _read_data(self) -> None:
        await super()._read_data()
        await self.idle_task.stop()


def _hypercorn_config(idle_timeout: float) -> HypercornConfig:
    hc = HypercornConfig()
    hc.keep_alive_timeout = idle_timeout  # idle from connect or from the last answer
    hc.read_timeout = max(1, math.ceil(idle_timeout))  # one receive; hypercorn takes whole s
    hc.h11_max_incomplete_size = _MAX_HEAD_BYTES
    hc.h2_max_header_list_size = _MAX_HEAD_BYTES
    hc.include_server_header = False
    hc.accesslog = None
    # A logger object (not "-") keeps hypercorn from installing its own stderr handler.
    hc.errorlog = log
    return hc


class _Runner:
    """hypercorn serving the bound sockets in a thread running its own ``trio.run``."""

    def __init__(self, bound: Sequence[_Bound], idle_timeout: float, max_connections: int):
        self._bound = bound
        self._config = _hypercorn_config(idle_timeout)
        self._slots = _Slots(max_connections)
        self._started = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._cancel = trio.CancelScope()
        self._thread = threading.Thread(target=self._run, name="claimkit-http", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._started.wait()

    def stop(self) -> None:
        if self._token is not None:
            try:  # not from_thread.run_sync: the caller may be a trio loop (serve's)
                self._token.run_sync_soon(self._cancel.cancel)
            except trio.RunFinishedError:
                pass
        self._thread.join(timeout=5)

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException:  # the consumer goes on; the probes will say the rest
            log.exception("claimkit: the metrics/health servers stopped")
        finally:
            self._started.set()

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        context = WorkerContext(None)
        with self._cancel:
            async with trio.open_nursery() as nursery:
                for b in self._bound:
                    listener = _BoundedListener(
                        trio.SocketListener(trio.socket.from_stdlib_socket(b.sock)),
                        self._slots,
                        b.where,
                    )
                    app = ASGIWrapper(_bounded_head(b.app))  # type: ignore[arg-type]
                    handler = partial(self._connection, app, context)
                    nursery.start_soon(partial(trio.serve_listeners, handler, [listener]))
                self._started.set()

    async def _connection(
        self, app: ASGIWrapper, context: WorkerContext, stream: trio.SocketStream
    ) -> None:
        try:
            with trio.CancelScope() as scope:
                if not self._slots.attach(stream, scope):
                    return  # evicted before it started; closed by the eviction
                timeout = self._config.keep_alive_timeout
                heard = partial(self._slots.heard, stream)
                bounded = _WriteBoundedStream(stream, timeout, scope.cancel, heard)
                await _TCPServer(app, self._config, context, {}, bounded)  # type: ignore[arg-type]
        finally:
            self._slots.release(stream)


def _listen(host: str, port: int, backlog: int, paths: str) -> socket.socket:
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # "::" takes IPv4 too
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        reason = (exc.strerror or str(exc)).lower()
        raise HttpBindError(paths, host, port, reason) from exc
    except BaseException:
        sock.close()
        raise
    return sock


@contextmanager
def serve_http(
    *,
    metrics_port: int,
    health_port: int,
    registry: CollectorRegistry,
    ready: Callable[[], tuple[bool, str]],
    host: str = DEFAULT_HTTP_HOST,
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT_SECONDS,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
) -> Iterator[dict[str, int]]:
    """Serve ``/metrics`` on ``metrics_port`` and ``/healthz`` + ``/readyz`` on
    ``health_port`` while the ``with`` block runs. When both ports are equal one server
    answers all three paths; a port of 0 serves nothing there.

    Args:
        ready: called per ``/readyz`` probe, from the servers' thread; returns
            ``(ready, reason)``.
        host: the IP address to bind (``"0.0.0.0"`` every IPv4 interface, ``"::"`` every
            interface).
        idle_timeout: seconds a connection may stay open without a complete request.
        max_connections: connections open at once over both servers; when all are open, a
            new one closes the oldest silent one (no byte sent yet), else the oldest.

    Yields:
        ``{"metrics": port, "health": port}`` of the servers actually started (bound ports).

    Raises:
        HttpBindError: a port is taken or the address is not this host's (one line).
    """
    health_paths, metrics_paths = _health_paths(ready), _metrics_paths(registry)
    health, metrics = _routes(health_paths), _routes(metrics_paths)
    both = _routes({**metrics_paths, **health_paths})

    wanted: list[tuple[str, int, _App, str]] = []
    if metrics_port and metrics_port == health_port:
        wanted.append(("metrics+health", metrics_port, both, "/metrics, /healthz and /readyz"))
    else:
        if metrics_port:
            wanted.append(("metrics", metrics_port, metrics, "/metrics"))
        if health_port:
            wanted.append(("health", health_port, health, "/healthz and /readyz"))
    backlog = min(max_connections, socket.SOMAXCONN)
    bound: dict[str, int] = {}
    servers: list[_Bound] = []
    with ExitStack() as stack:
        for role, port, app, paths in wanted:
            sock = _listen(host, port, backlog, paths)
            stack.callback(sock.close)  # trio closes it too; closing twice is harmless
            real = int(sock.getsockname()[1])
            for name in role.split("+"):
                bound[name] = real
            servers.append(_Bound(sock, app, f"the {paths} server on {_hostport(host, real)}"))
        if servers:
            runner = _Runner(servers, idle_timeout, max_connections)
            runner.start()
            stack.callback(runner.stop)
        yield bound
