"""tests/test_payload_refs.py again, on a real Redis Cluster (docs/topology.md#payload-keys).

Every test there that takes ``store`` runs here too, with ``store`` a cluster store: the
payload keys hash to slots of their own, so the fetch is one ``MGET`` per slot in one
pipeline and the ack's deletion a ``DEL`` per slot after the ack. Plus a consumer on the
cluster against the real gateway simulator. Skipped when no cluster can be started here
(tests/cluster.py).
"""

from __future__ import annotations

import json
from functools import partial
from typing import TYPE_CHECKING

import test_payload_refs
import trio
from cluster import redis_cluster
from cluster_store import flushed_store
from support import make_config, server_now, store_tests, wait_for
from test_payload_refs import PAYLOAD, RESULTS, TOKEN, Commands, ref_member

from claimkit.consumer.consumer import Consumer
from claimkit.dev.sim import SimApp, SimConfig, serve_sim
from claimkit.protocol.keys import key_slot, request_payload
from claimkit.protocol.models import PAYLOAD_MISSING_MESSAGE, ErrorCode, TerminalRecord

if TYPE_CHECKING:
    from cluster import RedisCluster

    from claimkit.store import Store

__all__ = ["flushed_store", "redis_cluster"]

globals().update(store_tests(test_payload_refs))


async def test_a_cluster_consumer_fetches_per_slot_and_deletes_after_the_ack(
    store: Store, redis_cluster: RedisCluster
) -> None:
    """Three requests whose payload keys live in three slots (none the queue's), one of
    them missing: one fetch pipeline of one ``MGET`` per slot; the two found are sent with
    their stored bytes, the missing one ends ``PAYLOAD_UNAVAILABLE`` unsent; after the
    acks the keys are deleted, one ``DEL`` per slot in one pipeline per ack batch."""
    queue = "q"
    ids = ["a1", "b2", "c3"]
    refs = {rid: request_payload(rid, TOKEN) for rid in ids}
    assert len({key_slot(r) for r in refs.values()} | {key_slot(queue)}) == 4
    sim = SimApp(SimConfig(), keep_bodies=True)
    with trio.fail_after(60):
        now = int(await server_now(store))
        for rid in ids:
            await store.command("ZADD", queue, now + 600, ref_member(rid, TOKEN, now + 600))
        bodies = {"a1": PAYLOAD.replace(b'"p1"', b'"a1"'), "c3": b'{ "id" : "c3" }'}
        for rid, body in bodies.items():
            await store.command("SET", refs[rid], body, "EX", 3600)
        recording = Commands(store)
        async with trio.open_nursery() as nursery:
            gateway = await nursery.start(partial(serve_sim, SimConfig(), app=sim))
            config = make_config(
                redis_cluster.url,
                queue=queue,
                gateway=gateway,
                mode="cluster",
                poll_interval_ms=20,
                metrics_port=0,
                health_port=0,
            )
            consumer = Consumer(config, recording)

            async def recorded() -> bool:
                return int(await store.command("LLEN", RESULTS)) == len(ids)

            async with trio.open_nursery() as inner:
                await inner.start(consumer.run)
                await wait_for(recorded, "three records")

                async def deleted() -> bool:
                    return not any([await store.command("EXISTS", r) for r in refs.values()])

                await wait_for(deleted, "the payload keys deleted")
                consumer.request_stop()
            nursery.cancel_scope.cancel()
        assert sim.bodies == bodies
        mgets = [p for p in recording.pipelines if p and p[0][0] == "MGET"]
        # The claim's cancel-marker read is an MGET pipeline too (request-cancel:<id>).
        fetches = [p for p in mgets if str(p[0][1]).startswith("request-payload:")]
        markers = [p for p in mgets if p not in fetches]
        assert sorted(c[1:] for p in markers for c in p) == sorted(
            [f"request-cancel:{rid}"] for rid in ids
        )
        by_slot = sorted([ref] for ref in refs.values())
        (fetch,) = fetches
        assert sorted(c[1:] for c in fetch) == by_slot
        assert all(len(c) == 2 for c in fetch)  # one key per slot here: one MGET each
        # One DEL pipeline per ack batch (the unsent b2 is acked first), each key once.
        drops = [p for p in recording.pipelines if p and p[0][0] == "DEL"]
        assert sorted(key for p in drops for c in p for key in c[1:]) == sorted(refs.values())
        assert all(len(c) == 2 for p in drops for c in p)  # a DEL per slot
        records = {json.loads(r)["id"]: r for r in await store.command("LRANGE", RESULTS, 0, -1)}
        assert (
            records["b2"]
            == TerminalRecord.error(
                "b2", ErrorCode.PAYLOAD_UNAVAILABLE, PAYLOAD_MISSING_MESSAGE, TOKEN
            ).to_json()
        )
        for rid in ("a1", "c3"):
            doc = json.loads(records[rid])
            assert records[rid] == TerminalRecord.http(rid, 200, doc["payload"], TOKEN).to_json()
