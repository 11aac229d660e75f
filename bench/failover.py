"""Fast failover, end to end: two `claimkit serve`, one SIGKILLed, a real Prometheus scraping.

A private Redis server, ``claimkit sim`` answering each request after ``--latency``
seconds (60 by default: a slow gateway), two ``claimkit serve`` processes (consumer ids
``a`` and ``b``, ``--concurrency`` each, lease 300 s, the default liveness TTL of 10 s and
reclaim interval of 15 s), a private Prometheus scraping both every second and a private
Pushgateway. ``--requests`` requests are submitted; once both consumers hold claims,
``b`` is SIGKILLed. The owner tokens of ``<q>:claim-owners`` are sampled every 0.2 s
throughout. Then, once ``a`` has written every record, a second short phase submits
``--concurrency`` more requests, SIGKILLs ``a`` while it holds them, waits until its
liveness entry lapsed and runs ``claimkit reclaim --once --pushgateway``. The script prints
one JSON object:

- ``seconds_to_redelivered``: from the kill until none of the claims ``b`` held is ``b``'s
  any more (each back in pending or claimed by ``a``); expected within the liveness TTL
  plus one reclaim interval, not the 300 s lease;
- ``seconds_to_claimed_by_a``: until ``a`` held or had finished each of them (``a``'s
  slots are busy for one ``--latency`` with its own claims first);
- ``seconds_to_all_records``: from the kill until the result list held every record;
- ``live_consumer_claims_lost``: claims of ``a`` whose owner entry changed or vanished
  without their record being written (0 is the point); ``deliveries_left``: entries of
  ``<q>:deliveries`` at the end (every ack clears its own: 0);
- ``records``, ``distinct_ids``, ``duplicates``: the records at the end (0 duplicates);
- ``consumers_before`` / ``consumers_after``: ``claimkit consumers --json`` before the kill
  and once ``b``'s claims were redelivered; ``inspect_before`` / ``inspect_after``: the
  per-consumer summary of ``claimkit inspect --json``;
- ``prometheus_vs_redis``: after the redelivery, with the Redis state unchanged across the
  query, each queue-wide gauge as Prometheus answers it (``max by (queue_name)``) beside
  the same figure read from Redis, and ``seconds_to_match`` (the gauges are sampled every
  5 s); ``sum(async_claim_depth)`` is there too (the per-process figure: ``b``'s is gone);
- ``reclaim_once``: that command's ``--json`` output and the
  ``async_reclaim_last_run_redelivered`` Prometheus scraped from the Pushgateway.

Usage: ``python bench/failover.py [--latency 60] [--requests 32] [--concurrency 8]``.
Needs ``/usr/bin/prometheus`` and ``/usr/bin/prometheus-pushgateway`` (Debian packages
``prometheus`` and ``prometheus-pushgateway``). Figures: docs/performance.md, "Fast failover".
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import trio
from _benchutil import free_port, machine

from claimkit.dev.redis_server import RedisServer
from claimkit.producer import Producer
from claimkit.store import open_store

CLAIMKIT = str(Path(sys.executable).with_name("claimkit"))
PROMETHEUS = "/usr/bin/prometheus"
PUSHGATEWAY = "/usr/bin/prometheus-pushgateway"
Q = "q"
RESULTS = "result-list"
LEASE = 300.0
TTL = 10.0  # consumer_liveness_ttl_seconds, the default (left unset in the config)
RECLAIM_MS = 15000  # claim_reclaim_interval_ms, the default (left unset in the config)
SAMPLE = 0.2  # seconds between samples of the owner tokens

# Queue-wide gauge -> how the same figure is read from Redis (docs/metrics.md).
GAUGES = (
    "queue_pending",
    "queue_claimed",
    "queue_claims_expired",
    "queue_consumers_alive",
    "dead_set_size",
    "retry_set_size",
    "retry_dead_size",
)


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Server:
    """A Prometheus or Pushgateway process on a free port in ``folder``, stopped by PID."""

    def __init__(self, folder: Path, argv: Any, flags_path: str, flag: str, value: str) -> None:
        self.folder, self.argv, self.flags_path, self.flag, self.value = (
            folder,
            argv,
            flags_path,
            flag,
            value,
        )
        self.proc: trio.Process | None = None
        self.url = ""

    async def start(self, http: httpx.AsyncClient) -> None:
        for _attempt in range(5):  # a port free a moment ago may be taken before the bind
            port = free_port()
            self.url = f"http://127.0.0.1:{port}"
            with (self.folder / f"{Path(self.argv(port)[0]).name}.log").open("w") as log:
                self.proc = await trio.lowlevel.open_process(
                    self.argv(port), cwd=self.folder, stdout=log, stderr=subprocess.STDOUT
                )
            with trio.move_on_after(60):
                while self.proc.poll() is None:
                    try:
                        doc = (await http.get(self.url + self.flags_path)).json()
                        flags = doc["data"].get("flags", doc["data"])
                        if flags.get(self.flag) == self.value:  # this server, not another's
                            return
                        break
                    except (httpx.TransportError, ValueError, KeyError):
                        await trio.sleep(0.1)
            await self.stop()
        raise RuntimeError(f"{self.argv(0)[0]} did not start")

    async def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            with trio.move_on_after(20):
                await self.proc.wait()
            if self.proc.poll() is None:
                self.proc.kill()
                await self.proc.wait()


async def prom_query(http: httpx.AsyncClient, url: str, expr: str) -> float | None:
    doc = (await http.get(url + "/api/v1/query", params={"query": expr})).json()
    result = doc["data"]["result"]
    return float(result[0]["value"][1]) if result else None


async def redis_state(store: Any) -> dict[str, float]:
    """The queue-wide figures as Redis holds them now (on the server clock)."""
    sec, usec = await store.command("TIME")
    now = f"{int(sec) + int(usec) / 1e6:.6f}"
    return {
        "queue_pending": int(await store.command("ZCARD", Q)),
        "queue_claimed": int(await store.command("HLEN", f"{Q}:claim-owners")),
        "queue_claims_expired": int(await store.command("ZCOUNT", f"{Q}:claims-idx", "-inf", now)),
        "queue_consumers_alive": int(await store.command("ZCOUNT", f"{Q}:consumers", now, "+inf")),
        "dead_set_size": int(await store.command("ZCARD", f"{Q}:dead")),
        "retry_set_size": int(await store.command("ZCARD", "retry-sortedset")),
        "retry_dead_size": int(await store.command("ZCARD", "retry-sortedset:dead")),
    }


async def owners(store: Any) -> dict[str, str]:
    flat = await store.command("HGETALL", f"{Q}:claim-owners")
    if isinstance(flat, dict):
        return {text(k): text(v) for k, v in flat.items()}
    return {text(flat[i]): text(flat[i + 1]) for i in range(0, len(flat), 2)}


async def cli(env: dict[str, str], *argv: str) -> Any:
    done = await trio.run_process(
        [CLAIMKIT, *argv], env=env, capture_stdout=True, capture_stderr=True, check=False
    )
    out = done.stdout.decode()
    try:
        return json.loads(out)
    except ValueError:
        return {"exit": done.returncode, "stdout": out, "stderr": done.stderr.decode()}


def per_consumer(inspect: Any) -> Any:
    """The per-consumer part of ``inspect --json`` (the whole document if it has none)."""
    if isinstance(inspect, dict):
        for key in ("consumers", "queues"):
            if key in inspect:
                return inspect[key]
    return inspect


async def poll(check: Any, timeout: float, interval: float = 0.1) -> Any:
    """Call ``check()`` (async) every ``interval`` seconds until it returns something true;
    that value. TooSlowError after ``timeout`` seconds. Other processes' state in Redis:
    there is nothing to wait on but polling."""
    with trio.fail_after(timeout):
        while not (value := await check()):  # noqa: ASYNC110
            await trio.sleep(interval)
    return value


class Sampler:
    """The owner tokens every 0.2 s after the kill: when ``b``'s claims were handed on, and
    every claim of ``a`` whose owner entry changed or vanished with no record written."""

    def __init__(self, store: Any, held: dict[str, str], b_ids: set[str], killed: float) -> None:
        self.store, self.b_ids, self.killed = store, b_ids, killed
        self.prev = dict(held)
        self.a_seen = {i: t for i, t in held.items() if t.startswith("a/")}
        self.lost: list[dict[str, str]] = []
        self.marks: dict[str, float] = {}
        self.redelivered, self.claimed_by_a, self.stop = trio.Event(), trio.Event(), trio.Event()

    async def done(self, i: str) -> bool:
        return bool(int(await self.store.command("EXISTS", f"result-terminal:{i}")))

    async def check_a(self, now: dict[str, str]) -> None:
        for i, t in list(self.a_seen.items()):
            if now.get(i) != t:
                del self.a_seen[i]
                if not await self.done(i):  # the ack writes the marker as it drops the claim
                    self.lost.append({"id": i, "token": t, "now": now.get(i, "")})
        for i, t in now.items():
            if t.startswith("a/") and self.prev.get(i) != t:
                self.a_seen[i] = t

    async def check_b(self, now: dict[str, str]) -> None:
        at = trio.current_time() - self.killed
        if not self.redelivered.is_set() and not any(
            now.get(i, "").startswith("b/") for i in self.b_ids
        ):
            self.marks["redelivered"] = at
            self.redelivered.set()
        if self.redelivered.is_set() and not self.claimed_by_a.is_set():
            for i in self.b_ids:
                if not now.get(i, "").startswith("a/") and not await self.done(i):
                    return
            self.marks["claimed_by_a"] = at
            self.claimed_by_a.set()

    async def run(self) -> None:
        while not self.stop.is_set():
            now = await owners(self.store)
            await self.check_a(now)
            await self.check_b(now)
            self.prev = now
            await trio.sleep(SAMPLE)


class Bench:
    """One run: the processes, their ports, and what was measured (:attr:`out`)."""

    def __init__(self, args: argparse.Namespace, workdir: Path, redis_url: str) -> None:
        self.conc, self.requests, self.latency = args.concurrency, args.requests, args.latency
        self.workdir = workdir
        self.env = {**os.environ, "REDIS_URL": redis_url}
        self.gport = free_port()
        self.ports = {c: (free_port(), free_port()) for c in "ab"}  # metrics, health
        self.transport = {
            "queues": [{"queue_name": Q, "igw_base_url": f"http://127.0.0.1:{self.gport}"}]
        }
        self.procs: dict[str, trio.Process] = {}
        self.servers: list[Server] = []
        self.out: dict[str, Any] = {
            "requests": self.requests,
            "concurrency_each": self.conc,
            "gateway_latency_seconds": self.latency,
            "claim_lease_ttl_seconds": LEASE,
            "consumer_liveness_ttl_seconds": TTL,
            "claim_reclaim_interval_ms": RECLAIM_MS,
            "expected_redelivery_bound_seconds": TTL + RECLAIM_MS / 1000,
        }

    async def start_monitoring(self, http: httpx.AsyncClient) -> None:
        """The sim, a Pushgateway and a Prometheus scraping both consumers and it."""
        with (self.workdir / "sim.log").open("w") as log:
            self.procs["sim"] = await trio.lowlevel.open_process(
                [CLAIMKIT, "sim", "--port", str(self.gport), "--latency", str(self.latency)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        pg_dir, prom_dir = self.workdir / "pushgateway", self.workdir / "prometheus"
        pg_dir.mkdir()
        prom_dir.mkdir()
        pg_file = str(pg_dir / "pushgateway.data")  # not Debian's default: nothing persists
        self.pushgw = Server(
            pg_dir,
            lambda port: [
                PUSHGATEWAY,
                f"--web.listen-address=127.0.0.1:{port}",
                f"--persistence.file={pg_file}",
            ],
            "/api/v1/status",
            "persistence.file",
            pg_file,
        )
        self.servers.append(self.pushgw)
        await self.pushgw.start(http)
        targets = [f"127.0.0.1:{self.ports[c][0]}" for c in "ab"]
        config = {
            "global": {"scrape_interval": "1s"},
            "scrape_configs": [
                {"job_name": "claimkit", "static_configs": [{"targets": targets}]},
                {
                    "job_name": "pushgateway",
                    "honor_labels": True,
                    "static_configs": [{"targets": [self.pushgw.url.removeprefix("http://")]}],
                },
            ],
        }
        prom_yml = prom_dir / "prometheus.yml"
        await trio.Path(prom_yml).write_text(json.dumps(config))
        self.prom = Server(
            prom_dir,
            lambda port: [
                PROMETHEUS,
                f"--config.file={prom_yml}",
                f"--storage.tsdb.path={prom_dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            "/api/v1/status/flags",
            "config.file",
            str(prom_yml),
        )
        self.servers.append(self.prom)
        await self.prom.start(http)

    async def submit(self, store: Any, prefix: str, n: int) -> None:
        sec = int((await store.command("TIME"))[0])
        await Producer(store, Q).submit_many(
            [
                {"id": f"{prefix}{i:05d}", "deadline": sec + 7200, "payload": {"n": i}}
                for i in range(n)
            ]
        )

    async def start_consumers(self) -> None:
        for c in "ab":
            config = {
                **self.transport,
                "claim_lease_ttl_seconds": LEASE,
                "concurrency": self.conc,
                "metrics_port": self.ports[c][0],
                "health_port": self.ports[c][1],
            }
            argv = ["serve", "--consumer-id", c, "--transport-config", json.dumps(config)]
            with (self.workdir / f"serve-{c}.log").open("w") as err:
                self.procs[c] = await trio.lowlevel.open_process(
                    [CLAIMKIT, *argv], stdout=subprocess.DEVNULL, stderr=err, env=self.env
                )

    async def views(self, when: str) -> None:
        inspect = await cli(self.env, "inspect", "--queue", Q, "--json")
        self.out[f"inspect_{when}"] = per_consumer(inspect)
        self.out[f"consumers_{when}"] = await cli(self.env, "consumers", "--queue", Q, "--json")

    async def kill(self, store: Any, c: str) -> tuple[dict[str, str], float]:
        held = await owners(store)
        self.procs[c].send_signal(signal.SIGKILL)
        killed = trio.current_time()
        await self.procs[c].wait()
        return held, killed

    async def compare(self, store: Any, http: httpx.AsyncClient, killed: float) -> None:
        """Each queue-wide gauge from Prometheus beside Redis, once Redis held still across
        the query and Prometheus caught up (the gauges are sampled every 5 s)."""
        start = trio.current_time()
        table: dict[str, Any] = {}

        async def matched() -> bool:
            nonlocal table
            before = await redis_state(store)
            seen = {
                g: await prom_query(
                    http, self.prom.url, f"max by (queue_name) (llm_d_async_async_{g})"
                )
                for g in GAUGES
            }
            after = await redis_state(store)
            table = {g: {"prometheus": seen[g], "redis": after[g]} for g in GAUGES}
            return before == after and all(seen[g] == after[g] for g in GAUGES)

        with trio.move_on_after(60):
            await poll(matched, 120, 0.5)
        self.out["prometheus_vs_redis"] = {
            "equal": all(v["prometheus"] == v["redis"] for v in table.values()),
            "seconds_after_kill": round(trio.current_time() - killed, 2),
            "seconds_to_match": round(trio.current_time() - start, 2),
            "gauges": table,
            "sum_claim_depth": await prom_query(
                http, self.prom.url, "sum(llm_d_async_async_claim_depth)"
            ),
        }

    async def failover(self, store: Any, http: httpx.AsyncClient) -> Sampler:
        """Phase 1: both hold claims, b is SIGKILLed, a goes on until every record is in."""
        want = min(self.requests, 2 * self.conc)

        async def both_hold() -> bool:
            by = [sum(t.startswith(f"{c}/") for t in (await owners(store)).values()) for c in "ab"]
            return all(by) and sum(by) == want

        await poll(both_hold, 60, 0.05)
        await self.views("before")
        held, killed = await self.kill(store, "b")
        b_ids = {i for i, t in held.items() if t.startswith("b/")}
        if not b_ids:
            raise RuntimeError("b finished its claims before the kill: raise --latency")
        self.out["claims_b_held_at_kill"] = len(b_ids)
        self.out["claims_a_held_at_kill"] = sum(t.startswith("a/") for t in held.values())
        sampler = Sampler(store, held, b_ids, killed)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sampler.run)
            with trio.fail_after(LEASE):
                await sampler.redelivered.wait()
            self.out["seconds_to_redelivered"] = round(sampler.marks["redelivered"], 2)
            await self.views("after")
            await self.compare(store, http, killed)

            async def all_in() -> bool:
                return int(await store.command("LLEN", RESULTS)) >= self.requests

            await poll(all_in, (self.requests / self.conc + 2) * self.latency + 120)
            self.out["seconds_to_all_records"] = round(trio.current_time() - killed, 2)
            with trio.fail_after(60):
                await sampler.claimed_by_a.wait()
            self.out["seconds_to_claimed_by_a"] = round(sampler.marks["claimed_by_a"], 2)
            sampler.stop.set()
        return sampler

    async def records(self, store: Any, http: httpx.AsyncClient, sampler: Sampler) -> None:
        records = [json.loads(r) for r in await store.command("LRANGE", RESULTS, 0, -1)]
        deliveries = await store.command("HVALS", f"{Q}:deliveries")
        self.out["live_consumer_claims_lost"] = len(sampler.lost)
        self.out["live_consumer_lost_detail"] = sampler.lost
        self.out["records"] = len(records)
        self.out["distinct_ids"] = len({r["id"] for r in records})
        self.out["duplicates"] = len(records) - self.out["distinct_ids"]
        self.out["status_codes"] = sorted({str(r.get("status_code")) for r in records})
        self.out["deliveries_left"] = len(deliveries)  # acks clear them: 0 expected
        for name, expr in (
            ("duplicates_suppressed", "duplicate_results_suppressed_total"),
            ("redeliveries_counted", "claims_expired_total"),
        ):
            self.out[name] = await prom_query(http, self.prom.url, f"sum(llm_d_async_async_{expr})")

    async def reclaim_once(self, store: Any, http: httpx.AsyncClient) -> None:
        """Phase 2: a dies holding claims, nobody is left; reclaim --once hands them on and
        pushes its counts to the Pushgateway, which Prometheus scrapes."""
        await self.submit(store, "s", self.conc)

        async def a_holds() -> bool:
            return len(await owners(store)) >= self.conc

        await poll(a_holds, 60, 0.05)
        await self.kill(store, "a")

        async def a_lapsed() -> bool:
            sec, usec = await store.command("TIME")
            score = await store.command("ZSCORE", f"{Q}:consumers", "a")
            return score is not None and float(score) < int(sec) + int(usec) / 1e6

        await poll(a_lapsed, TTL + 30)
        argv = ["reclaim", "--once", "--json", "--pushgateway", self.pushgw.url]
        reclaim = await cli(self.env, *argv, "--transport-config", json.dumps(self.transport))
        expr = f'llm_d_async_async_reclaim_last_run_redelivered{{queue_name="{Q}"}}'

        async def pushed() -> float | None:
            return await prom_query(http, self.prom.url, expr)

        with trio.move_on_after(30):
            await poll(pushed, 60, 0.2)
        self.out["reclaim_once"] = {
            "claims_a_held_at_kill": self.conc,
            "json": reclaim,
            "prometheus_last_run_redelivered": await pushed(),
            "pending_after": int(await store.command("ZCARD", Q)),
            "claimed_after": int(await store.command("HLEN", f"{Q}:claim-owners")),
        }

    async def stop(self) -> None:
        with trio.CancelScope(shield=True), trio.move_on_after(30):
            for proc in self.procs.values():
                if proc.poll() is None:
                    proc.terminate()
                    await proc.wait()
            for server in self.servers:
                await server.stop()

    def warnings(self) -> list[str]:
        found = []
        for c in "ab":
            log = self.workdir / f"serve-{c}.log"
            if log.exists():
                lines = log.read_text().splitlines()
                found += [f"{c}: {line}" for line in lines if " WARNING " in line]
        return found


async def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    with RedisServer() as redis:
        bench = Bench(args, workdir, redis.url)
        async with open_store(redis.url) as store, httpx.AsyncClient(timeout=10) as http:
            try:
                await bench.start_monitoring(http)
                await bench.submit(store, "r", bench.requests)
                await bench.start_consumers()
                sampler = await bench.failover(store, http)
                await bench.records(store, http, sampler)
                await bench.reclaim_once(store, http)
            finally:
                await bench.stop()
    bench.out["warnings"] = bench.warnings()
    bench.out["machine"] = machine()
    return bench.out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--latency", type=float, default=60.0, help="gateway seconds per request")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8, help="per consumer")
    args = parser.parse_args()
    if args.latency < 0 or args.requests < 2 or args.concurrency < 1:
        parser.error("--latency must be >= 0, --requests >= 2, --concurrency >= 1")
    for path in (PROMETHEUS, PUSHGATEWAY):
        if not os.access(path, os.X_OK):
            parser.error(f"{path} is missing (Debian packages prometheus, prometheus-pushgateway)")
    with tempfile.TemporaryDirectory() as tmp:
        result = trio.run(run, args, Path(tmp))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
