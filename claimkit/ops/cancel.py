"""Cancelling requests by id (``claimkit cancel``, docs/cli.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from claimkit.producer import Producer, SubmitError

if TYPE_CHECKING:
    from claimkit.store.api import Store

__all__ = ["cancel_requests"]


async def cancel_requests(
    store: Store, ids: Sequence[str]
) -> tuple[list[bool], SubmitError | None]:
    """Cancel ``ids`` in order (:meth:`Producer.cancel`): for each id handled, whether it
    had a live generation to cancel, and the error that stopped the run (a cancel key of
    another Redis type), else ``None``. The ids after a refused one are not tried.

    Raises:
        StoreError: Redis refused a command (:class:`StoreUnavailable`: unreachable).

    Cancellation: the ids already cancelled stay cancelled.
    """
    found: list[bool] = []
    producer = Producer(store, "")
    for rid in ids:
        try:
            found.append(await producer.cancel(rid))
        except SubmitError as exc:
            return found, exc
    return found, None
