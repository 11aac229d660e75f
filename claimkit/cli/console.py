"""Everything ``rich`` draws for the operator commands: tables, the live view, the progress
bar (docs/cli.md). The only module of the CLI that imports ``rich``.

Renderers take plain data (:class:`~claimkit.ops.inspect.QueueSnapshot`,
:class:`~claimkit.ops.dead.DeadLetter`) and return rich renderables; the CLI decides where
they go. On a terminal they are coloured; piped, rich writes plain text.
"""

from __future__ import annotations

import math
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

    from rich.console import JustifyMethod

    from claimkit.ops.consumers import ConsumerRow, ConsumersView
    from claimkit.ops.dead import DeadLetter, DeathCause
    from claimkit.ops.inspect import ClaimRow, QueueSnapshot
    from claimkit.protocol.pause import PauseMark

__all__ = [
    "Console",
    "RenderableType",
    "claims_table",
    "consumers_table",
    "consumers_view_text",
    "dead_table",
    "error_view",
    "format_clock",
    "format_duration",
    "format_time",
    "live_view",
    "make_console",
    "pause_text",
    "progress_bar",
    "short_token",
    "snapshot_view",
    "watch_status",
]

SHORT_TOKEN = 8
"""Hex characters of an owner token shown in tables (the JSON output has all of them)."""


def make_console(*, stderr: bool = False) -> Console:
    """A console on stdout (or stderr) that follows the current ``sys`` streams."""
    return Console(stderr=stderr, highlight=False, soft_wrap=False)


def format_time(ts: float | None) -> str:
    """Unix seconds -> ``2030-01-01T00:00:00Z`` (UTC, whole seconds); ``-`` for ``None``.

    Never raises: any float is shown. A time outside the years 1..9999 (or the platform's
    ``time_t``) is shown as its number of seconds, ``unix 1e+23 (out of range)``; an
    infinite one as ``∞`` or ``-∞``, NaN as ``?``. A producer's odd score or deadline
    must not stop an operator command.
    """
    if ts is None:
        return "-"
    if math.isnan(ts):
        return "?"
    if math.isinf(ts):
        return "∞" if ts > 0 else "-∞"
    try:
        return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    except (OverflowError, OSError, ValueError):
        return f"unix {ts:.6g} (out of range)"


_DAYS_SHOWN_EXACTLY = 100_000
"""Durations up to this many days are shown as ``2d04h``; longer ones as ``1.2e+05d``."""


def format_duration(seconds: float) -> str:
    """A compact non-negative duration (the sign is dropped): ``850ms``, ``12.3s``,
    ``4m05s``, ``3h02m``, ``2d04h``, ``1.16e+18d`` beyond :data:`_DAYS_SHOWN_EXACTLY`
    days, ``∞`` for an infinite one and ``?`` for NaN. Never raises."""
    if math.isnan(seconds):
        return "?"
    s = abs(seconds)
    if math.isinf(s):
        return "∞"
    if s < 1:
        return f"{s * 1000:.0f}ms"
    if s < 60:
        return f"{s:.1f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    if s < 86400:
        return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"
    if s < 86400 * _DAYS_SHOWN_EXACTLY:
        return f"{int(s // 86400)}d{int(s % 86400 // 3600):02d}h"
    return f"{s / 86400:.3g}d"


def _relative(ts: float, now: float) -> str:
    """``in 3m05s`` or ``3m05s ago``; ``?`` when either time is NaN or both infinite."""
    delta = ts - now
    if math.isnan(delta):
        return "?"
    return f"in {format_duration(delta)}" if delta > 0 else f"{format_duration(delta)} ago"


def short_token(token: str | None) -> str:
    """The last :data:`SHORT_TOKEN` hex characters of an owner token (``-`` for none).

    The last ones: claimkit's tokens are UUIDv7s, whose first 12 characters are the claim
    time in milliseconds (the same for a whole claim batch) and whose last ones are random.
    """
    return "-" if token is None else token[-SHORT_TOKEN:]


@dataclass(slots=True)
class _Col:
    """One column of a :class:`_FittedTable`: its header, cells, how narrow it may get
    (``minimum``, characters; ``None``: it keeps its natural width) and how it gives way:
    ``"wrap"`` at spaces, ``"ellipsis"`` (one line, cut with ``…``)."""

    header: str
    cells: list[str | Text]
    justify: JustifyMethod = "left"
    minimum: int | None = None
    give: str = "wrap"

    @property
    def natural(self) -> int:
        return max(cell_len(str(c)) for c in [self.header, *self.cells])


def _longest_word(*texts: str | Text) -> int:
    return max((cell_len(w) for t in texts for w in str(t).split()), default=1)


class _FittedTable:
    """A table laid out for the width it is drawn in (a terminal of 80 or 60 columns, the
    live view): columns keep their natural width when all fit; else the ``shrink`` ones
    (in that order) wrap or are cut down to their ``minimum``, and when even that is too
    wide the ``drop`` ones (in that order) are left out, named in a dim line under it.
    Columns with no ``minimum`` (the consumer id) never wrap."""

    def __init__(
        self,
        columns: dict[str, _Col],
        *,
        styles: list[str],
        shrink: Sequence[str],
        drop: Sequence[str],
        title: str | None,
    ) -> None:
        self.columns, self.styles, self.title = columns, styles, title
        self.shrink, self.drop = shrink, drop

    def widths(self, room: int) -> tuple[dict[str, int], list[str]]:
        """The width of each column shown and the columns left out, for ``room`` columns."""
        names = list(self.columns)
        dropped: list[str] = []
        while True:
            widths = {n: self.columns[n].natural for n in names}
            # Each column has a space either side and a rule before it; one rule closes.
            excess = sum(widths.values()) + 3 * len(names) + 1 - room
            for n in self.shrink:
                if excess <= 0:
                    break
                if n in widths:
                    floor = self.columns[n].minimum or widths[n]
                    cut = max(0, min(excess, widths[n] - floor))
                    widths[n] -= cut
                    excess -= cut
            left = [n for n in self.drop if n in names]
            if excess <= 0 or not left:
                return widths, dropped
            names.remove(left[0])
            dropped.append(left[0])

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        widths, dropped = self.widths(options.max_width)
        table = Table(title=self.title, title_justify="left", expand=False)
        for name, width in widths.items():
            col = self.columns[name]
            wrap = col.minimum is not None and col.give == "wrap"
            table.add_column(
                col.header,
                justify=col.justify,
                width=width,
                no_wrap=not wrap,
                overflow="fold" if wrap else "ellipsis",
            )
        shown = [self.columns[n] for n in widths]
        for i, style in enumerate(self.styles):
            table.add_row(*(col.cells[i] for col in shown), style=style)
        yield table
        if dropped:
            yield Text(f"(no room for {', '.join(dropped)}: see --json)", style="dim")


def claims_table(
    rows: Sequence[ClaimRow], *, now: float, title: str | None = None
) -> RenderableType:
    """The claim table: id, consumer (the id its token names), owner (short), lease left
    (server clock), deliveries, held (when any row knows it: exact from a claimkit token,
    ``≥`` a lower bound seen by ``--watch``), and its deadline relative to ``now`` (the
    original pending score it returns at; Unix seconds, server clock).

    Laid out for the terminal's width: the consumer id stays whole on one line; the claim id
    folds first, then the lease and deadline wrap; on a narrow terminal held, owner,
    deliveries and deadline are left out, in that order. Expired leases are shown in bold
    red; ghost entries (no owner or payload) dimmed.
    """
    tracked = any(row.held_seconds is not None for row in rows)
    cols = {
        "id": _Col("id", [], minimum=6),
        "consumer": _Col("consumer", []),
        "owner": _Col("owner", []),
        "lease left": _Col("lease left", [], justify="right"),
        "deliveries": _Col("deliveries", [], justify="right"),
    }
    if tracked:
        cols["held"] = _Col("held", [], justify="right")
    cols["deadline"] = _Col("deadline", [])
    styles: list[str] = []
    for row in rows:
        if row.expired:
            lease = Text(f"expired {format_duration(row.lease_left)} ago", style="bold red")
        else:
            lease = Text(format_duration(row.lease_left))
        if row.held_seconds is None:
            held = "-"
        else:
            held = ("" if row.held_exact else "≥") + format_duration(row.held_seconds)
        styles.append("dim" if row.ghost else ("red" if row.expired else ""))
        owner = short_token(row.owner) + (" (ghost)" if row.ghost else "")
        # Text, not str: a str cell is read as rich markup, and an id like "a[b]" would lose
        # its brackets.
        consumer = Text(row.consumer) if row.consumer is not None else Text("unknown", style="dim")
        cells: dict[str, str | Text] = {
            "id": Text(row.id),
            "consumer": consumer,
            "owner": Text(owner),
            "lease left": lease,
            "deliveries": str(row.deliveries),
            "held": held,
            "deadline": "-" if row.score is None else _relative(row.score, now),
        }
        for name, col in cols.items():
            col.cells.append(cells[name])
    for name in ("lease left", "deadline"):
        cols[name].minimum = _longest_word(cols[name].header, *cols[name].cells)
    return _FittedTable(
        cols,
        styles=styles,
        shrink=["id", "lease left", "deadline"],
        drop=["held", "owner", "deliveries", "deadline"],
        title=title,
    )


_STATE_STYLE = {
    "alive": "green",
    "alive (expiry too far ahead)": "bold yellow",
    "dead": "bold red",
    "dead, claims handed on": "red",
}


def _liveness(row: ConsumerRow, now: float) -> str:
    """When a consumer's liveness entry expires (``in 8.2s``) or expired (``12.0s ago``):
    ``-`` without an entry, ``unknown`` when the score cannot be a time (``inf``, or a
    dead consumer's entry ahead of the clock)."""
    if row.expires is None:
        return "-"
    if not math.isfinite(row.expires) or (not row.alive and row.expires > now):
        return "unknown"
    return _relative(row.expires, now)


def consumers_table(
    rows: Sequence[ConsumerRow], *, now: float, title: str | None = None, exact: bool = True
) -> RenderableType:
    """The consumer table (docs/operations.md#consumers): consumer, state, when its liveness
    entry expires (``in 8.2s``) or expired (``12.0s ago``; ``unknown`` for a score that
    cannot be a time), claims held (``≥`` when the owners hash was larger than the scan
    bound), the age of its oldest claim, host (``(unreadable info)`` when its info is
    not claimkit's JSON), pid. Times relative to ``now`` (Unix seconds, server clock).

    Laid out for the terminal's width: the consumer id stays whole on one line; host is
    cut short first, then state and the headers wrap; on a narrow terminal pid, host,
    oldest claim and claims are left out, in that order."""
    cols = {
        "consumer": _Col("consumer", []),
        "state": _Col("state", []),
        "liveness expires": _Col("liveness expires", []),
        "claims": _Col("claims", [], justify="right"),
        "oldest claim": _Col("oldest claim", [], justify="right"),
        "host": _Col("host", [], minimum=4, give="ellipsis"),
        "pid": _Col("pid", [], justify="right"),
    }
    for row in rows:
        if row.info_error is not None:
            host = Text("(unreadable info)", style="yellow")
        else:
            host = Text(row.host or "-")
        cells: dict[str, str | Text] = {
            "consumer": Text(row.id) if row.id is not None else Text("unknown", style="dim"),
            "state": Text(row.state, style=_STATE_STYLE.get(row.state, "dim")),
            "liveness expires": _liveness(row, now),
            "claims": ("" if exact else "≥") + str(row.claims),
            "oldest claim": "-" if row.oldest_age is None else format_duration(row.oldest_age),
            "host": host,
            "pid": "-" if row.pid is None else str(row.pid),
        }
        for name, col in cols.items():
            col.cells.append(cells[name])
    for name in ("liveness expires", "oldest claim"):
        cols[name].minimum = _longest_word(cols[name].header, *cols[name].cells)
    if any(row.info_error is not None for row in rows):
        cols["host"].minimum = min(cols["host"].natural, len("(unreadable info)"))
    # Two lines at most: "dead, claims" over "handed on".
    cols["state"].minimum = min(cols["state"].natural, 12)
    return _FittedTable(
        cols,
        styles=[""] * len(rows),
        shrink=["host", "state", "liveness expires", "oldest claim"],
        drop=["pid", "host", "oldest claim", "claims"],
        title=title,
    )


def consumers_view_text(
    views: Sequence[ConsumersView],
    forgotten: dict[str, list[str]] | None = None,
    *,
    forget_dead: bool = True,
) -> RenderableType:
    """The ``claimkit consumers`` screen: per queue a header line (alive and dead counts)
    and the consumer table, after a line per queue whose entries ``--forget-dead``
    (``forget_dead``) or ``--forget`` removed (``forgotten``): ``queue q: forgot 1 dead
    consumer: <id>``."""
    parts: list[RenderableType] = []
    kind = "dead consumer" if forget_dead else "consumer"
    for queue, ids in (forgotten or {}).items():
        line = f"queue {queue}: forgot {len(ids)} {kind}{'' if len(ids) == 1 else 's'}"
        parts.append(Text(line + (f": {', '.join(ids)}" if ids else "")))
    for view in views:
        alive = sum(1 for row in view.rows if row.alive)
        n_dead = sum(1 for row in view.rows if row.state.startswith("dead"))
        header = Text()
        header.append(f"queue {view.queue}", style="bold")
        header.append(
            f"  server time {format_time(view.server_time)}  alive {alive}  dead {n_dead}"
        )
        parts.append(header)
        if view.rows:
            parts.append(consumers_table(view.rows, now=view.server_time, exact=view.exact))
        else:
            parts.append(Text("no consumers", style="dim"))
    return Group(*parts)


def _counts(snap: QueueSnapshot) -> Text:
    text = Text()
    parts: list[tuple[str, str, str]] = [
        ("pending", str(snap.pending), ""),
        ("claimed", ("" if snap.claims_exact else "≥") + str(snap.claimed), ""),
        (
            "orphans",
            ("" if snap.claims_exact else "≥") + str(snap.orphans),
            "bold red" if snap.orphans else "",
        ),
        ("expired", str(snap.expired), "bold red" if snap.expired else ""),
        ("retrying", ("" if snap.retrying_exact else "≥") + str(snap.retrying), ""),
        ("dead", str(snap.dead), "bold yellow" if snap.dead else ""),
    ]
    if snap.outbox is not None:  # a Redis Cluster: records on their way to their list
        parts.append(("outbox", str(snap.outbox), ""))
    parts += [
        ("results", str(snap.result_count), ""),
        ("redelivered", str(snap.redelivered), ""),
    ]
    for i, (label, value, style) in enumerate(parts):
        if i:
            text.append("  ")
        text.append(f"{label} ")
        text.append(value, style=style or "bold")
    return text


def pause_text(mark: PauseMark) -> str:
    """A pause mark in words (docs/cli.md): ``since 2030-01-01T00:00:00Z (reason)``, the
    reason left out when there is none, ``since an unknown time`` for a mark without one
    (a key set by hand), and ``, until <time>`` when it resumes by itself."""
    text = "since an unknown time" if mark.since is None else f"since {format_time(mark.since)}"
    if mark.reason:
        text += f" ({mark.reason})"
    if mark.until is not None:
        text += f", until {format_time(mark.until)}"
    return text


def snapshot_view(snap: QueueSnapshot, *, url: str) -> RenderableType:
    """The ``inspect`` screen: a header, the counts, the oldest deadline, the claim table.

    ``url`` must already be redacted (``Store.url`` is).
    """
    header = Text()
    header.append(f"queue {snap.queue}", style="bold")
    header.append(f"  on {url}  server time {format_time(snap.server_time)}")
    oldest = Text("oldest pending deadline ")
    if snap.oldest_pending_deadline is None:
        oldest.append("-")
    else:
        oldest.append(format_time(snap.oldest_pending_deadline))
        oldest.append(f" ({_relative(snap.oldest_pending_deadline, snap.server_time)})")
    lists = ", ".join(f"{name}={n}" for name, n in snap.results.items())
    detail = Text(
        f"retry set {snap.retry_set}: {snap.retry_total} in all; result lists: {lists}",
        style="dim",
    )
    shown = f"claims ({len(snap.claims)} of {snap.leases}, earliest lease expiry first)"
    parts: list[RenderableType] = [header]
    if snap.paused is not None:  # consumers claim nothing new (docs/protocol.md#pause)
        parts.append(Text(f"paused {pause_text(snap.paused)}", style="bold yellow"))
    parts += [_counts(snap), oldest, detail]
    if snap.consumers is not None and snap.consumers.rows:
        parts.append(
            consumers_table(
                snap.consumers.rows,
                now=snap.consumers.server_time,
                title="consumers",
                exact=snap.consumers.exact,
            )
        )
    if snap.claims:
        parts.append(claims_table(snap.claims, now=snap.server_time, title=shown))
    else:
        parts.append(Text("no claims", style="dim"))
    return Group(*parts)


def format_clock(ts: float) -> str:
    """Unix seconds -> the time of day, ``12:00:01Z`` (UTC, whole seconds); never raises."""
    try:
        return datetime.fromtimestamp(ts, UTC).strftime("%H:%M:%SZ")
    except (OverflowError, OSError, ValueError):
        return format_time(ts)


def watch_status(
    view: RenderableType, *, read_at: float, now: float, stale: str | None = None
) -> RenderableType:
    """``view`` under a line saying when it was read (``read 12:00:01Z, 3.0s ago``), and,
    when ``stale`` says why the view is old, a bold ``STALE: <why>; ...`` line above it.
    Times are Unix seconds (the watcher's clock)."""
    read = f"read {format_clock(read_at)}, {format_duration(now - read_at)} ago"
    if stale is None:
        return Group(Text(read, style="dim"), view)
    line = Text(f"STALE: {stale}; retrying. Below: the view {read}", style="bold red")
    return Group(line, view)


def error_view(message: str) -> RenderableType:
    """What the live view shows while Redis cannot be read."""
    return Text(message, style="bold red")


_CAUSE_LABEL = {"invalid": "invalid", "max_deliveries": "max deliveries"}
_ID_WIDTH = 20
"""The widest the ``dead list`` id column gets; a longer id folds onto a second line."""
_WHY_MIN_WIDTH = 20


def dead_table(
    letters: Sequence[DeadLetter],
    causes: Sequence[DeathCause],
    *,
    now: float,
    total: int,
    dead_key: str,
    width: int = 80,
) -> Table:
    """The ``dead list`` table of the dead set ``dead_key`` (``<q>:dead``; ``{q}:dead`` on a
    Redis Cluster), made to fit 80 columns: id, when it died and its deadline
    (relative to ``now``, the server clock; exact in ``--json``), and why it died: the
    cause and the reason on one line, cut short with ``…`` when it does not fit (the full
    text is in ``--json``). A member the consumer would dead-letter again (it cannot be
    requeued) is yellow. ``width``: the columns to fit in."""
    ids = [d.id or "? (unreadable)" for d in letters]
    died = [_relative(d.dead_at, now) for d in letters]
    deadlines = [
        "unreadable" if d.deadline is None else _relative(d.deadline, now) for d in letters
    ]
    id_width = min(_ID_WIDTH, max(map(len, ["id", *ids])))
    # Four columns: five rules and a space either side of each cell.
    rest = sum(
        max(map(len, [head, *cells])) for head, cells in (("died", died), ("deadline", deadlines))
    )
    why_width = max(_WHY_MIN_WIDTH, width - 13 - id_width - rest)
    table = Table(
        title=Text(f"{dead_key} ({len(letters)} of {total}, oldest first; full reasons: --json)"),
        title_justify="left",
        expand=False,
    )
    table.add_column("id", overflow="fold", width=id_width)
    table.add_column("died", no_wrap=True)
    table.add_column("deadline", no_wrap=True)
    table.add_column("why", no_wrap=True, overflow="ellipsis", max_width=why_width)
    for d, cause, rid, dead_at, when in zip(letters, causes, ids, died, deadlines, strict=True):
        deadline = Text(when, style="yellow" if d.deadline is None else "")
        why = Text(f"{_CAUSE_LABEL.get(cause.cause, cause.cause)}: ", style="bold")
        why.append(cause.reason.removeprefix("Failed: "))
        if d.problem is not None:
            why.stylize("yellow")
        table.add_row(Text(rid, style="" if d.id else "yellow"), dead_at, deadline, why)
    return table


@contextmanager
def live_view(console: Console) -> Iterator[Callable[[RenderableType], None]]:
    """A live region redrawn on each call of the yielded function (``inspect --watch``).

    Nothing refreshes on its own (no background thread): the caller draws when it has read.
    On a non-terminal the last view is printed once when the block exits.
    """
    with Live(console=console, auto_refresh=False, transient=False) as live:

        def update(view: RenderableType) -> None:
            live.update(view, refresh=True)

        try:
            yield update
        finally:
            if not console.is_terminal:
                live.stop()
                console.line()


@contextmanager
def progress_bar(
    description: str, *, enabled: bool | None = None
) -> Iterator[tuple[Callable[[int], None], Callable[[int], None]]]:
    """A progress bar on stderr, shown only when stderr is a terminal (or ``enabled``).

    Yields ``(set_total, advance)``: call ``set_total(n)`` once the work is counted and
    ``advance(k)`` as it is done. When disabled both do nothing.
    """
    show = sys.stderr.isatty() if enabled is None else enabled
    if not show:
        yield (lambda _n: None), (lambda _k: None)
        return
    progress = Progress(
        TextColumn("{task.description}", markup=False),  # a queue name may hold "[...]"
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=make_console(stderr=True),
        transient=False,
    )
    with progress:
        task = progress.add_task(description, total=None)

        def set_total(n: int) -> None:
            progress.update(task, total=n)

        def advance(k: int) -> None:
            progress.advance(task, k)

        yield set_total, advance
