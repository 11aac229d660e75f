"""Topology mistakes of a new user, each refused in one line before anything is written
(docs/topology.md#configuration; exit status 1 as docs/cli.md#exit-status says)."""

from __future__ import annotations

import pytest
from support import closed_port, config_json, do, invoke, one_line_error

Q = "requests"
SUBMIT = ["submit", "-q", Q, '{"id":"r1","deadline":4102444800}']


@pytest.mark.parametrize(
    ("addr", "line"),
    [
        ("redis://127.0.0.1:7000", 'must be "host:port" without a scheme'),
        (
            "127.0.0.1:7000:1",
            'must be "host:port" with one ":" (an IPv6 host in brackets: "[::1]:7000")',
        ),
        (" 127.0.0.1:7000", 'must be "host:port" without spaces'),
        ("127.0.0.1:99999", "has port 99999, out of range 1-65535"),
    ],
)
def test_a_bad_addrs_entry_is_refused_by_name(redis_url: str, addr: str, line: str) -> None:
    config = config_json(redis_url, queue=Q, mode="cluster", addrs=[addr])
    result = invoke([*SUBMIT, "--transport-config", config])
    one_line_error(result, f'addrs entry "{addr}" {line}')
    assert do(redis_url, ("DBSIZE",)) == [0]


@pytest.mark.parametrize("database", ["/3", "/0?db=3"])
def test_a_cluster_url_selecting_a_database_is_refused_before_connecting(
    redis_url: str, database: str
) -> None:
    """``?db=`` wins over the path in coredis and redis-py: ``/0?db=3`` selects database 3,
    which a cluster node would refuse only after connecting (``SELECT is not allowed``)."""
    url = redis_url.removesuffix("/0") + database
    config = config_json(url, queue=Q, mode="cluster")
    result = invoke([*SUBMIT, "--transport-config", config])
    one_line_error(
        result, 'mode "cluster" does not support selecting database 3; use database 0 in url'
    )
    assert do(redis_url, ("DBSIZE",)) == [0]


@pytest.mark.parametrize(
    "doc", [{"mode": "cluster"}, {"mode": "sentinel", "master_name": "mymaster"}]
)
def test_cluster_and_sentinel_need_a_tcp_url(doc: dict[str, str]) -> None:
    """A cluster's nodes and the sentinels are TCP addresses: a unix:// url is refused
    before anything connects (it was read as 127.0.0.1:6379, whatever answered there)."""
    config = config_json("unix:///nonexistent/x.sock", queue=Q, **doc)
    result = invoke([*SUBMIT, "--transport-config", config])
    one_line_error(
        result, f'mode "{doc["mode"]}" needs a TCP url (redis:// or rediss://), not unix://'
    )


def test_an_unreachable_cluster_seed_is_unavailable() -> None:
    url = f"redis://127.0.0.1:{closed_port()}/0"
    config = config_json(url, queue=Q, mode="cluster")
    result = invoke(["inspect", "-q", Q, "--transport-config", config])
    one_line_error(
        result,
        f"Redis at {url} is unavailable: Redis Cluster at {url} cannot be reached: no seed "
        f"node answered (Unable to establish a connection to {url[8:-2]})",
    )
