"""`claimkit serve` as a real process: SIGKILL, SIGTERM, metrics, health (SPEC §3.8, §5, §7)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from held_gateway import held_gateway
from support import deadline, free_port, wait_port

from claimkit.consumer.serve import _EarlySignals
from claimkit.dev.redis_server import RedisServer
from claimkit.producer import Producer
from claimkit.store import Store, open_store

pytestmark = pytest.mark.slow

RedisFactory = Callable[..., RedisServer]
CLAIMKIT = str(Path(sys.executable).with_name("claimkit"))
Q = "requests"


@pytest.fixture
def sim_url(tmp_path: Path) -> Iterator[str]:
    """The gateway simulator as a subprocess, answering in 0.3-0.6 s."""
    log = tmp_path / "sim.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [CLAIMKIT, "sim", "--port", "0", "--latency", "0.3,0.6", "--seed", "7"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        # It picks its own port and says so: no free-port race with other processes.
        end = time.monotonic() + 30
        while not (found := re.findall(r"listening on (http://\S+)", log.read_text())):
            assert time.monotonic() < end, log.read_text()
            assert proc.poll() is None, log.read_text()
            time.sleep(0.02)
        yield found[0]
    finally:
        proc.kill()
        proc.wait(10)


def serve(
    redis_url: str, gateway: str, log: Path, *extra: str, **overrides: Any
) -> subprocess.Popen[bytes]:
    config = {
        "poll_interval_ms": 50,
        "claim_lease_ttl_seconds": 2,
        "claim_reclaim_interval_ms": 200,
        "queues": [{"queue_name": Q, "igw_base_url": gateway}],
        **overrides,
    }
    env = {**os.environ, "REDIS_URL": redis_url}
    # stdout (the summary line) goes to <log>.out, stderr to <log>; the child keeps its own
    # descriptors, so the parent closes its copies at once.
    with log.open("w") as err, log.with_suffix(".out").open("w") as out:
        return subprocess.Popen(
            [
                CLAIMKIT,
                "serve",
                "--transport-config",
                json.dumps(config),
                "--metrics-port",
                "0",
                "--health-port",
                "0",
                "--concurrency",
                "16",
                *extra,
            ],
            stdout=out,
            stderr=err,
            env=env,
        )


def summary_of(log: Path) -> dict[str, int]:
    """The counts of the summary line serve printed on stdout."""
    line = log.with_suffix(".out").read_text().strip().splitlines()[-1]
    assert line.startswith("claimkit: claimed=")
    return {k: int(v) for k, v in (kv.split("=") for kv in line.split()[1:])}


async def wait_for(store: Store, command: tuple[Any, ...], predicate: Any) -> Any:
    while True:
        value = await store.command(*command)
        if predicate(value):
            return value
        await trio.sleep(0.05)


async def test_sigkilled_consumer_work_is_redelivered_once(redis_url: str, tmp_path: Path) -> None:
    """A holds 16 claims (its concurrency; the gateway answers nothing until released) when
    it is SIGKILLed; B redelivers exactly those 16 and finishes everything, once each."""
    n, concurrency = 80, 16
    ids = [f"hk-{i:03d}" for i in range(n)]
    a = b = None
    try:
        with trio.fail_after(60), held_gateway() as gateway:
            async with open_store(redis_url) as store:
                await Producer(store, Q).submit_many(
                    [{"id": rid, "deadline": deadline(), "payload": {"id": rid}} for rid in ids]
                )
                a = serve(redis_url, gateway.url, tmp_path / "a.log")
                sent_by_a = await trio.to_thread.run_sync(gateway.wait_arrivals, concurrency, 30)
                a.send_signal(signal.SIGKILL)
                a.wait(10)
                held_at_kill = await store.command("HKEYS", f"{Q}:claim-owners")
                assert sorted(k.decode() for k in held_at_kill) == sorted(sent_by_a)
                gateway.release()
                b = serve(redis_url, gateway.url, tmp_path / "b.log")
                await wait_for(store, ("LLEN", "result-list"), lambda v: v >= n)
                b.send_signal(signal.SIGTERM)
                assert await trio.to_thread.run_sync(b.wait, 30) == 0
                records = [
                    json.loads(r) for r in await store.command("LRANGE", "result-list", 0, -1)
                ]
                assert sorted(r["id"] for r in records) == ids  # each exactly once
                assert {r["status_code"] for r in records} == {200}
                for key in (Q, f"{Q}:claims-idx"):
                    assert await store.command("ZCARD", key) == 0
                for key in (f"{Q}:claimed", f"{Q}:claim-owners", f"{Q}:deliveries"):
                    assert await store.command("HLEN", key) == 0
                assert summary_of(tmp_path / "b.log")["redelivered"] == concurrency
                # A's 16 ran twice (A's answers went to a dead process), the rest once.
                calls = gateway.calls()
                assert {rid for rid, count in calls.items() if count == 2} == set(sent_by_a)
                assert Counter(calls.values()) == {1: n - concurrency, 2: concurrency}
    finally:
        for proc in (a, b):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)


async def test_sigterm_returns_in_flight_claims_at_original_scores(
    redis_url: str, tmp_path: Path
) -> None:
    # A gateway that accepts connections and never answers: requests stay in flight.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(100)
        gateway = f"http://127.0.0.1:{silent.getsockname()[1]}"
        proc = None
        try:
            with trio.fail_after(40):
                async with open_store(redis_url) as store:
                    await Producer(store, Q).submit_many(
                        [{"id": f"t{i}", "deadline": deadline() + i} for i in range(6)]
                    )
                    before = await store.command("ZRANGE", Q, 0, -1, "WITHSCORES")
                    proc = serve(redis_url, gateway, tmp_path / "s.log", "--drain-timeout", "0.5")
                    await wait_for(store, ("HLEN", f"{Q}:claim-owners"), lambda v: v == 6)
                    proc.send_signal(signal.SIGTERM)
                    assert await trio.to_thread.run_sync(proc.wait, 30) == 0
                    assert await store.command("ZRANGE", Q, 0, -1, "WITHSCORES") == before
                    assert await store.command("HLEN", f"{Q}:claimed") == 0
                    assert await store.command("ZCARD", f"{Q}:claims-idx") == 0
                    assert await store.command("LLEN", "result-list") == 0
                    counts = summary_of(tmp_path / "s.log")
                    assert (counts["claimed"], counts["released"], counts["acked"]) == (6, 6, 0)
        finally:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)


async def test_metrics_and_health_endpoints(redis_url: str, sim_url: str, tmp_path: Path) -> None:
    mport, hport = free_port(), free_port()
    config = {
        "poll_interval_ms": 50,
        "metrics_port": mport,
        "health_port": hport,
        "queues": [{"queue_name": Q, "igw_base_url": sim_url, "labels": {"pool_name": "p1"}}],
    }
    with (tmp_path / "m.log").open("w") as err:
        proc = subprocess.Popen(
            [CLAIMKIT, "serve", "--transport-config", json.dumps(config)],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env={**os.environ, "REDIS_URL": redis_url},
        )
    try:
        with trio.fail_after(40):
            async with open_store(redis_url) as store:
                await Producer(store, Q).submit_many(
                    [{"id": f"m{i}", "deadline": deadline()} for i in range(3)]
                )
                await wait_for(store, ("LLEN", "result-list"), lambda v: v == 3)
            await trio.to_thread.run_sync(wait_port, hport)
            async with httpx.AsyncClient() as http:
                assert (await http.get(f"http://127.0.0.1:{hport}/healthz")).status_code == 200
                ready = await http.get(f"http://127.0.0.1:{hport}/readyz")
                assert (ready.status_code, ready.text) == (200, "ok\n")
                text = (await http.get(f"http://127.0.0.1:{mport}/metrics")).text
            labels = 'pool_name="p1",queue_id="requests",queue_name="requests"'
            assert f"llm_d_async_async_request_total{{{labels}}} 3.0" in text
            assert f"llm_d_async_async_successful_requests_total{{{labels}}} 3.0" in text
            assert f"llm_d_async_async_claim_depth{{{labels}}} 0.0" in text
            for name in (
                "async_claims_expired_total",
                "async_duplicate_results_suppressed_total",
                "async_request_retries_total",
                "async_failed_requests_total",
                "async_exceeded_deadline_requests_total",
                "async_shedded_requests_total",
                "async_inference_latency_time_millis_bucket",
                "async_inflight_requests",
                "async_broker_backlog",
                "async_dead_lettered_total",
            ):
                assert f"llm_d_async_{name}{{" in text, name
            proc.send_signal(signal.SIGTERM)
            assert await trio.to_thread.run_sync(proc.wait, 30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_bad_config_is_one_line(redis_url: str) -> None:
    proc = subprocess.run(
        [CLAIMKIT, "serve", "--transport-config", '{"claim_lease_ttl_seconds": -1, "queues": []}'],
        capture_output=True,
        env={**os.environ, "REDIS_URL": redis_url},
        timeout=30,
    )
    assert proc.returncode == 1
    assert proc.stderr.decode() == "claimkit: claim_lease_ttl_seconds must be non-negative\n"


def test_unreachable_redis_at_start_is_retried_not_fatal(tmp_path: Path) -> None:
    """Redis down at start: serve keeps retrying (SPEC §5) and still stops cleanly."""
    port = free_port()
    log = tmp_path / "u.log"
    proc = serve(f"redis://127.0.0.1:{port}/0", "http://127.0.0.1:9", log)
    try:
        # Its retry line, not a sleep: a SIGTERM before serve handles signals would kill it.
        wait_log(proc, log, f"Unable to establish a connection to 127.0.0.1:{port}")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()
        assert summary_of(log)["claimed"] == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def connected_to(port: int) -> bool:
    """Whether any local TCP connection to ``port`` is established (Linux /proc/net/tcp)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        _, _, remote, state, *_ = line.split()
        if int(remote.rsplit(":", 1)[1], 16) == port and state == "01":
            return True
    return False


def test_sigterm_while_starting_is_a_graceful_stop(
    redis_factory: RedisFactory, tmp_path: Path
) -> None:
    """SIGTERM while serve still starts (its preflight waits on a frozen Redis) must not
    kill it by the signal's default action: it stops through the shutdown, exit 0."""
    server = redis_factory()
    server.pause()
    log = tmp_path / "w.log"
    proc = serve(server.url, "http://127.0.0.1:9", log)
    try:
        end = time.monotonic() + 30
        while not connected_to(server.port):
            assert time.monotonic() < end, log.read_text()
            assert proc.poll() is None, log.read_text()
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        assert proc.poll() is None  # still waiting for Redis, not killed
        server.resume()
        assert proc.wait(30) == 0, log.read_text()
        assert summary_of(log)["claimed"] == 0
        assert "claimkit: SIGTERM received while starting" in log.read_text()
    finally:
        server.resume()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_redis_restart_is_logged_in_lines_not_tracebacks(
    redis_factory: RedisFactory, tmp_path: Path
) -> None:
    """Redis killed and restarted under a running serve: the operator reads one line that
    Redis went away and one that it answers again, never a library's traceback."""
    server = redis_factory(aof="always")
    log = tmp_path / "r.log"
    proc = serve(server.url, "http://127.0.0.1:9", log, "--consumer-id", "restart-1")
    try:
        wait_log(proc, log, "claimkit: serving ")
        server.kill()
        wait_log(proc, log, "retrying with backoff")
        server.restart()
        wait_log(proc, log, "claimkit: Redis answers again")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        text = log.read_text()
        assert "Traceback" not in text, text
        assert all(line[:4].isdigit() for line in text.splitlines()), text  # only log lines
        # Both HTTP servers are off: the start line names no bind address.
        started = [line for line in text.splitlines() if "claimkit: serving " in line]
        assert [line.split(" INFO ", 1)[1] for line in started] == [
            f"claimkit: serving {Q} on {server.url} as consumer restart-1 (metrics off, health off)"
        ]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def wait_log(proc: subprocess.Popen[bytes], log: Path, text: str, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while text not in log.read_text():
        assert time.monotonic() < end, log.read_text()
        assert proc.poll() is None, log.read_text()
        time.sleep(0.05)


def test_early_signal_handlers_are_put_back_once() -> None:
    """The start-up handlers remember signals and are gone again after restore(), which
    serve calls as soon as the consumer has stopped (before the teardown)."""
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    early = _EarlySignals()
    early.install()
    try:
        handler = signal.getsignal(signal.SIGTERM)
        assert handler == signal.getsignal(signal.SIGINT)
        assert callable(handler)
        handler(signal.SIGTERM, None)
        handler(signal.SIGINT, None)
        assert early.received == [signal.SIGTERM, signal.SIGINT]
    finally:
        early.restore()
    assert {s: signal.getsignal(s) for s in before} == before
    early.restore()  # idempotent: nothing to put back twice
    assert {s: signal.getsignal(s) for s in before} == before


def test_sim_survives_clients_that_hang_up_mid_request(tmp_path: Path) -> None:
    """Regression: the CLI once restored SIGPIPE's default action, so the first client
    that hung up before its answer killed `claimkit sim` (and could kill `serve`)."""
    port = free_port()
    with (tmp_path / "sim.log").open("w") as log:
        proc = subprocess.Popen(
            [CLAIMKIT, "sim", "--port", str(port), "--latency", "0.2"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_port(port)
        body = b'{"id":"x"}'
        request = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        for _ in range(5):
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(request)
            # closed before the 0.2 s answer: the sim writes into a reset connection
        time.sleep(0.5)
        assert proc.poll() is None
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"id": "y"}, timeout=5)
        assert reply.status_code == 200
        assert reply.json()["id"] != ""
    finally:
        proc.kill()
        proc.wait(10)


async def test_serve_refuses_a_queue_key_of_another_type(redis_url: str) -> None:
    async with open_store(redis_url) as store:
        await store.command("SET", Q, "oops")
    proc = await trio.run_process(
        [
            CLAIMKIT,
            "serve",
            "--metrics-port",
            "0",
            "--health-port",
            "0",
            "--transport-config",
            json.dumps({"queues": [{"queue_name": Q, "igw_base_url": "http://127.0.0.1:9"}]}),
        ],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        env={**os.environ, "REDIS_URL": redis_url},
    )
    assert proc.returncode == 1
    assert proc.stderr.decode() == f"claimkit: queue key '{Q}' holds a string, not a sorted set\n"
