"""``claimkit results`` and ``claimkit cancel`` (docs/cli.md): the producer's side."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated

import typer

from claimkit.cli.common import (
    RedisUrl,
    TransportConfig,
    TransportConfigFile,
    config_from,
    fail,
    usage_error,
)
from claimkit.cli.runner import until_sigint, with_store, with_store_until_stopped
from claimkit.protocol.keys import RESULT_LIST_TYPE

if TYPE_CHECKING:
    from claimkit.store import Store

__all__ = ["RESULT_LINE_PREVIEW", "cancel", "record_line", "results"]

RESULT_LINE_PREVIEW = 160
"""Characters of a record's payload shown per line by ``results`` without ``--json``."""


def record_line(raw: bytes, *, as_json: bool) -> str:
    """One line of ``results`` for the record ``raw``: its exact text with ``--json``, else
    ``<id>  <status or error code>  <body or error message>`` (the body cut at
    :data:`RESULT_LINE_PREVIEW` characters). An element that is not a terminal record is
    still shown, as ``?  (not a terminal record)  <its text>``."""
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


def _check_results_flags(pop: bool, follow: bool, peek: bool, list_name: str | None) -> None:
    if peek and pop:
        usage_error("--peek and --pop cannot be combined: --peek reads without removing")
    if follow and not pop:
        usage_error(
            "--follow removes each record it prints: pass --follow --pop "
            "(without --pop, results only reads)"
        )
    if list_name is not None and not list_name:
        usage_error("--list must not be empty")


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
    _check_results_flags(pop, follow, peek, list_name)
    config = config_from(transport_config, transport_config_file, redis_url, require_queues=False)
    name = list_name or config.result_queue_name
    if not name:
        fail("the configuration's result_queue_name is empty: name the list with --list")
    from claimkit.ops.results import follow_results, read_results

    def emit(raw: bytes) -> None:
        sys.stdout.write(record_line(raw, as_json=json_out) + "\n")
        sys.stdout.flush()

    def notify(line: str) -> None:
        sys.stderr.write(f"claimkit results: {line}\n")
        sys.stderr.flush()

    async def read(store: Store) -> int:
        raw = await read_results(store, name, count=count or 100, pop=pop)
        for item in raw:
            emit(item)
        return len(raw)

    async def follow_list(store: Store) -> int | None:
        return await until_sigint(
            lambda: follow_results(store, name, emit=emit, notify=notify, count=count)
        )

    if follow:
        with_store_until_stopped(config, follow_list, key_types={name: RESULT_LIST_TYPE})
        return
    if with_store(config, read, key_types={name: RESULT_LIST_TYPE}) == 0:
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

    async def go(store: Store) -> tuple[list[bool], SubmitError | None]:
        # In order; a refused id (a cancel key of another type) stops the run there.
        found: list[bool] = []
        # The configuration's result list: on a Redis Cluster a finished request's marker
        # is read in that list's marker hash (docs/topology.md#cluster-key-layout).
        producer = Producer(store, "", result_list=config.result_queue_name)
        for rid in ids:
            try:
                found.append(await producer.cancel(rid))
            except SubmitError as exc:
                return found, exc
        return found, None

    outcomes, refused = with_store(config, go)
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
