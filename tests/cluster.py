"""Test support: a real Redis Cluster of private ``redis-server`` processes.

:class:`RedisCluster` starts ``masters`` servers with ``--cluster-enabled yes``, each on a
free port in a temporary directory of its own (:class:`claimkit.dev.redis_server.RedisServer`),
joins them with ``redis-cli --cluster create ... --cluster-yes`` (no replicas), waits until
every node says ``cluster_state:ok``, and stops every process by PID on :meth:`close`.
The machine's shared Redis is never touched.

``redis_cluster`` is a module-scoped pytest fixture on it; import it into a test module
(``from cluster import redis_cluster``) to use it. Tests that need no redis-cli (or no
system ``redis-server``) are skipped, not failed.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import socket
import subprocess
import time
from typing import TYPE_CHECKING, Any

import pytest

from claimkit.dev.redis_server import RedisServer, RedisServerError, find_server_binary
from claimkit.dev.resp_client import call as _call

if TYPE_CHECKING:
    from collections.abc import Iterator

HOST = "127.0.0.1"
BUS_OFFSET = 10000  # a node's cluster bus listens on its port + 10000
_READY_TIMEOUT = 30.0


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def _pick_node_port(taken: set[int]) -> int:
    """A free port whose bus port (port + 10000) is free too (below the ephemeral range,
    so the pair fits under 65536)."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(20000, 55000)
        if port not in taken and _free(port) and _free(port + BUS_OFFSET):
            return port
    raise RuntimeError("no free port pair for a cluster node")


def cli_binary() -> str | None:
    """``redis-cli`` (or ``valkey-cli``) on PATH, or ``None``."""
    return shutil.which("redis-cli") or shutil.which("valkey-cli")


class RedisCluster:
    """A Redis Cluster of ``masters`` private nodes (no replicas), for one test module.

    Attributes:
        nodes: the node servers, in the order their slots were assigned (node 0 holds
            slots 0-5460 of a 3-master cluster).
    """

    def __init__(self, masters: int = 3) -> None:
        if masters < 3:
            raise ValueError("redis-cli --cluster create needs at least 3 masters")
        self.masters = masters
        self.nodes: list[RedisServer] = []

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    @property
    def url(self) -> str:
        """The first node's URL (``redis://127.0.0.1:PORT/0``)."""
        return self.nodes[0].url

    def call(self, node: int, *command: str) -> Any:
        """One command on one node (RESP2 reply; an error reply is returned as an
        exception object, not raised)."""
        return _call(self.nodes[node].port, [list(command)], 10.0)[0]

    def start(self) -> None:
        cli = cli_binary()
        if cli is None:
            raise RuntimeError("redis-cli is not on PATH")
        taken: set[int] = set()
        try:
            for _ in range(self.masters):
                self.nodes.append(self._start_node(taken))
            subprocess.run(
                [
                    cli,
                    "--cluster",
                    "create",
                    *(f"{HOST}:{node.port}" for node in self.nodes),
                    "--cluster-replicas",
                    "0",
                    "--cluster-yes",
                ],
                check=True,
                capture_output=True,
                timeout=60,
            )
            self._wait_ok()
        except BaseException:
            self.close()
            raise

    def _start_node(self, taken: set[int]) -> RedisServer:
        for attempt in range(5):
            port = _pick_node_port(taken)
            node = RedisServer(
                port=port,
                extra_args=[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "5000",
                ],
            )
            try:
                node.start()
            except RedisServerError:
                node.close()
                if attempt == 4:
                    raise
                continue
            taken.add(port)
            return node
        raise AssertionError("unreachable")

    def _wait_ok(self) -> None:
        deadline = time.monotonic() + _READY_TIMEOUT
        while True:
            states = [self.call(i, "CLUSTER", "INFO") for i in range(len(self.nodes))]
            if all(isinstance(s, bytes) and b"cluster_state:ok" in s for s in states):
                return
            if time.monotonic() >= deadline:
                raise RuntimeError(f"the cluster did not become ok: {states!r}")
            time.sleep(0.05)

    def dbsizes(self) -> list[int]:
        """``DBSIZE`` of every node."""
        return [int(self.call(i, "DBSIZE")) for i in range(len(self.nodes))]

    def close(self) -> None:
        """Stop every node by PID and remove its directory (idempotent)."""
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.close()
        self.nodes = []

    def __enter__(self) -> RedisCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def cluster_available() -> str | None:
    """Why a cluster cannot be started here, or ``None`` when it can."""
    if cli_binary() is None:
        return "redis-cli is not on PATH"
    try:
        find_server_binary()
    except Exception as exc:  # no binary at all
        return str(exc)
    return None


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[RedisCluster]:
    """A 3-master Redis Cluster for the test module; stopped by PID at its end."""
    why = cluster_available()
    if why is not None:
        pytest.skip(f"no Redis Cluster here: {why}")
    with RedisCluster(3) as cluster:
        yield cluster
