"""The claim protocol's cost in Redis: script calls per request, the ceiling, backlog, heartbeat.

Every measurement starts its own private ``redis-server`` (never the shared one on 6379) and,
where HTTP is involved, the peers harness's Node gateway. Figures are repeated ``--runs``
times and reported as medians (the machine is shared: say so when quoting them).

    python bench/protocol.py [all|calls|ceiling|backlog|heartbeat|scale|recovery] \
        [--runs 3] [--json bench/results/protocol.json]

- ``calls``: script calls and round trips per request of the real consumer
  (``bench/peers_runner.py``) at batch sizes 1, 10, 100, on the ``http`` workload, from
  ``INFO commandstats`` (script calls) and the store's own call counter (round trips).
- ``ceiling``: the same Redis driven by a pure loop of the claim and ack scripts (no HTTP,
  no consumer): 4 concurrent loops, batch 10; claims+acks per second and Redis CPU.
- ``backlog``: claim rate (peek + claim script, batch 10, no ack) with 1k vs 1M pending.
- ``heartbeat``: 10k claims held by one owner (registry on); one renew tick: script calls,
  Redis time (``usec`` of commandstats and the slowest SLOWLOG entry), wall time, client
  CPU; one liveness-only call (``renew_liveness``) likewise; and from those, the heartbeat's
  cost per minute at the default lease and liveness TTL, before and after the two cadences
  (docs/performance.md, "Heartbeat").
- ``scale``: 1, 2 and 4 consumer processes (``bench/peers_runner.py``) on the http workload.
- ``recovery``: SIGKILL a consumer holding claims; time until the first of its requests
  is finished by a second consumer (lease 2 s, reclaim interval 0.5 s).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import redis  # noqa: E402  (sync client for set-up and INFO; the consumer uses coredis)
import trio  # noqa: E402
from _benchutil import PEERS_DIR, free_port, machine  # noqa: E402

from claimkit.dev.redis_server import RedisServer  # noqa: E402
from claimkit.protocol.ops import AckItem, QueueOps, new_token  # noqa: E402
from claimkit.store import open_store  # noqa: E402

RUNNER = HERE / "peers_runner.py"
CLI = [sys.executable, "-c", "from claimkit.cli.app import app; app(prog_name='claimkit')"]
PY = sys.executable
Q = "bench"


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


class Gateway:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1/completions"
        self.proc = subprocess.Popen(
            ["node", str(PEERS_DIR / "gateway.js"), str(self.port)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None and "listening" in self.proc.stdout.readline()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait()


def envelope(i: int, deadline: int) -> bytes:
    doc = {
        "internal": {"request_token": f"{i:032x}"},
        "request_kind": "plain",
        "data": {
            "id": f"req-{i:07d}",
            "deadline": deadline,
            "payload": {
                "id": f"req-{i:07d}",
                "model": "bench-model",
                "prompt": "The quick brown fox jumps over the lazy dog. " * 3,
                "max_tokens": 16,
            },
        },
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def fill(r: redis.Redis, n: int, start: int = 0) -> None:
    """ZADD n envelopes straight into the pending set (1000 per command)."""
    deadline = int(time.time()) + 7200
    for k in range(start, start + n, 1000):
        r.zadd(Q, {envelope(i, deadline): deadline for i in range(k, min(start + n, k + 1000))})


# ``peers_runner.py work`` with its store counter also counting each script by name and how
# many records each ack carries: the done line gains ``scripts`` ({name: calls}) and
# ``ack_records`` (records sent in ack calls).
COUNTING_RUNNER = f"""
import sys
sys.path.insert(0, {str(HERE)!r})
import peers_runner, common
scripts, acked = {{}}, [0]
plain = peers_runner.count_calls
def count_calls(store, calls):
    plain(store, calls)
    for name in ("run", "run_many"):
        orig = getattr(store, name)
        async def counted(script, *a, _orig=orig, _many=name == "run_many", **k):
            n = len(a[0]) if _many else 1
            scripts[script.name] = scripts.get(script.name, 0) + n
            if script.name == "ack" and not _many:
                acked[0] += (len(a[1]) - 2) // 8  # 2 arguments, then 8 per record
            return await _orig(script, *a, **k)
        setattr(store, name, counted)
peers_runner.count_calls = count_calls
emit = common.emit
common.emit = lambda event, **f: emit(event, scripts=scripts, ack_records=acked[0], **f)
peers_runner.main()
"""


def runner(
    mode: str,
    url: str,
    n: int,
    gw: str,
    env: dict[str, str],
    workload: str = "http",
    conc: int = 50,
    *,
    counting: bool = False,
) -> dict[str, Any]:
    out = subprocess.run(
        [
            PY,
            *(["-c", COUNTING_RUNNER] if counting else [str(RUNNER)]),
            mode,
            "--redis",
            url,
            "--n",
            str(n),
            "--workload",
            workload,
            "--gateway",
            gw,
            "--concurrency",
            str(conc),
            "--queue",
            Q,
        ],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=600,
    )
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"runner {mode} gave no result: {out.stderr[-2000:]}")


# -- calls per request ------------------------------------------------------------------------


def bench_calls(runs: int, n: int, batches: tuple[int, ...] = (1, 10, 100)) -> list[dict[str, Any]]:
    gw = Gateway()
    rows = []
    try:
        for batch in batches:
            per: list[dict[str, float]] = []
            for _ in range(runs):
                with RedisServer() as srv:
                    r = redis.Redis(port=srv.port)
                    runner("enqueue", srv.url, n, gw.url, {})
                    r.config_resetstat()
                    done = runner(
                        "work",
                        srv.url,
                        n,
                        gw.url,
                        {"CLAIMKIT_BATCH": str(batch), "CLAIMKIT_COUNT_CALLS": "1"},
                        counting=True,
                    )
                    by_name = done["scripts"]
                    stats = r.info("commandstats")
                    scripts = sum(
                        v["calls"]
                        for k, v in stats.items()
                        if k in ("cmdstat_evalsha", "cmdstat_eval")
                    )
                    per.append(
                        {
                            "jobs_s": done["n"] / done["seconds"],
                            "scripts_per_req": scripts / n,
                            "round_trips_per_req": done["round_trips"] / n,
                            "cpu_ms_per_req": done["cpu_s"] / n * 1000,
                            "ack_calls_per_req": by_name.get("ack", 0) / n,
                            "records_per_ack": done["ack_records"] / max(by_name.get("ack", 0), 1),
                            "mover_calls_per_req": by_name.get("move-retries", 0) / n,
                            "renew_calls_per_req": by_name.get("renew", 0) / n,
                            "seconds": done["seconds"],
                        }
                    )
                    r.close()
            row = {"batch": batch, **{k: med([p[k] for p in per]) for k in per[0]}, "runs": per}
            rows.append(row)
            print(
                f"  batch {batch:3d}: {row['scripts_per_req']:.3f} scripts/req, "
                f"{row['round_trips_per_req']:.3f} round trips/req, {row['jobs_s']:,.0f} jobs/s, "
                f"{row['records_per_ack']:.1f} records/ack, "
                f"mover {row['mover_calls_per_req']:.3f}/req, "
                f"{row['cpu_ms_per_req']:.3f} CPU ms/req",
                file=sys.stderr,
            )
    finally:
        gw.stop()
    return rows


# -- ceiling ------------------------------------------------------------------------------------


async def _claim_ack_loop(url: str, n_each: int, loops: int, batch: int) -> float:
    from claimkit.protocol.models import Envelope, parse_member

    async with open_store(url) as store:
        ops = QueueOps(store, Q)

        async def loop() -> None:
            done = 0
            while done < n_each:
                members = await ops.peek(batch)
                envs = [e for e in map(parse_member, members) if isinstance(e, Envelope)]
                pairs = [(e, new_token()) for e in envs]
                _now, codes = await ops.claim(pairs, 300)
                items = [
                    AckItem(
                        e.id,
                        tok,
                        e.request_token,
                        "result-list",
                        b'{"id":"%s","status_code":200,"payload":"{}"}' % e.id.encode(),
                        e.raw,
                    )
                    for (e, tok), c in zip(pairs, codes, strict=True)
                    if c == 1
                ]
                if items:
                    await ops.ack(items)
                done += len(items)

        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(loops):
                nursery.start_soon(loop)
        return time.perf_counter() - t0


def bench_ceiling(runs: int, n: int = 20000, loops: int = 4, batch: int = 10) -> dict[str, Any]:
    per = []
    for _ in range(runs):
        with RedisServer() as srv:
            r = redis.Redis(port=srv.port)
            fill(r, n + loops * batch * 4)
            r.config_resetstat()
            cpu0 = _redis_cpu(r)
            seconds = trio.run(_claim_ack_loop, srv.url, n // loops, loops, batch)
            stats = r.info("commandstats")
            ev = stats.get("cmdstat_evalsha", {"calls": 0, "usec": 0})
            per.append(
                {
                    "jobs_s": n / seconds,
                    "redis_cpu_s": _redis_cpu(r) - cpu0,
                    "script_usec_per_call": ev["usec"] / max(ev["calls"], 1),
                    "redis_script_usec_per_job": ev["usec"] / n,
                }
            )
            r.close()
    out = {k: med([p[k] for p in per]) for k in per[0]}
    out.update(
        loops=loops,
        batch=batch,
        n=n,
        runs=per,
        redis_bound_jobs_s=1e6 / out["redis_script_usec_per_job"],
    )
    print(
        f"  ceiling: {out['jobs_s']:,.0f} claim+ack/s from {loops} Python loops; Redis script "
        f"time {out['redis_script_usec_per_job']:.1f} us/job -> Redis-bound "
        f"{out['redis_bound_jobs_s']:,.0f} jobs/s",
        file=sys.stderr,
    )
    return out


def _redis_cpu(r: redis.Redis) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


# -- backlog ------------------------------------------------------------------------------------


async def _claim_only(url: str, n: int, batch: int) -> float:
    from claimkit.protocol.models import Envelope, parse_member

    async with open_store(url) as store:
        ops = QueueOps(store, Q)
        t0 = time.perf_counter()
        done = 0
        while done < n:
            members = await ops.peek(batch)
            envs = [e for e in map(parse_member, members) if isinstance(e, Envelope)]
            _now, codes = await ops.claim([(e, new_token()) for e in envs], 300)
            done += sum(1 for c in codes if c == 1)
        return time.perf_counter() - t0


def bench_backlog(runs: int, claims: int = 2000, batch: int = 10) -> dict[str, Any]:
    """Two servers, one per backlog size, filled first; runs alternate between them so a
    noisy neighbour hits both alike."""
    out: dict[str, Any] = {"claims_per_run": claims, "batch": batch}
    sizes = (1_000, 1_000_000)
    rates: dict[int, list[float]] = {p: [] for p in sizes}
    usecs: dict[int, list[float]] = {p: [] for p in sizes}
    with RedisServer() as small, RedisServer() as big:
        servers = dict(zip(sizes, (small, big), strict=True))
        clients = {p: redis.Redis(port=srv.port) for p, srv in servers.items()}
        for p, r in clients.items():
            fill(r, p + claims * runs)
        for _ in range(runs):
            for p in sizes:
                r = clients[p]
                r.config_resetstat()
                seconds = trio.run(_claim_only, servers[p].url, claims, batch)
                ev = r.info("commandstats")["cmdstat_evalsha"]
                rates[p].append(claims / seconds)
                usecs[p].append(ev["usec_per_call"])
        for r in clients.values():
            r.close()
    for p in sizes:
        out[str(p)] = {
            "claims_s": med(rates[p]),
            "claim_script_usec_per_call": med(usecs[p]),
            "runs": rates[p],
            "script_usec_runs": usecs[p],
        }
        print(
            f"  backlog {p:>9,}: {med(rates[p]):,.0f} claims/s, claim script "
            f"{med(usecs[p]):.0f} us/call",
            file=sys.stderr,
        )
    out["ratio"] = out["1000000"]["claims_s"] / out["1000"]["claims_s"]
    out["script_ratio"] = (
        out["1000"]["claim_script_usec_per_call"] / out["1000000"]["claim_script_usec_per_call"]
    )
    return out


# -- heartbeat ----------------------------------------------------------------------------------


LIVENESS_CALLS = 50  # liveness-only calls timed per run


async def _hold_and_renew(url: str, held: int, ticks: int) -> dict[str, Any]:
    from claimkit.protocol.consumers import ConsumerIdentity
    from claimkit.protocol.models import Envelope, parse_member

    async with open_store(url) as store:
        # As ``serve`` calls it: with the consumer registry on (the default 10 s TTL).
        ops = QueueOps(store, Q, consumer=ConsumerIdentity("bench", 10.0, "host", 1, "0"))
        claims: list[tuple[str, str, int]] = []
        while len(claims) < held:
            members = await ops.peek(min(500, held - len(claims)))
            envs = [e for e in map(parse_member, members) if isinstance(e, Envelope)]
            pairs = [(e, new_token()) for e in envs]
            _now, codes = await ops.claim(pairs, 300)
            claims += [
                (e.id, t, e.deadline) for (e, t), c in zip(pairs, codes, strict=True) if c == 1
            ]
        calls = trips = 0
        orig_run, orig_many = store.run, store.run_many

        async def run(script, keys, args):  # type: ignore[no-untyped-def]
            nonlocal calls, trips
            calls, trips = calls + 1, trips + 1
            return await orig_run(script, keys, args)

        async def run_many(script, batch):  # type: ignore[no-untyped-def]
            nonlocal calls, trips
            calls, trips = calls + len(batch), trips + 1
            return await orig_many(script, batch)

        store.run, store.run_many = run, run_many  # type: ignore[method-assign]
        walls, cpus = [], []
        await store.command("CONFIG", "RESETSTAT")
        await store.command("SLOWLOG", "RESET")
        for _ in range(ticks):
            t0, c0 = time.perf_counter(), time.process_time()
            _now, codes = await ops.renew(claims, 300)
            cpus.append((time.process_time() - c0) * 1000)
            walls.append((time.perf_counter() - t0) * 1000)
            assert codes.count(1) == held, "every claim renewed"
        stats = await store.command("INFO", "commandstats")
        slow = await store.command("SLOWLOG", "GET", 128)
        tick_calls, tick_trips = calls, trips
        # The liveness tick between two claims ticks: the entry alone (renew_liveness).
        await store.command("CONFIG", "RESETSTAT")
        live_walls, live_cpus = [], []
        for _ in range(LIVENESS_CALLS):
            t0, c0 = time.perf_counter(), time.process_time()
            assert await ops.renew_liveness() is not None
            live_cpus.append((time.process_time() - c0) * 1000)
            live_walls.append((time.perf_counter() - t0) * 1000)
        live_stats = await store.command("INFO", "commandstats")
        return {
            "calls": tick_calls,
            "trips": tick_trips,
            "walls_ms": walls,
            "cpus_ms": cpus,
            "stats": stats,
            "slow": slow,
            "live_walls_ms": live_walls,
            "live_cpus_ms": live_cpus,
            "live_stats": live_stats,
        }


def _evalsha_usec(stats: bytes | str) -> float:
    text = stats.decode() if isinstance(stats, bytes) else stats
    line = next(x for x in text.splitlines() if x.startswith("cmdstat_evalsha"))
    fields = dict(kv.split("=") for kv in line.split(":", 1)[1].split(","))
    return float(fields["usec"])


def heartbeat_per_minute(
    out: dict[str, Any], lease: float = 300.0, liveness_ttl: float = 10.0
) -> dict[str, Any]:
    """What the heartbeat costs per minute at ``lease`` / ``liveness_ttl``, from the measured
    cost of one claims tick and one liveness-only call: before (every tick renews every claim,
    each ``min(clamp(lease/3, 1, 30), ttl/3)``) and now (claims each ``clamp(lease/3, 1, 30)``,
    the liveness alone at the other ticks, each ``ttl/3``)."""
    claims_every = min(30.0, max(1.0, lease / 3))
    live_every = liveness_ttl / 3
    before_ticks = 60 / min(claims_every, live_every)
    claims_ticks = 60 / claims_every
    live_ticks = max(0.0, 60 / live_every - claims_ticks) if live_every < claims_every else 0.0
    figures = {}
    for key, per_tick, per_live in (
        ("redis_ms", out["redis_usec_per_tick"] / 1000, out["liveness_redis_usec"] / 1000),
        ("client_cpu_ms", out["client_cpu_ms_per_tick"], out["liveness_client_cpu_ms"]),
        ("script_calls", out["calls_per_tick"], 1.0),
    ):
        figures[f"before_{key}"] = round(before_ticks * per_tick, 3)
        figures[f"now_{key}"] = round(claims_ticks * per_tick + live_ticks * per_live, 3)
    figures.update(
        lease=lease,
        liveness_ttl=liveness_ttl,
        before_ticks=before_ticks,
        now_claims_ticks=claims_ticks,
        now_liveness_ticks=live_ticks,
    )
    return figures


def bench_heartbeat(runs: int, held: int = 10_000) -> dict[str, Any]:
    per = []
    for _ in range(runs):
        # SLOWLOG every command over 0 us: the slowest renew call is then on record.
        with RedisServer(
            extra_args=["--slowlog-log-slower-than", "0", "--slowlog-max-len", "1024"]
        ) as srv:
            r = redis.Redis(port=srv.port)
            fill(r, held)
            res = trio.run(_hold_and_renew, srv.url, held, 5)
            slowest = max(
                (int(e[2]) for e in res["slow"] if b"EVALSHA" in [bytes(a) for a in e[3]][:1]),
                default=0,
            )
            per.append(
                {
                    "calls_per_tick": res["calls"] / 5,
                    "round_trips_per_tick": res["trips"] / 5,
                    "redis_usec_per_tick": _evalsha_usec(res["stats"]) / 5,
                    "slowest_script_usec": slowest,
                    "wall_ms_per_tick": med(res["walls_ms"]),
                    "client_cpu_ms_per_tick": med(res["cpus_ms"]),
                    "liveness_redis_usec": _evalsha_usec(res["live_stats"]) / LIVENESS_CALLS,
                    "liveness_wall_ms": med(res["live_walls_ms"]),
                    "liveness_client_cpu_ms": med(res["live_cpus_ms"]),
                }
            )
            r.close()
    out: dict[str, Any] = {k: med([p[k] for p in per]) for k in per[0]}
    out.update(held=held, runs=per, per_minute_at_defaults=heartbeat_per_minute(out))
    pm = out["per_minute_at_defaults"]
    print(
        f"  heartbeat, {held:,} claims: {out['round_trips_per_tick']:.0f} round trip(s) and "
        f"{out['calls_per_tick']:.0f} script calls/tick, Redis "
        f"{out['redis_usec_per_tick'] / 1000:.2f} ms/tick, slowest script "
        f"{out['slowest_script_usec'] / 1000:.2f} ms, wall {out['wall_ms_per_tick']:.1f} ms, "
        f"client CPU {out['client_cpu_ms_per_tick']:.1f} ms/tick; liveness alone: Redis "
        f"{out['liveness_redis_usec']:.0f} us, wall {out['liveness_wall_ms']:.2f} ms, client "
        f"CPU {out['liveness_client_cpu_ms']:.2f} ms; per minute at the defaults, before -> "
        f"now: Redis {pm['before_redis_ms']:.0f} -> {pm['now_redis_ms']:.0f} ms, client CPU "
        f"{pm['before_client_cpu_ms']:.0f} -> {pm['now_client_cpu_ms']:.0f} ms, script calls "
        f"{pm['before_script_calls']:.0f} -> {pm['now_script_calls']:.0f}",
        file=sys.stderr,
    )
    return out


# -- scale --------------------------------------------------------------------------------------


def bench_scale(runs: int, n: int) -> list[dict[str, Any]]:
    """k consumer processes share one queue of n requests. Each would count only its own
    acks, and one that stops at a quota leaves its other claims to lapse, so the rate is
    read from Redis instead: the parent polls ``LLEN result-list`` and times the window from
    10 % to 90 % of the records (start-up skew between processes stays outside), then
    SIGKILLs the consumers."""
    gw = Gateway()
    rows = []
    try:
        for procs in (1, 2, 4):
            rates = []
            for _ in range(runs):
                with RedisServer() as srv:
                    r = redis.Redis(port=srv.port)
                    runner("enqueue", srv.url, n, gw.url, {})
                    ps = [
                        subprocess.Popen(
                            [
                                PY,
                                str(RUNNER),
                                "work",
                                "--redis",
                                srv.url,
                                "--n",
                                str(n * 10),
                                "--workload",
                                "http",
                                "--gateway",
                                gw.url,
                                "--concurrency",
                                "50",
                                "--queue",
                                Q,
                            ],
                            stdout=subprocess.DEVNULL,
                            start_new_session=True,
                        )
                        for _ in range(procs)
                    ]
                    try:
                        lo, hi = n // 10, n * 9 // 10
                        _until(lambda r=r, lo=lo: r.llen("result-list") >= lo, 120)
                        t0, c0 = time.perf_counter(), r.llen("result-list")
                        _until(lambda r=r, hi=hi: r.llen("result-list") >= hi, 300)
                        t1, c1 = time.perf_counter(), r.llen("result-list")
                        rates.append((c1 - c0) / (t1 - t0))
                    finally:
                        for p in ps:
                            os.killpg(p.pid, signal.SIGKILL)
                            p.wait()
                        r.close()
            rows.append({"processes": procs, "jobs_s": med(rates), "runs": rates})
            print(f"  scale {procs} processes: {med(rates):,.0f} jobs/s", file=sys.stderr)
    finally:
        gw.stop()
    return rows


# -- recovery -----------------------------------------------------------------------------------


def bench_recovery(
    runs: int, lease: float = 2.0, reclaim_ms: int = 500, gateway_s: float = 3.0
) -> dict[str, Any]:
    """Consumer A (``claimkit serve``) holds 4 claims against a slow gateway (the simulator,
    ``gateway_s`` per answer) when it is SIGKILLed; consumer B, started once A held them and idle
    since, redelivers them. Measured: SIGKILL -> first record in the result list. Expected:
    the rest of the lease (<= ``lease``) + up to one reclaim interval + poll + the gateway."""
    times = []
    for _ in range(runs):
        with RedisServer() as srv, tempfile.TemporaryDirectory() as tmp:
            sim_port = free_port()
            sim = subprocess.Popen(
                [*CLI, "sim", "--port", str(sim_port), "--latency", f"{gateway_s},{gateway_s}"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            cfg = {
                "url": srv.url,
                "poll_interval_ms": 50,
                "claim_lease_ttl_seconds": lease,
                "claim_reclaim_interval_ms": reclaim_ms,
                "queues": [{"queue_name": Q, "igw_base_url": f"http://127.0.0.1:{sim_port}"}],
            }
            cfg_path = Path(tmp) / "cfg.json"
            cfg_path.write_text(json.dumps(cfg))
            serve = [
                *CLI,
                "serve",
                "--transport-config-file",
                str(cfg_path),
                "--metrics-port",
                "0",
                "--health-port",
                "0",
                "--concurrency",
                "4",
            ]
            r = redis.Redis(port=srv.port)
            procs: list[subprocess.Popen[bytes]] = []
            try:
                _wait_port(sim_port)

                def start(
                    serve: list[str] = serve, procs: list[subprocess.Popen[bytes]] = procs
                ) -> subprocess.Popen[bytes]:
                    p = subprocess.Popen(
                        serve,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                    procs.append(p)
                    return p

                a = start()
                time.sleep(1.5)  # A is up and polling
                fill(r, 4)
                _until(lambda r=r: r.hlen(f"{Q}:claim-owners") == 4, 20)
                start()
                time.sleep(1.5)  # B is up, polling an empty queue
                assert r.llen("result-list") == 0
                os.killpg(a.pid, signal.SIGKILL)
                t_kill = time.perf_counter()
                _until(lambda r=r: r.llen("result-list") >= 1, 60)
                times.append(time.perf_counter() - t_kill)
            finally:
                for p in procs:
                    if p.poll() is None:
                        os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
                sim.terminate()
                sim.wait()
                r.close()
    out = {
        "lease_s": lease,
        "reclaim_interval_ms": reclaim_ms,
        "gateway_latency_s": gateway_s,
        "seconds": med(times),
        "seconds_without_gateway": med(times) - gateway_s,
        "runs": times,
    }
    print(
        f"  recovery (lease {lease} s, reclaim {reclaim_ms} ms, gateway {gateway_s} s): "
        f"{med(times):.2f} s from SIGKILL to first redelivered result",
        file=sys.stderr,
    )
    return out


def _wait_port(port: int, timeout: float = 20) -> None:
    import socket

    def up() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return True
        except OSError:
            return False

    _until(up, timeout)


def _until(pred: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.002)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "what",
        nargs="*",
        default=["all"],
        choices=["all", "calls", "ceiling", "backlog", "heartbeat", "scale", "recovery"],
    )
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--batches", default="1,10,100", help="calls: the batch sizes, e.g. 10")
    ap.add_argument("--json", default=str(HERE / "results" / "protocol.json"))
    args = ap.parse_args()
    what = set(args.what)
    if "all" in what:
        what = {"calls", "ceiling", "backlog", "heartbeat", "scale", "recovery"}
    path = Path(args.json)
    results: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    results["machine"] = machine()
    path.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        path.write_text(json.dumps(results, indent=1, default=str))

    if "heartbeat" in what:
        results["heartbeat"] = bench_heartbeat(args.runs)
        save()
    if "backlog" in what:
        results["backlog"] = bench_backlog(args.runs)
        save()
    if "ceiling" in what:
        results["ceiling"] = bench_ceiling(args.runs)
        save()
    if "calls" in what:
        results["calls"] = bench_calls(
            args.runs, args.n, tuple(int(b) for b in args.batches.split(","))
        )
        save()
    if "scale" in what:
        results["scale"] = bench_scale(args.runs, args.n)
        save()
    if "recovery" in what:
        results["recovery"] = bench_recovery(args.runs)
        save()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, default=str))
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
