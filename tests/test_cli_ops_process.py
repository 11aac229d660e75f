"""The operator commands as an operator runs them: the installed ``claimkit`` console
script, next to live ``claimkit serve`` consumers and the ``claimkit sim`` gateway.

- the entry point answers ``--help``, ``inspect --json`` and a one-line Redis error;
- ``inspect --watch`` ends cleanly on Ctrl-C (SIGINT);
- ``drain --release-all`` while two consumers hold claims (a gateway that answers only
  when the test lets it): every claim is handed back, then every request ends with
  exactly one record, nothing lost, nothing doubled;
- ``reclaim --once`` after every consumer was SIGKILLed: all expired claims, a backlog
  larger than one script batch included, are back in pending at their original scores.

Every process is started here and stopped by its PID. Waiting is done by polling Redis
state against an absolute deadline.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pytest
from held_gateway import held_gateway
from support import do, redis, wait_until

from claimkit.producer import Producer
from claimkit.protocol.models import Envelope, parse_member
from claimkit.protocol.ops import CHUNK, QueueOps, new_token

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

    from claimkit.store import Store

pytestmark = pytest.mark.slow

T = TypeVar("T")
Q = "jobs"
CLAIMKIT = Path(sys.executable).with_name("claimkit")
START_TIMEOUT = 20.0  # seconds for a child process to come up


class Children:
    """Child processes of one test, output in files, all killed by PID at teardown."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        out = (self.directory / f"{name}.out").open("wb")
        err = (self.directory / f"{name}.err").open("wb")
        proc = subprocess.Popen([str(CLAIMKIT), *args], stdout=out, stderr=err)
        out.close()
        err.close()
        self.procs.append(proc)
        return proc

    def output(self, name: str, stream: str = "out") -> str:
        return (self.directory / f"{name}.{stream}").read_text(errors="replace")

    def start_sim(self, *args: str) -> str:
        proc = self.start("sim", "sim", "--port", "0", *args)
        found: list[str] = []

        def listening() -> bool:
            assert proc.poll() is None, self.output("sim", "err")
            found[:] = re.findall(r"listening on (http://\S+)", self.output("sim"))
            return bool(found)

        wait_until("the simulator to listen", listening, START_TIMEOUT)
        return found[0]

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


@pytest.fixture
def children(tmp_path: Path) -> Iterator[Children]:
    kids = Children(tmp_path)
    try:
        yield kids
    finally:
        kids.close()


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(CLAIMKIT), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
        check=False,
    )


def serve_config(url: str, gateway: str, **extra: Any) -> str:
    doc: dict[str, Any] = {
        "url": url,
        "queues": [{"queue_name": Q, "igw_base_url": gateway}],
        "metrics_port": 0,
        "health_port": 0,
        "poll_interval_ms": 50,
        "batch_size": 20,
    }
    doc.update(extra)
    return json.dumps(doc)


async def server_time(store: Store) -> float:
    sec, usec = await store.command("TIME")
    return int(sec) + int(usec) / 1_000_000


def submit(url: str, ids: Sequence[str], deadline: int) -> None:
    async def go(store: Store) -> None:
        await Producer(store, Q).submit_many(
            [
                {"id": rid, "deadline": deadline, "payload": {"id": rid, "prompt": "x"}}
                for rid in ids
            ]
        )

    redis(url, go)


def test_the_console_script_runs_the_operator_commands(redis_url: str) -> None:
    assert CLAIMKIT.is_file(), f"the claimkit console script is not installed at {CLAIMKIT}"
    top = run_cli("--help")
    assert top.returncode == 0
    for command in ("inspect", "drain", "reclaim", "dead", "results", "cancel"):
        assert command in top.stdout
    do(redis_url, ("ZADD", Q, 1_900_000_000, b'{"data":{"id":"a","deadline":1900000000}}'))
    shown = run_cli("inspect", "-q", Q, "--json", env={"REDIS_URL": redis_url})
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["counts"]["pending"] == 1
    down = run_cli(
        "reclaim",
        "--once",
        "--transport-config",
        serve_config("redis://ops:hunter2@127.0.0.1:1/0", "http://127.0.0.1:9"),
    )
    assert down.returncode == 1
    assert down.stdout == ""
    warning, failure = down.stderr.splitlines()  # exactly two lines
    assert warning.startswith("claimkit: warning: --transport-config holds a Redis password")
    assert failure.startswith("claimkit: Redis at redis://ops:***@127.0.0.1:1/0 is unavail")
    assert "hunter2" not in down.stderr


def test_inspect_watch_ends_cleanly_on_ctrl_c(redis_url: str, children: Children) -> None:
    async def seed(store: Store) -> None:
        await store.command("ZADD", Q, 1_900_000_000, b'{"data":{"id":"a","deadline":1}}')

    redis(redis_url, seed)
    do(redis_url, ("CONFIG", "RESETSTAT"))
    proc = children.start(
        "watch", "inspect", "-q", Q, "--watch", "--interval", "0.1", "--redis-url", redis_url
    )

    def snapshots_taken() -> int:
        # The inspect script calls ZCOUNT once per snapshot: count them in Redis's stats.
        stats = do(redis_url, ("INFO", "commandstats"))[0].decode()
        found = re.search(r"cmdstat_zcount:calls=(\d+)", stats)
        assert proc.poll() is None, children.output("watch", "err")
        return int(found.group(1)) if found else 0

    wait_until("the watcher to redraw twice", lambda: snapshots_taken() >= 2, START_TIMEOUT)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=20) == 0
    out = children.output("watch")
    assert f"queue {Q}" in out
    assert "pending 1" in out
    assert "Traceback" not in children.output("watch", "err")


def test_drain_release_all_under_live_consumers(redis_url: str, children: Children) -> None:
    """Two live consumers hold every claim they can (the gateway answers nothing until the
    test releases it), ``drain --release-all`` hands each back, then the work finishes:
    one record per request. The claims cannot end before the drain subprocess runs."""
    n, concurrency = 240, 40
    held = 2 * concurrency
    deadline = int(redis(redis_url, server_time)) + 600
    ids = [f"req-{i:04d}" for i in range(n)]
    submit(redis_url, ids, deadline)
    with held_gateway() as gateway:
        # A 90 s lease and a 90 s liveness TTL: the first heartbeat (30 s) comes long after
        # the drain.
        transport = serve_config(
            redis_url,
            gateway.url,
            claim_lease_ttl_seconds=90,
            consumer_liveness_ttl_seconds=90,
            concurrency=concurrency,
        )
        consumers = [
            children.start(f"serve{i}", "serve", "--transport-config", transport) for i in (1, 2)
        ]
        # Each consumer fills its slots, then waits on the gateway with its claims held.
        arrived = gateway.wait_arrivals(held, START_TIMEOUT)
        assert set(arrived) <= set(ids)
        assert set(arrived.values()) == {1}
        state = ("ZCARD", Q), ("ZCARD", f"{Q}:claims-idx"), ("HLEN", f"{Q}:claim-owners")
        assert do(redis_url, *state) == [n - held, held, held]

        drained = run_cli("drain", "-q", Q, "--release-all", "--redis-url", redis_url)
        assert drained.returncode == 0, drained.stderr
        assert drained.stdout.splitlines()[-1] == (
            f"claimkit drain {Q}: released={held} of {held} claims gone=0 renewed=0 "
            "other_owner=0 ghosts=0"
        )
        assert do(redis_url, *state) == [n, 0, 0]  # every claim back in pending

        gateway.release()

        def finished() -> bool:
            llen, pending, index = do(
                redis_url, ("LLEN", "result-list"), ("ZCARD", Q), ("ZCARD", f"{Q}:claims-idx")
            )
            return (llen, pending, index) == (n, 0, 0)

        wait_until("every request's record", finished, 90)
        for proc in consumers:
            proc.send_signal(signal.SIGTERM)
        for proc in consumers:
            assert proc.wait(timeout=30) == 0
    records = [json.loads(r) for r in do(redis_url, ("LRANGE", "result-list", 0, -1))[0]]
    assert Counter(r["id"] for r in records) == Counter(ids), "nothing lost, nothing doubled"
    not_ok = [r for r in records if r.get("status_code") != 200]
    assert not_ok == []
    leftovers = do(
        redis_url,
        ("EXISTS", Q, f"{Q}:claimed", f"{Q}:claim-owners", f"{Q}:claims-idx", f"{Q}:dead"),
    )
    assert leftovers == [0]


def test_reclaim_once_after_every_consumer_was_killed(redis_url: str, children: Children) -> None:
    gateway = children.start_sim("--rate-hang", "1.0")  # requests are never answered
    now = redis(redis_url, server_time)
    live_ids = [f"live-{i:03d}" for i in range(40)]
    submit(redis_url, live_ids, int(now) + 3600)
    # Their liveness entries outlive the test (60 s): the run hands nothing on by fast
    # failover and has no lapsed consumer to report; every claim comes back by its lease.
    transport = serve_config(
        redis_url,
        gateway,
        claim_lease_ttl_seconds=3,
        concurrency=20,
        consumer_liveness_ttl_seconds=60,
    )
    consumers = [
        children.start(f"serve{i}", "serve", "--transport-config", transport) for i in (1, 2)
    ]

    def all_claimed() -> bool:
        return do(redis_url, ("ZCARD", Q), ("ZCARD", f"{Q}:claims-idx")) == [0, len(live_ids)]

    wait_until("the consumers to claim every request", all_claimed, START_TIMEOUT)
    for proc in consumers:
        proc.kill()  # SIGKILL: no sweep, the claims stay until their leases lapse
        proc.wait(timeout=10)

    # A third consumer died long ago with a backlog larger than one script batch.
    backlog = 2 * CHUNK + 100

    async def dead_consumer(store: Store) -> None:
        ops = QueueOps(store, Q)
        base = int(await server_time(store)) + 7200
        members = [
            json.dumps(
                {
                    "internal": {},
                    "request_kind": "plain",
                    "data": {"id": f"old-{i:04d}", "deadline": base + i},
                },
                separators=(",", ":"),
            ).encode()
            for i in range(backlog)
        ]
        await store.pipeline(
            [("ZADD", Q, base + i, m) for i, m in enumerate(members)], transaction=True
        )
        envs = [parse_member(m) for m in members]
        assert all(isinstance(e, Envelope) for e in envs)
        _, codes = await ops.claim([(e, new_token()) for e in envs if isinstance(e, Envelope)], 1)
        assert codes == [1] * backlog

    # What every claim must return to: its claimed bytes at its original score.
    redis(redis_url, dead_consumer)
    claimed = do(redis_url, ("HGETALL", f"{Q}:claimed"))[0]
    expected = {
        claimed[rid]: float(claimed[rid + b":score"])
        for rid in claimed
        if not rid.endswith(b":score")
    }
    assert len(expected) == len(live_ids) + backlog

    async def all_expired(store: Store) -> bool:
        t = await server_time(store)
        lapsed = await store.command("ZCOUNT", f"{Q}:claims-idx", "-inf", repr(t))
        return int(lapsed) == len(expected)

    wait_until("every lease to lapse", lambda: redis(redis_url, all_expired), 30)
    result = run_cli("reclaim", "--once", "--transport-config", transport)

    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        f"claimkit reclaim: queues=1 redelivered={len(expected)} dead_lettered=0 ghosts=0 "
        "leases_restored=0 handed_on=0\n"
    )
    assert result.stderr == ""
    pending = {m: float(s) for m, s in do(redis_url, ("ZRANGE", Q, 0, -1, "WITHSCORES"))[0]}
    assert pending == expected
    exists, deliveries = do(
        redis_url,
        ("EXISTS", f"{Q}:claimed", f"{Q}:claim-owners", f"{Q}:claims-idx", f"{Q}:dead"),
        ("HVALS", f"{Q}:deliveries"),
    )
    assert exists == 0
    assert deliveries == [b"1"] * len(expected)
