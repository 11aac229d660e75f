"""The retry mover's read-only look (docs/protocol.md#retry-mover) on a real Redis: an idle
consumer with an empty retry set runs no mover script, only ``ZRANGE ... 0 0 WITHSCORES``
looks; a due member is moved by one script call. Counts from ``INFO commandstats``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio
from support import command_calls, make_config, member, server_now

from claimkit.consumer.runtime import ServerClock
from claimkit.consumer.upkeep import Upkeep
from claimkit.protocol.models import retry_member
from claimkit.protocol.ops import QueueOps

if TYPE_CHECKING:
    from claimkit.store import Store

Q = "requests"
RETRY = "retry-sortedset"


class _Health:
    answering_since = 0.0

    def answered(self) -> None: ...

    async def failed(self, what: str, exc: BaseException) -> None:
        raise AssertionError(f"{what}: {exc}")


class _Queue:
    def __init__(self, ops: QueueOps) -> None:
        self.ops = ops
        self.name = ops.queue


async def test_next_retry_due_reads_the_earliest_score(store: Store) -> None:
    ops = QueueOps(store, Q, retry_set=RETRY)
    assert await ops.next_retry_due() is None
    await store.command("ZADD", RETRY, 20.5, b"b", 10.25, b"a")
    assert await ops.next_retry_due() == 10.25


async def test_an_idle_mover_runs_no_script_and_a_due_member_one(
    store: Store, redis_url: str
) -> None:
    """The mover over an empty retry set until it has looked 4 times (poll interval
    10 ms: 4 looks span 15 poll intervals): no ``EVALSHA``. Then a member due now: the
    next look finds it and one script call moves it back to pending."""
    ops = QueueOps(store, Q, retry_set=RETRY)
    config = make_config(redis_url, queue=Q, poll_interval_ms=10)
    clock = ServerClock()
    clock.observe(await server_now(store))
    upkeep = Upkeep(config, [_Queue(ops)], _Health(), clock)  # type: ignore[list-item,arg-type]
    await ops.move_retries()  # the script is in the server's cache: one call is one EVALSHA
    await store.command("CONFIG", "RESETSTAT")
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(upkeep.retry_mover)
            while (await command_calls(store)).get("zrange", 0) < 4:
                await trio.sleep(0.01)
            idle = await command_calls(store)
            raw = member("r1", 4_000_000_000)
            await store.command("ZADD", RETRY, await server_now(store) - 1, retry_member(raw, Q))
            while not await store.command("ZCARD", Q):
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    assert idle.get("evalsha", 0) == 0
    assert idle.get("eval", 0) == 0
    after = await command_calls(store)
    assert (after.get("evalsha", 0), after.get("eval", 0)) == (1, 0)
    assert await store.command("ZCARD", RETRY) == 0
