"""The sentinel store (``mode: sentinel``) across a real failover: a primary, its replica
and three sentinels, the primary SIGKILLed (docs/topology.md#sentinel).

The group is a private fixture of this module (:class:`_Group`) until
``claimkit.dev.sentinel.SentinelGroup`` lands: every process on a free port in a temporary
directory, stopped by PID.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import trio
from support import free_port, wait_for, wait_until

from claimkit.config import ConfigError, load_config
from claimkit.consumer.consumer import Consumer, QueueRuntime
from claimkit.consumer.dispatch import Done, Outcome
from claimkit.consumer.serve import _AfterFailovers
from claimkit.dev.redis_server import RedisServer, find_server_binary
from claimkit.dev.resp_client import call
from claimkit.producer import Producer
from claimkit.protocol.models import Envelope, TerminalRecord
from claimkit.store import StoreUnavailable, open_store
from claimkit.store.topology import Topology

if TYPE_CHECKING:
    from collections.abc import Iterator

    from claimkit.store import Store

MASTER = "m"
_SYNC_AT_ONCE = ["--repl-diskless-sync-delay", "0"]
Q = "requests"


def ask(port: int, *command: str) -> Any:
    """One command on 127.0.0.1:``port``; its RESP2 reply."""
    return call(port, [list(command)], 5.0)[0]


class _Group:
    """A primary, one replica (``--replicaof``) and three sentinels (quorum 2)."""

    def __init__(self) -> None:
        # Diskless sync at once (by default a primary waits 5 s for more replicas); the
        # replica gets the same, for when it is promoted.
        self.primary = RedisServer(aof="off", extra_args=_SYNC_AT_ONCE)
        self.replica: RedisServer | None = None
        self.sentinels: list[tuple[subprocess.Popen[bytes], int, Path]] = []

    def start(self) -> None:
        self.primary.start()
        self.replica = RedisServer(
            aof="off",
            extra_args=[*_SYNC_AT_ONCE, "--replicaof", "127.0.0.1", str(self.primary.port)],
        )
        self.replica.start()
        wait_until("the replica in sync", lambda: self._link_up(self.replica))
        for _ in range(3):
            self.sentinels.append(self._sentinel())
        wait_until("the sentinels know the replica and each other", self._sentinels_ready)

    def _link_up(self, server: RedisServer | None) -> bool:
        assert server is not None
        info = call(server.port, [["INFO", "replication"]], 5.0)[0]
        return isinstance(info, bytes) and b"master_link_status:up" in info

    def _sentinel(self) -> tuple[subprocess.Popen[bytes], int, Path]:
        directory = Path(tempfile.mkdtemp(prefix="claimkit-sentinel-"))
        port = free_port()
        conf = directory / "sentinel.conf"
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {directory}\n"
            f"sentinel monitor {MASTER} 127.0.0.1 {self.primary.port} 2\n"
            f"sentinel down-after-milliseconds {MASTER} 1000\n"
            f"sentinel failover-timeout {MASTER} 5000\n",
            encoding="utf-8",
        )
        log = (directory / "sentinel.log").open("ab")
        process = subprocess.Popen(
            [find_server_binary(), str(conf), "--sentinel"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=directory,
            start_new_session=True,
        )
        log.close()
        wait_until(f"sentinel on {port}", lambda: self._pong(port))
        return process, port, directory

    @staticmethod
    def _pong(port: int) -> bool:
        try:
            return call(port, [["PING"]], 1.0)[0] == b"PONG"
        except OSError:
            return False

    def _sentinels_ready(self) -> bool:
        for _, port, _ in self.sentinels:
            replicas = call(port, [["SENTINEL", "REPLICAS", MASTER]], 5.0)[0]
            others = call(port, [["SENTINEL", "SENTINELS", MASTER]], 5.0)[0]
            if not (isinstance(replicas, list) and len(replicas) == 1):
                return False
            if not (isinstance(others, list) and len(others) == 2):
                return False
        return True

    @property
    def sentinel_addrs(self) -> list[str]:
        return [f"127.0.0.1:{port}" for _, port, _ in self.sentinels]

    def url(self, path: str = "/0") -> str:
        """The store URL: the first sentinel's address, the data connection's db."""
        return f"redis://{self.sentinel_addrs[0]}{path}"

    def topology(self) -> Topology:
        return Topology("sentinel", tuple(self.sentinel_addrs[1:]), MASTER)

    def named_primary(self) -> int:
        """The port the first sentinel names as the primary."""
        _host, port = ask(self.sentinels[0][1], "SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER)
        return int(port)

    def kill_primary_and_wait_for_promotion(self) -> None:
        replica = self.replica
        assert replica is not None
        self.primary.kill()
        wait_until(
            "the replica promoted",
            lambda: (
                self.named_primary() == replica.port and ask(replica.port, "ROLE")[0] == b"master"
            ),
            timeout=30,
        )

    def close(self) -> None:
        for process, _, directory in self.sentinels:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGKILL)
            process.wait(timeout=10)
            shutil.rmtree(directory, ignore_errors=True)
        self.sentinels = []
        for server in (self.primary, self.replica):
            if server is not None:
                with contextlib.suppress(Exception):
                    server.close()


@pytest.fixture
def group() -> Iterator[_Group]:
    g = _Group()
    try:
        g.start()
        yield g
    finally:
        g.close()


def _replica(g: _Group) -> RedisServer:
    """The group's replica (the primary once promoted)."""
    assert g.replica is not None
    return g.replica


async def test_the_store_follows_a_failover_and_says_so_in_one_line(
    group: _Group, caplog: pytest.LogCaptureFixture
) -> None:
    replica = _replica(group)
    with trio.fail_after(60):
        async with open_store(group.url(), topology=group.topology(), timeout=2) as store:
            assert store.mode == "sentinel"
            assert await store.command("SET", "k", "before") == b"OK"
            assert call(group.primary.port, [["GET", "k"]], 5.0) == [b"before"]
            wait_until(
                "k replicated", lambda: call(replica.port, [["GET", "k"]], 5.0) == [b"before"]
            )
            caplog.clear()
            await trio.to_thread.run_sync(group.kill_primary_and_wait_for_promotion)

            async def written() -> bool:
                try:
                    return bool(await store.command("SET", "k", "after") == b"OK")
                except StoreUnavailable:
                    return False

            await wait_for(written, "a write on the promoted primary")
            assert call(replica.port, [["GET", "k"]], 5.0) == [b"after"]
            assert await store.command("GET", "k") == b"after"
            assert store.topology_changes == 1  # type: ignore[attr-defined]
    changes = [r for r in caplog.records if "Redis primary for" in r.getMessage()]
    assert [(r.levelno, r.getMessage()) for r in changes] == [
        (
            logging.WARNING,
            f"claimkit: Redis primary for {MASTER} is now 127.0.0.1:{replica.port} "
            f"(was 127.0.0.1:{group.primary.port})",
        )
    ]


def _config(g: _Group, **fields: Any) -> Any:
    doc = {
        "url": g.url(),
        "mode": "sentinel",
        "addrs": g.sentinel_addrs[1:],
        "master_name": MASTER,
        "poll_interval_ms": 20,
        "claim_lease_ttl_seconds": 3,
        "claim_reclaim_interval_ms": 100,
        "metrics_port": 0,
        "health_port": 0,
        "drain_timeout_seconds": 2,
        "queues": [{"queue_name": Q, "igw_base_url": "http://127.0.0.1:9"}],
        **fields,
    }
    return load_config(inline=json.dumps(doc))


async def _lease_expiry(store: Store, rid: str) -> float | None:
    score = await store.command("ZSCORE", f"{Q}:claims-idx", rid)
    return None if score is None else float(score)


async def test_a_held_claim_keeps_renewing_across_a_failover(group: _Group) -> None:
    """The heartbeat retries through the failover: the claim, replicated before the kill,
    is renewed on the promoted primary, and its one record is pushed there."""
    replica = _replica(group)
    started = trio.Event()
    release = trio.Event()

    async def handler(q: QueueRuntime, env: Envelope, now: float) -> Outcome:
        started.set()
        await release.wait()
        return Done(TerminalRecord.http(env.id, 200, "{}"))

    config = _config(group)
    with trio.fail_after(90):
        async with open_store(config.url, topology=config.topology, timeout=2) as store:
            await Producer(store, Q).submit({"id": "r1", "deadline": int(time.time()) + 600})
            consumer = Consumer(config, store, handler=handler)
            async with trio.open_nursery() as nursery:
                await nursery.start(consumer.run)
                await started.wait()
                await trio.to_thread.run_sync(
                    lambda: wait_until(
                        "the claim replicated",
                        lambda: call(replica.port, [["HLEN", f"{Q}:claim-owners"]], 5.0) == [1],
                    )
                )
                await trio.to_thread.run_sync(group.kill_primary_and_wait_for_promotion)
                promoted = float(ask(replica.port, "TIME")[0])

                async def renewed_on_the_new_primary() -> bool:
                    try:
                        expiry = await _lease_expiry(store, "r1")
                    except StoreUnavailable:
                        return False
                    # A lease of 3 s renewed after the promotion ends after it + 2 s.
                    return expiry is not None and expiry > promoted + 2

                await wait_for(renewed_on_the_new_primary, "a renewal on the promoted primary")
                release.set()

                async def acked() -> bool:
                    try:
                        return bool(await store.command("LLEN", "result-list") == 1)
                    except StoreUnavailable:
                        return False

                await wait_for(acked, "the record on the promoted primary")
                consumer.request_stop()
            raw = ask(replica.port, "LRANGE", "result-list", "0", "-1")
            assert [json.loads(r)["id"] for r in raw] == ["r1"]
            assert call(replica.port, [["HLEN", f"{Q}:claim-owners"]], 5.0) == [0]
            assert call(replica.port, [["ZCARD", Q]], 5.0) == [0]
            assert consumer.summary.taken_over == 0


async def test_the_preflight_runs_again_on_the_promoted_primary(
    group: _Group, caplog: pytest.LogCaptureFixture
) -> None:
    """The replica evicts any key (allkeys-lru): the start checks passed on the old
    primary, and once the replica is promoted they run again there and stop the consumer
    with the same one-line refusal serve gives at start."""
    replica = _replica(group)
    assert call(replica.port, [["CONFIG", "SET", "maxmemory-policy", "allkeys-lru"]], 5.0) == [
        b"OK"
    ]
    config = _config(group)
    with trio.fail_after(90):
        async with open_store(config.url, topology=config.topology, timeout=2) as store:
            followed = _AfterFailovers(store, config, allow_eviction=False)
            assert followed.applies()
            consumer = Consumer(config, store)
            async with trio.open_nursery() as nursery:
                await nursery.start(followed.run, consumer)
                await nursery.start(consumer.run)
                assert await store.command("PING") == b"PONG"
                await trio.to_thread.run_sync(group.kill_primary_and_wait_for_promotion)

                async def stopped() -> bool:
                    return followed.refusal is not None

                await wait_for(stopped, "the preflight's refusal")
    refusal = (
        f"Redis at {config.url} has maxmemory-policy allkeys-lru, which can evict queued and "
        'claimed requests: set maxmemory-policy noeviction (docs/operations.md, "Eviction"), '
        "or pass --allow-eviction to serve anyway"
    )
    assert str(followed.refusal) == refusal
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [f"claimkit: after the failover: {refusal}; stopping"]
    with pytest.raises(ConfigError):
        followed.raise_refusal()


async def test_no_sentinel_answering_is_unavailable_not_an_error_at_open() -> None:
    from support import closed_port

    url = f"redis://127.0.0.1:{closed_port()}/0"
    with trio.fail_after(20):
        async with open_store(url, topology=Topology("sentinel", master_name=MASTER)) as store:
            with pytest.raises(StoreUnavailable) as info:
                await store.command("GET", "k")
    # Not coredis's "No primary found", which a wrong master_name says too.
    assert str(info.value) == f"no sentinel answered at {url.removeprefix('redis://')[:-2]}"
