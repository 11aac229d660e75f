"""Reading a result list for operators and producers (``claimkit results``, docs/cli.md).

:func:`read_results` reads (``LRANGE``) or pops (``RPOP``) a bounded batch, oldest first;
:func:`follow_results` pops new records until cancelled and rides out a Redis restart
without losing a record it popped. Neither prints anything: records go to the caller's
``emit``, status lines to its ``notify``. The record format: docs/protocol.md#terminal-record.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from claimkit.protocol import keys as _keys
from claimkit.protocol.operator import cluster_layout
from claimkit.protocol.store_calls import read_results as read_results
from claimkit.store import StoreUnavailable

if TYPE_CHECKING:
    from collections.abc import Callable

    from claimkit.store import Store

__all__ = [
    "FOLLOW_BLOCK_SECONDS",
    "FOLLOW_RETRY_FIRST",
    "FOLLOW_RETRY_MAX",
    "follow_results",
    "read_results",
]

FOLLOW_BLOCK_SECONDS = 1.0
"""How long one ``BLMOVE`` of ``results --follow`` blocks (well under the store's 10 s
reply timeout, so a quiet list is not mistaken for a dead Redis)."""

FOLLOW_RETRY_FIRST = 0.25
"""Seconds ``results --follow`` waits before its first retry after losing Redis; each
further retry waits twice as long, up to :data:`FOLLOW_RETRY_MAX`."""

FOLLOW_RETRY_MAX = 5.0
"""The longest wait between two retries of ``results --follow`` while Redis is away."""


async def follow_results(
    store: Store,
    name: str,
    *,
    emit: Callable[[bytes], None],
    notify: Callable[[str], None],
    count: int | None = None,
    holding: str | None = None,
    block: float = FOLLOW_BLOCK_SECONDS,
    retry_first: float = FOLLOW_RETRY_FIRST,
    retry_max: float = FOLLOW_RETRY_MAX,
) -> int:
    """Pop records from the list ``name`` oldest first and ``emit`` each, until ``count``
    records (``None``: until cancelled). Returns how many were emitted.

    A popped record survives a lost reply. A record is not popped with ``BRPOP``, whose
    reply dies with a broken connection after Redis already removed the record: it is moved
    with ``BLMOVE name holding RIGHT LEFT`` into a holding list of this reader's own
    (:func:`claimkit.protocol.keys.results_holding_list`; on a Redis Cluster in the list's
    slot, ``{<list>}:following:<hex>``, docs/topology.md#cluster-key-layout), emitted, and
    only then deleted from there. A reply lost on the way leaves the record in the holding
    list, and it is emitted from there once Redis answers again. The holding list has at
    most one record. At worst a record is emitted twice (Ctrl-C between emitting it and
    noting that), never not at all, unless the reader itself is killed with a record in its
    holding list (docs/operations.md says how to move it back).

    While Redis is unreachable (:class:`StoreUnavailable`: down, restarting, loading) this
    says so once through ``notify`` (one line), retries with a backoff from
    ``retry_first`` doubling up to ``retry_max`` seconds, and says so again when Redis is
    back. Other errors (a ``WRONGTYPE`` reply, say) are raised. ``block`` is the seconds
    one ``BLMOVE`` waits.

    Cancellation: the normal way out (Ctrl-C). A record still in the holding list goes
    back to the oldest end of ``name``, where it came from, or is deleted there when it
    was already emitted (shielded, at most 5 s). If Redis cannot be reached for that, one
    ``notify`` line names the holding list and how to move its record back.
    """
    holding = holding or _keys.results_holding_list(name, cluster=cluster_layout(store))
    follower = _Follower(store, name, holding)
    seen = 0
    delay = retry_first
    try:
        while count is None or seen < count:
            try:
                got = await follower.step(block)
            except StoreUnavailable as exc:
                follower.maybe_held = True
                if not follower.away:
                    notify(
                        f"Redis at {store.url} is unavailable ({exc}); retrying with backoff "
                        "until it is back (Ctrl-C to stop)"
                    )
                    follower.away = True
                await trio.sleep(delay)
                delay = min(delay * 2, retry_max)
                continue
            if follower.away:
                notify(f"Redis at {store.url} is back; following {name} again")
                follower.away, delay = False, retry_first
            if got is not None:
                emit(got)
                seen += 1
                follower.emitted_held = True
    finally:
        await follower.clean_up(notify)
    return seen


class _Follower:
    """The holding-list state of one :func:`follow_results` reader."""

    def __init__(self, store: Store, name: str, holding: str) -> None:
        self.store, self.name, self.holding = store, name, holding
        self.emitted_held = False  # the record in the holding list was emitted: delete it
        self.maybe_held = False  # a reply may have been lost: look in the holding list first
        self.away = False  # Redis was unreachable at the last try

    async def step(self, block: float) -> bytes | None:
        """One round trip: delete an emitted record, look for a held one, or move one."""
        if self.emitted_held:
            await self.store.command("DEL", self.holding)
            self.emitted_held = False
            return None
        if self.maybe_held:
            got: bytes | None = await self.store.command("LINDEX", self.holding, -1)
            self.maybe_held = False
            return got
        self.maybe_held = True  # until the reply is in: Redis may have moved one
        got = await self.store.command("BLMOVE", self.name, self.holding, "RIGHT", "LEFT", block)
        self.maybe_held = False
        return got

    async def clean_up(self, notify: Callable[[str], None]) -> None:
        """Empty the holding list (shielded, at most 5 s), or say how to."""
        store, name, holding = self.store, self.name, self.holding
        cleaned = False
        with trio.move_on_after(5, shield=True):
            try:
                if self.emitted_held:
                    await store.command("DEL", holding)
                else:
                    await store.command("LMOVE", holding, name, "LEFT", "RIGHT")
                cleaned = True
            except StoreUnavailable:
                pass
        if not cleaned and self.emitted_held:
            notify(
                f"Redis at {store.url} is unavailable; the last record printed is still in "
                f"{holding}: DEL {holding} removes it"
            )
        elif not cleaned and self.maybe_held:
            notify(
                f"Redis at {store.url} is unavailable; a record popped from {name} may wait "
                f"in {holding}: LMOVE {holding} {name} LEFT RIGHT puts it back"
            )
