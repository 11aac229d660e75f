"""Dispatch (SPEC §4) against real HTTP servers: the simulator, a tiny ASGI app, a raw socket."""

from __future__ import annotations

import email.utils
import json
import math
import random
import time
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

import pytest
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve
from support import closed_port, make_config, server_now

from claimkit.consumer.consumer import Consumer
from claimkit.consumer.dispatch import (
    DEADLINE_MARGIN,
    Done,
    Retry,
    Target,
    Unsent,
    backoff_delay,
    build_headers,
    build_url,
    dispatch,
    open_http_client,
)
from claimkit.consumer.http import HttpClient
from claimkit.dev.sim import SimApp, SimConfig, serve_sim
from claimkit.producer import Producer
from claimkit.protocol.models import (
    LAST_RESPONSE_FIELD,
    LAST_RESPONSE_MAX_BYTES,
    Envelope,
    ErrorCode,
    TerminalRecord,
    parse_member,
    retry_member,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from claimkit.config import Config
    from claimkit.store import Store

TIMEOUT = 10.0  # absolute cap for every test, seconds
PREFIX = "Failed to send request to inference: "
SIM_429_BODY = (
    '{"error":{"message":"simulated rate limit","type":"rate_limit_exceeded",'
    '"param":null,"code":null}}'
)


def make_env(
    *,
    rid: str = "req-1",
    deadline: int | None = None,
    payload: Any = None,
    headers: dict[str, str] | None = None,
    metadata: dict[str, str] | None = None,
    endpoint: str | None = None,
    retry_count: int = 0,
) -> Envelope:
    data: dict[str, Any] = {
        "id": rid,
        "deadline": deadline if deadline is not None else int(time.time()) + 1000,
        "payload": payload,
    }
    if headers is not None:
        data["headers"] = headers
    if metadata is not None:
        data["metadata"] = metadata
    if endpoint is not None:
        data["endpoint"] = endpoint
    member = {"internal": {"retry_count": retry_count}, "request_kind": "plain", "data": data}
    env = parse_member(json.dumps(member).encode())
    assert isinstance(env, Envelope)
    return env


def expected_base(seed: int, attempt: int, seconds_left: float) -> tuple[float, random.Random]:
    """The first draw ``backoff_delay`` makes, replayed; returns the rng for further draws."""
    rng = random.Random(seed)
    t = min(60.0, seconds_left, 2.0 * 2.0**attempt)
    return t / 2 + rng.random() * (t / 2), rng


# -- servers -------------------------------------------------------------------------------


@dataclass
class Call:
    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes


@dataclass
class EdgeApp:
    """A tiny ASGI gateway with one route per edge case; it records every call."""

    calls: list[Call] = field(default_factory=list)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                event = await receive()
                if event["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        body = b""
        while True:
            event = await receive()
            body += event.get("body", b"")
            if not event.get("more_body", False):
                break
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
        path = scope["path"]
        self.calls.append(Call(scope["method"], path, headers, body))
        status, out, extra = edge_route(scope, headers, body)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-length", str(len(out)).encode()), *extra],
            }
        )
        await send({"type": "http.response.body", "body": out, "more_body": False})


# path -> (status, body, extra headers) of the fixed routes of EdgeApp.
FIXED_ROUTES: dict[str, tuple[int, bytes, list[tuple[bytes, bytes]]]] = {
    "/bad": (400, b'{"error":"prompt is required"}', []),
    "/boom": (500, b"boom", []),
    "/unavailable": (503, b"try later", []),
    "/redirect": (302, b"moved", [(b"location", b"/landed")]),
    "/landed": (200, b"landed", []),
}


def edge_route(
    scope: Any, headers: list[tuple[str, str]], body: bytes
) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
    """EdgeApp's answer to one request: ``(status, body, extra headers)``."""
    path = scope["path"]
    if path == "/created":
        out = '{"id": "x",  "text": "café" }\n'.encode()
        return 201, out, [(b"content-type", b"application/json; charset=utf-8")]
    if path == "/busy":
        query = parse_qs(scope["query_string"].decode())
        return (
            429,
            b"slow down",
            [(b"retry-after", query["ra"][0].encode())] if "ra" in query else [],
        )
    if path in FIXED_ROUTES:
        return FIXED_ROUTES[path]
    if path.endswith("/echo"):
        doc = {"path": path, "headers": [[k, v] for k, v in headers], "body": body.decode()}
        return 200, json.dumps(doc).encode(), []
    return 404, f"no route {scope['method']} {path}".encode(), []


@dataclass
class Edge:
    url: str
    app: EdgeApp


@pytest.fixture
async def edge(nursery: trio.Nursery) -> Edge:
    app = EdgeApp()
    config = HypercornConfig()
    config.bind = ["127.0.0.1:0"]
    config.errorlog = None
    config.accesslog = None
    with trio.fail_after(TIMEOUT):
        binds = await nursery.start(partial(serve, app, config, mode="asgi"))
    return Edge(binds[0], app)


async def start_sim(nursery: trio.Nursery, config: SimConfig) -> tuple[str, SimApp]:
    app = SimApp(config)
    with trio.fail_after(TIMEOUT):
        url = await nursery.start(partial(serve_sim, config, app=app))
    return url, app


@pytest.fixture
async def broken_body_url(nursery: trio.Nursery) -> str:
    """A raw HTTP server that promises 100 body bytes, sends 7, and hangs up."""

    async def handler(stream: trio.SocketStream) -> None:
        async with stream:
            received = b""
            while b"\r\n\r\n" not in received:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    return
                received += chunk
            await stream.send_all(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 100\r\n\r\npartial"
            )

    listeners = await nursery.start(partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
async def client() -> AsyncIterator[HttpClient]:
    async with open_http_client(8) as c:
        yield c


# -- terminal HTTP outcomes ----------------------------------------------------------------


async def test_201_body_kept_exactly(edge: Edge, client: HttpClient) -> None:
    with trio.fail_after(TIMEOUT):
        env = make_env(payload={"prompt": "hi"})
        out = await dispatch(
            client, env, Target(edge.url, "/created"), request_timeout=5, now=time.time()
        )
    body = '{"id": "x",  "text": "café" }\n'
    assert out == Done(TerminalRecord(id="req-1", payload=body, status_code=201))
    assert [(c.method, c.path, c.body) for c in edge.app.calls] == [
        ("POST", "/created", b'{"prompt":"hi"}')
    ]


async def test_200_from_simulator(nursery: trio.Nursery, client: HttpClient) -> None:
    url, app = await start_sim(nursery, SimConfig())
    with trio.fail_after(TIMEOUT):
        env = make_env(rid="r-7", payload={"id": "r-7", "model": "m1", "prompt": "x"})
        out = await dispatch(client, env, Target(url), request_timeout=5, now=time.time())
    assert isinstance(out, Done)
    assert out.record.status_code == 200
    assert out.record.error_code is None
    doc = json.loads(out.record.payload)
    assert (doc["id"], doc["object"], doc["model"]) == ("r-7", "text_completion", "m1")
    assert app.stats()["calls_by_id"] == {"r-7": 1}


async def test_endpoint_overrides_queue_path(nursery: trio.Nursery, client: HttpClient) -> None:
    url, _ = await start_sim(nursery, SimConfig())
    with trio.fail_after(TIMEOUT):
        env = make_env(payload={"messages": []}, endpoint="/v1/chat/completions")
        out = await dispatch(client, env, Target(url + "/"), request_timeout=5, now=time.time())
    assert isinstance(out, Done)
    assert out.record.status_code == 200
    assert json.loads(out.record.payload)["object"] == "chat.completion"


async def test_null_payload_is_sent_as_json_null(edge: Edge, client: HttpClient) -> None:
    with trio.fail_after(TIMEOUT):
        out = await dispatch(
            client,
            make_env(payload=None),
            Target(edge.url, "echo"),
            request_timeout=5,
            now=time.time(),
        )
    assert isinstance(out, Done)
    assert json.loads(out.record.payload)["body"] == "null"
    assert edge.app.calls[0].body == b"null"


async def test_base_url_prefix_kept_and_404_terminal(edge: Edge, client: HttpClient) -> None:
    with trio.fail_after(TIMEOUT):
        out = await dispatch(
            client,
            make_env(),
            Target(edge.url + "/gw/", "/v1/completions"),
            request_timeout=5,
            now=time.time(),
        )
    assert out == Done(TerminalRecord.http("req-1", 404, "no route POST /gw/v1/completions"))


async def test_400_is_terminal_with_body(edge: Edge, client: HttpClient) -> None:
    with trio.fail_after(TIMEOUT):
        out = await dispatch(
            client,
            make_env(retry_count=3),
            Target(edge.url, "/bad"),
            request_timeout=5,
            now=time.time(),
        )
    assert out == Done(TerminalRecord.http("req-1", 400, '{"error":"prompt is required"}'))
    assert len(edge.app.calls) == 1


async def test_redirect_is_not_followed(edge: Edge, client: HttpClient) -> None:
    with trio.fail_after(TIMEOUT):
        out = await dispatch(
            client, make_env(), Target(edge.url, "/redirect"), request_timeout=5, now=time.time()
        )
    assert out == Done(TerminalRecord.http("req-1", 302, "moved"))
    assert [(c.method, c.path) for c in edge.app.calls] == [("POST", "/redirect")]


# -- retryable outcomes --------------------------------------------------------------------


@pytest.mark.parametrize("retry_count", [0, 1, 2, 3, 4, 5, 9])
async def test_429_retry_delay_follows_backoff(
    edge: Edge, client: HttpClient, retry_count: int
) -> None:
    with trio.fail_after(TIMEOUT):
        env = make_env(retry_count=retry_count)
        out = await dispatch(
            client,
            env,
            Target(edge.url, "/busy"),
            request_timeout=5,
            now=time.time(),
            rng=random.Random(42),
        )
    attempt = retry_count + 1
    t = min(60.0, 2.0 * 2.0**attempt)  # s ≈ 1000 s does not bind
    want, _ = expected_base(42, attempt, 1000.0)
    assert out == Retry(want, TerminalRecord.http("req-1", 429, "slow down"))
    assert t / 2 <= out.delay < t


@pytest.mark.parametrize(
    ("path", "status", "body"), [("/boom", 500, "boom"), ("/unavailable", 503, "try later")]
)
async def test_5xx_retry(edge: Edge, client: HttpClient, path: str, status: int, body: str) -> None:
    with trio.fail_after(TIMEOUT):
        out = await dispatch(
            client,
            make_env(retry_count=1),
            Target(edge.url, path),
            request_timeout=5,
            now=time.time(),
            rng=random.Random(7),
        )
    want, _ = expected_base(7, 2, 1000.0)
    assert out == Retry(want, TerminalRecord.http("req-1", status, body))
    assert 4.0 <= out.delay < 8.0


async def test_simulator_429_with_retry_after_seconds(
    nursery: trio.Nursery, client: HttpClient
) -> None:
    url, app = await start_sim(nursery, SimConfig(rate_429=1.0, retry_after="30"))
    with trio.fail_after(TIMEOUT):
        out = await dispatch(
            client,
            make_env(),
            Target(url),
            request_timeout=5,
            now=time.time(),
            rng=random.Random(3),
        )
    _, rng = expected_base(3, 1, 1000.0)
    want = 30.0 * (1.0 + 0.25 * rng.random())
    assert out == Retry(want, TerminalRecord.http("req-1", 429, SIM_429_BODY))
    assert 30.0 <= out.delay < 37.5
    assert app.stats()["by_status"] == {"429": 1}


async def test_retry_after_http_date_honoured(edge: Edge, client: HttpClient) -> None:
    now = time.time()
    date = email.utils.formatdate(math.floor(now) + 41, usegmt=True)
    with trio.fail_after(TIMEOUT):
        out = await dispatch(
            client,
            make_env(),
            Target(edge.url, f"/busy?ra={date}"),
            request_timeout=5,
            now=now,
            rng=random.Random(5),
        )
    assert isinstance(out, Retry)
    # Asked for 40..41 s from `now`, minus the attempt's own duration, plus up to 25 %.
    assert 39.0 <= out.delay < 41.0 * 1.25


async def test_retry_after_capped_at_half_the_time_left(edge: Edge, client: HttpClient) -> None:
    now = time.time()
    deadline = math.floor(now) + 21  # 20..21 s left
    with trio.fail_after(TIMEOUT):
        out = await dispatch(
            client,
            make_env(deadline=deadline),
            Target(edge.url, "/busy?ra=3600"),
            request_timeout=5,
            now=now,
            rng=random.Random(5),
        )
    assert isinstance(out, Retry)
    assert 9.9 <= out.delay < 10.5 * 1.25
    assert out.last == TerminalRecord.http("req-1", 429, "slow down")


async def test_body_that_breaks_mid_read_is_retried(
    broken_body_url: str, client: HttpClient
) -> None:
    with trio.fail_after(TIMEOUT):
        out = await dispatch(
            client,
            make_env(),
            Target(broken_body_url),
            request_timeout=5,
            now=time.time(),
            rng=random.Random(11),
        )
    want, _ = expected_base(11, 1, 1000.0)
    assert out == Retry(want, None)


# -- the deadline --------------------------------------------------------------------------


async def test_near_deadline_retry_becomes_last_response(
    nursery: trio.Nursery, client: HttpClient
) -> None:
    url, app = await start_sim(nursery, SimConfig(rate_429=1.0))
    env = make_env(deadline=2_000_000_000)
    # 1 s left: the backoff is at least 0.5 s, which would leave < DEADLINE_MARGIN.
    with trio.fail_after(TIMEOUT):
        out = await dispatch(
            client,
            env,
            Target(url),
            request_timeout=5,
            now=env.deadline - 1.0,
            rng=random.Random(1),
        )
    assert DEADLINE_MARGIN == 0.5
    assert out == Done(TerminalRecord.http("req-1", 429, SIM_429_BODY))
    assert app.stats()["requests"] == 1


async def test_near_deadline_unreadable_body_is_deadline_exceeded(
    broken_body_url: str, client: HttpClient
) -> None:
    env = make_env(deadline=2_000_000_000)
    with trio.fail_after(TIMEOUT):
        out = await dispatch(
            client,
            env,
            Target(broken_body_url),
            request_timeout=5,
            now=env.deadline - 1.0,
        )
    assert out == Done(
        TerminalRecord.error("req-1", ErrorCode.DEADLINE_EXCEEDED, "deadline exceeded")
    )


@pytest.mark.parametrize("past", [0.0, 0.001, 30.0])
async def test_deadline_passed_sends_nothing(
    nursery: trio.Nursery, client: HttpClient, past: float
) -> None:
    url, app = await start_sim(nursery, SimConfig())
    env = make_env(deadline=2_000_000_000)
    with trio.fail_after(TIMEOUT):
        out = await dispatch(client, env, Target(url), request_timeout=5, now=env.deadline + past)
        stats = app.stats()
    assert out == Done(
        TerminalRecord(
            id="req-1",
            payload='{"error":"deadline exceeded"}',
            error_code="DEADLINE_EXCEEDED",
            error_message="deadline exceeded",
        )
    )
    assert stats == {"requests": 0, "by_status": {}, "hangs": 0, "calls_by_id": {}}


# -- no response ---------------------------------------------------------------------------


async def test_connection_refused_sends_nothing_and_writes_no_record(client: HttpClient) -> None:
    """Not sent: handed back, no record (the other kinds of "not sent" and the breaker:
    tests/test_breaker.py)."""
    port = closed_port()
    with trio.fail_after(TIMEOUT):
        out = await dispatch(
            client,
            make_env(),
            Target(f"http://127.0.0.1:{port}"),
            request_timeout=5,
            now=time.time(),
        )
    assert out == Unsent(f"all attempts to connect to 127.0.0.1:{port} failed (Connection refused)")


async def test_hang_times_out_as_inference_error(nursery: trio.Nursery, client: HttpClient) -> None:
    url, app = await start_sim(nursery, SimConfig(rate_hang=1.0))
    with trio.fail_after(TIMEOUT):
        started = trio.current_time()
        out = await dispatch(client, make_env(), Target(url), request_timeout=0.3, now=time.time())
        elapsed = trio.current_time() - started
    assert out == Done(
        TerminalRecord.error(
            "req-1", ErrorCode.INFERENCE_ERROR, PREFIX + "no response within 0.3 s"
        ),
        unanswered=True,  # sent, never answered: counted, never re-sent
    )
    assert 0.3 <= elapsed < 2.0
    assert app.stats()["hangs"] == 1


async def test_timeout_is_capped_by_deadline(nursery: trio.Nursery, client: HttpClient) -> None:
    """The attempt's limit is the 0.25 s left to the deadline, not request_timeout: running
    out of it is the deadline ending the request (it used to read as INFERENCE_ERROR "no
    response within 0.25 s")."""
    url, app = await start_sim(nursery, SimConfig(rate_hang=1.0))
    env = make_env(deadline=2_000_000_000)
    with trio.fail_after(TIMEOUT):
        started = trio.current_time()
        out = await dispatch(client, env, Target(url), request_timeout=300, now=env.deadline - 0.25)
        assert trio.current_time() - started >= 0.25
    assert out == Done(
        TerminalRecord.error("req-1", ErrorCode.DEADLINE_EXCEEDED, "deadline exceeded")
    )
    assert app.stats()["hangs"] == 1


async def test_deadline_cut_after_a_parked_429_is_that_429(
    nursery: trio.Nursery, client: HttpClient
) -> None:
    """The member carries the 429 an earlier attempt got; this attempt hangs until the
    deadline: the record is the carried 429, status and body."""
    url, _ = await start_sim(nursery, SimConfig(rate_hang=1.0))
    parked = retry_member(
        make_env(deadline=2_000_000_000).raw, "q", TerminalRecord.http("x", 429, "slow down")
    )
    env = parse_member(parked)
    assert isinstance(env, Envelope)
    assert env.last_response == TerminalRecord.http("req-1", 429, "slow down")
    with trio.fail_after(TIMEOUT):
        out = await dispatch(client, env, Target(url), request_timeout=300, now=env.deadline - 0.25)
    assert out == Done(TerminalRecord.http("req-1", 429, "slow down"))
    # request_timeout, not the deadline, cutting it is still the gateway failing to answer.
    with trio.fail_after(TIMEOUT):
        out = await dispatch(client, env, Target(url), request_timeout=0.2, now=env.deadline - 5)
    assert out == Done(
        TerminalRecord.error(
            "req-1", ErrorCode.INFERENCE_ERROR, PREFIX + "no response within 0.2 s"
        ),
        unanswered=True,
    )


async def test_unsupported_scheme_is_inference_error(client: HttpClient) -> None:
    with trio.fail_after(TIMEOUT):
        out = await dispatch(
            client, make_env(), Target("ftp://gw.example"), request_timeout=5, now=time.time()
        )
    assert out == Done(
        TerminalRecord.error(
            "req-1",
            ErrorCode.INFERENCE_ERROR,
            PREFIX + "Request URL has an unsupported protocol 'ftp://'.",
        )
    )


# -- headers and URLs ----------------------------------------------------------------------


def test_build_headers_order_and_overrides() -> None:
    env = make_env(
        headers={
            "content-type": "application/json; charset=utf-8",
            "X-Custom": "1",
            "X-LLM-D-Inference-Fairness-Id": "spoofed",
        },
        metadata={"userid": "alice", "other": "x"},
    )
    headers = build_headers(env, Target("http://gw", inference_objective="premium"))
    assert list(headers.items()) == [
        ("x-gateway-inference-objective", "premium"),
        ("content-type", "application/json; charset=utf-8"),
        ("X-Custom", "1"),
        ("x-llm-d-inference-fairness-id", "alice"),
    ]


def test_build_headers_request_overrides_objective() -> None:
    env = make_env(headers={"X-Gateway-Inference-Objective": "mine"})
    headers = build_headers(env, Target("http://gw", inference_objective="premium"))
    assert headers == {"Content-Type": "application/json", "X-Gateway-Inference-Objective": "mine"}


@pytest.mark.parametrize("metadata", [None, {}, {"userid": ""}, {"UserId": "bob"}])
def test_build_headers_without_userid(metadata: dict[str, str] | None) -> None:
    env = make_env(metadata=metadata, headers={"x-llm-d-inference-fairness-id": "kept"})
    assert build_headers(env, Target("http://gw")) == {
        "Content-Type": "application/json",
        "x-llm-d-inference-fairness-id": "kept",
    }


async def test_headers_on_the_wire(edge: Edge, client: HttpClient) -> None:
    env = make_env(
        payload={"prompt": "p"},
        headers={
            "CONTENT-TYPE": "application/json",
            "X-Custom": "ü",
            "x-LLM-d-inference-FAIRNESS-id": "spoof",
        },
        metadata={"userid": "alice"},
    )
    with trio.fail_after(TIMEOUT):
        out = await dispatch(
            client,
            env,
            Target(edge.url, "/v1/echo", "batch"),
            request_timeout=5,
            now=time.time(),
        )
    assert isinstance(out, Done)
    sent = edge.app.calls[0].headers
    interesting = [
        (k, v)
        for k, v in sent
        if k
        in {
            "content-type",
            "x-custom",
            "x-gateway-inference-objective",
            "x-llm-d-inference-fairness-id",
            "user-agent",
        }
    ]
    assert sorted(interesting) == [
        ("content-type", "application/json"),
        ("user-agent", "claimkit"),
        ("x-custom", "ü".encode().decode("latin-1")),
        ("x-gateway-inference-objective", "batch"),
        ("x-llm-d-inference-fairness-id", "alice"),
    ]


@pytest.mark.parametrize(
    ("base", "path", "url"),
    [
        ("http://gw:8000", "/v1/completions", "http://gw:8000/v1/completions"),
        ("http://gw:8000/", "/v1/completions", "http://gw:8000/v1/completions"),
        ("http://gw:8000/", "v1/completions", "http://gw:8000/v1/completions"),
        ("http://gw:8000", "v1/completions", "http://gw:8000/v1/completions"),
        ("http://gw/prefix/", "/v1/chat/completions", "http://gw/prefix/v1/chat/completions"),
        ("http://gw/prefix", "/v1/x", "http://gw/prefix/v1/x"),
        ("http://gw//", "//v1/x", "http://gw/v1/x"),
        ("http://gw/prefix", "", "http://gw/prefix"),
        ("http://gw", "http://evil/x", "http://gw/http://evil/x"),
    ],
)
def test_build_url(base: str, path: str, url: str) -> None:
    assert build_url(base, path) == url


# -- backoff_delay (pure) ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("attempt", "seconds_left", "low", "high"),
    [
        (1, 1000.0, 2.0, 4.0),
        (2, 1000.0, 4.0, 8.0),
        (3, 1000.0, 8.0, 16.0),
        (4, 1000.0, 16.0, 32.0),
        (5, 1000.0, 30.0, 60.0),
        (6, 1000.0, 30.0, 60.0),
        (1000, 1000.0, 30.0, 60.0),
        (0, 1000.0, 2.0, 4.0),
        (5, 10.0, 5.0, 10.0),
        (1, 3.0, 1.5, 3.0),
    ],
)
def test_backoff_range(attempt: int, seconds_left: float, low: float, high: float) -> None:
    for seed in range(50):
        delay = backoff_delay(attempt, seconds_left, None, now=0.0, rng=random.Random(seed))
        assert low <= delay < high
        assert delay == low + random.Random(seed).random() * (high - low)


NOW = 1_700_000_000.0


@pytest.mark.parametrize(
    ("retry_after", "seconds_left", "wanted"),
    [
        ("30", 1000.0, 30.0),
        ("  30 ", 1000.0, 30.0),
        ("7.5", 1000.0, 7.5),
        ("3600", 100.0, 50.0),  # capped at s/2
        (email.utils.formatdate(NOW + 40, usegmt=True), 1000.0, 40.0),
        ("Tue, 14 Nov 2023 22:14:00", 1000.0, 40.0),  # no zone: read as UTC
        (email.utils.formatdate(NOW + 4000, usegmt=True), 1000.0, 500.0),
    ],
)
def test_retry_after_honoured(retry_after: str, seconds_left: float, wanted: float) -> None:
    for seed in range(20):
        delay = backoff_delay(1, seconds_left, retry_after, now=NOW, rng=random.Random(seed))
        rng = random.Random(seed)
        rng.random()  # the base draw
        assert delay == wanted * (1.0 + 0.25 * rng.random())
        assert wanted <= delay < wanted * 1.25


@pytest.mark.parametrize(
    "retry_after",
    [
        "1",
        "0",
        "soon",
        "",
        "-5",
        "1e3",
        "Wed, 99 Foo 2023",
        email.utils.formatdate(NOW - 60, usegmt=True),
    ],
)
def test_retry_after_ignored_when_small_or_unusable(retry_after: str) -> None:
    for seed in range(20):
        delay = backoff_delay(3, 1000.0, retry_after, now=NOW, rng=random.Random(seed))
        assert delay == 8.0 + random.Random(seed).random() * 8.0


def test_retry_after_cap_never_shortens_the_backoff() -> None:
    # s = 10, attempt 5: base in [5, 10); Retry-After 100 is capped at 5 (+≤25 %).
    for seed in range(50):
        rng = random.Random(seed)
        base = 5.0 + rng.random() * 5.0
        honoured = 5.0 * (1.0 + 0.25 * rng.random())
        delay = backoff_delay(5, 10.0, "100", now=NOW, rng=random.Random(seed))
        assert delay == max(base, honoured)


@pytest.mark.parametrize("seconds_left", [0.0, -1.0])
def test_backoff_without_time_left_is_zero(seconds_left: float) -> None:
    assert backoff_delay(1, seconds_left, "30", now=NOW, rng=random.Random(0)) == 0.0


# -- the client ----------------------------------------------------------------------------


async def test_open_http_client() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_http_client(3) as c:
            assert isinstance(c, HttpClient)
            assert c.max_connections == 3
            assert c.user_agent == b"claimkit"
        assert c.is_closed
    with pytest.raises(ValueError, match="concurrency must be at least 1"):
        open_http_client(0)


async def test_concurrency_limit_is_respected(nursery: trio.Nursery) -> None:
    url, app = await start_sim(nursery, SimConfig(latency=(0.2, 0.2)))
    results: list[object] = []
    with trio.fail_after(TIMEOUT):
        async with open_http_client(2) as c:
            started = trio.current_time()
            async with trio.open_nursery() as n:
                for i in range(4):
                    env = make_env(rid=f"r{i}", payload={"id": f"r{i}"})
                    n.start_soon(_collect, results, c, env, url)
            elapsed = trio.current_time() - started
    # Two connections for four 0.2 s requests: two rounds.
    assert 0.4 <= elapsed < 2.0
    assert len(results) == 4
    assert app.stats()["calls_by_id"] == {"r0": 1, "r1": 1, "r2": 1, "r3": 1}


async def _collect(results: list[object], client: HttpClient, env: Envelope, url: str) -> None:
    results.append(await dispatch(client, env, Target(url), request_timeout=5, now=time.time()))


# -- whole consumer: the deadline ends a rate-limited request with its last response --------


@dataclass
class ScriptedGateway:
    """A raw HTTP/1.1 gateway (keep-alive) that acts per request id and arrival number:
    ``act(id, n)`` gives ``("429", seconds)`` (answer 429 after that long, body naming the
    arrival), ``("hang",)``, ``("drop",)`` (read the whole request, close, no answer) or
    ``("200",)``. Every request read in full is an arrival."""

    act: Any
    arrivals: dict[str, int] = field(default_factory=dict)
    connections: int = 0
    url: str = ""

    @staticmethod
    def body_429(n: int) -> bytes:
        return b'{"error":{"message":"rate limited","arrival":%d}}' % n

    async def handler(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        async with stream:
            buf = bytearray()
            while True:
                while b"\r\n\r\n" not in buf:
                    chunk = await stream.receive_some(65536)
                    if not chunk:
                        return
                    buf += chunk
                head, _, rest = bytes(buf).partition(b"\r\n\r\n")
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                while len(rest) < length:
                    chunk = await stream.receive_some(65536)
                    if not chunk:
                        return
                    rest += chunk
                del buf[: len(head) + 4 + length]
                rid = json.loads(rest[:length])["id"]
                n = self.arrivals[rid] = self.arrivals.get(rid, 0) + 1
                act = self.act(rid, n)
                if act[0] == "drop":
                    return
                if act[0] == "hang":
                    await trio.sleep_forever()
                if act[0] == "429":
                    await trio.sleep(act[1])
                    status, out = b"429 Too Many Requests", self.body_429(n)
                else:
                    status, out = b"200 OK", b'{"ok":true}'
                await stream.send_all(
                    b"HTTP/1.1 %s\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (status, len(out), out)
                )


async def start_gateway(nursery: trio.Nursery, act: Any) -> ScriptedGateway:
    gw = ScriptedGateway(act)
    listeners = await nursery.start(partial(trio.serve_tcp, gw.handler, 0, host="127.0.0.1"))
    gw.url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
    return gw


def consumer_config(redis_url: str, gateway: str) -> Config:
    return make_config(
        redis_url,
        gateway=gateway,
        poll_interval_ms=20,
        claim_lease_ttl_seconds=30,
        metrics_port=0,
        health_port=0,
        drain_timeout_seconds=1,
    )


async def poll_until(predicate: Any) -> None:
    """Poll until ``predicate()`` holds (the caller's fail_after bounds it)."""
    while not await predicate():
        await trio.sleep(0.02)


async def result_records(store: Store) -> list[dict[str, Any]]:
    return [json.loads(r) for r in reversed(await store.command("LRANGE", "result-list", 0, -1))]


async def submit_at_second_start(store: Store, rid: str, seconds: int) -> int:
    """Submit ``rid`` with a deadline ``seconds`` ahead, just after a whole second of the
    Redis clock starts, so the time left is ``seconds`` less a few milliseconds."""
    while True:
        sec, usec = (int(x) for x in await store.command("TIME"))
        if usec < 100_000:
            break
        await trio.sleep((1_000_000 - usec) / 1e6)
    deadline = sec + seconds
    await Producer(store, "requests").submit(
        {"id": rid, "deadline": deadline, "payload": {"id": rid}}
    )
    return deadline


async def generation(store: Store, rid: str) -> str:
    """The ``request_token`` the producer gave ``rid`` (read while its deadline is ahead)."""
    token: bytes = await store.command("GET", f"request-active:{rid}")
    return token.decode()


# Seed 1's first draw is 0.134. With ~4.9 s left the first 429 (at ~0.3 s) is parked for
# 2 + 0.134 * 2 = 2.27 s (t = min(60, 4.6, 2 * 2^1) = 4), so the second attempt starts at
# ~2.6 s, 2 s before the deadline cuts it: margins a loaded machine does not eat.
SEED = 1


async def test_rate_limited_request_cut_by_its_deadline_ends_with_the_429(
    nursery: trio.Nursery, store: Store, redis_url: str
) -> None:
    """A LiteLLM-like gateway: 429 after a while, then a second answer that comes after the
    deadline. The deadline cuts the second attempt: the record is the 429 it got (status
    and the gateway's body), not INFERENCE_ERROR."""
    gw = await start_gateway(nursery, lambda rid, n: ("429", 0.3) if n == 1 else ("429", 30))
    with trio.fail_after(20):
        await submit_at_second_start(store, "rl-1", 5)
        token = await generation(store, "rl-1")
        consumer = Consumer(consumer_config(redis_url, gw.url), store, rng=random.Random(SEED))
        async with trio.open_nursery() as n:
            await n.start(consumer.run)
            await poll_until(lambda: _has_records(store, 1))
            consumer.request_stop()
        assert await result_records(store) == [
            {
                "id": "rl-1",
                "status_code": 429,
                "payload": ScriptedGateway.body_429(1).decode(),
                "request_token": token,
            }
        ]
        assert gw.arrivals == {"rl-1": 2}
        assert consumer.summary.retried == 1


async def test_parked_429_survives_a_consumer_restart(
    nursery: trio.Nursery, store: Store, redis_url: str
) -> None:
    """The 429 travels in the retry member: a consumer started after the first one stopped
    makes the last attempt, the deadline cuts it, and the record is still that 429."""
    gw = await start_gateway(nursery, lambda rid, n: ("429", 0.3) if n == 1 else ("hang",))
    config = consumer_config(redis_url, gw.url)
    with trio.fail_after(20):
        await submit_at_second_start(store, "rl-2", 5)
        token = await generation(store, "rl-2")
        first = Consumer(config, store, rng=random.Random(SEED))
        async with trio.open_nursery() as n:
            await n.start(first.run)
            members: list[bytes] = []

            async def parked() -> bool:
                members[:] = await store.command("ZRANGE", "retry-sortedset", 0, -1)
                return bool(members)

            await poll_until(parked)
            first.request_stop()
        (member,) = members
        internal = json.loads(member)["internal"]
        assert internal["claimkit_last_response"] == {
            "status_code": 429,
            "payload": ScriptedGateway.body_429(1).decode(),
        }
        assert internal["retry_count"] == 1
        second = Consumer(config, store, rng=random.Random(SEED))
        async with trio.open_nursery() as n:
            await n.start(second.run)
            await poll_until(lambda: _has_records(store, 1))
            second.request_stop()
        assert await result_records(store) == [
            {
                "id": "rl-2",
                "status_code": 429,
                "payload": ScriptedGateway.body_429(1).decode(),
                "request_token": token,
            }
        ]
        assert gw.arrivals == {"rl-2": 2}


async def test_no_response_ever_cut_by_the_deadline_is_deadline_exceeded(
    nursery: trio.Nursery, store: Store, redis_url: str
) -> None:
    gw = await start_gateway(nursery, lambda rid, n: ("hang",))
    with trio.fail_after(20):
        await submit_at_second_start(store, "h-1", 3)
        token = await generation(store, "h-1")
        consumer = Consumer(consumer_config(redis_url, gw.url), store)
        async with trio.open_nursery() as n:
            await n.start(consumer.run)
            await poll_until(lambda: _has_records(store, 1))
            consumer.request_stop()
        assert await result_records(store) == [
            {
                "id": "h-1",
                "payload": '{"error":"deadline exceeded"}',
                "error_code": "DEADLINE_EXCEEDED",
                "error_message": "deadline exceeded",
                "request_token": token,
            }
        ]
        assert gw.arrivals == {"h-1": 1}
        assert _no_response_count(consumer) == 0


async def test_gateway_that_reads_the_request_and_drops_it_sees_it_once(
    nursery: trio.Nursery, store: Store, redis_url: str
) -> None:
    """The second request goes out on the kept-alive connection of the first; the gateway
    reads it in full and hangs up without answering. It may be running it: the record is
    INFERENCE_ERROR, the gateway saw one arrival (it used to see two), and the outcome is
    counted in async_gateway_no_response_total."""
    gw = await start_gateway(nursery, lambda rid, n: ("drop",) if rid == "drop" else ("200",))
    with trio.fail_after(20):
        # A long idle expiry, so that "drop" surely goes out on the connection "keep" used.
        async with HttpClient(max_connections=4, keepalive_expiry=60) as http:
            consumer = Consumer(consumer_config(redis_url, gw.url), store, http_client=http)
            async with trio.open_nursery() as n:
                await n.start(consumer.run)
                producer = Producer(store, "requests")
                now = int(await server_now(store))
                await producer.submit(
                    {"id": "keep", "deadline": now + 600, "payload": {"id": "keep"}}
                )
                await poll_until(lambda: _has_records(store, 1))
                await producer.submit(
                    {"id": "drop", "deadline": now + 600, "payload": {"id": "drop"}}
                )
                await poll_until(lambda: _has_records(store, 2))
                consumer.request_stop()
        first, second = await result_records(store)
        keep, drop = await generation(store, "keep"), await generation(store, "drop")
        assert first == {
            "id": "keep",
            "status_code": 200,
            "payload": '{"ok":true}',
            "request_token": keep,
        }
        message = PREFIX + "server closed the connection without a response"
        assert second == {
            "id": "drop",
            "payload": json.dumps({"error": message}, separators=(",", ":")),
            "error_code": "INFERENCE_ERROR",
            "error_message": message,
            "request_token": drop,
        }
        assert gw.arrivals == {"keep": 1, "drop": 1}
        assert gw.connections == 1  # "drop" went out on the kept-alive connection
        assert _no_response_count(consumer) == 1


async def _has_records(store: Store, count: int) -> bool:
    length: int = await store.command("LLEN", "result-list")
    return length >= count


def _no_response_count(consumer: Consumer) -> float | None:
    return consumer.metrics.registry.get_sample_value(
        "llm_d_async_async_gateway_no_response_total",
        {"queue_id": "requests", "queue_name": "requests", "pool_name": ""},
    )


# -- the last response in the retry member ---------------------------------------------------


def test_retry_member_carries_the_last_response_bounded() -> None:
    env = make_env(rid="big")
    body = "é" * 40_000  # 80,000 UTF-8 bytes: cut at 65,536, on a character boundary
    member = retry_member(env.raw, "q", TerminalRecord.http("big", 503, body))
    carried = json.loads(member)["internal"][LAST_RESPONSE_FIELD]
    assert carried == {"status_code": 503, "payload": "é" * 32_768}
    assert len(carried["payload"].encode()) == LAST_RESPONSE_MAX_BYTES == 65536
    parked = parse_member(member)
    assert isinstance(parked, Envelope)
    assert parked.last_response == TerminalRecord.http("big", 503, "é" * 32_768)
    # An attempt with no readable response (last=None) keeps what an earlier one left.
    again = parse_member(retry_member(member, "q", None))
    assert isinstance(again, Envelope)
    assert (again.retry_count, again.last_response) == (2, parked.last_response)


@pytest.mark.parametrize(
    "carried",
    [None, "429", {"status_code": "429", "payload": "x"}, {"status_code": 99, "payload": "x"},
     {"status_code": 429}, {"status_code": True, "payload": "x"}, [429, "x"]],
)  # fmt: skip
def test_a_damaged_last_response_is_ignored_not_fatal(carried: Any) -> None:
    member = {
        "internal": {"retry_count": 1, LAST_RESPONSE_FIELD: carried},
        "request_kind": "plain",
        "data": {"id": "d", "deadline": 2_000_000_000},
    }
    env = parse_member(json.dumps(member).encode())
    assert isinstance(env, Envelope)  # still a valid request
    assert env.last_response is None


async def test_member_found_past_its_deadline_ends_with_its_carried_response(
    store: Store, redis_url: str
) -> None:
    """A parked 429 moved back after its deadline (a consumer was down meanwhile) is not
    sent again: its record is the 429 it carries, not DEADLINE_EXCEEDED."""
    now = int(await server_now(store))
    env = make_env(rid="late", deadline=now - 1)
    member = retry_member(env.raw, "requests", TerminalRecord.http("late", 429, "slow down"))
    await store.command("ZADD", "requests", now - 1, member)
    consumer = Consumer(consumer_config(redis_url, f"http://127.0.0.1:{closed_port()}"), store)
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            await n.start(consumer.run)
            await poll_until(lambda: _has_records(store, 1))
            consumer.request_stop()
    assert await result_records(store) == [
        {"id": "late", "status_code": 429, "payload": "slow down"}
    ]
