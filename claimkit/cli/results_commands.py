"""``claimkit results`` and ``claimkit cancel`` (docs/cli.md): the producer's side."""

from __future__ import annotations

import signal
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

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from claimkit.protocol.result_delivery import ResultDelivery
    from claimkit.store import Store

__all__ = ["RESULT_LINE_PREVIEW", "cancel", "record_line", "results", "write_record"]

RESULT_LINE_PREVIEW = 160
"""Characters of a record's payload shown per line by ``results`` without ``--json``."""


def record_line(raw: bytes) -> str:
    """One line of ``results`` without ``--json`` for the record ``raw``:
    ``<id>  <status or error code>  <body or error message>`` (the body cut at
    :data:`RESULT_LINE_PREVIEW` characters). An element that is not a terminal record
    (:func:`~claimkit.protocol.result_delivery.parse_result`) is still shown, as
    ``?  (not a terminal record)  <its text>``, bytes that are not UTF-8 as U+FFFD."""
    from claimkit.protocol.result_delivery import parse_result

    rec, _why = parse_result(raw)
    if rec is None:  # a popped element must still be printed
        text = raw.decode("utf-8", errors="replace")
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


def write_record(raw: bytes, *, as_json: bool) -> None:
    """Print the record ``raw``: with ``as_json`` its exact bytes and a newline, written to
    stdout's byte stream as stored (not decoded, so a record that is not UTF-8 comes out
    byte for byte; docs/cli.md), else :func:`record_line`."""
    if as_json:
        sys.stdout.flush()
        sys.stdout.buffer.write(raw + b"\n")
        sys.stdout.buffer.flush()
    else:
        sys.stdout.write(record_line(raw) + "\n")
        sys.stdout.flush()


def _check_results_flags(
    pop: bool,
    follow: bool,
    peek: bool,
    json_out: bool,
    list_name: str | None,
    command: str | None,
    lease: float | None,
    poll: float | None,
) -> None:
    """Refuse a contradictory or out-of-range ``results`` command line: one line, exit 2."""
    from claimkit.result_reader import check_lease_seconds, check_poll_seconds

    if peek and pop:
        usage_error("--peek and --pop cannot be combined: --peek reads without removing")
    if follow and pop:
        usage_error(
            "--follow --pop is gone: --follow alone reads durably (each record leased, "
            "acked once printed or handled; docs/results.md); --pop is a one-shot "
            "destructive read"
        )
    if follow and peek:
        usage_error(
            "--follow and --peek cannot be combined: --follow acks each record it prints "
            "(it leaves the list); --peek reads without removing"
        )
    if not follow:
        for given, flag in ((command, "--exec"), (lease, "--lease"), (poll, "--poll")):
            if given is not None:
                usage_error(f"{flag} applies to --follow only")
    if command is not None and json_out:
        usage_error(
            "--exec and --json cannot be combined: with --exec nothing is printed, CMD gets "
            "each record's exact JSON on its stdin"
        )
    if command is not None and not command.strip():
        usage_error("--exec must not be empty")
    if list_name is not None and not list_name:
        usage_error("--list must not be empty")
    try:
        if lease is not None:
            check_lease_seconds(lease, "--lease")
        if poll is not None:
            check_poll_seconds(poll, "--poll")
    except ValueError as exc:
        usage_error(str(exc))


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
            "--pop",
            help="Remove each record printed (RPOP), once; refused while the list has "
            "durable readers. Without it nothing is removed.",
        ),
    ] = False,
    follow: Annotated[
        bool,
        typer.Option(
            "--follow",
            help="Read durably until Ctrl-C: lease each record, print it (or --exec), ack "
            "it; rides out a Redis restart.",
        ),
    ] = False,
    command: Annotated[
        str | None,
        typer.Option(
            "--exec",
            metavar="CMD",
            help="With --follow: run CMD through /bin/sh -c per record, its JSON on stdin; "
            "ack only when CMD exits 0.",
            show_default=False,
        ),
    ] = None,
    lease: Annotated[
        float | None,
        typer.Option(
            "--lease",
            metavar="SECONDS",
            help="With --follow: each record's lease, seconds (default 300; 0.001 to "
            "604800, 7 days).",
            show_default=False,
        ),
    ] = None,
    poll: Annotated[
        float | None,
        typer.Option(
            "--poll",
            metavar="SECONDS",
            help="With --follow: seconds between reads of an empty list (default 1.0; above "
            "0, at most 3600).",
            show_default=False,
        ),
    ] = None,
    peek: Annotated[
        bool,
        typer.Option("--peek", help="Read without removing: the default, accepted for scripts."),
    ] = False,
    count: Annotated[
        int | None,
        typer.Option(
            min=1,
            metavar="N",
            help="At most this many records (default 100; with --follow: stop after N acks, "
            "default no limit).",
            show_default=False,
        ),
    ] = None,
    json_out: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Print each record's exact bytes as stored, one per line (not re-encoded).",
        ),
    ] = False,
    transport_config: TransportConfig = None,
    transport_config_file: TransportConfigFile = None,
    redis_url: RedisUrl = None,
) -> None:
    """Print terminal records, oldest first, without removing them (unless --pop or --follow).

    Each line: id, status code or error code, body or error message (--json: the record's
    exact bytes as stored, even when not UTF-8, docs/protocol.md). By default the oldest
    --count records are read with LRANGE and stay in the list. --pop removes each record
    it prints (RPOP), once; it is refused (exit status 1, nothing popped) while the list
    has durable readers.

    --follow reads durably until Ctrl-C (or --count acks), as llm-d's result readers do,
    so several readers can share a list (docs/results.md): each record is leased
    (--lease, default 300 s), printed, then acked. With --exec CMD, CMD runs through
    /bin/sh -c with the record's JSON on stdin, the lease renewed meanwhile; the record is
    acked only when CMD exits 0, else one line on stderr and it comes back after the
    lease. An unparsable record is reported on stderr and left leased, never deleted.
    Rides out a Redis restart (one line on stderr, backoff, a line when it is back).
    Ctrl-C (or SIGTERM) leaves records not yet acked leased: they come back after the
    lease. A running --exec CMD runs in its own process group, which then gets SIGTERM
    (SIGKILL 5 s later), and claimkit waits for that shell to exit (docs/results.md).

    Contradictory flags (--follow with --peek or --pop, --peek with --pop, --exec with
    --json, --exec/--lease/--poll without --follow) are a usage error (exit status 2).

    Examples:

        claimkit results --redis-url redis://127.0.0.1:6379/0 --count 10

        claimkit results --redis-url redis://127.0.0.1:6379/0 --follow --json

        claimkit results --redis-url redis://127.0.0.1:6379/0 \\
          --follow --lease 60 --exec 'jq -c . >> results.jsonl'
    """
    _check_results_flags(pop, follow, peek, json_out, list_name, command, lease, poll)
    config = config_from(transport_config, transport_config_file, redis_url, require_queues=False)
    name = list_name or config.result_queue_name
    if not name:
        fail("the configuration's result_queue_name is empty: name the list with --list")
    from claimkit.ops.results import read_results
    from claimkit.protocol.keys import ResultClaimKeys, cluster_layout
    from claimkit.protocol.result_delivery import ResultPopRefused

    def emit(raw: bytes) -> None:
        write_record(raw, as_json=json_out)

    def notify(line: str) -> None:
        sys.stderr.write(f"claimkit results: {line}\n")
        sys.stderr.flush()

    def key_types(store: Store) -> dict[str, str]:
        try:
            return ResultClaimKeys.for_list(name, cluster=cluster_layout(store)).types()
        except ValueError as exc:
            fail(str(exc))

    async def read(store: Store) -> int:
        try:
            raw = await read_results(store, name, count=count or 100, pop=pop)
        except ResultPopRefused as exc:
            fail(str(exc))
        for item in raw:
            emit(item)
        return len(raw)

    if follow:
        follow_list = _follower(name, command, lease, poll, count, emit, notify)
        with_store_until_stopped(config, follow_list, key_types=key_types)
        return
    if with_store(config, read, key_types=key_types) == 0:
        typer.echo(f"claimkit results: {name} is empty", err=True)


def _follower(
    name: str,
    command: str | None,
    lease: float | None,
    poll: float | None,
    count: int | None,
    emit: Callable[[bytes], None],
    notify: Callable[[str], None],
) -> Callable[[Store], Awaitable[int | None]]:
    """``results --follow`` on an open store: print and ack, or run ``--exec`` and ack on
    exit status 0 (docs/results.md)."""
    from claimkit.ops.results import follow_results, run_command

    lease_seconds = 300.0 if lease is None else lease

    async def print_record(delivery: ResultDelivery) -> bool:
        emit(delivery.raw)
        return True

    async def run_record(delivery: ResultDelivery) -> bool:
        assert command is not None
        status = await run_command(command, delivery.raw)
        if status == 0:
            return True
        how = f"was killed by signal {-status}" if status < 0 else f"exited with status {status}"
        notify(
            f"{name}: --exec {how} for result {delivery.id!r}: not acked; it is delivered "
            f"again after the lease ({lease_seconds:g} s)"
        )
        return False

    async def follow_list(store: Store) -> int | None:
        return await until_sigint(
            lambda: follow_results(
                store,
                name,
                handle=print_record if command is None else run_record,
                notify=notify,
                count=count,
                lease_seconds=lease_seconds,
                poll_seconds=1.0 if poll is None else poll,
            ),
            also=(signal.SIGTERM,),
        )

    return follow_list


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
