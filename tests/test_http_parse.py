"""``claimkit.consumer.http_parse`` against h11, the library the HTTP client used before.

Each response of a corpus is fed to both, whole and byte by byte, and the outcomes must agree:
refused before the head, refused after the head (status known), or accepted with the same
status, headers, body and connection reuse. The few cases where llhttp is stricter (or, for
empty lines, laxer) than h11 are listed, and asserted as such.
"""

from __future__ import annotations

import h11
import pytest

from claimkit.consumer.http_parse import ProtocolError, ResponseParser, serialise_post

OK_HEAD = b"HTTP/1.1 200 OK\r\n"
NODE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n"
    b"Date: Thu, 03 Dec 2026 11:35:31 GMT\r\nConnection: keep-alive\r\n"
    b'Keep-Alive: timeout=120\r\n\r\n{"id": "x"}'
)
CHUNKED = OK_HEAD + b"Transfer-Encoding: chunked\r\n\r\n"

CORPUS: dict[str, bytes] = {
    "node gateway": NODE,
    "chunked, extension, trailer": CHUNKED + b"3;x=y\r\ncaf\r\n1\r\n\xe9\r\n0\r\nT: 1\r\n\r\n",
    "chunked, upper-case coding": OK_HEAD
    + b"Transfer-Encoding: Chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n",
    "100 Continue first": b"HTTP/1.1 100 Continue\r\n\r\n" + NODE,
    "two 1xx first": b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early\r\nLink: x\r\n\r\n" + NODE,
    "204 with Content-Length": b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\n",
    "304": b"HTTP/1.1 304 Not Modified\r\nETag: x\r\n\r\n",
    "body to EOF": OK_HEAD + b"Content-Type: text/plain\r\n\r\nuntil the end",
    "empty body to EOF": OK_HEAD + b"\r\n",
    "HTTP/1.0": b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nhi",
    "HTTP/1.0 keep-alive": b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\n"
    b"Content-Length: 2\r\n\r\nhi",
    "HTTP/2.0 status line": b"HTTP/2.0 200 OK\r\nContent-Length: 2\r\n\r\nhi",
    "Connection: close": OK_HEAD + b"Connection: close\r\nContent-Length: 2\r\n\r\nhi",
    "Connection: Keep-Alive, Close": OK_HEAD
    + b"Connection: Keep-Alive, Close\r\nContent-Length: 2\r\n\r\nhi",
    "no reason phrase": b"HTTP/1.1 503\r\nRetry-After: 7\r\nContent-Length: 0\r\n\r\n",
    "status 999": b"HTTP/1.1 999 Odd\r\nContent-Length: 0\r\n\r\n",
    "empty and padded values": OK_HEAD
    + b"X-Empty:\r\nX-Pad: \t a  b \t\r\nContent-Length: 0\r\n\r\n",
    "obs-text value": OK_HEAD + b"X: caf\xe9\r\nContent-Length: 0\r\n\r\n",
    "Content-Length 0": OK_HEAD + b"Content-Length: 0\r\n\r\n",
    "big complete head": OK_HEAD + b"X: " + b"a" * 20000 + b"\r\nContent-Length: 0\r\n\r\n",
    # Refused by both.
    "empty": b"",
    "truncated head": OK_HEAD + b"Content-Len",
    "truncated Content-Length body": OK_HEAD + b"Content-Length: 100\r\n\r\npartial",
    "truncated chunked body": CHUNKED + b"5\r\nab",
    "Transfer-Encoding: gzip": OK_HEAD + b"Transfer-Encoding: gzip\r\n\r\nxx",
    "Transfer-Encoding: gzip, chunked": OK_HEAD
    + b"Transfer-Encoding: gzip, chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n",
    "two Transfer-Encoding headers": OK_HEAD
    + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "conflicting Content-Length": OK_HEAD + b"Content-Length: 1\r\nContent-Length: 2\r\n\r\nxx",
    "bad Content-Length": OK_HEAD + b"Content-Length: abc\r\n\r\n",
    "huge Content-Length": OK_HEAD + b"Content-Length: " + b"9" * 30 + b"\r\n\r\n",
    "101 unasked": b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n",
    "space before colon": OK_HEAD + b"X : y\r\nContent-Length: 0\r\n\r\n",
    "two-digit status": b"HTTP/1.1 20 OK\r\nContent-Length: 0\r\n\r\n",
    "not HTTP": b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
    "bad chunk size": CHUNKED + b"zz\r\nx\r\n0\r\n\r\n",
    "bad chunk footer": CHUNKED + b"1\r\nxyz\r\n0\r\n\r\n",
    "NUL in a value": OK_HEAD + b"X: a\x00b\r\nContent-Length: 0\r\n\r\n",
    "big incomplete head": OK_HEAD + b"X: " + b"a" * 20000,
    # Something after the response: accepted, the connection not reused.
    "a second response after": NODE + NODE,
    "garbage after": NODE + b"garbage",
    "half a head after": NODE + b"HTTP/1.1 2",
    "body to EOF after 204": b"HTTP/1.1 204 No Content\r\n\r\nzzz",
}

STRICTER = {
    # h11 accepts these; llhttp refuses them.
    "repeated Content-Length": OK_HEAD + b"Content-Length: 2\r\nContent-Length: 2\r\n\r\nhi",
    "comma-listed Content-Length": OK_HEAD + b"Content-Length: 2, 2\r\n\r\nhi",
    "Content-Length and Transfer-Encoding": OK_HEAD
    + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n",
    "obsolete line fold": OK_HEAD + b"X: a\r\n b\r\nContent-Length: 0\r\n\r\n",
    "bare LF line ends": b"HTTP/1.1 200 OK\nContent-Length: 2\n\nhi",
    "HTTP/1.2": b"HTTP/1.2 200 OK\r\nContent-Length: 0\r\n\r\n",
    "control character in a value": OK_HEAD + b"X: a\x01b\r\nContent-Length: 0\r\n\r\n",
}

Outcome = tuple[object, ...]


def h11_outcome(pieces: list[bytes]) -> Outcome:
    """What the old client made of ``pieces`` (read one after another, then EOF)."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(
        h11.Request(method="POST", target="/", headers=[("Host", "x"), ("Content-Length", "0")])
    )
    conn.send(h11.EndOfMessage())
    head: h11.Response | None = None
    body: list[bytes] = []
    try:
        for i, piece in enumerate([*pieces, b""]):
            if not piece and head is None:
                return ("refused", "before head")  # EOF without a response head
            conn.receive_data(piece)
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    break
                if type(event) is h11.Response:
                    head = event
                elif type(event) is h11.Data:
                    body.append(bytes(event.data))
                elif type(event) is h11.EndOfMessage:
                    assert head is not None
                    leftover = bool(conn.trailing_data[0]) or any(pieces[i + 1 :])
                    reuse = conn.our_state is h11.DONE and conn.their_state is h11.DONE
                    # A body that ran to EOF: h11 said DONE, but the server has closed.
                    reuse = reuse and i < len(pieces)
                    return (
                        "ok",
                        head.status_code,
                        list(head.headers),
                        b"".join(body),
                        reuse and not leftover,
                    )
                elif type(event) is not h11.InformationalResponse:
                    raise AssertionError(event)
    except h11.RemoteProtocolError:
        pass
    return ("refused", "before head" if head is None else ("after head", head.status_code))


def our_outcome(pieces: list[bytes]) -> Outcome:
    parser = ResponseParser()
    try:
        for i, piece in enumerate(pieces):
            if parser.feed(piece):
                leftover = parser.extra or any(pieces[i + 1 :])
                break
        else:
            parser.feed_eof()
            leftover = False
    except ProtocolError:
        if not parser.head_done:
            return ("refused", "before head")
        return ("refused", ("after head", parser.status))
    assert parser.done
    return (
        "ok",
        parser.status,
        parser.headers,
        parser.body,
        parser.keep_alive and not leftover,
    )


def splits(data: bytes) -> list[list[bytes]]:
    """The response whole, byte by byte, and cut in two at a few places."""
    out = [[data] if data else [], [data[i : i + 1] for i in range(len(data))]]
    for cut in (1, 17, len(data) // 2, len(data) - 1):
        if 0 < cut < len(data):
            out.append([data[:cut], data[cut:]])
    return out


@pytest.mark.parametrize("name", list(CORPUS))
def test_same_outcome_as_h11(name: str) -> None:
    data = CORPUS[name]
    for pieces in splits(data):
        assert our_outcome(pieces) == h11_outcome(pieces), (name, len(pieces))


@pytest.mark.parametrize("name", list(STRICTER))
def test_stricter_than_h11_where_llhttp_is(name: str) -> None:
    data = STRICTER[name]
    for pieces in splits(data):
        assert h11_outcome(pieces)[0] == "ok"
        assert our_outcome(pieces) == ("refused", "before head"), (name, len(pieces))


def test_empty_lines_around_a_response_are_dropped() -> None:
    """llhttp skips empty lines between messages, as servers do between pipelined
    requests: before the status line (h11 refused that) and after the response (h11 kept
    them for the next response, which it then refused). Consumed, they cannot be handed to
    the next request, so the connection stays reusable."""
    assert our_outcome([b"\r\n" + NODE])[0] == "ok"
    assert h11_outcome([b"\r\n" + NODE]) == ("refused", "before head")
    assert our_outcome([NODE + b"\r\n"])[-1] is True


def test_request_serialisation_matches_h11() -> None:
    cases: list[tuple[list[tuple[bytes, bytes]], bytes]] = [
        (
            [
                (b"Host", b"gw:8000"),
                (b"Content-Type", b"application/json"),
                (b"Content-Length", b"2"),
            ],
            b"{}",
        ),
        ([(b"Content-Type", b"a"), (b"host", b"gw")], b""),
        ([(b"Host", b"gw"), (b"Content-Length", b"2, 2"), (b"content-length", b"2")], b"ab"),
        ([(b"Host", b"gw"), (b"Transfer-Encoding", b"Chunked")], b"abc"),
        ([(b"Host", b"gw"), (b"Transfer-Encoding", b"chunked")], b""),
        (
            [(b"Host", b"gw"), (b"Connection", b"keep-alive, Close"), (b"Content-Length", b"1")],
            b"x",
        ),
        ([(b"Host", b"gw"), (b"X", b"caf\xe9 \t au lait"), (b"Content-Length", b"0")], b""),
    ]
    for headers, body in cases:
        conn = h11.Connection(h11.CLIENT)
        wire = conn.send(h11.Request(method=b"POST", target=b"/v1/x?y=1", headers=headers)) or b""
        wire += conn.send(h11.Data(data=body)) or b""
        wire += conn.send(h11.EndOfMessage()) or b""
        assert serialise_post(b"/v1/x?y=1", headers, body) == (
            wire,
            conn.our_state is h11.DONE,
        ), headers


@pytest.mark.parametrize(
    ("headers", "body"),
    [
        ([(b"Host", b"gw"), (b"X", b"bad\n")], b""),
        ([(b"Host", b"gw"), (b"bad\n", b"x")], b""),
        ([(b"Host", b"gw"), (b"X", b"a\rb")], b""),
        ([(b"Host", b"gw"), (b"X", b"a\x00b")], b""),
        ([(b"Host", b"gw"), (b"X", b" padded")], b""),
        ([(b"Host", b"gw"), (b"X Y", b"z")], b""),
        ([(b"Host", b"gw"), (b"", b"z")], b""),
        ([(b"X", b"no host")], b""),
        ([(b"Host", b"a"), (b"Host", b"b")], b""),
        ([(b"Host", b"gw"), (b"Content-Length", b"3")], b"ab"),
        ([(b"Host", b"gw"), (b"Content-Length", b"1")], b"ab"),
        ([(b"Host", b"gw"), (b"Content-Length", b"1, 2")], b"a"),
        ([(b"Host", b"gw"), (b"Content-Length", b"1"), (b"Content-Length", b"2")], b"a"),
        ([(b"Host", b"gw"), (b"Content-Length", b"-1")], b""),
        ([(b"Host", b"gw"), (b"Transfer-Encoding", b"gzip")], b""),
        ([(b"Host", b"gw"), (b"Transfer-Encoding", b"chunked")] * 2, b""),
    ],
)
def test_request_refused_where_h11_refused(headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    def h11_send() -> None:
        conn = h11.Connection(h11.CLIENT)
        conn.send(h11.Request(method=b"POST", target=b"/", headers=headers))
        conn.send(h11.Data(data=body))
        conn.send(h11.EndOfMessage())

    with pytest.raises(h11.LocalProtocolError):
        h11_send()
    with pytest.raises(ProtocolError):
        serialise_post(b"/", headers, body)
