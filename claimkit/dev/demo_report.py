"""The demo's figures and how they are shown: the summary table, its notes and the verdict
(docs/demo.md)."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from rich.table import Table
from rich.text import Text

from claimkit.protocol import keys as _keys

__all__ = ["LEFT", "RESULTS", "Report", "parse_summary", "summary_table", "verdict"]

RESULTS = _keys.DEFAULT_RESULT_LIST  # the default result_queue_name (docs/configuration.md)
LEFT = ("pending", "claimed", "retrying", "dead")
_SUMMARY = re.compile(r"claimkit: claimed=.*")


@dataclass
class Report:
    """Everything the summary table shows."""

    submitted: int = 0
    finished: bool = False
    held_by_a: int = 0
    records: int = 0
    distinct: int = 0
    by_status: Counter[str] = field(default_factory=Counter)
    markers: int = 0
    left: dict[str, int] = field(default_factory=dict)
    redelivered_seen: int = 0
    summary_b: dict[str, int] = field(default_factory=dict)
    executions: int | None = None  # None: the simulator could not be asked
    ran_twice: int | None = None

    @property
    def lost(self) -> int:
        return self.submitted - self.distinct

    @property
    def duplicate_records(self) -> int:
        return self.records - self.distinct

    @property
    def left_total(self) -> int:
        return sum(self.left.values())

    @property
    def ok(self) -> bool:
        return self.lost == 0 and self.duplicate_records == 0 and self.left_total == 0


def parse_summary(output: str) -> dict[str, int]:
    """The counts of the last ``claimkit: claimed=...`` summary line in ``output``."""
    found = _SUMMARY.findall(output)
    if not found:
        return {}
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", found[-1])}


def _must_be_zero(value: int) -> Text:
    return Text("ok", style="green") if value == 0 else Text("FAIL", style="bold red")


def summary_table(report: Report) -> Table:
    """The figures, a check where one is due, and what each means (``docs/demo.md``)."""
    b = report.summary_b
    statuses = ", ".join(f"{code}: {n}" for code, n in sorted(report.by_status.items()))
    left = "/".join(str(report.left.get(k, "?")) for k in LEFT)
    rows: list[tuple[str, str, Text | str, str]] = [
        ("submitted", str(report.submitted), "", "requests put on the queue"),
        ("terminal records", str(report.records), "", f"in {RESULTS}; by status {statuses}"),
        ("ids with a record", str(report.distinct), "", "distinct request ids among them"),
        ("dedup markers", str(report.markers), "", "result-terminal:<id> keys"),
        ("A's claims at SIGKILL", str(report.held_by_a), "", "held by A when it died"),
        (
            "redelivered",
            f"{report.redelivered_seen} / {b.get('redelivered', '?')}",
            "",
            "lapsed leases put back (Redis / B)",
        ),
        (
            "gateway executions",
            "?" if report.executions is None else str(report.executions),
            "",
            f"POSTs seen; {'?' if report.ran_twice is None else report.ran_twice} ids ran "
            "twice [1]",
        ),
        (
            "duplicates suppressed",
            str(b.get("duplicates_suppressed", "?")),
            "",
            "second records refused (B) [2]",
        ),
        (
            "duplicate records",
            str(report.duplicate_records),
            _must_be_zero(report.duplicate_records),
            "records - ids with a record",
        ),
        ("lost", str(report.lost), _must_be_zero(report.lost), "submitted - ids with a record"),
        ("left in Redis", left, _must_be_zero(report.left_total), "/".join(LEFT)),
    ]
    table = Table(
        title="claimkit demo",
        title_justify="left",
        caption=Text(_notes(report)),
        caption_justify="left",
    )
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("check")
    table.add_column("meaning")
    for row in rows:
        table.add_row(*row)
    return table


def _notes(report: Report) -> str:
    """Why "ids ran twice" and "duplicates suppressed 0" are both true (docs/demo.md)."""
    twice = "?" if report.ran_twice is None else str(report.ran_twice)
    suppressed = report.summary_b.get("duplicates_suppressed", "?")
    if report.ran_twice == 0:
        first = (
            "[1] No id ran twice: A had sent none of the requests it held when it died, so "
            "B's runs of them were their first.\n"
        )
    else:
        first = (
            f"[1] {twice} ids ran twice: A was killed with their requests in flight (sent, "
            "not yet acked); once their leases lapsed B ran them again. Execution is "
            "at-least-once.\n"
        )
    return first + (
        f"[2] Records are still one per id, and duplicates suppressed is {suppressed}: A died "
        "before it could push a record, so there was no second record to refuse. Only a "
        "late ack by a claim's earlier owner is suppressed."
    )


def verdict(report: Report) -> Text:
    if report.ok:
        return Text.assemble(
            ("PASS", "bold green"),
            f": {report.distinct}/{report.submitted} requests, one record each; "
            f"A died holding {report.held_by_a} claims; lost 0.",
        )
    return Text.assemble(
        ("FAIL", "bold red"),
        f": lost {report.lost}, duplicate records {report.duplicate_records}, "
        f"left in Redis {report.left_total} (see the logs with --keep).",
    )
