"""Topology mistakes of a new user, each refused in one line before anything is written
(docs/topology.md#configuration; exit status 1 as docs/cli.md#exit-status says)."""

from __future__ import annotations

import pytest
from support import config_json, do, invoke, one_line_error

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
