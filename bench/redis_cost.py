"""Redis cost per request, for sizing Redis: Redis CPU, script calls, commands and round trips
per job with 1, 2 and 4 consumer processes (standalone) and 1 and 2 (cluster), plus what an
idle consumer costs.

    python bench/redis_cost.py [--runs 3] [--n 10000] [--setups standalone,cluster] \
        [--idle-seconds 20] [--json bench/results/redis_cost.json]

Each loaded run: private servers (a ``redis-server`` on a free port, or a 3-primary cluster
with one replica each from ``claimkit.dev.cluster``), the peers harness's instant Node
gateway, ``--n`` requests on the http workload (the peers' ~200 B payload), then ``k`` real
:class:`claimkit.Consumer` processes (this file's ``_consume`` mode: batch 10, concurrency 50,
poll 50 ms, as ``bench/peers_runner.py``). The window runs from 10 % to 90 % of the records
in the result list (start-up and the tail stay outside). At its start the parent sends
``CONFIG RESETSTAT`` to every node and reads ``INFO cpu``; each consumer reports its own call
counter on SIGUSR1 (a round trip is one command, script, script pipeline or pipeline; a
MULTI/EXEC transaction is two, docs on ``Store.pipeline``). At the end: the counters again,
``INFO cpu``, ``commandstats``, ``stats``, ``clients``. The parent's own commands (its
``LLEN`` polls, ``INFO``, ``CONFIG``) are subtracted.

Columns: Redis CPU µs/job (``used_cpu_user+sys`` of the server process, summed over the
primaries in cluster; "main" is the main thread, the one that bounds a single Redis core),
script calls/job (``EVALSHA``+``EVAL``), Redis commands/job including those run inside
scripts (sum of ``commandstats``; Redis 7's ``total_commands_processed`` counts those too:
it is kept in the JSON as ``top_level_commands_per_job``, not top-level), round trips/job
(client counter). Extrapolation: jobs/s one Redis core takes = 1e6 / (main-thread CPU µs
per job) on the busiest primary. It is an extrapolation, not a measurement: this machine has
2 shared cores, so Redis, the gateway and the consumers compete,
and at higher load Redis amortises its per-event cost over bigger batches.

Idle rows: ``k`` consumers on an empty queue at poll 1000 ms (the product default) and 50 ms
(the bench setting): Redis calls/s per consumer by caller (poll, heartbeat, reclaimer, retry
mover, queue stats), and Redis CPU per consumer above the same servers' baseline with no
consumer.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import redis  # noqa: E402
import trio  # noqa: E402
from _benchutil import PEERS_DIR, machine  # noqa: E402
from protocol import Gateway, med  # noqa: E402

from claimkit.dev.cluster import RedisClusterProcesses  # noqa: E402
from claimkit.dev.redis_server import RedisServer  # noqa: E402

PY = sys.executable
PARENT_COMMANDS = ("cmdstat_info", "cmdstat_config")  # prefixes: only the parent sends these

# What each call is for, by the name the counter gives it.
PURPOSE = {
    "pipeline:GET": "poll (pause flag + peek)",
    "pipeline:ZRANGE": "poll (peek)",
    "script:claim": "poll (claim)",
    "script:ack": "ack",
    "script:ack-local": "ack",
    "script:ack-outbox": "ack",
    "script:renew": "heartbeat",
    "script:register": "heartbeat (registry)",
    "script:expire-owners": "reclaimer",
    "script:reclaim": "reclaimer",
    "script:reclaim-cluster": "reclaimer",
    "script:move-retries": "retry mover",
    "script:move-retries-queue": "retry mover",
    "script:queue-stats": "queue stats",
}


# -- the consumer process -------------------------------------------------------------------


def _count_calls(store: Any, counts: dict[str, list[int]]) -> None:
    """Wrap ``store``'s four call methods: ``counts[name] = [round trips, script calls]``."""

    def bump(name: str, trips: int, scripts: int) -> None:
        row = counts.setdefault(name, [0, 0])
        row[0] += trips
        row[1] += scripts

    orig_command, orig_pipeline = store.command, store.pipeline
    orig_run, orig_many = store.run, store.run_many

    async def command(*args: Any) -> Any:
        bump(f"cmd:{str(args[0]).upper()}", 1, 0)
        return await orig_command(*args)

    async def pipeline(commands: Any, *, transaction: bool) -> Any:
        first = str(commands[0][0]).upper() if commands else "-"
        bump(f"{'multi' if transaction else 'pipeline'}:{first}", 2 if transaction else 1, 0)
        return await orig_pipeline(commands, transaction=transaction)

    async def run(script: Any, keys: Any, args: Any) -> Any:
        bump(f"script:{script.name}", 1, 1)
        return await orig_run(script, keys, args)

    async def run_many(script: Any, calls: Any) -> Any:
        bump(f"script:{script.name}", 1, len(calls))
        return await orig_many(script, calls)

    store.command, store.pipeline, store.run, store.run_many = command, pipeline, run, run_many


async def _consume(a: argparse.Namespace) -> None:
    import peers_runner

    from claimkit import Consumer, open_store

    base = peers_runner.config_for(a)  # batch and poll from CLAIMKIT_BATCH / CLAIMKIT_POLL_MS
    queue = dataclasses.replace(base.queues[0], result_queue_name=a.result_list or None)
    config = dataclasses.replace(base, mode=a.mode, queues=(queue,))
    counts: dict[str, list[int]] = {}

    def snapshot(_sig: int, _frame: Any) -> None:
        sys.stdout.write(json.dumps({"counts": counts, "cpu_s": time.process_time()}) + "\n")
        sys.stdout.flush()

    signal.signal(signal.SIGUSR1, snapshot)
    async with open_store(config.url, topology=config.topology) as store:
        _count_calls(store, counts)
        consumer = Consumer(config, store)
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        await consumer.run()


# -- the parent -----------------------------------------------------------------------------


class Setup:
    """The servers of one run: ``ports`` of the primaries, ``replica_ports``, and where the
    queue lives."""

    def __init__(self, stack: ExitStack, kind: str, replicas: int) -> None:
        self.kind = kind
        if kind == "standalone":
            srv = stack.enter_context(RedisServer())
            self.url, self.mode = srv.url, "standalone"
            self.ports, self.replica_ports = [srv.port], []
            self.queue, self.result_list = "bench", ""
            list_port = srv.port
        else:
            cluster = stack.enter_context(RedisClusterProcesses(masters=3, replicas=replicas))
            self.url, self.mode = cluster.urls[0], "cluster"
            self.ports = [m.port for m in cluster.masters]
            self.replica_ports = [r.port for r in cluster.replicas]
            self.queue, self.result_list = "{t}:q", "{t}:results"
            list_port = cluster.primary_for_key(self.result_list).port
        self.list_port = list_port
        self.clients = {p: redis.Redis(port=p) for p in self.ports + self.replica_ports}
        stack.callback(lambda: [c.close() for c in self.clients.values()])
        self.sent: dict[int, int] = {}  # the parent's own commands per port since RESETSTAT
        self.llens = 0

    def result_len(self) -> int:
        self.llens += 1
        self.sent[self.list_port] = self.sent.get(self.list_port, 0) + 1
        return int(self.clients[self.list_port].llen(self.result_list or "result-list"))

    def info(self, port: int, section: str) -> dict[str, Any]:
        self.sent[port] = self.sent.get(port, 0) + 1
        return dict(self.clients[port].info(section))

    def reset(self) -> None:
        for p in self.clients:
            self.clients[p].config_resetstat()
        self.sent = {p: 1 for p in self.clients}
        self.llens = 0

    def cpu(self) -> dict[int, tuple[float, float]]:
        out = {}
        for p in self.clients:
            i = self.info(p, "cpu")
            main = float(i.get("used_cpu_user_main_thread", "nan")) + float(
                i.get("used_cpu_sys_main_thread", "nan")
            )
            out[p] = (float(i["used_cpu_user"]) + float(i["used_cpu_sys"]), main)
        return out

    def stats(self, port: int) -> dict[str, Any]:
        cmd = self.info(port, "commandstats")
        stats = self.info(port, "stats")
        clients = self.info(port, "clients")
        own_llen = self.llens if port == self.list_port else 0
        calls = {
            k[len("cmdstat_") :]: int(v["calls"])
            for k, v in cmd.items()
            if k not in PARENT_COMMANDS
        }
        if own_llen:
            calls["llen"] = calls.get("llen", 0) - own_llen
        usec = sum(int(v["usec"]) for k, v in cmd.items() if not k.startswith(PARENT_COMMANDS))
        return {
            "calls": {k: v for k, v in calls.items() if v},
            "commands_incl_scripts": sum(calls.values()),
            "scripts": calls.get("evalsha", 0) + calls.get("eval", 0),
            "top_level": int(stats["total_commands_processed"]) - self.sent.get(port, 0),
            "usec": usec,
            "connected_clients": int(clients["connected_clients"]),
        }


async def _enqueue(setup: Setup, n: int) -> None:
    os.environ.setdefault("CLAIMKIT_PEERS_RUNNERS", str(PEERS_DIR / "runners"))
    import peers_runner  # noqa: F401  (puts the peers' common.py on the path)
    from common import payload  # type: ignore[import-not-found]

    from claimkit import Producer, open_store
    from claimkit.store.topology import Topology

    deadline = int(time.time()) + 3600
    async with open_store(setup.url, topology=Topology(mode=setup.mode)) as store:
        kw = {"result_list": setup.result_list} if setup.result_list else {}
        producer = Producer(store, setup.queue, **kw)
        for k in range(0, n, 1000):
            await producer.submit_many(
                {"id": f"req-{i:06d}", "deadline": deadline, "payload": payload(i)}
                for i in range(k, min(n, k + 1000))
            )


class Consumers:
    def __init__(self, setup: Setup, k: int, gateway: str, poll_ms: int, logdir: str) -> None:
        env = {**os.environ, "CLAIMKIT_BATCH": "10", "CLAIMKIT_POLL_MS": str(poll_ms)}
        env.setdefault("CLAIMKIT_PEERS_RUNNERS", str(PEERS_DIR / "runners"))
        argv = [PY, __file__, "_consume", "--redis", setup.url, "--topology", setup.mode]
        argv += ["--queue", setup.queue, "--result-list", setup.result_list]
        argv += ["--gateway", gateway, "--concurrency", "50"]
        self.procs = []
        self.logs = []
        for i in range(k):
            log = open(Path(logdir) / f"consumer-{i}.log", "wb")
            self.logs.append(log)
            p = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=log, text=True, env=env, start_new_session=True
            )
            self.procs.append(p)
        for p in self.procs:
            self._line(p, "ready")

    def _line(self, p: subprocess.Popen[str], what: str) -> str:
        assert p.stdout is not None
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"a consumer ended before '{what}'; see {self.logs[0].name}")
        return line

    def snapshot(self) -> tuple[dict[str, list[int]], float]:
        for p in self.procs:
            p.send_signal(signal.SIGUSR1)
        counts: dict[str, list[int]] = {}
        cpu = 0.0
        for p in self.procs:
            snap = json.loads(self._line(p, "snapshot"))
            cpu += snap["cpu_s"]
            for name, (trips, scripts) in snap["counts"].items():
                row = counts.setdefault(name, [0, 0])
                row[0] += trips
                row[1] += scripts
        return counts, cpu

    def stop(self) -> None:
        for p in self.procs:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        for log in self.logs:
            log.close()


def _until(pred: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.02)  # the parent's LLEN polls: 50/s, subtracted from the counts


def _diff(a: dict[str, list[int]], b: dict[str, list[int]]) -> dict[str, list[int]]:
    out = {}
    for name, (trips, scripts) in b.items():
        t0, s0 = a.get(name, [0, 0])
        if trips - t0 or scripts - s0:
            out[name] = [trips - t0, scripts - s0]
    return out


def _window(setup: Setup, cons: Consumers) -> dict[str, Any]:
    """Reset the stats, read CPU and counters; the caller's wait happens in between."""
    setup.reset()
    cpu0 = setup.cpu()
    counts0, ccpu0 = cons.snapshot()
    return {"cpu0": cpu0, "counts0": counts0, "ccpu0": ccpu0, "t0": time.perf_counter()}


def _close_window(setup: Setup, cons: Consumers | None, w: dict[str, Any]) -> dict[str, Any]:
    counts1, ccpu1 = cons.snapshot() if cons else ({}, 0.0)
    seconds = time.perf_counter() - w["t0"]
    cpu1 = setup.cpu()
    per_node = {p: setup.stats(p) for p in setup.ports}
    counts = _diff(w["counts0"], counts1)
    return {
        "seconds": seconds,
        "cpu_s": {p: cpu1[p][0] - w["cpu0"][p][0] for p in setup.ports},
        "main_cpu_s": {p: cpu1[p][1] - w["cpu0"][p][1] for p in setup.ports},
        "replica_cpu_s": sum(cpu1[p][0] - w["cpu0"][p][0] for p in setup.replica_ports),
        "nodes": per_node,
        "counts": counts,
        "consumer_cpu_s": ccpu1 - w["ccpu0"],
    }


def loaded_run(kind: str, k: int, n: int, gw: Gateway, replicas: int) -> dict[str, Any]:
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        setup = Setup(stack, kind, replicas)
        trio.run(_enqueue, setup, n)
        cons = Consumers(setup, k, gw.url, 50, tmp)
        stack.callback(cons.stop)
        lo, hi = n // 10, n * 9 // 10
        _until(lambda: setup.result_len() >= lo, 120)
        w = _window(setup, cons)
        c0 = setup.result_len()
        _until(lambda: setup.result_len() >= hi, 120)
        c1 = setup.result_len()
        res = _close_window(setup, cons, w)
    jobs = c1 - c0
    busiest = max(setup.ports, key=lambda p: res["cpu_s"][p])
    nodes = res["nodes"].values()
    trips = sum(t for t, _ in res["counts"].values())
    return {
        "jobs": jobs,
        "jobs_s": jobs / res["seconds"],
        "redis_cpu_us_per_job": sum(res["cpu_s"].values()) * 1e6 / jobs,
        "redis_main_cpu_us_per_job": sum(res["main_cpu_s"].values()) * 1e6 / jobs,
        "busiest_primary_main_cpu_us_per_job": res["main_cpu_s"][busiest] * 1e6 / jobs,
        "replica_cpu_us_per_job": res["replica_cpu_s"] * 1e6 / jobs,
        "redis_cmd_usec_per_job": sum(x["usec"] for x in nodes) / jobs,
        "scripts_per_job": sum(x["scripts"] for x in nodes) / jobs,
        "commands_per_job": sum(x["commands_incl_scripts"] for x in nodes) / jobs,
        "top_level_commands_per_job": sum(x["top_level"] for x in nodes) / jobs,
        "round_trips_per_job": trips / jobs,
        "consumer_cpu_us_per_job": res["consumer_cpu_s"] * 1e6 / jobs,
        "connected_clients": sum(x["connected_clients"] for x in nodes),
        "counts": res["counts"],
        "commandstats": {str(p): x["calls"] for p, x in res["nodes"].items()},
    }


def idle_run(kind: str, k: int, poll_ms: int, seconds: float, replicas: int) -> dict[str, Any]:
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        setup = Setup(stack, kind, replicas)
        time.sleep(1.0)
        setup.reset()
        cpu0 = setup.cpu()
        base_s = min(seconds, 5.0)  # the servers alone (cluster: gossip, replication)
        time.sleep(base_s)
        cpu1 = setup.cpu()
        base_cpu = sum(cpu1[p][0] - cpu0[p][0] for p in setup.ports) / base_s
        base = {p: setup.stats(p) for p in setup.ports}
        cons = Consumers(setup, k, "http://127.0.0.1:1/v1/completions", poll_ms, tmp)
        stack.callback(cons.stop)
        time.sleep(3.0)  # registration, first heartbeat, script loads
        w = _window(setup, cons)
        time.sleep(seconds)
        res = _close_window(setup, cons, w)
    per = 1.0 / (k * res["seconds"])
    nodes = res["nodes"].values()
    by_purpose: dict[str, float] = {}
    for name, (trips, _s) in res["counts"].items():
        key = PURPOSE.get(name, name)
        by_purpose[key] = by_purpose.get(key, 0.0) + trips * per
    return {
        "setup": kind,
        "consumers": k,
        "poll_ms": poll_ms,
        "seconds": res["seconds"],
        "round_trips_s_per_consumer": sum(t for t, _ in res["counts"].values()) * per,
        "scripts_s_per_consumer": sum(x["scripts"] for x in nodes) * per,
        "commands_s_per_consumer": sum(x["commands_incl_scripts"] for x in nodes) * per,
        "top_level_s_per_consumer": sum(x["top_level"] for x in nodes) * per,
        "redis_cpu_ms_s_per_consumer": (sum(res["cpu_s"].values()) / res["seconds"] - base_cpu)
        * 1000
        / k,
        "baseline_redis_cpu_ms_s": base_cpu * 1000,
        "baseline_top_level_s": sum(x["top_level"] for x in base.values()) / base_s,
        "round_trips_s_per_consumer_by_purpose": by_purpose,
        "counts": res["counts"],
    }


LOADED_KEYS = (
    "jobs_s",
    "redis_cpu_us_per_job",
    "redis_main_cpu_us_per_job",
    "busiest_primary_main_cpu_us_per_job",
    "replica_cpu_us_per_job",
    "redis_cmd_usec_per_job",
    "scripts_per_job",
    "commands_per_job",
    "top_level_commands_per_job",
    "round_trips_per_job",
    "consumer_cpu_us_per_job",
    "connected_clients",
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", nargs="?", default="bench", choices=["bench", "_consume"])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--n", type=int, default=10000)
    ap.add_argument("--setups", default="standalone,cluster")
    ap.add_argument("--cluster-replicas", type=int, default=1)
    ap.add_argument("--idle-seconds", type=float, default=20.0)
    ap.add_argument("--idle-polls", default="1000,50", help="poll_interval_ms of the idle rows")
    ap.add_argument("--json", default=str(HERE / "results" / "redis_cost.json"))
    # _consume (the consumer process)
    ap.add_argument("--redis", default="")
    ap.add_argument("--queue", default="bench")
    ap.add_argument("--result-list", default="")
    ap.add_argument("--gateway", default="")
    ap.add_argument("--concurrency", type=int, default=50)
    ap.add_argument("--topology", default="standalone", choices=["standalone", "cluster"])
    a = ap.parse_args()
    if a.mode == "_consume":
        a.mode = a.topology
        trio.run(_consume, a)
        return
    t_start = time.monotonic()
    out: dict[str, Any] = {"machine": machine(), "n": a.n, "runs": a.runs, "loaded": [], "idle": []}
    path = Path(a.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    setups = a.setups.split(",")
    plan = [(s, k) for s in setups for k in ((1, 2, 4) if s == "standalone" else (1, 2))]
    gw = Gateway()
    try:
        runs: dict[tuple[str, int], list[dict[str, Any]]] = {c: [] for c in plan}
        for r in range(a.runs):  # interleaved: every configuration once per round
            for kind, k in plan:
                res = loaded_run(kind, k, a.n, gw, a.cluster_replicas)
                runs[(kind, k)].append(res)
                print(
                    f"  round {r + 1}: {kind} x{k}: {res['jobs_s']:,.0f} jobs/s, "
                    f"{res['redis_cpu_us_per_job']:.1f} us Redis CPU/job",
                    file=sys.stderr,
                )
        for kind, k in plan:
            rs = runs[(kind, k)]
            row: dict[str, Any] = {"setup": kind, "consumers": k}
            row.update({key: med([x[key] for x in rs]) for key in LOADED_KEYS})
            row["jobs_s_per_redis_core"] = 1e6 / row["busiest_primary_main_cpu_us_per_job"]
            row["per_run"] = rs
            out["loaded"].append(row)
        for kind in setups:
            for poll in (int(x) for x in a.idle_polls.split(",") if x):
                out["idle"].append(idle_run(kind, 2, poll, a.idle_seconds, a.cluster_replicas))
    finally:
        gw.stop()
    out["seconds"] = time.monotonic() - t_start
    path.write_text(json.dumps(out, indent=1, default=str) + "\n")
    print_tables(out)
    print(f"wrote {path} ({out['seconds']:.0f} s)")


def print_tables(out: dict[str, Any]) -> None:
    m = out["machine"]
    print(
        f"\nRedis cost per job: http workload, instant gateway, batch 10, concurrency 50, "
        f"poll 50 ms, {out['n']:,} requests per run, window 10-90 %, medians of {out['runs']}"
        f"\nmachine: {m['cpu']}, {m['cores']} cores (shared: consumers, gateway and Redis "
        f"compete), {m['redis']}, Python {m['python']}"
    )
    head = (
        f"{'setup':<11}{'cons':>5}{'jobs/s':>8}{'CPU us/job':>11}{'main us':>9}"
        f"{'scripts':>9}{'cmds':>7}{'trips':>7}{'clients':>8}{'core jobs/s*':>13}"
    )
    print(head)
    for r in out["loaded"]:
        print(
            f"{r['setup']:<11}{r['consumers']:>5}{r['jobs_s']:>8,.0f}"
            f"{r['redis_cpu_us_per_job']:>11.1f}{r['redis_main_cpu_us_per_job']:>9.1f}"
            f"{r['scripts_per_job']:>9.3f}{r['commands_per_job']:>7.2f}"
            f"{r['round_trips_per_job']:>7.3f}{r['connected_clients']:>8.0f}"
            f"{r['jobs_s_per_redis_core']:>13,.0f}"
        )
    print(
        "CPU us/job: Redis server CPU (user+sys) per job, summed over primaries; main: its main"
        " thread;\nscripts/cmds/trips: per job (cmds: every command Redis ran, those inside"
        " scripts too; trips:\nround trips, counted by the consumers); clients: connections at"
        " the end (the bench's own included);\n* extrapolation, not measured: 1e6 / main-thread "
        "us per job of the busiest primary (one queue = one primary)."
    )
    print(
        f"\n{'idle (per consumer)':<22}{'poll ms':>8}{'trips/s':>9}{'scripts/s':>10}"
        f"{'cmds/s':>8}{'CPU ms/s':>9}  by caller (round trips/s)"
    )
    for r in out["idle"]:
        by = ", ".join(
            f"{k} {v:.2f}"
            for k, v in sorted(
                r["round_trips_s_per_consumer_by_purpose"].items(), key=lambda x: -x[1]
            )
        )
        print(
            f"{out_setup(r):<22}{r['poll_ms']:>8}{r['round_trips_s_per_consumer']:>9.2f}"
            f"{r['scripts_s_per_consumer']:>10.2f}{r['commands_s_per_consumer']:>8.1f}"
            f"{r['redis_cpu_ms_s_per_consumer']:>9.3f}  {by}"
        )


def out_setup(r: dict[str, Any]) -> str:
    return f"{r.get('setup', '')} x{r['consumers']}"


if __name__ == "__main__":
    main()
