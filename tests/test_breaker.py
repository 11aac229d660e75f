"""Gateway outages (docs/dispatch.md#the-gateway-is-unreachable): an attempt that could not
reach the gateway is handed back, not recorded; a per-queue breaker stops claiming, says so
once, shows in ``/readyz`` and a metric, and probes until the gateway answers.

Every gateway here is real: a closed local port, a name under ``.invalid``, a TCP listener
speaking garbage, a TLS server with a certificate nobody trusts, a listener whose backlog is
full, raw servers that read the request and then hang or reset, and ``claimkit sim``."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import ssl
import struct
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import trio
import trustme
from support import closed_port, free_port, make_config, server_now

from claimkit.config import QueueConfig
from claimkit.consumer import http as _http
from claimkit.consumer.breaker import (
    PROBE_MAX_SECONDS,
    UNSENT_THRESHOLD,
    GatewayBreaker,
    host_port,
    reached_gateway,
)
from claimkit.consumer.consumer import Consumer
from claimkit.consumer.dispatch import Done, Retry, Target, Unsent, dispatch, open_http_client
from claimkit.consumer.metrics import Metrics
from claimkit.dev.sim import SimConfig, serve_sim
from claimkit.producer import Producer
from claimkit.protocol.models import Envelope, ErrorCode, TerminalRecord, parse_member

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable

    from claimkit.config import Config
    from claimkit.consumer.http import HttpClient
    from claimkit.store import Store

TIMEOUT = 10.0
PREFIX = "Failed to send request to inference: "
CLAIMKIT = str(Path(sys.executable).with_name("claimkit"))
Q = "requests"
LABELS = {"queue_id": Q, "queue_name": Q, "pool_name": ""}


def make_env(rid: str = "req-1", deadline: float | None = None) -> Envelope:
    doc = {
        "internal": {"retry_count": 0},
        "request_kind": "plain",
        "data": {"id": rid, "deadline": deadline or int(time.time()) + 1000, "payload": {}},
    }
    env = parse_member(json.dumps(doc).encode())
    assert isinstance(env, Envelope)
    return env


@pytest.fixture
async def client() -> AsyncIterator[HttpClient]:
    async with open_http_client(4) as c:
        yield c


async def attempt(client: HttpClient, url: str, *, request_timeout: float = 5) -> object:
    with trio.fail_after(TIMEOUT):
        return await dispatch(
            client, make_env(), Target(url), request_timeout=request_timeout, now=time.time()
        )


class Listener:
    """A raw TCP server on 127.0.0.1 running ``act(stream, received)`` per connection;
    ``received`` collects every byte each connection sent."""

    def __init__(self) -> None:
        self.received: list[bytearray] = []
        self.port = 0


async def start_listener(
    nursery: trio.Nursery, act: Callable[[trio.SocketStream, bytearray], Awaitable[None]]
) -> Listener:
    listener = Listener()

    async def handler(stream: trio.SocketStream) -> None:
        got = bytearray()
        listener.received.append(got)
        try:
            await act(stream, got)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    listeners = await nursery.start(partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    listener.port = listeners[0].socket.getsockname()[1]
    return listener


async def read_request(stream: trio.SocketStream, got: bytearray) -> None:
    """Read until the whole request (head and its Content-Length body) has arrived."""
    while True:
        head, sep, rest = bytes(got).partition(b"\r\n\r\n")
        if sep:
            length = int(re.search(rb"Content-Length: (\d+)", head)[1])  # type: ignore[index]
            if len(rest) >= length:
                return
        chunk = await stream.receive_some(65536)
        if not chunk:
            return
        got += chunk


# -- which failures are "not sent" --------------------------------------------------------


async def test_connection_refused_is_unsent(client: HttpClient) -> None:
    port = closed_port()
    out = await attempt(client, f"http://127.0.0.1:{port}")
    assert out == Unsent(f"all attempts to connect to 127.0.0.1:{port} failed (Connection refused)")


async def test_a_name_that_does_not_resolve_is_unsent(client: HttpClient) -> None:
    with pytest.raises(socket.gaierror) as info:
        socket.getaddrinfo("gateway.invalid", 80)
    out = await attempt(client, "http://gateway.invalid/prefix")
    assert out == Unsent(f"cannot resolve gateway.invalid: {info.value.strerror}")


async def test_a_tls_handshake_with_a_plain_tcp_listener_is_unsent(
    nursery: trio.Nursery, client: HttpClient
) -> None:
    """The listener answers the ClientHello with garbage: the handshake fails, and what it
    received is a TLS record only, no byte of the request."""

    async def garbage(stream: trio.SocketStream, got: bytearray) -> None:
        got += await stream.receive_some(65536)
        await stream.send_all(b"HTTP/1.1 400 Bad Request\r\n\r\nthis is not TLS\r\n")
        await stream.aclose()

    listener = await start_listener(nursery, garbage)
    out = await attempt(client, f"https://127.0.0.1:{listener.port}")
    assert isinstance(out, Unsent)
    assert re.fullmatch(
        rf"TLS handshake with 127\.0\.0\.1:{listener.port} failed: "
        r"\[SSL: (WRONG_VERSION_NUMBER|RECORD_LAYER_FAILURE|PACKET_LENGTH_TOO_LONG)\] .*",
        out.reason,
    ), out.reason
    [got] = listener.received
    assert got[:1] == b"\x16"  # a TLS handshake record: the ClientHello
    assert b"POST" not in got
    assert b"Content-Length" not in got


async def test_a_certificate_that_does_not_verify_is_unsent(
    nursery: trio.Nursery, client: HttpClient
) -> None:
    """A gateway whose certificate the system store does not trust: nothing is sent."""
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    requests: list[bytes] = []

    async def handler(stream: trio.SSLStream[trio.SocketStream]) -> None:
        try:
            requests.append(bytes(await stream.receive_some(65536)))
        except trio.BrokenResourceError:
            pass

    listeners = await nursery.start(
        partial(trio.serve_ssl_over_tcp, handler, 0, server_ctx, host="127.0.0.1")
    )
    port = listeners[0].transport_listener.socket.getsockname()[1]
    out = await attempt(client, f"https://127.0.0.1:{port}")
    assert isinstance(out, Unsent)
    assert out.reason.startswith(
        f"TLS handshake with 127.0.0.1:{port} failed: [SSL: CERTIFICATE_VERIFY_FAILED]"
    ), out.reason
    assert requests == []


@pytest.fixture
def full_backlog() -> Any:
    """A port whose listen backlog is full: a further connect gets no answer to its SYN
    (Linux drops it), so connecting times out."""
    with socket.socket() as server, socket.socket() as queued:
        server.bind(("127.0.0.1", 0))
        server.listen(0)
        port = server.getsockname()[1]
        queued.connect(("127.0.0.1", port))  # fills the backlog of one; never accepted
        yield port


async def test_a_connect_timeout_is_unsent_unless_the_deadline_cut_it(
    client: HttpClient, full_backlog: int
) -> None:
    out = await attempt(client, f"http://127.0.0.1:{full_backlog}", request_timeout=0.3)
    assert out == Unsent("timed out connecting after 0.3 s")
    # The time left to the deadline was the limit: the deadline ended it, as before.
    env = make_env(deadline=2_000_000_000)
    with trio.fail_after(TIMEOUT):
        out = await dispatch(
            client,
            env,
            Target(f"http://127.0.0.1:{full_backlog}"),
            request_timeout=300,
            now=env.deadline - 0.3,
        )
    assert out == Done(
        TerminalRecord.error("req-1", ErrorCode.DEADLINE_EXCEEDED, "deadline exceeded")
    )


async def test_a_response_timeout_after_sending_stays_inference_error(
    nursery: trio.Nursery, client: HttpClient
) -> None:
    async def silent(stream: trio.SocketStream, got: bytearray) -> None:
        await read_request(stream, got)
        await trio.sleep_forever()

    listener = await start_listener(nursery, silent)
    out = await attempt(client, f"http://127.0.0.1:{listener.port}", request_timeout=0.3)
    assert out == Done(
        TerminalRecord.error(
            "req-1", ErrorCode.INFERENCE_ERROR, PREFIX + "no response within 0.3 s"
        ),
        unanswered=True,
    )
    [got] = listener.received
    assert got.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert got.endswith(b"\r\n\r\n{}")


async def test_a_reset_after_the_request_was_written_stays_inference_error(
    nursery: trio.Nursery, client: HttpClient
) -> None:
    async def reset(stream: trio.SocketStream, got: bytearray) -> None:
        await read_request(stream, got)
        # SO_LINGER 0: the close sends a RST, not a FIN.
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        stream.socket.close()

    listener = await start_listener(nursery, reset)
    out = await attempt(client, f"http://127.0.0.1:{listener.port}")
    assert isinstance(out, Done)
    assert out.unanswered
    assert out.record.error_code == ErrorCode.INFERENCE_ERROR
    assert out.record.error_message == (
        PREFIX + "connection broke: socket connection broken: [Errno 104] Connection reset by peer"
    )
    [got] = listener.received
    assert got.endswith(b"\r\n\r\n{}")  # the whole request had arrived


async def test_probe_connects_and_sends_nothing(nursery: trio.Nursery) -> None:
    async def record(stream: trio.SocketStream, got: bytearray) -> None:
        while chunk := await stream.receive_some(65536):
            got += chunk

    listener = await start_listener(nursery, record)
    with trio.fail_after(TIMEOUT):
        await _http.probe(f"http://user:secret@127.0.0.1:{listener.port}/v1", 5)
        while not listener.received:
            await trio.sleep(0.01)
        await trio.sleep(0.05)  # give a stray byte the chance to arrive
    assert listener.received == [bytearray()]
    port = closed_port()
    with pytest.raises(_http.ConnectError, match=f"127.0.0.1:{port} failed"):
        await _http.probe(f"http://127.0.0.1:{port}", 5)


# -- the breaker itself ---------------------------------------------------------------------


def metrics_for(queue: str = Q) -> tuple[Metrics, Any]:
    metrics = Metrics()
    return metrics, metrics.for_queue(QueueConfig(queue_name=queue, igw_base_url="http://gw"))


def gauge(metrics: Metrics, queue: str = Q) -> float | None:
    labels = {"queue_id": queue, "queue_name": queue, "pool_name": ""}
    return metrics.registry.get_sample_value("llm_d_async_async_gateway_breaker_open", labels)


def test_host_port_never_shows_user_info_or_path() -> None:
    assert host_port("https://u:pw@gw.example/prefix") == "gw.example:443"
    assert host_port("http://gw.example") == "gw.example:80"
    assert host_port("http://[::1]:8000/v1") == "[::1]:8000"


def test_reached_gateway() -> None:
    assert reached_gateway(Retry(1.0, None))
    assert reached_gateway(Done(TerminalRecord.http("a", 503, "x")))
    assert reached_gateway(Done(TerminalRecord.error("a", ErrorCode.INFERENCE_ERROR, "x"), True))
    assert not reached_gateway(Done(TerminalRecord.error("a", ErrorCode.INFERENCE_ERROR, "x")))
    assert not reached_gateway(
        Done(TerminalRecord.error("a", ErrorCode.DEADLINE_EXCEEDED, "deadline exceeded"))
    )
    assert not reached_gateway(Unsent("refused"))


async def test_opens_after_the_threshold_with_one_warning_and_an_answer_closes_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    metrics, qm = metrics_for()
    breaker = GatewayBreaker(Q, "http://u:pw@gw.example:8000/v1", qm)
    assert gauge(metrics) == 0.0
    with caplog.at_level(logging.INFO, logger="claimkit"):
        for _ in range(UNSENT_THRESHOLD - 1):
            breaker.note(Unsent("refused"))
        breaker.note(Done(TerminalRecord.http("a", 500, "x")))  # an answer resets the count
        for _ in range(UNSENT_THRESHOLD - 1):
            breaker.note(Unsent("refused"))
        assert not breaker.is_open
        # a deadline or a cancel says nothing about the gateway: the count goes on
        breaker.note(Done(TerminalRecord.error("a", ErrorCode.DEADLINE_EXCEEDED, "x")))
        breaker.note(Unsent("refused again"))
        assert breaker.is_open
        assert gauge(metrics) == 1.0
        for _ in range(5):
            breaker.note(Unsent("refused again"))
        breaker.note(Done(TerminalRecord.http("a", 429, "x")))
        assert not breaker.is_open
        assert gauge(metrics) == 0.0
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "claimkit"]
    assert lines[0] == (
        "WARNING",
        "claimkit: gateway for queue requests (gw.example:8000) is unreachable: refused "
        "again; claiming from requests is paused until it answers",
    )
    assert len(lines) == 2
    assert lines[1][0] == "INFO"
    assert re.fullmatch(
        r"claimkit: gateway for queue requests \(gw\.example:8000\) answers again "
        r"\(a request was answered\) after \d+\.\d s; claiming resumes",
        lines[1][1],
    )


async def test_probes_back_off_until_one_connects(autojump_clock: trio.testing.MockClock) -> None:
    probes: list[tuple[float, str, float]] = []

    async def probe(url: str, timeout: float) -> None:
        probes.append((trio.current_time(), url, timeout))
        if len(probes) < 7:
            raise _http.ConnectError("refused")

    _, qm = metrics_for()
    breaker = GatewayBreaker(Q, "http://gw:1", qm, probe=probe)
    await breaker.probe_until_answered()  # closed: returns at once
    assert probes == []
    for _ in range(UNSENT_THRESHOLD):
        breaker.unsent("refused")
    start = trio.current_time()
    await breaker.probe_until_answered()
    assert not breaker.is_open
    waits = [round(t - start, 3) for t, _, _ in probes]
    assert waits == [0.5, 1.5, 3.5, 7.5, 12.5, 17.5, 22.5]  # 0.5 doubling, capped at 5 s
    assert PROBE_MAX_SECONDS == 5.0
    assert {(url, timeout) for _, url, timeout in probes} == {("http://gw:1", 5.0)}


# -- a consumer against a gateway that is down ---------------------------------------------


def consumer_config(redis_url: str, gateway: str, **overrides: Any) -> Config:
    fields: dict[str, Any] = {
        "poll_interval_ms": 20,
        "claim_lease_ttl_seconds": 30,
        "metrics_port": 0,
        "health_port": 0,
        "drain_timeout_seconds": 1,
    }
    return make_config(redis_url, queue=Q, gateway=gateway, **(fields | overrides))


def sample(consumer: Consumer, name: str) -> float | None:
    return consumer.metrics.registry.get_sample_value(f"llm_d_async_{name}", LABELS)


async def test_an_outage_hands_requests_back_and_the_deadline_still_ends_them(
    store: Store, redis_url: str, nursery: trio.Nursery
) -> None:
    """While the gateway is down: no record, the members back in pending byte for byte at
    their scores (no retry count, no delivery), ``/readyz`` not ready. A request whose
    deadline passed meanwhile ends DEADLINE_EXCEEDED once claiming resumes; the other is
    answered."""
    port = free_port()
    consumer = Consumer(consumer_config(redis_url, f"http://127.0.0.1:{port}"), store)
    now = int(await server_now(store))
    producer = Producer(store, Q)
    soon_token = await producer.submit(
        {"id": "soon", "deadline": now + 3, "payload": {"id": "soon"}}
    )
    await producer.submit({"id": "late", "deadline": now + 600, "payload": {"id": "late"}})
    before = await store.command("ZRANGE", Q, 0, -1, "WITHSCORES")
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            await n.start(consumer.run)
            while not consumer.queues[0].breaker.is_open:
                await trio.sleep(0.01)
            assert consumer.ready() == (False, "gateway unreachable: requests")
            # every claim handed back: pending as submitted, nothing claimed
            while await store.command("HLEN", f"{Q}:claimed"):
                await trio.sleep(0.01)
            assert await store.command("ZRANGE", Q, 0, -1, "WITHSCORES") == before
            assert await store.command("EXISTS", f"{Q}:deliveries", "retry-sortedset") == 0
            while await server_now(store) < now + 4:  # "soon" is now past its deadline
                await trio.sleep(0.05)
            assert await store.command("LLEN", "result-list") == 0
            await nursery.start(serve_sim, SimConfig(port=port))
            while await store.command("LLEN", "result-list") < 2:
                await trio.sleep(0.02)
            assert consumer.ready() == (True, "ok")
            consumer.request_stop()
    records = {
        r["id"]: r for r in map(json.loads, await store.command("LRANGE", "result-list", 0, -1))
    }
    assert records["soon"] == {
        "id": "soon",
        "payload": '{"error":"deadline exceeded"}',
        "error_code": "DEADLINE_EXCEEDED",
        "error_message": "deadline exceeded",
        "request_token": soon_token,
    }
    assert records["late"]["status_code"] == 200
    unsent = sample(consumer, "async_gateway_unsent_total")
    assert unsent is not None
    assert unsent >= UNSENT_THRESHOLD
    # every claim ended as a hand-back or a record
    assert sample(consumer, "async_request_total") == unsent + 2
    assert sample(consumer, "async_gateway_breaker_open") == 0.0
    assert sample(consumer, "async_request_retries_total") == 0.0
    assert consumer.summary.acked == 2
    assert consumer.summary.released == unsent


async def test_a_shutdown_while_the_breaker_is_open_leaves_every_request_pending(
    store: Store, redis_url: str
) -> None:
    consumer = Consumer(consumer_config(redis_url, f"http://127.0.0.1:{closed_port()}"), store)
    now = int(await server_now(store))
    await Producer(store, Q).submit_many([{"id": f"s{i}", "deadline": now + 600} for i in range(5)])
    before = await store.command("ZRANGE", Q, 0, -1, "WITHSCORES")
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            await n.start(consumer.run)
            while not consumer.queues[0].breaker.is_open:
                await trio.sleep(0.01)
            consumer.request_stop()
    assert await store.command("ZRANGE", Q, 0, -1, "WITHSCORES") == before
    assert await store.command("HLEN", f"{Q}:claimed") == 0
    assert await store.command("LLEN", "result-list") == 0
    assert consumer.summary.acked == 0
    assert consumer.summary.claimed == consumer.summary.released


# -- the acceptance run: `claimkit serve` with the gateway port closed, then opened ----------


def scrape(text: str, name: str) -> float:
    [value] = re.findall(
        rf'^llm_d_async_{name}{{pool_name="",queue_id="{Q}",queue_name="{Q}"}} (\S+)$',
        text,
        re.MULTILINE,
    )
    return float(value)


@pytest.mark.slow
async def test_gateway_closed_then_opened(redis_url: str, store: Store, tmp_path: Path) -> None:
    """serve's gateway port is closed while the breaker opens and for 3 s more, then
    ``claimkit sim`` starts on it: no record during the outage, ``/readyz`` 503 all along,
    one WARNING; afterwards every request has exactly one 200 record and the breaker
    metric is back to 0."""
    n = 30
    gport, mport, hport = free_port(), free_port(), free_port()
    config = {
        "poll_interval_ms": 50,
        "metrics_port": mport,
        "health_port": hport,
        "queues": [{"queue_name": Q, "igw_base_url": f"http://127.0.0.1:{gport}"}],
    }
    log = tmp_path / "serve.log"
    now = int(await server_now(store))
    ids = [f"o{i:02d}" for i in range(n)]
    await Producer(store, Q).submit_many(
        [{"id": rid, "deadline": now + 600, "payload": {"id": rid}} for rid in ids]
    )
    env = {**os.environ, "REDIS_URL": redis_url}
    with log.open("w") as err:
        proc = subprocess.Popen(
            [CLAIMKIT, "serve", "--transport-config", json.dumps(config), "--concurrency", "8"],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=env,
        )
    sim: subprocess.Popen[bytes] | None = None
    readyz = f"http://127.0.0.1:{hport}/readyz"
    try:
        async with httpx.AsyncClient() as http:
            with trio.fail_after(30):
                while True:  # the breaker opens: /readyz says so
                    assert proc.poll() is None, log.read_text()
                    try:
                        ready = await http.get(readyz)
                    except httpx.TransportError:
                        ready = None
                    # (before Redis first answers, /readyz is 503 "redis unavailable")
                    if ready is not None and ready.text == "gateway unreachable: requests\n":
                        break
                    await trio.sleep(0.05)
            assert ready.text == "gateway unreachable: requests\n"
            outage_end = trio.current_time() + 3
            while trio.current_time() < outage_end:  # the outage goes on
                assert await store.command("LLEN", "result-list") == 0
                ready = await http.get(readyz)
                assert (ready.status_code, ready.text) == (503, "gateway unreachable: requests\n")
                await trio.sleep(0.1)
            assert await store.command("LLEN", "result-list") == 0
            metrics = (await http.get(f"http://127.0.0.1:{mport}/metrics")).text
            assert scrape(metrics, "async_gateway_breaker_open") == 1.0
            with (tmp_path / "sim.log").open("w") as out:
                sim = subprocess.Popen(
                    [CLAIMKIT, "sim", "--port", str(gport)], stdout=out, stderr=subprocess.STDOUT
                )
            with trio.fail_after(60):
                while await store.command("LLEN", "result-list") < n:
                    assert sim.poll() is None, (tmp_path / "sim.log").read_text()
                    await trio.sleep(0.05)
                while (ready := await http.get(readyz)).status_code != 200:
                    await trio.sleep(0.05)
            assert ready.text == "ok\n"
            metrics = (await http.get(f"http://127.0.0.1:{mport}/metrics")).text
        records = [json.loads(r) for r in await store.command("LRANGE", "result-list", 0, -1)]
        assert sorted(r["id"] for r in records) == ids  # exactly one record each
        assert {r["status_code"] for r in records} == {200}
        assert {r["id"]: json.loads(r["payload"])["id"] for r in records} == {i: i for i in ids}
        assert scrape(metrics, "async_gateway_breaker_open") == 0.0
        unsent = scrape(metrics, "async_gateway_unsent_total")
        assert unsent >= UNSENT_THRESHOLD
        assert scrape(metrics, "async_request_total") == n + unsent
        assert scrape(metrics, "async_successful_requests_total") == n
        proc.send_signal(signal.SIGTERM)
        assert await trio.to_thread.run_sync(proc.wait, 30) == 0
    finally:
        for p in (proc, sim):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)
    text = log.read_text()
    warnings = [line for line in text.splitlines() if " WARNING " in line]
    assert len(warnings) == 1, text
    assert warnings[0].endswith(
        f"WARNING claimkit: gateway for queue requests (127.0.0.1:{gport}) is unreachable: "
        f"all attempts to connect to 127.0.0.1:{gport} failed (Connection refused); claiming "
        "from requests is paused until it answers"
    ), text
    assert len(re.findall(r"INFO claimkit: gateway for queue requests .* answers again", text)) == 1
