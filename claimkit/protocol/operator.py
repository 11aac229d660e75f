"""The operator commands' scripts (``claimkit inspect``, ``claimkit dead requeue``): what
reads or repairs a queue beside the consumer, through the protocol layer like every other
script call (docs/operations.md, docs/architecture.md).

Both key layouts (docs/topology.md#cluster-key-layout): on a Redis Cluster
(:func:`cluster_layout`) every script touches the keys of one slot only, the queue's or a
result list's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from claimkit.protocol import keys as _keys
from claimkit.protocol.keys import cluster_layout as cluster_layout
from claimkit.protocol.models import Envelope, parse_member
from claimkit.protocol.replies import InspectReply, RequeueCode
from claimkit.protocol.routing import ResultRouting
from claimkit.protocol.store_calls import as_int, chunks
from claimkit.store.scripts import script

if TYPE_CHECKING:
    from collections.abc import Sequence

    from claimkit.store import Arg, Store

__all__ = ["OperatorScripts", "cluster_layout", "script_source"]


class OperatorScripts:
    """The operator scripts of one queue ``queue`` (``<q>``) on ``store``, in the key layout
    of the store's mode (:func:`cluster_layout`)."""

    def __init__(self, store: Store, queue: str) -> None:
        self.store = store
        self.cluster = cluster_layout(store)
        self.keys = _keys.QueueKeys.for_queue(queue, cluster=self.cluster)

    async def inspect(self, limit: int, scan_max: int) -> InspectReply:
        """Read the queue's own keys in one instant, writing nothing (``lua/inspect-6.lua``;
        all six in the queue's slot in the cluster layout).

        Args:
            limit: at most this many claim rows, earliest lease expiry first; 0 = all.
            scan_max: at most this many fields of each claim hash are read to count the
                claims without a lease entry; 0 = no bound.

        Cancellation: nothing is written, so a cancelled call leaves no trace.
        """
        k = self.keys
        reply = await self.store.run(
            script("inspect"),
            [k.pending, k.claimed, k.owners, k.index, k.deliveries, k.dead],
            [limit, scan_max],
        )
        return InspectReply.from_reply(reply)

    async def requeue_dead(
        self,
        members: Sequence[bytes],
        *,
        keep_marker: bool,
        routing: ResultRouting | None = None,
    ) -> list[RequeueCode]:
        """Move dead members back to pending at their queue score (``data.deadline`` and
        enqueue order, docs/protocol.md#enqueue-order) by exact bytes, reset
        their delivery counts and, unless ``keep_marker``, delete the dedup marker of their
        generation (``lua/requeue-dead-3.lua``), one script call per
        :data:`~claimkit.protocol.store_calls.CHUNK` members. Returns one
        :class:`RequeueCode` per member.

        In the cluster layout a marker lives in its result list's slot
        (:class:`~claimkit.protocol.keys.ResultKeys`), not the queue's, so the requeue
        script never reads one: unless ``keep_marker``, each chunk's markers are first
        deleted by ``lua/drop-markers-2.lua``, one call per list, in the list the member's
        record went to by ``routing`` (default: no queue list, the default global list)
        and in its fallback list. First, so that a rerun's record, which can only follow
        the move, never meets the old marker and is never deleted with it.
        """
        k = self.keys
        route = routing or ResultRouting()
        # Cluster: the script's marker branch would read an undeclared key of another slot.
        flag = "1" if keep_marker or self.cluster else "0"
        codes: list[RequeueCode] = []
        for chunk in chunks(members):
            if self.cluster and not keep_marker:
                await self._drop_markers(chunk, route)
            args: list[Arg] = [_keys.RESULT_TERMINAL_PREFIX, flag, *chunk]
            reply = await self.store.run(
                script("requeue-dead"), [k.dead, k.pending, k.deliveries], args
            )
            codes += [RequeueCode(as_int(v)) for v in reply]
        return codes

    async def _drop_markers(self, members: Sequence[bytes], routing: ResultRouting) -> None:
        """Delete the cluster-layout markers of ``members``' generations (those that parse;
        the others are not requeued), one ``lua/drop-markers-2.lua`` call per list, all in
        one pipeline (each call is in one slot)."""
        by_list: dict[str, list[Arg]] = {}
        for raw in members:
            env = parse_member(raw)
            if not isinstance(env, Envelope):
                continue
            token = env.request_token or "1"
            lists = dict.fromkeys([routing.list_for(env.result_queue_name), routing.fallback])
            for name in lists:
                by_list.setdefault(name, []).extend([env.id, token])
        calls: list[tuple[list[str], list[Arg]]] = []
        for name, args in by_list.items():
            marker = _keys.ResultKeys.for_list(name)
            calls.append(([marker.terminal, marker.expiry], args))
        if calls:
            await self.store.run_many(script("drop-markers"), calls)


def script_source(name: str) -> str:
    """The full Lua text of the script called ``name`` (``"claim"``), includes resolved: for
    tools that read what a script does, such as ``claimkit acl`` collecting the commands
    each role's scripts call. Raises ``KeyError`` if there is no such script."""
    return script(name).source
