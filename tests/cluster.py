"""Test support: a real Redis Cluster of private server processes, with replicas.

``redis_cluster`` is a module-scoped pytest fixture: 3 primaries and one replica each
(:class:`claimkit.dev.cluster.RedisClusterProcesses`), every node on a free port in a
temporary directory of its own, joined with plain ``CLUSTER`` commands (no ``redis-cli``),
stopped by PID at the end of the module. Import it into a test module (``from cluster
import redis_cluster``) to use it. What tests use of it:

- ``urls``: the primaries' URLs, in slot order (``urls[0]`` serves slots 0-5460);
- ``nodes``: every server, the primaries first in slot order, then the replicas
  (``nodes[3 + i]`` replicates ``nodes[i]``);
- ``call(i, *command)``: one command on ``nodes[i]``, an error reply returned, not raised;
- ``masters``, ``replicas``, ``primary_for_slot``, ``kill_primary``, ``wait_failover``,
  ``dbsizes()`` (the primaries').

The tests that use it are skipped, not failed, only where no server binary is found or the
binary has no cluster support. The machine's shared Redis is never touched.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import pytest

from claimkit.dev.cluster import RedisClusterProcesses, cluster_support_problem
from claimkit.dev.redis_server import find_server_binary

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["RedisCluster", "cluster_available", "redis_cluster"]

RedisCluster = RedisClusterProcesses
"""The fixture's type (the name the test modules annotate with)."""


@functools.cache
def cluster_available() -> str | None:
    """Why a cluster cannot be started here, or ``None`` when it can: no server binary,
    or one that refuses ``--cluster-enabled yes`` (checked once, by starting it)."""
    try:
        return cluster_support_problem(find_server_binary())
    except RuntimeError as exc:
        return str(exc)


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[RedisClusterProcesses]:
    """3 primaries with one replica each, for the test module; stopped by PID at its end."""
    why = cluster_available()
    if why is not None:
        pytest.skip(f"no Redis Cluster here: {why}")
    with RedisClusterProcesses(masters=3, replicas=1) as cluster:
        yield cluster
