"""Every command refuses a Redis Cluster in one line and writes nothing when the config
does not say ``"mode": "cluster"`` (issue 8, defect 14; docs/topology.md#configuration).

A cluster node is detected before the first command (``INFO``: ``cluster_enabled:1``) or
from a cluster reply (``MOVED`` and kin), against a real cluster (:mod:`cluster`).
"""

from __future__ import annotations

import pytest
import trio
from cluster import RedisCluster, redis_cluster
from support import config_json, do, invoke, one_line_error
from typer.testing import CliRunner

from claimkit.cli.app import app
from claimkit.store import StoreError, open_store
from claimkit.store.coredis_store import open_coredis_store
from claimkit.store.server_checks import ClusterUnsupported

__all__ = ["redis_cluster"]  # the fixture, imported for pytest

Q = "requests"


def refusal(url: str, how: str = "INFO says cluster_enabled:1") -> str:
    return (
        f'claimkit: Redis at {url} is a Redis Cluster node ({how}): set "mode": "cluster" '
        "in the transport config to use it (docs/topology.md#configuration)\n"
    )


COMMANDS = {
    "serve": ["serve", "--metrics-port", "0", "--health-port", "0"],
    "submit": ["submit", "-q", Q, '{"id":"r1","deadline":4102444800}'],
    "inspect": ["inspect", "-q", Q],
    "inspect --json": ["inspect", "-q", Q, "--json"],
    "drain": ["drain", "-q", Q, "--release-all"],
    "reclaim": ["reclaim", "--once"],
    "dead list": ["dead", "list", "-q", Q],
    "dead requeue": ["dead", "requeue", "-q", Q, "r1"],
    "dead purge": ["dead", "purge", "-q", Q, "r1"],
    "cancel": ["cancel", "r1"],
    "results": ["results"],
    "results --follow": ["results", "--follow"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_refuses_a_cluster_in_one_line_and_writes_nothing(
    redis_cluster: RedisCluster, name: str
) -> None:
    url = redis_cluster.url
    result = CliRunner().invoke(
        app,
        [
            *COMMANDS[name],
            "--transport-config",
            config_json(url, queue=Q, metrics_port=0, health_port=0),
        ],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 1, result.output
    assert result.stderr == refusal(url)
    assert result.stdout == ""
    assert redis_cluster.dbsizes() == [0, 0, 0]


async def test_a_moved_reply_is_readable_and_refused(redis_cluster: RedisCluster) -> None:
    """A user whose ACL refuses INFO: the cluster is then told by its MOVED reply, which
    keeps its word (coredis strips it: "838 127.0.0.1:32360")."""
    moved = redis_cluster.call(0, "GET", "foo")
    assert str(moved).startswith("MOVED 12182 ")
    for i in range(3):
        rule = ["on", ">pw", "~*", "+@all", "-info"]
        assert redis_cluster.call(i, "ACL", "SETUSER", "noinfo", *rule) == b"OK"
    base = redis_cluster.url
    url = base.replace("redis://", "redis://noinfo:pw@")
    shown = base.replace("redis://", "redis://noinfo:***@")
    with trio.fail_after(20):
        async with open_coredis_store(url, timeout=5) as raw:
            with pytest.raises(StoreError) as info:
                await raw.command("GET", "foo")
            assert str(info.value) == str(moved)
        async with open_store(url) as store:
            with pytest.raises(ClusterUnsupported) as refused:
                await store.command("SET", "foo", "x")
            assert str(refused.value) + "\n" == refusal(shown, f"it answered {moved}").removeprefix(
                "claimkit: "
            )
            # Refused for good: even a key of this node's slots is not written.
            with pytest.raises(ClusterUnsupported):
                await store.command("SET", "{a}", "x")
    assert redis_cluster.dbsizes() == [0, 0, 0]


async def test_a_standalone_redis_is_not_refused(store: object) -> None:
    from claimkit.store.server_checks import StandaloneOnly

    assert isinstance(store, StandaloneOnly)
    with trio.fail_after(10):
        assert await store.command("SET", "k", "v") == b"OK"
        assert store.info is not None
        assert store.info["cluster_enabled"] == "0"


@pytest.mark.redispy
async def test_the_redispy_store_refuses_a_cluster_too(redis_cluster: RedisCluster) -> None:
    moved = redis_cluster.call(0, "GET", "foo")
    url = redis_cluster.url.replace("redis://", "redis://noinfo:pw@")
    shown = redis_cluster.url.replace("redis://", "redis://noinfo:***@")
    with trio.fail_after(20):
        async with open_store(redis_cluster.url, backend="redispy") as store:
            with pytest.raises(ClusterUnsupported) as info:
                await store.command("PING")
            assert str(info.value) + "\n" == refusal(redis_cluster.url).removeprefix("claimkit: ")
        for i in range(3):
            rule = ["on", ">pw", "~*", "+@all", "-info"]
            assert redis_cluster.call(i, "ACL", "SETUSER", "noinfo", *rule) == b"OK"
        async with open_store(url, backend="redispy") as store:
            with pytest.raises(ClusterUnsupported) as info:
                await store.command("SET", "foo", "x")
            expected = refusal(shown, f"it answered {moved}").removeprefix("claimkit: ")
            assert str(info.value) + "\n" == expected
    assert redis_cluster.dbsizes() == [0, 0, 0]


def test_inspect_in_cluster_mode_refuses_a_standalone_server_in_one_line(redis_url: str) -> None:
    config = config_json(redis_url, queue=Q, mode="cluster")
    result = invoke(["inspect", "-q", Q, "--transport-config", config])
    one_line_error(
        result,
        f"Redis at {redis_url} is not a Redis Cluster node (it answered This instance has "
        'cluster support disabled): set "mode": "standalone" in the transport config, or '
        "point url at a cluster node (docs/topology.md#configuration)",
    )
    assert do(redis_url, ("DBSIZE",)) == [0]


def test_inspect_in_standalone_mode_refuses_a_cluster_node_in_one_line(
    redis_cluster: RedisCluster,
) -> None:
    url = redis_cluster.url
    config = config_json(url, queue=Q, mode="standalone")
    result = invoke(["inspect", "-q", Q, "--transport-config", config])
    one_line_error(result, refusal(url).removeprefix("claimkit: ").rstrip("\n"))
    assert sum(redis_cluster.dbsizes()) == 0


@pytest.mark.parametrize(
    ("version", "old"),
    [
        ("6.2.14", True),
        ("6.0.0", True),
        ("7.0.15", False),
        ("7.2.4", False),
        ("8.1.8", False),
        ("", False),
        ("x.y", False),
    ],
)
def test_a_server_older_than_redis_7_is_too_old(version: str, old: bool) -> None:
    from claimkit.store.server_checks import ServerTooOld, too_old

    assert too_old(version) is old
    assert str(ServerTooOld.for_url("redis://h:1/0", "6.2.14")) == (
        "Redis at redis://h:1/0 is version 6.2.14: claimkit needs Redis 7.0 or later, or "
        "Valkey 7.2 or later (docs/compatibility.md#sharing-queues)"
    )
