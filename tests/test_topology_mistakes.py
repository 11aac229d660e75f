"""Topology mistakes of a new user, each refused in one line before anything is written
(docs/topology.md#configuration; exit status 1 as docs/cli.md#exit-status says)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from sentinel import sentinel_group
from support import closed_port, config_json, do, invoke, one_line_error

if TYPE_CHECKING:
    from claimkit.dev.sentinel import SentinelGroup

__all__ = ["sentinel_group"]  # the fixture, imported for pytest

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


def test_sentinel_mode_at_a_data_server_says_it_is_not_a_sentinel(
    sentinel_group: SentinelGroup,
) -> None:
    url = sentinel_group.primary.url
    config = config_json(url, queue=Q, mode="sentinel", master_name="claimkit")
    result = invoke([*SUBMIT, "--transport-config", config])
    one_line_error(
        result,
        f"Redis at {url} is not a Sentinel (it answered unknown command 'SENTINEL', with "
        "args beginning with: 'GET-MASTER-ADDR-BY-NAME' 'claimkit'): point url and addrs at "
        "the sentinels (docs/topology.md#configuration)",
    )
    assert do(url, ("DBSIZE",)) == [0]


def test_a_wrong_master_name_is_not_an_unreachable_sentinel(
    sentinel_group: SentinelGroup,
) -> None:
    url, addrs = sentinel_group.sentinel_url, sentinel_group.sentinel_addrs
    config = config_json(url, queue=Q, mode="sentinel", master_name="nope", addrs=addrs)
    result = invoke([*SUBMIT, "--transport-config", config])
    one_line_error(
        result,
        f"Redis at {url} is unavailable: the sentinels at {', '.join(addrs)} know no "
        "primary named 'nope'",
    )
    assert do(sentinel_group.primary.url, ("DBSIZE",)) == [0]
    down = [f"127.0.0.1:{closed_port()}", f"127.0.0.1:{closed_port()}"]
    url = f"redis://{down[0]}/0"
    config = config_json(url, queue=Q, mode="sentinel", master_name="claimkit", addrs=down)
    result = invoke([*SUBMIT, "--transport-config", config])
    one_line_error(
        result, f"Redis at {url} is unavailable: no sentinel answered at {', '.join(down)}"
    )


@pytest.mark.parametrize("mode", ["standalone", "cluster"])
def test_a_sentinel_is_not_a_data_server(sentinel_group: SentinelGroup, mode: str) -> None:
    url = sentinel_group.sentinel_url
    serve = ["serve", "--metrics-port", "0", "--health-port", "0"]
    for command in (SUBMIT, ["inspect", "-q", Q], serve):
        result = invoke([*command, "--transport-config", config_json(url, queue=Q, mode=mode)])
        one_line_error(
            result,
            f'Redis at {url} is a Sentinel: set "mode": "sentinel" and "master_name" '
            "(docs/topology.md#configuration)",
        )
    assert do(sentinel_group.primary.url, ("DBSIZE",)) == [0]
