"""The gateway simulator (``claimkit sim``), over real HTTP."""

from __future__ import annotations

import random
import re
import signal
import socket
import subprocess
import sys
from functools import partial
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import trio
from support import free_port

from claimkit.dev.sim import SimApp, SimConfig, parse_latency, serve_sim

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

TIMEOUT = 10.0  # absolute cap for every test, seconds


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=5.0) as client:
        yield client


async def start(nursery: trio.Nursery, config: SimConfig) -> tuple[str, SimApp]:
    app = SimApp(config)
    with trio.fail_after(TIMEOUT):
        url: str = await nursery.start(partial(serve_sim, config, app=app))
    return url, app


async def test_completion_echoes_id_and_model(
    nursery: trio.Nursery, http: httpx.AsyncClient
) -> None:
    url, _ = await start(nursery, SimConfig())
    with trio.fail_after(TIMEOUT):
        body = b'{"id": "abc", "model": "m", "prompt": "p"}'  # 43 bytes
        r = await http.post(url + "/v1/completions", content=body)
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    doc = r.json()
    created = doc.pop("created")
    assert isinstance(created, int)
    assert doc == {
        "id": "abc",
        "object": "text_completion",
        "model": "m",
        "choices": [{"index": 0, "text": "ok ok", "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12},
    }


async def test_chat_completion_shape(nursery: trio.Nursery, http: httpx.AsyncClient) -> None:
    url, _ = await start(nursery, SimConfig())
    with trio.fail_after(TIMEOUT):
        r = await http.post(url + "/v1/chat/completions", json={"messages": []})
    assert r.status_code == 200
    doc = r.json()
    del doc["created"]
    assert doc == {
        "id": "cmpl-sim-1",
        "object": "chat.completion",
        "model": "sim",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok ok"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }


async def test_stats_count_and_reset(nursery: trio.Nursery, http: httpx.AsyncClient) -> None:
    url, app = await start(nursery, SimConfig())
    with trio.fail_after(TIMEOUT):
        for rid in ["a", "b", "a", "a"]:
            r = await http.post(url + "/v1/completions", json={"id": rid})
            assert r.status_code == 200
        r = await http.post(url + "/v1/completions", content=b"null")
        assert r.status_code == 200
        r = await http.post(url + "/v1/completions", json={"id": 7})
        assert r.status_code == 200
        stats = (await http.get(url + "/stats")).json()
        assert stats == {
            "requests": 6,
            "by_status": {"200": 6},
            "hangs": 0,
            "calls_by_id": {"a": 3, "b": 1},
        }
        assert app.stats() == stats
        r = await http.post(url + "/stats/reset")
        assert (r.status_code, r.json()) == (200, {"reset": True})
        stats = (await http.get(url + "/stats")).json()
    assert stats == {"requests": 0, "by_status": {}, "hangs": 0, "calls_by_id": {}}


async def test_bad_requests(nursery: trio.Nursery, http: httpx.AsyncClient) -> None:
    url, app = await start(nursery, SimConfig())
    with trio.fail_after(TIMEOUT):
        bad_json = await http.post(url + "/v1/completions", content=b"{not json")
        wrong_method = await http.get(url + "/v1/completions")
        no_route = await http.post(url + "/v2/anything", json={})
    assert bad_json.status_code == 400
    assert bad_json.json()["error"]["message"] == "body is not JSON"
    assert wrong_method.status_code == 405
    assert no_route.status_code == 404
    assert no_route.json()["error"]["message"] == "no route POST /v2/anything"
    # Only the completion POSTs count; the malformed one did reach the gateway.
    assert app.stats() == {"requests": 1, "by_status": {"400": 1}, "hangs": 0, "calls_by_id": {}}


async def test_429_with_retry_after(nursery: trio.Nursery, http: httpx.AsyncClient) -> None:
    url, _ = await start(nursery, SimConfig(rate_429=1.0, retry_after="12"))
    with trio.fail_after(TIMEOUT):
        r = await http.post(url + "/v1/completions", json={"id": "x"})
    assert r.status_code == 429
    assert r.headers["retry-after"] == "12"
    assert r.text == (
        '{"error":{"message":"simulated rate limit","type":"rate_limit_exceeded",'
        '"param":null,"code":null}}'
    )


async def test_429_without_retry_after(nursery: trio.Nursery, http: httpx.AsyncClient) -> None:
    url, _ = await start(nursery, SimConfig(rate_429=1.0))
    with trio.fail_after(TIMEOUT):
        r = await http.post(url + "/v1/completions", json={"id": "x"})
    assert r.status_code == 429
    assert "retry-after" not in r.headers


async def test_5xx(nursery: trio.Nursery, http: httpx.AsyncClient) -> None:
    url, app = await start(nursery, SimConfig(rate_5xx=1.0))
    with trio.fail_after(TIMEOUT):
        r = await http.post(url + "/v1/chat/completions", json={"id": "x"})
    assert r.status_code == 503
    assert app.stats()["by_status"] == {"503": 1}


async def test_seeded_fault_mix_is_reproducible(
    nursery: trio.Nursery, http: httpx.AsyncClient
) -> None:
    config = SimConfig(rate_429=0.3, rate_5xx=0.2, latency=(0.0, 0.001), seed=7)
    url, app = await start(nursery, config)
    with trio.fail_after(TIMEOUT):
        got = []
        for i in range(40):
            r = await http.post(url + "/v1/completions", json={"id": f"r{i}"})
            got.append(r.status_code)
    # Replay the simulator's draws: one fault draw, then one latency draw, per request.
    rng = random.Random(7)
    want = []
    for _ in range(40):
        draw = rng.random()
        rng.uniform(0.0, 0.001)
        want.append(429 if draw < 0.3 else 503 if draw < 0.5 else 200)
    assert got == want
    assert {200, 429, 503} <= set(got)
    stats = app.stats()
    assert stats["requests"] == 40
    assert stats["by_status"] == {str(s): want.count(s) for s in set(want)}
    assert stats["calls_by_id"] == {f"r{i}": 1 for i in range(40)}


async def test_hang_until_client_gives_up(nursery: trio.Nursery, http: httpx.AsyncClient) -> None:
    url, _ = await start(nursery, SimConfig(rate_hang=1.0))
    with trio.fail_after(TIMEOUT):
        with pytest.raises(httpx.ReadTimeout):
            await http.post(url + "/v1/completions", json={"id": "h"}, timeout=0.2)
        stats = (await http.get(url + "/stats")).json()
    assert stats == {"requests": 1, "by_status": {}, "hangs": 1, "calls_by_id": {"h": 1}}


async def test_fixed_latency(nursery: trio.Nursery, http: httpx.AsyncClient) -> None:
    url, _ = await start(nursery, SimConfig(latency=(0.2, 0.2)))
    with trio.fail_after(TIMEOUT):
        started = trio.current_time()
        r = await http.post(url + "/v1/completions", json={})
        elapsed = trio.current_time() - started
    assert r.status_code == 200
    assert 0.2 <= elapsed < 2.0


async def test_stats_is_never_delayed(nursery: trio.Nursery, http: httpx.AsyncClient) -> None:
    """A completion sleeps its latency (here an hour); /stats answers at once meanwhile."""
    url, _ = await start(nursery, SimConfig(latency=(3600.0, 3600.0)))
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as inner:
            inner.start_soon(partial(http.post, url + "/v1/completions", json={"id": "slow"}))
            while (stats := (await http.get(url + "/stats")).json())["requests"] == 0:
                await trio.sleep(0.01)
            inner.cancel_scope.cancel()
    assert stats == {"requests": 1, "by_status": {}, "hangs": 0, "calls_by_id": {"slow": 1}}


async def test_explicit_port(nursery: trio.Nursery, http: httpx.AsyncClient) -> None:
    port = free_port()
    url, _ = await start(nursery, SimConfig(port=port))
    assert url == f"http://127.0.0.1:{port}"
    with trio.fail_after(TIMEOUT):
        r = await http.get(url + "/stats")
    assert r.status_code == 200


async def test_port_in_use_raises_oserror() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # The errno or the words are checked below: the message is the platform's.
        with trio.fail_after(TIMEOUT), pytest.raises(OSError) as info:  # noqa: PT011
            await serve_sim(SimConfig(port=port))
    assert info.value.errno == 98 or "in use" in str(info.value)


async def test_cancel_stops_the_server(http: httpx.AsyncClient) -> None:
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            url, _ = await start(nursery, SimConfig())
            assert (await http.get(url + "/stats")).status_code == 200
            nursery.cancel_scope.cancel()
        with pytest.raises(httpx.ConnectError):
            await http.get(url + "/stats")


@pytest.mark.parametrize(
    ("text", "latency"),
    [("0", (0.0, 0.0)), ("0.05", (0.05, 0.05)), ("0.01,0.2", (0.01, 0.2)), (" 1 , 2 ", (1.0, 2.0))],
)
def test_parse_latency(text: str, latency: tuple[float, float]) -> None:
    assert parse_latency(text) == latency


@pytest.mark.parametrize("text", ["", "a", "1,2,3", "0.2,0.1", "-1", "1,", "inf"])
def test_parse_latency_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="latency must"):
        parse_latency(text)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rate_429": 1.5}, "rate_429 must be between 0 and 1, got 1.5"),
        ({"rate_5xx": -0.1}, "rate_5xx must be between 0 and 1, got -0.1"),
        ({"rate_hang": 2.0}, "rate_hang must be between 0 and 1, got 2.0"),
        ({"rate_429": 0.6, "rate_5xx": 0.5}, "rate_429 + rate_5xx + rate_hang must not exceed 1"),
        ({"latency": (0.5, 0.1)}, "latency must satisfy 0 <= min <= max, got 0.5,0.1"),
        ({"port": 70000}, "port must be between 0 and 65535, got 70000"),
    ],
)
def test_config_validation(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        SimConfig(**kwargs)


@pytest.mark.slow
async def test_run_sim_forever_subprocess(http: httpx.AsyncClient) -> None:
    code = "from claimkit.dev.sim import *; run_sim_forever(SimConfig(rate_5xx=1.0))"
    with trio.fail_after(TIMEOUT):
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        try:
            assert proc.stdout is not None
            assert proc.stderr is not None
            line = b""
            while not line.endswith(b"\n"):
                chunk = await proc.stdout.receive_some(1)
                assert chunk, "the simulator exited before saying where it listens"
                line += chunk
            prefix = "claimkit sim listening on "
            text = line.decode().strip()
            assert text.startswith(prefix + "http://127.0.0.1:")
            url = text[len(prefix) :]
            r = await http.post(url + "/v1/completions", json={"id": "s"})
            assert r.status_code == 503
            proc.send_signal(signal.SIGINT)
            assert await proc.wait() == 0
            rest = await _read_all(proc.stdout)
            err = await _read_all(proc.stderr)
        finally:
            if proc.returncode is None:
                proc.kill()
                with trio.CancelScope(shield=True):
                    await proc.wait()
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    await stream.aclose()
    assert rest == b""
    assert err == b""


async def _read_all(stream: trio.abc.ReceiveStream) -> bytes:
    out = b""
    while chunk := await stream.receive_some(65536):
        out += chunk
    return out


@pytest.mark.slow
def test_run_sim_forever_bind_error_is_plain_oserror() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = f"from claimkit.dev.sim import *; run_sim_forever(SimConfig(port={port}))"
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT
        )
    assert done.returncode == 1
    assert done.stdout == ""
    last = done.stderr.strip().splitlines()[-1]
    assert last == "OSError: [Errno 98] Address already in use"
