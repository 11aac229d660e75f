"""A real Prometheus scrapes a running ``claimkit serve`` and a Pushgateway that
``claimkit reclaim --once`` pushed to (docs/metrics.md#queue-wide-gauges,
docs/metrics.md#reclaim-once-metrics): the queue-wide gauges it stores equal the Redis state
exactly, claims whose owner is gone included, and the cron run's redeliveries are visible.

Debian's ``prometheus`` and ``prometheus-pushgateway`` binaries: skipped where missing,
failed under CI (:mod:`prometheus_tools`)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from prometheus_tools import Prometheus, Pushgateway, binary, fetch, poll_until
from support import do, free_port, member, server_now_sync
from test_deploy_monitoring import dashboard_exprs

if TYPE_CHECKING:
    from collections.abc import Iterator

pytestmark = pytest.mark.slow

CLAIMKIT = str(Path(sys.executable).with_name("claimkit"))
Q = "q"
SERVE_ID = "a-serve"
FAR = 4102444800  # 2100-01-01
DAY_MS = 86_400_000

GAUGES = {
    "pending": "llm_d_async_async_queue_pending",
    "claimed": "llm_d_async_async_queue_claimed",
    "expired": "llm_d_async_async_queue_claims_expired",
    "dead": "llm_d_async_async_dead_set_size",
    "retry": "llm_d_async_async_retry_set_size",
    "retry_dead": "llm_d_async_async_retry_dead_size",
    "alive": "llm_d_async_async_queue_consumers_alive",
}


def claim(rid: str, expiry: float) -> list[tuple[Any, ...]]:
    return [
        ("HSET", f"{Q}:claimed", rid, member(rid, FAR), f"{rid}:score", FAR),
        ("HSET", f"{Q}:claim-owners", rid, "f" * 32),  # an owner that is not this serve
        ("ZADD", f"{Q}:claims-idx", repr(expiry), rid),
    ]


def redis_state(url: str) -> dict[str, int]:
    """What Redis holds now, by the gauge it should show in."""
    now = server_now_sync(url)
    replies = do(
        url,
        ("ZCARD", Q),
        ("HLEN", f"{Q}:claim-owners"),
        ("ZCOUNT", f"{Q}:claims-idx", "-inf", repr(now)),
        ("ZCARD", f"{Q}:dead"),
        ("ZCARD", "retry-sortedset"),
        ("ZCARD", "retry-sortedset:dead"),
        ("ZCOUNT", f"{Q}:consumers", repr(now), "+inf"),
    )
    return dict(zip(GAUGES, (int(r) for r in replies), strict=True))


def scraped(prometheus: Prometheus, job: str | None = None) -> dict[str, int]:
    """The gauges Prometheus holds for queue ``q``, folded as docs/metrics.md advises."""
    out = {}
    where = f'queue_name="{Q}"' + (f',job="{job}"' if job else "")
    for key, name in GAUGES.items():
        values = prometheus.values(f"max by (queue_name) ({name}{{{where}}})")
        if Q not in values:
            return {}
        out[key] = int(values[Q])
    return out


@contextlib.contextmanager
def serving(redis_url: str, log: Path) -> Iterator[int]:
    """``claimkit serve`` on a paused queue (it claims nothing) whose reclaimer runs once
    at start and then not for a day; its metrics port. A port free a moment ago may be
    taken before serve binds it: serve then exits with one line, and another port is
    tried; the port is the one serve's start line names, so the scrape reaches it."""
    for _attempt in range(5):
        port = free_port()
        config = {
            "poll_interval_ms": 100,
            "claim_reclaim_interval_ms": DAY_MS,
            "metrics_port": port,
            "health_port": 0,
            "http_host": "127.0.0.1",
            "queues": [{"queue_name": Q, "igw_base_url": "http://127.0.0.1:9"}],
        }
        with log.open("w") as err:
            proc = subprocess.Popen(
                [
                    CLAIMKIT,
                    "serve",
                    "--transport-config",
                    json.dumps(config),
                    # Sorts before the seeded "c-1": this serve is the queue's exporter.
                    "--consumer-id",
                    SERVE_ID,
                ],
                stdout=subprocess.DEVNULL,
                stderr=err,
                env={**os.environ, "REDIS_URL": redis_url},
            )
        line = f"(metrics {port},"

        def started(proc: subprocess.Popen[bytes] = proc, line: str = line) -> str | bool:
            return "exited" if proc.poll() is not None else line in log.read_text()

        try:
            if poll_until("serve to start or exit", started) is True:
                yield port
                return
        finally:
            proc.kill()
            proc.wait(10)
    raise AssertionError(f"serve found no free metrics port: {log.read_text()}")


def test_prometheus_sees_the_redis_state_and_the_cron_reclaim(
    redis_url: str, tmp_path: Path
) -> None:
    binary("prometheus")  # skip (or fail under CI) before anything starts
    binary("prometheus-pushgateway")
    log = tmp_path / "serve.log"
    now = server_now_sync(redis_url)
    base = int(now)
    pause = json.dumps({"since": now, "reason": "scrape test"})
    do(
        redis_url,
        ("SET", f"{Q}:paused", pause),
        *[("ZADD", Q, FAR + i, member(f"p{i}", FAR + i)) for i in range(3)],
        ("ZADD", f"{Q}:dead", base, b"d1", base, b"d2"),
        *[("ZADD", "retry-sortedset", FAR, f"r{i}".encode()) for i in range(4)],  # due in 2100
        ("ZADD", "retry-sortedset:dead", base, b"rd"),
        ("ZADD", f"{Q}:consumers", FAR, "c-1"),
        *claim("sentinel", now - 10),
    )
    with serving(redis_url, log) as port:
        poll_until(
            "serve's registry entry",
            lambda: do(redis_url, ("ZSCORE", f"{Q}:consumers", SERVE_ID))[0] is not None,
        )
        # The reclaimer's run at start redelivers the sentinel; the next run is a day away.
        poll_until(
            "serve's first reclaim",
            lambda: do(redis_url, ("ZSCORE", Q, member("sentinel", FAR)))[0] is not None,
        )
        # Two claims of an owner that is gone, whose leases run out in a moment, and a live one.
        soon = server_now_sync(redis_url) + 1.5
        do(redis_url, *claim("x", soon), *claim("y", soon), *claim("z", FAR))
        poll_until("the two leases to run out", lambda: server_now_sync(redis_url) > soon)
        expected = {
            "pending": 4,
            "claimed": 3,
            "expired": 2,
            "dead": 2,
            "retry": 4,
            "retry_dead": 1,
            "alive": 2,  # c-1 and the serve itself
        }
        assert redis_state(redis_url) == expected

        with Pushgateway(tmp_path / "push") as gateway:
            targets = [f"127.0.0.1:{port}", f"127.0.0.1:{gateway.port}"]
            with Prometheus(tmp_path / "prom", targets, honor_labels=True) as prometheus:
                poll_until(
                    "Prometheus to hold the queue-wide gauges",
                    lambda: scraped(prometheus, "claimkit") == expected,
                )
                assert scraped(prometheus, "claimkit") == redis_state(redis_url)
                build = prometheus.query("llm_d_async_claimkit_build_info")
                assert [r["metric"]["version"] for r in build] == ["0.1.0"]
                # Every dashboard query is one this Prometheus accepts, and the queue panels
                # show the queue.
                for expr in dashboard_exprs():
                    if not expr.startswith("label_values"):
                        prometheus.query(expr.replace("$queue", ".*"))
                pending = prometheus.values(dashboard_exprs()[0].replace("$queue", ".*"))
                assert pending == {Q: 4.0}

                reclaim = subprocess.run(
                    [
                        CLAIMKIT,
                        "reclaim",
                        "--once",
                        "--transport-config",
                        json.dumps({"queues": [{"queue_name": Q, "igw_base_url": "http://h:1"}]}),
                        "--pushgateway",
                        gateway.url,
                    ],
                    env={**os.environ, "REDIS_URL": redis_url},
                    capture_output=True,
                    text=True,
                    timeout=60,
                    check=False,
                )
                assert reclaim.returncode == 0, reclaim.stderr
                assert reclaim.stdout == (
                    "claimkit reclaim: queues=1 redelivered=2 dead_lettered=0 ghosts=0 "
                    "leases_restored=0 handed_on=0\n"
                )
                after = {**expected, "pending": 6, "claimed": 1, "expired": 0}
                assert redis_state(redis_url) == after
                assert b"claimkit-reclaim" in fetch(gateway.url + "/metrics")

                def cron_seen() -> bool:
                    redelivered = prometheus.values(
                        'llm_d_async_async_reclaim_last_run_redelivered{job="claimkit-reclaim"}'
                    )
                    return (
                        redelivered == {Q: 2.0} and scraped(prometheus, "claimkit-reclaim") == after
                    )

                poll_until("the cron run's push to be scraped", cron_seen)
                # serve's next sample (every 5 s) shows the same.
                poll_until(
                    "serve's gauges after the reclaim",
                    lambda: scraped(prometheus, "claimkit") == after,
                )
    assert "Traceback" not in log.read_text()
