"""The operator commands (docs/cli.md): ``inspect``, ``drain``, ``reclaim``, ``dead``,
``results`` and ``cancel``, registered on the main app by :func:`register`.

They share serve's configuration (docs/configuration.md: ``--transport-config``/``-file``,
``--redis-url``, ``$REDIS_URL``). A queue named with ``--queue`` must be one of the
configured queues when the config lists queues; with only a Redis URL any name is
accepted, and a key of the wrong Redis type is one error line. Every error is one line on
stderr: exit status 1 when the work could not be done (:func:`claimkit.cli.common.run`),
2 for a usage error (docs/cli.md, "Exit status"); passwords are never printed.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import trio
import typer

from claimkit.cli.common import (
    EXIT_INTERRUPTED,
    RedisUrl,
    TransportConfig,
    TransportConfigFile,
    config_from,
    fail,
    run,
    usage_error,
)
from claimkit.config import Config, ConfigError, QueueConfig
from claimkit.protocol import keys as _keys
from claimkit.store import StoreUnavailable, open_store

if TYPE_CHECKING:
    from claimkit.cli.console import Console, RenderableType
    from claimkit.ops.drain import DrainReport
    from claimkit.ops.inspect import QueueSnapshot
    from claimkit.store import Store

__all__ = ["follow_results", "register", "watch_queue"]

T = TypeVar("T")

Queue = Annotated[
    str,
    typer.Option("--queue", "-q", help="The queue (pending ZSET) name.", show_default=False),
]
JsonOut = Annotated[bool, typer.Option("--json", help="Print JSON for scripts instead of text.")]

RESULT_LINE_PREVIEW = 160
"""Characters of a record's payload shown per line by ``results`` without ``--json``."""

FOLLOW_BLOCK_SECONDS = 1.0
"""How long one ``BLMOVE`` of ``results --follow`` blocks (well under the store's 10 s
reply timeout, so a quiet list is not mistaken for a dead Redis)."""

FOLLOW_RETRY_FIRST = 0.25
"""Seconds ``results --follow`` waits before its first retry after losing Redis; each
further retry waits twice as long, up to :data:`FOLLOW_RETRY_MAX`."""

FOLLOW_RETRY_MAX = 5.0
"""The longest wait between two retries of ``results --follow`` while Redis is away."""


# -- shared plumbing -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Target:
    """A queue an operator command works on, with where its records go."""

    config: Config
    queue: str
    queue_config: QueueConfig | None

    @property
    def result_lists(self) -> list[str]:
        """The lists this queue's records go to by config (docs/protocol.md#terminal-record)."""
        if self.queue_config is not None and self.queue_config.result_queue_name:
            return [self.queue_config.result_queue_name]
        return [self.config.result_queue_name]

    def key_types(self) -> dict[str, str]:
        from claimkit.ops.inspect import queue_key_types

        # The queue's own keys win a name clash: `inspect -q result-list` must say that the
        # key is a list, not a sorted set, rather than check it as the result list.
        types = {self.config.retry_queue_name: "zset"}
        types.update({name: "list" for name in self.result_lists})
        types.update(queue_key_types(self.queue))
        return types


def _target(
    queue: str,
    transport_config: str | None,
    transport_config_file: str | None,
    redis_url: str | None,
) -> _Target:
    """Load the config and resolve ``--queue`` against it, or exit with one line."""
    if not queue:
        usage_error("--queue must not be empty")
    config = config_from(transport_config, transport_config_file, redis_url, require_queues=False)
    if not config.queues:
        return _Target(config, queue, None)
    try:
        return _Target(config, queue, config.queue(queue))
    except ConfigError as exc:
        fail(str(exc))


def _run_until_interrupt(fn: Callable[[], Awaitable[T]], *, url: str) -> T | None:
    """:func:`run`, where Ctrl-C is the normal way to stop (``--watch``, ``--follow``):
    it ends quietly with exit status 0 instead of a traceback."""
    try:
        return run(fn, url=url)
    except KeyboardInterrupt:
        return None
    except BaseExceptionGroup as group:
        _, rest = group.split(KeyboardInterrupt)
        if rest is not None:
            raise
        return None


_INTERRUPTED = "interrupted; batches already done stay done, run it again to finish"


def _run(fn: Callable[[], Awaitable[T]], *, url: str) -> T:
    """:func:`run`, where Ctrl-C ends the command with one line and exit status 130.

    Every change is made by atomic scripts in batches, so an interrupted command leaves
    the batches it finished done and the rest untouched; running it again finishes.
    """
    try:
        return run(fn, url=url)
    except KeyboardInterrupt:
        fail(_INTERRUPTED, EXIT_INTERRUPTED)
    except BaseExceptionGroup as group:
        _, rest = group.split(KeyboardInterrupt)
        if rest is not None:
            raise
        fail(_INTERRUPTED, EXIT_INTERRUPTED)


def _print_json(doc: Any) -> None:
    """Print ``doc`` as strict JSON: a non-finite float becomes ``"inf"``, ``"-inf"`` or
    ``"nan"`` (:func:`claimkit.ops.inspect.json_safe`), never the invalid ``Infinity``."""
    from claimkit.ops.inspect import json_safe

    typer.echo(json.dumps(json_safe(doc), indent=2, ensure_ascii=False, allow_nan=False))


def _console() -> Console:
    from claimkit.cli.console import make_console

    return make_console()


# -- inspect ---------------------------------------------------------------------------------


WATCH_STALE_AFTER = 2.0
"""Seconds a read of ``inspect --watch`` may go unanswered before the view on screen is
marked STALE (a read takes milliseconds; the store gives up on a reply only after 10 s)."""


async def watch_queue(
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
    stale_after: float = WATCH_STALE_AFTER,
    clock: Callable[[], float] = time.time,
) -> None:
    """Redraw the ``inspect`` view until cancelled or Ctrl-C (or ``refreshes`` reads, for
    tests): a read every ``interval`` seconds, a redraw at least every second.

    The view's first line says when it was read (``read 12:00:01Z, 3.0s ago``, UTC). When
    a read goes unanswered for ``stale_after`` seconds (a frozen Redis) or Redis cannot
    be reached, the last view stays on screen under a ``STALE:`` line saying since when
    and why, and the reads go on; the line goes once Redis answers. A key of the wrong
    type ends the watch (``WrongKeyType``). ``clock`` gives Unix seconds (tests).

    Cancellation: the normal way out; the last view stays on screen.
    """
    from claimkit.cli.console import (
        error_view,
        format_clock,
        live_view,
        snapshot_view,
        watch_status,
    )
    from claimkit.ops.inspect import check_key_types, snapshot

    first_seen: dict[tuple[str, str], float] = {}
    last: RenderableType | None = None  # the last view read
    read_at = 0.0  # when it was read (clock)
    asking_since: float | None = None  # a read is in flight since then
    trouble_since: float | None = None  # reads unanswered or failing since then
    failure: str | None = None  # why the last read failed
    reads = 0

    with live_view(console) as update:

        def draw() -> None:
            now = clock()
            hung = asking_since is not None and now - asking_since > stale_after
            since = trouble_since if trouble_since is not None else asking_since
            if last is None:
                if failure is not None:
                    update(error_view(f"Redis at {store.url} is unavailable: {failure}; retrying"))
                elif hung and since is not None:
                    update(
                        error_view(
                            f"Redis at {store.url} not answering since {format_clock(since)}; "
                            "waiting"
                        )
                    )
                return
            if failure is not None and since is not None:
                why = f"unavailable since {format_clock(since)}: {failure}"
            elif hung and since is not None:
                why = f"not answering since {format_clock(since)}"
            else:
                update(watch_status(last, read_at=read_at, now=now))
                return
            stale = f"Redis at {store.url} {why}"
            update(watch_status(last, read_at=read_at, now=now, stale=stale))

        async def read_forever(cancel_scope: trio.CancelScope) -> None:
            nonlocal last, read_at, asking_since, trouble_since, failure, reads
            while True:
                asking_since = clock()
                try:
                    await check_key_types(store, key_types)
                    snap = await snapshot(
                        store,
                        queue,
                        result_lists=result_lists,
                        retry_set=retry_set,
                        limit=limit,
                        first_seen=first_seen,
                    )
                except StoreUnavailable as exc:
                    if trouble_since is None:
                        trouble_since = asking_since
                    failure = str(exc)
                else:
                    last, read_at = snapshot_view(snap, url=store.url), clock()
                    trouble_since = failure = None
                asking_since = None
                reads += 1
                draw()
                if refreshes is not None and reads >= refreshes:
                    cancel_scope.cancel()
                    return
                await trio.sleep(interval)

        async def redraw_forever() -> None:
            # A hung read must not freeze the screen: "3.0s ago" keeps counting and an
            # overdue read turns the view STALE while the read itself still waits.
            while True:
                await trio.sleep(min(interval, 1.0))
                draw()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_forever, nursery.cancel_scope)
            nursery.start_soon(redraw_forever)


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
    deadline, and the claims with the earliest lease expiry first: id, owner token
    (short), lease left on the Redis server clock, deliveries, and how long the claim has
    been held (exact for claimkit's tokens, which carry their claim time; with --watch a
    lower bound for others). Expired leases are red: any reclaimer may redeliver them.
    Reads only the queue's own keys, the retry set and the result list; never KEYS or SCAN.
    With --watch the header says when the view was read; while Redis does not answer, the
    last view stays with a STALE line saying since when, and the watch keeps retrying.
    The keys: docs/protocol.md.

    Example:

        claimkit inspect --redis-url redis://127.0.0.1:6379/0 -q requests --watch
    """
    if watch and json_out:
        usage_error("--watch and --json cannot be combined: --json prints one document")
    target = _target(queue, transport_config, transport_config_file, redis_url)
    config = target.config
    from claimkit.ops.inspect import check_key_types, snapshot

    if watch:
        console = _console()

        async def watching() -> None:
            # No check before the first view: watch_queue checks key types on every
            # redraw, and shows "unavailable" (and keeps trying) while Redis is down.
            async with open_store(config.url) as store:
                await watch_queue(
                    store,
                    queue,
                    console=console,
                    key_types=target.key_types(),
                    result_lists=target.result_lists,
                    retry_set=config.retry_queue_name,
                    limit=limit,
                    interval=interval,
                )

        _run_until_interrupt(watching, url=config.url)
        return

    async def once() -> tuple[Any, str]:
        async with open_store(config.url) as store:
            await check_key_types(store, target.key_types())
            snap = await snapshot(
                store,
                queue,
                result_lists=target.result_lists,
                retry_set=config.retry_queue_name,
                limit=limit,
            )
            return snap, store.url

    snap, url = _run(once, url=config.url)
    if json_out:
        _print_json(snap.to_json(url=url))
    else:
        from claimkit.cli.console import snapshot_view

        _console().print(snapshot_view(snap, url=url))


# -- drain -----------------------------------------------------------------------------------


def drain(
    queue: Queue,
    release_all: Annotated[
        bool,
        typer.Option("--release-all", help="Hand every claim back to pending (required)."),
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Show what would be released; change nothing.")
    ] = False,
    batch_size: Annotated[
        int, typer.Option(min=1, help="Claims per Redis round trip and release script call.")
    ] = 500,
    limit: Annotated[
        int, typer.Option(min=0, help="With --dry-run: at most this many rows (0 = all).")
    ] = 50,
    transport_config: TransportConfig = None,
    transport_config_file: TransportConfigFile = None,
    redis_url: RedisUrl = None,
) -> None:
    """Hand every claim of a queue back to pending at its original score.

    Each claim is released fenced by the owner token and lease expiry read just before, in
    batches: a claim acked, reclaimed or renewed meanwhile is left alone and counted. Safe
    while consumers run (their heartbeat drops the released work) and safe to run twice.
    Shows a progress bar on a terminal and ends with one count line. --dry-run shows the
    first --limit claims (earliest lease expiry first) and counts every claim in batches
    of --batch-size, as a real drain would read them; the table states no total of its
    own, so the two cannot disagree while consumers claim and ack.

    Example:

        claimkit drain --redis-url redis://127.0.0.1:6379/0 -q requests \\
          --release-all --dry-run
    """
    if not release_all:
        usage_error("drain needs --release-all (add --dry-run to preview what would be released)")
    target = _target(queue, transport_config, transport_config_file, redis_url)
    config = target.config
    from claimkit.cli.console import claims_table, progress_bar
    from claimkit.ops.drain import drain_claims
    from claimkit.ops.inspect import check_key_types, snapshot

    async def go() -> tuple[DrainReport, QueueSnapshot | None]:
        async with open_store(config.url) as store:
            await check_key_types(store, target.key_types())
            if dry_run:
                # The table: one bounded read. The count: batched reads like a real drain's,
                # never one script call over every claim (a few ms per script,
                # docs/protocol.md#claim-protocol).
                snap = await snapshot(
                    store,
                    queue,
                    result_lists=target.result_lists,
                    retry_set=config.retry_queue_name,
                    limit=limit,
                )
                return await drain_claims(store, queue, dry_run=True, batch_size=batch_size), snap
            with progress_bar(f"releasing {queue} claims") as (set_total, advance):
                report = await drain_claims(
                    store, queue, batch_size=batch_size, progress=advance, on_start=set_total
                )
            return report, None

    report, snap = _run(go, url=config.url)
    if snap is not None and snap.claims:
        title = (
            f"claims that would go back to pending: the first {len(snap.claims)}, "
            "earliest lease expiry first (the count below is the total)"
        )
        _console().print(claims_table(snap.claims, now=snap.server_time, title=title))
    typer.echo(report.line(queue, dry_run=dry_run))
    if report.renewed or report.other_owner:
        typer.echo(
            "claimkit drain: some claims changed while draining and were left alone; "
            "run it again to release them",
            err=True,
        )


# -- reclaim ---------------------------------------------------------------------------------


def reclaim(
    once: Annotated[
        bool, typer.Option("--once", help="Run one full reclaim run and exit (required).")
    ] = False,
    json_out: JsonOut = False,
    transport_config: TransportConfig = None,
    transport_config_file: TransportConfigFile = None,
    redis_url: RedisUrl = None,
) -> None:
    """Redeliver every expired claim of every configured queue, once.

    Each expired claim goes back to pending at its original score with its delivery count
    raised; one that reaches max_deliveries is dead-lettered with a MAX_DELIVERIES_EXCEEDED
    record. Passes repeat until no expired claim is left. Claims without a lease entry
    (evicted or partly restored) get their lease back (claim_lease_ttl_seconds), not a
    redelivery: a live owner goes on, a dead owner's comes back one lease later; they are
    counted as leases_restored and reported on stderr. Meant for
    cron: prints one summary line (or --json), exit status 0; on a Redis or config error
    one line and 1. Needs no running consumer. The rules: docs/protocol.md.

    Example:

        claimkit reclaim --once \\
          --transport-config-file /etc/claimkit/transport.json
    """
    if not once:
        usage_error("reclaim needs --once (serve runs the reclaimer continuously)")
    config = config_from(transport_config, transport_config_file, redis_url, require_queues=False)
    if not config.queues:
        fail(
            "reclaim --once works on the configured queues: give a transport config "
            "(--transport-config or --transport-config-file) whose queues list them"
        )
    from claimkit.ops.inspect import check_key_types, queue_key_types
    from claimkit.protocol.ops import QueueOps, ReclaimCounts, orphans_message

    async def go() -> dict[str, ReclaimCounts]:
        async with open_store(config.url) as store:
            types: dict[str, str] = {}
            for q in config.queues:
                types.update(queue_key_types(q.queue_name))
            await check_key_types(store, types)
            out: dict[str, ReclaimCounts] = {}
            for q in config.queues:
                ops = QueueOps(
                    store,
                    q.queue_name,
                    result_list=q.result_queue_name,
                    default_result_list=config.result_queue_name,
                    dedup_ttl=config.result_dedup_ttl_seconds,
                    lease_ttl=config.claim_lease_ttl_seconds,
                )
                out[q.queue_name] = await ops.reclaim(config.max_deliveries, full_scan=True)
            return out

    per_queue = _run(go, url=config.url)
    total = ReclaimCounts()
    for counts in per_queue.values():
        total += counts
    if json_out:
        _print_json(
            {
                "queues": {
                    name: {
                        "redelivered": c.redelivered,
                        "dead_lettered": c.dead,
                        "ghosts": c.ghosts,
                        "orphans": c.orphans,
                        "leases_restored": c.leases_restored,
                    }
                    for name, c in per_queue.items()
                },
                "redelivered": total.redelivered,
                "dead_lettered": total.dead,
                "ghosts": total.ghosts,
                "orphans": total.orphans,
                "leases_restored": total.leases_restored,
            }
        )
    else:
        typer.echo(
            f"claimkit reclaim: queues={len(per_queue)} redelivered={total.redelivered} "
            f"dead_lettered={total.dead} ghosts={total.ghosts} "
            f"leases_restored={total.leases_restored}"
        )
    for name, c in per_queue.items():
        if c.orphans:
            typer.echo(
                f"claimkit reclaim: warning: {name}: {orphans_message(c)}; "
                'see docs/operations.md, "Eviction"',
                err=True,
            )


# -- dead ------------------------------------------------------------------------------------

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
    target = _target(queue, transport_config, transport_config_file, redis_url)
    from claimkit.ops.dead import list_dead
    from claimkit.ops.inspect import check_key_types

    async def go() -> tuple[int, list[Any], float]:
        async with open_store(target.config.url) as store:
            await check_key_types(store, target.key_types())
            total, letters = await list_dead(store, queue, limit=limit)
            secs, micros = await store.command("TIME")
            return total, letters, int(secs) + int(micros) / 1_000_000

    total, letters, now = _run(go, url=target.config.url)
    config = target.config
    queues = [q.queue_name for q in config.queues] or [queue]
    reserved = _keys.reserved_keys(queues, config.retry_queue_name)
    # Without the consumer's config the default max_deliveries would be a guess.
    configured = transport_config is not None or transport_config_file is not None
    causes = [
        d.cause_of_death(
            max_deliveries=config.max_deliveries if configured else None,
            reserved=reserved,
            result_list_configured=bool(
                target.queue_config and target.queue_config.result_queue_name
            ),
        )
        for d in letters
    ]
    if json_out:
        dead = [d.to_json(cause) for d, cause in zip(letters, causes, strict=True)]
        _print_json({"queue": queue, "total": total, "dead": dead})
        return
    if not letters:
        typer.echo(f"{queue}:dead is empty")
        return
    from claimkit.cli.console import dead_table

    console = _console()
    console.print(
        dead_table(letters, causes, now=now, total=total, queue=queue, width=console.width)
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
    target = _target(queue, transport_config, transport_config_file, redis_url)
    from claimkit.ops.dead import RequeueReport, requeue_dead
    from claimkit.ops.inspect import check_key_types

    async def go() -> RequeueReport:
        async with open_store(target.config.url) as store:
            await check_key_types(store, target.key_types())
            return await requeue_dead(
                store, queue, None if all_ else list(ids or ()), keep_marker=keep_marker
            )

    report = _run(go, url=target.config.url)
    if json_out:
        _print_json(
            {
                "queue": queue,
                "requeued": report.requeued,
                "refused": [
                    {"id": r.letter.id, "dead_at": r.letter.dead_at, "reason": r.reason}
                    for r in report.refused
                ],
                "not_found": report.not_found,
            }
        )
    else:
        typer.echo(
            f"claimkit dead requeue {queue}: requeued={len(report.requeued)} "
            f"refused={len(report.refused)} not_found={len(report.not_found)}"
        )
        for r in report.refused:
            typer.echo(f"  refused {r.letter.label()}: {r.reason}")
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
    target = _target(queue, transport_config, transport_config_file, redis_url)
    from claimkit.ops.dead import PurgeReport, purge_dead
    from claimkit.ops.inspect import check_key_types

    async def go() -> PurgeReport:
        async with open_store(target.config.url) as store:
            await check_key_types(store, target.key_types())
            return await purge_dead(
                store, queue, ids=list(ids) if ids else None, older_than=older_than
            )

    report = _run(go, url=target.config.url)
    if json_out:
        _print_json({"queue": queue, "purged": report.purged, "not_found": report.not_found})
    else:
        typer.echo(
            f"claimkit dead purge {queue}: purged={report.purged} not_found={len(report.not_found)}"
        )
    if report.not_found:
        fail("no dead letter for " + ", ".join(map(repr, report.not_found)))


# -- results and cancel ----------------------------------------------------------------------


def _record_line(raw: bytes, *, as_json: bool) -> str:
    text = raw.decode("utf-8", errors="replace")
    if as_json:
        return text
    from claimkit.protocol.models import TerminalRecord

    try:
        rec = TerminalRecord.from_json(raw)
    except (ValueError, RecursionError):  # a popped element must still be printed
        return f"?  (not a terminal record)  {text[:RESULT_LINE_PREVIEW]}"
    if rec.error_code is not None:
        return f"{rec.id}  {rec.error_code}  {rec.error_message}"
    body = (
        rec.payload
        if len(rec.payload) <= RESULT_LINE_PREVIEW
        else (rec.payload[:RESULT_LINE_PREVIEW] + "…")
    )
    status = "-" if rec.status_code is None else str(rec.status_code)
    return f"{rec.id}  {status}  {body}"


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

    A popped record survives a lost reply. A record is not popped with ``BRPOP``, whose reply dies
    with a broken connection after Redis already removed the record: it is moved with
    ``BLMOVE name holding RIGHT LEFT`` into a holding list of this reader's own
    (:func:`claimkit.protocol.keys.results_holding_list`), emitted, and only then deleted from
    there. A reply lost on the way leaves the record in the holding list, and it is
    emitted from there once Redis answers again. The holding list has at most one record.
    At worst a record is emitted twice (Ctrl-C between emitting it and noting that), never
    not at all, unless the reader itself is killed with a record in its holding list
    (docs/operations.md says how to move it back).

    While Redis is unreachable (:class:`StoreUnavailable`: down, restarting, loading) this
    says so once through ``notify`` (one line), retries with a backoff from
    ``retry_first`` doubling up to ``retry_max`` seconds, and says so again when Redis is
    back. Other errors (a ``WRONGTYPE`` reply, say) are raised.

    Cancellation: the normal way out (Ctrl-C). A record still in the holding list goes
    back to the oldest end of ``name``, where it came from, or is deleted there when it
    was already emitted (shielded, at most 5 s). If Redis cannot be reached for that, one
    ``notify`` line names the holding list and how to move its record back.
    """
    holding = holding or _keys.results_holding_list(name)
    seen = 0
    emitted_held = False  # the record in the holding list was emitted: delete it, no more
    maybe_held = False  # a reply may have been lost: look in the holding list first
    away = False
    delay = retry_first
    try:
        while count is None or seen < count:
            got: bytes | None = None
            try:
                if emitted_held:
                    await store.command("DEL", holding)
                    emitted_held = False
                elif maybe_held:
                    got = await store.command("LINDEX", holding, -1)
                    maybe_held = False
                else:
                    maybe_held = True  # until the reply is in: Redis may have moved one
                    got = await store.command("BLMOVE", name, holding, "RIGHT", "LEFT", block)
                    maybe_held = False
            except StoreUnavailable as exc:
                maybe_held = True
                if not away:
                    notify(
                        f"Redis at {store.url} is unavailable ({exc}); retrying with backoff "
                        "until it is back (Ctrl-C to stop)"
                    )
                    away = True
                await trio.sleep(delay)
                delay = min(delay * 2, retry_max)
                continue
            if away:
                notify(f"Redis at {store.url} is back; following {name} again")
                away, delay = False, retry_first
            if got is not None:
                emit(got)
                seen += 1
                emitted_held = True
    finally:
        cleaned = False
        with trio.move_on_after(5, shield=True):
            try:
                if emitted_held:
                    await store.command("DEL", holding)
                else:
                    await store.command("LMOVE", holding, name, "LEFT", "RIGHT")
                cleaned = True
            except StoreUnavailable:
                pass
        if not cleaned and emitted_held:
            notify(
                f"Redis at {store.url} is unavailable; the last record printed is still in "
                f"{holding}: DEL {holding} removes it"
            )
        elif not cleaned and maybe_held:
            notify(
                f"Redis at {store.url} is unavailable; a record popped from {name} may wait "
                f"in {holding}: LMOVE {holding} {name} LEFT RIGHT puts it back"
            )
    return seen


async def _until_sigint(fn: Callable[[], Awaitable[T]]) -> T | None:
    """Run ``fn`` until it returns or Ctrl-C (SIGINT), which cancels it: its cleanup then
    runs as for any cancellation, instead of a ``KeyboardInterrupt`` at any line."""
    result: list[T] = []
    with trio.open_signal_receiver(signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

            async def stop_on_sigint() -> None:
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    return

            async def main() -> None:
                result.append(await fn())
                nursery.cancel_scope.cancel()

            nursery.start_soon(stop_on_sigint)
            nursery.start_soon(main)
    return result[0] if result else None


def results(
    list_name: Annotated[
        str | None,
        typer.Option(
            "--list",
            metavar="LIST",
            help="The result list (default: result_queue_name from the config, else result-list).",
            show_default=False,
        ),
    ] = None,
    pop: Annotated[
        bool,
        typer.Option(
            "--pop", help="Remove each record printed (RPOP); without it nothing is removed."
        ),
    ] = False,
    follow: Annotated[
        bool,
        typer.Option(
            "--follow",
            help="With --pop: keep popping new records until Ctrl-C; rides out a Redis restart.",
        ),
    ] = False,
    peek: Annotated[
        bool,
        typer.Option("--peek", help="Read without removing: the default, accepted for scripts."),
    ] = False,
    count: Annotated[
        int | None,
        typer.Option(
            min=1,
            metavar="N",
            help="At most this many records (default 100; with --follow: no limit).",
            show_default=False,
        ),
    ] = None,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print each record's exact JSON, one per line.")
    ] = False,
    transport_config: TransportConfig = None,
    transport_config_file: TransportConfigFile = None,
    redis_url: RedisUrl = None,
) -> None:
    """Print terminal records, oldest first, without removing them (unless --pop).

    Each line: id, status code or error code, body or error message (--json: the record
    exactly as stored, docs/protocol.md). By default the oldest --count records are read
    with LRANGE and stay in the list. --pop removes each record it prints (RPOP): a
    producer that reads its results this way gets each record once.

    --follow --pop blocks for new records until Ctrl-C (or --count records), removing
    each one it prints, and rides out a Redis restart: one line on stderr, retries with
    backoff, carries on when Redis is back. A record it pops is never lost: it is moved
    to a holding list of its own (<list>:following:<hex>) and removed from there once
    printed. --follow without --pop is refused: there is no following without removing.

    Examples:

        claimkit results --redis-url redis://127.0.0.1:6379/0 --count 10

        claimkit results --redis-url redis://127.0.0.1:6379/0 \\
          --follow --pop --json
    """
    if peek and pop:
        usage_error("--peek and --pop cannot be combined: --peek reads without removing")
    if follow and not pop:
        usage_error(
            "--follow removes each record it prints: pass --follow --pop "
            "(without --pop, results only reads)"
        )
    if list_name is not None and not list_name:
        usage_error("--list must not be empty")
    config = config_from(transport_config, transport_config_file, redis_url, require_queues=False)
    name = list_name or config.result_queue_name
    if not name:
        fail("the configuration's result_queue_name is empty: name the list with --list")
    from claimkit.ops.inspect import check_key_types

    def emit(raw: bytes) -> None:
        sys.stdout.write(_record_line(raw, as_json=json_out) + "\n")
        sys.stdout.flush()

    async def read() -> int:
        async with open_store(config.url) as store:
            await check_key_types(store, {name: "list"})
            n = count or 100
            if pop:
                raw = await store.command("RPOP", name, n) or []
            else:
                raw = list(reversed(await store.command("LRANGE", name, -n, -1)))
            for item in raw:
                emit(item)
            return len(raw)

    def notify(line: str) -> None:
        sys.stderr.write(f"claimkit results: {line}\n")
        sys.stderr.flush()

    async def follow_list() -> int | None:
        async with open_store(config.url) as store:
            await check_key_types(store, {name: "list"})
            return await _until_sigint(
                lambda: follow_results(store, name, emit=emit, notify=notify, count=count)
            )

    if follow:
        _run_until_interrupt(follow_list, url=config.url)
        return
    if _run(read, url=config.url) == 0:
        typer.echo(f"claimkit results: {name} is empty", err=True)


def cancel(
    ids: Annotated[list[str], typer.Argument(help="Request ids to cancel.", show_default=False)],
    transport_config: TransportConfig = None,
    transport_config_file: TransportConfigFile = None,
    redis_url: RedisUrl = None,
) -> None:
    """Cancel requests: set request-cancel:<id> to the live generation's token.

    A consumer ends a cancelled request with one CANCELLED record when it claims it; a
    request already being run is not interrupted. An id with no live generation (unknown,
    finished - its terminal record was pushed - or past its deadline) is reported and left
    alone, and the command then exits 1 naming it (every other id is still cancelled).
    Ids are handled in order; a cancel key of another Redis type stops the run with one
    error line naming the key (exit status 1), after the lines of the ids before it.

    Example:

        claimkit cancel --redis-url redis://127.0.0.1:6379/0 r1 r2
    """
    config = config_from(transport_config, transport_config_file, redis_url, require_queues=False)
    from claimkit.producer import Producer, SubmitError

    async def go() -> tuple[list[bool], SubmitError | None]:
        found: list[bool] = []
        async with open_store(config.url) as store:
            producer = Producer(store, "")
            for rid in ids:
                try:
                    found.append(await producer.cancel(rid))
                except SubmitError as exc:
                    return found, exc
        return found, None

    outcomes, refused = _run(go, url=config.url)
    for rid, cancelled in zip(ids, outcomes, strict=False):
        if cancelled:
            typer.echo(f"{rid}: cancelled")
        else:
            typer.echo(f"{rid}: not active (unknown, finished or expired); not cancelled")
    if refused is not None:
        fail(str(refused))
    inactive = [rid for rid, cancelled in zip(ids, outcomes, strict=True) if not cancelled]
    if inactive:
        fail("no live request to cancel for " + ", ".join(map(repr, dict.fromkeys(inactive))))


def register(app: typer.Typer) -> None:
    """Add the operator commands to ``app`` (called by :mod:`claimkit.cli.app`)."""
    app.command("inspect")(inspect_queue)
    app.command("drain")(drain)
    app.command("reclaim")(reclaim)
    app.command("results")(results)
    app.command("cancel")(cancel)
    app.add_typer(dead_app, name="dead")
