"""``claimkit inspect`` (docs/cli.md): a queue's state, once or as a live view."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Annotated, Any

import typer

from claimkit.cli.common import (
    JsonOut,
    Queue,
    RedisUrl,
    TransportConfig,
    TransportConfigFile,
    usage_error,
)
from claimkit.cli.runner import console, resolve_queue, show, with_store, with_store_until_stopped

if TYPE_CHECKING:
    from collections.abc import Callable

    from claimkit.cli.console import Console, RenderableType
    from claimkit.ops.inspect import QueueSnapshot
    from claimkit.ops.watch import WatchFrame
    from claimkit.protocol.result_delivery import ResultListCounts
    from claimkit.store import Store

__all__ = ["inspect_queue", "live_watch", "watch_view"]


def watch_view(
    frame: WatchFrame, view: RenderableType | None, *, url: str
) -> RenderableType | None:
    """What the live view shows for ``frame``: ``view`` (the last snapshot's, drawn) under
    its ``read ...`` line, with a STALE line while Redis fails or hangs; before the first
    snapshot an error line, or ``None`` (leave the screen as it is)."""
    from claimkit.cli.console import error_view, format_clock, watch_status

    since = frame.trouble_since
    if view is None:
        if frame.failure is not None:
            return error_view(f"Redis at {url} is unavailable: {frame.failure}; retrying")
        if frame.hung and since is not None:
            return error_view(f"Redis at {url} not answering since {format_clock(since)}; waiting")
        return None
    if frame.failure is not None and since is not None:
        why = f"unavailable since {format_clock(since)}: {frame.failure}"
    elif frame.hung and since is not None:
        why = f"not answering since {format_clock(since)}"
    else:
        return watch_status(view, read_at=frame.read_at, now=frame.now)
    return watch_status(view, read_at=frame.read_at, now=frame.now, stale=f"Redis at {url} {why}")


async def live_watch(
    store: Store,
    queue: str,
    *,
    console: Console,
    key_types: dict[str, str],
    result_lists: list[str],
    retry_set: str,
    limit: int,
    interval: float,
    refreshes: int | None = None,
    stale_after: float | None = None,
    clock: Callable[[], float] = time.time,
) -> None:
    """Redraw the ``inspect`` view on ``console`` until cancelled or Ctrl-C (or
    ``refreshes`` reads, for tests): :func:`claimkit.ops.watch.watch_queue` reads, this
    draws each of its frames (:func:`watch_view`).

    The view's first line says when it was read (``read 12:00:01Z, 3.0s ago``, UTC). When
    a read goes unanswered for ``stale_after`` seconds (default
    :data:`~claimkit.ops.watch.WATCH_STALE_AFTER`; a frozen Redis) or Redis cannot be
    reached, the last view stays on screen under a ``STALE:`` line saying since when and
    why, and the reads go on; the line goes once Redis answers. A key of the wrong type
    ends the watch (``WrongKeyType``). ``clock`` gives Unix seconds (tests).

    Cancellation: the normal way out; the last view stays on screen.
    """
    from claimkit.cli.console import live_view, snapshot_view
    from claimkit.ops.watch import WATCH_STALE_AFTER, watch_queue

    drawn: tuple[QueueSnapshot, RenderableType] | None = None  # the last snapshot, drawn

    with live_view(console) as update:

        def draw(frame: WatchFrame) -> None:
            nonlocal drawn
            snap = frame.snapshot
            if snap is not None and (drawn is None or drawn[0] is not snap):
                drawn = snap, snapshot_view(snap, url=store.url)
            shown = watch_view(frame, None if drawn is None else drawn[1], url=store.url)
            if shown is not None:
                update(shown)

        await watch_queue(
            store,
            queue,
            show=draw,
            key_types=key_types,
            result_lists=result_lists,
            retry_set=retry_set,
            limit=limit,
            interval=interval,
            refreshes=refreshes,
            stale_after=WATCH_STALE_AFTER if stale_after is None else stale_after,
            clock=clock,
        )


def inspect_queue(
    queue: Queue,
    watch: Annotated[
        bool, typer.Option("--watch", "-w", help="Redraw a live table until Ctrl-C.")
    ] = False,
    json_out: JsonOut = False,
    limit: Annotated[int, typer.Option(min=0, help="At most this many claim rows (0 = all).")] = 50,
    interval: Annotated[
        float, typer.Option(min=0.1, help="Seconds between redraws with --watch.")
    ] = 1.0,
    transport_config: TransportConfig = None,
    transport_config_file: TransportConfigFile = None,
    redis_url: RedisUrl = None,
) -> None:
    """Show a queue's state without changing it.

    Counts (pending, claimed, orphans: claims without a lease entry, expired, retrying,
    dead, results), the oldest pending
    deadline, the consumers holding claims (alive or dead, claims, oldest, when each one's
    liveness entry expires or expired; docs/operations.md#consumers), and the claims with
    the earliest lease expiry first: id, consumer (unknown for a token that names none),
    owner token (short), lease left on the Redis server clock, deliveries, and how long the
    claim has been held (exact for claimkit's tokens, which carry their claim time; with
    --watch a lower bound for others). Expired leases are red: any reclaimer may redeliver
    them.
    Reads only the queue's own keys, the retry set and the result list; never KEYS or SCAN.
    On a Redis Cluster (mode "cluster") the counts add the outbox: records acked and on
    their way to a result list in another slot (docs/topology.md#cluster-key-layout).
    With --watch the header says when the view was read; while Redis does not answer, the
    last view stays with a STALE line saying since when, and the watch keeps retrying.
    When the configuration's result list is read durably (it has leases or tombstones), a
    last line says so: pending records, leases (how many past their lease) and tombstones
    (docs/results.md). The keys: docs/protocol.md.

    Example:

        claimkit inspect --redis-url redis://127.0.0.1:6379/0 -q requests --watch
    """
    if watch and json_out:
        usage_error("--watch and --json cannot be combined: --json prints one document")
    target = resolve_queue(queue, transport_config, transport_config_file, redis_url)
    config = target.config
    from claimkit.ops.inspect import snapshot

    if watch:
        out = console()

        async def watching(store: Store) -> None:
            # No check before the first view: the watch checks key types on every
            # redraw, and shows "unavailable" (and keeps trying) while Redis is down.
            await live_watch(
                store,
                queue,
                console=out,
                key_types=target.key_types(store),
                result_lists=target.result_lists,
                retry_set=config.retry_queue_name,
                limit=limit,
                interval=interval,
            )

        with_store_until_stopped(config, watching)
        return

    from claimkit.ops.results import reader_counts, reader_line

    async def once(store: Store) -> tuple[QueueSnapshot, str, ResultListCounts | None]:
        snap = await snapshot(
            store,
            queue,
            result_lists=target.result_lists,
            retry_set=config.retry_queue_name,
            limit=limit,
        )
        return snap, store.url, await reader_counts(store, config.result_queue_name)

    snap, url, readers = with_store(config, once, key_types=target.key_types)

    def view() -> RenderableType:
        from claimkit.cli.console import snapshot_view

        return snapshot_view(snap, url=url)

    def doc() -> dict[str, Any]:
        out = snap.to_json(url=url)
        if readers is not None:
            out["result_readers"] = {"list": config.result_queue_name, **asdict(readers)}
        return out

    show(json_out, doc=doc, text=view)
    if readers is not None and not json_out:
        typer.echo(reader_line(config.result_queue_name, readers))
