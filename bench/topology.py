"""What the topology costs: the claim protocol on standalone, on a cluster, and with WAIT.

Every setup starts its own private servers (never the shared one on 6379): a standalone
``redis-server``; the same with one replica and ``wait_replicas: 1``; a 3-master cluster
with one replica each (``claimkit.dev.cluster``) with a tagged queue and list
(``{t}:q`` + ``{t}:results``, the one-script ack) and with an untagged queue whose list
is in another slot (the outbox ack, docs/topology.md#acks-across-slots).

    python bench/topology.py [--n 20000] [--loops 4] [--batch 10] [--runs 3] \
        [--json bench/results/topology.json]

Each run drives the protocol with ``--loops`` concurrent Python loops of peek + claim +
ack (batch ``--batch``), the way ``bench/protocol.py ceiling`` does, and prints claim+ack
per second and the Redis CPU seconds per 1,000 jobs summed over every server of the setup.
Medians of ``--runs``. On this 2-core machine all servers and the loops share two cores,
so the cluster's figure is a floor for three real nodes, not a scaling figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import trio  # noqa: E402
from _benchutil import machine  # noqa: E402

from claimkit.dev.cluster import RedisClusterProcesses  # noqa: E402
from claimkit.dev.redis_server import RedisServer  # noqa: E402
from claimkit.dev.resp_client import call  # noqa: E402
from claimkit.protocol.models import Envelope, parse_member  # noqa: E402
from claimkit.protocol.ops import AckItem, QueueOps, new_token  # noqa: E402
from claimkit.store import open_store  # noqa: E402
from claimkit.store.topology import Topology  # noqa: E402


def envelope(i: int, deadline: int) -> bytes:
    doc = {
        "internal": {"request_token": f"{i:032x}"},
        "request_kind": "plain",
        "data": {"id": f"req-{i:07d}", "deadline": deadline, "payload": {"prompt": "x" * 120}},
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def _cpu(port: int) -> float:
    (info,) = call(port, [["INFO", "cpu"]], 5.0)
    text = info.decode() if isinstance(info, bytes) else str(info)
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return float(fields["used_cpu_user"]) + float(fields["used_cpu_sys"])


async def _drive(
    url: str,
    topology: Topology,
    queue: str,
    result_list: str,
    n: int,
    loops: int,
    batch: int,
    wait_replicas: int,
) -> float:
    async with open_store(url, topology=topology, wait_replicas=wait_replicas) as store:
        deadline = int(time.time()) + 7200
        total = n + loops * batch * 4
        for k in range(0, total, 1000):
            args: list[Any] = []
            for i in range(k, min(total, k + 1000)):
                args += [deadline, envelope(i, deadline)]
            await store.command("ZADD", queue, *args)
        ops = QueueOps(store, queue, result_list=result_list)

        async def loop(n_each: int) -> None:
            done = 0
            while done < n_each:
                envs = [
                    e for e in map(parse_member, await ops.peek(batch)) if isinstance(e, Envelope)
                ]
                pairs = [(e, new_token()) for e in envs]
                _now, codes = await ops.claim(pairs, 300)
                items = [
                    AckItem(
                        e.id,
                        tok,
                        e.request_token,
                        result_list,
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
                nursery.start_soon(loop, n // loops)
        seconds = time.perf_counter() - t0
        records = await store.command("LLEN", result_list)
        if int(records) < n:
            raise RuntimeError(f"{result_list} holds {records} records, expected >= {n}")
        return seconds


def _until_synced(port: int, timeout: float = 20.0) -> None:
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        (info,) = call(port, [["INFO", "replication"]], 5.0)
        if b"master_link_status:up" in (info if isinstance(info, bytes) else b""):
            return
        time.sleep(0.05)
    raise RuntimeError(f"the replica on port {port} did not sync within {timeout} s")


SETUPS = ("standalone", "standalone-wait1", "cluster-tagged", "cluster-cross-slot")


def run_setup(name: str, n: int, loops: int, batch: int) -> dict[str, Any]:
    with ExitStack() as stack:
        wait = 0
        if name.startswith("standalone"):
            primary = stack.enter_context(RedisServer())
            ports = [primary.port]
            if name == "standalone-wait1":
                replica = stack.enter_context(
                    RedisServer(extra_args=["--replicaof", "127.0.0.1", str(primary.port)])
                )
                ports.append(replica.port)
                _until_synced(replica.port)
                wait = 1
            url, topology, queue, rlist = primary.url, Topology(), "q", "result-list"
        else:
            cluster = stack.enter_context(RedisClusterProcesses(masters=3, replicas=1))
            ports = [node.port for node in cluster.nodes]
            url, topology = cluster.urls[0], Topology(mode="cluster")
            tagged = name == "cluster-tagged"
            queue, rlist = ("{t}:q", "{t}:results") if tagged else ("q", "result-list")
        cpu0 = sum(_cpu(p) for p in ports)
        seconds = trio.run(_drive, url, topology, queue, rlist, n, loops, batch, wait)
        cpu = sum(_cpu(p) for p in ports) - cpu0
    return {"jobs_s": n / seconds, "redis_cpu_ms_per_1k_jobs": cpu * 1e6 / n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--loops", type=int, default=4)
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--setups", default=",".join(SETUPS))
    ap.add_argument("--json", default=str(HERE / "results" / "topology.json"))
    a = ap.parse_args()
    out: dict[str, Any] = {"machine": machine(), "n": a.n, "loops": a.loops, "batch": a.batch}
    print(f"{'setup':<22}{'claim+ack/s':>14}{'Redis CPU ms / 1k jobs':>26}")
    for name in a.setups.split(","):
        runs = [run_setup(name, a.n, a.loops, a.batch) for _ in range(a.runs)]
        row = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        row["runs"] = runs
        out[name] = row
        print(f"{name:<22}{row['jobs_s']:>14,.0f}{row['redis_cpu_ms_per_1k_jobs']:>26,.1f}")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
