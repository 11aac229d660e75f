"""The chaos harness in the suite: a short fixed-seed run, and the faults it found.

``test_short_chaos_run`` runs ``bench/chaos.py`` (a private AOF Redis, the simulator, two
``claimkit serve`` processes, every fault kind once) and requires its invariants: no lost
request, no duplicate record, every request in exactly one place at every sample, poll
batches in deadline order, redelivery within its bound.

The other tests pin down, in-process and deterministically, each fault a chaos run found
(see docs/reliability.md):

- a poll batch was dispatched in reverse order about half the time (trio runs tasks
  started together in either order);
- a stalled owner's late result was recorded while another consumer held the request
  (or had parked it for a retry): the request was then both recorded and claimed, and ran
  again;
- a claim whose ack Redis refused (out of memory) stayed in the consumer's registry,
  renewed by every heartbeat with nothing behind it: the request never ended.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import trio
from support import make_config

from claimkit.consumer.consumer import Consumer, QueueRuntime
from claimkit.consumer.dispatch import Done, Outcome
from claimkit.producer import Producer
from claimkit.protocol.models import Envelope, TerminalRecord, parse_member
from claimkit.protocol.ops import QueueOps, new_token
from claimkit.store import Store, open_store

if TYPE_CHECKING:
    from claimkit.config import Config

CHAOS = Path(__file__).resolve().parent.parent / "bench" / "chaos.py"
Q = "requests"


def config(redis_url: str, **overrides: Any) -> Config:
    fields = {
        "poll_interval_ms": 20,
        "metrics_port": 0,
        "health_port": 0,
        "drain_timeout_seconds": 1,
    }
    return make_config(redis_url, queue=Q, **fields | overrides)


@pytest.mark.slow
def test_short_chaos_run(tmp_path: Path) -> None:
    report = tmp_path / "chaos.json"
    args = [
        sys.executable, str(CHAOS), "--seed", "11", "--requests", "400", "--duration", "20",
        "--consumers", "2", "--every-kind", "--fault-gap", "0.5,1.5", "--json", str(report),
    ]  # fmt: skip
    # Its work dir (kept when a run fails or aborts) goes under tmp_path, not the system's.
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run(args, capture_output=True, text=True, timeout=240, check=False, env=env)
    assert done.returncode == 0, done.stdout + done.stderr[-6000:]
    (line,) = done.stdout.splitlines()
    assert re.search(r" lost=0 duplicates=0 phantom=0 location_violations=0/\d+", line), line
    assert line.endswith("PASS"), line
    figures = json.loads(report.read_text())
    # Every submit is accounted for: accepted, or refused during a Redis fault (how many fall
    # into a fault window depends on the machine's load, so only a floor is asserted).
    assert figures["accepted"] + figures["uncertain_not_accepted"] == 400
    assert figures["accepted"] >= 200
    assert figures["records"] == figures["accepted"]
    assert set(figures["faults_by_kind"]) >= {
        "kill",
        "stop",
        "clientkill",
        "redis",
        "term",
        "start",
    }
    assert figures["poll_batches"] > 0
    assert figures["snapshots"] > 10


async def test_a_poll_batch_is_dispatched_in_deadline_order(store: Store, redis_url: str) -> None:
    """Ten batches of ten: each handler call must come in deadline order. Before the fix
    trio started a batch's workers in reverse order about half the time."""
    seen: list[int] = []
    all_done = trio.Event()

    async def handler(q: QueueRuntime, env: Envelope, now: float) -> Outcome:
        seen.append(env.deadline)
        if len(seen) == 100:
            all_done.set()
        await trio.sleep(0.01)
        return Done(TerminalRecord.http(env.id, 200, "ok"))

    with trio.fail_after(20):
        now = int(time.time())
        await Producer(store, Q).submit_many(
            [{"id": f"r{i:03d}", "deadline": now + 1000 + i} for i in reversed(range(100))]
        )
        consumer = Consumer(
            config(redis_url, batch_size=10, concurrency=100), store, handler=handler
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(consumer.run)
            await all_done.wait()
            consumer.request_stop()
    assert seen == sorted(seen)


async def test_a_stalled_owners_late_result_is_suppressed(store: Store, redis_url: str) -> None:
    """The owner stalls past its lease (SIGSTOP, a long GC pause), another instance takes
    the request; the owner's late result must not be recorded beside the live claim."""
    stalled = trio.Event()
    resume = trio.Event()

    async def slow(q: QueueRuntime, env: Envelope, now: float) -> Outcome:
        stalled.set()
        await resume.wait()
        return Done(TerminalRecord.http(env.id, 200, "late"))

    with trio.fail_after(20):
        await Producer(store, Q).submit({"id": "s1", "deadline": int(time.time()) + 600})
        # A long lease: the heartbeat (every 30 s) does not run during the test, so it is
        # the ack that meets the stolen claim.
        owner = Consumer(config(redis_url, claim_lease_ttl_seconds=90), store, handler=slow)
        other = QueueOps(store, Q)
        async with trio.open_nursery() as nursery:
            await nursery.start(owner.run)
            await stalled.wait()
            # The lease lapses and another instance reclaims and claims the request.
            await store.command("ZADD", f"{Q}:claims-idx", "XX", 1, "s1")
            assert (await other.reclaim(max_deliveries=10)).redelivered == 1
            (raw,) = await other.peek(1)
            env = parse_member(raw)
            assert isinstance(env, Envelope)
            token_b = new_token()
            _now, codes = await other.claim([(env, token_b)], 60)
            assert codes == [1]
            resume.set()  # the stalled owner wakes up and acks its late result

            async def acked() -> bool:
                return owner.summary.duplicates_suppressed == 1

            while not await acked():
                await trio.sleep(0.02)
            assert await store.command("LLEN", "result-list") == 0
            assert await store.command("HGET", f"{Q}:claim-owners", "s1") == token_b.encode()
            owner.request_stop()
        assert owner.summary.acked == 0


async def test_a_claim_whose_ack_redis_refused_lapses_and_is_redelivered(
    redis_factory: Any,
) -> None:
    """Redis refuses the ack (out of memory): the claim must lapse and be redelivered. It
    used to stay in the consumer's registry, renewed by every heartbeat with no task behind
    it, so the request never ended (chaos fault "oom")."""
    server = redis_factory()
    calls: list[str] = []
    first = trio.Event()
    go_on = trio.Event()

    async def handler(q: QueueRuntime, env: Envelope, now: float) -> Outcome:
        calls.append(env.id)
        if len(calls) == 1:
            first.set()
            await go_on.wait()
        return Done(TerminalRecord.http(env.id, 200, f"call {len(calls)}"))

    with trio.fail_after(30):
        async with open_store(server.url) as store:
            await Producer(store, Q).submit({"id": "m1", "deadline": int(time.time()) + 600})
            cfg = config(server.url, claim_lease_ttl_seconds=3, claim_reclaim_interval_ms=100)
            consumer = Consumer(cfg, store, handler=handler)
            async with trio.open_nursery() as nursery:
                await nursery.start(consumer.run)
                await first.wait()
                await store.command("CONFIG", "SET", "maxmemory", "1")
                go_on.set()
                await trio.sleep(1.5)  # the ack fails; heartbeats pass while Redis refuses
                await store.command("CONFIG", "SET", "maxmemory", "0")
                while await store.command("LLEN", "result-list") == 0:
                    await trio.sleep(0.05)
                consumer.request_stop()
            (record,) = await store.command("LRANGE", "result-list", 0, -1)
            token = await store.command("GET", "request-active:m1")
            assert (
                record
                == b'{"id":"m1","status_code":200,"payload":"call 2","request_token":"%s"}' % token
            )
            assert calls == ["m1", "m1"]
            assert await store.command("HLEN", f"{Q}:claim-owners") == 0
