"""Configuration (SPEC §6): JSON inline or from a file, flags, REDIS_URL, one-line errors."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import pytest

from claimkit.config import Config, ConfigError, load_config
from claimkit.store.topology import Topology

if TYPE_CHECKING:
    from pathlib import Path

QUEUE = {"queue_name": "q", "igw_base_url": "http://gw:8000"}
ENV = {"REDIS_URL": "redis://env-host:6379/0"}


def load(doc: dict[str, Any], **kw: Any) -> Config:
    return load_config(inline=json.dumps(doc), environ=kw.pop("environ", ENV), **kw)


def test_defaults_follow_the_spec() -> None:
    c = load({"queues": [QUEUE]})
    assert (c.url, c.result_queue_name, c.retry_queue_name) == (
        "redis://env-host:6379/0",
        "result-list",
        "retry-sortedset",
    )
    assert (c.poll_interval_ms, c.batch_size, c.claim_lease_ttl_seconds) == (1000, 10, 300.0)
    assert (c.claim_reclaim_interval_ms, c.result_dedup_ttl_seconds, c.max_deliveries) == (
        15000,
        21600,
        10,
    )
    assert (c.concurrency, c.request_timeout_seconds, c.drain_timeout_seconds) == (64, 300.0, 10.0)
    assert (c.metrics_port, c.health_port) == (9090, 8081)
    q = c.queues[0]
    assert (q.queue_id, q.request_path_url, q.gate_type, q.result_queue_name) == (
        "q",
        "/v1/completions",
        "constant",
        None,
    )


def test_heartbeat_cadences_a_third_of_the_lease_clamped_and_a_third_of_the_ttl() -> None:
    def intervals(lease: float, liveness: float = 0) -> tuple[float, float | None]:
        doc = {"queues": [QUEUE], "claim_lease_ttl_seconds": lease}
        c = load({**doc, "consumer_liveness_ttl_seconds": liveness})
        return c.claim_renew_interval_seconds, c.liveness_renew_interval_seconds

    assert (intervals(300), intervals(60), intervals(1)) == ((30, None), (20, None), (1, None))
    # The claims cadence does not depend on the liveness TTL (SPEC 3.3).
    assert (intervals(300, 10), intervals(300, 120), intervals(6, 3)) == (
        (30, 10 / 3),
        (30, 40),
        (2, 1),
    )
    defaults = load({"queues": [QUEUE]})
    assert (defaults.claim_renew_interval_seconds, defaults.liveness_renew_interval_seconds) == (
        30,
        10 / 3,
    )


def test_the_liveness_ttl_defaults_to_10_s_and_0_turns_the_registry_off() -> None:
    assert load({"queues": [QUEUE]}).consumer_liveness_ttl_seconds == 10.0
    off = load({"queues": [QUEUE], "consumer_liveness_ttl_seconds": 0})
    assert (off.consumer_liveness_ttl_seconds, off.consumer_identity()) == (0.0, None)
    on = load({"queues": [QUEUE], "consumer_liveness_ttl_seconds": 3.5}, flags={"consumer_id": "c"})
    identity = on.consumer_identity()
    assert identity is not None
    assert (identity.id, identity.liveness_ttl) == ("c", 3.5)
    with pytest.raises(ConfigError, match="consumer_liveness_ttl_seconds must be non-negative"):
        load({"queues": [QUEUE], "consumer_liveness_ttl_seconds": -1})


@pytest.mark.parametrize("ttl", [0.001, 2.999, 86400.5, 1000000])
def test_a_liveness_ttl_outside_3_s_to_a_day_is_refused_in_one_line(ttl: float) -> None:
    with pytest.raises(ConfigError) as caught:
        load({"queues": [QUEUE], "consumer_liveness_ttl_seconds": ttl})
    assert str(caught.value) == (
        "consumer_liveness_ttl_seconds must be 0 (no consumer registry) or from 3 to 86400"
        f" seconds, got {ttl}"
    )
    # the flag takes the same path
    with pytest.raises(ConfigError, match=r"^consumer_liveness_ttl_seconds must be 0 "):
        load({"queues": [QUEUE]}, flags={"consumer_liveness_ttl_seconds": ttl})


def test_the_liveness_ttl_bounds_themselves_are_taken() -> None:
    for ttl in (3, 3.0, 86400):
        config = load({"queues": [QUEUE], "consumer_liveness_ttl_seconds": ttl})
        assert config.consumer_liveness_ttl_seconds == ttl


def test_the_consumer_id_comes_from_the_flag_the_environment_or_the_host() -> None:
    doc = json.dumps({"url": "redis://h:6379/0", "queues": [QUEUE]})

    def cid(flag: str | None, env: dict[str, str]) -> str:
        return load_config(inline=doc, flags={"consumer_id": flag}, environ=env).consumer_id

    assert cid("flag-id", {"CLAIMKIT_CONSUMER_ID": "env", "POD_NAME": "pod"}) == "flag-id"
    assert cid(None, {"CLAIMKIT_CONSUMER_ID": "env", "POD_NAME": "pod"}) == "env"
    assert cid(None, {"POD_NAME": "pod-7d9"}) == "pod-7d9"
    assert cid(None, {}).endswith(f"-{os.getpid()}")
    with pytest.raises(ConfigError, match=r"^consumer id 'a/b' must be 1 to 127 letters"):
        cid("a/b", {})


def test_json_wins_over_flags_and_flags_fill_the_rest() -> None:
    c = load(
        {"queues": [QUEUE], "claim_lease_ttl_seconds": 60},
        flags={"claim_lease_ttl_seconds": 5, "concurrency": 8, "metrics_port": None},
    )
    assert (c.claim_lease_ttl_seconds, c.concurrency, c.metrics_port) == (60.0, 8, 9090)


def test_url_precedence_json_then_flag_then_env() -> None:
    assert load(
        {"queues": [QUEUE], "url": "redis://json:1"}, flags={"url": "redis://flag:1"}
    ).url == ("redis://json:1")
    assert load({"queues": [QUEUE]}, flags={"url": "redis://flag:1"}).url == "redis://flag:1"
    assert load({"queues": [QUEUE]}).url == ENV["REDIS_URL"]


def test_zero_means_default_but_not_for_max_deliveries_and_ports() -> None:
    c = load(
        {
            "queues": [QUEUE],
            "batch_size": 0,
            "claim_lease_ttl_seconds": 0,
            "max_deliveries": 0,
            "metrics_port": 0,
            "health_port": 0,
        }
    )
    assert (c.batch_size, c.claim_lease_ttl_seconds) == (10, 300.0)
    assert (c.max_deliveries, c.metrics_port, c.health_port) == (0, 0, 0)
    # SPEC §1: a dedup TTL of 0 is a marker that never expires, not the 6 h default.
    assert load({"queues": [QUEUE], "result_dedup_ttl_seconds": 0}).result_dedup_ttl_seconds == 0


def test_unknown_fields_are_listed() -> None:
    c = load({"queues": [{**QUEUE, "gate": "x"}], "claim_lease_ttl_second": 5})
    assert c.unknown_fields == ("claim_lease_ttl_second", "queues[0].gate")
    assert c.claim_lease_ttl_seconds == 300.0
    assert load({"queues": [QUEUE]}).unknown_fields == ()


@pytest.mark.parametrize(
    ("base", "ok"),
    [
        ("http://h:99999", False),
        ("http://[::1", False),
        ("http://h:0", False),
        ("https://h", True),
        ("http://[::1]:8000/base", True),
    ],
)
def test_gateway_url_is_checked(base: str, ok: bool) -> None:
    doc = {"queues": [{"queue_name": "q", "igw_base_url": base}]}
    if ok:
        assert load(doc).queues[0].igw_base_url == base
    else:
        with pytest.raises(ConfigError, match=r"^queues\[0\]\.igw_base_url must be an http"):
            load(doc)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis://:pw@h:notaport/0", "Redis URL has a bad port: 'redis://:***@h:notaport/0'"),
        ("redis://:pw@h:99999/0", "Redis URL has a bad port: 'redis://:***@h:99999/0'"),
        ("redis://h/abc", "Redis URL database must be a number, got 'abc' in 'redis://h/abc'"),
        (
            "redis://:pw@h/0?db=x",
            "Redis URL parameter db must be a number, got 'x' in 'redis://:***@h/0?db=x'",
        ),
        (
            "redis://h/0?stream_timeout=1.5&socket_timeout=soon",
            "Redis URL parameter socket_timeout must be a number, got 'soon' in "
            "'redis://h/0?stream_timeout=1.5&socket_timeout=soon'",
        ),
    ],
)
def test_bad_redis_urls(url: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load({"queues": [QUEUE], "url": url})
    assert str(info.value) == message


def test_non_utf8_config_file(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_bytes(b"\xff\xfe{")
    with pytest.raises(ConfigError, match=r"is not UTF-8 text$"):
        load_config(path=path, environ=ENV)


def test_file_config(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"queues": [QUEUE], "batch_size": 3}))
    assert load_config(path=path, environ=ENV).batch_size == 3


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (
            {"queues": [QUEUE], "claim_lease_ttl_seconds": -1},
            "claim_lease_ttl_seconds must be non-negative",
        ),
        ({"queues": [QUEUE], "batch_size": "10"}, 'batch_size must be a number, got "10"'),
        ({"queues": [QUEUE], "batch_size": 2.5}, "batch_size must be a whole number, got 2.5"),
        (
            {"queues": [QUEUE], "metrics_port": 70000},
            "metrics_port must be a port number (0 turns the server off), got 70000",
        ),
        ({"queues": []}, "queues must list at least one queue"),
        ({"queues": {}}, "queues must be a list"),
        ({"queues": [{"igw_base_url": "http://g"}]}, "queues[0].queue_name is required"),
        ({"queues": [{"queue_name": "q"}]}, "queues[0].igw_base_url is required"),
        (
            {"queues": [{"queue_name": "q", "igw_base_url": "ftp://g"}]},
            "queues[0].igw_base_url must be an http:// or https:// URL with a valid host and"
            " port, got 'ftp://g'",
        ),
        ({"queues": [QUEUE, QUEUE]}, "queue_name 'q' is listed twice"),
        (
            {"queues": [QUEUE, {**QUEUE, "queue_name": "r", "id": "q"}]},
            "queue id 'q' is listed twice",
        ),
        (
            {"queues": [{**QUEUE, "gate_type": "magic"}]},
            "queues[0].gate_type must be one of constant, redis, local-max-concurrency,"
            " got 'magic'",
        ),
        (
            {"queues": [{**QUEUE, "labels": {"a": 1}}]},
            "queues[0].labels must be an object of strings",
        ),
        (
            {"queues": [QUEUE], "url": "http://h:1"},
            "Redis URL must start with redis://, rediss:// or unix://, got 'http://h:1'",
        ),
        (
            {"queues": [QUEUE], "result_queue_name": ""},
            "result_queue_name must be a non-empty string",
        ),
    ],
)
def test_errors_name_the_field(doc: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(doc)
    assert str(info.value) == message
    assert "\n" not in str(info.value)


def test_other_errors() -> None:
    with pytest.raises(
        ConfigError,
        match=r"^--transport-config is not valid JSON: Expecting value at line 1 column 1$",
    ):
        load_config(inline="nope", environ=ENV)
    with pytest.raises(ConfigError, match="mutually exclusive"):
        load_config(inline="{}", path="x.json", environ=ENV)
    with pytest.raises(
        ConfigError, match=r"^cannot read /nonexistent/t\.json: No such file or directory$"
    ):
        load_config(path="/nonexistent/t.json", environ=ENV)
    with pytest.raises(ConfigError, match=r"^url is required"):
        load_config(inline=json.dumps({"queues": [QUEUE]}), environ={})
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        load_config(inline="[1]", environ=ENV)


def test_unknown_queue_lookup() -> None:
    c = load({"queues": [QUEUE]})
    assert c.queue("q") is c.queues[0]
    with pytest.raises(ConfigError, match=r"^unknown queue 'x' \(configured: q\)$"):
        c.queue("x")


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("redis://user:secret@host:1/0", "redis://user:***@host:1/0"),
        ("redis://:p@ss@h/0", "redis://:***@h/0"),
        ("redis://h:1/0?password=s3cret&db=1", "redis://h:1/0?password=***&db=1"),
        # One URL: a password may hold spaces (and '@').
        ("redis://:s3cret pw@127.0.0.1:1/0", "redis://:***@127.0.0.1:1/0"),
        ("redis://h:1/0?password=s3 cret&db=1", "redis://h:1/0?password=***&db=1"),
        ("redis://u:a b@c@h/0?pwd=x y", "redis://u:***@h/0?pwd=***"),
        # In a message: a quoted URL as a whole; unquoted, up to an '@' before a space or '/'.
        ("got 'redis://:a b@h' and 'redis://c:d@e'", "got 'redis://:***@h' and 'redis://c:***@e'"),
        ('bad "redis://u:p@ss w@h/0?password=x y"', 'bad "redis://u:***@h/0?password=***"'),
        ("Redis at redis://:p@ss@h:1/0 is down", "Redis at redis://:***@h:1/0 is down"),
        # A URL without a password keeps its port and the message its text (a Lua error
        # names "@user_script").
        (
            "Redis at redis://127.0.0.1:6421/0 answered: WRONGTYPE script: ab, on @user_script:39.",
            "Redis at redis://127.0.0.1:6421/0 answered: WRONGTYPE script: ab, on @user_script:39.",
        ),
        (
            "got 'rediss://a:b@h' and 'redis://c:d@e'",
            "got 'rediss://a:***@h' and 'redis://c:***@e'",
        ),
        (
            "Redis URL must start with redis://, got 'http://h:1'",
            "Redis URL must start with redis://, got 'http://h:1'",
        ),
    ],
)
def test_passwords_are_masked(text: str, shown: str) -> None:
    from claimkit.store import redact_url

    assert redact_url(text) == shown


# -- topology (docs/topology.md#configuration) -------------------------------------------------


def test_topology_defaults_to_standalone_without_waiting() -> None:
    c = load({"queues": [QUEUE]})
    assert (c.mode, c.addrs, c.master_name, c.wait_replicas, c.wait_timeout_ms) == (
        "standalone",
        (),
        None,
        0,
        1000,
    )
    assert c.topology == Topology()


def test_cluster_and_sentinel_topologies_are_read() -> None:
    c = load({"queues": [QUEUE], "mode": "cluster", "addrs": ["h2:7001", "[::1]:7002"]})
    assert c.topology == Topology("cluster", ("h2:7001", "[::1]:7002"), None)
    assert c.topology.seeds("redis://h1:7000/0") == [("h1", 7000), ("h2", 7001), ("::1", 7002)]
    c = load(
        {
            "queues": [QUEUE],
            "url": "redis://:pw@s1:26379/2",
            "mode": "sentinel",
            "addrs": ["s2:26379"],
            "master_name": "mymaster",
            "wait_replicas": 1,
            "wait_timeout_ms": 250,
        }
    )
    assert c.topology == Topology("sentinel", ("s2:26379",), "mymaster")
    assert (c.wait_replicas, c.wait_timeout_ms) == (1, 250)
    # 0 means the default for the timeout (WAIT 0 would block for ever), 0 for the replicas.
    c = load({"queues": [QUEUE], "wait_replicas": 0, "wait_timeout_ms": 0})
    assert (c.wait_replicas, c.wait_timeout_ms) == (0, 1000)


BAD_ADDRS = {
    "redis://127.0.0.1:7000": '"redis://127.0.0.1:7000" must be "host:port" without a scheme',
    "127.0.0.1:7000:1": '"127.0.0.1:7000:1" must be "host:port" with one ":" (an IPv6 host in '
    'brackets: "[::1]:7000")',
    "::1:7000": '"::1:7000" must be "host:port" with one ":" (an IPv6 host in brackets: '
    '"[::1]:7000")',
    " 127.0.0.1:7000": '" 127.0.0.1:7000" must be "host:port" without spaces',
    "127.0.0.1:7000 ": '"127.0.0.1:7000 " must be "host:port" without spaces',
    "h:\n1": '"h:\\n1" must be "host:port" without spaces',
    "127.0.0.1:99999": '"127.0.0.1:99999" has port 99999, out of range 1-65535',
    ":7000": '":7000" must be "host:port" (no host)',
    "h:": '"h:" must be "host:port" (no port)',
    "h:x": '"h:x" must be "host:port" (port "x" is not a number)',
    "h:-1": '"h:-1" must be "host:port" (port "-1" is not a number)',
    "a/b:1": '"a/b:1" must be "host:port" (bad host "a/b")',
    "user@h:1": '"user@h:1" must be "host:port" (bad host "user@h")',
    "[::1]": '"[::1]" must be "[IPv6 address]:port"',
    "[h]:1": '"[h]:1" must be "[IPv6 address]:port"',
    "[::1]:70000": '"[::1]:70000" has port 70000, out of range 1-65535',
}
"""Each ``addrs`` mistake and its line after ``addrs entry `` (docs/topology.md#configuration)."""


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"addrs": ["h:1"]}, 'addrs requires mode "cluster" or "sentinel"'),
        ({"mode": "standalone", "addrs": ["h:1"]}, 'addrs requires mode "cluster" or "sentinel"'),
        ({"master_name": "m"}, 'master_name requires mode "sentinel"'),
        ({"mode": "cluster", "master_name": "m"}, 'master_name requires mode "sentinel"'),
        ({"mode": "sentinel"}, 'master_name is required when mode is "sentinel"'),
        (
            {"mode": "sentinel", "master_name": ""},
            'master_name is required when mode is "sentinel"',
        ),
        ({"mode": "x"}, 'unknown mode "x" (expected "standalone", "cluster" or "sentinel")'),
        (
            {"mode": "cluster", "url": "redis://h:7000/3"},
            'mode "cluster" does not support selecting database 3; use database 0 in url',
        ),
        (
            {"mode": "cluster", "url": "redis://h:7000?db=2"},
            'mode "cluster" does not support selecting database 2; use database 0 in url',
        ),
        (
            # The clients read ?db= before the path: this URL selects database 3.
            {"mode": "cluster", "url": "redis://h:7000/0?db=3"},
            'mode "cluster" does not support selecting database 3; use database 0 in url',
        ),
        (
            {"mode": "cluster", "url": "redis://h:7000/0?timeout=5&db=3&db=0"},
            'mode "cluster" does not support selecting database 3; use database 0 in url',
        ),
        ({"mode": 1}, "mode must be a string, got 1"),
        ({"mode": "cluster", "addrs": "h:1"}, 'addrs must be a list of "host:port" strings'),
        ({"mode": "cluster", "addrs": [7000]}, 'addrs must be a list of "host:port" strings'),
        ({"mode": "cluster", "addrs": ["h"]}, 'addrs entry "h" must be "host:port"'),
        (
            {"mode": "cluster", "addrs": ["h:0"]},
            'addrs entry "h:0" has port 0, out of range 1-65535',
        ),
        *(({"mode": "cluster", "addrs": [a]}, f"addrs entry {m}") for a, m in BAD_ADDRS.items()),
        ({"mode": "sentinel", "master_name": 3}, "master_name must be a non-empty string"),
        ({"wait_replicas": -1}, "wait_replicas must be non-negative"),
        ({"wait_timeout_ms": "1s"}, 'wait_timeout_ms must be a number, got "1s"'),
    ],
)
def test_topology_errors_are_upstreams_lines(doc: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load({"queues": [QUEUE], **doc})
    assert str(info.value) == message


def test_addrs_entries_are_host_and_port() -> None:
    doc = {"mode": "cluster", "addrs": ["h:1", "10.0.0.6:65535", "[::1]:7000", "[fe80::1%eth0]:7"]}
    c = load({"queues": [QUEUE], **doc})
    assert c.topology.seeds("redis://h:1") == [
        ("h", 1),
        ("10.0.0.6", 65535),
        ("::1", 7000),
        ("fe80::1%eth0", 7),
    ]


def test_a_cluster_on_database_0_is_fine() -> None:
    for url in ("redis://h:7000", "redis://h:7000/0", "redis://h:7000/", "redis://h:7000/3?db=0"):
        assert load({"queues": [QUEUE], "mode": "cluster", "url": url}).mode == "cluster"
