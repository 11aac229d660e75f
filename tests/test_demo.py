"""``claimkit demo`` (:mod:`claimkit._demo`): the durability demo, run for real.

The slow test runs the whole demo with 60 requests: a private Redis, the simulator and two
``claimkit serve`` subprocesses, one SIGKILLed while it holds claims. It must pass (exit 0,
lost 0), finish in well under a minute and leave no temporary directory behind.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from claimkit._cli import app
from claimkit._demo import run_demo


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
