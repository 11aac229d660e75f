"""Profile claimkit's peers-harness worker (``bench/peers_runner.py work``) in-process.

Starts its own ``redis-server`` (a free port on 127.0.0.1, never 6379) and the harness
gateway (``node gateway.js``), enqueues N requests with the runner's ``enqueue``, then runs
``work`` under a profiler and writes what it saw when the N-th request is settled (the
runner leaves at once, as in the harness)::

    CLAIMKIT_PEERS_DIR=../shared/peers .venv/bin/python bench/profile_peers.py \
        --n 5000 --profiler cprofile --out /tmp/peers.prof

``--profiler cprofile`` writes a pstats file and prints the top functions by own time;
``pyinstrument`` writes a text tree; ``none`` measures CPU per job only (user+sys of the
work window, from the runner's done line). Not run in CI.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEERS = Path(os.environ.get("CLAIMKIT_PEERS_DIR", HERE.parent.parent / "shared" / "peers"))


def free_port() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in (6379, 6390):
            return port


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=5000)
    p.add_argument("--concurrency", type=int, default=50)
    p.add_argument("--workload", choices=["noop", "http"], default="http")
    p.add_argument("--profiler", choices=["cprofile", "pyinstrument", "none"], default="cprofile")
    p.add_argument("--out", type=Path, default=Path("/tmp/claimkit-peers.prof"))
    p.add_argument("--top", type=int, default=45)
    args = p.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="claimkit-profile-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        rport = free_port()
        server = ["redis-server", "--port", str(rport), "--bind", "127.0.0.1", "--save", ""]
        server += ["--appendonly", "no", "--dir", str(workdir), "--daemonize", "no"]
        procs.append(subprocess.Popen(server, stdout=subprocess.DEVNULL))
        gport = free_port()
        gw = subprocess.Popen(
            ["node", str(PEERS / "gateway.js"), str(gport), "0"], stdout=subprocess.PIPE
        )
        procs.append(gw)
        assert gw.stdout is not None and b"listening" in gw.stdout.readline()
        time.sleep(0.3)
        common = ["--redis", f"redis://127.0.0.1:{rport}/0", "--n", str(args.n)]
        common += ["--workload", args.workload, "--concurrency", str(args.concurrency)]
        common += ["--gateway", f"http://127.0.0.1:{gport}/v1/completions", "--queue", "bench"]
        runner = [sys.executable, str(HERE / "peers_runner.py")]
        subprocess.run([*runner, "enqueue", *common], check=True, stdout=subprocess.DEVNULL)
        out = subprocess.run(
            [*runner, "work", *common],
            check=True,
            capture_output=True,
            text=True,
            env={
                **os.environ,
                "CLAIMKIT_PROFILE": args.profiler,
                "CLAIMKIT_PROFILE_OUT": str(args.out),
            },
        ).stdout
        done = next(json.loads(line) for line in out.splitlines() if '"done"' in line)
        print(
            f"n={done['n']} failed={done['failed']} seconds={done['seconds']:.2f} "
            f"cpu_ms_per_job={1000 * done['cpu_s'] / max(1, done['n']):.3f}"
        )
        if args.profiler == "cprofile":
            import pstats

            text = io.StringIO()
            pstats.Stats(str(args.out), stream=text).sort_stats("tottime").print_stats(args.top)
            print(text.getvalue())
        elif args.profiler == "pyinstrument":
            print(f"profile: {args.out}")
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
