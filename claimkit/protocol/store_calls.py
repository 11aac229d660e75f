"""Protocol calls not tied to one queue: the retry mover over the shared retry set and the
key-type check, plus the chunking every batched call shares (docs/protocol.md). Reading a
result list is :mod:`claimkit.protocol.result_delivery`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

from claimkit.protocol import keys as _keys
from claimkit.store import reply_text
from claimkit.store.scripts import script

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping, Sequence

    from claimkit.store import Store

__all__ = ["CHUNK", "as_int", "chunks", "first_wrong_type", "move_retries"]

CHUNK = 500
"""Items per script call. A chunk keeps one script near or under ~5 ms of Redis time."""

T = TypeVar("T")


def chunks(items: Sequence[T], size: int = CHUNK) -> Iterator[Sequence[T]]:
    """``items`` in slices of at most ``size``."""
    for start in range(0, len(items), size):
        yield items[start : start + size]


def as_int(value: Any) -> int:
    """A script's integer reply as ``int``."""
    return int(value)


async def move_retries(store: Store, retry_set: str, *, limit: int = CHUNK) -> tuple[int, int]:
    """The retry mover (docs/protocol.md#retry-mover): move every due retry member back to
    its queue at its queue score (deadline and enqueue order, docs/protocol.md#enqueue-order),
    ``limit`` per script call, until none is due. Returns
    ``(moved, dead)``: members that could not be routed go to ``<retry_set>:dead``."""
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    moved = dead = 0
    more = True
    while more:
        reply = await store.run(
            script("move-retries"), [retry_set, _keys.retry_dead(retry_set)], [limit]
        )
        m, d, more_flag = (as_int(v) for v in reply)
        moved, dead, more = moved + m, dead + d, bool(more_flag)
    return moved, dead


async def first_wrong_type(
    store: Store, expected: Mapping[str, str]
) -> tuple[str, str, str] | None:
    """The first existing key of ``expected`` (key -> ``TYPE`` name, e.g.
    :meth:`~claimkit.protocol.keys.QueueKeys.types`) holding another type, as
    ``(key, found, expected)``; ``None`` when all are right or missing. One pipelined round
    trip of ``TYPE`` calls.

    Raises:
        StoreUnavailable, StoreError: from the store.
    """
    names = list(expected)
    if not names:
        return None
    replies = await store.pipeline([("TYPE", name) for name in names], transaction=False)
    for name, reply in zip(names, replies, strict=True):
        found = reply_text(reply)
        if found not in ("none", expected[name]):
            return name, found, expected[name]
    return None
