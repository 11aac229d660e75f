"""The consumer registry and fast failover on a real Redis (docs/protocol.md#consumers,
docs/protocol.md#fast-failover): tokens that name their consumer, the registry scripts'
exact keys, the heartbeat renewing leases and liveness in one call, the reclaimer handing a
dead consumer's claims on (and only those), and how deliveries are counted.

Every test that takes only ``store`` runs again on a Redis Cluster
(tests/test_consumer_registry_cluster.py).
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

import pytest
from support import StoreWrapper, member, pairs, server_now, zrange

from claimkit.protocol.consumers import (
    ConsumerIdentity,
    default_consumer_id,
    forget_consumers,
    read_registry,
)
from claimkit.protocol.models import Envelope, parse_member
from claimkit.protocol.ops import ClaimCode, QueueOps, ReleaseCode, RenewCode
from claimkit.protocol.tokens import (
    consumer_id_problem,
    new_token,
    token_consumer,
    token_time,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from claimkit.store import Arg, ScriptCall, Store
    from claimkit.store.scripts import Script

Q = "{tenant-r}:requests"
FAR = 4_000_000_000  # a deadline far ahead: leases are now + ttl


def identity(cid: str, ttl: float = 10.0) -> ConsumerIdentity:
    return ConsumerIdentity(cid, ttl, "host-" + cid, 4242, "0.1.0")


def envelope(rid: str) -> Envelope:
    env = parse_member(member(rid, FAR))
    assert isinstance(env, Envelope)
    return env


async def claim_as(
    ops: QueueOps, cid: str | None, ids: Sequence[str], ttl: float = 300
) -> list[str]:
    """Submit and claim ``ids`` with tokens of consumer ``cid`` (``None``: bare hex, as
    before consumer ids); returns the tokens."""
    envs = [envelope(rid) for rid in ids]
    for env in envs:
        await ops.store.command("ZADD", ops.keys.pending, FAR, env.raw)
    pairs_ = [(env, new_token(cid)) for env in envs]
    _, codes = await ops.claim(pairs_, ttl)
    assert codes == [ClaimCode.CLAIMED] * len(ids)
    return [token for _, token in pairs_]


async def leases(store: Store, ops: QueueOps) -> dict[str, float]:
    return {m.decode(): s for m, s in await zrange(store, ops.keys.index)}


async def registry(store: Store, ops: QueueOps) -> dict[str, float]:
    return {m.decode(): s for m, s in await zrange(store, ops.keys.consumers)}


async def infos(store: Store, ops: QueueOps) -> dict[str, dict[str, Any]]:
    raw = pairs(await store.command("HGETALL", ops.keys.consumer_info))
    return {k.decode(): json.loads(v) for k, v in raw}


# -- tokens (docs/protocol.md#ownership-tokens) ----------------------------------------------


def test_a_token_is_the_consumer_id_a_slash_and_a_uuid7() -> None:
    token = new_token("pod-a.1_x", now=1_796_000_000.25)
    cid, sep, hex_part = token.partition("/")
    assert (cid, sep) == ("pod-a.1_x", "/")
    assert re.fullmatch(r"[0-9a-f]{12}7c1[0-9a-f][89ab][0-9a-f]{15}", hex_part)
    assert token_consumer(token) == "pod-a.1_x"
    assert token_time(token) == 1_796_000_000.25
    assert new_token("pod-a", now=1_796_000_000) != new_token("pod-a", now=1_796_000_000)


def test_old_and_foreign_tokens_still_parse_with_the_consumer_unknown() -> None:
    bare = new_token(now=1_796_000_000)
    assert (token_consumer(bare), token_time(bare)) == (None, 1_796_000_000.0)
    for foreign in ["f" * 32, "someone/else", "/" + bare, "bad id/" + bare, "a/b/" + "x", ""]:
        assert token_consumer(foreign) is None, foreign
    assert token_time("bad id/" + bare) is None  # not ours: the part before "/" is no id
    assert token_time("someone/else") is None


@pytest.mark.parametrize(
    ("cid", "ok"),
    [
        ("a", True),
        ("pod-7c9f-xz2.default_1", True),
        ("A" * 127, True),
        ("A" * 128, False),
        ("", False),
        ("-pod", False),
        (".pod", False),
        ("pod/a", False),
        ("pod a", False),
        ("pöd", False),
    ],
)
def test_consumer_ids_are_checked(cid: str, ok: bool) -> None:
    assert (consumer_id_problem(cid) is None) is ok
    if not ok:
        with pytest.raises(ValueError, match="consumer id"):
            new_token(cid)


def test_the_default_consumer_id_comes_from_the_environment_or_the_host() -> None:
    assert default_consumer_id({"CLAIMKIT_CONSUMER_ID": "x", "POD_NAME": "p"}) == "x"
    assert default_consumer_id({"POD_NAME": "claimkit-7d9-abcde"}) == "claimkit-7d9-abcde"
    here = default_consumer_id({})
    assert consumer_id_problem(here) is None
    assert re.fullmatch(r".+-\d+", here)


# -- the registry scripts -------------------------------------------------------------------


async def test_register_writes_the_liveness_entry_and_the_info(store: Store) -> None:
    ops = QueueOps(store, Q, consumer=identity("pod-a", ttl=7.5))
    registered = await ops.register()
    assert registered is not None
    now, other = registered
    assert other is None
    assert await registry(store, ops) == {"pod-a": pytest.approx(now + 7.5, abs=1e-6)}
    assert await infos(store, ops) == {
        "pod-a": {
            "host": "host-pod-a",
            "pid": 4242,
            "started": pytest.approx(now, abs=1e-3),
            "version": "0.1.0",
        }
    }
    # A restart under the same id replaces the info (its start time) and the expiry.
    registered = await ops.register()
    assert registered is not None
    again, other = registered
    assert (again >= now, other) == (True, None)  # the same host and pid: no other process
    assert (await infos(store, ops))["pod-a"]["started"] == pytest.approx(again, abs=1e-3)
    assert await QueueOps(store, Q).register() is None  # no consumer: nothing sent
    assert set(await registry(store, ops)) == {"pod-a"}


async def test_register_tells_of_another_live_process_under_the_same_id(store: Store) -> None:
    first = QueueOps(store, Q, consumer=ConsumerIdentity("pod-a", 10.0, "node-1", 100, "0.1.0"))
    registered = await first.register()
    assert registered is not None
    started = (await infos(store, first))["pod-a"]
    other_pid = QueueOps(store, Q, consumer=ConsumerIdentity("pod-a", 10.0, "node-1", 200, "0.1.0"))
    registered = await other_pid.register()
    assert registered is not None
    assert registered[1] == started  # alive, and another pid: the first process's info
    other_host = QueueOps(
        store, Q, consumer=ConsumerIdentity("pod-a", 10.0, "node-2", 200, "0.1.0")
    )
    registered = await other_host.register()
    assert registered is not None
    assert registered[1] == {**started, "pid": 200, "started": pytest.approx(registered[0], abs=1)}
    # Lapsed (a pod restarted under its name after its TTL), or marked dead: nothing to tell.
    for score in (1000.0, -1000.0):
        await store.command("ZADD", first.keys.consumers, score, "pod-a")
        registered = await first.register()
        assert registered is not None
        assert registered[1] is None
    # Alive with junk info, or none: nothing to tell either; the entry is replaced.
    await store.command("HSET", first.keys.consumer_info, "pod-a", "junk")
    registered = await other_pid.register()
    assert registered is not None
    assert registered[1] is None
    assert (await infos(store, first))["pod-a"]["pid"] == 200


async def test_serve_warns_once_of_another_live_process_under_its_id(
    store: Store, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    import trio
    from support import make_config

    from claimkit.consumer.consumer import Consumer

    queues = [{"queue_name": q, "igw_base_url": "http://x"} for q in (Q, "{tenant-r}:other")]
    config = make_config(redis_url, queues=queues)
    other = ConsumerIdentity(config.consumer_id, 60.0, "node-9", 1, "0.0.9")
    for q in (Q, "{tenant-r}:other"):
        await QueueOps(store, q, consumer=other).register()
    consumer = Consumer(config, store)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(consumer.run)
            while (await infos(store, QueueOps(store, "{tenant-r}:other")))[config.consumer_id][
                "host"
            ] == "node-9":
                await trio.sleep(0.02)
            consumer.request_stop()
    same = [r for r in caplog.records if "is in use by another live process" in r.getMessage()]
    assert [(r.levelname, r.getMessage()) for r in same] == [
        (
            "WARNING",
            f"consumer id {config.consumer_id} is in use by another live process too (host "
            f"node-9, pid 1, on {Q}): the two share one liveness entry, so if one dies the "
            "other keeps it alive and the dead one's claims wait for their whole lease; give "
            "each process its own id (--consumer-id; docs/operations.md#consumers)",
        )
    ]


async def test_renew_renews_the_leases_and_the_liveness_in_one_call(store: Store) -> None:
    calls: list[tuple[str, int]] = []

    class Counting(StoreWrapper):
        async def run(self, script: Script, keys: Sequence[str], args: Sequence[Arg]) -> Any:
            calls.append((script.name, 1))
            return await super().run(script, keys, args)

        async def run_many(self, script: Script, many: Sequence[ScriptCall]) -> list[Any]:
            calls.append((script.name, len(many)))
            return await super().run_many(script, many)

    plain = QueueOps(store, Q)
    tokens = await claim_as(plain, "pod-a", ["r1", "r2"], ttl=10)
    ops = QueueOps(Counting(store), Q, consumer=identity("pod-a", ttl=5))
    now, codes = await ops.renew([("r1", tokens[0], FAR), ("r2", tokens[1], FAR)], 60)
    assert codes == [RenewCode.RENEWED, RenewCode.RENEWED]
    assert calls == [("renew", 1)]  # one round trip, one script call
    assert await leases(store, ops) == {
        "r1": pytest.approx(now + 60, abs=1e-6),
        "r2": pytest.approx(now + 60, abs=1e-6),
    }
    assert await registry(store, ops) == {"pod-a": pytest.approx(now + 5, abs=1e-6)}
    # Lost or forgotten info is written again, with the renewal's time as its start.
    assert (await infos(store, ops))["pod-a"]["pid"] == 4242


async def test_a_consumer_holding_no_claims_still_renews_its_liveness(store: Store) -> None:
    ops = QueueOps(store, Q, consumer=identity("idle", ttl=3))
    now, codes = await ops.renew([], 300)
    assert codes == []
    assert await registry(store, ops) == {"idle": pytest.approx(now + 3, abs=1e-6)}
    assert await store.command("EXISTS", ops.keys.index) == 0
    # Without a consumer (the registry off) an empty renew sends nothing.
    assert await QueueOps(store, Q).renew([], 300) == (0.0, [])


async def test_renew_liveness_renews_the_entry_alone_in_one_script_call(store: Store) -> None:
    """The heartbeat's liveness tick: one ``renew`` script call with no claims; the
    leases are left alone, the entry goes to server time + TTL, lost info is written again
    with that time as its start."""
    calls: list[str] = []

    class Counting(StoreWrapper):
        async def run(self, script: Script, keys: Sequence[str], args: Sequence[Arg]) -> Any:
            calls.append(script.name)
            return await super().run(script, keys, args)

        async def run_many(self, script: Script, many: Sequence[ScriptCall]) -> list[Any]:
            calls.extend(script.name for _ in many)
            return await super().run_many(script, many)

    plain = QueueOps(store, Q)
    await claim_as(plain, "pod-a", ["r1"], ttl=10)
    before = await leases(store, plain)
    ops = QueueOps(Counting(store), Q, consumer=identity("pod-a", ttl=5))
    now = await ops.renew_liveness()
    assert now is not None
    assert calls == ["renew"]
    assert await leases(store, ops) == before
    assert await registry(store, ops) == {"pod-a": pytest.approx(now + 5, abs=1e-6)}
    info = (await infos(store, ops))["pod-a"]
    assert (info["pid"], info["started"]) == (4242, pytest.approx(now, abs=1e-3))  # JSON
    # Without a consumer (the registry off) nothing is sent.
    calls.clear()
    assert await QueueOps(Counting(store), Q).renew_liveness() is None
    assert calls == []


async def test_renew_brings_a_consumer_marked_dead_back(store: Store) -> None:
    ops = QueueOps(store, Q, consumer=identity("pod-a", ttl=10))
    await store.command("ZADD", ops.keys.consumers, -123.5, "pod-a")
    now, _ = await ops.renew([], 300)
    assert await registry(store, ops) == {"pod-a": pytest.approx(now + 10, abs=1e-6)}


# -- fast failover (docs/protocol.md#fast-failover) -----------------------------------------


async def test_expire_owners_cuts_only_the_dead_consumers_leases(store: Store) -> None:
    plain = QueueOps(store, Q)
    dead = QueueOps(store, Q, consumer=identity("dead"))
    live = QueueOps(store, Q, consumer=identity("live"))
    await dead.register()
    await live.register()
    await claim_as(plain, "dead", ["d1", "d2"])
    await claim_as(plain, "live", ["l1"])
    await claim_as(plain, None, ["old"])  # a claim from before consumer ids
    await claim_as(plain, "gone", ["g1"])  # a consumer with no registry entry
    before = await leases(store, plain)
    await store.command("ZADD", plain.keys.consumers, "XX", 1000.5, "dead")  # lapsed

    now, cut = await plain.expire_owners()
    assert cut == 2
    after = await leases(store, plain)
    assert after == {
        "d1": pytest.approx(now, abs=1e-6),
        "d2": pytest.approx(now, abs=1e-6),
        "l1": before["l1"],
        "old": before["old"],
        "g1": before["g1"],
    }
    # Marked dead (score negated), kept for `claimkit consumers`; the live one untouched.
    reg = await registry(store, plain)
    assert reg["dead"] == -1000.5
    assert reg["live"] > now
    # Handled once: a second cycle finds no lapsed consumer and writes nothing.
    assert (await plain.expire_owners())[1] == 0
    assert await leases(store, plain) == after

    # The reclaim that follows redelivers exactly the dead consumer's claims, as deliveries.
    counts = await plain.reclaim(max_deliveries=10)
    assert (counts.redelivered, counts.dead) == (2, 0)
    pending = {m for m, _ in await zrange(store, Q)}
    assert pending == {member("d1", FAR), member("d2", FAR)}
    deliveries = dict(pairs(await store.command("HGETALL", plain.keys.deliveries)))
    assert deliveries == {b"d1": b"1", b"d2": b"1"}
    assert set(await leases(store, plain)) == {"l1", "old", "g1"}


async def test_expire_owners_never_lengthens_a_lease(store: Store) -> None:
    plain = QueueOps(store, Q)
    await claim_as(plain, "dead", ["d1", "d2"])
    await store.command("ZADD", plain.keys.index, "XX", 5.0, "d1")  # already lapsed
    await store.command("ZADD", plain.keys.consumers, 1000.0, "dead")
    now, cut = await plain.expire_owners()
    assert cut == 1
    assert await leases(store, plain) == {"d1": 5.0, "d2": pytest.approx(now, abs=1e-6)}


async def test_expire_owners_walks_a_large_owners_hash_in_pages(store: Store) -> None:
    plain = QueueOps(store, Q)
    dead_ids = [f"d{i}" for i in range(700)]
    await claim_as(plain, "dead", dead_ids)
    await claim_as(plain, "live", [f"l{i}" for i in range(300)])
    await store.command("ZADD", plain.keys.consumers, 1000.0, "dead", FAR, "live")
    now, cut = await plain.expire_owners()
    assert cut == 700
    found = await leases(store, plain)
    assert {rid for rid, lease in found.items() if lease <= now + 1e-6} == set(dead_ids)
    assert (await registry(store, plain))["dead"] == -1000.0


async def test_a_release_is_no_delivery_but_a_death_is(store: Store) -> None:
    plain = QueueOps(store, Q)
    swept = await claim_as(plain, "pod-a", ["s1"])
    await claim_as(plain, "pod-b", ["k1"])
    assert await plain.release([("s1", swept[0], None)]) == [ReleaseCode.RELEASED]
    await store.command("ZADD", plain.keys.consumers, 1000.0, "pod-b")
    await plain.expire_owners()
    await plain.reclaim(max_deliveries=10)
    deliveries = dict(pairs(await store.command("HGETALL", plain.keys.deliveries)))
    assert deliveries == {b"k1": b"1"}  # the sweep's hand-back is not counted
    assert {m for m, _ in await zrange(store, Q)} == {member("s1", FAR), member("k1", FAR)}


async def test_max_deliveries_counts_deaths(store: Store) -> None:
    plain = QueueOps(store, Q)
    for _ in range(2):
        pending = await store.command("ZRANGE", Q, 0, -1)
        if pending:
            _, codes = await plain.claim([(envelope("x"), new_token("pod-a"))], 300)
            assert codes == [ClaimCode.CLAIMED]
        else:
            await claim_as(plain, "pod-a", ["x"])
        await store.command("ZADD", plain.keys.consumers, 1000.0, "pod-a")
        await plain.expire_owners()
        await plain.reclaim(max_deliveries=2)
    assert await store.command("ZCARD", plain.keys.dead) == 1  # the 2nd death: dead-lettered
    assert await store.command("ZCARD", Q) == 0


# -- forgetting and reading -----------------------------------------------------------------


async def test_forget_consumers_dead_only_or_named(store: Store) -> None:
    ops = QueueOps(store, Q)
    for cid in ("alive", "lapsed", "marked"):
        await QueueOps(store, Q, consumer=identity(cid)).register()
    await store.command("ZADD", ops.keys.consumers, "XX", 1000.0, "lapsed", -900.0, "marked")
    await store.command("HSET", ops.keys.consumer_info, "stray", "{}")
    gone = await forget_consumers(store, ops.keys)
    assert sorted(gone) == ["lapsed", "marked"]
    assert set(await registry(store, ops)) == {"alive"}
    assert set(await infos(store, ops)) == {"alive"}
    assert await forget_consumers(store, ops.keys, ["alive"]) == []  # alive: kept
    assert await forget_consumers(store, ops.keys, ["alive"], dead_only=False) == ["alive"]
    assert await store.command("EXISTS", ops.keys.consumers, ops.keys.consumer_info) == 0


async def test_forget_self_removes_only_its_own_entry(store: Store) -> None:
    a = QueueOps(store, Q, consumer=identity("a"))
    b = QueueOps(store, Q, consumer=identity("b"))
    await a.register()
    await b.register()
    assert await a.forget_self() is True
    assert await a.forget_self() is False
    assert set(await registry(store, a)) == {"b"}
    assert set(await infos(store, a)) == {"b"}


async def test_read_registry_names_each_consumers_claims(store: Store) -> None:
    plain = QueueOps(store, Q)
    await QueueOps(store, Q, consumer=identity("live", ttl=60)).register()
    await QueueOps(store, Q, consumer=identity("dead")).register()
    now = await server_now(store)
    await store.command("ZADD", plain.keys.consumers, "XX", -(now - 5), "dead")
    oldest = new_token("live", now=now - 42)
    await claim_as(plain, "live", ["l1", "l2"])
    await store.command("HSET", plain.keys.owners, "l2", oldest)
    await claim_as(plain, "dead", ["d1"])
    await claim_as(plain, "forgotten", ["f1"])
    await claim_as(plain, None, ["o1"])
    await store.command("HSET", plain.keys.owners, "x1", "not-ours")

    view = await read_registry(store, plain.keys)
    assert view.exact
    assert view.unknown_claims == 2
    assert view.unknown_oldest == pytest.approx(now, abs=5)
    by_id = {c.id: c for c in view.consumers}
    assert [c.id for c in view.consumers] == ["dead", "live", "forgotten"]
    live, dead, forgotten = by_id["live"], by_id["dead"], by_id["forgotten"]
    assert (live.claims, live.alive(view.server_now), live.marked_dead) == (2, True, False)
    assert live.oldest_claim == pytest.approx(now - 42, abs=1e-3)
    assert live.info["host"] == "host-live"
    assert (dead.claims, dead.alive(view.server_now), dead.marked_dead) == (1, False, True)
    assert dead.expires == pytest.approx(now - 5, abs=1e-3)
    assert (forgotten.claims, forgotten.expires, forgotten.info) == (1, None, {})
    assert not forgotten.alive(view.server_now)


def test_the_registry_keys_are_reserved_like_every_per_queue_key() -> None:
    from claimkit.protocol.keys import QueueKeys, is_reserved, key_slot, reserved_keys

    standalone = reserved_keys(["q"], "rs")
    assert {"q:consumers", "q:consumer-info"} <= standalone
    assert is_reserved("q:consumers", standalone)
    cluster = reserved_keys(["q"], "rs", cluster=True)
    assert {"{q}:consumers", "{q}:consumer-info"} <= cluster
    keys = QueueKeys.for_queue("q", cluster=True)
    assert key_slot(keys.consumers) == key_slot(keys.consumer_info) == key_slot("q")
