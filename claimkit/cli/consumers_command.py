"""``claimkit consumers`` (docs/cli.md): who consumes each queue, alive or dead, and what
each holds."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from claimkit.cli.common import (
    JsonOut,
    RedisUrl,
    TransportConfig,
    TransportConfigFile,
    config_from,
    usage_error,
)
from claimkit.cli.runner import resolve_queue, show, with_store

if TYPE_CHECKING:
    from claimkit.cli.console import RenderableType
    from claimkit.ops.consumers import ConsumersView
    from claimkit.store import Store

__all__ = ["consumers"]


def consumers(
    queue: Annotated[
        str | None,
        typer.Option(
            "--queue",
            "-q",
            help="The queue (pending ZSET) name (default: every configured queue).",
            show_default=False,
        ),
    ] = None,
    forget_dead: Annotated[
        bool,
        typer.Option(
            "--forget-dead",
            help="Remove the entries of dead consumers first (their claims not yet handed "
            "on then wait out their lease).",
        ),
    ] = False,
    json_out: JsonOut = False,
    transport_config: TransportConfig = None,
    transport_config_file: TransportConfigFile = None,
    redis_url: RedisUrl = None,
) -> None:
    """List the consumers of a queue: alive or dead, and the claims each holds.

    One row per consumer id in the queue's registry (each claimkit serve renews its entry
    with every heartbeat), then consumers that hold claims without an entry, then the
    claims whose token names no consumer ("unknown": taken before consumer ids, or by
    another program). Columns: consumer, state (alive; dead: its entry lapsed, the next
    reclaim hands its claims on; dead, claims handed on: a reclaimer did), when its entry
    expires or expired (one liveness TTL after its last heartbeat), claims held, the age of
    its oldest claim, host and pid. Times are on the Redis server clock. Reads only; with
    --forget-dead, dead entries are removed first. How to read it:
    docs/operations.md#consumers.

    Example:

        claimkit consumers --redis-url redis://127.0.0.1:6379/0 -q requests
    """
    if queue is not None:
        target = resolve_queue(queue, transport_config, transport_config_file, redis_url)
        config, names = target.config, [queue]
    else:
        config = config_from(
            transport_config, transport_config_file, redis_url, require_queues=False
        )
        names = [q.queue_name for q in config.queues]
        if not names:
            usage_error("--queue is required when the configuration lists no queues")
    from claimkit.ops.consumers import consumers_view
    from claimkit.ops.consumers import forget_dead as forget
    from claimkit.ops.inspect import check_key_types, cluster_layout
    from claimkit.protocol.keys import QueueKeys

    async def read(store: Store) -> tuple[list[ConsumersView], dict[str, list[str]]]:
        cluster = cluster_layout(store)
        types: dict[str, str] = {}
        for name in names:
            k = QueueKeys.for_queue(name, cluster=cluster)
            types.update({k.consumers: "zset", k.consumer_info: "hash", k.owners: "hash"})
        await check_key_types(store, types)
        forgotten = {name: await forget(store, name) for name in names} if forget_dead else {}
        return [await consumers_view(store, name) for name in names], forgotten

    views, forgotten = with_store(config, read)

    def doc() -> dict[str, object]:
        out: dict[str, object] = {"queues": [v.to_json() for v in views]}
        if forget_dead:
            out["forgotten"] = forgotten
        return out

    def text() -> RenderableType:
        from claimkit.cli.console import consumers_view_text

        return consumers_view_text(views, forgotten if forget_dead else None)

    show(json_out, doc=doc, text=text)
