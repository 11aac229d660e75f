"""claimkit's own HTTP/1.1 client (``claimkit.consumer.http``) over real sockets.

Against the simulator (hypercorn) and small raw trio servers that misbehave on purpose:
connection reuse, a server closing idle connections, timeouts in each phase, partial and
chunked bodies, the pool limit, and cancellation.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial

import pytest
import trio
import trio.testing

from claimkit.consumer.http import (
    KEEPALIVE_EXPIRY_SECONDS,
    BodyError,
    ConnectError,
    HttpClient,
    InvalidURL,
    NoResponse,
    PoolTimeout,
    ReadTimeout,
    RemoteProtocolError,
    _keep_for,
)
from claimkit.dev.sim import SimApp, SimConfig, serve_sim

TIMEOUT = 10.0
JSON = [(b"Content-Type", b"application/json")]

Handler = Callable[[trio.SocketStream], Awaitable[None]]


async def start_raw(nursery: trio.Nursery, handler: Handler) -> str:
    listeners = await nursery.start(partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    return f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"


async def read_request(stream: trio.SocketStream, buf: bytearray) -> bytes | None:
    """Read one request (head + Content-Length body) from ``buf``/``stream``; None on EOF."""
    while b"\r\n\r\n" not in buf:
        chunk = await stream.receive_some(65536)
        if not chunk:
            return None
        buf += chunk
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(rest) < length:
        chunk = await stream.receive_some(65536)
        if not chunk:
            return None
        rest += chunk
    del buf[: len(head) + 4 + length]
    return head


async def idle_connections_closed_by_server(client: HttpClient) -> None:
    """Poll until the server's FIN has reached every idle connection of ``client`` (a
    written request is never re-sent, so a test must not race it; fail_after bounds it)."""
    while not all(c.readable() for conns in client._idle.values() for c in conns):
        await trio.sleep(0.01)


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


async def test_simulator_round_trip_and_reuse(nursery: trio.Nursery) -> None:
    app = SimApp(SimConfig())
    with trio.fail_after(TIMEOUT):
        url = await nursery.start(partial(serve_sim, SimConfig(), app=app))
        async with HttpClient(max_connections=4) as client:
            for i in range(5):
                r = await client.post(
                    url + "/v1/completions", b'{"id": "r%d"}' % i, JSON, timeout=5
                )
                assert r.status == 200
                assert r.header("Content-Type") == "application/json"
                assert '"text_completion"' in r.text or "choices" in r.text
            # Sequential requests share one kept-alive connection.
            assert client.connections_opened == 1
            assert client.idle_count() == 1
        assert client.is_closed
        assert client.idle_count() == 0
    assert app.stats()["calls_by_id"] == {f"r{i}": 1 for i in range(5)}


async def test_concurrent_requests_open_up_to_the_limit(nursery: trio.Nursery) -> None:
    config = SimConfig(latency=(0.05, 0.05))
    with trio.fail_after(TIMEOUT):
        url = await nursery.start(partial(serve_sim, config, app=SimApp(config)))
        async with HttpClient(max_connections=3) as client:
            statuses: list[int] = []

            async def one() -> None:
                statuses.append(
                    (await client.post(url + "/v1/completions", b"{}", JSON, timeout=5)).status
                )

            async with trio.open_nursery() as n:
                for _ in range(9):
                    n.start_soon(one)
            assert statuses == [200] * 9
            assert client.connections_opened == 3
            assert client.idle_count() == 3


async def test_server_closing_idle_connection_is_not_reused(nursery: trio.Nursery) -> None:
    """The server answers one request per connection, then closes it (as an idle timeout
    would): the client notices before reuse and opens a fresh one."""
    accepted = 0

    async def handler(stream: trio.SocketStream) -> None:
        nonlocal accepted
        accepted += 1
        async with stream:
            if await read_request(stream, bytearray()) is not None:
                await stream.send_all(ok(b"fine"))

    with trio.fail_after(TIMEOUT):
        url = await start_raw(nursery, handler)
        async with HttpClient(max_connections=2) as client:
            for _ in range(3):
                r = await client.post(url + "/x", b"{}", JSON, timeout=5)
                assert (r.status, r.body) == (200, b"fine")
                await idle_connections_closed_by_server(client)
    assert accepted == 3


async def test_request_read_then_dropped_is_not_sent_again(nursery: trio.Nursery) -> None:
    """The gateway reads the whole second request on a kept-alive connection, then hangs up
    without answering. It may be running it: the client must not send it again (it used to,
    on a fresh connection, taking this for the keep-alive race)."""
    arrivals: list[int] = []  # per connection, requests read in full

    async def handler(stream: trio.SocketStream) -> None:
        async with stream:
            buf = bytearray()
            arrivals.append(0)
            idx = len(arrivals) - 1
            while await read_request(stream, buf) is not None:
                arrivals[idx] += 1
                if arrivals[idx] == 2:
                    return  # read it all, then hang up without answering
                await stream.send_all(ok(b"n%d" % arrivals[idx]))

    with trio.fail_after(TIMEOUT):
        url = await start_raw(nursery, handler)
        async with HttpClient(max_connections=1) as client:
            assert (await client.post(url, b"{}", JSON, timeout=5)).body == b"n1"
            with pytest.raises(RemoteProtocolError, match="without a response") as info:
                await client.post(url, b"{}", JSON, timeout=5)
            assert isinstance(info.value, NoResponse)
            assert client.connections_opened == 1
            assert client.idle_count() == 0
    assert arrivals == [2]  # one arrival per request: nothing was sent twice


async def test_idle_connection_closed_by_server_is_replaced_before_writing(
    nursery: trio.Nursery,
) -> None:
    """The server closes a kept-alive connection while it is idle (its keep-alive timeout):
    the client sees the EOF before writing, and sends the request once, on a fresh
    connection."""
    arrivals: list[int] = []
    closed = trio.Event()

    async def handler(stream: trio.SocketStream) -> None:
        async with stream:
            buf = bytearray()
            arrivals.append(0)
            idx = len(arrivals) - 1
            while await read_request(stream, buf) is not None:
                arrivals[idx] += 1
                await stream.send_all(ok(b"c%d" % idx))
                if idx == 0:
                    break  # close the idle connection after its first exchange
        if idx == 0:
            closed.set()

    with trio.fail_after(TIMEOUT):
        url = await start_raw(nursery, handler)
        async with HttpClient(max_connections=1) as client:
            assert (await client.post(url, b"{}", JSON, timeout=5)).body == b"c0"
            assert client.idle_count() == 1
            await closed.wait()
            await idle_connections_closed_by_server(client)
            assert (await client.post(url, b"{}", JSON, timeout=5)).body == b"c1"
            assert client.connections_opened == 2
    assert arrivals == [1, 1]


async def test_idle_connection_past_its_expiry_is_not_reused(nursery: trio.Nursery) -> None:
    async def handler(stream: trio.SocketStream) -> None:
        async with stream:
            buf = bytearray()
            while await read_request(stream, buf) is not None:
                await stream.send_all(ok(b"fine"))

    assert HttpClient(max_connections=1).keepalive_expiry == KEEPALIVE_EXPIRY_SECONDS == 1.5
    with trio.fail_after(TIMEOUT):
        url = await start_raw(nursery, handler)
        async with HttpClient(max_connections=1, keepalive_expiry=1.0) as client:
            await client.post(url, b"{}", JSON, timeout=5)
            await client.post(url, b"{}", JSON, timeout=5)  # at once: reused
            assert client.connections_opened == 1
            await trio.sleep(1.1)  # older than keepalive_expiry now
            await client.post(url, b"{}", JSON, timeout=5)
            assert client.connections_opened == 2


async def test_fresh_connection_closed_without_response_is_an_error(
    nursery: trio.Nursery,
) -> None:
    async def handler(stream: trio.SocketStream) -> None:
        async with stream:
            await read_request(stream, bytearray())

    with trio.fail_after(TIMEOUT):
        url = await start_raw(nursery, handler)
        async with HttpClient(max_connections=1) as client:
            with pytest.raises(RemoteProtocolError, match="without a response"):
                await client.post(url, b"{}", JSON, timeout=5)
            assert client.idle_count() == 0


async def test_partial_body_is_a_body_error_with_status(nursery: trio.Nursery) -> None:
    async def handler(stream: trio.SocketStream) -> None:
        async with stream:
            await read_request(stream, bytearray())
            await stream.send_all(
                b"HTTP/1.1 503 Busy\r\nRetry-After: 7\r\nContent-Length: 100\r\n\r\npartial"
            )

    with trio.fail_after(TIMEOUT):
        url = await start_raw(nursery, handler)
        async with HttpClient(max_connections=1) as client:
            with pytest.raises(BodyError) as info:
                await client.post(url, b"{}", JSON, timeout=5)
            assert info.value.status == 503
            assert (b"retry-after", b"7") in info.value.headers
            assert not info.value.timed_out
            assert client.idle_count() == 0  # a broken connection is never pooled


async def test_body_that_never_finishes_times_out_as_body_error(nursery: trio.Nursery) -> None:
    async def handler(stream: trio.SocketStream) -> None:
        async with stream:
            await read_request(stream, bytearray())
            await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npart")
            await trio.sleep_forever()

    with trio.fail_after(TIMEOUT):
        url = await start_raw(nursery, handler)
        async with HttpClient(max_connections=1) as client:
            started = trio.current_time()
            with pytest.raises(BodyError, match=r"body not complete within 0\.2 s") as info:
                await client.post(url, b"{}", JSON, timeout=0.2)
            assert 0.2 <= trio.current_time() - started < 2
            assert info.value.status == 200
            assert info.value.timed_out


async def test_no_response_times_out(nursery: trio.Nursery) -> None:
    async def handler(stream: trio.SocketStream) -> None:
        async with stream:
            await trio.sleep_forever()

    with trio.fail_after(TIMEOUT):
        url = await start_raw(nursery, handler)
        async with HttpClient(max_connections=1) as client:
            with pytest.raises(ReadTimeout, match=r"no response within 0\.2 s"):
                await client.post(url, b"{}", JSON, timeout=0.2)


async def test_pool_timeout_when_every_connection_is_busy(nursery: trio.Nursery) -> None:
    async def handler(stream: trio.SocketStream) -> None:
        async with stream:
            await read_request(stream, bytearray())
            await trio.sleep(0.5)
            await stream.send_all(ok(b"slow"))

    with trio.fail_after(TIMEOUT):
        url = await start_raw(nursery, handler)
        async with HttpClient(max_connections=1) as client:
            async with trio.open_nursery() as n:
                n.start_soon(partial(client.post, url, b"{}", JSON, timeout=5))
                await trio.testing.wait_all_tasks_blocked()
                with pytest.raises(PoolTimeout, match=r"no free connection within 0\.1 s"):
                    await client.post(url, b"{}", JSON, timeout=0.1)


async def test_chunked_body_and_informational_response(nursery: trio.Nursery) -> None:
    async def handler(stream: trio.SocketStream) -> None:
        async with stream:
            buf = bytearray()
            while await read_request(stream, buf) is not None:
                await stream.send_all(
                    b"HTTP/1.1 100 Continue\r\n\r\n"
                    b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n"
                    b"Content-Type: text/plain; charset=latin-1\r\n\r\n"
                    b"3\r\ncaf\r\n1\r\n\xe9\r\n0\r\n\r\n"
                )

    with trio.fail_after(TIMEOUT):
        url = await start_raw(nursery, handler)
        async with HttpClient(max_connections=1) as client:
            for _ in range(2):
                r = await client.post(url, b"{}", JSON, timeout=5)
                assert (r.status, r.body, r.text) == (201, b"caf\xe9", "café")
            assert client.connections_opened == 1


async def test_connection_close_response_is_not_pooled(nursery: trio.Nursery) -> None:
    async def handler(stream: trio.SocketStream) -> None:
        async with stream:
            await read_request(stream, bytearray())
            await stream.send_all(ok(b"bye", b"Connection: close\r\n"))

    with trio.fail_after(TIMEOUT):
        url = await start_raw(nursery, handler)
        async with HttpClient(max_connections=1) as client:
            assert (await client.post(url, b"{}", JSON, timeout=5)).body == b"bye"
            assert client.idle_count() == 0


async def test_request_on_the_wire(nursery: trio.Nursery) -> None:
    heads: list[bytes] = []

    async def handler(stream: trio.SocketStream) -> None:
        async with stream:
            head = await read_request(stream, bytearray())
            assert head is not None
            heads.append(head)
            await stream.send_all(ok(b""))

    with trio.fail_after(TIMEOUT):
        url = await start_raw(nursery, handler)
        async with HttpClient(max_connections=1) as client:
            await client.post(url + "/a b/ü?q=x y", b"{}", JSON, timeout=5)
    lines = heads[0].split(b"\r\n")
    assert lines[0] == b"POST /a%20b/%C3%BC?q=x%20y HTTP/1.1"
    assert b"User-Agent: claimkit" in lines
    assert b"Content-Length: 2" in lines
    assert any(line.startswith(b"Host: 127.0.0.1:") for line in lines)


async def test_errors_before_any_connection() -> None:
    with trio.fail_after(TIMEOUT):
        async with HttpClient(max_connections=1) as client:
            with pytest.raises(InvalidURL, match="unsupported protocol 'ftp://'"):
                await client.post("ftp://x/y", b"", [], timeout=1)
            with pytest.raises(InvalidURL, match="invalid request"):
                await client.post("http://127.0.0.1:1/", b"", [(b"bad\n", b"x")], timeout=1)
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            with pytest.raises(ConnectError):
                await client.post(f"http://127.0.0.1:{port}/", b"", [], timeout=1)
        with pytest.raises(RuntimeError, match="closed"):
            await client.post("http://127.0.0.1:1/", b"", [], timeout=1)
    with pytest.raises(ValueError, match="at least 1"):
        HttpClient(max_connections=0)


async def test_cancelled_request_frees_its_slot_and_closes_its_connection(
    nursery: trio.Nursery,
) -> None:
    async def handler(stream: trio.SocketStream) -> None:
        async with stream:
            buf = bytearray()
            while await read_request(stream, buf) is not None:
                await trio.sleep(0.3)
                await stream.send_all(ok(b"late"))

    with trio.fail_after(TIMEOUT):
        url = await start_raw(nursery, handler)
        async with HttpClient(max_connections=1) as client:
            with trio.move_on_after(0.05):
                await client.post(url, b"{}", JSON, timeout=5)
            assert client.idle_count() == 0
            # The slot is free again: the next request goes through on a new connection.
            assert (await client.post(url, b"{}", JSON, timeout=5)).body == b"late"
            assert client.connections_opened == 2


@pytest.mark.parametrize(
    "after",
    [ok(b"stale"), b"garbage", b"HTTP/1.1 2"],
    ids=["a second response", "stray bytes", "half a head"],
)
async def test_bytes_after_the_response_close_the_connection(
    nursery: trio.Nursery, after: bytes
) -> None:
    """The server writes more than the answer in one go (a second response, stray bytes):
    the client must not keep the connection, or the next request would be handed those
    buffered bytes as its answer (the idle-readable check cannot see them)."""
    accepted = 0

    async def handler(stream: trio.SocketStream) -> None:
        nonlocal accepted
        accepted += 1
        conn = accepted
        async with stream:
            buf = bytearray()
            answered = 0
            while await read_request(stream, buf) is not None:
                answered += 1
                body = b"conn%d-answer%d" % (conn, answered)
                await stream.send_all(ok(body) + after if conn == 1 else ok(body))

    with trio.fail_after(TIMEOUT):
        url = await start_raw(nursery, handler)
        async with HttpClient(max_connections=1) as client:
            assert (await client.post(url, b"{}", JSON, timeout=5)).body == b"conn1-answer1"
            assert client.idle_count() == 0
            assert (await client.post(url, b"{}", JSON, timeout=5)).body == b"conn2-answer1"
            assert client.connections_opened == 2
            # A clean answer keeps its connection.
            assert (await client.post(url, b"{}", JSON, timeout=5)).body == b"conn2-answer2"
            assert client.connections_opened == 2


async def test_caller_connection_close_and_transfer_encoding(nursery: trio.Nursery) -> None:
    """Caller headers keep h11's meaning: ``Connection: close`` ends reuse after the
    exchange; ``Transfer-Encoding: chunked`` frames the body (no Content-Length added)."""
    raw: list[bytes] = []

    async def handler(stream: trio.SocketStream) -> None:
        async with stream:
            buf = b""
            while not buf.endswith((b"\r\n0\r\n\r\n", b"\r\n\r\n{}")):
                chunk = await stream.receive_some(65536)
                if not chunk:
                    return
                buf += chunk
            raw.append(buf)
            await stream.send_all(ok(b"fine"))
            await stream.receive_some(65536)  # the client closes, or sends the next one

    with trio.fail_after(TIMEOUT):
        url = await start_raw(nursery, handler)
        async with HttpClient(max_connections=1) as client:
            for _ in range(2):
                r = await client.post(url, b"{}", [(b"Connection", b"close")], timeout=5)
                assert r.body == b"fine"
                assert client.idle_count() == 0
            assert client.connections_opened == 2
            r = await client.post(url, b"{}", [(b"Transfer-Encoding", b"chunked")], timeout=5)
            assert r.body == b"fine"
    assert b"\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}" in raw[0]
    head, _, body = raw[2].partition(b"\r\n\r\n")
    assert b"Transfer-Encoding: chunked" in head.split(b"\r\n")
    assert b"content-length" not in head.lower()
    assert body == b"2\r\n{}\r\n0\r\n\r\n"


def keep_alive_server(hint: bytes) -> Handler:
    async def handler(stream: trio.SocketStream) -> None:
        async with stream:
            buf = bytearray()
            while await read_request(stream, buf) is not None:
                await stream.send_all(ok(b"fine", b"Keep-Alive: " + hint + b"\r\n"))

    return handler


async def test_keep_alive_hint_keeps_idle_connections_longer(nursery: trio.Nursery) -> None:
    """A server that says ``Keep-Alive: timeout=5`` keeps idle connections 5 s: the client
    keeps them up to 4 s, past its own default (here 0.5 s)."""
    with trio.fail_after(TIMEOUT):
        url = await start_raw(nursery, keep_alive_server(b"timeout=5, max=1000"))
        async with HttpClient(max_connections=1, keepalive_expiry=0.5) as client:
            await client.post(url, b"{}", JSON, timeout=5)
            await trio.sleep(0.7)  # past keepalive_expiry, within the hint
            await client.post(url, b"{}", JSON, timeout=5)
            assert client.connections_opened == 1


async def test_short_keep_alive_hint_drops_idle_connections_sooner(
    nursery: trio.Nursery,
) -> None:
    """``Keep-Alive: timeout=1``: kept 0.5 s (half the hint), below the 1.5 s default."""
    with trio.fail_after(TIMEOUT):
        url = await start_raw(nursery, keep_alive_server(b"timeout=1"))
        async with HttpClient(max_connections=1) as client:
            await client.post(url, b"{}", JSON, timeout=5)
            await trio.sleep(0.7)
            await client.post(url, b"{}", JSON, timeout=5)
            assert client.connections_opened == 2


async def test_keep_alive_timeout_zero_is_not_pooled(nursery: trio.Nursery) -> None:
    with trio.fail_after(TIMEOUT):
        url = await start_raw(nursery, keep_alive_server(b"timeout=0"))
        async with HttpClient(max_connections=1) as client:
            await client.post(url, b"{}", JSON, timeout=5)
            assert client.idle_count() == 0


@pytest.mark.parametrize(
    ("headers", "keep"),
    [
        ([], 1.5),
        ([(b"keep-alive", b"timeout=5")], 4.0),
        ([(b"keep-alive", b"max=100, Timeout=120")], 60.0),  # capped
        ([(b"keep-alive", b"timeout=1")], 0.5),
        ([(b"keep-alive", b"timeout=0")], 0.0),
        ([(b"keep-alive", b"timeout=soon")], 1.5),
        ([(b"keep-alive", b"timeout=-3")], 1.5),
        ([(b"keep-alive", b"max=5")], 1.5),
    ],
)
def test_keep_alive_hint_parsing(headers: list[tuple[bytes, bytes]], keep: float) -> None:
    assert _keep_for(headers, 1.5) == keep
