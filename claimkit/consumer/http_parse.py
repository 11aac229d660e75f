"""The HTTP/1.1 wire format for :mod:`claimkit.consumer.http`: a response parser (the
``httptools`` binding of llhttp, wrapped) and a request serialiser.

The parser refuses every response h11 0.16 (the library the client used before) refused, at a
fraction of its CPU (``docs/performance.md``, "The dispatch path"):

- **Head.** A status line ``HTTP/x.y NNN [reason]`` and header lines ended by an empty line
  (llhttp's strict grammar; names are returned lower-case, values without surrounding
  whitespace). An unfinished head over :data:`MAX_INCOMPLETE_BYTES` is refused.
- **1xx.** ``100 Continue`` and other informational heads are skipped; ``101`` (a protocol
  switch nobody asked for) is refused.
- **Framing.** 204 and 304 have no body; else ``Transfer-Encoding: chunked`` (the only
  transfer coding accepted, in one header), else ``Content-Length``, else the body runs to
  EOF (:meth:`ResponseParser.feed_eof` ends it).
- **Keep-alive.** Not after ``Connection: close``, an ``HTTP/1.0`` response or a body read to
  EOF. Bytes after the end of the response are reported (:attr:`ResponseParser.extra`), so
  that the client closes the connection instead of reading them as the next answer.

Stricter than h11 (llhttp refuses what h11 let through; a gateway does not send these): a
repeated or comma-listed ``Content-Length``, ``Content-Length`` beside ``Transfer-Encoding``,
obsolete line folding, bare LF line ends, control characters in header values, HTTP versions
other than 0.9, 1.0, 1.1, 2.0 and 3.0. Laxer: empty lines before the status line are skipped.

Errors are :class:`ProtocolError`; :attr:`ResponseParser.head_done` tells whether the
response head had arrived when it was raised.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import httptools

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["MAX_INCOMPLETE_BYTES", "ProtocolError", "ResponseParser", "serialise_post"]

MAX_INCOMPLETE_BYTES = 16384
"""An unfinished response head longer than this is refused (h11's default
``max_incomplete_event_size``; llhttp has no limit of its own)."""

_TOKEN_RE = re.compile(rb"[-!#$%&'*+.^_`|~0-9a-zA-Z]+")
_FIELD_VALUE_RE = re.compile(rb"(?:[^\x00\s]+(?:[ \t]+[^\x00\s]+)*)?")
_CONTENT_LENGTH_RE = re.compile(rb"[0-9]{1,20}")


class ProtocolError(Exception):
    """The bytes are not an HTTP/1.1 response this client accepts, or a request cannot be
    written as given; ``str`` says why."""


class _Extra(Exception):
    """A second message began after the response (raised inside a parser callback)."""


def _has_close(value: bytes) -> bool:
    return any(x.strip().lower() == b"close" for x in value.split(b","))


class ResponseParser:
    """One response to a ``POST``, fed as it arrives: :meth:`feed` each read,
    :meth:`feed_eof` at EOF.

    Attributes (valid once :attr:`head_done`):
        status: the final status (1xx heads are skipped).
        headers: ``(name, value)`` bytes, names lower-case, ``Transfer-Encoding`` lower-case.
        keep_alive: the response allows the connection to carry another request.
        extra: bytes arrived after the end of the response (once :attr:`done`).
    """

    __slots__ = (
        "_chunks",
        "_close",
        "_head_bytes",
        "_informational",
        "_length",
        "_parser",
        "_te",
        "done",
        "extra",
        "head_done",
        "headers",
        "keep_alive",
        "status",
    )

    def __init__(self) -> None:
        self._parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self._chunks: list[bytes] = []
        self._head_bytes = 0
        self._informational = False
        self._te = False
        self._length = False
        self._close = False
        self.done = False
        self.extra = False
        self.head_done = False
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = True

    @property
    def body(self) -> bytes:
        """The body bytes received (all of it once :attr:`done`)."""
        return b"".join(self._chunks)

    def feed(self, data: bytes) -> bool:
        """Parse ``data`` (the next bytes read); True once the response is complete.

        Raises:
            ProtocolError: malformed response.
        """
        parser = self._parser
        if parser is None:
            raise ProtocolError("the response already ended")
        try:
            parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            self._parser = None
            cause = exc.__context__
            if isinstance(cause, _Extra):
                self.extra = True
                return True
            if isinstance(cause, ProtocolError):
                raise ProtocolError(str(cause)) from None
            raise ProtocolError(str(exc)) from None
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._parser = None
            if self.done:  # garbage after the response
                self.extra = True
                return True
            raise ProtocolError(str(exc) or type(exc).__name__) from None
        if self.done:
            # The llhttp parser refers back to this object: dropped, so that no reference
            # cycle is left for the garbage collector (one per request, measurable).
            self._parser = None
            return True
        if not self.head_done:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_INCOMPLETE_BYTES:
                self._parser = None
                raise ProtocolError("response head too long")
        return False

    def feed_eof(self) -> None:
        """The server closed the connection: ends a body read to EOF.

        Raises:
            ProtocolError: the response was not complete.
        """
        if self.done:
            return
        if not self.head_done:
            raise ProtocolError("server closed the connection without a response")
        if self._te or self._length:
            raise ProtocolError(
                "peer closed connection without sending complete message body "
                f"(received {sum(map(len, self._chunks))} bytes)"
            )
        self.done = True

    # -- llhttp callbacks ------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.done:
            raise _Extra

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.head_done:
            return  # a chunked trailer: checked by llhttp, dropped (as h11 did)
        name = name.lower()
        value = value.rstrip(b" \t")
        if name == b"transfer-encoding":
            if self._te:
                raise ProtocolError("multiple Transfer-Encoding headers")
            value = value.lower()
            if value != b"chunked":
                raise ProtocolError("Only Transfer-Encoding: chunked is supported")
            self._te = True
        elif name == b"content-length":
            self._length = True
        elif name == b"connection" and _has_close(value):
            self._close = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self._parser
        assert parser is not None  # called from inside feed_data
        status = parser.get_status_code()
        if status < 200:
            if status == 101:
                raise ProtocolError("101 Switching Protocols without an Upgrade request")
            # 100 Continue and friends: the real head follows.
            self._informational = True
            self.headers = []
            self._te = self._length = self._close = False
            return
        self.status = status
        self.head_done = True
        if self._close or parser.get_http_version() < "1.1":
            self.keep_alive = False
        if not (self._te or self._length) and status != 204 and status != 304:
            self.keep_alive = False  # the body runs to EOF

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        self.done = True


def _normalise_length(value: bytes) -> bytes:
    lengths = {v.strip() for v in value.split(b",")}
    if len(lengths) != 1:
        raise ProtocolError("conflicting Content-Length headers")
    value = lengths.pop()
    if _CONTENT_LENGTH_RE.fullmatch(value) is None:
        raise ProtocolError("bad Content-Length")
    return value


def _check_header(name: bytes, value: bytes) -> tuple[bytes, bytes, bytes]:
    """``(lower-case name, value as sent, the line)`` of one request header.

    Raises:
        ProtocolError: a name that is no token, a value with CR, LF, NUL or surrounding
            whitespace, a bad ``Content-Length`` or ``Transfer-Encoding``.
    """
    if _TOKEN_RE.fullmatch(name) is None:
        raise ProtocolError(f"Illegal header name {name!r}")
    if _FIELD_VALUE_RE.fullmatch(value) is None:
        raise ProtocolError(f"Illegal header value {value!r}")
    lower = name.lower()
    if lower == b"content-length":
        value = _normalise_length(value)
    elif lower == b"transfer-encoding":
        value = value.lower()
        if value != b"chunked":
            raise ProtocolError("Only Transfer-Encoding: chunked is supported")
    return lower, value, b"%s: %s\r\n" % (name, value)


_LINES: dict[tuple[bytes, bytes], tuple[bytes, bytes, bytes]] = {}
"""Checked header lines: dispatch sends the same few headers with every request."""
_LINES_MAX = 512
_LINES_VALUE_MAX = 256


def _header_line(name: bytes, value: bytes) -> tuple[bytes, bytes, bytes]:
    """:func:`_check_header`, remembered for short values (bounded: cleared when full)."""
    key = (name, value)
    line = _LINES.get(key)
    if line is None:
        line = _check_header(name, value)
        if len(value) <= _LINES_VALUE_MAX:
            if len(_LINES) >= _LINES_MAX:
                _LINES.clear()
            _LINES[key] = line
    return line


def serialise_post(
    target: bytes,
    headers: Sequence[tuple[bytes, bytes]],
    body: bytes,
) -> tuple[bytes, bool]:
    """The bytes of ``POST target HTTP/1.1`` with ``headers`` and ``body``, and whether the
    connection may carry another request after it (no ``Connection: close``). What h11 sent
    for the same request, and refused where h11 refused.

    ``headers`` must hold exactly one ``Host`` (it is written first). Header names must be
    tokens, values visible characters with inner spaces or tabs (no CR, LF, NUL, nothing
    around them). A ``Content-Length`` (repeats must agree; written once) must equal
    ``len(body)``. A ``Transfer-Encoding`` must be ``chunked``, given once, and frames the
    body (it wins over a ``Content-Length``).

    Raises:
        ProtocolError: a header that cannot be sent, or a body that contradicts them.
    """
    host: list[bytes] = []
    lines: list[bytes] = []
    length: bytes | None = None
    chunked = False
    keep = True
    for raw_name, raw_value in headers:
        name, value, line = _header_line(raw_name, raw_value)
        if name == b"host":
            host.append(line)
            continue
        if name == b"content-length":
            if length is not None:
                if length != value:
                    raise ProtocolError("conflicting Content-Length headers")
                continue
            length = value
        elif name == b"transfer-encoding":
            if chunked:
                raise ProtocolError("multiple Transfer-Encoding headers")
            chunked = True
        elif name == b"connection" and _has_close(value):
            keep = False
        lines.append(line)
    if len(host) != 1:
        raise ProtocolError(
            "Missing mandatory Host: header" if not host else "Found multiple Host: headers"
        )
    if chunked:
        payload = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body) if body else b"0\r\n\r\n"
    elif length is not None and int(length) != len(body):
        raise ProtocolError(
            "Too much data for declared Content-Length"
            if len(body) > int(length)
            else "Too little data for declared Content-Length"
        )
    else:
        payload = body
    return b"POST %s HTTP/1.1\r\n%s%s\r\n%s" % (target, host[0], b"".join(lines), payload), keep
