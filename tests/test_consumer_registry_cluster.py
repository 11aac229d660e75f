"""tests/test_consumer_registry.py again, on a real Redis Cluster
(docs/topology.md#cluster-key-layout): the registry keys are ``{q}:consumers`` and
``{q}:consumer-info``, in the queue's slot, and every registry script runs under the
shebang, so a node refuses any key of another slot. Skipped when no cluster can be started
here (tests/cluster.py)."""

from __future__ import annotations

import test_consumer_registry
from cluster import redis_cluster
from cluster_store import flushed_store
from support import store_tests

__all__ = ["flushed_store", "redis_cluster"]

globals().update(store_tests(test_consumer_registry))
