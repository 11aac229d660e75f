"""``claimkit reclaim --once`` and the fast failover on a real Redis
(docs/protocol.md#fast-failover, docs/operations.md#a-redis-restart): it hands a dead
consumer's claims on and counts them (``handed_on``), and skips the failover, saying why,
while Redis has been up less than one liveness TTL or when no consumer of the queue is
alive (the signature of an outage); ``INFO`` refused, only the second rule applies."""

from __future__ import annotations

import json
import re
import time
from typing import TYPE_CHECKING

import pytest
from support import config_json, do, invoke, member, server_now_sync

from claimkit.store.server_checks import info_fields

if TYPE_CHECKING:
    from collections.abc import Sequence

    from claimkit.store import Arg

Q = "jobs"
FAR = 4_000_000_000
HEX = "0" * 32


def scenario(url: str, *, alive: bool) -> float:
    """``d1`` held by the lapsed consumer ``dead``, ``l1`` by ``live`` (alive or lapsed),
    both leases 300 s ahead; returns the lease of ``d1``."""
    now = server_now_sync(url)
    lease = round(now + 300, 3)
    claims: list[Sequence[Arg]] = []
    for rid, cid in (("d1", "dead"), ("l1", "live")):
        claims += [
            ("HSET", f"{Q}:claimed", rid, member(rid, FAR), f"{rid}:score", FAR),
            ("HSET", f"{Q}:claim-owners", rid, f"{cid}/{HEX}"),
            ("ZADD", f"{Q}:claims-idx", repr(lease), rid),
        ]
    do(url, *claims, ("ZADD", f"{Q}:consumers", 1000.5, "dead", FAR if alive else 1001, "live"))
    return lease


def uptime(url: str) -> int:
    (info,) = do(url, ("INFO", "server"))
    return int(info_fields(info)["uptime_in_seconds"])


def wait_uptime(url: str, seconds: int) -> None:
    deadline = time.monotonic() + 60
    while uptime(url) < seconds:
        assert time.monotonic() < deadline, "Redis's uptime never reached the TTL"
        time.sleep(0.1)


def reclaim(url: str, ttl: float, *extra: str, user: str | None = None) -> tuple[str, str]:
    target = url if user is None else url.replace("redis://", f"redis://{user}:pw@", 1)
    transport = config_json(queue=Q, consumer_liveness_ttl_seconds=ttl)
    result = invoke(["reclaim", "--once", "--transport-config", transport, *extra], target)
    assert result.exit_code == 0, result.output
    return result.stdout, result.stderr


def state(url: str) -> list[object]:
    return do(
        url,
        ("ZRANGE", f"{Q}:claims-idx", 0, -1),
        ("ZRANGE", Q, 0, -1),
        ("ZSCORE", f"{Q}:consumers", "dead"),
    )


LINE = "claimkit reclaim: queues=1 redelivered={} dead_lettered=0 ghosts=0 leases_restored=0 "


def test_reclaim_once_hands_a_dead_consumers_claims_on_and_counts_them(redis_url: str) -> None:
    wait_uptime(redis_url, 3)
    scenario(redis_url, alive=True)
    assert reclaim(redis_url, 3) == (LINE.format(1) + "handed_on=1\n", "")
    assert state(redis_url) == [[b"l1"], [member("d1", FAR)], -1000.5]


def test_reclaim_once_json_counts_the_handed_on_claims(redis_url: str) -> None:
    wait_uptime(redis_url, 3)
    scenario(redis_url, alive=True)
    out, err = reclaim(redis_url, 3, "--json")
    counts = {"redelivered": 1, "dead_lettered": 0, "ghosts": 0, "orphans": 0}
    counts |= {"leases_restored": 0, "handed_on": 1}
    assert (json.loads(out), err) == ({"queues": {Q: counts}, **counts, "failover_skipped": {}}, "")


def test_reclaim_once_skips_fast_failover_while_redis_is_younger_than_one_ttl(
    redis_url: str,
) -> None:
    scenario(redis_url, alive=True)
    out, err = reclaim(redis_url, 86400)
    assert out == LINE.format(0) + "handed_on=0\n"
    assert re.fullmatch(
        rf"claimkit reclaim: {Q}: fast failover skipped: Redis has been up \d+ s, less than"
        r" one liveness TTL \(86400 s\): live consumers may not have renewed yet; the queue's"
        r" claims wait for their leases\n",
        err,
    ), err
    # Nothing handed on, the dead consumer not marked: the lease-based reclaim decides.
    assert state(redis_url) == [[b"d1", b"l1"], [], 1000.5]
    out, _ = reclaim(redis_url, 86400, "--json")
    (why,) = json.loads(out)["failover_skipped"].values()
    assert why.startswith("Redis has been up ")


def test_reclaim_once_says_nothing_when_the_failover_would_hand_nothing_on(
    redis_url: str,
) -> None:
    do(redis_url, ("ZADD", f"{Q}:consumers", FAR, "live"))
    assert reclaim(redis_url, 86400) == (LINE.format(0) + "handed_on=0\n", "")


NO_ONE = (
    f"claimkit reclaim: {Q}: fast failover skipped: no consumer of the queue is alive (every"
    " liveness entry lapsed: a Redis outage or failover, not one dead consumer); the"
    " queue's claims wait for their leases\n"
)


def test_reclaim_once_skips_fast_failover_when_no_consumer_is_alive(redis_url: str) -> None:
    wait_uptime(redis_url, 3)
    scenario(redis_url, alive=False)
    assert reclaim(redis_url, 3) == (LINE.format(0) + "handed_on=0\n", NO_ONE)
    assert state(redis_url) == [[b"d1", b"l1"], [], 1000.5]


@pytest.mark.parametrize("alive", [True, False])
def test_with_info_refused_only_the_no_one_alive_rule_applies(redis_url: str, alive: bool) -> None:
    do(redis_url, ("ACL", "SETUSER", "noinfo", "on", ">pw", "~*", "&*", "+@all", "-info"))
    try:
        scenario(redis_url, alive=alive)
        # A TTL of a day: were INFO readable, Redis would be too young for any failover.
        out, err = reclaim(redis_url, 86400, user="noinfo")
    finally:
        do(redis_url, ("ACL", "DELUSER", "noinfo"))
    if alive:
        assert (out, err) == (LINE.format(1) + "handed_on=1\n", "")
        assert state(redis_url) == [[b"l1"], [member("d1", FAR)], -1000.5]
    else:
        assert (out, err) == (LINE.format(0) + "handed_on=0\n", NO_ONE)
        assert state(redis_url) == [[b"d1", b"l1"], [], 1000.5]
