"""Chaos harness: measure claimkit's durability promise under faults (GitHub issue #4).

Zero lost requests and exactly one terminal record per request, through any crash. The
harness runs, all on this machine and all started and stopped by PID:

- a private Redis (``appendfsync always``, :class:`claimkit.dev.redis_server.RedisServer`);
- the gateway simulator (``claimkit sim``) with random latency, 429s and 503s;
- N ``claimkit serve`` consumers (short lease, fast reclaimer);
- a producer submitting requests throughout (some with short deadlines, some cancelled);
- a fault schedule drawn from ``--seed``: SIGKILL a consumer; SIGSTOP one for longer than
  its lease, then SIGCONT (its stolen claims must be cancelled, its late results
  suppressed); ``CLIENT KILL`` a consumer's Redis connections; SIGKILL Redis and restart it
  from its AOF; SIGTERM a consumer (graceful); start fresh consumers; make Redis refuse
  writes for a moment (``maxmemory``, as when it runs out of memory).

While it runs it samples, with one atomic read-only script, where every request is, and
reads Redis ``MONITOR`` (see ``bench/chaos_observe.py``). At the end it checks:

1. every accepted request has exactly one terminal record (lost = 0, duplicates = 0);
2. at every sample each accepted request is in exactly one of pending, claimed, retry,
   dead, results (a dead-lettered request's record counts with its dead entry), claims are
   whole (owner, payload, score, lease entry) and a pending member's score is its own
   (its deadline and enqueue order, docs/protocol.md#enqueue-order);
3. no record exists for an id that was never submitted;
4. within each poll batch (one claim call) the candidates are in deadline order, so the
   first dispatch of a batch follows deadlines;
5. a killed consumer's claims are dispatched again within lease + reclaim interval + poll
   interval (+ slack);
6. no consumer crashed and every graceful stop exited 0 within its grace.

7. no consumer log line mentions ``CROSSSLOT`` (a script or transaction that spanned two
   cluster slots).

It prints one line of figures on stdout and exits 1 if any check fails. Among them:
requests, records, lost, duplicates, executions (POSTs counted at the gateway simulator),
the longest stretch without a new record (``no_progress_max``, to the sampling interval),
and ``crossslot``.

**Topologies** (``--topology``; issue 10, docs/topology.md), all started by PID from here
(:mod:`claimkit.dev.cluster`, :mod:`claimkit.dev.sentinel`), every data node with
``appendfsync always``:

- ``standalone`` (default): one private Redis, as above.
- ``cluster``: 3 primaries with a replica each; the queue ``chaos`` and the result list
  ``result-list`` are in slots of different primaries (the cross-slot ack through the
  outbox), or with ``--tagged`` ``{t}:q`` and ``{t}:results`` in one slot (the one-script
  ack). The ``redis`` fault SIGKILLs the queue's primary and restarts it from its AOF within
  the node timeout (5 s), so no failover happens.
- ``sentinel``: a primary, a replica and 3 sentinels; the consumers find the primary through
  the sentinels. The ``redis`` fault does not apply (a crash is a failover there).

``--fault failover`` replaces the random schedule by one fault halfway through submitting:
SIGKILL the primary (cluster: the queue's) and wait until a replica is promoted; the
consumers must follow it. Asynchronous replication may lose the last writes: ``lost``,
``duplicates`` and ``records_vanished`` (records read before the failover that the new
primary does not have) say what it cost, ``lost_never_claimed`` how many of the lost never
reached a consumer (the producer's own submit was lost, which ``--wait-replicas`` does not
cover). ``--wait-replicas N`` sets the consumers' ``wait_replicas`` (claim, ack, release,
park and reclaim wait for N replicas).

A cluster or sentinel run needs claimkit's topology support (``mode``, ``addrs``,
``master_name``); where it is missing the run stops at once with exit status 2.

    python bench/chaos.py                      # the default run, about 3 minutes
    python bench/chaos.py --seed 7 --requests 10000 --duration 300 --kills 20 --redis-crashes 2
    python bench/chaos.py --topology cluster --kills 3 --redis-crashes 0
    python bench/chaos.py --fault failover --wait-replicas 1 --requests 2000 --duration 60
    nox -s chaos -- --seed 3
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import inspect
import itertools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chaos_observe import (
    QUEUE_SNAPSHOT,
    RESULTS_READ,
    SNAPSHOT,
    ChaosKeys,
    Locations,
    Monitor,
    MonitorSet,
    count_records,
    gateway_inversions,
    location_problem,
    order_violations,
    redelivery_of,
)

from claimkit.dev.cluster import RedisClusterProcesses
from claimkit.dev.redis_server import RedisServer, RedisServerError, find_server_binary
from claimkit.dev.resp_client import call as resp_call
from claimkit.dev.sentinel import SentinelGroup
from claimkit.producer import Producer
from claimkit.protocol.keys import key_slot, request_active
from claimkit.store import Store, StoreError, StoreUnavailable, open_store

QUEUE = "chaos"
RESULTS = "result-list"  # slot 6122, another primary's than "chaos" (4772) on 3 primaries
TAGGED_QUEUE = "{t}:q"  # --tagged: the queue and the result list in one slot (15891)
TAGGED_RESULTS = "{t}:results"
RETRY = "retry-sortedset"
TOPOLOGIES = ("standalone", "cluster", "sentinel")
MASTER_NAME = "claimkit"
FAULT_KINDS = ("kill", "stop", "clientkill", "redis", "term", "start", "oom")
DEFAULT_WEIGHTS = "kill=4,stop=3,clientkill=2,redis=1,term=2,start=1,oom=1"
# Rough seconds each fault takes, for fitting a schedule into --duration.
_FAULT_COST = {"kill": 5.0, "stop": 5.0, "clientkill": 0.5, "redis": 4.0, "term": 3.0}
_FAULT_COST |= {"start": 0.5, "oom": 1.5, "failover": 8.0}
# The cluster's node timeout: longer than a "redis" fault's downtime (so a restart from the
# AOF is no failover), unless the run's fault is the failover.
_CLUSTER_NODE_TIMEOUT_MS = 5000
_FAILOVER_NODE_TIMEOUT_MS = 2000
_FAILOVER_WAIT = 60.0  # seconds allowed for a promotion
_REQUEST_TIMEOUT = 10  # the consumers' request_timeout_seconds


def log(message: str) -> None:
    sys.stderr.write(f"[chaos {time.strftime('%H:%M:%S')}] {message}\n")
    sys.stderr.flush()


# -- options and schedule ------------------------------------------------------------------------


def _pair(text: str) -> tuple[float, float]:
    parts = [float(p) for p in text.split(",")]
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or parts[0] > parts[1] or parts[0] < 0:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX seconds, got {text!r}")
    return parts[0], parts[1]


def _weights(text: str) -> dict[str, float]:
    out = dict.fromkeys(FAULT_KINDS, 0.0)
    for part in text.split(","):
        kind, _, weight = part.partition("=")
        if kind.strip() not in out:
            raise argparse.ArgumentTypeError(f"unknown fault kind {kind!r}")
        out[kind.strip()] = float(weight)
    if sum(out.values()) <= 0:
        raise argparse.ArgumentTypeError("at least one fault weight must be positive")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="chaos",
        description="Chaos harness for claimkit's durability promise (lost = 0, duplicates = 0).",
    )
    p.add_argument("--seed", type=int, default=1, help="seed of the workload and fault schedule")
    p.add_argument("--requests", type=int, default=3000, help="requests to submit")
    p.add_argument(
        "--duration", type=float, default=120.0, help="seconds over which requests are submitted"
    )
    p.add_argument("--consumers", type=int, default=3, help="claimkit serve processes at start")
    p.add_argument("--kills", type=int, default=0, help="at least this many consumer SIGKILLs")
    p.add_argument(
        "--redis-crashes",
        type=int,
        default=None,
        help="exactly this many Redis SIGKILL+restarts (default 1; 0 with sentinel or failover)",
    )
    p.add_argument("--fault-gap", type=_pair, default=(1.0, 3.0), help="MIN,MAX s between faults")
    p.add_argument(
        "--fault-weights",
        type=_weights,
        default=_weights(DEFAULT_WEIGHTS),
        help=f"relative frequency of each fault kind (default {DEFAULT_WEIGHTS})",
    )
    p.add_argument(
        "--every-kind", action="store_true", help="schedule at least one fault of every kind"
    )
    p.add_argument("--lease", type=float, default=3.0, help="claim_lease_ttl_seconds")
    p.add_argument("--reclaim-ms", type=int, default=500, help="claim_reclaim_interval_ms")
    p.add_argument("--poll-ms", type=int, default=100, help="poll_interval_ms")
    p.add_argument("--batch", type=int, default=10, help="batch_size")
    p.add_argument("--concurrency", type=int, default=16, help="per consumer")
    p.add_argument(
        "--drain",
        type=float,
        default=0.5,
        help="drain_timeout_seconds: below the gateway latency, so SIGTERM sweeps claims back",
    )
    p.add_argument("--latency", default="0.05,1.0", help="simulator latency MIN,MAX seconds")
    p.add_argument("--rate-429", type=float, default=0.05)
    p.add_argument("--rate-5xx", type=float, default=0.05)
    p.add_argument("--cancel-rate", type=float, default=0.01, help="share of requests cancelled")
    p.add_argument(
        "--short-deadline-rate",
        type=float,
        default=0.03,
        help="share of requests whose deadline is 2-8 s away (some expire in flight)",
    )
    p.add_argument("--sample-interval", type=float, default=0.5, help="seconds between snapshots")
    p.add_argument("--settle", type=float, default=120.0, help="max seconds to wait for records")
    p.add_argument("--slack", type=float, default=1.5, help="seconds added to the redelivery bound")
    p.add_argument("--json", type=Path, help="also write every figure and failure here")
    p.add_argument(
        "--topology",
        choices=TOPOLOGIES,
        default=None,
        help="standalone (default), cluster (3 primaries + replicas) or sentinel "
        "(primary + replica + 3 sentinels; the default with --fault failover)",
    )
    p.add_argument(
        "--tagged",
        action="store_true",
        help=f"queue {TAGGED_QUEUE} and result list {TAGGED_RESULTS} (one slot: the "
        f"one-script ack) instead of {QUEUE} and {RESULTS}",
    )
    p.add_argument(
        "--fault",
        choices=("failover",),
        help="instead of the random schedule: SIGKILL the primary halfway through and wait "
        "for a replica to be promoted (sentinel or cluster)",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="replicas per primary (cluster, sentinel); after a failover one fewer remains",
    )
    p.add_argument(
        "--rejoin",
        action="store_true",
        help="after a failover, restart the killed primary: it comes back as a replica",
    )
    p.add_argument(
        "--lag-ms",
        type=int,
        default=0,
        help="with --fault failover: cut the primary's replicas off this many ms before the "
        "kill (its ACL refuses SYNC/PSYNC, its replica links are killed), so the promoted "
        "replica misses the primary's last writes, as asynchronous replication can",
    )
    p.add_argument(
        "--wait-replicas",
        type=int,
        default=None,
        help='the consumers\' "wait_replicas" (WAIT for N replicas after each claim, ack, '
        "release, park, reclaim); unset: not in the config",
    )
    p.add_argument(
        "--wait-timeout-ms",
        type=int,
        default=None,
        help="the consumers' \"wait_timeout_ms\"; unset: not in the config (claimkit's default)",
    )
    p.add_argument("--keep", action="store_true", help="keep the work dir (AOF, logs)")
    args = p.parse_args(argv)
    if args.requests < 1 or args.duration <= 0 or args.consumers < 1:
        p.error("--requests, --duration and --consumers must be positive")
    if args.topology is None:
        args.topology = "sentinel" if args.fault == "failover" else "standalone"
    if args.fault == "failover" and args.topology == "standalone":
        p.error("--fault failover needs --topology sentinel or cluster (a replica to promote)")
    if args.redis_crashes is None:
        args.redis_crashes = 0 if args.topology == "sentinel" or args.fault else 1
    if args.topology == "sentinel" and args.redis_crashes:
        p.error(
            "--redis-crashes does not apply to sentinel (a crash is a failover there: "
            "use --fault failover)"
        )
    if args.topology == "sentinel":
        args.fault_weights = {**args.fault_weights, "redis": 0.0}
        if sum(args.fault_weights.values()) <= 0:
            p.error("at least one fault weight but redis must be positive with sentinel")
    if args.replicas < (1 if args.topology == "sentinel" or args.fault else 0):
        p.error("--replicas must be at least 1 with sentinel or --fault failover")
    short = args.wait_replicas is not None and args.wait_replicas >= args.replicas
    if args.fault and short and not args.rejoin:
        log(
            f"note: after the failover {args.replicas - 1} replica(s) remain, fewer than "
            f"--wait-replicas {args.wait_replicas}: every waited call will wait "
            "wait_timeout_ms and warn (add --rejoin or --replicas)"
        )
    for name in ("wait_replicas", "wait_timeout_ms"):
        value = getattr(args, name)
        if value is not None and value < 0:
            p.error(f"--{name.replace('_', '-')} must not be negative")
    args.queue, args.results = (TAGGED_QUEUE, TAGGED_RESULTS) if args.tagged else (QUEUE, RESULTS)
    return args


@dataclass(frozen=True)
class Fault:
    gap: float  # seconds after the previous fault ended
    kind: str
    pick: float  # in [0, 1): which consumer, chosen when the fault runs
    length: float  # stop: seconds stopped; redis: seconds down; kill/term: replacement delay


def make_schedule(rng: random.Random, opts: argparse.Namespace) -> list[Fault]:
    """The fault schedule: kinds, gaps and lengths all drawn from ``rng`` (the seed).

    ``--fault failover``: one failover halfway through submitting, nothing else."""
    if opts.fault == "failover":
        return [Fault(opts.duration / 2, "failover", 0.0, 0.0)]
    kinds: list[str] = []
    budget = opts.duration
    while budget > 0:
        kind = rng.choices(FAULT_KINDS, [opts.fault_weights[k] for k in FAULT_KINDS])[0]
        kinds.append(kind)
        budget -= _FAULT_COST[kind] + sum(opts.fault_gap) / 2
    # Quotas: exactly --redis-crashes Redis crashes, at least --kills consumer kills.
    slots = [i for i, k in enumerate(kinds) if k == "redis"]
    others = [k for k in FAULT_KINDS if k != "redis"]
    for i in slots[opts.redis_crashes :]:
        kinds[i] = rng.choices(others, [opts.fault_weights[k] or 1e-9 for k in others])[0]
    need = opts.redis_crashes - min(len(slots), opts.redis_crashes)
    need_kills = max(0, opts.kills - kinds.count("kill"))
    free = [i for i, k in enumerate(kinds) if k not in ("redis", "kill")]
    rng.shuffle(free)
    _place(kinds, free, "redis", need, rng)
    _place(kinds, free, "kill", need_kills, rng)
    if opts.every_kind:
        _cover_every_kind(kinds, opts, rng)
    out = []
    for kind in kinds:
        length = _fault_length(kind, opts, rng)
        out.append(Fault(rng.uniform(*opts.fault_gap), kind, rng.random(), length))
    return out


def _place(kinds: list[str], free: list[int], kind: str, n: int, rng: random.Random) -> None:
    """Make ``n`` more faults ``kind``: over a free slot while there is one, else inserted."""
    for _ in range(n):
        if free:
            kinds[free.pop()] = kind
        else:
            kinds.insert(rng.randrange(len(kinds) + 1), kind)


def _cover_every_kind(kinds: list[str], opts: argparse.Namespace, rng: random.Random) -> None:
    """``--every-kind``: each kind at least once, over a kind that occurs more than needed."""
    for kind in FAULT_KINDS:
        if kind in kinds or (kind == "redis" and opts.topology == "sentinel"):
            continue
        spare = [
            i
            for i, k in enumerate(kinds)
            if kinds.count(k) > 1 and k != "redis" and (k != "kill" or kinds.count(k) > opts.kills)
        ]
        if spare:
            kinds[rng.choice(spare)] = kind
        else:
            kinds.insert(rng.randrange(len(kinds) + 1), kind)


def _fault_length(kind: str, opts: argparse.Namespace, rng: random.Random) -> float:
    """Seconds stopped (stop), down (redis) or before the replacement starts (kill/term)."""
    if kind == "stop":
        return float(opts.lease + rng.uniform(0.5, 2.5))
    if kind == "redis":
        return rng.uniform(0.2, 1.5)
    return rng.uniform(0.5, 2.0)


# -- the Redis topology --------------------------------------------------------------------------


class TopologyUnsupported(RuntimeError):
    """This claimkit cannot open a cluster or sentinel store (no issue 10 support yet)."""


def topology_support_problem() -> str | None:
    """Why this claimkit cannot run a cluster or sentinel topology, or ``None``."""
    if importlib.util.find_spec("claimkit.store.topology") is None:
        return "this claimkit has no topology support (no claimkit.store.topology)"
    if "topology" not in inspect.signature(open_store).parameters:
        return "this claimkit's open_store() takes no topology"
    return None


class Topo:
    """The Redis of the run, started and stopped by PID: one server, a cluster (3 primaries,
    one replica each) or a sentinel group (primary, replica, 3 sentinels); every data node
    with ``appendfsync always``. The blocking methods run in a thread."""

    def __init__(self, opts: argparse.Namespace, workdir: Path) -> None:
        self.mode: str = opts.topology
        self.opts = opts
        self.workdir = workdir
        self.server: RedisServer | None = None
        self.cluster: RedisClusterProcesses | None = None
        self.group: SentinelGroup | None = None
        self.failover_seconds: list[float] = []
        self.rejoin_seconds: list[float] = []

    def start(self) -> None:
        if self.mode == "standalone":
            self.server = RedisServer(aof="always", directory=self.workdir / "redis")
            self.server.start()
        elif self.mode == "cluster":
            failover = self.opts.fault == "failover"
            self.cluster = RedisClusterProcesses(
                masters=3,
                replicas=self.opts.replicas,
                aof="always",
                node_timeout_ms=_FAILOVER_NODE_TIMEOUT_MS if failover else _CLUSTER_NODE_TIMEOUT_MS,
                directory=self.workdir / "cluster",
            )
            self.cluster.start()
        else:
            self.group = SentinelGroup(
                replicas=self.opts.replicas,
                sentinels=3,
                master_name=MASTER_NAME,
                aof="always",
                directory=self.workdir / "sentinel",
            )
            self.group.start()

    def close(self) -> None:
        for part in (self.server, self.cluster, self.group):
            if part is not None:
                part.close()

    def describe(self) -> str:
        q, r = self.opts.queue, self.opts.results
        if self.cluster is not None:
            return (
                f"cluster of 3 primaries + 3 replicas (node timeout "
                f"{self.cluster.node_timeout_ms} ms): queue {q!r} slot {key_slot(q)} on port "
                f"{self.port_for(q)}, results {r!r} slot {key_slot(r)} on port {self.port_for(r)}"
            )
        if self.group is not None:
            return (
                f"sentinel group {MASTER_NAME!r}: primary port {self.group.primary.port}, "
                f"replica {[s.port for s in self.group.replicas]}, "
                f"sentinels {self.group.sentinel_addrs}"
            )
        return f"standalone Redis on {self.url}"

    @property
    def url(self) -> str:
        if self.cluster is not None:
            return self.cluster.urls[0]
        if self.group is not None:
            return self.group.sentinel_url
        assert self.server is not None
        return self.server.url

    def transport_fields(self) -> dict[str, Any]:
        """``url`` and, outside standalone, ``mode``, ``addrs`` and ``master_name``: the
        address part of the consumers' transport config (issue 10's contract: ``url`` is
        the first seed or sentinel, ``addrs`` the others)."""
        if self.cluster is not None:
            return {"url": self.url, "mode": "cluster", "addrs": self.cluster.addrs[1:]}
        if self.group is not None:
            return {
                "url": self.url,
                "mode": "sentinel",
                "addrs": self.group.sentinel_addrs[1:],
                "master_name": MASTER_NAME,
            }
        return {"url": self.url}

    def primary_ports(self) -> list[int]:
        """The ports of the primaries now (the consumers' data connections go there)."""
        if self.cluster is not None:
            return [m.port for m in self.cluster.masters]
        if self.group is not None:
            return [self.group.primary.port]
        assert self.server is not None
        return [self.server.port]

    def port_for(self, key: str) -> int:
        """The port of the primary that holds ``key`` now."""
        if self.cluster is not None:
            return self.cluster.primary_for_slot(key_slot(key)).port
        return self.primary_ports()[0]

    def crash_target(self) -> RedisServer:
        """The server the ``redis`` fault SIGKILLs and restarts: the one Redis, or the
        queue's primary (cluster)."""
        if self.cluster is not None:
            return self.cluster.primary_for_slot(key_slot(self.opts.queue))
        assert self.server is not None
        return self.server

    def failover(self) -> tuple[RedisServer, str]:
        """SIGKILL the primary (cluster: the queue's) and wait for its replica's promotion.

        Returns: the killed primary and the new primary's ``host:port``."""
        self._cut_replication()
        began = time.monotonic()
        if self.group is not None:
            victim = self.group.kill_primary()
            new = self.group.wait_promoted(_FAILOVER_WAIT)
        else:
            assert self.cluster is not None
            victim = self.crash_target()
            self.cluster.kill_primary(self.cluster.masters.index(victim))
            (promoted,) = self.cluster.wait_failover(_FAILOVER_WAIT)
            new = f"127.0.0.1:{promoted.port}"
        self.failover_seconds.append(time.monotonic() - began)
        return victim, new

    def _cut_replication(self) -> None:
        """With ``--lag-ms``: cut the primary's replicas off for that long before the kill,
        so the primary acknowledges writes no replica ever gets (asynchronous
        replication's window, made wide enough to measure). The primary's ACL refuses
        ``SYNC``/``PSYNC`` and its replica links are killed: a replica cannot reconnect,
        and the promoted one misses the last ``lag_ms`` of writes."""
        if self.opts.lag_ms <= 0:
            return
        port = self.group.primary.port if self.group is not None else self.crash_target().port
        for reply in resp_call(
            port,
            [
                ["ACL", "SETUSER", "default", "-sync", "-psync"],
                ["CLIENT", "KILL", "TYPE", "replica"],
            ],
            5.0,
        ):
            if isinstance(reply, Exception):
                raise RuntimeError(f"cannot cut replication on port {port}: {reply}")
        time.sleep(self.opts.lag_ms / 1000)

    def rejoin(self, server: RedisServer) -> None:
        """Restart a killed primary; it comes back as a replica of its replacement."""
        began = time.monotonic()
        if self.group is not None:
            self.group.rejoin(server, _FAILOVER_WAIT)
        else:
            assert self.cluster is not None
            self.cluster.rejoin(server, _FAILOVER_WAIT)
        self.rejoin_seconds.append(time.monotonic() - began)

    def open_store(self) -> contextlib.AbstractAsyncContextManager[Store]:
        """The harness's own store (producer, samples) on this topology.

        Raises:
            TopologyUnsupported: a cluster or sentinel, and claimkit cannot open one.
        """
        if self.mode == "standalone":
            return open_store(self.url, timeout=3)
        why = topology_support_problem()
        if why is not None:
            raise TopologyUnsupported(why)
        from claimkit.store.topology import Topology

        fields = self.transport_fields()
        topology = Topology(
            mode=fields["mode"],
            addrs=tuple(fields["addrs"]),
            master_name=fields.get("master_name"),
        )
        return open_store(fields["url"], timeout=3, topology=topology)


@dataclass
class RecordLog:
    """The result list's records as the harness has read them, oldest first.

    Read incrementally (the new head of the list) where the list only grows, or whole
    (:meth:`replace`) where a failover may have lost some: then ``vanished`` counts the
    records once read that are gone, and counting restarts from the survivors.
    """

    records: list[bytes] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)
    vanished: int = 0
    progress: list[float] = field(default_factory=list)  # monotonic times a record came

    def extend(self, new: list[bytes]) -> None:
        if new:
            self.records.extend(new)
            self.counts.update(count_records(new))
            self.progress.append(time.monotonic())

    def replace(self, whole: list[bytes]) -> None:
        counts = count_records(whole)
        self.vanished += sum((self.counts - counts).values())
        if counts - self.counts:
            self.progress.append(time.monotonic())
        self.records, self.counts = list(whole), counts

    def longest_stall(self) -> float:
        """The longest time between two reads that brought new records (seconds)."""
        times = self.progress
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


# -- processes -----------------------------------------------------------------------------------


def claimkit_exe() -> list[str]:
    beside = Path(sys.executable).with_name("claimkit")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("claimkit")
    if found:
        return [found]
    return [sys.executable, "-c", "from claimkit.cli.app import main; main()"]


@dataclass(eq=False)
class ConsumerProc:
    name: str
    proc: subprocess.Popen[bytes]
    started: float
    expected_exit: bool = False
    stopped: bool = False
    reported: bool = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None


class Aborted(Exception):
    """SIGINT or SIGTERM: stop, and stop every process this run started."""


async def abort_on_signal() -> None:
    # Also when started in the background, where SIGINT may be ignored: cleanup must run.
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            raise Aborted(signal.Signals(signum).name)


@dataclass
class Run:
    """Everything one chaos run knows; filled in as it goes."""

    opts: argparse.Namespace
    workdir: Path
    topo: Topo
    keys: ChaosKeys
    sim_url: str = ""
    consumers: list[ConsumerProc] = field(default_factory=list)
    serial: int = 0
    submitted: dict[str, float] = field(default_factory=dict)  # id -> deadline
    accepted: dict[str, float] = field(default_factory=dict)  # id -> time accepted (local)
    uncertain: set[str] = field(default_factory=set)
    log: RecordLog = field(default_factory=RecordLog)
    full_records: bool = False  # read the whole result list at every sample (failovers)
    snapshots: int = 0
    location_violations: list[str] = field(default_factory=list)
    location_violation_count: int = 0
    structure_problems: list[str] = field(default_factory=list)
    faults: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    kill_claims: list[tuple[float, str, str]] = field(default_factory=list)  # (t_kill, id, token)
    redelivery_delays: list[float] = field(default_factory=list)
    stop_count_cancelled: int = 0
    crashed: list[str] = field(default_factory=list)
    summaries: list[str] = field(default_factory=list)
    submitting_done: bool = False
    sample_lock: trio.Lock = field(default_factory=trio.Lock)
    cancelled: int = 0
    monitor: MonitorSet | None = None

    @property
    def record_counts(self) -> Counter[str]:
        return self.log.counts

    def follow_primaries(self) -> None:
        """Point the MONITOR readers at the primaries holding the queue and the result
        list now (after a failover)."""
        assert self.monitor is not None
        first, *rest = self.monitor.monitors
        first.port = self.topo.port_for(self.opts.queue)
        for m in rest:
            m.port = self.topo.port_for(self.opts.results)

    def consumer_config(self) -> str:
        o = self.opts
        extra = {
            name: getattr(o, name)
            for name in ("wait_replicas", "wait_timeout_ms")
            if getattr(o, name) is not None
        }
        return json.dumps(
            {
                **self.topo.transport_fields(),
                **extra,
                "queues": [{"queue_name": o.queue, "igw_base_url": self.sim_url}],
                "result_queue_name": o.results,
                "retry_queue_name": RETRY,
                "poll_interval_ms": o.poll_ms,
                "batch_size": o.batch,
                "claim_lease_ttl_seconds": o.lease,
                "claim_reclaim_interval_ms": o.reclaim_ms,
                "concurrency": o.concurrency,
                "drain_timeout_seconds": o.drain,
                "request_timeout_seconds": _REQUEST_TIMEOUT,
                "metrics_port": 0,
                "health_port": 0,
            }
        )

    def start_consumer(self) -> ConsumerProc:
        self.serial += 1
        name = f"consumer-{self.serial:02d}"
        out = (self.workdir / f"{name}.out").open("wb")
        err = (self.workdir / f"{name}.err").open("wb")
        proc = subprocess.Popen(
            [*claimkit_exe(), "serve", "--transport-config", self.consumer_config()],
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
        )
        out.close()
        err.close()
        c = ConsumerProc(name, proc, time.time())
        self.consumers.append(c)
        return c

    def live(self) -> list[ConsumerProc]:
        return [c for c in self.consumers if c.alive() and not c.expected_exit]

    def served(self, c: ConsumerProc) -> bool:
        """Whether ``c`` logged that it serves (it claims nothing before that line)."""
        text = (self.workdir / f"{c.name}.err").read_text(errors="replace")
        return "claimkit: serving " in text

    def tail(self, c: ConsumerProc, lines: int = 15) -> str:
        text = (self.workdir / f"{c.name}.err").read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])


def start_sim(run: Run) -> subprocess.Popen[bytes]:
    o = run.opts
    out_path = run.workdir / "sim.out"
    with out_path.open("wb") as out, (run.workdir / "sim.err").open("wb") as err:
        proc = subprocess.Popen(
            [
                *claimkit_exe(), "sim", "--port", "0",
                "--latency", o.latency,
                "--rate-429", str(o.rate_429),
                "--rate-5xx", str(o.rate_5xx),
                "--seed", str(o.seed),
            ],
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = re.findall(r"listening on (http://\S+)", out_path.read_text(errors="replace"))
        if found:
            run.sim_url = found[0]
            return proc
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("the simulator did not start: " + (run.workdir / "sim.err").read_text())


def redis_connections(pid: int, redis_port: int) -> list[int]:
    """Local ports of ``pid``'s TCP connections to Redis (Linux /proc)."""
    inodes: set[str] = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir() if fd_dir.exists() else ():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = []
    for table in (f"/proc/{pid}/net/tcp", f"/proc/{pid}/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                parts = line.split()
                if len(parts) > 9 and parts[9] in inodes:
                    if int(parts[2].rsplit(":", 1)[1], 16) == redis_port:
                        ports.append(int(parts[1].rsplit(":", 1)[1], 16))
    return ports


# -- Redis access that rides out faults -----------------------------------------------------------


# Error replies that mean "not now" on a cluster or a replica: a restarted primary turns
# writable 2 s after it started, a replica refuses writes until promoted.
TRANSIENT_ERRORS = ("CLUSTERDOWN", "TRYAGAIN", "MASTERDOWN", "LOADING", "READONLY")


def transient(exc: BaseException) -> bool:
    if isinstance(exc, StoreUnavailable):
        return True
    return isinstance(exc, StoreError) and str(exc).startswith(TRANSIENT_ERRORS)


async def patient(store: Store, fn: Any, *args: Any, limit: float = 60.0) -> Any:
    """Call ``fn(*args)`` until Redis answers (it may be down for a restart, or a
    failover)."""
    deadline = trio.current_time() + limit
    while True:
        try:
            return await fn(*args)
        except (StoreUnavailable, StoreError) as exc:
            if not transient(exc) or trio.current_time() > deadline:
                raise
            await trio.sleep(0.1)


def node_call(port: int, *command: str, attempts: int = 50) -> Any:
    """One command on one node, retried while it does not answer (blocking: run it in a
    thread); an error reply is returned, not raised."""
    for attempt in range(attempts):
        try:
            return resp_call(port, [list(command)], 5.0)[0]
        except OSError:
            if attempt == attempts - 1:
                raise
            time.sleep(0.1)
    raise AssertionError("unreachable")


# -- the workload --------------------------------------------------------------------------------


def request_id(run: Run, n: int, rng: random.Random) -> str:
    rid = f"r{run.opts.seed}-{n:06d}"
    if rng.random() < 0.02:
        rid += rng.choice([":a:b", "{tag}x", ":score", "-ünï", " sp"])
    return rid


async def submitter(run: Run, store: Store, rng: random.Random) -> None:
    o = run.opts
    producer = Producer(
        store,
        o.queue,
        result_list=o.results,
        wait_replicas=o.wait_replicas or 0,
        wait_timeout_ms=o.wait_timeout_ms or 1000,
    )
    tick = 0.1
    per_tick = o.requests / (o.duration / tick)
    owed = 0.0
    n = 0
    cancels: list[tuple[float, str]] = []
    start = trio.current_time()
    last_deadline = int(time.time()) + 120
    while n < o.requests:
        owed += per_tick
        batch: list[dict[str, Any]] = []
        while owed >= 1 and n < o.requests:
            owed -= 1
            rid = request_id(run, n, rng)
            n += 1
            draw = rng.random()
            now = int(time.time())
            if draw < o.short_deadline_rate:
                deadline = now + rng.randint(3, 8)
            elif draw < o.short_deadline_rate + 0.05:
                deadline = max(last_deadline, now + 60)  # ties
            else:
                deadline = now + rng.randint(60, 300)
            last_deadline = deadline
            run.submitted[rid] = deadline
            batch.append({"id": rid, "deadline": deadline, "payload": {"id": rid, "prompt": "hi"}})
            if rng.random() < o.cancel_rate:
                cancels.append((trio.current_time() + rng.uniform(0, 2), rid))
        if batch:
            ids = [str(d["id"]) for d in batch]
            try:
                await producer.submit_many(batch)
            except (StoreUnavailable, StoreError) as exc:
                run.uncertain.update(ids)
                log(f"submit of {len(ids)} failed ({exc}); acceptance to be resolved")
            else:
                t = time.time()
                for rid in ids:
                    run.accepted[rid] = t
        now_t = trio.current_time()
        due = [c for c in cancels if c[0] <= now_t]
        cancels = [c for c in cancels if c[0] > now_t]
        for _, rid in due:
            with contextlib.suppress(StoreUnavailable, StoreError):
                if await producer.cancel(rid):
                    run.cancelled += 1
        await trio.sleep_until(start + (n / max(per_tick, 1e-9)) * tick)
    run.submitting_done = True
    log(f"submitted {n} requests ({len(run.accepted)} accepted, {len(run.uncertain)} uncertain)")


async def resolve_uncertain(run: Run, store: Store) -> None:
    """A submit that failed may still have been applied: ``request-active:<id>`` says so."""
    for rid in sorted(run.uncertain):
        exists = await patient(store, store.command, "EXISTS", request_active(rid))
        if exists:
            run.uncertain.discard(rid)
            run.accepted[rid] = time.time()


# -- sampling ------------------------------------------------------------------------------------


async def read_results(run: Run, store: Store) -> None:
    """Read the result list alone (a cluster whose list is in another slot than the queue)."""
    known = 0 if run.full_records else len(run.log.records)
    n, new = await store.run(RESULTS_READ, [run.keys.results], [known])
    whole = run.full_records
    if int(n) < known:  # the list shrank: a failover lost records; read it all again
        log(f"the result list shrank from {known} to {n} records")
        n, new = await store.run(RESULTS_READ, [run.keys.results], [0])
        whole = True
    records = [r if isinstance(r, bytes) else str(r).encode() for r in reversed(list(new))]
    if whole:
        run.log.replace(records)
    else:
        run.log.extend(records)


async def sample(run: Run, store: Store) -> Locations:
    """One snapshot; checks the location invariant for every accepted request.

    Atomic (one script) where the result list shares the queue's slot; otherwise the
    queue's keys are read between two reads of the list (:func:`location_problem`)."""
    keys = run.keys
    async with run.sample_lock:
        accepted_before = set(run.accepted)
        if keys.one_slot:
            known = 0 if run.full_records else len(run.log.records)
            loc = Locations.from_reply(await store.run(SNAPSHOT, keys.snapshot_keys(), [known]))
            whole = run.full_records
            if loc.result_count is not None and loc.result_count < known:
                log(f"the result list shrank from {known} to {loc.result_count} records")
                loc = Locations.from_reply(await store.run(SNAPSHOT, keys.snapshot_keys(), [0]))
                whole = True
            if whole:
                run.log.replace(loc.new_records)
            else:
                run.log.extend(loc.new_records)
            before = after = set(run.log.counts)
        else:
            await read_results(run, store)
            before = set(run.log.counts)
            loc = Locations.from_reply(await store.run(QUEUE_SNAPSHOT, keys.queue_keys(), [0]))
            await read_results(run, store)
            after = set(run.log.counts)
        run.snapshots += 1
    for problem in loc.problems:
        run.structure_problems.append(f"t={loc.server_time:.3f} {problem}")
    for rid in set(loc.places) | accepted_before:
        places = list(loc.places.get(rid, ()))
        accepted = rid in accepted_before
        if not accepted and rid not in run.submitted:
            problem: str | None = "never submitted"
        else:  # not accepted: being submitted right now, or its submit failed
            problem = location_problem(
                places, record_before=rid in before, record_after=rid in after, accepted=accepted
            )
        if problem is not None:
            run.location_violation_count += 1
            if len(run.location_violations) < 50:
                shown = places + (["results"] if rid in after else [])
                run.location_violations.append(
                    f"t={loc.server_time:.3f} {rid!r} in {shown or 'nowhere'}: {problem}"
                )
    return loc


async def sampler(run: Run, store: Store) -> None:
    while True:
        try:
            await sample(run, store)
        except (StoreUnavailable, StoreError) as exc:
            if not transient(exc):
                log(f"sample failed: {exc}")
        await trio.sleep(run.opts.sample_interval)


async def watchdog(run: Run) -> None:
    """Any consumer that exits when not told to has crashed."""
    while True:
        for c in run.consumers:
            if not c.expected_exit and not c.alive() and not c.reported:
                c.reported = True
                msg = f"{c.name} (pid {c.pid}) exited by itself with {c.proc.returncode}"
                run.crashed.append(msg + "\n" + run.tail(c))
                log(msg)
        await trio.sleep(0.5)


# -- faults --------------------------------------------------------------------------------------


def pick(run: Run, fault: Fault) -> ConsumerProc | None:
    live = run.live()
    if not live:
        return None
    return live[min(int(fault.pick * len(live)), len(live) - 1)]


def redelivery_bound(opts: argparse.Namespace) -> float:
    return float(opts.lease + opts.reclaim_ms / 1000 + opts.poll_ms / 1000 + opts.slack)


async def fault_kill(run: Run, store: Store, fault: Fault) -> None:
    victim = pick(run, fault)
    if victim is None:
        return
    victim.expected_exit = True
    os.kill(victim.pid, signal.SIGKILL)
    t_kill = time.time()
    await trio.to_thread.run_sync(victim.proc.wait)
    loc = await patient(store, sample, run, store)
    held = [(rid, token) for rid, (token, _expiry) in loc.claims.items()]
    log(f"SIGKILL {victim.name}; {len(held)} claims in Redis right after")
    await trio.sleep(fault.length)
    if len(run.live()) < run.opts.consumers:
        c = run.start_consumer()
        run.faults["start"] += 1
        log(f"started {c.name} (replacement)")
    # Wait until each claim held at the kill is resolved: ended by its (live) owner, or
    # lapsed and dispatched again.
    assert run.monitor is not None
    limit = t_kill + redelivery_bound(run.opts) + 10
    while True:
        pending = 0
        for rid, token in held:
            state, when = redelivery_of(run.monitor.events_of(rid), token, t_kill)
            if state == "open" or (state == "lapsed" and when is None):
                pending += 1
        if not pending or time.time() > limit:
            break
        await trio.sleep(0.2)
    for rid, token in held:
        run.kill_claims.append((t_kill, rid, token))


async def fault_stop(run: Run, fault: Fault) -> None:
    victim = pick(run, fault)
    if victim is None:
        return
    log(f"SIGSTOP {victim.name} for {fault.length:.1f}s (lease {run.opts.lease}s)")
    victim.stopped = True
    os.kill(victim.pid, signal.SIGSTOP)
    try:
        await trio.sleep(fault.length)
    finally:
        os.kill(victim.pid, signal.SIGCONT)
        victim.stopped = False
    await trio.sleep(1.5)  # let its heartbeat find its stolen claims


async def fault_clientkill(run: Run, fault: Fault) -> None:
    victim = pick(run, fault)
    if victim is None:
        return
    found = killed = 0
    for node in run.topo.primary_ports():
        ports = redis_connections(victim.pid, node)
        found += len(ports)
        for port in ports:
            with contextlib.suppress(OSError):
                command = ("CLIENT", "KILL", "ADDR", f"127.0.0.1:{port}")
                reply = await trio.to_thread.run_sync(functools.partial(node_call, node, *command))
                killed += not isinstance(reply, Exception)
    log(f"CLIENT KILL {victim.name}: {killed} of {found} connections")


async def fault_redis(run: Run, fault: Fault) -> None:
    server = run.topo.crash_target()
    where = "" if run.topo.mode == "standalone" else f" (the queue's primary, port {server.port})"
    log(f"SIGKILL redis{where}; down {fault.length:.1f}s; restart from the AOF")
    await trio.to_thread.run_sync(server.kill)
    await trio.sleep(fault.length)
    for attempt in range(20):
        try:
            await trio.to_thread.run_sync(server.start)
            return
        except RedisServerError as exc:
            log(f"redis restart attempt {attempt + 1} failed: {str(exc).splitlines()[0]}")
            await trio.sleep(0.5)
    raise RuntimeError("Redis did not restart")


async def set_maxmemory(run: Run, value: str) -> None:
    for port in run.topo.primary_ports():
        command = ("CONFIG", "SET", "maxmemory", value)
        await trio.to_thread.run_sync(functools.partial(node_call, port, *command))


async def fault_oom(run: Run, fault: Fault) -> None:
    log(f"Redis refuses writes (maxmemory 1) for {fault.length:.1f}s")
    await set_maxmemory(run, "1")
    try:
        await trio.sleep(fault.length)
    finally:
        with trio.CancelScope(shield=True):
            await set_maxmemory(run, "0")


async def fault_failover(run: Run) -> None:
    """SIGKILL the primary (cluster: the queue's) and wait for its replica's promotion."""
    log(f"failover: SIGKILL the primary{'' if run.topo.group else ' of the queue'}")
    old, new = await trio.to_thread.run_sync(run.topo.failover)
    run.follow_primaries()
    log(f"failover: port {old.port} -> {new} in {run.topo.failover_seconds[-1]:.1f}s")
    if run.opts.rejoin:
        await trio.to_thread.run_sync(run.topo.rejoin, old)
        log(f"port {old.port} rejoined as a replica in {run.topo.rejoin_seconds[-1]:.1f}s")


async def fault_term(run: Run, fault: Fault) -> None:
    victim = pick(run, fault)
    if victim is None:
        return
    victim.expected_exit = True
    victim.proc.send_signal(signal.SIGTERM)
    log(f"SIGTERM {victim.name}")
    grace = run.opts.drain + 10 + 8  # drain timeout + sweep timeout + start-up margin
    try:
        code = await trio.to_thread.run_sync(lambda: victim.proc.wait(grace))
    except subprocess.TimeoutExpired:
        run.failures.append(f"{victim.name} did not exit within {grace}s of SIGTERM")
        victim.proc.kill()
        await trio.to_thread.run_sync(victim.proc.wait)
        return
    if code == -signal.SIGTERM and not run.served(victim):
        # Python was still importing claimkit: no handler yet, nothing claimed yet. From
        # serve's first line on, a SIGTERM is a graceful stop (exit 0), checked below.
        log(f"{victim.name} was still starting; SIGTERM ended it before it served")
    elif code != 0:
        run.failures.append(f"{victim.name} exited {code} after SIGTERM:\n{run.tail(victim)}")
    await trio.sleep(fault.length)
    if len(run.live()) < run.opts.consumers:
        c = run.start_consumer()
        run.faults["start"] += 1
        log(f"started {c.name} (replacement)")


async def fault_start(run: Run) -> bool:
    if len(run.live()) >= run.opts.consumers + 2:
        return False
    c = run.start_consumer()
    log(f"started {c.name}")
    return True


async def faults(run: Run, store: Store, schedule: list[Fault]) -> None:
    for fault in schedule:
        await trio.sleep(fault.gap)
        if fault.kind == "kill":
            await fault_kill(run, store, fault)
        elif fault.kind == "stop":
            await fault_stop(run, fault)
        elif fault.kind == "clientkill":
            await fault_clientkill(run, fault)
        elif fault.kind == "redis":
            await fault_redis(run, fault)
        elif fault.kind == "term":
            await fault_term(run, fault)
        elif fault.kind == "oom":
            await fault_oom(run, fault)
        elif fault.kind == "failover":
            await fault_failover(run)
        elif fault.kind == "start" and not await fault_start(run):
            continue
        run.faults[fault.kind] += 1


# -- the run -------------------------------------------------------------------------------------


async def settle(run: Run, store: Store) -> None:
    """Wait until every accepted request has its record (or --settle runs out).

    Also stops when requests have no record but nothing is left in Redis that could give
    them one (nothing pending, claimed, waiting to retry or in the outbox) for longer than
    a lease and a request timeout: they are lost (a failover can lose writes), and waiting
    longer changes nothing."""
    deadline = trio.current_time() + run.opts.settle
    idle_since: float | None = None
    while trio.current_time() < deadline:
        await resolve_uncertain(run, store)
        loc = await patient(store, sample, run, store)
        missing = [rid for rid in run.accepted if not run.record_counts.get(rid)]
        if loc.busy:
            idle_since = None
        elif not missing:
            return
        else:
            idle_since = trio.current_time() if idle_since is None else idle_since
            if trio.current_time() - idle_since > run.opts.lease + _REQUEST_TIMEOUT + 2:
                log(
                    f"{len(missing)} accepted requests have no record, and nothing is left "
                    "in Redis that could give them one: settling stops"
                )
                return
        await trio.sleep(0.5)
    log("settle time ran out")


async def stop_consumers(run: Run) -> None:
    for c in run.consumers:
        if c.alive():
            c.expected_exit = True
            c.proc.send_signal(signal.SIGTERM)
    for c in run.consumers:
        if c.proc.poll() is None:
            try:
                await trio.to_thread.run_sync(functools.partial(c.proc.wait, 25))
            except subprocess.TimeoutExpired:
                run.failures.append(f"{c.name} did not exit within 25 s of the final SIGTERM")
                c.proc.kill()
        out = (run.workdir / f"{c.name}.out").read_text(errors="replace").strip()
        if out:
            run.summaries.append(f"{c.name}: {out.splitlines()[-1]}")


async def sim_stats(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=30) as client:
        reply = await client.get(url + "/stats")
        reply.raise_for_status()
        doc: dict[str, Any] = reply.json()
        return doc


async def main_async(opts: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    rng = random.Random(opts.seed)
    schedule = make_schedule(random.Random(f"faults-{opts.seed}"), opts)
    kinds = Counter(f.kind for f in schedule)
    log(
        f"seed {opts.seed}: {opts.requests} requests over {opts.duration:.0f}s, "
        f"{opts.consumers} consumers, {len(schedule)} faults scheduled {dict(kinds)}"
    )
    topo = Topo(opts, workdir)
    keys = ChaosKeys.for_run(opts.queue, RETRY, opts.results, cluster=opts.topology == "cluster")
    run = Run(opts=opts, workdir=workdir, topo=topo, keys=keys)
    run.full_records = opts.topology == "sentinel" or opts.fault == "failover"
    sim: subprocess.Popen[bytes] | None = None
    try:
        await trio.to_thread.run_sync(topo.start)
        log(f"topology: {topo.describe()}")
        sim = start_sim(run)
        queue_port, results_port = topo.port_for(opts.queue), topo.port_for(opts.results)
        monitors = [Monitor(queue_port, keys)]
        if results_port != queue_port:
            monitors.append(Monitor(results_port, keys))
        monitor = run.monitor = MonitorSet(monitors)
        monitor.start()
        await trio.to_thread.run_sync(monitor.wait_connected, 10)
        began = time.monotonic()
        async with topo.open_store() as store:
            for _ in range(opts.consumers):
                run.start_consumer()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(abort_on_signal)
                nursery.start_soon(sampler, run, store)
                nursery.start_soon(watchdog, run)
                async with trio.open_nursery() as work:
                    work.start_soon(submitter, run, store, rng)
                    work.start_soon(faults, run, store, schedule)
                log("workload and faults done; settling")
                await settle(run, store)
                await stop_consumers(run)
                nursery.cancel_scope.cancel()
            await resolve_uncertain(run, store)
            run.full_records = True  # the final count: the whole list, as it is now
            final = await patient(store, sample, run, store)
            stats = await sim_stats(run.sim_url)
    finally:
        for c in run.consumers:
            if c.alive():
                c.proc.kill()
                c.proc.wait()
        if sim is not None:
            sim.kill()
            sim.wait()
        if run.monitor is not None:
            run.monitor.stop()
        await trio.to_thread.run_sync(topo.close)
    return figures(run, final, stats, time.monotonic() - began)


def crossslot_lines(run: Run) -> int:
    """Lines of the consumers' logs (stdout and stderr) that mention CROSSSLOT."""
    count = 0
    for c in run.consumers:
        for suffix in (".out", ".err"):
            path = run.workdir / f"{c.name}{suffix}"
            if path.exists():
                text = path.read_text(errors="replace")
                count += sum("CROSSSLOT" in line for line in text.splitlines())
    return count


def figures(run: Run, final: Locations, stats: dict[str, Any], elapsed: float) -> dict[str, Any]:
    opts = run.opts
    assert run.monitor is not None
    mon = run.monitor
    per_id = run.record_counts
    accepted = set(run.accepted)
    # A submit whose outcome was unknown counts as accepted if its request shows up.
    found_uncertain = {rid for rid in run.uncertain if rid in per_id or rid in final.places}
    accepted |= found_uncertain
    lost = sorted(rid for rid in accepted if per_id.get(rid, 0) == 0)
    dups = {rid: n for rid, n in per_id.items() if n > 1}
    phantom = sorted(rid for rid in per_id if rid not in run.submitted)
    calls = stats.get("calls_by_id", {})
    executions = [calls.get(rid, 0) for rid in accepted]
    first_arrival = {rid: i for i, rid in enumerate(calls)}
    order_bad = order_violations(mon.claim_calls)
    pairs, inverted = gateway_inversions(mon.claim_calls, first_arrival, run.submitted)
    delays = []
    unresolved = 0
    for t_kill, rid, token in run.kill_claims:
        state, when = redelivery_of(mon.events_of(rid), token, t_kill)
        if state == "lapsed" and when is not None:
            delays.append(when - t_kill)
        elif state == "open" or state == "lapsed":
            unresolved += 1
    bound = redelivery_bound(opts)
    parks = sum(1 for evs in mon.events.values() for e in evs if e.kind == "park")
    leftovers = {rid: places for rid, places in final.places.items() if set(places) - {"dead"}}
    crossslot = crossslot_lines(run)
    # Lost without ever reaching a consumer: the submit itself did not survive (a failover
    # can lose the producer's writes, which wait_replicas does not cover).
    never_claimed = [
        rid
        for rid in lost
        if not calls.get(rid) and not any(e.kind == "claim" for e in mon.events_of(rid))
    ]
    checks = {
        "workload": bool(accepted),  # a run that accepted nothing proves nothing
        "lost": not lost,
        "duplicates": not dups,
        "phantom": not phantom,
        "locations": run.location_violation_count == 0 and not run.structure_problems,
        "order": not order_bad,
        "redelivery": all(d <= bound for d in delays) and unresolved == 0,
        "consumers": not run.crashed and not run.failures,
        "drained": not leftovers and not final.claims and not final.outbox_count,
        "crossslot": crossslot == 0,
    }
    out: dict[str, Any] = {
        "seed": opts.seed,
        "topology": opts.topology,
        "queue": opts.queue,
        "result_list": opts.results,
        "one_slot": run.keys.one_slot,
        "fault": opts.fault,
        "wait_replicas": opts.wait_replicas,
        "wait_timeout_ms": opts.wait_timeout_ms,
        "lag_ms": opts.lag_ms,
        "requests": opts.requests,
        "accepted": len(accepted),
        "uncertain_not_accepted": len(run.uncertain - found_uncertain),
        "records": len(run.log.records),
        "lost": len(lost),
        "lost_never_claimed": len(never_claimed),
        "duplicates": sum(n - 1 for n in dups.values()),
        "phantom": len(phantom),
        "snapshots": run.snapshots,
        "location_violations": run.location_violation_count,
        "structure_problems": len(run.structure_problems),
        "poll_batches": len(mon.claim_calls),
        "order_violations": len(order_bad),
        "gateway_pairs": pairs,
        "gateway_inversions": inverted,
        "executions": sum(executions),
        "executions_max": max(executions, default=0),
        "executions_mean": round(sum(executions) / max(len(executions), 1), 3),
        "retry_parks": parks,
        "redundant_executions": max(0, sum(executions) - parks - len(accepted)),
        "kill_claims_redelivered": len(delays),
        "kill_claims_unresolved": unresolved,
        "worst_redelivery_s": round(max(delays, default=0.0), 3),
        "redelivery_bound_s": round(bound, 3),
        "stale_acks": mon.stale_acks,
        "stale_acks_pushed": mon.stale_pushes,
        "faults": sum(run.faults.values()),
        "faults_by_kind": dict(run.faults),
        "cancelled": run.cancelled,
        "monitor_gaps": mon.gaps,
        "monitor_unparsed_calls": mon.unparsed,
        "crossslot": crossslot,
        "no_progress_max_s": round(run.log.longest_stall(), 2),
        "no_progress_resolution_s": opts.sample_interval,
        "records_vanished": run.log.vanished,
        "failovers": len(run.topo.failover_seconds),
        "failover_s": [round(t, 2) for t in run.topo.failover_seconds],
        "rejoin_s": [round(t, 2) for t in run.topo.rejoin_seconds],
        "replicas": opts.replicas if opts.topology != "standalone" else 0,
        "elapsed_s": round(elapsed, 1),
        "checks": checks,
        "passed": all(checks.values()),
        "details": {
            "lost": lost[:50],
            "duplicates": dict(list(dups.items())[:50]),
            "phantom": phantom[:50],
            "location_violations": run.location_violations,
            "structure_problems": run.structure_problems[:50],
            "order_violations": order_bad[:20],
            "crashed": run.crashed,
            "failures": run.failures,
            "leftovers": {k: v for k, v in list(leftovers.items())[:50]},
            "unresolved_kill_claims": {
                rid: [f"{e.time:.3f} {e.kind} {e.token[:8]} {e.detail}" for e in mon.events_of(rid)]
                + [f"killed at {t_kill:.3f} holding {token[:8]}"]
                for t_kill, rid, token in run.kill_claims
                if redelivery_of(mon.events_of(rid), token, t_kill)[1] is None
                and redelivery_of(mon.events_of(rid), token, t_kill)[0] in ("open", "lapsed")
            },
            "stale_pushes": {
                rid: [f"{e.time:.3f} {e.kind} {e.token[:8]} {e.detail}" for e in mon.events_of(rid)]
                for rid in mon.stale_push_ids[:20]
            },
            "summaries": run.summaries,
        },
    }
    return out


def line(f: dict[str, Any]) -> str:
    kinds = " ".join(f"{k}={v}" for k, v in sorted(f["faults_by_kind"].items()))
    failed = [k for k, ok in f["checks"].items() if not ok]
    where = f["topology"] + ("" if f["one_slot"] or f["topology"] != "cluster" else " cross-slot")
    if f["topology"] == "cluster" and f["one_slot"]:
        where += " one-slot"
    if f["topology"] != "standalone":
        where += f" replicas={f['replicas']}"
    if f["wait_replicas"] is not None:
        where += f" wait_replicas={f['wait_replicas']}"
    if f.get("lag_ms"):
        where += f" lag_ms={f['lag_ms']}"
    failover = ""
    if f["failovers"]:
        failover = (
            f"failovers={f['failovers']} ({','.join(f'{t}s' for t in f['failover_s'])}) "
            + (f"rejoined ({','.join(f'{t}s' for t in f['rejoin_s'])}) " if f["rejoin_s"] else "")
            + f"records_vanished={f['records_vanished']} "
            f"lost_never_claimed={f['lost_never_claimed']} "
        )
    return (
        f"chaos seed={f['seed']} {where}: requests={f['requests']} accepted={f['accepted']} "
        f"records={f['records']} "
        f"lost={f['lost']} duplicates={f['duplicates']} phantom={f['phantom']} "
        f"location_violations={f['location_violations']}/{f['snapshots']}snapshots "
        f"order_violations={f['order_violations']}/{f['poll_batches']}batches "
        f"executions={f['executions']} "
        f"executions/request max={f['executions_max']} mean={f['executions_mean']} "
        f"no_progress_max={f['no_progress_max_s']}s crossslot={f['crossslot']} {failover}"
        f"worst_redelivery={f['worst_redelivery_s']}s bound={f['redelivery_bound_s']}s "
        f"(n={f['kill_claims_redelivered']}) faults={f['faults']} ({kinds}) "
        f"elapsed={f['elapsed_s']}s " + ("PASS" if f["passed"] else "FAIL " + ",".join(failed))
    )


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    try:
        find_server_binary()  # before the work dir exists: nothing to keep when there is none
    except RuntimeError as exc:
        log(str(exc))
        return 2
    if opts.topology != "standalone":
        why = topology_support_problem()
        if why is not None:
            log(f"--topology {opts.topology} needs claimkit's cluster/sentinel support: {why}")
            return 2
    workdir = Path(tempfile.mkdtemp(prefix="claimkit-chaos-"))
    try:
        f = trio.run(main_async, opts, workdir)
    except BaseException as exc:
        log(f"aborted ({exc!r}); work dir kept: {workdir}")
        return 2
    if opts.json:
        opts.json.write_text(json.dumps(f, indent=2, ensure_ascii=False) + "\n")
    if not f["passed"]:
        for name, items in f["details"].items():
            if items and name != "summaries":
                log(f"{name}: {json.dumps(items, ensure_ascii=False, indent=1)[:4000]}")
    print(line(f), flush=True)
    if opts.keep or not f["passed"]:
        log(f"work dir kept: {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if f["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
