"""Fast failover with real ``claimkit serve`` processes (docs/protocol.md#fast-failover,
docs/operations.md#consumers): two consumers under a 300 s lease and a 3 s liveness TTL,
one SIGKILLed while it holds its claims. Its claims are handed on by the survivor within
seconds, long before any lease could lapse, and every request gets exactly one record;
``claimkit consumers`` and ``claimkit inspect`` name both consumers and mark the dead one.
"""

from __future__ import annotations

import json
import signal
from typing import TYPE_CHECKING, Any

import pytest
import trio
from held_gateway import held_gateway
from support import deadline, invoke, pairs
from test_serve_process import Q, serve, summary_of

from claimkit.producer import Producer
from claimkit.store import Store, open_store

if TYPE_CHECKING:
    import subprocess
    from pathlib import Path

pytestmark = pytest.mark.slow

REGISTRY = {
    "claim_lease_ttl_seconds": 300,
    "consumer_liveness_ttl_seconds": 3,
    "claim_reclaim_interval_ms": 200,
}


def cli_json(redis_url: str, *args: str) -> dict[str, Any]:
    result = invoke([*args, "--json"], redis_url)
    assert result.exit_code == 0, result.output
    doc: dict[str, Any] = json.loads(result.stdout)
    return doc


async def consumers(redis_url: str) -> dict[str, dict[str, Any]]:
    doc = await trio.to_thread.run_sync(cli_json, redis_url, "consumers", "-q", Q)
    (view,) = doc["queues"]
    return {row["consumer"]: row for row in view["consumers"]}


async def until(what: str, check: Any) -> None:
    """Poll ``await check()`` until it is true (the caller's fail_after bounds it)."""
    while not await check():
        await trio.sleep(0.1)


async def test_a_sigkilled_consumers_claims_are_handed_on_within_seconds(
    redis_url: str, tmp_path: Path
) -> None:
    n, concurrency = 32, 16
    ids = [f"ff-{i:03d}" for i in range(n)]
    a: subprocess.Popen[bytes] | None = None
    b: subprocess.Popen[bytes] | None = None
    try:
        # 60 s in all, a fifth of the 300 s lease: only the fast failover can hand the
        # dead consumer's claims on in time.
        with trio.fail_after(60), held_gateway() as gateway:
            async with open_store(redis_url) as store:
                await Producer(store, Q).submit_many(
                    [{"id": rid, "deadline": deadline(), "payload": {"id": rid}} for rid in ids]
                )
                a = serve(
                    redis_url, gateway.url, tmp_path / "a.log", "--consumer-id", "pod-a", **REGISTRY
                )
                sent_by_a = await trio.to_thread.run_sync(gateway.wait_arrivals, concurrency, 30)
                b = serve(
                    redis_url, gateway.url, tmp_path / "b.log", "--consumer-id", "pod-b", **REGISTRY
                )
                await trio.to_thread.run_sync(gateway.wait_arrivals, n, 30)
                sent_by_b = set(gateway.calls()) - set(sent_by_a)

                seen = await consumers(redis_url)
                assert {k: (v["state"], v["claims"]) for k, v in seen.items()} == {
                    "pod-a": ("alive", concurrency),
                    "pod-b": ("alive", concurrency),
                }
                owners = await owner_ids(store)
                assert {rid for rid, cid in owners.items() if cid == "pod-a"} == set(sent_by_a)

                a.send_signal(signal.SIGKILL)
                a.wait(10)

                async def handed_on() -> bool:
                    return int(await store.command("ZCARD", Q)) == concurrency

                await until("A's claims back in pending", handed_on)
                got = dict(pairs(await store.command("HGETALL", f"{Q}:deliveries")))
                assert got == {rid.encode(): b"1" for rid in sent_by_a}  # one delivery each
                assert set((await owner_ids(store)).values()) == {"pod-b"}

                seen = await consumers(redis_url)
                assert {k: (v["state"], v["claims"]) for k, v in seen.items()} == {
                    "pod-a": ("dead, claims handed on", 0),
                    "pod-b": ("alive", concurrency),
                }
                doc = await trio.to_thread.run_sync(cli_json, redis_url, "inspect", "-q", Q)
                assert {row["consumer"]: row["state"] for row in doc["consumers"]} == {
                    "pod-a": "dead, claims handed on",
                    "pod-b": "alive",
                }
                assert {row["consumer"] for row in doc["claims"]} == {"pod-b"}
                text = await trio.to_thread.run_sync(invoke, ["inspect", "-q", Q], redis_url)
                rows = {
                    line.split("│")[1].strip(): line
                    for line in text.stdout.splitlines()
                    if line.startswith("│")
                }
                assert "dead, claims handed on" in rows["pod-a"]
                assert "alive" in rows["pod-b"]

                gateway.release()

                async def all_done() -> bool:
                    return int(await store.command("LLEN", "result-list")) == n

                await until("every record", all_done)
                b.send_signal(signal.SIGTERM)
                assert await trio.to_thread.run_sync(b.wait, 30) == 0
                records = [
                    json.loads(r) for r in await store.command("LRANGE", "result-list", 0, -1)
                ]
                assert sorted(r["id"] for r in records) == ids  # each exactly once
                assert {r["status_code"] for r in records} == {200}
                assert await store.command("ZCARD", Q) == 0
                assert await store.command("HLEN", f"{Q}:claim-owners") == 0
                assert summary_of(tmp_path / "b.log")["acked"] == n
                # B left the registry at its shutdown; A stays, dead, until forgotten.
                entries = await store.command("ZRANGE", f"{Q}:consumers", 0, -1)
                assert entries == [b"pod-a"]
                calls = gateway.calls()
                assert {rid for rid, count in calls.items() if count == 2} == set(sent_by_a)
                assert {rid for rid, count in calls.items() if count == 1} == sent_by_b
    finally:
        for proc in (a, b):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)


async def owner_ids(store: Store) -> dict[str, str]:
    """Each claim's consumer, from its token (``<consumer id>/<uuid>``)."""
    raw = pairs(await store.command("HGETALL", f"{Q}:claim-owners"))
    return {k.decode(): v.decode().split("/")[0] for k, v in raw}
