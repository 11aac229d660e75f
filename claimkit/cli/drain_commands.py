"""``claimkit drain`` and ``claimkit reclaim`` (docs/cli.md): claims back to pending."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Annotated

import typer

from claimkit.cli.common import (
    JsonOut,
    Queue,
    RedisUrl,
    TransportConfig,
    TransportConfigFile,
    config_from,
    fail,
    usage_error,
)
from claimkit.cli.runner import console, resolve_queue, show, with_store
from claimkit.store import StoreError, StoreUnavailable

if TYPE_CHECKING:
    from collections.abc import Mapping

    from claimkit.ops.drain import DrainReport
    from claimkit.ops.inspect import QueueSnapshot
    from claimkit.protocol.ops import ReclaimCounts
    from claimkit.protocol.stats import QueueStats
    from claimkit.store import Store

__all__ = ["drain", "reclaim"]

Stats = dict[str, "QueueStats"] | str
"""What ``reclaim --once`` read after its run for export: the queue-wide figures by queue,
or why they could not be read."""


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
    Running consumers claim the released requests again unless the queue is paused
    (claimkit pause): on a queue that is not paused, a hint on stderr says so. Shows a
    progress bar on a terminal and ends with one count line. --dry-run shows the first
    --limit claims (earliest lease expiry first) and counts every claim in batches
    of --batch-size, as a real drain would read them; the table states no total of its
    own, so the two cannot disagree while consumers claim and ack.

    Example:

        claimkit drain --redis-url redis://127.0.0.1:6379/0 -q requests \\
          --release-all --dry-run
    """
    if not release_all:
        usage_error("drain needs --release-all (add --dry-run to preview what would be released)")
    target = resolve_queue(queue, transport_config, transport_config_file, redis_url)
    config = target.config
    from claimkit.cli.console import claims_table, progress_bar
    from claimkit.ops.drain import drain_claims
    from claimkit.ops.inspect import snapshot
    from claimkit.ops.pause import read_pause

    async def go(store: Store) -> tuple[DrainReport, QueueSnapshot | None, bool]:
        paused = await read_pause(store, queue) is not None
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
            report = await drain_claims(store, queue, dry_run=True, batch_size=batch_size)
            return report, snap, paused
        with progress_bar(f"releasing {queue} claims") as (set_total, advance):
            report = await drain_claims(
                store, queue, batch_size=batch_size, progress=advance, on_start=set_total
            )
        return report, None, paused

    report, snap, paused = with_store(config, go, key_types=target.key_types)
    if snap is not None and snap.claims:
        title = (
            f"claims that would go back to pending: the first {len(snap.claims)}, "
            "earliest lease expiry first (the count below is the total)"
        )
        console().print(claims_table(snap.claims, now=snap.server_time, title=title))
    typer.echo(report.line(queue, dry_run=dry_run))
    if report.renewed or report.other_owner:
        typer.echo(
            "claimkit drain: some claims changed while draining and were left alone; "
            "run it again to release them",
            err=True,
        )
    if report.released and not paused:
        typer.echo(
            f"claimkit drain: hint: {queue} is not paused, so running consumers claim the "
            f"released requests again; to hand them back for good run "
            f"'claimkit pause -q {queue}' first (docs/operations.md#a-planned-restart)",
            err=True,
        )


def reclaim(
    once: Annotated[
        bool, typer.Option("--once", help="Run one full reclaim run and exit (required).")
    ] = False,
    json_out: JsonOut = False,
    textfile: Annotated[
        str | None,
        typer.Option(
            "--textfile",
            metavar="PATH",
            help="After the run, write what it did and the queue-wide gauges to PATH (a"
            " .prom file in the node exporter's textfile folder), atomically"
            " (docs/metrics.md#reclaim-once-metrics).",
            show_default=False,
        ),
    ] = None,
    pushgateway: Annotated[
        str | None,
        typer.Option(
            "--pushgateway",
            metavar="URL",
            help="After the run, push the same metrics to the Prometheus Pushgateway at URL"
            " (docs/metrics.md#reclaim-once-metrics).",
            show_default=False,
        ),
    ] = None,
    push_job: Annotated[
        str | None,
        typer.Option(
            "--push-job",
            metavar="NAME",
            help="The Pushgateway job to push under (default claimkit-reclaim); needs"
            " --pushgateway.",
            show_default=False,
        ),
    ] = None,
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
    counted as leases_restored and reported on stderr. On a Redis Cluster each queue's
    run also finishes its outbox: records acked on their way to a list in another slot
    are pushed (counted as replayed; docs/topology.md#acks-across-slots). Meant for
    cron: prints one summary line (or --json), exit status 0; on a Redis or config error
    one line and 1. Needs no running consumer. The rules: docs/protocol.md.

    With --textfile or --pushgateway the run's counts, its finish time and the queue-wide
    gauges go where Prometheus sees them (docs/metrics.md#reclaim-once-metrics); if that
    fails, one line and exit status 1 after the summary: the reclaim itself stays done.

    Example:

        claimkit reclaim --once \\
          --transport-config-file /etc/claimkit/transport.json \\
          --textfile /var/lib/node_exporter/textfile/claimkit.prom
    """
    if not once:
        usage_error("reclaim needs --once (serve runs the reclaimer continuously)")
    export = _check_export(textfile, pushgateway, push_job)
    config = config_from(transport_config, transport_config_file, redis_url, require_queues=False)
    if not config.queues:
        fail(
            "reclaim --once works on the configured queues: give a transport config "
            "(--transport-config or --transport-config-file) whose queues list them"
        )
    from claimkit.ops.inspect import cluster_layout
    from claimkit.ops.reclaim import (
        ReclaimRun,
        failover_skipped_lines,
        reclaim_all,
        reclaim_json,
        reclaim_line,
    )
    from claimkit.ops.reclaim_metrics import queue_stats_all
    from claimkit.protocol.ops import ReclaimCounts, orphans_message

    async def go(store: Store) -> tuple[ReclaimRun, Stats, bool]:
        run = await reclaim_all(store, config)
        stats: Stats = {}
        if export:  # a failed read is reported after the summary: the run is done
            try:
                stats = await queue_stats_all(store, config)
            except (StoreUnavailable, StoreError) as exc:
                stats = str(exc)
        return run, stats, cluster_layout(store)

    run, stats, cluster = with_store(config, go)
    per_queue = run.per_queue
    total = ReclaimCounts()
    for counts in per_queue.values():
        total += counts
    show(
        json_out,
        doc=lambda: reclaim_json(
            per_queue, total, cluster=cluster, failover_skipped=run.failover_skipped
        ),
        text=lambda: reclaim_line(len(per_queue), total, cluster=cluster),
    )
    if not json_out:
        for line in failover_skipped_lines(run):
            typer.echo(line, err=True)
    for name, c in per_queue.items():
        if c.orphans:
            typer.echo(
                f"claimkit reclaim: warning: {name}: {orphans_message(c)}; "
                'see docs/operations.md, "Eviction"',
                err=True,
            )
    if export:
        _export(per_queue, stats, textfile, pushgateway, push_job)


def _check_export(textfile: str | None, pushgateway: str | None, push_job: str | None) -> bool:
    """Refuse bad export options before anything runs (exit status 2); whether to export."""
    from claimkit.ops.reclaim_metrics import pushgateway_problem, textfile_problem

    if push_job is not None and pushgateway is None:
        usage_error("--push-job needs --pushgateway")
    if push_job is not None and not push_job.strip():
        usage_error("--push-job must not be empty")
    problem = (textfile_problem(textfile) if textfile is not None else None) or (
        pushgateway_problem(pushgateway) if pushgateway is not None else None
    )
    if problem is not None:
        usage_error(problem)
    return textfile is not None or pushgateway is not None


def _export(
    per_queue: Mapping[str, ReclaimCounts],
    stats: Stats,
    textfile: str | None,
    pushgateway: str | None,
    push_job: str | None,
) -> None:
    """Write the textfile and push, as asked; a failure is one line and exit status 1.
    ``stats`` is why the queue-wide gauges could not be read, when it is text: the run's
    own counts are exported all the same, then that is the one line."""
    from claimkit.ops.reclaim_metrics import (
        DEFAULT_PUSH_JOB,
        ExportError,
        push_metrics,
        reclaim_registry,
        write_textfile,
    )

    unread = stats if isinstance(stats, str) else None
    read = {} if isinstance(stats, str) else stats
    registry = reclaim_registry(per_queue, read, time.time())
    try:
        if textfile is not None:
            write_textfile(textfile, registry)
        if pushgateway is not None:
            push_metrics(pushgateway, push_job or DEFAULT_PUSH_JOB, registry)
    except ExportError as exc:
        fail(f"reclaim: {exc} (the reclaim run itself is done)")
    if unread is not None:
        fail(
            f"reclaim: cannot read the queue-wide gauges: {unread}; the run's counts were "
            "exported without them (the reclaim run itself is done)"
        )
