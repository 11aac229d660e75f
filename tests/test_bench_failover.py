"""``bench/failover.py`` (the fast-failover benchmark, docs/performance.md "Fast failover")
starts and refuses bad flags; the measured run itself takes minutes and prints figures, not
pass/fail, so the suite does not run it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

FAILOVER = Path(__file__).resolve().parent.parent / "bench" / "failover.py"


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(FAILOVER), *argv], capture_output=True, text=True, timeout=60
    )


def test_help_names_the_flags() -> None:
    done = run("--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: failover.py [-h] [--latency LATENCY]")
    for flag in ("--latency", "--requests", "--concurrency"):
        assert flag in done.stdout
    assert done.stderr == ""


def test_bad_flag_is_one_usage_error() -> None:
    done = run("--requests", "1")
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.splitlines()[-1] == (
        "failover.py: error: --latency must be >= 0, --requests >= 2, --concurrency >= 1"
    )
    assert "Traceback" not in done.stderr
