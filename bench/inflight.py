"""The in-flight regime (issue 13 item 2): one ``claimkit serve`` process holding thousands of
slow gateway calls, with their claims renewed.

For each ``--concurrency`` C it starts, each stopped by its PID at the end:

- a private ``redis-server`` (AOF off, :class:`claimkit.dev.redis_server.RedisServer`);
- the peers harness's gateway (``node gateway.js PORT LATENCY_MS``), answering every POST
  ``--latency-ms`` after its body arrived;
- ``claimkit serve --concurrency C`` as a subprocess, on the defaults a user would set (poll
  interval, batch size, 300 s lease, liveness registry on), with its soft open-file limit
  set to ``--nofile-soft`` (1024, what most Linux logins and systemd services start with)
  and the hard limit left as it is, so ``serve``'s own limit handling is what is measured.

Once ``serve`` is up and idle (idle RSS taken), ``--periods`` x C requests are submitted
(:class:`claimkit.Producer`, a deadline one hour ahead, the peers' ~200 B payload), and every
``--sample`` seconds it reads:

- the consumer's ``/proc/PID``: RSS (and its peak, ``VmHWM``), user+sys CPU, open fds and
  how many are sockets;
- Redis, in one pipeline: ``TIME``; the claims index (``<q>:claims-idx``, lease expiry per
  held claim, docs/protocol.md#keys): ``ZCARD`` and its lowest score, so the worst lease
  headroom is ``min(expiry - now) / lease``; the result list's length (finished requests);
  ``INFO cpu``; and ``SLOWLOG`` (threshold 0, reset at each sample) for the server time of
  every renew script (``lua/renew-4.lua``): a claims tick is one pipeline of one renew per
  1000 held claims, so the claims renews of one sample make up its ticks; a renew with no
  claims (13 arguments) is a liveness-only call, counted apart.

Reported per run: steady-state throughput (the result list's rate between the first full
latency period and the last) against the ideal C / latency, and the rate after the first wave
((n - C) over the time from C finished to n finished, which does not depend on where the
waves of completions fall between samples); peak RSS and RSS per held request
((median RSS while C are held - idle RSS) / held); consumer CPU and Redis CPU per request; peak
fds and sockets; the worst lease headroom; renew server time per claims tick (median and
max); renew calls per second and their Redis time per second (claims and liveness-only).

Run::

    .venv/bin/python bench/inflight.py --concurrency 2000 --concurrency 10000

Writes ``bench/results/inflight-<time>.json`` (git-ignored) and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchutil import PEERS_DIR, free_port, machine

from claimkit import Producer, open_store
from claimkit.dev.redis_server import RedisServer
from claimkit.dev.resp_client import call
from claimkit.protocol.keys import DEFAULT_LEASE_TTL_SECONDS, DEFAULT_RESULT_LIST
from claimkit.store.scripts import script

QUEUE = "inflight"
CLK_TCK = os.sysconf("SC_CLK_TCK")
RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_CLAIMKIT = str(Path(sys.executable).with_name("claimkit"))


@dataclass
class Sample:
    t: float  # seconds since the requests were submitted
    rss_kb: int
    hwm_kb: int
    cpu_s: float
    fds: int
    sockets: int
    held: int
    done: int
    headroom: float | None  # min(lease expiry - server now) / lease, over held claims
    redis_cpu_s: float
    renew_us: list[int] = field(default_factory=list)  # server time of each claims renew call
    liveness_us: list[int] = field(default_factory=list)  # ... of each liveness-only renew


@dataclass
class Run:
    concurrency: int
    latency_s: float
    n: int
    nofile_soft: int
    claimkit: str
    batch_size: int
    samples: list[Sample] = field(default_factory=list)
    idle_rss_kb: int = 0
    idle_cpu_s: float = 0.0  # the consumer's CPU before any request: imports, start-up
    serve_log_tail: str = ""
    summary_line: str = ""
    complete: bool = False
    wall_s: float = 0.0
    gateway: dict[str, int] = field(default_factory=dict)  # POSTs answered, TCP connections
    commands: dict[str, int] = field(default_factory=dict)  # Redis calls by command, whole run


def proc_stats(pid: int) -> tuple[int, int, float, int, int]:
    """``(rss_kb, hwm_kb, cpu_s, fds, sockets)`` of a live process, from ``/proc``."""
    rss = hwm = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1])
        elif line.startswith("VmHWM:"):
            hwm = int(line.split()[1])
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    cpu = (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime
    fds = sockets = 0
    for entry in os.scandir(f"/proc/{pid}/fd"):
        fds += 1
        with contextlib.suppress(OSError):
            if os.readlink(entry.path).startswith("socket:"):
                sockets += 1
    return rss, hwm, cpu, fds, sockets


def redis_cpu(info: bytes) -> float:
    values = dict(line.split(":", 1) for line in info.decode().splitlines() if ":" in line)
    return float(values["used_cpu_user"]) + float(values["used_cpu_sys"])


# A liveness-only renew (QueueOps.renew_liveness: no claims) as SLOWLOG shows it: EVALSHA,
# sha, numkeys, 4 keys, the lease ttl and 5 consumer arguments.
LIVENESS_RENEW_ARGS = 13


def redis_sample(
    port: int, renew_sha: str
) -> tuple[float, int, float | None, int, float, list[int], list[int]]:
    """``(server_now, held, lowest lease expiry, done, redis_cpu_s, renew_us, liveness_us)``:
    the server time of each renew call that carried claims, and of each that renewed the
    consumer's liveness entry alone."""
    idx = f"{QUEUE}:claims-idx"
    replies = call(
        port,
        [
            ["TIME"],
            ["ZCARD", idx],
            ["ZRANGE", idx, "0", "0", "WITHSCORES"],
            ["LLEN", DEFAULT_RESULT_LIST],
            ["INFO", "cpu"],
            ["SLOWLOG", "GET", "-1"],
            ["SLOWLOG", "RESET"],
        ],
        timeout=10,
    )
    time_reply, held, lowest, done, info, slowlog, _ = replies
    assert isinstance(time_reply, list)
    now = int(time_reply[0]) + int(time_reply[1]) / 1e6  # type: ignore[call-overload]
    first = float(lowest[1]) if isinstance(lowest, list) and lowest else None  # type: ignore[arg-type]
    renews, alone = [], []
    for entry in slowlog if isinstance(slowlog, list) else []:
        args = entry[3]  # type: ignore[index]
        if len(args) > 1 and args[0].upper() == b"EVALSHA" and args[1].decode() == renew_sha:
            into = alone if len(args) == LIVENESS_RENEW_ARGS else renews
            into.append(int(entry[2]))  # type: ignore[index]
    assert isinstance(held, int) and isinstance(done, int) and isinstance(info, bytes)
    return now, held, first, done, redis_cpu(info), renews, alone


def commandstats(port: int) -> dict[str, int]:
    """Calls per command since the last ``CONFIG RESETSTAT`` (commands run inside scripts
    count too, as in the peers harness)."""
    (info,) = call(port, [["INFO", "commandstats"]], timeout=10)
    assert isinstance(info, bytes)
    calls = {}
    for line in info.decode().splitlines():
        if line.startswith("cmdstat_"):
            name, rest = line[len("cmdstat_") :].split(":", 1)
            calls[name] = int(rest.split(",")[0].split("=")[1])
    return calls


def start_gateway(latency_ms: int, log: Path) -> tuple[subprocess.Popen[bytes], int]:
    if not (PEERS_DIR / "gateway.js").exists():
        raise SystemExit(f"no {PEERS_DIR}/gateway.js: set CLAIMKIT_PEERS_DIR to the peers harness")
    port = free_port()
    with log.open("w") as out:
        proc = subprocess.Popen(
            ["node", str(PEERS_DIR / "gateway.js"), str(port), str(latency_ms)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    end = time.monotonic() + 20
    while "listening" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > end:
            raise RuntimeError(f"gateway did not start: {log.read_text()}")
        time.sleep(0.05)
    return proc, port


def start_serve(
    args: argparse.Namespace, redis_url: str, gateway_port: int, concurrency: int, log: Path
) -> subprocess.Popen[bytes]:
    config: dict[str, Any] = {
        "queues": [{"queue_name": QUEUE, "igw_base_url": f"http://127.0.0.1:{gateway_port}"}]
    }
    if args.batch_size:
        config["batch_size"] = args.batch_size
    nofile_soft = args.nofile_soft
    command = [args.claimkit]
    if args.profile:
        pyinstrument = str(Path(sys.executable).with_name("pyinstrument"))
        command = [pyinstrument, "-r", "text", "-o", str(log.with_suffix(".profile.txt")), *command]

    def limit() -> None:
        _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(nofile_soft, hard), hard))

    with log.open("w") as err, log.with_suffix(".out").open("w") as out:
        return subprocess.Popen(
            [
                *command,
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
            stdout=out,
            stderr=err,
            preexec_fn=limit,
        )


async def submit(redis_url: str, n: int) -> None:
    deadline = int(time.time()) + 3600
    body = {"model": "bench-model", "prompt": "x" * 160, "max_tokens": 8}
    async with open_store(redis_url) as store:
        producer = Producer(store, QUEUE)
        for k in range(0, n, 1000):
            await producer.submit_many(
                {"id": f"req-{i:06d}", "deadline": deadline, "payload": body}
                for i in range(k, min(n, k + 1000))
            )


def one_run(args: argparse.Namespace, concurrency: int, workdir: Path) -> Run:
    n = args.periods * concurrency
    run = Run(
        concurrency, args.latency_ms / 1000, n, args.nofile_soft, args.claimkit, args.batch_size
    )
    renew_sha = script("renew").sha1
    with RedisServer(
        extra_args=["--slowlog-log-slower-than", "0", "--slowlog-max-len", "100000"]
    ) as redis:
        gateway, gw_port = start_gateway(args.latency_ms, workdir / f"gateway-{concurrency}.log")
        serve_log = workdir / f"serve-{concurrency}.log"
        serve = start_serve(args, redis.url, gw_port, concurrency, serve_log)
        try:
            end = time.monotonic() + 30
            while "serving" not in serve_log.read_text():
                if serve.poll() is not None or time.monotonic() > end:
                    raise RuntimeError(f"serve did not start: {serve_log.read_text()}")
                time.sleep(0.05)
            time.sleep(2.0)
            idle = proc_stats(serve.pid)
            run.idle_rss_kb, run.idle_cpu_s = idle[0], idle[2]
            redis_sample(redis.port, renew_sha)  # resets the slowlog
            t0 = time.monotonic()
            trio.run(submit, redis.url, n)
            call(redis.port, [["CONFIG", "RESETSTAT"]], timeout=10)  # the consumer's calls only
            stop_at = t0 + args.timeout
            while time.monotonic() < stop_at:
                if serve.poll() is not None:
                    break
                rss, hwm, cpu, fds, sockets = proc_stats(serve.pid)
                now, held, lowest, done, rcpu, renews, alone = redis_sample(redis.port, renew_sha)
                headroom = None if lowest is None else (lowest - now) / DEFAULT_LEASE_TTL_SECONDS
                run.samples.append(
                    Sample(
                        time.monotonic() - t0, rss, hwm, cpu, fds, sockets, held, done,
                        headroom, rcpu, renews, alone,
                    )
                )  # fmt: skip
                if done >= n:
                    run.complete = True
                    break
                time.sleep(args.sample)
            run.wall_s = time.monotonic() - t0
            run.commands = commandstats(redis.port)
            with contextlib.suppress(OSError, ValueError):
                with urllib.request.urlopen(f"http://127.0.0.1:{gw_port}/stats", timeout=5) as r:
                    run.gateway = json.loads(r.read())
        finally:
            if serve.poll() is None:
                serve.send_signal(signal.SIGTERM)
                try:
                    serve.wait(60)
                except subprocess.TimeoutExpired:
                    serve.kill()
                    serve.wait(10)
            gateway.terminate()
            gateway.wait(10)
        run.serve_log_tail = "\n".join(serve_log.read_text().splitlines()[-15:])
        out = serve_log.with_suffix(".out").read_text().strip().splitlines()
        run.summary_line = out[-1] if out else ""
    return run


def crossing(samples: list[Sample], done: int) -> float | None:
    """When the result list first reached ``done`` (seconds, linear between samples)."""
    prev = None
    for x in samples:
        if x.done >= done:
            if prev is None or x.done == prev.done:
                return x.t
            return prev.t + (x.t - prev.t) * (done - prev.done) / (x.done - prev.done)
        prev = x
    return None


def figures(run: Run) -> dict[str, Any]:
    s = run.samples
    if not s:
        return {"error": "no samples"}
    c, lat = run.concurrency, run.latency_s
    # Steady state: from the first full latency period to the last one.
    steady = [x for x in s if x.done >= c and x.done <= run.n - c]
    if len(steady) >= 2:
        rate = (steady[-1].done - steady[0].done) / (steady[-1].t - steady[0].t)
    else:
        rate = float("nan")
    ideal = c / lat
    # The requests are all submitted at once, so they finish in waves of up to C, one per
    # latency period, and a rate read between two fixed samples depends on where the waves
    # fall. After the first wave: (n - C) requests over the time from the result list
    # reaching C to reaching n (each crossing interpolated between samples).
    first, last_t = crossing(s, c), crossing(s, run.n)
    after_first = (run.n - c) / (last_t - first) if first and last_t and last_t > first else None
    full = [x for x in s if x.t >= lat and x.done <= run.n - c] or s
    held = statistics.median(x.held for x in full)
    rss_steady = statistics.median(x.rss_kb for x in full)
    last = s[-1]
    first_redis = s[0].redis_cpu_s  # after the submit: the consumer's Redis work alone
    done = max(last.done, 1)
    renews = [u for x in s for u in x.renew_us]
    alone = [u for x in s for u in x.liveness_us]
    # One claims tick's renews arrive within one sample; a sample with claims renews holds
    # one tick (claims ticks are 30 s apart at the default lease, samples 0.5 s).
    ticks = [sum(x.renew_us) for x in s if x.renew_us]
    span = max(s[-1].t - s[0].t, 1e-9)
    headrooms = [x.headroom for x in s if x.headroom is not None]
    return {
        "concurrency": c,
        "latency_s": lat,
        "n": run.n,
        "done": last.done,
        "complete": run.complete,
        "wall_s": round(run.wall_s, 1),
        "steady_rate": round(rate, 1),
        "ideal_rate": round(ideal, 1),
        "rate_vs_ideal": round(rate / ideal, 3),
        "after_first_rate": round(after_first, 1) if after_first else None,
        "after_first_vs_ideal": round(after_first / ideal, 3) if after_first else None,
        "overall_rate": round(last.done / last.t, 1),
        "held_median": held,
        "held_max": max(x.held for x in s),
        "idle_rss_mb": round(run.idle_rss_kb / 1024, 1),
        "steady_rss_mb": round(rss_steady / 1024, 1),
        "peak_rss_mb": round(max(x.hwm_kb for x in s) / 1024, 1),
        "rss_kb_per_held": round((rss_steady - run.idle_rss_kb) / held, 2) if held else None,
        "cpu_ms_per_req": round(1000 * (last.cpu_s - run.idle_cpu_s) / done, 3),
        "redis_cpu_ms_per_req": round(1000 * (last.redis_cpu_s - first_redis) / done, 3),
        "fds_max": max(x.fds for x in s),
        "sockets_max": max(x.sockets for x in s),
        "worst_headroom": round(min(headrooms), 4) if headrooms else None,
        "renew_calls": len(renews),
        "liveness_calls": len(alone),
        "renew_calls_per_s": round((len(renews) + len(alone)) / span, 3),
        "renew_redis_ms_per_s": round((sum(renews) + sum(alone)) / 1000 / span, 3),
        "liveness_call_us_median": statistics.median(alone) if alone else None,
        "renew_tick_ms_median": round(statistics.median(ticks) / 1000, 2) if ticks else None,
        "renew_tick_ms_max": round(max(ticks) / 1000, 2) if ticks else None,
        "renew_call_ms_max": round(max(renews) / 1000, 2) if renews else None,
        "scripts_per_req": round(
            sum(v for k, v in run.commands.items() if k in ("evalsha", "eval")) / done, 3
        ),
        "round_trip_cmds_per_req": round(
            sum(v for k, v in run.commands.items() if k in TOP_LEVEL) / done, 3
        ),
        "commands": run.commands,
        "gateway_posts": run.gateway.get("posts"),
        "gateway_connections": run.gateway.get("connections"),
        "nofile_soft_at_start": run.nofile_soft,
        "batch_size": run.batch_size or 10,
        "summary_line": run.summary_line,
    }


# Commands a client sends (not the ones a script runs): with a pipeline several go in one
# round trip, so this is an upper bound on round trips per request.
TOP_LEVEL = {"evalsha", "eval", "zrange", "zrangebyscore", "hmget", "hget", "mget", "get", "exists"}

COLUMNS = [
    ("concurrency", "in flight"),
    ("steady_rate", "req/s"),
    ("ideal_rate", "ideal"),
    ("rate_vs_ideal", "of ideal"),
    ("after_first_rate", "req/s after 1st"),
    ("after_first_vs_ideal", "of ideal"),
    ("cpu_ms_per_req", "CPU ms/req"),
    ("gateway_connections", "connections"),
    ("held_median", "held"),
    ("idle_rss_mb", "idle RSS MB"),
    ("peak_rss_mb", "peak RSS MB"),
    ("rss_kb_per_held", "KB/held"),
    ("redis_cpu_ms_per_req", "Redis ms/req"),
    ("scripts_per_req", "scripts/req"),
    ("fds_max", "fds"),
    ("sockets_max", "sockets"),
    ("worst_headroom", "min headroom"),
    ("renew_tick_ms_median", "tick ms (med)"),
    ("renew_tick_ms_max", "tick ms (max)"),
    ("renew_calls_per_s", "renews/s"),
    ("renew_redis_ms_per_s", "renew Redis ms/s"),
]


def table(rows: list[dict[str, Any]]) -> str:
    head = "| " + " | ".join(h for _k, h in COLUMNS) + " |"
    rule = "|" + "|".join("---:" for _ in COLUMNS) + "|"
    body = ["| " + " | ".join(str(r.get(k)) for k, _h in COLUMNS) + " |" for r in rows]
    return "\n".join([head, rule, *body])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, action="append", help="repeatable (2000)")
    p.add_argument("--latency-ms", type=int, default=10000)
    p.add_argument("--periods", type=int, default=4, help="requests = periods x concurrency")
    p.add_argument("--sample", type=float, default=0.5, help="seconds between samples")
    p.add_argument("--timeout", type=float, default=150, help="seconds allowed per run")
    p.add_argument("--nofile-soft", type=int, default=1024, help="serve's soft RLIMIT_NOFILE")
    p.add_argument("--claimkit", default=DEFAULT_CLAIMKIT, help="the claimkit executable")
    p.add_argument("--batch-size", type=int, default=0, help="config batch_size (0: default)")
    p.add_argument("--profile", action="store_true", help="run serve under pyinstrument")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    levels = args.concurrency or [2000]
    RESULTS.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    workdir = RESULTS / f"inflight-{stamp}"
    workdir.mkdir()
    rows = []
    for c in levels:
        run = one_run(args, c, workdir)
        row = figures(run)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if not run.complete:
            print(run.serve_log_tail, file=sys.stderr)
        (workdir / f"samples-{c}.json").write_text(json.dumps([asdict(x) for x in run.samples]))
    out = args.json or RESULTS / f"inflight-{stamp}.json"
    out.write_text(
        json.dumps(
            {"machine": machine(), "args": vars(args) | {"json": str(out)}, "runs": rows}, indent=2
        )
    )
    print(table(rows))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
