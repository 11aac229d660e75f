"""``claimkit reclaim --once --textfile/--pushgateway`` (docs/metrics.md#reclaim-once-metrics):
what the run did, when, and the queue-wide gauges, in a node-exporter textfile written
atomically and in a real Pushgateway; an export that fails is one line and exit status 1
with the reclaim still done; bad options are refused before anything runs."""

from __future__ import annotations

import http.server
import json
import math
import threading
from typing import TYPE_CHECKING

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_tools import Pushgateway, fetch
from support import closed_port, config_json, do, invoke, member, one_line_error, server_now_sync

from claimkit.config import load_config
from claimkit.ops.acl import acl_rule

if TYPE_CHECKING:
    from collections.abc import Sequence
    from pathlib import Path

    from conftest import RedisFactory

    from claimkit.store import Arg

Q = "jobs"
SUMMARY = (
    "claimkit reclaim: queues=2 redelivered=2 dead_lettered=1 ghosts=0 leases_restored=0 "
    "handed_on=0\n"
)


def claim(queue: str, rid: str, *, expiry: float, score: int) -> list[Sequence[Arg]]:
    return [
        ("HSET", f"{queue}:claimed", rid, member(rid, score), f"{rid}:score", score),
        ("HSET", f"{queue}:claim-owners", rid, "t" * 32),
        ("ZADD", f"{queue}:claims-idx", repr(expiry), rid),
    ]


def scenario(url: str) -> tuple[str, int]:
    """jobs: 2 expired claims (one at max_deliveries), 1 live one, 1 pending; other: 1
    expired claim; 2 in the shared retry set."""
    now = server_now_sync(url)
    base = int(now)
    do(
        url,
        ("ZADD", Q, base + 50, member("p", base + 50)),
        *claim(Q, "a", expiry=now - 1, score=base + 100),
        *claim(Q, "poison", expiry=now - 2, score=base + 200),
        *claim(Q, "live", expiry=base + 300, score=base + 300),
        *claim("other", "b", expiry=now - 3, score=base + 400),
        ("HSET", f"{Q}:deliveries", "poison", 2),
        ("ZADD", "retry-sortedset", base, b"r1", base, b"r2"),
    )
    transport = config_json(
        url,
        max_deliveries=3,
        queues=[
            {"queue_name": Q, "igw_base_url": "http://h:1"},
            {"queue_name": "other", "igw_base_url": "http://h:1"},
        ],
    )
    return transport, base


def samples(text: str, **only: str) -> dict[tuple[str, str], float]:
    """``(metric name, queue_name)`` -> value of every sample in ``text`` whose labels
    include ``only``."""
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "queue_name" in s.labels and all(s.labels.get(k) == v for k, v in only.items()):
                out[(s.name.removeprefix("llm_d_async_"), s.labels["queue_name"])] = s.value
    return out


def check_exported(found: dict[tuple[str, str], float], base: int) -> None:
    """The exact figures of :func:`scenario` after one run (times relative to the run's
    finish, the server clock the same reply gave)."""
    done = {q: found.pop(("async_reclaim_last_run_timestamp_seconds", q)) for q in (Q, "other")}
    assert base <= done[Q] < base + 60
    nan = [k for k, v in found.items() if isinstance(v, float) and math.isnan(v)]
    assert sorted(nan) == [
        ("async_queue_lease_headroom_seconds", "other"),  # no claim held
        ("async_queue_oldest_pending_age_seconds", Q),  # no member carries data.created
        ("async_queue_oldest_pending_age_seconds", "other"),
    ]
    for key in nan:
        del found[key]
    assert found == {
        ("async_reclaim_last_run_redelivered", Q): 1.0,
        ("async_reclaim_last_run_redelivered", "other"): 1.0,
        ("async_reclaim_last_run_dead_lettered", Q): 1.0,
        ("async_reclaim_last_run_dead_lettered", "other"): 0.0,
        ("async_reclaim_last_run_leases_restored", Q): 0.0,
        ("async_reclaim_last_run_leases_restored", "other"): 0.0,
        ("async_reclaim_last_run_handed_on", Q): 0.0,
        ("async_reclaim_last_run_handed_on", "other"): 0.0,
        ("async_queue_pending", Q): 2.0,  # p, and a redelivered
        ("async_queue_pending", "other"): 1.0,
        ("async_queue_claimed", Q): 1.0,  # live
        ("async_queue_claimed", "other"): 0.0,
        ("async_queue_claims_expired", Q): 0.0,
        ("async_queue_claims_expired", "other"): 0.0,
        ("async_queue_pending_deadline_headroom_seconds", Q): base + 50 - done[Q],
        ("async_queue_pending_deadline_headroom_seconds", "other"): base + 400 - done["other"],
        ("async_queue_lease_headroom_seconds", Q): base + 300 - done[Q],
        ("async_queue_consumers_alive", Q): 0.0,
        ("async_queue_consumers_alive", "other"): 0.0,
        ("async_retry_set_size", Q): 2.0,  # standalone: the one retry set both share
        ("async_retry_set_size", "other"): 2.0,
        ("async_retry_dead_size", Q): 0.0,
        ("async_retry_dead_size", "other"): 0.0,
        ("async_dead_set_size", Q): 1.0,
        ("async_dead_set_size", "other"): 0.0,
    }


def test_textfile_holds_what_the_run_did(redis_url: str, tmp_path: Path) -> None:
    transport, base = scenario(redis_url)
    path = tmp_path / "claimkit.prom"
    result = invoke(["reclaim", "--once", "--transport-config", transport, "--textfile", str(path)])
    assert result.exit_code == 0, result.output
    assert (result.stdout, result.stderr) == (SUMMARY, "")
    text = path.read_text()
    # The text format, HELP and TYPE lines first: what the node exporter's collector reads.
    assert text.startswith(
        "# HELP llm_d_async_async_reclaim_last_run_redelivered Expired claims the last "
        "reclaim --once run put back in pending\n"
        "# TYPE llm_d_async_async_reclaim_last_run_redelivered gauge\n"
        f'llm_d_async_async_reclaim_last_run_redelivered{{queue_name="{Q}"}} 1.0\n'
        'llm_d_async_async_reclaim_last_run_redelivered{queue_name="other"} 1.0\n'
    )
    check_exported(samples(text), base)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["claimkit.prom"]  # no temp file left
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    # A second run replaces the file whole.
    again = invoke(["reclaim", "--once", "--transport-config", transport, "--textfile", str(path)])
    assert again.exit_code == 0, again.output
    found = samples(path.read_text())
    assert found[("async_reclaim_last_run_redelivered", Q)] == 0.0
    assert found[("async_queue_pending", Q)] == 2.0


@pytest.mark.slow
def test_pushgateway_receives_what_the_run_did(redis_url: str, tmp_path: Path) -> None:
    transport, base = scenario(redis_url)
    with Pushgateway(tmp_path) as gateway:
        args = ["reclaim", "--once", "--transport-config", transport]
        result = invoke([*args, "--pushgateway", gateway.url, "--push-job", "cron-test"])
        assert result.exit_code == 0, result.output
        assert (result.stdout, result.stderr) == (SUMMARY, "")
        text = fetch(gateway.url + "/metrics").decode()
    found = samples(text, job="cron-test")
    # The Pushgateway adds its own push_time_seconds / push_failure_time_seconds series.
    found = {k: v for k, v in found.items() if not k[0].startswith("push_")}
    check_exported(found, base)


def test_a_failed_push_is_one_line_and_the_reclaim_stays_done(redis_url: str) -> None:
    transport, base = scenario(redis_url)
    gateway = f"http://127.0.0.1:{closed_port()}"
    result = invoke(
        ["reclaim", "--once", "--transport-config", transport, "--pushgateway", gateway]
    )
    assert result.exit_code == 1
    assert result.stdout == SUMMARY
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"claimkit: reclaim: cannot push to --pushgateway {gateway}: ")
    assert lines[0].endswith(" (the reclaim run itself is done)")
    assert "Traceback" not in result.output
    assert do(redis_url, ("ZRANGE", Q, 0, -1))[0] == [
        member("p", base + 50),
        member("a", base + 100),
    ]


def test_a_textfile_that_cannot_be_written_is_one_line_and_the_reclaim_stays_done(
    redis_url: str, tmp_path: Path
) -> None:
    transport, _ = scenario(redis_url)
    path = tmp_path / "missing" / "claimkit.prom"
    result = invoke(["reclaim", "--once", "--transport-config", transport, "--textfile", str(path)])
    assert result.exit_code == 1
    assert result.stdout == SUMMARY
    assert result.stderr == (
        f"claimkit: reclaim: cannot write --textfile {path}: No such file or directory"
        " (the reclaim run itself is done)\n"
    )
    assert do(redis_url, ("ZCARD", f"{Q}:claims-idx"))[0] == 1  # only the live claim left


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--push-job", "x"], "--push-job needs --pushgateway"),
        (["--pushgateway", "http://h:1", "--push-job", " "], "--push-job must not be empty"),
        (
            ["--textfile", "/tmp/claimkit.txt"],
            "--textfile must name a file ending in .prom (the node exporter reads only "
            "those), got '/tmp/claimkit.txt'",
        ),
        (
            ["--pushgateway", "ftp://h:1"],
            "--pushgateway must be an http:// or https:// URL with a host, got 'ftp://h:1'",
        ),
        (
            ["--pushgateway", "http://"],
            "--pushgateway must be an http:// or https:// URL with a host, got 'http://'",
        ),
    ],
)
def test_bad_export_options_are_refused_before_anything_runs(
    redis_url: str, args: list[str], line: str
) -> None:
    transport, _ = scenario(redis_url)
    before = do(redis_url, ("ZCARD", f"{Q}:claims-idx"))[0]
    one_line_error(invoke(["reclaim", "--once", "--transport-config", transport, *args]), line, 2)
    assert do(redis_url, ("ZCARD", f"{Q}:claims-idx"))[0] == before == 3


def test_gauges_that_cannot_be_read_still_export_the_run(
    redis_factory: RedisFactory, tmp_path: Path
) -> None:
    """A user that may reclaim but not read the gauges (its rule lacks ZCOUNT): the run is
    done and printed, the file holds the run's counts, then one line and exit status 1."""
    server = redis_factory()
    transport, base = scenario(server.url)
    rule = acl_rule(load_config(inline=transport), "operator").rule()
    do(server.url, ("ACL", "SETUSER", "cron", "on", ">pw", *rule.split(), "-zcount"))
    url = server.url.replace("redis://", "redis://cron:pw@")
    path = tmp_path / "claimkit.prom"
    args = ["reclaim", "--once", "--textfile", str(path), "--transport-config"]
    doc = json.loads(transport)
    del doc["url"]  # the password goes in $REDIS_URL, not on the command line
    result = invoke([*args, json.dumps(doc)], url)
    assert result.exit_code == 1
    assert result.stdout == SUMMARY
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("claimkit: reclaim: cannot read the queue-wide gauges: ")
    assert "zcount" in lines[0].lower()
    assert lines[0].endswith(
        "; the run's counts were exported without them (the reclaim run itself is done)"
    )
    found = samples(path.read_text())
    stamp = found.pop(("async_reclaim_last_run_timestamp_seconds", Q))
    assert base - 60 < stamp < base + 600  # this machine's clock
    assert found[("async_reclaim_last_run_redelivered", Q)] == 1.0
    assert not any(name.startswith("async_queue_") for name, _q in found)


class _Refuse(http.server.BaseHTTPRequestHandler):
    def do_PUT(self) -> None:  # the push
        self.send_response(503, "Gone Fishing")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        del format, args


def test_a_push_the_gateway_refuses_names_its_status(redis_url: str) -> None:
    transport, _ = scenario(redis_url)
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refuse) as refusing:
        thread = threading.Thread(target=refusing.serve_forever, daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{refusing.server_address[1]}"
        try:
            args = ["reclaim", "--once", "--transport-config", transport]
            result = invoke([*args, "--pushgateway", url])
        finally:
            refusing.shutdown()
            thread.join(10)
    assert result.exit_code == 1
    assert result.stdout == SUMMARY
    assert result.stderr == (
        f"claimkit: reclaim: cannot push to --pushgateway {url}: HTTP 503 Gone Fishing"
        " (the reclaim run itself is done)\n"
    )
