"""``claimkit demo``: the durability demo (the README's first command, ``nox -s demo``).

One run, on this machine only, with nothing shared:

1. a private Redis (AOF ``appendfsync always``) in a temporary directory;
2. the gateway simulator (``claimkit sim``), answering after 0.2-0.6 s, so claims are held
   for a while;
3. two consumers, A and B (``claimkit serve``, 3 s lease, reclaim every 500 ms);
4. ``requests`` requests submitted;
5. consumer A SIGKILLed while it holds claims: no sweep, no goodbye;
6. a wait until every request has a terminal record (B redelivers A's claims once their
   leases lapse, SPEC §3.7), then SIGTERM for B;
7. a summary table, read from Redis, B's summary line and the simulator's counters, and a
   verdict. The exit status is 0 iff no request was lost, none has two records and
   nothing is left pending, claimed, retrying or dead.

Every process it starts is stopped by its PID in a ``finally``, Ctrl-C included, and the
temporary directory is removed unless ``keep``. See ``docs/demo.md``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import trio
from rich.table import Table
from rich.text import Text

from . import _keys
from ._console import make_console
from ._producer import Producer
from ._redis_server import RedisServer
from ._store import open_store

if TYPE_CHECKING:
    from rich.console import Console

    from ._store import Store

__all__ = ["run_demo"]

QUEUE = "demo-requests"
RESULTS = "result-list"  # the default result_queue_name (SPEC §6)
RETRY_SET = "retry-sortedset"  # the default retry_queue_name (SPEC §6)
SIM_LATENCY = "0.2,0.6"  # seconds per answer, uniform: claims stay held a while
LEASE_SECONDS = 3.0  # short, so A's orphaned claims come back within seconds
RECLAIM_INTERVAL_MS = 500
HEARTBEAT_SECONDS = max(1.0, LEASE_SECONDS / 3)  # what serve derives from the lease (§3.3)
CONCURRENCY = 16  # requests in flight per consumer
POLL_INTERVAL_MS = 50
DEADLINE_SECONDS = 600  # requests' deadline, from submission
KILL_AFTER_SHARE = 0.2  # SIGKILL A once this share of the requests has a record
START_TIMEOUT = 30.0  # seconds for the simulator and a consumer to come up
FINISH_TIMEOUT = 120.0  # seconds for every request to get its record after the kill
STOP_TIMEOUT = 30.0  # seconds for B to exit on SIGTERM (its drain timeout is 10 s)
POLL_SECONDS = 0.02  # how often the demo looks at Redis and the log files

# The children run claimkit's CLI with this interpreter, so they import the same claimkit
# as the demo, whether or not a console script exists next to it. `app`, not `main`:
# `main` restores the default SIGPIPE action (for `claimkit results | head`), and a
# server with that action dies the moment it writes to a peer that hung up, which is
# what the simulator does when consumer A is killed mid-request. Python's own default
# (ignored; the write raises BrokenPipeError) is the right one for servers.
_CLAIMKIT = (sys.executable, "-c", "from claimkit._cli import app; app(prog_name='claimkit')")
_LEFT = ("pending", "claimed", "retrying", "dead")
_SUMMARY = re.compile(r"claimkit: claimed=.*")


class DemoError(RuntimeError):
    """A step of the demo could not run (a child exited, a timeout); one line."""


# -- child processes ---------------------------------------------------------------------------


class _Children:
    """The demo's child processes: output in ``<logs>/<name>.out|.err``, each in a session
    (process group) of its own so that a signal reaches it and only it, stopped by PID."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        """Start ``claimkit <args>`` as child ``name``."""
        with (
            (self.logs / f"{name}.out").open("wb") as out,
            (self.logs / f"{name}.err").open("wb") as err,
        ):
            proc = subprocess.Popen(
                [*_CLAIMKIT, *args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,  # Ctrl-C reaches the demo, which then stops them
            )
        self.procs[name] = proc
        return proc

    def output(self, name: str, stream: str = "out") -> str:
        """What child ``name`` wrote so far on ``stream`` (``out`` or ``err``)."""
        path = self.logs / f"{name}.{stream}"
        return path.read_text(errors="replace") if path.exists() else ""

    def check_alive(self, name: str) -> None:
        """Raise :class:`DemoError` quoting its stderr if child ``name`` has exited."""
        code = self.procs[name].poll()
        if code is not None:
            tail = self.output(name, "err").strip().splitlines()[-5:]
            raise DemoError(f"{name} exited with code {code}: " + " | ".join(tail))

    def signal(self, name: str, signum: signal.Signals) -> None:
        """Send ``signum`` to child ``name``'s process group, if it was not reaped yet
        (an unreaped child's PID cannot have been reused)."""
        proc = self.procs[name]
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signum)

    def kill_all(self) -> None:
        """SIGKILL every child still running and reap it. Blocking; for the ``finally``."""
        for name, proc in self.procs.items():
            self.signal(name, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)


async def _until(what: str, check: Callable[[], Awaitable[bool]], timeout: float) -> None:
    """Poll ``check`` every :data:`POLL_SECONDS` until it holds.

    Raises:
        DemoError: it did not hold within ``timeout`` seconds.
    """
    with trio.move_on_after(timeout):
        while True:  # polling another process's state: there is no event to wait on
            if await check():
                return
            await trio.sleep(POLL_SECONDS)
    raise DemoError(f"timed out after {timeout:.0f}s waiting for {what}")


async def _exit_code(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    """Wait up to ``timeout`` seconds for ``proc`` to exit; its code, or ``None``."""
    with trio.move_on_after(timeout):
        while True:
            code = proc.poll()
            if code is not None:
                return code
            await trio.sleep(POLL_SECONDS)
    return None


# -- Redis views ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ClaimSnapshot:
    """Every claim in Redis at one moment: id -> (owner token, lease expiry), and the
    redelivery counts."""

    claims: dict[str, tuple[str, float]]
    deliveries: dict[str, int]

    def redelivered_since(self, earlier: _ClaimSnapshot, rid: str) -> bool:
        return self.deliveries.get(rid, 0) > earlier.deliveries.get(rid, 0)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def _claims(store: Store) -> _ClaimSnapshot:
    keys = _keys.QueueKeys.for_queue(QUEUE)
    owners, index, deliveries = await store.pipeline(
        [
            ["HGETALL", keys.owners],
            ["ZRANGE", keys.index, 0, -1, "WITHSCORES"],
            ["HGETALL", keys.deliveries],
        ],
        transaction=True,
    )
    expiry = {_text(rid): float(score) for rid, score in index}
    return _ClaimSnapshot(
        claims={_text(r): (_text(t), expiry.get(_text(r), 0.0)) for r, t in owners.items()},
        deliveries={_text(r): int(n) for r, n in deliveries.items()},
    )


async def _claims_of_the_dead(store: Store, at_kill: _ClaimSnapshot) -> int:
    """How many of the claims in Redis at the kill were consumer A's.

    The claims carry no owner name, only a token, so A's are told apart by behaviour: a
    live owner (B) acks its claims or renews them every heartbeat, which moves their lease
    expiry; a dead owner's claims keep token and expiry until the reclaimer redelivers
    them. So, one heartbeat and a margin after the kill, A's claims are those of the kill
    snapshot that are frozen or were redelivered meanwhile.
    """
    await trio.sleep(HEARTBEAT_SECONDS + 0.5)
    now = await _claims(store)
    return sum(
        1
        for rid, claim in at_kill.claims.items()
        if now.claims.get(rid) == claim or now.redelivered_since(at_kill, rid)
    )


async def _records_done(store: Store, markers: list[str]) -> int:
    """How many of the requests have their terminal record: their ``result-terminal:<id>``
    marker is set together with the record, atomically (SPEC §3.4)."""
    count: int = await store.command("EXISTS", *markers)
    return count


# -- the run -------------------------------------------------------------------------------------


@dataclass
class _Report:
    """Everything the summary table shows."""

    submitted: int = 0
    finished: bool = False
    held_by_a: int = 0
    kill_at: float = 0.0  # seconds after submission
    done_at: float | None = None  # seconds after submission
    records: int = 0
    distinct: int = 0
    by_status: Counter[str] = field(default_factory=Counter)
    markers: int = 0
    left: dict[str, int] = field(default_factory=dict)
    redelivered_redis: int = 0
    summary_b: dict[str, int] = field(default_factory=dict)
    exit_b: int | None = None
    executions: int = 0
    ran_twice: int = 0

    @property
    def lost(self) -> int:
        return self.submitted - self.distinct

    @property
    def duplicate_records(self) -> int:
        return self.records - self.distinct

    @property
    def left_total(self) -> int:
        return sum(self.left.values())

    @property
    def ok(self) -> bool:
        return self.lost == 0 and self.duplicate_records == 0 and self.left_total == 0


def _serve_args(redis_url: str, sim_url: str) -> list[str]:
    transport = {
        "url": redis_url,
        "poll_interval_ms": POLL_INTERVAL_MS,
        "queues": [{"queue_name": QUEUE, "igw_base_url": sim_url}],
    }
    return [
        "serve",
        "--transport-config", json.dumps(transport),
        "--claim-lease-ttl", str(LEASE_SECONDS),
        "--claim-reclaim-interval", str(RECLAIM_INTERVAL_MS),
        "--concurrency", str(CONCURRENCY),
        "--metrics-port", "0",
        "--health-port", "0",
    ]  # fmt: skip


async def _start_sim(kids: _Children) -> str:
    """Start the simulator on a port it picks itself; its base URL, from its one line."""
    kids.start("sim", "sim", "--port", "0", "--latency", SIM_LATENCY)
    found: list[str] = []

    async def listening() -> bool:
        kids.check_alive("sim")
        found[:] = re.findall(r"listening on (http://\S+)", kids.output("sim"))
        return bool(found)

    await _until("the simulator to listen", listening, START_TIMEOUT)
    return found[0]


async def _start_consumers(kids: _Children, redis_url: str, sim_url: str) -> None:
    """Start consumers A and B and wait until both serve the queue."""
    for name in ("consumer-a", "consumer-b"):
        kids.start(name, *_serve_args(redis_url, sim_url))
    for name in ("consumer-a", "consumer-b"):

        async def serving(name: str = name) -> bool:
            kids.check_alive(name)
            return "claimkit: serving" in kids.output(name, "err")

        await _until(f"{name} to start", serving, START_TIMEOUT)


async def _submit(store: Store, ids: list[str]) -> None:
    deadline = int(time.time()) + DEADLINE_SECONDS
    docs = [
        # The id in the HTTP body lets the simulator count executions per request.
        {"id": rid, "deadline": deadline, "payload": {"model": "sim", "prompt": "hi", "id": rid}}
        for rid in ids
    ]
    await Producer(store, QUEUE, result_list=RESULTS).submit_many(docs)


async def _collect(store: Store, report: _Report, ids: list[str], markers: list[str]) -> None:
    """Fill the Redis figures of ``report``."""
    keys = _keys.QueueKeys.for_queue(QUEUE)
    replies = await store.pipeline(
        [
            ["LRANGE", RESULTS, 0, -1],
            ["EXISTS", *markers],
            ["ZCARD", keys.pending],
            ["HLEN", keys.owners],
            ["ZCARD", keys.index],
            ["ZCARD", RETRY_SET],
            ["ZCARD", keys.dead],
            ["HVALS", keys.deliveries],
        ],
        transaction=True,
    )
    raw, report.markers, pending, claimed, indexed, retrying, dead, deliveries = replies
    wanted = set(ids)
    records = [json.loads(r) for r in raw]
    report.records = len(records)
    report.distinct = len({r["id"] for r in records} & wanted)
    report.by_status = Counter(str(r.get("status_code", r.get("error_code"))) for r in records)
    report.left = {  # in the order of _LEFT
        "pending": pending,
        "claimed": max(claimed, indexed),
        "retrying": retrying,
        "dead": dead,
    }
    report.redelivered_redis = sum(int(n) for n in deliveries)


async def _gateway_counts(sim_url: str, report: _Report, ids: list[str]) -> None:
    async with httpx.AsyncClient(timeout=10.0) as client:
        stats = (await client.get(f"{sim_url}/stats")).json()
    calls: dict[str, int] = stats.get("calls_by_id", {})
    report.executions = sum(calls.get(rid, 0) for rid in ids)
    report.ran_twice = sum(1 for rid in ids if calls.get(rid, 0) > 1)


def _parse_summary(line_source: str) -> dict[str, int]:
    found = _SUMMARY.findall(line_source)
    if not found:
        return {}
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", found[-1])}


async def _scenario(console: Console, kids: _Children, redis_url: str, requests: int) -> _Report:
    """Steps 2 to 6: simulator, consumers, submit, kill A, wait, stop B, collect."""
    report = _Report(submitted=requests)
    sim_url = await _start_sim(kids)
    console.print(f"  gateway simulator   {sim_url}, answers after {SIM_LATENCY} s")
    await _start_consumers(kids, redis_url, sim_url)
    a, b = kids.procs["consumer-a"], kids.procs["consumer-b"]
    console.print(
        f"  consumers           A (pid {a.pid}) and B (pid {b.pid}): lease {LEASE_SECONDS:g} s, "
        f"reclaim every {RECLAIM_INTERVAL_MS} ms, {CONCURRENCY} in flight each"
    )
    ids = [f"demo-{n:05d}" for n in range(requests)]
    markers = [_keys.result_terminal(rid) for rid in ids]
    async with open_store(redis_url) as store:
        await _submit(store, ids)
        started = time.monotonic()
        console.print(f"  submitted           {requests} requests to queue {QUEUE!r}")

        threshold = max(1, int(requests * KILL_AFTER_SHARE))

        async def a_is_busy() -> bool:
            kids.check_alive("consumer-a")
            return await _records_done(store, markers) >= threshold

        await _until("the first records", a_is_busy, FINISH_TIMEOUT)
        kids.signal("consumer-a", signal.SIGKILL)
        await _exit_code(a, STOP_TIMEOUT)
        await trio.sleep(0.05)  # a command A sent just before dying may still be executing
        at_kill = await _claims(store)
        report.kill_at = time.monotonic() - started
        done = await _records_done(store, markers)
        console.print(
            f"  SIGKILL consumer A  at {report.kill_at:.2f} s, {done}/{requests} records "
            f"written, {len(at_kill.claims)} claims held by A and B"
        )
        report.held_by_a = await _claims_of_the_dead(store, at_kill)
        console.print(
            f"                      {report.held_by_a} of them were A's: they come back "
            f"when their {LEASE_SECONDS:g} s leases lapse"
        )

        async def all_done() -> bool:
            kids.check_alive("consumer-b")
            return await _records_done(store, markers) == requests

        try:
            await _until("every request's record", all_done, FINISH_TIMEOUT)
            report.finished = True
            report.done_at = time.monotonic() - started
            console.print(f"  all {requests} records   at {report.done_at:.2f} s")
        except DemoError as exc:
            console.print(f"  [bold red]{exc}[/]")
        kids.signal("consumer-b", signal.SIGTERM)
        report.exit_b = await _exit_code(b, STOP_TIMEOUT)
        console.print(f"  SIGTERM consumer B  exit status {report.exit_b}")
        report.summary_b = _parse_summary(kids.output("consumer-b"))
        await _collect(store, report, ids, markers)
    await _gateway_counts(sim_url, report, ids)
    return report


# -- the summary ---------------------------------------------------------------------------------


def _must_be_zero(value: int) -> Text:
    return Text("ok", style="green") if value == 0 else Text("FAIL", style="bold red")


def _summary_table(report: _Report) -> Table:
    """The figures, what each means, and a check where one is due."""
    b = report.summary_b
    table = Table(title="claimkit demo", title_justify="left")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("check")
    table.add_column("meaning")
    statuses = ", ".join(f"{code}: {n}" for code, n in sorted(report.by_status.items()))
    rows: list[tuple[str, str, Text | str, str]] = [
        ("submitted", str(report.submitted), "", "requests put on the queue"),
        ("records", str(report.records), "", f"terminal records in {RESULTS} ({statuses or '-'})"),
        ("distinct ids with a record", str(report.distinct), "", "requests that got a record"),
        (
            "dedup markers",
            str(report.markers),
            "",
            "result-terminal:<id> keys, set with each record",
        ),
        (
            "claims held by A when killed",
            str(report.held_by_a),
            "",
            "A's claims that nobody would ack: A died holding them",
        ),
        (
            "redelivered",
            f"{report.redelivered_redis} / {b.get('redelivered', '?')}",
            "",
            f"expired leases put back in pending ({QUEUE}:deliveries / B's summary)",
        ),
        (
            "executions at the gateway",
            str(report.executions),
            "",
            f"POSTs the simulator saw; {report.ran_twice} ids ran twice (at-least-once)",
        ),
        (
            "duplicates suppressed",
            str(b.get("duplicates_suppressed", "?")),
            "",
            "late acks refused by the dedup marker (B's summary)",
        ),
        (
            "duplicate records",
            str(report.duplicate_records),
            _must_be_zero(report.duplicate_records),
            "records - distinct ids",
        ),
        ("lost", str(report.lost), _must_be_zero(report.lost), "submitted - distinct ids"),
        (
            "left pending/claimed/retrying/dead",
            "/".join(str(report.left.get(k, "?")) for k in _LEFT),
            _must_be_zero(report.left_total),
            "what is still in Redis for the queue",
        ),
    ]
    for row in rows:
        table.add_row(*row)
    return table


def _verdict(report: _Report) -> Text:
    if report.ok:
        return Text.assemble(
            ("PASS", "bold green"),
            f": all {report.submitted} requests have exactly one terminal record; consumer A "
            f"was SIGKILLed holding {report.held_by_a} claims, lost 0.",
        )
    return Text.assemble(
        ("FAIL", "bold red"),
        f": lost {report.lost}, duplicate records {report.duplicate_records}, "
        f"left in Redis {report.left_total}.",
    )


# -- entry point ---------------------------------------------------------------------------------


@contextlib.contextmanager
def _no_interrupts() -> Iterator[None]:
    """Ignore Ctrl-C while cleaning up, so a second one cannot leave orphans behind."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupted(exc: BaseException) -> bool:
    if isinstance(exc, KeyboardInterrupt):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return all(_interrupted(inner) for inner in exc.exceptions)
    return False


def run_demo(*, requests: int = 300, keep: bool = False) -> int:
    """Run the durability demo and print its summary (``claimkit demo``).

    Starts a private Redis (AOF ``appendfsync always``), the gateway simulator and two
    consumers as child processes, submits ``requests`` requests, SIGKILLs consumer A while
    it holds claims, waits (at most 120 s) until every request has a terminal record,
    stops consumer B with SIGTERM, and prints a table and a one-line verdict.

    Args:
        requests: how many requests to submit (at least 1).
        keep: keep the temporary directory (Redis AOF, every child's output) and print
            where it is.

    Returns:
        The exit status: 0 iff lost == 0, duplicate records == 0 and nothing is left
        pending, claimed, retrying or dead; 1 otherwise or when a step fails; 2 for a bad
        argument; 130 on Ctrl-C.

    Cancellation:
        On Ctrl-C (or any error) every child process and the Redis server are killed and
        reaped before this returns, and the directory is removed unless ``keep``.
    """
    console = make_console()
    if requests < 1:
        console.print("claimkit demo: --requests must be at least 1")
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="claimkit-demo-"))
    (workdir / "logs").mkdir()
    kids = _Children(workdir / "logs")
    redis = RedisServer(aof="always", directory=workdir / "redis")
    console.print(
        f"claimkit demo: {requests} requests, two consumers, one SIGKILLed while it holds claims"
    )
    try:
        redis.start()
        console.print(f"  private Redis       {redis.url}, AOF appendfsync always, in {workdir}")
        report = trio.run(_scenario, console, kids, redis.url, requests)
    except (KeyboardInterrupt, BaseExceptionGroup) as exc:
        if not _interrupted(exc):
            raise
        console.print("claimkit demo: interrupted; stopping everything it started")
        return 130
    except (DemoError, RuntimeError) as exc:  # RedisServerError is a RuntimeError
        console.print(f"[bold red]claimkit demo failed:[/] {exc}")
        return 1
    finally:
        with _no_interrupts():
            kids.kill_all()
            redis.stop()
            if keep:
                console.print(f"  kept {workdir} (redis/, logs/)")
            else:
                shutil.rmtree(workdir, ignore_errors=True)
    console.print()
    console.print(_summary_table(report))
    console.print(_verdict(report))
    return 0 if report.ok and report.finished else 1
