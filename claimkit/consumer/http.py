"""A small HTTP/1.1 client for the gateway over trio streams, with a keep-alive pool.

Why not httpx: at 50 requests in flight httpx (through httpcore) spends ~1.2 ms of CPU per
request, most of it in pool bookkeeping that grows with open x idle connections, which caps
one consumer process near 800 requests/s (see ``docs/performance.md``). This client does
only what dispatch needs (docs/dispatch.md): one ``POST`` with a body already in bytes, the whole
response read into memory, redirects never followed. Its pool is a LIFO stack of idle
connections per origin and a counter; taking or returning a connection is O(1).

The wire format is :mod:`claimkit.consumer.http_parse`: the ``httptools`` (llhttp, C)
response parser in a thin wrapper that refuses what h11 refused, and a hand-written request
serialiser. It replaced h11 (issue 13), whose event machinery was 9-17 % of the consumer's
CPU: measured with ``bench/dispatch_paths.py``, the client went from 0.129 to 0.056 ms of
CPU per request. A strict hand-written parser with h11's exact grammar
(``bench/_http_handwritten.py``) was measured too, at 0.060 ms: not faster, so the library
was kept (``docs/performance.md``, "The dispatch path").

Behaviour:

- **Pool.** At most ``max_connections`` connections are open at once across all origins; a
  request waits for one to free up (``PoolTimeout`` if its deadline passes first). Idle
  connections are reused most recent first, and kept for as long as the server says it
  keeps them minus a margin: a response's ``Keep-Alive: timeout=N`` header (Node and
  Apache send one; see :func:`_keep_for`) keeps the connection up to ``N`` − 1 s (at most
  :data:`KEEPALIVE_MAX_SECONDS`); without one, ``keepalive_expiry`` seconds (default
  :data:`KEEPALIVE_EXPIRY_SECONDS`). So a connection is dropped before the server drops it,
  and a gateway that keeps connections longer than the default is not reconnected to
  after every pause in the traffic (a burst of completions waiting to be refilled).
- **Server closed an idle connection.** Before reuse, an idle connection that has become
  readable (the server sent EOF or stray bytes) is thrown away unused, and the request
  goes on the next idle connection or a fresh one: nothing of it was written yet.
- **Bytes after the response.** A connection on which anything arrived after the end of the
  response (a second response, stray bytes) is closed, never reused: those bytes would be
  read as the next request's answer. (Empty lines are the exception: llhttp drops them, as
  between pipelined messages.) So is one whose request or response said
  ``Connection: close``, an ``HTTP/1.0`` response, or a body that ran to EOF.
- **Request headers.** Header names must be tokens and values free of CR, LF, NUL and
  surrounding whitespace, else :class:`InvalidURL` (``invalid request: ...``) before
  anything connects; so too a ``Content-Length`` that is not the body's length. A caller's
  ``Transfer-Encoding: chunked`` frames the body (no ``Content-Length`` is added then).
  Informational (1xx) responses are skipped.
- **Connecting.** A new connection is opened whole before anything is written: the name
  resolved, TCP connected, and for ``https`` the TLS handshake done (trio would otherwise
  defer it to the first write). So :class:`ConnectError` and :class:`ConnectTimeout` mean
  that no byte of the request reached the gateway; the consumer hands such a request back
  instead of ending it (docs/dispatch.md, "The gateway is unreachable").
- **Never sent twice.** Once any byte of a request is written, a failure is final
  (:class:`NoResponse`), even on a reused connection that died before any response byte:
  the server may have read the whole request and be running it (a gateway that drops the
  connection without answering). Telling that apart from a keep-alive race, where the
  server closed the connection just as the request went out, is impossible; the short
  idle expiry keeps that race rare instead.
- **Timeouts.** One absolute deadline per request (``timeout`` seconds from the call)
  bounds every phase; the error says which phase ran out (connect, pool, write, response).
- **Errors.** :class:`HttpError` subclasses only. Failures before the response head are
  "no response" errors; a response whose body fails (EOF mid-body, bad framing, deadline)
  raises :class:`BodyError` carrying the status and headers that did arrive.

Cancellation: any call may be cancelled; the connection it was using is closed (never put
back half-used), its pool slot is freed, and nothing else changes.
"""

from __future__ import annotations

import enum
import functools
import math
import socket
import ssl
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import quote, urlsplit

import trio

from claimkit.consumer.http_parse import ProtocolError, ResponseParser, serialise_post

if TYPE_CHECKING:
    from collections.abc import Sequence
    from types import TracebackType

__all__ = [
    "KEEPALIVE_EXPIRY_SECONDS",
    "KEEPALIVE_MAX_SECONDS",
    "BodyError",
    "ConnectError",
    "ConnectTimeout",
    "HttpClient",
    "HttpError",
    "InvalidURL",
    "NoResponse",
    "PoolTimeout",
    "ReadTimeout",
    "RemoteProtocolError",
    "Response",
    "WriteTimeout",
    "probe",
]

_RECEIVE_BYTES = 65536

KEEPALIVE_EXPIRY_SECONDS = 1.5
"""How long an idle connection is kept for reuse, in seconds: shorter than the keep-alive
timeout of the servers gateways run on, so claimkit drops an idle connection before the
server does and a request rarely goes out on one the server is closing (which, since a
written request is never re-sent, would end it as :class:`NoResponse`). Gunicorn closes
idle connections after 2 s by default, uvicorn run by gunicorn's ``UvicornWorker`` too
(LiteLLM's proxy can run so); uvicorn and hypercorn alone after 5 s, Node after 5 s,
nginx after 75 s. Reopening a connection costs one handshake; an inference costs far more.
Used when the server gives no ``Keep-Alive: timeout=N`` hint (see :data:`KEEPALIVE_MAX_SECONDS`)."""

KEEPALIVE_MAX_SECONDS = 60.0
"""The longest an idle connection is kept, in seconds, whatever the server's
``Keep-Alive: timeout=N`` hint says: the hint is the server's own idle timeout, so up to
``N`` − 1 s (``N`` / 2 when ``N`` < 2) is safe, but a middlebox may drop a quiet
connection sooner."""

_KEEPALIVE_MARGIN_SECONDS = 1.0


class HttpError(Exception):
    """Any failure of a request. ``str(exc)`` is a short human reason."""


class NoResponse(HttpError):
    """The request was written (all or in part) and no response head came back: the
    gateway may have received it and be running it, so it is never sent again."""


class InvalidURL(HttpError):
    """The URL cannot be requested (unsupported scheme, no host)."""


class ConnectError(HttpError):
    """The connection could not be opened (DNS failure, connection refused or unreachable,
    TLS handshake failure): nothing of the request was sent."""


class ConnectTimeout(HttpError):
    """The deadline passed while connecting (TCP or the TLS handshake): nothing of the
    request was sent."""


class PoolTimeout(HttpError):
    """The deadline passed while waiting for a free connection."""


class WriteTimeout(NoResponse):
    """The deadline passed while sending the request."""


class ReadTimeout(NoResponse):
    """The deadline passed before the response head arrived."""


class RemoteProtocolError(NoResponse):
    """The connection broke or the server spoke malformed HTTP before a response head."""


class BodyError(HttpError):
    """The response head arrived but its body did not (EOF, bad framing or the deadline).

    Attributes:
        status: the response status.
        headers: the response headers (names lower-case).
        timed_out: True when the deadline ended the read.
    """

    def __init__(
        self, reason: str, status: int, headers: list[tuple[bytes, bytes]], *, timed_out: bool
    ) -> None:
        super().__init__(reason)
        self.status = status
        self.headers = headers
        self.timed_out = timed_out


@dataclass(frozen=True, slots=True)
class Response:
    """A whole response: status, headers (names lower-case bytes), body bytes."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (case-insensitive), as latin-1 text."""
        return _header(self.headers, name)

    @property
    def text(self) -> str:
        """The body as text: the charset of ``Content-Type`` if given and known, else UTF-8
        (undecodable bytes replaced)."""
        charset = "utf-8"
        ctype = self.header("content-type")
        if ctype:
            for param in ctype.split(";")[1:]:
                key, _, value = param.strip().partition("=")
                if key.lower() == "charset" and value:
                    charset = value.strip('"').strip()
        try:
            return self.body.decode(charset, errors="replace")
        except LookupError:
            return self.body.decode("utf-8", errors="replace")


def _header(headers: Sequence[tuple[bytes, bytes]], name: str) -> str | None:
    key = name.lower().encode()
    for k, v in headers:
        if k == key:
            return v.decode("latin-1")
    return None


@dataclass(frozen=True, slots=True)
class _Origin:
    scheme: str
    host: str
    port: int

    @property
    def host_header(self) -> bytes:
        default = 443 if self.scheme == "https" else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        return (host if self.port == default else f"{host}:{self.port}").encode("idna")


_PATH_SAFE = "/:@!$&'()*+,;=%~"
_QUERY_SAFE = _PATH_SAFE + "?"


@functools.lru_cache(maxsize=256)
def _split(url: str) -> tuple[_Origin, bytes]:
    """The origin and the request target of ``url``, percent-encoding what must be (a
    space, non-ASCII) and keeping existing escapes. Gateway URLs repeat: cached."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise InvalidURL(f"Request URL has an unsupported protocol '{scheme}://'.")
    if not parts.hostname:
        raise InvalidURL(f"Request URL has no host: {url!r}")
    try:
        port = parts.port or (443 if scheme == "https" else 80)
    except ValueError as exc:
        raise InvalidURL(f"Request URL has an invalid port: {url!r}") from exc
    target = quote(parts.path or "/", safe=_PATH_SAFE)
    if parts.query:
        target += "?" + quote(parts.query, safe=_QUERY_SAFE)
    return _Origin(scheme, parts.hostname, port), target.encode("ascii")


class _Conn:
    """One HTTP/1.1 connection: a trio stream, and when it expires while idle."""

    __slots__ = ("expires_at", "origin", "stream", "uses")

    def __init__(self, origin: _Origin, stream: trio.abc.Stream) -> None:
        self.origin = origin
        self.stream = stream
        self.expires_at = 0.0  # while idle: when it is dropped instead of reused (trio clock)
        self.uses = 0  # completed exchanges

    def readable(self) -> bool:
        """True if the server sent EOF (or anything) while the connection was idle."""
        stream = self.stream
        if isinstance(stream, trio.SSLStream):
            stream = stream.transport_stream
        sock = getattr(stream, "socket", None)
        return sock is None or bool(sock.is_readable())

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            await trio.aclose_forcefully(self.stream)


class _State(enum.Enum):
    UNOPENED = 1
    OPEN = 2
    CLOSED = 3


class HttpClient:
    """A keep-alive HTTP/1.1 client for ``POST`` requests to an inference gateway.

    Args:
        max_connections: connections open at once, across origins (>= 1).
        keepalive_expiry: seconds an idle connection is kept for reuse when the server's
            response gives no ``Keep-Alive: timeout=N`` hint (keep it below the server's
            keep-alive timeout; see :data:`KEEPALIVE_EXPIRY_SECONDS`).
        user_agent: the ``User-Agent`` header sent with every request.

    Use it as ``async with HttpClient(...) as client:``; :meth:`aclose` is idempotent.
    """

    def __init__(
        self,
        *,
        max_connections: int,
        keepalive_expiry: float = KEEPALIVE_EXPIRY_SECONDS,
        user_agent: str = "claimkit",
    ) -> None:
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        self.max_connections = max_connections
        self.keepalive_expiry = keepalive_expiry
        self.user_agent = user_agent.encode()
        self._slots = trio.Semaphore(max_connections)
        self._idle: dict[_Origin, deque[_Conn]] = {}
        self._state = _State.OPEN
        self.connections_opened = 0
        """How many connections this client has opened (for tests and benchmarks)."""

    @property
    def is_closed(self) -> bool:
        return self._state is _State.CLOSED

    async def __aenter__(self) -> HttpClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close every idle connection; the client then refuses new requests."""
        if self._state is _State.CLOSED:
            return
        self._state = _State.CLOSED
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                if not self._close_soon(conn):  # 10,000 idle sockets close in one pass
                    await conn.aclose()

    def idle_count(self) -> int:
        return sum(len(c) for c in self._idle.values())

    async def post(
        self,
        url: str,
        body: bytes,
        headers: Sequence[tuple[bytes, bytes]],
        *,
        timeout: float,
    ) -> Response:
        """``POST body`` to ``url`` and read the whole response.

        Args:
            url: an ``http://`` or ``https://`` URL.
            body: the request body (``Content-Length`` is set from it).
            headers: extra headers as ``(name, value)`` bytes; ``Host``, ``User-Agent``
                and ``Content-Length`` are added unless present.
            timeout: seconds for the whole request, every phase included.

        Returns:
            The :class:`Response`, whatever its status (3xx is not followed).

        Raises:
            InvalidURL, ConnectError, ConnectTimeout, PoolTimeout: nothing was sent.
            NoResponse (WriteTimeout, ReadTimeout, RemoteProtocolError): the request was
                written, all or in part, and no response head came back; it is not sent
                again (the server may be running it).
            BodyError: the response head arrived, its body did not.

        Cancellation: the connection in use is closed and its slot freed.
        """
        if self._state is _State.CLOSED:
            raise RuntimeError("the HTTP client is closed")
        origin, target = _split(url)
        deadline = trio.current_time() + max(timeout, 0.0)
        request = self._request(origin, target, body, headers)
        try:
            self._slots.acquire_nowait()  # the usual case: no cancel scope, no deadline entry
        except trio.WouldBlock:
            with trio.move_on_at(deadline) as pool_wait:
                await self._slots.acquire()
            if pool_wait.cancelled_caught:
                raise PoolTimeout(f"no free connection within {_seconds(timeout)}") from None
        try:
            # An idle connection the server closed is dropped here, before a byte is
            # written on it; after that nothing is ever sent twice.
            conn = self._take_idle(origin) or await self._connect(origin, deadline, timeout)
            return await self._exchange(conn, request, deadline, timeout)
        finally:
            self._slots.release()

    # -- internals ---------------------------------------------------------------------

    def _request(
        self,
        origin: _Origin,
        target: bytes,
        body: bytes,
        headers: Sequence[tuple[bytes, bytes]],
    ) -> tuple[bytes, bool]:
        """The request's bytes, and whether its connection may be reused after it."""
        have = {k.lower() for k, _ in headers}
        out: list[tuple[bytes, bytes]] = []
        if b"host" not in have:
            out.append((b"Host", origin.host_header))
        if b"user-agent" not in have:
            out.append((b"User-Agent", self.user_agent))
        out.extend(headers)
        # Transfer-Encoding given: it frames the body, and a Content-Length beside it
        # would make the message one that servers may refuse (RFC 9112 section 6.1).
        if b"content-length" not in have and b"transfer-encoding" not in have:
            out.append((b"Content-Length", str(len(body)).encode()))
        try:
            return serialise_post(target, out, body)
        except ProtocolError as exc:
            raise InvalidURL(f"invalid request: {exc}") from None

    def _take_idle(self, origin: _Origin) -> _Conn | None:
        conns = self._idle.get(origin)
        if not conns:
            return None
        now = trio.current_time()
        while conns:
            conn = conns.pop()  # most recently used first: the one least likely timed out
            if conn.expires_at <= now or conn.readable():
                self._close_soon(conn)
                continue
            # Connections under it on the stack are older (one server: the same hint), so
            # expired ones gather at the bottom: drop them.
            while conns and conns[0].expires_at <= now:
                self._close_soon(conns.popleft())
            return conn
        return None

    def _close_soon(self, conn: _Conn) -> bool:
        """Close an idle connection's socket now; False if its stream has none."""
        # A plain TCP socket closes synchronously; TLS would want a close_notify, but a
        # forceful close of an idle connection is what every pool does.
        stream = conn.stream
        if isinstance(stream, trio.SocketStream):
            stream.socket.close()
        elif isinstance(stream, trio.SSLStream) and isinstance(
            stream.transport_stream, trio.SocketStream
        ):
            stream.transport_stream.socket.close()
        else:
            return False
        return True

    def _put_back(self, conn: _Conn, headers: Sequence[tuple[bytes, bytes]]) -> None:
        """Pool ``conn`` after a complete exchange whose response had ``headers``."""
        keep = _keep_for(headers, self.keepalive_expiry)
        if self._state is _State.CLOSED or keep <= 0:
            self._close_soon(conn)
            return
        conn.expires_at = trio.current_time() + keep
        self._idle.setdefault(conn.origin, deque()).append(conn)

    async def _connect(self, origin: _Origin, deadline: float, timeout: float) -> _Conn:
        with trio.move_on_at(deadline):
            stream = await _open_stream(origin)
            self.connections_opened += 1
            return _Conn(origin, stream)
        raise ConnectTimeout(f"timed out connecting after {_seconds(timeout)}")

    async def _exchange(
        self,
        conn: _Conn,
        request: tuple[bytes, bool],
        deadline: float,
        timeout: float,
    ) -> Response:
        """One request/response on ``conn``. Puts it back in the pool when both sides
        allow it and nothing arrived after the response; closes it otherwise."""
        keep = False
        writing = True
        parser = ResponseParser()
        try:
            with trio.move_on_at(deadline):
                stream = conn.stream
                try:
                    await stream.send_all(request[0])
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                    raise RemoteProtocolError(f"connection broke while sending: {exc}") from None
                writing = False
                try:
                    await self._read_response(stream, parser)
                except (ProtocolError, _Broken) as exc:
                    reason = (
                        f"malformed response: {exc}" if type(exc) is ProtocolError else str(exc)
                    )
                    if not parser.head_done:
                        raise RemoteProtocolError(reason) from None
                    raise BodyError(
                        reason, parser.status, parser.headers, timed_out=False
                    ) from None
                conn.uses += 1
                # Bytes after the response (a second response, stray data) would be read
                # as the next request's answer: such a connection is closed, not reused.
                keep = request[1] and parser.keep_alive and not parser.extra
                return Response(parser.status, parser.headers, parser.body)
            # The deadline passed: say in which phase.
            if parser.head_done:
                raise BodyError(
                    f"body not complete within {_seconds(timeout)}",
                    parser.status,
                    parser.headers,
                    timed_out=True,
                )
            if writing:
                raise WriteTimeout(f"timed out sending the request after {_seconds(timeout)}")
            raise ReadTimeout(f"no response within {_seconds(timeout)}")
        finally:
            if keep:
                self._put_back(conn, parser.headers)
            else:
                await conn.aclose()

    @staticmethod
    async def _read_response(stream: trio.abc.Stream, parser: ResponseParser) -> None:
        """Read into ``parser`` until the response is complete.

        Raises:
            ProtocolError: malformed response (or EOF mid-body).
            _Broken: the connection broke, or closed before the response head.
        """
        while True:
            try:
                data = await stream.receive_some(_RECEIVE_BYTES)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise _Broken(f"connection broke: {exc}") from None
            if not data:
                if not parser.head_done:
                    raise _Broken("server closed the connection without a response")
                parser.feed_eof()
                return
            if parser.feed(data if type(data) is bytes else bytes(data)):
                return


def _keep_for(headers: Sequence[tuple[bytes, bytes]], default: float) -> float:
    """Seconds to keep a connection idle after a response with ``headers``: with a
    ``Keep-Alive: timeout=N`` hint (RFC 2068 19.7.1.1; Node, Apache), ``N`` − 1 s, or ``N`` / 2
    when ``N`` < 2, capped at :data:`KEEPALIVE_MAX_SECONDS`; ``0`` (do not keep) for
    ``timeout=0``; ``default`` when there is no usable hint."""
    for name, value in headers:
        if name != b"keep-alive":
            continue
        for param in value.split(b","):
            key, _, number = param.partition(b"=")
            if key.strip().lower() != b"timeout":
                continue
            try:
                hint = float(number.strip().strip(b'"'))
            except ValueError:
                return default
            if not math.isfinite(hint) or hint < 0:
                return default
            keep = hint - _KEEPALIVE_MARGIN_SECONDS if hint >= 2 else hint / 2
            return min(keep, KEEPALIVE_MAX_SECONDS)
    return default


async def _open_stream(origin: _Origin) -> trio.abc.Stream:
    """A connection to ``origin``: TCP, and for ``https`` the whole TLS handshake.

    trio would defer the handshake to the first write; it is done here so that a failed
    handshake, like a refused connection or a name that does not resolve, is a
    :class:`ConnectError` raised before any byte of a request is written (docs/dispatch.md,
    "The gateway is unreachable").

    Raises:
        ConnectError: DNS failure, connection refused or unreachable, TLS handshake failure
            (a certificate that does not verify included).

    Cancellation: a half-open connection is closed; nothing was sent.
    """
    try:
        tcp = await trio.open_tcp_stream(origin.host, origin.port)
    except socket.gaierror as exc:
        raise ConnectError(f"cannot resolve {origin.host}: {exc.strerror or exc}") from exc
    except OSError as exc:
        raise ConnectError(str(exc) or type(exc).__name__) from exc
    if origin.scheme != "https":
        return tcp
    # The context trio.open_ssl_over_tcp_stream would make: the system's certificate store.
    tls = trio.SSLStream(
        tcp, ssl.create_default_context(), server_hostname=origin.host, https_compatible=True
    )
    try:
        await tls.do_handshake()
    except trio.BrokenResourceError as exc:
        failure = f"TLS handshake with {origin.host}:{origin.port} failed: {exc.__cause__ or exc}"
    except BaseException:
        await trio.aclose_forcefully(tcp)
        raise
    else:
        return tls
    await trio.aclose_forcefully(tcp)
    # Raised outside the except block, so the SSL error (whose errno is no OS reason) is
    # not taken for the cause of the failure.
    raise ConnectError(failure)


async def probe(url: str, timeout: float) -> None:
    """Open a connection to ``url``'s host and port as a request would (TCP, and the TLS
    handshake for ``https``), then close it; nothing is sent. The gateway breaker's probe
    (docs/dispatch.md, "The gateway is unreachable").

    Args:
        url: an ``http://`` or ``https://`` URL; only its scheme, host and port are used.
        timeout: seconds the connection may take.

    Raises:
        InvalidURL: the URL cannot be requested.
        ConnectError: the connection could not be opened (DNS, refused, TLS).
        ConnectTimeout: it did not open within ``timeout`` seconds.

    Cancellation: a half-open connection is closed.
    """
    origin, _target = _split(url)
    with trio.move_on_after(max(timeout, 0.0)):
        stream = await _open_stream(origin)
        await trio.aclose_forcefully(stream)
        return
    raise ConnectTimeout(f"timed out connecting after {_seconds(timeout)}")


class _Broken(Exception):
    """The connection broke or reached EOF while reading (mapped by the phase)."""


def _seconds(seconds: float) -> str:
    if math.isinf(seconds):
        return "inf s"
    return f"{seconds:.3f}".rstrip("0").rstrip(".") + " s"
