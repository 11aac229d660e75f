"""`claimkit serve` raises its soft open-file limit (RLIMIT_NOFILE) to the hard one, and warns
in one line when that is still below what ``--concurrency`` needs
(docs/performance.md#how-to-size-concurrency)."""

from __future__ import annotations

import json
import re
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from claimkit import Producer, open_store
from claimkit.config import Config, QueueConfig
from claimkit.consumer.serve import FD_RESERVE, fds_needed
from claimkit.dev.resp_client import call
from claimkit.protocol.keys import DEFAULT_RESULT_LIST

pytestmark = pytest.mark.slow

CLAIMKIT = str(Path(sys.executable).with_name("claimkit"))
HARD_LIMIT = 512  # below what this machine allows, so the test sets both limits itself


def serve_with_limits(
    redis_url: str, tmp_path: Path, soft: int, hard: int, concurrency: int
) -> tuple[str, int]:
    """Start serve with (soft, hard) as its open-file limits; once it serves, return its
    stderr and the soft limit in force in the running process (``/proc/PID/limits``)."""
    config = {"queues": [{"queue_name": "fd", "igw_base_url": "http://127.0.0.1:1"}]}

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    log = tmp_path / "serve.log"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [
                CLAIMKIT,
                "serve",
                "--redis-url",
                redis_url,
                "--transport-config",
                json.dumps(config),
                "--concurrency",
                str(concurrency),
                "--metrics-port",
                "0",
                "--health-port",
                "0",
            ],
            stdout=subprocess.DEVNULL,
            stderr=err,
            preexec_fn=limit,
        )
    try:
        end = time.monotonic() + 30
        while "claimkit: serving" not in log.read_text():
            assert time.monotonic() < end, log.read_text()
            assert proc.poll() is None, log.read_text()
            time.sleep(0.05)
        limits = Path(f"/proc/{proc.pid}/limits").read_text()
        (line,) = [x for x in limits.splitlines() if x.startswith("Max open files")]
        in_force = int(line.split()[3])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    return log.read_text(), in_force


def messages(text: str) -> list[str]:
    """The log lines without their timestamp and level."""
    return [line.split(" ", 3)[3] for line in text.splitlines()]


def test_serve_raises_the_soft_limit_to_the_hard_one(redis_url: str, tmp_path: Path) -> None:
    text, in_force = serve_with_limits(redis_url, tmp_path, 128, HARD_LIMIT, concurrency=16)
    assert in_force == HARD_LIMIT
    assert f"claimkit: open-file limit (RLIMIT_NOFILE) raised from 128 to {HARD_LIMIT}" in (
        messages(text)
    )
    assert "warning" not in text.lower()


def test_serve_warns_in_one_line_when_the_hard_limit_is_too_low(
    redis_url: str, tmp_path: Path
) -> None:
    text, in_force = serve_with_limits(redis_url, tmp_path, 128, HARD_LIMIT, concurrency=1000)
    assert in_force == HARD_LIMIT
    needed = 1000 + FD_RESERVE  # both probe servers are off: no probe connections
    warnings = [m for m in messages(text) if "warning" in m]
    assert warnings == [
        f"claimkit: warning: the open-file limit is {HARD_LIMIT} (hard limit {HARD_LIMIT}), "
        f"below the {needed} that --concurrency 1000 needs (one gateway connection per "
        f"request in flight, plus {FD_RESERVE}); past it a request that cannot open a "
        "connection is handed back and claiming waits (docs/dispatch.md#out-of-open-files): "
        "raise the hard limit (ulimit -Hn, systemd LimitNOFILE=, the "
        "container's nofile ulimit; docs/performance.md#how-to-size-concurrency) or lower "
        "--concurrency"
    ]


def test_serve_leaves_a_soft_limit_that_is_already_the_hard_one(
    redis_url: str, tmp_path: Path
) -> None:
    text, in_force = serve_with_limits(redis_url, tmp_path, HARD_LIMIT, HARD_LIMIT, 16)
    assert in_force == HARD_LIMIT
    assert "open-file limit" not in text


def test_fds_needed_counts_probe_connections_only_when_a_server_is_on() -> None:
    queues = (QueueConfig(queue_name="q", igw_base_url="http://gw"),)
    off = Config(url="redis://x", queues=queues, concurrency=100, metrics_port=0, health_port=0)
    on = Config(url="redis://x", queues=queues, concurrency=100, http_max_connections=512)
    assert fds_needed(off) == 100 + FD_RESERVE
    assert fds_needed(on) == 100 + 512 + FD_RESERVE


def test_out_of_open_files_hands_requests_back_in_one_line_without_the_breaker(
    redis_url: str, tmp_path: Path
) -> None:
    """A serve whose open-file limit (64, soft and hard) is below what 150 requests in
    flight against a gateway answering after 1 s need: the connects past the limit fail
    with EMFILE. They are handed back (no record, the gateway breaker stays closed, no
    "unreachable" line), one WARNING names the limit, and every request ends 200 once
    connections free up (docs/dispatch.md#out-of-open-files)."""
    n, limit = 150, 64
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sim_log = tmp_path / "sim.log"
    with sim_log.open("w") as out:
        sim = subprocess.Popen(
            [CLAIMKIT, "sim", "--port", str(port), "--latency", "1"], stdout=out, stderr=out
        )
    serve: subprocess.Popen[bytes] | None = None
    try:
        end = time.monotonic() + 30
        while "listening" not in sim_log.read_text():
            assert time.monotonic() < end, sim_log.read_text()
            assert sim.poll() is None, sim_log.read_text()
            time.sleep(0.05)
        trio.run(submit, redis_url, n)
        config = {"queues": [{"queue_name": "fd", "igw_base_url": f"http://127.0.0.1:{port}"}]}

        def low_limit() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

        log = tmp_path / "serve.log"
        with log.open("w") as err:
            serve = subprocess.Popen(
                [
                    CLAIMKIT, "serve", "--redis-url", redis_url, "--transport-config",
                    json.dumps(config), "--concurrency", str(n), "--metrics-port", "0",
                    "--health-port", "0",
                ],
                stdout=subprocess.DEVNULL,
                stderr=err,
                preexec_fn=low_limit,
            )  # fmt: skip
        port_of_redis = int(redis_url.rsplit(":", 1)[1].split("/")[0])
        end = time.monotonic() + 60
        while call(port_of_redis, [["LLEN", DEFAULT_RESULT_LIST]], timeout=5)[0] != n:
            assert time.monotonic() < end, log.read_text()
            assert serve.poll() is None, log.read_text()
            time.sleep(0.2)
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(30) == 0, log.read_text()
        (records,) = call(port_of_redis, [["LRANGE", DEFAULT_RESULT_LIST, "0", "-1"]], timeout=5)
    finally:
        for proc in (serve, sim):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert isinstance(records, list)
    statuses = sorted(json.loads(r)["status_code"] for r in records)
    assert statuses == [200] * n
    text = log.read_text()
    assert "unreachable" not in text
    short = [m for m in text.splitlines() if "too many open files" in m]
    (line,) = [m for m in short if "cannot open a connection" in m]
    # A Redis connection opened while the files ran out says so too, and blames no one else.
    for other in short:
        assert other == line or "open-file limit, not Redis" in other, other
    assert line.split(" ", 3)[2] == "WARNING", line
    assert re.fullmatch(
        rf"claimkit: queue fd: cannot open a connection: too many open files "
        rf"\(limit {limit}\); \d+ requests? handed back \(nothing was sent\) and claiming "
        r"waits 1 s; raise the open-file limit \(ulimit -n, systemd LimitNOFILE=\) or "
        r"lower --concurrency \(docs/performance.md#how-to-size-concurrency\)",
        line.split(" ", 3)[3],
    ), line


async def submit(redis_url: str, n: int) -> None:
    deadline = int(time.time()) + 600
    async with open_store(redis_url) as store:
        await Producer(store, "fd").submit_many(
            {"id": f"req-{i:04d}", "deadline": deadline, "payload": {"prompt": "x"}}
            for i in range(n)
        )
