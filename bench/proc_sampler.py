"""Sample the worker processes of a peers-harness run: RSS, open files and sockets, per system.

The harness (``../shared/peers``) reports throughput, CPU and Redis figures, but not what a
worker holds in memory or how many sockets it keeps open, which is what bounds a process
with thousands of slow requests in flight (docs/performance.md, "In flight"). Run this beside
the harness; it finds every ``<runner> work --redis ...`` process as it starts, samples it
every ``--interval`` seconds until it exits, and prints one row per worker process::

    python bench/proc_sampler.py --json bench/results/inflight-procs.json &
    bash ../shared/peers/run.sh --gateway-latency-ms 10000 --concurrency 2000 ...
    kill %1        # or --until-pid PID: stop when that process (the harness) ends

Columns: ``rss_start_mib`` (the first sample, a few ms after the worker started),
``rss_peak_mib``, ``fds_peak`` (entries of ``/proc/PID/fd``) and ``sockets_peak`` (those that
are sockets: gateway connections, Redis connections, listeners). A system's name comes from
its runner's file name (``peers_runner.py`` is claimkit; ``CLAIMKIT_BACKEND=redispy`` in its
environment makes it claimkit-redispy).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

RUNNER_NAMES = {
    "peers_runner.py": "claimkit",
    "bullmq_runner.js": "bullmq",
    "arq_runner.py": "arq",
    "saq_runner.py": "saq",
    "rq_runner.py": "rq",
    "calib_coredis.py": "calib-coredis",
    "calib_trio.py": "calib-trio",
    "calib_asyncio.py": "calib-asyncio",
}


@dataclass
class Worker:
    pid: int
    system: str
    args: str
    started: float
    samples: int = 0
    rss_start_mib: float = 0.0
    rss_peak_mib: float = 0.0
    fds_peak: int = 0
    sockets_peak: int = 0
    seconds: float = 0.0


def system_of(proc: psutil.Process) -> tuple[str, str] | None:
    """``(system, argument string)`` for a runner's ``work`` process, else None."""
    try:
        cmd = proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
    if "work" not in cmd or "--redis" not in cmd:
        return None
    for part in cmd:
        name = RUNNER_NAMES.get(Path(part).name)
        if name is None:
            continue
        if name == "claimkit":
            try:
                if proc.environ().get("CLAIMKIT_BACKEND") == "redispy":
                    name = "claimkit-redispy"
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        i = cmd.index("work")
        return name, " ".join(cmd[i:])
    return None


def count_sockets(pid: int) -> int:
    """How many of ``pid``'s open files are sockets (``/proc/PID/fd`` links to ``socket:[…]``)."""
    fd_dir = Path(f"/proc/{pid}/fd")
    n = 0
    for fd in fd_dir.iterdir():
        try:
            n += fd.readlink().name.startswith("socket:")
        except OSError:
            pass
    return n


def sample(proc: psutil.Process, w: Worker) -> bool:
    """One sample of ``proc`` into ``w``; False once the process is gone."""
    try:
        with proc.oneshot():
            rss = proc.memory_info().rss / 2**20
            fds = proc.num_fds()
        sockets = count_sockets(proc.pid)
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except (psutil.AccessDenied, FileNotFoundError):
        return not FileNotFoundError
    if w.samples == 0:
        w.rss_start_mib = rss
    w.samples += 1
    w.rss_peak_mib = max(w.rss_peak_mib, rss)
    w.fds_peak = max(w.fds_peak, fds)
    w.sockets_peak = max(w.sockets_peak, sockets)
    w.seconds = time.monotonic() - w.started
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--interval", type=float, default=0.5, help="seconds between samples")
    ap.add_argument("--until-pid", type=int, help="stop once this process has exited")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    live: dict[int, tuple[psutil.Process, Worker]] = {}
    done: list[Worker] = []
    stop = False

    def on_signal(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while not stop:
        if args.until_pid is not None and not psutil.pid_exists(args.until_pid):
            break
        for proc in psutil.process_iter():
            if proc.pid in live:
                continue
            found = system_of(proc)
            if found is not None:
                live[proc.pid] = (proc, Worker(proc.pid, found[0], found[1], time.monotonic()))
        for pid, (proc, w) in list(live.items()):
            if not sample(proc, w):
                done.append(w)
                del live[pid]
        time.sleep(args.interval)
    done.extend(w for _, w in live.values())
    rows = [asdict(w) for w in done if w.samples]
    head = ("system", "pid", "s", "RSS start", "RSS peak", "fds", "sockets")
    print("{:<18} {:>7} {:>6} {:>10} {:>10} {:>6} {:>8}".format(*head))
    for r in rows:
        print(
            f"{r['system']:<18} {r['pid']:>7} {r['seconds']:>6.0f} {r['rss_start_mib']:>8.1f}Mi"
            f" {r['rss_peak_mib']:>8.1f}Mi {r['fds_peak']:>6} {r['sockets_peak']:>8}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
