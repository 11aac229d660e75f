"""``claimkit dead list|requeue|purge`` (docs/cli.md): a queue's dead letters."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from claimkit.cli.common import (
    JsonOut,
    Queue,
    RedisUrl,
    TransportConfig,
    TransportConfigFile,
    fail,
    usage_error,
)
from claimkit.cli.runner import console, resolve_queue, show, with_store

if TYPE_CHECKING:
    from claimkit.cli.console import RenderableType
    from claimkit.ops.dead import DeadLetter, PurgeReport, RequeueReport
    from claimkit.store import Store

__all__ = ["dead_app"]

dead_app = typer.Typer(
    name="dead",
    help="List, requeue or purge a queue's dead letters (<queue>:dead, docs/protocol.md).",
    no_args_is_help=True,
    rich_markup_mode=None,
)


@dead_app.command("list")
def dead_list(
    queue: Queue,
    limit: Annotated[int, typer.Option(min=0, help="At most this many (0 = all).")] = 50,
    json_out: JsonOut = False,
    transport_config: TransportConfig = None,
    transport_config_file: TransportConfigFile = None,
    redis_url: RedisUrl = None,
) -> None:
    """List dead letters, oldest first: id, when it died, its deadline, and why it died.

    The cause is "invalid" (the consumer could not serve it; the reason names the bad
    field) or "max deliveries" (its lease expired max_deliveries times without an ack).
    It is found from the member's bytes by the consumer's own checks; an invalid member
    cannot be requeued ("cannot_requeue" in --json). The table fits the terminal (80
    columns too) and cuts long reasons short; --json has them in full ("reason").

    With --json each entry carries the exact member: "member" is its text when the bytes
    are valid UTF-8, else null with "member_base64" holding the bytes. The JSON is strict:
    a non-finite number (a deadline of 1e400) is the string "inf", "-inf" or "nan".

    Example:

        claimkit dead list --redis-url redis://127.0.0.1:6379/0 --queue requests
    """
    target = resolve_queue(queue, transport_config, transport_config_file, redis_url)
    from claimkit.ops.dead import dead_key, list_dead
    from claimkit.ops.inspect import cluster_layout

    async def go(store: Store) -> tuple[int, list[DeadLetter], float, str, bool]:
        total, letters = await list_dead(store, queue, limit=limit)
        secs, micros = await store.command("TIME")
        now = int(secs) + int(micros) / 1_000_000
        return total, letters, now, dead_key(store, queue), cluster_layout(store)

    total, letters, now, key, cluster = with_store(target.config, go, key_types=target.key_types)
    causes = target.causes_of_death(
        letters,
        configured=transport_config is not None or transport_config_file is not None,
        cluster=cluster,
    )

    def table() -> str | RenderableType:
        if not letters:
            return f"{key} is empty"
        from claimkit.cli.console import dead_table

        width = console().width
        return dead_table(letters, causes, now=now, total=total, dead_key=key, width=width)

    show(
        json_out,
        doc=lambda: {
            "queue": queue,
            "total": total,
            "dead": [d.to_json(cause) for d, cause in zip(letters, causes, strict=True)],
        },
        text=table,
    )


@dead_app.command("requeue")
def dead_requeue(
    queue: Queue,
    ids: Annotated[
        list[str] | None, typer.Argument(help="Request ids to requeue.", show_default=False)
    ] = None,
    all_: Annotated[bool, typer.Option("--all", help="Requeue every dead letter.")] = False,
    keep_marker: Annotated[
        bool,
        typer.Option(
            "--keep-marker",
            help="Keep result-terminal:<id>, so the rerun's record is suppressed "
            "(one record per request generation).",
        ),
    ] = False,
    json_out: JsonOut = False,
    transport_config: TransportConfig = None,
    transport_config_file: TransportConfigFile = None,
    redis_url: RedisUrl = None,
) -> None:
    """Put dead letters back in pending at their deadline score, delivery count reset.

    Members move by their exact bytes, atomically per batch. Only members the consumer
    would accept are moved; any other (not JSON, no request_kind, a deadline that is not
    a positive integer, ...) is refused, stays dead, and is listed with the reason. The
    request's dedup marker is removed, so the rerun's terminal record is delivered after
    the one it got when it died; pass --keep-marker to suppress it instead. Exit status 1
    when a member was refused or a named id has no dead letter.

    Example:

        claimkit dead requeue --redis-url redis://127.0.0.1:6379/0 \\
          -q requests r1 r2
    """
    if bool(ids) == all_:
        usage_error("name the ids to requeue or pass --all (not both)")
    target = resolve_queue(queue, transport_config, transport_config_file, redis_url)
    from claimkit.ops.dead import requeue_dead

    async def go(store: Store) -> RequeueReport:
        return await requeue_dead(
            store,
            queue,
            None if all_ else list(ids or ()),
            keep_marker=keep_marker,
            routing=target.routing,
        )

    report = with_store(
        target.config, go, key_types=lambda store: target.key_types(store, markers=True)
    )
    show(
        json_out,
        doc=lambda: {
            "queue": queue,
            "requeued": report.requeued,
            "refused": [
                {"id": r.letter.id, "dead_at": r.letter.dead_at, "reason": r.reason}
                for r in report.refused
            ],
            "not_found": report.not_found,
        },
        text=lambda: [
            f"claimkit dead requeue {queue}: requeued={len(report.requeued)} "
            f"refused={len(report.refused)} not_found={len(report.not_found)}",
            *(f"  refused {r.letter.label()}: {r.reason}" for r in report.refused),
        ],
    )
    problems = []
    if report.refused:
        problems.append(
            f"{len(report.refused)} refused and left dead (the consumer would dead-letter "
            "them again; see each reason)"
        )
    if report.not_found:
        problems.append("no dead letter for " + ", ".join(map(repr, report.not_found)))
    if problems:
        fail("; ".join(problems))


@dead_app.command("purge")
def dead_purge(
    queue: Queue,
    ids: Annotated[
        list[str] | None, typer.Argument(help="Request ids to purge.", show_default=False)
    ] = None,
    all_: Annotated[bool, typer.Option("--all", help="Purge every dead letter.")] = False,
    older_than: Annotated[
        float | None,
        typer.Option(
            min=0, help="Purge those dead for at least this many seconds.", show_default=False
        ),
    ] = None,
    json_out: JsonOut = False,
    transport_config: TransportConfig = None,
    transport_config_file: TransportConfigFile = None,
    redis_url: RedisUrl = None,
) -> None:
    """Delete dead letters for good: the named ids, --all, or --older-than SECONDS.

    Exactly one of the three. Prints how many were removed (every generation of a named
    id counts) and how many named ids had no dead letter; exit status 1 when one had
    none, as for requeue.

    Example:

        claimkit dead purge --redis-url redis://127.0.0.1:6379/0 \\
          -q requests --older-than 604800
    """
    if sum((bool(ids), all_, older_than is not None)) != 1:
        usage_error("say what to purge: ids, --all or --older-than SECONDS (exactly one)")
    target = resolve_queue(queue, transport_config, transport_config_file, redis_url)
    from claimkit.ops.dead import purge_dead

    async def go(store: Store) -> PurgeReport:
        return await purge_dead(store, queue, ids=list(ids) if ids else None, older_than=older_than)

    report = with_store(target.config, go, key_types=target.key_types)
    show(
        json_out,
        doc=lambda: {"queue": queue, "purged": report.purged, "not_found": report.not_found},
        text=lambda: (
            f"claimkit dead purge {queue}: purged={report.purged} not_found={len(report.not_found)}"
        ),
    )
    if report.not_found:
        fail("no dead letter for " + ", ".join(map(repr, report.not_found)))
