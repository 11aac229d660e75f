"""The operator commands' scripts (``claimkit inspect``, ``claimkit dead requeue``): what
reads or repairs a queue beside the consumer, through the protocol layer like every other
script call (docs/operations.md, docs/architecture.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from claimkit.protocol import keys as _keys
from claimkit.protocol.replies import InspectReply, RequeueCode
from claimkit.protocol.store_calls import as_int, chunks
from claimkit.store.scripts import script

if TYPE_CHECKING:
    from collections.abc import Sequence

    from claimkit.store import Arg, Store

__all__ = ["OperatorScripts", "script_source"]


class OperatorScripts:
    """The operator scripts of one queue ``queue`` (``<q>``) on ``store``."""

    def __init__(self, store: Store, queue: str) -> None:
        self.store = store
        self.keys = _keys.QueueKeys.for_queue(queue)

    async def inspect(self, limit: int, scan_max: int) -> InspectReply:
        """Read the queue's own keys in one instant, writing nothing (``lua/inspect-6.lua``).

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
        self, members: Sequence[bytes], *, keep_marker: bool
    ) -> list[RequeueCode]:
        """Move dead members back to pending at ``data.deadline`` by exact bytes, reset
        their delivery counts and, unless ``keep_marker``, delete the dedup marker of their
        generation (``lua/requeue-dead-3.lua``), one script call per
        :data:`~claimkit.protocol.store_calls.CHUNK` members. Returns one
        :class:`RequeueCode` per member."""
        k = self.keys
        flag = "1" if keep_marker else "0"
        codes: list[RequeueCode] = []
        for chunk in chunks(members):
            args: list[Arg] = [_keys.RESULT_TERMINAL_PREFIX, flag, *chunk]
            reply = await self.store.run(
                script("requeue-dead"), [k.dead, k.pending, k.deliveries], args
            )
            codes += [RequeueCode(as_int(v)) for v in reply]
        return codes


def script_source(name: str) -> str:
    """The full Lua text of the script called ``name`` (``"claim"``), includes resolved: for
    tools that read what a script does, such as ``claimkit acl`` collecting the commands
    each role's scripts call. Raises ``KeyError`` if there is no such script."""
    return script(name).source
