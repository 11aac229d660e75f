"""A hand-written HTTP/1.1 response parser: the candidate ``bench/dispatch_paths.py`` measures
against the ``httptools`` wrapper claimkit uses (:mod:`claimkit.consumer.http_parse`).

Not used by claimkit (docs/performance.md, "The dispatch path": it cost more CPU than the
wrapper, so the library was kept). It has the wrapper's interface and accepts and refuses
exactly what h11 0.16 does for the response to a ``POST`` (``tests/test_http_parse.py``'s
corpus, run against it by ``python bench/_http_handwritten.py``):

- **Head.** A status line ``HTTP/d.d NNN [reason]`` and header lines (names are tokens,
  values visible characters with inner spaces or tabs, surrounding whitespace dropped),
  ended by an empty line; lines end in CRLF or a bare LF; an obsolete line fold joins the
  previous header with one space. An incomplete head over 16 KiB is refused.
- **1xx** skipped, ``101`` refused. **Framing**: 204/304 empty, else chunked (the only
  transfer coding), else ``Content-Length`` (repeats must agree), else to EOF.
- **Keep-alive**: not after ``Connection: close``, ``HTTP/1.0`` or a body read to EOF.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

from claimkit.consumer.http_parse import MAX_INCOMPLETE_BYTES, ProtocolError

__all__ = ["ResponseParser"]

_TOKEN = rb"[-!#$%&'*+.^_`|~0-9a-zA-Z]+"
_FIELD_VALUE = rb"(?:[^\x00\s]+(?:[ \t]+[^\x00\s]+)*)?"
_TOKEN_RE = re.compile(_TOKEN)
_FIELD_VALUE_RE = re.compile(_FIELD_VALUE)
_HEADER_RE = re.compile(rb"(" + _TOKEN + rb"):[ \t]*(" + _FIELD_VALUE + rb")[ \t]*")
_STATUS_RE = re.compile(rb"HTTP/([0-9]\.[0-9]) ([0-9]{3})(?: (?:[ \t]|[^\x00\s])*)?")
_STATUS_CRLF_RE = re.compile(rb"HTTP/([0-9]\.[0-9]) ([0-9]{3})(?: (?:[ \t]|[^\x00\s])*)?\r\n")
_HEADER_CRLF_RE = re.compile(rb"(" + _TOKEN + rb"):[ \t]*(" + _FIELD_VALUE + rb")[ \t]*\r\n")
_BLANK_LINE_RE = re.compile(rb"\n\r?\n")
_CHUNK_RE = re.compile(rb"([0-9A-Fa-f]{1,20})(?:;.*)?[ \t]*\r\n")
_CONTENT_LENGTH_RE = re.compile(rb"[0-9]{1,20}")

# Parser modes.
_HEAD = 0
_LENGTH = 1
_CHUNK_SIZE = 2
_CHUNK_DATA = 3
_CHUNK_END = 4
_TRAILER = 5
_TO_EOF = 6
_DONE = 7


def _comma_values(headers: Sequence[tuple[bytes, bytes]], name: bytes) -> list[bytes]:
    out: list[bytes] = []
    for k, v in headers:
        if k == name:
            out.extend(x.strip().lower() for x in v.split(b",") if x.strip())
    return out


def _header_lines(lines: list[bytes]) -> list[tuple[bytes, bytes]]:
    """``(lower-case name, value)`` of each header line, obsolete folds joined."""
    out: list[tuple[bytes, bytes]] = []
    match = _HEADER_RE.fullmatch
    folded: bytes | None = None
    for line in reversed(lines):
        if line[:1] in b" \t" and line:
            folded = line.lstrip(b" \t") + (b" " + folded if folded is not None else b"")
            continue
        if folded is not None:
            line += b" " + folded
            folded = None
        m = match(line)
        if m is None:
            raise ProtocolError(f"illegal header line: {line!r}")
        out.append((m[1].lower(), m[2]))
    if folded is not None:
        raise ProtocolError("continuation line at start of headers")
    out.reverse()
    return out


def _split_lines(head: bytes) -> list[bytes]:
    lines = head.split(b"\n")
    return [line[:-1] if line[-1:] == b"\r" else line for line in lines]


class ResponseParser:
    """One response, fed as it arrives: :meth:`feed` each read, :meth:`feed_eof` at EOF.

    Attributes (valid once :attr:`head_done`):
        status: the final status (1xx heads are skipped).
        headers: ``(name, value)`` bytes, names lower-case, ``Content-Length`` and
            ``Transfer-Encoding`` values normalised.
        keep_alive: the response allows the connection to carry another request.
        leftover: bytes that arrived after the end of the response (after :attr:`done`).
    """

    __slots__ = (
        "_buf",
        "_chunks",
        "_expected",
        "_mode",
        "_remaining",
        "done",
        "head_done",
        "headers",
        "keep_alive",
        "status",
    )

    def __init__(self) -> None:
        self._buf = b""
        self._chunks: list[bytes] = []
        self._mode = _HEAD
        self._remaining = 0
        self._expected = 0
        self.head_done = False
        self.done = False
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = True

    @property
    def body(self) -> bytes:
        return b"".join(self._chunks)

    @property
    def leftover(self) -> bytes:
        return self._buf

    @property
    def extra(self) -> bool:
        return bool(self._buf)

    def feed(self, data: bytes) -> bool:
        """Parse ``data`` (the next bytes read); True once the response is complete.

        Raises:
            ProtocolError: malformed response.
        """
        if self._buf:
            self._buf += data
        else:
            self._buf = data
        if self._mode == _HEAD and not self._read_head():
            return False
        mode = self._mode
        if mode == _LENGTH:
            buf = self._buf
            n = len(buf)
            remaining = self._remaining
            if n >= remaining:
                self._chunks.append(buf[:remaining] if n > remaining else buf)
                self._buf = buf[remaining:] if n > remaining else b""
                self._remaining = 0
                self._mode = _DONE
                self.done = True
                return True
            if n:
                self._chunks.append(buf)
                self._buf = b""
                self._remaining = remaining - n
            return False
        if mode == _TO_EOF:
            if self._buf:
                self._chunks.append(self._buf)
                self._buf = b""
            return False
        if mode == _DONE:
            self.done = True
            return True
        return self._read_chunked()

    def feed_eof(self) -> None:
        """The server closed the connection: completes a body read to EOF.

        Raises:
            ProtocolError: the response was not complete.
        """
        if self._mode == _TO_EOF:
            self._mode = _DONE
            self.done = True
            return
        if self._mode == _DONE:
            return
        if self._mode == _HEAD:
            raise ProtocolError("server closed the connection without a response")
        if self._mode == _LENGTH:
            raise ProtocolError(
                "peer closed connection without sending complete message body "
                f"(received {self._expected - self._remaining} bytes, expected {self._expected})"
            )
        raise ProtocolError(
            "peer closed connection without sending complete message body (incomplete chunked read)"
        )

    def _read_head(self) -> bool:
        while True:
            buf = self._buf
            if not buf:
                return False
            if buf[:1] == b"\n" or buf[:2] == b"\r\n":
                raise ProtocolError("no response line received")
            head = self._head_crlf(buf) or self._head_general(buf)
            if head is None:
                return False
            version, status, headers = head
            if status < 200:
                if status == 101:
                    raise ProtocolError("101 Switching Protocols without an Upgrade request")
                _normalise(headers)
                continue  # 100 Continue and friends: the real head follows
            self._start_body(version, status, headers)
            return True

    def _head_crlf(self, buf: bytes) -> tuple[bytes, int, list[tuple[bytes, bytes]]] | None:
        """The common case: CRLF line ends, no folded lines (else None: a bare LF or a fold
        fails a match, and :meth:`_head_general` decides)."""
        end = buf.find(b"\r\n\r\n") + 2
        if end < 2:
            return None
        sm = _STATUS_CRLF_RE.match(buf, 0, end)
        if sm is None:
            return None
        headers: list[tuple[bytes, bytes]] = []
        pos = sm.end()
        match = _HEADER_CRLF_RE.match
        append = headers.append
        while pos < end:
            m = match(buf, pos, end)
            if m is None:
                return None
            append((m[1].lower(), m[2]))
            pos = m.end()
        self._buf = buf[end + 2 :]
        return sm[1], int(sm[2]), headers

    def _head_general(self, buf: bytes) -> tuple[bytes, int, list[tuple[bytes, bytes]]] | None:
        m = _BLANK_LINE_RE.search(buf)
        if m is None:
            if buf[0] < 0x21:
                raise ProtocolError("illegal status line")
            if len(buf) > MAX_INCOMPLETE_BYTES:
                raise ProtocolError("response head too long")
            return None
        lines = _split_lines(buf[: m.start()])
        self._buf = buf[m.end() :]
        sm = _STATUS_RE.fullmatch(lines[0])
        if sm is None:
            raise ProtocolError(f"illegal status line: {lines[0]!r}")
        return sm[1], int(sm[2]), _header_lines(lines[1:])

    def _start_body(self, version: bytes, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        chunked, length, close = _normalise(headers)
        self.status = status
        self.headers = headers
        self.head_done = True
        if close or version < b"1.1":
            self.keep_alive = False
        if status in (204, 304):
            self._mode = _DONE
        elif chunked:
            self._mode = _CHUNK_SIZE
        elif length is not None:
            self._mode = _LENGTH if length else _DONE
            self._remaining = self._expected = length
        else:
            self._mode = _TO_EOF
            self.keep_alive = False

    def _read_chunked(self) -> bool:
        step = {
            _CHUNK_SIZE: self._chunk_size,
            _CHUNK_DATA: self._chunk_data,
            _CHUNK_END: self._chunk_end,
            _TRAILER: self._trailer,
        }
        while self._mode != _DONE:
            if not step[self._mode]():
                return False
        self.done = True
        return True

    def _chunk_size(self) -> bool:
        buf = self._buf
        i = buf.find(b"\r\n")
        if i < 0:
            if len(buf) > MAX_INCOMPLETE_BYTES:
                raise ProtocolError("chunk header too long")
            return False
        line = buf[: i + 2]
        m = _CHUNK_RE.fullmatch(line)
        if m is None:
            raise ProtocolError(f"illegal chunk header: {line!r}")
        self._buf = buf[i + 2 :]
        size = int(m[1], 16)
        if size:
            self._remaining = size
            self._mode = _CHUNK_DATA
        else:
            self._mode = _TRAILER
        return True

    def _chunk_data(self) -> bool:
        buf = self._buf
        if not buf:
            return False
        remaining = self._remaining
        self._chunks.append(buf[:remaining])
        self._buf = buf[remaining:]
        if len(buf) < remaining:
            self._remaining = remaining - len(buf)
            return False
        self._remaining = 2  # the CRLF after the chunk
        self._mode = _CHUNK_END
        return True

    def _chunk_end(self) -> bool:
        buf = self._buf
        if not buf:
            return False
        want = b"\r\n"[2 - self._remaining :]
        got = buf[: len(want)]
        if got != want[: len(got)]:
            raise ProtocolError(f"malformed chunk footer: {got!r} (expected {want!r})")
        self._buf = buf[len(got) :]
        self._remaining -= len(got)
        if self._remaining:
            return False
        self._mode = _CHUNK_SIZE
        return True

    def _trailer(self) -> bool:
        """Header lines up to an empty line, checked and dropped (as h11 does)."""
        buf = self._buf
        if buf[:1] == b"\n" or buf[:2] == b"\r\n":
            self._buf = buf[1:] if buf[:1] == b"\n" else buf[2:]
        else:
            m = _BLANK_LINE_RE.search(buf)
            if m is None:
                if len(buf) > MAX_INCOMPLETE_BYTES:
                    raise ProtocolError("chunked trailer too long")
                return False
            _header_lines(_split_lines(buf[: m.start()]))
            self._buf = buf[m.end() :]
        self._mode = _DONE
        return True


def _length(value: bytes, seen: bytes | None) -> bytes:
    """A ``Content-Length`` value normalised (``"5, 5"`` is 5), checked against one seen."""
    if not (value.isdigit() and len(value) <= 20):
        lengths = {v.strip() for v in value.split(b",")}
        if len(lengths) != 1:
            raise ProtocolError("conflicting Content-Length headers")
        value = lengths.pop()
        if _CONTENT_LENGTH_RE.fullmatch(value) is None:
            raise ProtocolError("bad Content-Length")
    if seen is not None and seen != value:
        raise ProtocolError("conflicting Content-Length headers")
    return value


def _normalise(headers: list[tuple[bytes, bytes]]) -> tuple[bool, int | None, bool]:
    """Check and normalise ``Content-Length`` and ``Transfer-Encoding`` in place (as h11
    does); returns (chunked, content length or None, ``Connection: close``)."""
    length: bytes | None = None
    chunked = False
    close = False
    lengths_seen = 0
    for i, (name, value) in enumerate(headers):
        if name == b"connection":
            if b"close" in value.lower() and b"close" in _comma_values([(name, value)], name):
                close = True
        elif name == b"content-length":
            lengths_seen += 1
            length = _length(value, length)
            if length != value:
                headers[i] = (name, length)
        elif name == b"transfer-encoding":
            if chunked:
                raise ProtocolError("multiple Transfer-Encoding headers")
            value = value.lower()
            if value != b"chunked":
                raise ProtocolError("Only Transfer-Encoding: chunked is supported")
            chunked = True
            headers[i] = (name, value)
    if lengths_seen > 1:  # equal repeats are listed once, as h11 lists them
        seen = False
        for i in range(len(headers) - 1, -1, -1):
            if headers[i][0] == b"content-length":
                if seen:
                    del headers[i]
                seen = True
    return chunked, None if length is None else int(length), close


def _check_against_h11() -> None:
    """Run ``tests/test_http_parse.py``'s h11 parity corpus against this parser."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import test_http_parse as t

    t.ResponseParser = ResponseParser  # type: ignore[misc]
    for name, data in t.CORPUS.items():
        for pieces in t.splits(data):
            assert t.our_outcome(pieces) == t.h11_outcome(pieces), name
    for name, data in t.STRICTER.items():  # h11 accepts these; so does this parser
        for pieces in t.splits(data):
            ours = t.our_outcome(pieces)
            assert ours == t.h11_outcome(pieces), (name, ours)
    print(f"same outcomes as h11 on {len(t.CORPUS) + len(t.STRICTER)} responses")


if __name__ == "__main__":
    _check_against_h11()
