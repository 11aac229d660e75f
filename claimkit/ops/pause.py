"""Pause and resume a queue (``claimkit pause`` / ``claimkit resume``, docs/cli.md).

A paused queue has the key ``<q>:paused`` (``{q}:paused`` on a Redis Cluster, in the
queue's slot; docs/protocol.md#pause). Every consumer reads it with each peek and claims
nothing new from the queue while it exists; claims already held run to their end (renewed,
acked, parked), and the reclaimer and the retry mover go on. Both commands are idempotent:
pausing a paused queue changes nothing (the first pause's time and reason stay), resuming
a queue that is not paused changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from claimkit.protocol import keys as _keys
from claimkit.protocol.pause import PauseMark, parse_pause
from claimkit.store import StoreUnavailable

if TYPE_CHECKING:
    from claimkit.store import Store

__all__ = ["PauseResult", "pause_key", "pause_queue", "read_pause", "resume_queue"]

_PAUSE_TRIES = 3
"""Rounds of ``SET NX`` then ``GET`` before giving up, when a concurrent resume keeps
deleting the key between the two (three is already far-fetched)."""


@dataclass(frozen=True, slots=True)
class PauseResult:
    """What :func:`pause_queue` found or did.

    Attributes:
        mark: the queue's pause mark now (the new one, or the one already there).
        changed: ``True`` when this call paused the queue; ``False`` when it was already
            paused (``mark`` is then the existing one, untouched).
    """

    mark: PauseMark
    changed: bool


def pause_key(store: Store, queue: str) -> str:
    """``<q>:paused``, or ``{q}:paused`` in the cluster layout of ``store``
    (:func:`~claimkit.protocol.keys.cluster_layout`)."""
    return _keys.QueueKeys.for_queue(queue, cluster=_keys.cluster_layout(store)).paused


async def _server_now(store: Store) -> float:
    seconds, micros = await store.command("TIME")
    return int(seconds) + int(micros) / 1_000_000


async def pause_queue(
    store: Store, queue: str, *, reason: str | None = None, for_seconds: int | None = None
) -> PauseResult:
    """Pause ``queue``: write ``<q>:paused`` unless it exists (``SET ... NX``), stamped with
    the Redis server time (``TIME``) and ``reason``; with ``for_seconds`` the key expires
    (``EX``) and the queue resumes by itself then. An existing key is left exactly as it
    is (its time, reason and TTL) and read back (``GET``).

    Args:
        store: an open store; its mode picks the key's name.
        queue: ``<q>``.
        reason: free text shown by ``inspect`` and in consumers' logs; ``None`` or empty
            for none.
        for_seconds: whole seconds (>= 1) until it resumes by itself; ``None``: until
            ``claimkit resume``.

    Returns:
        A :class:`PauseResult`.

    Raises:
        ValueError: ``for_seconds`` < 1.
        StoreUnavailable, StoreError: from the store (a key of another type is refused
            by ``GET`` with ``WRONGTYPE``; the CLI checks key types first);
            StoreUnavailable too when a resume deleted the key between each ``SET NX``
            and its ``GET``, three times over.

    Cancellation: the key is either written whole or not at all.
    """
    if for_seconds is not None and for_seconds < 1:
        raise ValueError(f"for_seconds must be at least 1, got {for_seconds}")
    key = pause_key(store, queue)
    for _ in range(_PAUSE_TRIES):
        now = await _server_now(store)
        until = None if for_seconds is None else now + for_seconds
        mark = PauseMark(since=now, reason=reason or None, until=until)
        expiry = () if for_seconds is None else ("EX", for_seconds)
        if await store.command("SET", key, mark.encode(), "NX", *expiry) is not None:
            return PauseResult(mark, changed=True)
        existing = parse_pause(await store.command("GET", key))
        if existing is not None:
            return PauseResult(existing, changed=False)
    # Resumed between each SET NX and its GET, every time: someone is resuming on a loop.
    raise StoreUnavailable(
        f"queue {queue!r} was resumed while pausing it, {_PAUSE_TRIES} times; run pause again"
    )


async def resume_queue(store: Store, queue: str) -> PauseMark | None:
    """Resume ``queue``: delete ``<q>:paused`` (``GETDEL``). Returns the mark it held, or
    ``None`` when the queue was not paused (nothing changed). Consumers claim from the
    queue again at their next poll.

    Raises:
        StoreUnavailable, StoreError: from the store.

    Cancellation: the key is either deleted or not.
    """
    return parse_pause(await store.command("GETDEL", pause_key(store, queue)))


async def read_pause(store: Store, queue: str) -> PauseMark | None:
    """The pause mark of ``queue`` (``GET <q>:paused``), ``None`` when it is not paused.
    Writes nothing."""
    return parse_pause(await store.command("GET", pause_key(store, queue)))
