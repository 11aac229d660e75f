"""`claimkit serve` raises its soft open-file limit (RLIMIT_NOFILE) to the hard one, and warns
in one line when that is still below what ``--concurrency`` needs
(docs/performance.md#how-to-size-concurrency)."""

from __future__ import annotations

import json
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from claimkit.config import Config, QueueConfig
from claimkit.consumer.serve import FD_RESERVE, fds_needed

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
        f"request in flight, plus {FD_RESERVE}); past it connects fail as if the gateway "
        "were unreachable: raise the hard limit (ulimit -Hn, systemd LimitNOFILE=, the "
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
