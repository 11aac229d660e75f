"""The cluster key layout (claimkit.protocol.keys): hash tags and slots exactly as a real
Redis Cluster computes them (``CLUSTER KEYSLOT``), and the names of DESIGN's layout."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import pytest
from cluster import redis_cluster
from support import make_config

from claimkit.config import ConfigError, load_config
from claimkit.consumer.preflight import key_roles
from claimkit.protocol.keys import (
    QueueKeys,
    ResultKeys,
    cluster_name_problem,
    hash_tag,
    key_slot,
    outbox_field,
    reserved_keys,
    slot_key,
)

if TYPE_CHECKING:
    from cluster import RedisCluster

__all__ = ["redis_cluster"]

NAMES = [
    "",
    "q",
    "requests",
    "result-list",
    "retry-sortedset",
    "request-cancel:r1",
    "request-active:r1",
    "result-terminal:r1",
    "{t}:q",
    "{t}:results",
    "{tenant-a}:requests",
    "{tenant-a}:requests:claimed",
    "{}",
    "{}a",
    "a{}",
    "a{}b{c}",
    "{}{a}",
    "{",
    "}",
    "}{",
    "}{a}",
    "a{b",
    "a}b{",
    "{a",
    "a}",
    "{{a}}",
    "{{}}",
    "{a}{b}",
    "x{a}y{b}z",
    "{a}}",
    "{{a}",
    "{ }",
    "{\x00}",
    "{q}",
    "{q}:claimed",
    "{q}:outbox",
    "{result-list}:result-terminal",
    "{result-list}:result-terminal-expiry",
    "ünï/çødé 1",
    "{ünï}x",
    "a:b:c",
    "{x}y",
    "123456789",
    "foo",
    "bar",
    "user1000",
    "{user1000}.following",
    "{user1000}.followers",
    "tenant-b:requests",
    "{tenant-b}:requests",
    "long-" + "x" * 300,
    "{" + "y" * 300 + "}tail",
]


def test_key_slot_is_crc16_xmodem() -> None:
    # The CRC catalogue's check value of CRC-16/XMODEM, and the example of the cluster spec.
    assert key_slot("123456789") == 0x31C3 % 16384


@pytest.mark.parametrize(
    ("key", "tag"),
    [
        ("q", None),
        ("{t}:q", b"t"),
        ("a{b}{c}", b"b"),
        ("{}a", None),
        ("a{}b{c}", None),
        ("a{b", None),
        ("}{a}", b"a"),
        ("{{a}}", b"{a"),
        ("{ }", b" "),
        ("{ünï}x", "ünï".encode()),
    ],
)
def test_hash_tag(key: str, tag: bytes | None) -> None:
    assert hash_tag(key) == tag


def test_slots_match_cluster_keyslot(redis_cluster: RedisCluster) -> None:
    expected = [int(redis_cluster.call(0, "CLUSTER", "KEYSLOT", name)) for name in NAMES]
    assert [key_slot(name) for name in NAMES] == expected
    assert [key_slot(name.encode()) for name in NAMES] == expected


def test_slot_key_wraps_only_untagged_names(redis_cluster: RedisCluster) -> None:
    assert slot_key("q") == "{q}"
    assert slot_key("{t}:q") == "{t}:q"
    assert slot_key("{}q") == "{{}q}"
    assert slot_key("a{b") == "{a{b}"
    for name in NAMES:
        if name and name.find("}") < 0:  # "{name}" has the tag "name"
            assert key_slot(slot_key(name) + ":claimed") == key_slot(name)
    for name in ["q", "{t}:q", "a:b:c", "ünï/çødé 1", "a{b"]:
        wrapped = slot_key(name) + ":claimed"
        assert int(redis_cluster.call(0, "CLUSTER", "KEYSLOT", wrapped)) == key_slot(name)


def test_queue_keys_standalone_names_are_unchanged() -> None:
    k = QueueKeys.for_queue("q")
    assert k == QueueKeys(
        pending="q",
        claimed="q:claimed",
        owners="q:claim-owners",
        index="q:claims-idx",
        deliveries="q:deliveries",
        dead="q:dead",
        paused="q:paused",
        consumers="q:consumers",
        consumer_info="q:consumer-info",
        retry_set="retry-sortedset",
        retry_dead="retry-sortedset:dead",
        outbox=None,
    )
    assert not k.cluster
    assert k.types() == {
        "q": "zset",
        "q:claimed": "hash",
        "q:claim-owners": "hash",
        "q:claims-idx": "zset",
        "q:deliveries": "hash",
        "q:dead": "zset",
        "q:paused": "string",
        "q:consumers": "zset",
        "q:consumer-info": "hash",
    }
    assert QueueKeys.for_queue("q", retry_set="r").retry_dead == "r:dead"


def test_queue_keys_cluster_layout() -> None:
    k = QueueKeys.for_queue("q", cluster=True, retry_set="retry-sortedset")
    assert k.cluster
    assert k.described() == [
        ("q", "zset", "queue key"),
        ("{q}:claimed", "hash", "claimed hash"),
        ("{q}:claim-owners", "hash", "claim-owners hash"),
        ("{q}:claims-idx", "zset", "claims index"),
        ("{q}:deliveries", "hash", "deliveries hash"),
        ("{q}:dead", "zset", "dead set"),
        ("{q}:paused", "string", "pause key"),
        ("{q}:consumers", "zset", "consumer registry"),
        ("{q}:consumer-info", "hash", "consumer-info hash"),
        ("{q}:outbox", "hash", "outbox hash"),
        ("{q}:retry-sortedset", "zset", "retry set"),
        ("{q}:retry-sortedset:dead", "zset", "retry dead set"),
    ]
    tagged = QueueKeys.for_queue("{t}:q", cluster=True, retry_set="rs")
    assert (tagged.consumers, tagged.consumer_info) == ("{t}:q:consumers", "{t}:q:consumer-info")
    assert (tagged.claimed, tagged.paused, tagged.outbox, tagged.retry_set, tagged.retry_dead) == (
        "{t}:q:claimed",
        "{t}:q:paused",
        "{t}:q:outbox",
        "{t}:q:rs",
        "{t}:q:rs:dead",
    )
    for keys in (k, tagged):
        assert {key_slot(name) for name in keys.types()} == {key_slot(keys.pending)}


def test_result_keys_share_the_lists_slot() -> None:
    assert ResultKeys.for_list("result-list") == ResultKeys(
        "result-list", "{result-list}:result-terminal", "{result-list}:result-terminal-expiry"
    )
    assert ResultKeys.for_list("{t}:results") == ResultKeys(
        "{t}:results", "{t}:results:result-terminal", "{t}:results:result-terminal-expiry"
    )
    for name in ["result-list", "{t}:results", "ünï/çødé 1"]:
        r = ResultKeys.for_list(name)
        assert {key_slot(r.results), key_slot(r.terminal), key_slot(r.expiry)} == {key_slot(name)}
    assert key_slot("{t}:results") == key_slot("{t}:q")


def test_outbox_field_and_reserved_keys() -> None:
    assert outbox_field("r1", "ab") == "r1\x00ab"
    assert reserved_keys(["q"], "rs") == frozenset(QueueKeys.for_queue("q").types()) | {
        "rs",
        "rs:dead",
    }
    assert reserved_keys(["q"], "rs", cluster=True) == frozenset(
        QueueKeys.for_queue("q", cluster=True, retry_set="rs").types()
    ) | {"rs", "rs:dead"}


def test_serve_checks_the_cluster_layouts_keys() -> None:
    """In cluster mode ``serve``'s key-type check names the keys the cluster layout uses:
    each queue's {q}: keys, outbox and retry sets, and each configured list's markers."""
    config = make_config("redis://127.0.0.1:7000/0", queue="q", mode="cluster")
    roles = {name: (role.kind, role.name(name)) for name, role in key_roles(config).items()}
    assert {n: r for n, r in roles.items() if n.startswith(("{q}", "{result-list}"))} == {
        "{q}:claimed": ("hash", "claimed hash '{q}:claimed' of queue 'q'"),
        "{q}:claim-owners": ("hash", "claim-owners hash '{q}:claim-owners' of queue 'q'"),
        "{q}:claims-idx": ("zset", "claims index '{q}:claims-idx' of queue 'q'"),
        "{q}:deliveries": ("hash", "deliveries hash '{q}:deliveries' of queue 'q'"),
        "{q}:dead": ("zset", "dead set '{q}:dead' of queue 'q'"),
        "{q}:paused": ("string", "pause key '{q}:paused' of queue 'q'"),
        "{q}:consumers": ("zset", "consumer registry '{q}:consumers' of queue 'q'"),
        "{q}:consumer-info": ("hash", "consumer-info hash '{q}:consumer-info' of queue 'q'"),
        "{q}:outbox": ("hash", "outbox hash '{q}:outbox' of queue 'q'"),
        "{q}:retry-sortedset": ("zset", "retry set '{q}:retry-sortedset' of queue 'q'"),
        "{q}:retry-sortedset:dead": (
            "zset",
            "retry dead set '{q}:retry-sortedset:dead' of queue 'q'",
        ),
        "{result-list}:result-terminal": (
            "hash",
            "result-terminal hash '{result-list}:result-terminal' of result list 'result-list'",
        ),
        "{result-list}:result-terminal-expiry": (
            "zset",
            "result-terminal expiry set '{result-list}:result-terminal-expiry' of result list "
            "'result-list'",
        ),
    }
    standalone = key_roles(make_config("redis://127.0.0.1:7000/0", queue="q"))
    assert not any(name.startswith("{") for name in standalone)


UNTAGGABLE = ["a}b", "{}:q", "x{}y", "}", "q}"]


@pytest.mark.parametrize("name", [*UNTAGGABLE, "q", "{t}:q", "{a", "{t}:q}", "ünï"])
def test_a_name_is_refused_exactly_when_its_derived_keys_leave_its_slot(
    redis_cluster: RedisCluster, name: str
) -> None:
    slot = int(redis_cluster.call(0, "CLUSTER", "KEYSLOT", name))
    derived = int(redis_cluster.call(0, "CLUSTER", "KEYSLOT", slot_key(name) + ":claimed"))
    problem = cluster_name_problem(name)
    assert (problem is not None) == (name in UNTAGGABLE) == (slot != derived)


@pytest.mark.parametrize(
    ("field", "doc"),
    [
        ("queue_name", {"queues": [{"queue_name": "a}b", "igw_base_url": "http://gw"}]}),
        (
            "result_queue_name",
            {
                "queues": [
                    {"queue_name": "q", "igw_base_url": "http://gw", "result_queue_name": "{}:r"}
                ]
            },
        ),
        (
            "result_queue_name",
            {
                "result_queue_name": "r}",
                "queues": [{"queue_name": "q", "igw_base_url": "http://gw"}],
            },
        ),
    ],
)
def test_cluster_mode_refuses_a_name_no_key_can_share_a_slot_with(
    field: str, doc: dict[str, object]
) -> None:
    bad = {"a}b", "{}:r", "r}"}
    conf = {"url": "redis://127.0.0.1:7000/0", "mode": "cluster", **doc}
    with pytest.raises(ConfigError) as err:
        load_config(inline=json.dumps(conf))
    (name,) = [n for n in bad if repr(n) in str(err.value)]
    assert str(err.value) == (
        f"{field} {name!r} cannot be used in cluster mode: it holds a '}}' but no hash tag, so "
        "no other key can share its slot; give it a hash tag ({tenant}:...) or drop the '}' "
        "(docs/topology.md#cluster-key-layout)"
    )
    # The same names are fine on a standalone Redis: nothing there checks slots.
    load_config(inline=json.dumps({**conf, "mode": "standalone"}))


def test_the_consumer_dead_letters_a_request_whose_list_cannot_be_used_on_a_cluster() -> None:
    """The poller's rule (claimkit.consumer.poll ``_misrouted``) and ``claimkit dead``'s:
    on a cluster a member's own list must be usable there; on standalone it may be."""
    from claimkit.protocol.routing import reserved_destination

    assert reserved_destination("x}y", frozenset(), cluster=True) == (
        "Failed: internal.result_queue_name 'x}y' cannot be used in cluster mode: it holds a "
        "'}' but no hash tag, so no other key can share its slot; give it a hash tag "
        "({tenant}:...) or drop the '}' (docs/topology.md#cluster-key-layout)"
    )
    assert reserved_destination("x}y", frozenset()) is None
    assert reserved_destination("{t}:x}y", frozenset(), cluster=True) is None
    assert reserved_destination(None, frozenset(), cluster=True) is None


@pytest.mark.parametrize(
    "name",
    [
        "results:result-claimed",
        "results:result-claim-owners",
        "results:result-claims-idx",
        "results:result-ack-tombstones",
        "{results}:result-terminal",
        "{results}:result-terminal-expiry",
    ],
)
def test_a_key_kept_beside_a_result_list_is_not_a_destination(name: str) -> None:
    """A member must not send its record onto a durable reader's key or a cluster marker
    key of some list: the LPUSH would meet a hash or a sorted set (or re-create it as a
    list while it is empty)."""
    from claimkit.protocol.routing import reserved_destination

    assert reserved_destination(name, frozenset()) == (
        f"Failed: internal.result_queue_name names a key claimkit uses: {name!r}"
    )
    # A list whose own name merely contains the words is still a list.
    assert reserved_destination(name + "-archive", frozenset()) is None
