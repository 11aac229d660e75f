"""The claim protocol on a real Redis Cluster (docs/topology.md#cluster-key-layout): what
only the cluster layout has.

Every test compares the whole keyspace of every primary. Two layouts run throughout:
``untagged`` (queue ``q`` and result list ``results`` in different slots: every ack goes
through the outbox) and ``tagged`` (``{t}:q`` and ``{t}:results``: the one-script ack).
The scripts run under the shebang, so a node refuses any key a script does not declare or
keys of two slots: a script that broke the rule would fail its test with Redis's error.

The crash tests stop an ack between its steps (a raising hook, and a child process that
SIGKILLs itself there) and show that any other instance's reclaim finishes it: one record,
no second execution, nothing left in the outbox.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import pytest
import trio
from cluster import redis_cluster
from cluster_store import flushed_store, topology
from support import (
    StoreWrapper,
    make_config,
    markers,
    member,
    reopen,
    server_now,
    snapshot,
    wait_for,
)

from claimkit.consumer.consumer import Consumer
from claimkit.consumer.dispatch import Done, Retry
from claimkit.consumer.upkeep import Upkeep
from claimkit.producer import Producer, SubmitError
from claimkit.protocol.keys import QueueKeys, ResultKeys, key_slot, outbox_field, slot_key
from claimkit.protocol.models import (
    Envelope,
    ErrorCode,
    Invalid,
    TerminalRecord,
    parse_member,
    retry_member,
)
from claimkit.protocol.ops import AckItem, ClaimCode, QueueOps, new_token
from claimkit.store import StoreError, StoreUnavailable

if TYPE_CHECKING:
    from collections.abc import Sequence

    from cluster import RedisCluster

    from claimkit.store import Arg, ScriptCall, Store
    from claimkit.store.scripts import Script

__all__ = ["flushed_store", "redis_cluster"]

DEDUP = 100
TOKEN = "ab" * 16
LAYOUTS = [
    pytest.param(("q", "results"), id="untagged"),
    pytest.param(("{t}:q", "{t}:results"), id="tagged"),
]


class Recording(StoreWrapper):
    """Records every script call (name, keys) and every plain command's name."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.runs: list[tuple[str, list[str]]] = []
        self.commands: list[str] = []

    async def command(self, *args: Arg) -> Any:
        self.commands.append(str(args[0]).upper())
        return await self.inner.command(*args)

    async def pipeline(self, commands: Sequence[Sequence[Arg]], *, transaction: bool) -> list[Any]:
        assert not transaction, "no MULTI/EXEC in cluster mode"
        self.commands += [str(c[0]).upper() for c in commands]
        return await self.inner.pipeline(commands, transaction=transaction)

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[Arg]) -> Any:
        self.runs.append((script.name, list(keys)))
        return await self.inner.run(script, keys, args)

    async def run_many(self, script: Script, calls: Sequence[ScriptCall]) -> list[Any]:
        self.runs += [(script.name, list(keys)) for keys, _ in calls]
        return await self.inner.run_many(script, calls)

    def scripts(self) -> list[str]:
        return [name for name, _ in self.runs]


def envelope(raw: bytes) -> Envelope:
    parsed = parse_member(raw)
    assert isinstance(parsed, Envelope), parsed
    return parsed


async def claimed(
    ops: QueueOps, store: Store, rid: str, deadline: int, **internal: Any
) -> tuple[Envelope, str]:
    """``rid`` submitted by hand (its generation TOKEN) and claimed by ``ops``."""
    raw = member(rid, deadline, request_token=TOKEN, **internal)
    await store.command("ZADD", ops.queue, deadline, raw)
    token = new_token()
    _, codes = await ops.claim([(envelope(raw), token)], 60)
    assert codes == [ClaimCode.CLAIMED]
    return envelope(raw), token


def ack_item(env: Envelope, token: str, result_list: str, record: TerminalRecord) -> AckItem:
    return AckItem(env.id, token, env.request_token, result_list, record.to_json(), env.raw)


def test_the_two_layouts_are_what_they_say() -> None:
    assert key_slot("q") != key_slot("results")
    assert key_slot("{t}:q") == key_slot("{t}:results")


# -- every script, one slot per call -----------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_every_operation_keeps_each_script_call_in_one_slot(
    store: Store, layout: tuple[str, str]
) -> None:
    """Each operation once, on the cluster: every script call's keys share one slot (the
    node would refuse it otherwise, and the call would fail), and each operation calls the
    scripts the cluster layout gives it."""
    queue, results = layout
    with trio.fail_after(30):
        rec = Recording(store)
        ops = QueueOps(rec, queue, result_list=results, dedup_ttl=DEDUP)
        now = int(await server_now(store))

        bad = parse_member(b'{"request_kind":"plain","data":{"id":"bad","deadline":0}}')
        assert isinstance(bad, Invalid)
        await store.command("ZADD", queue, 1, bad.raw)
        assert await ops.dead_letter([bad]) == (1, 1)
        assert rec.scripts() == ["dead-letter-outbox", "push-result"]

        rec.runs.clear()
        rec.commands.clear()
        env, token = await claimed(ops, store, "c", now + 600)
        assert rec.scripts() == ["claim"]
        assert rec.commands[-1:] == ["MGET"]  # the cancel marker, read after the claim
        assert (await ops.claim([(env, token)], 60))[1] == [ClaimCode.NOT_PENDING]
        await store.command("SET", "request-cancel:c", TOKEN)

        rec.runs.clear()
        assert (await ops.renew([("c", token, now + 600)], 60))[1] == [1]
        assert await ops.release([("c", token, None)]) == [1]
        _, codes = await ops.claim([(env, token)], 60)
        assert codes == [ClaimCode.CANCELLED]  # read after the claim
        _, parked = await ops.park([("c", token, -1.0, retry_member(env.raw, queue))])
        assert parked == [1]
        assert await ops.move_retries() == (1, 0)
        assert rec.scripts() == [
            "renew",
            "release",
            "claim",
            "park",
            "move-retries-queue",
        ]

        rec.runs.clear()
        (raw,) = await ops.peek(1)
        env, token = envelope(raw), new_token()
        assert (await ops.claim([(env, token)], 60))[1] == [ClaimCode.CANCELLED]
        rec.runs.clear()
        record = TerminalRecord.error("c", ErrorCode.CANCELLED, "cancelled")
        assert await ops.ack([ack_item(env, token, results, record)]) == [(True, True)]
        tagged = key_slot(queue) == key_slot(results)
        assert rec.scripts() == (["ack-local"] if tagged else ["ack-outbox", "push-result"])

        rec.runs.clear()
        env2, token2 = await claimed(ops, store, "d", now + 600)
        await store.command("ZADD", ops.keys.index, "XX", 1, "d")
        counts = await ops.reclaim(max_deliveries=1)
        assert (counts.dead, counts.replayed) == (1, 1)
        assert rec.scripts() == ["claim", "reclaim-cluster", "push-result"]

        rec.runs.clear()
        await store.command("SET", "elsewhere", "a string")
        env3, token3 = await claimed(ops, store, "e", now + 600)
        other = QueueOps(rec, queue, dedup_ttl=DEDUP, default_result_list=results)
        item = ack_item(env3, token3, "elsewhere", TerminalRecord.http("e", 200, "x"))
        assert await other.ack([item]) == [(True, True)]
        assert "outbox-aim" in rec.scripts()

        for name, keys in rec.runs:
            assert len({key_slot(k) for k in keys}) == 1, (name, keys)
            if name != "push-result":
                assert key_slot(keys[0]) == key_slot(queue), name
        del token2, env2


async def test_the_cancel_markers_are_read_after_the_claim_across_slots(store: Store) -> None:
    """Four requests in four slots claimed in one call: their cancel markers are read with
    one MGET per slot in one pipeline, no script. Only a string holding the request's own
    generation cancels it: an older generation's token or a key of another type does not."""
    with trio.fail_after(30):
        rec = Recording(store)
        queue = "{q}:requests"
        ops = QueueOps(rec, queue, dedup_ttl=DEDUP)
        now = int(await server_now(store))
        ids = ["m1", "m2", "m3", "m4"]
        assert len({key_slot(f"request-cancel:{i}") for i in ids}) == 4
        await store.command("SET", "request-cancel:m1", TOKEN)  # this generation: cancelled
        await store.command("SET", "request-cancel:m2", "cd" * 16)  # an older one: not
        await store.command("HSET", "request-cancel:m3", TOKEN, TOKEN)  # not a string: not
        raws = [member(i, now + 600 + n, request_token=TOKEN) for n, i in enumerate(ids)]
        for n, raw in enumerate(raws):
            await store.command("ZADD", queue, now + 600 + n, raw)
        rec.commands.clear()
        _, codes = await ops.claim([(envelope(raw), new_token()) for raw in raws], 60)
        assert codes == [
            ClaimCode.CANCELLED,
            ClaimCode.CLAIMED,
            ClaimCode.CLAIMED,
            ClaimCode.CLAIMED,
        ]
        assert rec.scripts() == ["claim"]
        assert rec.commands == ["MGET"] * 4


# -- ack: the one-script path and the outbox ---------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_ack_pushes_once_and_leaves_nothing_behind(
    store: Store, layout: tuple[str, str]
) -> None:
    queue, results = layout
    with trio.fail_after(10):
        rec = Recording(store)
        ops = QueueOps(rec, queue, result_list=results, dedup_ttl=DEDUP)
        now = int(await server_now(store))
        env, token = await claimed(ops, store, "r1", now + 600)
        await store.command("HSET", ops.keys.deliveries, "r1", 2)
        record = TerminalRecord.http("r1", 200, '{"ok":true}')
        rec.runs.clear()
        rec.commands.clear()

        assert await ops.ack([ack_item(env, token, results, record)]) == [(True, True)]
        expected = {
            results: [record.to_json()],
            **markers(store, ("r1", TOKEN, DEDUP), result_list=results),
        }
        assert await snapshot(store) == expected
        if key_slot(queue) == key_slot(results):
            assert (rec.scripts(), rec.commands) == (["ack-local"], [])
        else:
            assert (rec.scripts(), rec.commands) == (["ack-outbox", "push-result"], ["HDEL"])

        # The same ack again (a retry after a lost reply): suppressed, nothing written.
        assert await ops.ack([ack_item(env, token, results, record)]) == [(False, False)]
        assert await snapshot(store) == expected


async def test_an_ack_batch_splits_by_slot(store: Store) -> None:
    """One batch with records for a list in the queue's slot and for one elsewhere: the
    first in one script, the others through the outbox; each pushed once."""
    with trio.fail_after(10):
        rec = Recording(store)
        ops = QueueOps(rec, "{t}:q", dedup_ttl=DEDUP)
        now = int(await server_now(store))
        a = await claimed(ops, store, "a", now + 600)
        b = await claimed(ops, store, "b", now + 600)
        c = await claimed(ops, store, "c", now + 600)
        records = [TerminalRecord.http(r, 200, r) for r in "abc"]
        lists = ["{t}:results", "results", "{t}:results"]
        rec.runs.clear()
        items = [
            ack_item(env, tok, lst, r)
            for (env, tok), lst, r in zip([a, b, c], lists, records, strict=True)
        ]
        assert await ops.ack(items) == [(True, True)] * 3
        assert rec.scripts() == ["ack-local", "ack-outbox", "push-result"]
        assert await snapshot(store) == {
            "{t}:results": [records[2].to_json(), records[0].to_json()],
            "results": [records[1].to_json()],
            **markers(store, ("a", TOKEN, DEDUP), ("c", TOKEN, DEDUP), result_list="{t}:results"),
            **markers(store, ("b", TOKEN, DEDUP), result_list="results"),
        }


class Crash(Exception):
    """The process stops here (a test's stand-in for a SIGKILL between two steps)."""


def crash_at(step: int) -> Any:
    async def hook(at: int) -> None:
        if at == step:
            raise Crash(f"stopped after step {at}")

    return hook


@pytest.mark.parametrize("step", [1, 2])
async def test_a_crash_between_the_steps_of_an_ack_loses_nothing_and_runs_nothing_twice(
    store: Store, step: int
) -> None:
    """Stopped after step 1 (the claim is in the outbox) or step 2 (its record is pushed,
    the outbox field not yet deleted): another instance's reclaim finishes it with exactly
    one record; the request is claimed by nobody and pending nowhere, so it never runs
    again; the outbox is empty."""
    with trio.fail_after(20):
        dying = QueueOps(store, "q", dedup_ttl=DEDUP, _after_outbox_step=crash_at(step))
        now = int(await server_now(store))
        env, token = await claimed(dying, store, "r1", now + 600)
        record = TerminalRecord.http("r1", 200, "done")
        with pytest.raises(Crash):
            await dying.ack([ack_item(env, token, "results", record)])

        k = QueueKeys.for_queue("q", cluster=True)
        assert k.outbox is not None
        entry = {"list": "results", "request_token": TOKEN, "id": "r1"}
        state = await snapshot(store)
        ((field, raw),) = state.pop(k.outbox).items()
        assert field == outbox_field("r1", token).encode()
        assert json.loads(raw) == {**entry, "record": record.to_json().decode()}
        pushed = {
            "results": [record.to_json()],
            **markers(store, ("r1", TOKEN, DEDUP), result_list="results"),
        }
        assert state == (pushed if step == 2 else {})  # the claim is gone either way

        async with reopen(store) as other_store:
            other = QueueOps(other_store, "q", dedup_ttl=DEDUP)
            counts = await other.reclaim(max_deliveries=10)
            assert (counts.redelivered, counts.replayed) == (0, 1)
            assert await snapshot(store) == pushed
            # Nothing can run it again: not pending, not claimed, no lease to lapse.
            assert (await other.claim([(env, new_token())], 60))[1] == [ClaimCode.NOT_PENDING]
            await store.command("ZADD", k.index, 1, "x")  # any expired lease: none is r1
            assert (await other.reclaim(max_deliveries=10)).replayed == 0
            await store.command("DEL", k.index)
            assert await snapshot(store) == pushed


CHILD = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import trio
from claimkit.protocol.models import TerminalRecord, parse_member
from claimkit.protocol.ops import AckItem, QueueOps
from claimkit.store import Topology, open_store

async def kill(at):
    if at == {step}:
        os.kill(os.getpid(), signal.SIGKILL)

async def main():
    topo = Topology(mode="cluster", addrs={addrs!r})
    async with open_store({url!r}, topology=topo) as store:
        ops = QueueOps(store, "q", dedup_ttl={dedup}, _after_outbox_step=kill)
        (raw,) = await ops.peek(1)
        env = parse_member(raw)
        _, codes = await ops.claim([(env, {token!r})], 60)
        assert list(codes) == [1], codes
        record = TerminalRecord.http(env.id, 200, "done").to_json()
        await ops.ack([AckItem(env.id, {token!r}, env.request_token, "results", record, raw)])
    sys.exit(3)  # not reached: killed at the step

trio.run(main)
"""


@pytest.mark.parametrize("step", [1, 2])
async def test_an_ack_killed_between_its_steps_is_finished_by_another_process(
    store: Store, redis_cluster: RedisCluster, step: int
) -> None:
    """A real SIGKILL of the acking process between step 1 and 2, or 2 and 3."""
    with trio.fail_after(60):
        now = int(await server_now(store))
        raw = member("r1", now + 600, request_token=TOKEN)
        await store.command("ZADD", "q", now + 600, raw)
        token = new_token()
        code = CHILD.format(
            tests=str(Path(__file__).parent),
            step=step,
            addrs=topology(redis_cluster).addrs,
            url=redis_cluster.url,
            dedup=DEDUP,
            token=token,
        )
        child = await trio.run_process(
            [sys.executable, "-c", code], check=False, capture_stderr=True
        )
        assert child.returncode == -signal.SIGKILL, child.stderr.decode()
        k = QueueKeys.for_queue("q", cluster=True)
        assert k.outbox is not None
        assert list((await snapshot(store))[k.outbox]) == [outbox_field("r1", token).encode()]

        ops = QueueOps(store, "q", dedup_ttl=DEDUP)
        assert (await ops.reclaim(max_deliveries=10)).replayed == 1
        record = TerminalRecord.http("r1", 200, "done").to_json()
        assert await snapshot(store) == {
            "results": [record],
            **markers(store, ("r1", TOKEN, DEDUP), result_list="results"),
        }
        assert (await ops.claim([(envelope(raw), new_token())], 60))[1] == [ClaimCode.NOT_PENDING]


class LostOnce(StoreWrapper):
    """Fails one call of an ack across slots once with ``StoreUnavailable``, as a primary
    SIGKILLed mid-call does: ``"push"`` before the push is sent, ``"push-applied"`` after
    it ran (its reply lost), ``"drop"`` the ``HDEL`` of step 3 before it is sent."""

    def __init__(self, inner: Store, where: str) -> None:
        super().__init__(inner)
        self.where = where
        self.failed = 0

    def _fails(self, where: str) -> bool:
        if self.where != where or self.failed:
            return False
        self.failed += 1
        return True

    async def command(self, *args: Arg) -> Any:
        if str(args[0]).upper() == "HDEL" and self._fails("drop"):
            raise StoreUnavailable("Connection lost while sending")
        return await self.inner.command(*args)

    async def run_many(self, script: Script, calls: Sequence[ScriptCall]) -> list[Any]:
        if script.name != "push-result":
            return await self.inner.run_many(script, calls)
        if self._fails("push"):
            raise StoreUnavailable("Connection lost while sending")
        reply = await self.inner.run_many(script, calls)
        if self._fails("push-applied"):
            raise StoreUnavailable("Connection lost while receiving response")
        return reply


@pytest.mark.parametrize("where", ["push", "push-applied", "drop"])
async def test_an_unavailable_push_step_acks_and_leaves_the_record_for_the_replay(
    store: Store, where: str
) -> None:
    """Step 1 has moved the claim, then the list's slot fails (step 2 unsent, step 2 run
    with its reply lost, or step 3 unsent): the ack answers acked by its owner, not an
    error to retry (a retry would report the request's own push as a duplicate, or the
    entry a replay finished as not ours). The entry waits in the outbox; a reclaim pushes
    the record once (or finds it there) and empties the outbox."""
    with trio.fail_after(20):
        failing = LostOnce(store, where)
        ops = QueueOps(failing, "q", dedup_ttl=DEDUP)
        now = int(await server_now(store))
        env, token = await claimed(ops, store, "r1", now + 600)
        await store.command("HSET", ops.keys.deliveries, "r1", 1)
        record = TerminalRecord.http("r1", 200, "done")

        assert await ops.ack([ack_item(env, token, "results", record)]) == [(True, True)]
        assert failing.failed == 1
        k = ops.keys
        assert k.outbox is not None
        pushed = {
            "results": [record.to_json()],
            **markers(store, ("r1", TOKEN, DEDUP), result_list="results"),
        }
        state = await snapshot(store)
        ((field, raw),) = state.pop(k.outbox).items()
        assert field == outbox_field("r1", token).encode()
        assert json.loads(raw) == {
            "list": "results",
            "request_token": TOKEN,
            "id": "r1",
            "record": record.to_json().decode(),
        }
        assert state == ({} if where == "push" else pushed)  # claimed by nobody either way

        assert await ops.replay_outbox() == (1, 1 if where == "push" else 0)
        assert await snapshot(store) == pushed
        assert (await ops.claim([(env, new_token())], 60))[1] == [ClaimCode.NOT_PENDING]


async def test_an_ack_whose_move_reply_was_lost_is_its_owners_on_retry(store: Store) -> None:
    """Step 1 ran but its reply was lost, and the caller retries the ack: "already in the
    outbox" is the owner's own ack (owned), and its push reports pushed."""
    with trio.fail_after(20):
        ops = QueueOps(store, "q", dedup_ttl=DEDUP, _after_outbox_step=crash_at(1))
        now = int(await server_now(store))
        env, token = await claimed(ops, store, "r1", now + 600)
        record = TerminalRecord.http("r1", 200, "done")
        item = ack_item(env, token, "results", record)
        with pytest.raises(Crash):
            await ops.ack([item])
        ops._after_outbox_step = None
        assert await ops.ack([item]) == [(True, True)]
        assert await snapshot(store) == {
            "results": [record.to_json()],
            **markers(store, ("r1", TOKEN, DEDUP), result_list="results"),
        }


class MoveReplyLost(StoreWrapper):
    """Step 1 of the first ack runs, then its reply is lost (``StoreUnavailable``)."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.lost = False

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[Arg]) -> Any:
        reply = await self.inner.run(script, keys, args)
        if script.name == "ack-outbox" and not self.lost:
            self.lost = True
            raise StoreUnavailable("Connection lost while receiving response")
        return reply


async def test_a_retried_ack_whose_entry_a_replay_finished_is_its_owners(store: Store) -> None:
    """Step 1's reply is lost, a reclaim replays the entry, then the caller retries the
    ack: its step 1 finds neither claim nor entry, and as this QueueOps sent that step it
    answers acked by the owner; the same ack from another QueueOps (one that never sent
    it) is a suppressed duplicate, not ours. One record, nothing else left."""
    with trio.fail_after(20):
        ops = QueueOps(MoveReplyLost(store), "q", dedup_ttl=DEDUP)
        now = int(await server_now(store))
        env, token = await claimed(ops, store, "r1", now + 600)
        record = TerminalRecord.http("r1", 200, "done")
        item = ack_item(env, token, "results", record)
        with pytest.raises(StoreUnavailable):
            await ops.ack([item])
        assert (await QueueOps(store, "q", dedup_ttl=DEDUP).reclaim(10)).replayed == 1
        pushed = {
            "results": [record.to_json()],
            **markers(store, ("r1", TOKEN, DEDUP), result_list="results"),
        }
        assert await snapshot(store) == pushed
        assert await QueueOps(store, "q", dedup_ttl=DEDUP).ack([item]) == [(False, False)]
        assert await ops.ack([item]) == [(True, True)]
        assert await ops.ack([item]) == [(False, False)]  # answered once: forgotten
        assert await snapshot(store) == pushed


# -- a destination of another type -------------------------------------------------------------


@pytest.mark.parametrize(
    ("queue", "aimed"),
    [
        pytest.param("q", "elsewhere", id="untagged"),
        pytest.param("{t}:q", "{t}:results", id="tagged"),
    ],
)
async def test_a_list_of_another_type_sends_the_record_to_the_fallback(
    store: Store, queue: str, aimed: str
) -> None:
    """The member names a list that holds a string: the record goes to the fallback list
    (the global one here, in another slot), under the fallback's markers; the string is
    untouched and the outbox ends empty."""
    with trio.fail_after(10):
        rec = Recording(store)
        ops = QueueOps(rec, queue, dedup_ttl=DEDUP, default_result_list="fallback")
        await store.command("SET", aimed, "not a list")
        now = int(await server_now(store))
        env, token = await claimed(ops, store, "w", now + 600, result_queue_name=aimed)
        assert ops.result_list_for(env.result_queue_name) == aimed
        record = TerminalRecord.http("w", 200, "x")
        rec.runs.clear()
        assert await ops.ack([ack_item(env, token, aimed, record)]) == [(True, True)]
        assert await snapshot(store) == {
            aimed: (b"not a list", -1),
            "fallback": [record.to_json()],
            **markers(store, ("w", TOKEN, DEDUP), result_list="fallback"),
        }
        if key_slot(queue) == key_slot(aimed):  # moved to the outbox by the one script
            assert rec.scripts() == ["ack-local", "push-result"]
        else:  # the push step says unusable; the entry is re-aimed, then pushed
            assert rec.scripts() == ["ack-outbox", "push-result", "outbox-aim", "push-result"]


async def test_a_fallback_of_another_type_keeps_the_record_in_the_outbox(store: Store) -> None:
    """The last resort holds another type: the push fails with WRONGTYPE, writing nothing;
    the record waits in the outbox (the claim is gone: it runs nowhere) until the key is
    fixed, and the next reclaim pushes it."""
    with trio.fail_after(10):
        ops = QueueOps(store, "q", result_list="results", dedup_ttl=DEDUP)
        await store.command("SET", "results", "not a list")
        now = int(await server_now(store))
        env, token = await claimed(ops, store, "f", now + 600)
        record = TerminalRecord.http("f", 200, "x")
        with pytest.raises(StoreError, match="wrong kind of value"):
            await ops.ack([ack_item(env, token, "results", record)])
        state = await snapshot(store)
        assert set(state) == {"results", ops.keys.outbox}
        with pytest.raises(StoreError, match="wrong kind of value"):
            await ops.reclaim(max_deliveries=10)
        await store.command("DEL", "results")
        assert (await ops.reclaim(max_deliveries=10)).replayed == 1
        assert await snapshot(store) == {
            "results": [record.to_json()],
            **markers(store, ("f", TOKEN, DEDUP), result_list="results"),
        }


async def test_a_one_slot_fallback_of_another_type_fails_before_any_write(store: Store) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, "{t}:q", result_list="{t}:results", dedup_ttl=DEDUP)
        await store.command("SET", "{t}:results", "not a list")
        now = int(await server_now(store))
        env, token = await claimed(ops, store, "f", now + 600)
        before = await snapshot(store)
        with pytest.raises(StoreError, match="wrong kind of value"):
            await ops.ack([ack_item(env, token, "{t}:results", TerminalRecord.http("f", 200, "x"))])
        assert await snapshot(store) == before  # the claim is still held, to be retried


async def test_marker_keys_of_another_type_make_the_list_unusable(store: Store) -> None:
    """``{L}:result-terminal`` holding a list (someone pushed records to that name): the
    records of ``L`` go to the fallback rather than overwrite that key."""
    with trio.fail_after(10):
        ops = QueueOps(store, "q", dedup_ttl=DEDUP, default_result_list="fallback")
        marker = ResultKeys.for_list("mine").terminal
        await store.command("RPUSH", marker, "somebody's record")
        now = int(await server_now(store))
        env, token = await claimed(ops, store, "m", now + 600, result_queue_name="mine")
        record = TerminalRecord.http("m", 200, "x")
        assert await ops.ack([ack_item(env, token, "mine", record)]) == [(True, True)]
        assert await snapshot(store) == {
            marker: [b"somebody's record"],
            "fallback": [record.to_json()],
            **markers(store, ("m", TOKEN, DEDUP), result_list="fallback"),
        }


# -- dedup markers: expiry on the server clock, bounded cleanup --------------------------------


async def test_an_expired_marker_is_absent_and_pushes_sweep_100_expired(store: Store) -> None:
    with trio.fail_after(20):
        ops = QueueOps(store, "q", result_list="results", dedup_ttl=DEDUP)
        r = ResultKeys.for_list("results")
        # 150 markers that expired long ago, one of them this generation's own.
        ids = ["r1", *(f"old-{i:03d}" for i in range(149))]
        hset: list[Arg] = []
        zadd: list[Arg] = []
        for n, rid in enumerate(ids):
            hset += [rid, TOKEN]
            zadd += [n + 1, rid]
        await store.command("HSET", r.terminal, *hset)
        await store.command("ZADD", r.expiry, *zadd)
        now = int(await server_now(store))
        env, token = await claimed(ops, store, "r1", now + 600)
        record = TerminalRecord.http("r1", 200, "again")
        assert await ops.ack([ack_item(env, token, "results", record)]) == [(True, True)]
        state = await snapshot(store)
        assert state["results"] == [record.to_json()]
        # The 100 oldest went (r1 among them); r1's new marker is in; 50 stale ones wait.
        left = [f"old-{i:03d}".encode() for i in range(99, 149)]
        assert set(state[r.terminal]) == {b"r1", *left}
        assert [m for m, _ in state[r.expiry]] == [*left, b"r1"]
        assert state[r.expiry][-1][1] == pytest.approx(now + DEDUP, abs=5)


async def test_a_live_marker_of_the_generation_suppresses_the_record(store: Store) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, "q", result_list="results", dedup_ttl=0)
        r = ResultKeys.for_list("results")
        await store.command("HSET", r.terminal, "r1", TOKEN)
        now = int(await server_now(store))
        env, token = await claimed(ops, store, "r1", now + 600)
        assert await ops.ack(
            [ack_item(env, token, "results", TerminalRecord.http("r1", 200, "x"))]
        ) == [(False, True)]
        assert await snapshot(store) == {r.terminal: {b"r1": TOKEN.encode()}}


# -- retries: one set per queue, one mover per queue -------------------------------------------


async def test_the_consumer_moves_the_retries_of_every_queue(store: Store) -> None:
    """Upkeep.retry_mover on a cluster: one mover per queue, each on the queue's own set."""
    with trio.fail_after(20):
        queues = [SimpleNamespace(ops=QueueOps(store, name)) for name in ("qa", "qb")]
        assert [q.ops.retry_set for q in queues] == [
            "{qa}:retry-sortedset",
            "{qb}:retry-sortedset",
        ]
        now = int(await server_now(store))
        parked = {}
        for q in queues:
            env, token = await claimed(q.ops, store, "r", now + 600)
            retry = retry_member(env.raw, q.ops.queue)
            assert (await q.ops.park([("r", token, -1.0, retry)]))[1] == [1]
            parked[q.ops.queue] = retry
        config = SimpleNamespace(poll_interval_ms=20)
        clock = SimpleNamespace(now=lambda: float(now))
        upkeep = Upkeep(config, queues, SimpleNamespace(), clock)  # type: ignore[arg-type]

        async def both_back() -> bool:
            scores = [await store.command("ZSCORE", name, raw) for name, raw in parked.items()]
            return None not in scores

        async with trio.open_nursery() as nursery:
            nursery.start_soon(upkeep.retry_mover)
            await wait_for(both_back, "both queues' retries back in their queues")
            nursery.cancel_scope.cancel()
        assert await snapshot(store) == {
            name: [(raw, float(now + 600))] for name, raw in parked.items()
        }


# -- the producer: no MULTI across slots -------------------------------------------------------


async def test_submit_writes_cancel_active_then_the_queue_without_multi(store: Store) -> None:
    with trio.fail_after(10):
        rec = Recording(store)
        await store.command("SET", "request-cancel:a", "old")
        now = int(await server_now(store))
        tokens = await Producer(rec, "q").submit_many(
            [{"id": "a", "deadline": now + 600}, {"id": "b", "deadline": now + 700}]
        )
        assert rec.commands == ["TIME", "TYPE", "DEL", "DEL", "SET", "SET"]
        # Then one enqueue call per deadline, on the queue and its counter (one slot).
        assert rec.runs == [
            ("enqueue", ["q", f"request-seq:{{q}}:{now + 600}"]),
            ("enqueue", ["q", f"request-seq:{{q}}:{now + 700}"]),
        ]
        state = await snapshot(store)
        assert {k: v[0] for k, v in state.items() if k.startswith("request-")} == {
            "request-active:a": tokens[0].encode(),
            "request-active:b": tokens[1].encode(),
            f"request-seq:{{q}}:{now + 600}": b"1",
            f"request-seq:{{q}}:{now + 700}": b"1",
        }
        assert [json.loads(m)["data"]["id"] for m, _ in state["q"]] == ["a", "b"]


async def test_cancel_reads_the_marker_of_the_producers_list(store: Store) -> None:
    with trio.fail_after(10):
        producer = Producer(store, "q", result_list="results")
        now = int(await server_now(store))
        (token,) = await producer.submit_many([{"id": "a", "deadline": now + 600}])
        r = ResultKeys.for_list("results")
        await store.command("HSET", r.terminal, "a", token)
        assert not await producer.cancel("a")  # finished: its record is there
        await store.command("ZADD", r.expiry, 1, "a")  # ... but that marker expired
        assert await producer.cancel("a")
        assert await store.command("GET", "request-cancel:a") == token.encode()
        await store.command("DEL", r.expiry)
        await store.command("SET", r.expiry, "x")
        with pytest.raises(SubmitError, match=r"holds a string, not a sorted set: 'a' was not"):
            await producer.cancel("a")


# -- the key layout of claims and queues ---------------------------------------------------


async def test_untagged_claim_keys_share_the_queues_slot(store: Store) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, "q")
        now = int(await server_now(store))
        env, token = await claimed(ops, store, "r", now + 600)
        state = await snapshot(store)
        assert set(state) == {"{q}:claimed", "{q}:claim-owners", "{q}:claims-idx"}
        assert {key_slot(k) for k in state} == {key_slot("q")} == {key_slot(slot_key("q"))}
        assert state["{q}:claim-owners"] == {b"r": token.encode()}
        del env


# -- the consumer on a cluster -----------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_a_consumer_serves_a_cluster_queue_with_one_record_each(
    store: Store, redis_cluster: RedisCluster, layout: tuple[str, str]
) -> None:
    """``Consumer`` on the cluster store: requests submitted by the producer, one of them
    cancelled, one retried once (parked in the queue's own retry set, moved back by the
    consumer's mover): one record each in the list, nothing claimed, parked or in the
    outbox at the end."""
    queue, results = layout
    with trio.fail_after(60):
        producer = Producer(store, queue, result_list=results)
        now = int(await server_now(store))
        ids = [f"r{i}" for i in range(12)]
        await producer.submit_many([{"id": rid, "deadline": now + 600} for rid in ids])
        assert await producer.cancel("r3")
        tries: dict[str, int] = {}

        async def handler(q: Any, env: Envelope, server: float) -> Any:
            tries[env.id] = tries.get(env.id, 0) + 1
            if env.id == "r5" and tries[env.id] == 1:
                return Retry(0.05, TerminalRecord.http(env.id, 503, "busy"))
            return Done(TerminalRecord.http(env.id, 200, f"ok {env.id}"))

        config = make_config(
            redis_cluster.url,
            queue=queue,
            mode="cluster",
            result_queue_name=results,
            poll_interval_ms=20,
            metrics_port=0,
            health_port=0,
        )
        consumer = Consumer(config, store, handler=handler)

        async def all_recorded() -> bool:
            return int(await store.command("LLEN", results)) >= len(ids)

        async with trio.open_nursery() as nursery:
            await nursery.start(consumer.run)
            await wait_for(all_recorded, "a record for every request")
            consumer.request_stop()
        records = [json.loads(r) for r in await store.command("LRANGE", results, 0, -1)]
        assert sorted(r["id"] for r in records) == sorted(ids)
        (cancelled,) = [r for r in records if r["id"] == "r3"]
        assert cancelled["error_code"] == "CANCELLED"
        assert tries == {rid: (2 if rid == "r5" else 1) for rid in ids if rid != "r3"}
        k = QueueKeys.for_queue(queue, cluster=True)
        state = await snapshot(store)
        assert not {k.pending, k.claimed, k.owners, k.index, k.outbox, k.retry_set} & set(state)
        s = consumer.summary
        assert (s.claimed, s.acked, s.retried, s.duplicates_suppressed) == (13, 12, 1, 0)


class StalledAck(StoreWrapper):
    """Holds one call of the first ack across slots until a heartbeat has renewed the
    claims after step 1 moved them, then fails it with ``StoreUnavailable``: ``"push"``
    the push step (not sent; the record waits in the outbox), ``"move"`` step 1 itself
    after it ran (its reply lost; the acker retries the ack)."""

    def __init__(self, inner: Store, where: str) -> None:
        super().__init__(inner)
        self.where = where
        self.stalled = False
        self.renewed = trio.Event()

    async def _stall(self) -> None:
        self.stalled = True
        await self.renewed.wait()
        if self.where == "move":  # the consumer's reclaimer finishes the entries meanwhile

            async def replayed() -> bool:
                return int(await self.inner.command("HLEN", "{chat}:outbox")) == 0

            await wait_for(replayed, "the outbox replayed")
        raise StoreUnavailable("Connection lost while receiving response")

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[Arg]) -> Any:
        reply = await self.inner.run(script, keys, args)
        if script.name == "ack-outbox" and self.where == "move" and not self.stalled:
            await self._stall()
        return reply

    async def run_many(self, script: Script, calls: Sequence[ScriptCall]) -> list[Any]:
        if script.name == "push-result" and self.where == "push" and not self.stalled:
            await self._stall()
        armed = script.name == "renew" and self.stalled
        reply = await self.inner.run_many(script, calls)
        if armed:
            self.renewed.set()
        return reply


@pytest.mark.parametrize("where", ["push", "move"])
async def test_a_heartbeat_during_an_ack_across_slots_counts_nothing_released(
    store: Store,
    redis_cluster: RedisCluster,
    where: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The result list's primary dies while acks are in flight: a heartbeat renews the
    claims step 1 has already moved into the outbox (no claim is left to renew), then the
    push fails (``push``: the records wait in the outbox) or step 1's reply is lost
    (``move``: the consumer's reclaimer replays the outbox, then the acker retries and
    finds neither claim nor entry). No claim is "released
    elsewhere": each is acked once, by its owner; one record each; the outbox and the
    claim keys end empty."""
    with trio.fail_after(60):
        stalled = StalledAck(store, where)
        producer = Producer(store, "chat", result_list="res")
        now = int(await server_now(store))
        ids = [f"g{i}" for i in range(5)]
        await producer.submit_many([{"id": rid, "deadline": now + 600} for rid in ids])
        release = trio.Event()

        async def handler(q: Any, env: Envelope, server: float) -> Any:
            await release.wait()  # all five acked in one batch
            return Done(TerminalRecord.http(env.id, 200, f"ok {env.id}"))

        config = make_config(
            redis_cluster.url,
            queue="chat",
            mode="cluster",
            result_queue_name="res",
            poll_interval_ms=20,
            claim_lease_ttl_seconds=3,  # a heartbeat each second
            claim_reclaim_interval_ms=100,
            metrics_port=0,
            health_port=0,
        )
        consumer = Consumer(config, stalled, handler=handler)
        k = QueueKeys.for_queue("chat", cluster=True)

        async def all_claimed() -> bool:
            return int(await store.command("HLEN", k.owners)) == len(ids)

        async def all_recorded() -> bool:
            state = await snapshot(store)
            return len(state.get("res", [])) == len(ids) and k.outbox not in state

        with caplog.at_level(logging.WARNING, logger="claimkit"):
            async with trio.open_nursery() as nursery:
                await nursery.start(consumer.run)
                await wait_for(all_claimed, "every request claimed")
                release.set()
                await wait_for(all_recorded, "a record for every request, the outbox empty")
                consumer.request_stop()
        assert stalled.renewed.is_set()
        records = [json.loads(r) for r in await store.command("LRANGE", "res", 0, -1)]
        assert sorted(r["id"] for r in records) == ids
        state = await snapshot(store)
        assert not {k.pending, k.claimed, k.owners, k.index, k.deliveries, k.outbox} & set(state)
        s = consumer.summary
        counts = (s.claimed, s.acked, s.duplicates_suppressed, s.released_elsewhere)
        assert counts == (5, 5, 0, 0)
        assert (s.taken_over, s.released, s.left_to_lapse, s.redelivered) == (0, 0, 0, 0)
        warnings = [r.getMessage() for r in caplog.records if r.name == "claimkit"]
        assert not [m for m in warnings if "released elsewhere" in m or "claim on" in m]
