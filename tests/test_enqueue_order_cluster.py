"""tests/test_enqueue_order.py again, on a real Redis Cluster (docs/topology.md), and the
cluster submit's ordered writes.

Every test there that takes ``store`` runs here too, with ``store`` a cluster store: the
producer then deletes the cancel markers, sets the active markers (and payload keys), and
queues each deadline's requests with ``lua/enqueue-2.lua`` on the queue and its counter, in
the queue's slot, under the shebang (a node refuses an undeclared or cross-slot key).
Skipped when no cluster can be started here (tests/cluster.py).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import test_enqueue_order
import trio
from cluster import redis_cluster
from cluster_store import flushed_store
from support import StoreWrapper, server_now, store_tests, zrange

from claimkit.producer import Producer
from claimkit.protocol.keys import key_slot

if TYPE_CHECKING:
    from collections.abc import Sequence

    from claimkit.store import Arg, ScriptCall, Store
    from claimkit.store.scripts import Script

__all__ = ["flushed_store", "redis_cluster"]

globals().update(store_tests(test_enqueue_order))


class Recording(StoreWrapper):
    """Records each round trip: ``("pipeline", [command names])`` or ``("run", script,
    keys)``."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.trips: list[tuple[Any, ...]] = []

    async def pipeline(self, commands: Sequence[Sequence[Arg]], *, transaction: bool) -> list[Any]:
        assert not transaction, "no MULTI/EXEC in cluster mode"
        self.trips.append(("pipeline", [str(c[0]).upper() for c in commands]))
        return await self.inner.pipeline(commands, transaction=transaction)

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[Arg]) -> Any:
        self.trips.append(("run", script.name, [list(keys)]))
        return await self.inner.run(script, keys, args)

    async def run_many(self, script: Script, calls: Sequence[ScriptCall]) -> list[Any]:
        self.trips.append(("run", script.name, [list(keys) for keys, _ in calls]))
        return await self.inner.run_many(script, calls)


async def test_submit_writes_markers_then_each_deadline_in_one_slot(store: Store) -> None:
    with trio.fail_after(20):
        rec = Recording(store)
        await store.command("SET", "request-cancel:a", "old")
        d1 = int(await server_now(store)) + 600
        d2 = d1 + 100
        tokens = await Producer(rec, "q", payload_refs=True).submit_many(
            [
                {"id": "a", "deadline": d1, "payload": {"p": 1}},
                {"id": "b", "deadline": d2},
                {"id": "c", "deadline": d1},
            ]
        )
        seq1, seq2 = f"request-seq:{{q}}:{d1}", f"request-seq:{{q}}:{d2}"
        assert key_slot(seq1) == key_slot(seq2) == key_slot("q")
        assert rec.trips == [
            ("pipeline", ["TIME", "TYPE"]),
            ("pipeline", ["DEL", "DEL", "DEL"]),
            ("pipeline", ["SET", "SET", "SET", "SET", "SET", "SET"]),
            ("run", "enqueue", [["q", seq1], ["q", seq2]]),
        ]
        assert [(json.loads(m)["data"]["id"], s) for m, s in await zrange(store, "q")] == [
            ("a", d1 + 1 / 2**21),
            ("c", d1 + 2 / 2**21),
            ("b", d2 + 1 / 2**21),
        ]
        assert await store.command("EXISTS", "request-cancel:a") == 0
        for rid, token in zip("abc", tokens, strict=True):
            assert await store.command("GET", f"request-active:{rid}") == token.encode()
            assert await store.command("GET", f"request-payload:{rid}:{token}") == (
                b'{"p":1}' if rid == "a" else b"null"
            )
        assert await store.command("EXPIRETIME", seq1) == d1 + 3600
        assert await store.command("EXPIRETIME", seq2) == d2 + 3600
