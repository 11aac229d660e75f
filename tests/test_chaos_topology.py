"""The chaos harness's topology pieces that need no Redis: its options, its schedule, the
cluster key layout it reads, the location rule for reads that are not atomic across slots,
and its record log (bench/chaos.py, bench/chaos_observe.py).

The harness itself runs against real topologies (``--topology cluster|sentinel``); these
tests pin down the rules it judges those runs by.
"""

from __future__ import annotations

import importlib
import json
import random
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from claimkit.protocol.keys import hash_tag, key_slot, slot_key

if TYPE_CHECKING:
    from types import ModuleType

BENCH = Path(__file__).resolve().parent.parent / "bench"


def bench(name: str) -> ModuleType:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


def test_the_cluster_layout_wraps_an_untagged_queue_and_keeps_a_tagged_one() -> None:
    observe = bench("chaos_observe")
    keys = observe.ChaosKeys.for_run("chaos", "retry-sortedset", "result-list", cluster=True)
    assert keys.queue_keys() == [
        "chaos",
        "{chaos}:claimed",
        "{chaos}:claim-owners",
        "{chaos}:claims-idx",
        "{chaos}:retry-sortedset",
        "{chaos}:dead",
        "{chaos}:retry-sortedset:dead",
        "{chaos}:outbox",
    ]
    assert keys.queue.deliveries == "{chaos}:deliveries"
    assert not keys.one_slot  # slots 4772 and 6122
    tagged = observe.ChaosKeys.for_run("{t}:q", "retry-sortedset", "{t}:results", cluster=True)
    assert tagged.snapshot_keys() == [
        "{t}:q",
        "{t}:q:claimed",
        "{t}:q:claim-owners",
        "{t}:q:claims-idx",
        "{t}:q:retry-sortedset",
        "{t}:q:dead",
        "{t}:q:retry-sortedset:dead",
        "{t}:q:outbox",
        "{t}:results",
    ]
    assert tagged.one_slot
    standalone = observe.ChaosKeys.for_run("chaos", "retry-sortedset", "result-list", cluster=False)
    assert standalone.queue_keys()[:7] == [
        "chaos",
        "chaos:claimed",
        "chaos:claim-owners",
        "chaos:claims-idx",
        "retry-sortedset",
        "chaos:dead",
        "retry-sortedset:dead",
    ]
    assert standalone.one_slot


def test_key_slots_and_hash_tags_as_redis_defines_them() -> None:
    # CLUSTER KEYSLOT answers on Redis 7.0: foo 12182, chaos 4772, result-list 6122.
    assert [key_slot(k) for k in ("foo", "chaos", "result-list")] == [12182, 4772, 6122]
    assert key_slot("{chaos}:claimed") == key_slot("chaos")
    assert key_slot("{t}:q") == key_slot("{t}:results") == key_slot("t")
    assert slot_key("{}x") == "{{}x}"  # an empty tag is no tag
    assert slot_key("a{b}c") == "a{b}c"
    assert hash_tag("x{}{y}") is None


@pytest.mark.parametrize(
    ("places", "before", "after", "accepted", "problem"),
    [
        (["pending"], False, False, True, None),
        (["claimed"], False, True, True, None),  # acked between the two reads
        (["pending"], False, True, True, None),  # claimed, run and acked in between
        (["claimed"], True, True, True, "claimed after its record"),
        (["outbox"], False, False, True, None),  # moved, not pushed yet
        (["outbox"], True, True, True, None),  # pushed, not dropped yet
        (["dead", "outbox"], False, False, True, None),  # dead-letter record on its way
        (["dead"], True, True, True, None),
        ([], False, True, True, None),
        ([], False, False, True, "nowhere"),
        ([], False, False, False, None),  # being submitted
        (["pending", "claimed"], False, False, True, "more than one copy"),
        (["outbox", "outbox"], False, False, True, "more than one copy"),
        (["claimed", "outbox"], False, False, True, "claimed and outbox at once"),
        (["retry", "dead"], False, False, True, "retry and dead at once"),
    ],
)
def test_the_location_rule(
    places: list[str], before: bool, after: bool, accepted: bool, problem: str | None
) -> None:
    rule = bench("chaos_observe").location_problem
    assert rule(places, record_before=before, record_after=after, accepted=accepted) == problem


def test_the_record_log_counts_vanished_records_and_stalls() -> None:
    log = bench("chaos").RecordLog()
    log.extend([b'{"id":"a"}', b'{"id":"b"}'])
    log.extend([])
    assert dict(log.counts) == {"a": 1, "b": 1}
    log.replace([b'{"id":"a"}'])  # a failover lost b's record
    assert (dict(log.counts), log.vanished, len(log.progress)) == ({"a": 1}, 1, 1)
    log.replace([b'{"id":"a"}', b'{"id":"b"}', b'{"id":"b"}'])  # b ran again: 2 records
    assert (dict(log.counts), log.vanished, len(log.progress)) == ({"a": 1, "b": 2}, 1, 2)
    log.progress = [10.0, 10.5, 13.0, 13.2]
    assert log.longest_stall() == 2.5


def test_the_options_of_the_topologies() -> None:
    chaos = bench("chaos")
    opts = chaos.parse_args(["--fault", "failover", "--wait-replicas", "1"])
    assert (opts.topology, opts.redis_crashes, opts.wait_replicas) == ("sentinel", 0, 1)
    assert opts.fault_weights["redis"] == 0.0
    assert chaos.make_schedule(random.Random(1), opts) == [chaos.Fault(60.0, "failover", 0, 0)]
    cluster = chaos.parse_args(["--topology", "cluster", "--tagged"])
    assert (cluster.queue, cluster.results, cluster.redis_crashes) == ("{t}:q", "{t}:results", 1)
    plain = chaos.parse_args([])
    assert (plain.topology, plain.queue, plain.results, plain.redis_crashes) == (
        "standalone",
        "chaos",
        "result-list",
        1,
    )
    assert plain.wait_replicas is None
    schedule = chaos.make_schedule(
        random.Random(2), chaos.parse_args(["--topology", "sentinel", "--every-kind"])
    )
    assert {f.kind for f in schedule} == {"kill", "stop", "clientkill", "term", "start", "oom"}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--fault", "failover", "--topology", "standalone"], "--fault failover needs"),
        (["--topology", "sentinel", "--redis-crashes", "1"], "--redis-crashes does not apply"),
        (["--wait-replicas", "-1"], "--wait-replicas must not be negative"),
    ],
)
def test_options_that_do_not_fit_are_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        bench("chaos").parse_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_wait_replicas_is_passed_through_to_the_consumers_config(tmp_path: Path) -> None:
    chaos = bench("chaos")
    observe = bench("chaos_observe")
    from claimkit.dev.redis_server import RedisServer

    opts = chaos.parse_args(["--wait-replicas", "2"])
    topo = chaos.Topo(opts, tmp_path)
    topo.server = RedisServer(port=23456)  # not started: only its URL is read
    keys = observe.ChaosKeys.for_run(opts.queue, chaos.RETRY, opts.results, cluster=False)
    run = chaos.Run(opts=opts, workdir=tmp_path, topo=topo, keys=keys, sim_url="http://sim")
    config = json.loads(run.consumer_config())
    assert config["url"] == "redis://127.0.0.1:23456/0"
    assert config["wait_replicas"] == 2
    assert "wait_timeout_ms" not in config
    assert "mode" not in config
    assert config["queues"] == [{"queue_name": "chaos", "igw_base_url": "http://sim"}]
    assert config["result_queue_name"] == "result-list"
    plain = chaos.parse_args([])
    run.opts = plain
    assert "wait_replicas" not in json.loads(run.consumer_config())


@pytest.mark.parametrize(
    ("script", "argv"),
    [
        # lua/ack-5.lua: dedup ttl, fallback, then 8 per item (id, token, ...)
        (
            "ack",
            [
                b"0",
                b"fb",
                b"r1",
                b"t1",
                b"g1",
                b"m",
                b"l",
                b"{}",
                b"x",
                b"",
                b"r2",
                b"t2",
                b"",
                b"m",
                b"l",
                b"{}",
                b"x",
                b"request-payload:r2:g2",
            ],
        ),
        # lua/ack-local-9.lua: dedup ttl, final flag, fallback, then 6 per item
        (
            "ack-local",
            [
                b"0",
                b"0",
                b"fb",
                b"r1",
                b"t1",
                b"g1",
                b"{}",
                b"x",
                b"r1\0t1",
                b"r2",
                b"t2",
                b"",
                b"{}",
                b"x",
                b"r2\0t2",
            ],
        ),
        # lua/ack-outbox-6.lua: 7 per item (id, token, request_token, list, record, member, field)
        (
            "ack-outbox",
            [
                b"r1",
                b"t1",
                b"g1",
                b"l",
                b"{}",
                b"x",
                b"r1\0t1",
                b"r2",
                b"t2",
                b"",
                b"l",
                b"{}",
                b"x",
                b"r2\0t2",
            ],
        ),
    ],
)
def test_the_monitor_reads_every_ack_scripts_items(script: str, argv: list[bytes]) -> None:
    """A cluster's one-slot ack and outbox move end claims as ack-5 does: the harness must
    read their (id, token) items, or a killed owner's acked claims count as unresolved."""
    observe = bench("chaos_observe")
    numkeys = {"ack": 5, "ack-local": 9, "ack-outbox": 6}[script]
    args = [b"EVALSHA", b"sha", str(numkeys).encode(), *[b"k"] * numkeys, *argv]
    claim_call, items = observe.Monitor._items(script, 0.0, "c", args)
    assert claim_call is None
    assert items == [("r1", "t1"), ("r2", "t2")]
    assert observe._ACK_ALIASES.get(script, script) == "ack"
