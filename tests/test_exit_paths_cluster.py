"""tests/test_exit_paths.py again, on a real Redis Cluster (docs/topology.md#cluster-key-layout).

Every test there that takes ``store`` runs here too, with ``store`` a cluster store
(``mode == "cluster"``): QueueOps then uses the cluster layout and scripts that touch one
slot each, under the shebang, so a node refuses any undeclared or cross-slot key (the test
fails with ``CROSSSLOT`` or "Script attempted to access ..." if one is left). The test ids
of the standalone runs stay as they are; these are ``test_exit_paths_cluster.py::<same name>``.
Skipped when no cluster can be started here (tests/cluster.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import test_exit_paths
from cluster import redis_cluster
from cluster_store import cluster_store
from support import store_tests

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from cluster import RedisCluster

    from claimkit.store import Store

__all__ = ["redis_cluster"]

globals().update(store_tests(test_exit_paths))


@pytest.fixture
async def store(redis_cluster: RedisCluster) -> AsyncIterator[Store]:
    """A cluster store on an empty cluster keyspace."""
    async with cluster_store(redis_cluster) as opened:
        await opened.command("FLUSHALL")
        yield opened
