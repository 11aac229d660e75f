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
    fail,
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
    forget_ids: Annotated[
        list[str] | None,
        typer.Option(
            "--forget",
            metavar="ID",
            help="Remove this consumer's entry (repeatable), first. A live consumer's entry "
            "is refused without --force; one whose expiry is too far ahead is removed.",
            show_default=False,
        ),
    ] = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="With --forget: remove live consumers' entries too (their claims then "
            "look unregistered until their next heartbeat registers them again).",
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
    reclaim hands its claims on; dead, claims handed on: a reclaimer did; alive (expiry too
    far ahead): an entry no heartbeat wrote), when its entry expires or expired (one
    liveness TTL after its last heartbeat), claims held, the age of its oldest claim, host
    and pid. Times are on the Redis server clock. Reads only; with --forget-dead, dead
    entries are removed first, with --forget the named ones. How to read it:
    docs/operations.md#consumers.

    Example:

        claimkit consumers --redis-url redis://127.0.0.1:6379/0 -q requests

        claimkit consumers -q requests --forget claimkit-7d9f8b6c4-x2k9p
    """
    if force and not forget_ids:
        usage_error("--force needs --forget ID")
    if forget_ids and forget_dead:
        usage_error("give --forget ID or --forget-dead, not both")
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

    refusal: list[str] = []
    ttl = config.consumer_liveness_ttl_seconds

    async def read(store: Store) -> tuple[list[ConsumersView], dict[str, list[str]]]:
        cluster = cluster_layout(store)
        types: dict[str, str] = {}
        for name in names:
            k = QueueKeys.for_queue(name, cluster=cluster)
            types.update({k.consumers: "zset", k.consumer_info: "hash", k.owners: "hash"})
        await check_key_types(store, types)
        forgotten: dict[str, list[str]] = {}
        if forget_dead:
            forgotten = {name: await forget(store, name) for name in names}
        elif forget_ids:
            forgotten = await _forget_these(
                store, names, forget_ids, force=force, ttl=ttl, refusal=refusal
            )
            if refusal:
                return [], {}
        views = [await consumers_view(store, name, liveness_ttl=ttl) for name in names]
        return views, forgotten

    views, forgotten = with_store(config, read)
    if refusal:
        fail(refusal[0])  # nothing was removed

    forgetting = forget_dead or bool(forget_ids)

    def doc() -> dict[str, object]:
        return _document(views, forgotten if forgetting else None)

    def text() -> RenderableType:
        from claimkit.cli.console import consumers_view_text

        return consumers_view_text(
            views, forgotten if forgetting else None, forget_dead=forget_dead
        )

    show(json_out, doc=doc, text=text)


def _document(
    views: list[ConsumersView], forgotten: dict[str, list[str]] | None
) -> dict[str, object]:
    """The ``--json`` document; when entries were forgotten, each queue's ``forgotten``
    ids and all of them by queue."""
    queues = []
    for view in views:
        one = view.to_json()
        if forgotten is not None:
            one["forgotten"] = forgotten.get(view.queue, [])
        queues.append(one)
    out: dict[str, object] = {"queues": queues}
    if forgotten is not None:
        out["forgotten"] = forgotten
    return out


async def _forget_these(
    store: Store,
    names: list[str],
    ids: list[str],
    *,
    force: bool,
    ttl: float,
    refusal: list[str],
) -> dict[str, list[str]]:
    """``--forget``: check every named id first (an entry in one of ``names``, and not
    alive unless ``force``: else the reason goes to ``refusal`` and nothing is removed),
    then remove them. Returns the ids removed, by queue."""
    from claimkit.ops.consumers import ALIVE, consumers_view, forget_named

    wanted = list(dict.fromkeys(ids))
    plan: dict[str, tuple[list[str], list[str]]] = {}  # queue -> (dead ones, any state)
    found: set[str] = set()
    for name in names:
        view = await consumers_view(store, name, liveness_ttl=ttl)
        rows = {row.id: row for row in view.rows if row.expires is not None}
        dead: list[str] = []
        anyway: list[str] = []
        for cid in wanted:
            row = rows.get(cid)
            if row is None:
                continue
            found.add(cid)
            if row.state == ALIVE and not force:
                refusal.append(
                    f"consumer {cid!r} of queue {name} is alive; --force removes its entry anyway"
                )
                return {}
            (anyway if row.alive else dead).append(cid)
        plan[name] = (dead, anyway)
    missing = [cid for cid in wanted if cid not in found]
    if missing:
        where = f"queue {names[0]}" if len(names) == 1 else "any queue"
        refusal.append(f"no consumer entry {', '.join(map(repr, missing))} in {where}")
        return {}
    out: dict[str, list[str]] = {}
    for name, (dead, anyway) in plan.items():
        removed = await forget_named(store, name, dead, any_state=False) if dead else []
        if anyway:
            removed += await forget_named(store, name, anyway, any_state=True)
        if dead or anyway:
            out[name] = removed
    return out
