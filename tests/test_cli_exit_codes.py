"""One exit-status convention for every command (docs/cli.md, "Exit status"):

- 0: done as asked, also when there was nothing to do;
- 1: not done, or not all of it: Redis unreachable, a key of the wrong type, the
  configuration refused, a named request not found, a member refused;
- 2: a usage error: the command line is wrong (typer's own checks and claimkit's checks
  of option values and combinations); nothing is read or changed.

``serve``'s 0 (after SIGTERM) and 1 (a wrong key type) are run as a real process in
tests/test_serve_process.py; ``demo``'s in tests/test_demo.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from support import closed_port, config_json, do
from typer.testing import CliRunner

from claimkit.cli.app import app

if TYPE_CHECKING:
    from collections.abc import Sequence

runner = CliRunner()
Q = "jobs"
LIVE = (
    b'{"internal":{"request_token":"t1"},"request_kind":"plain","data":{"id":"%s","deadline":%d}}'
)


def seed(url: str) -> None:
    """A pending request r1 (live: cancellable), a dead letter d1 and a result record."""
    deadline = int(do(url, ("TIME",))[0][0]) + 3600
    do(
        url,
        ("ZADD", Q, deadline, LIVE % (b"r1", deadline)),
        ("SET", "request-active:r1", "t1", "EX", 3600),
        ("ZADD", f"{Q}:dead", 1_700_000_000, LIVE % (b"d1", 1_900_000_000)),
        ("LPUSH", "result-list", b'{"id":"x","status_code":200,"payload":"{}"}'),
    )


# (args, exit status) with the seeded Redis as $REDIS_URL. "{cfg}" is a transport config.
CASES: list[tuple[list[str], int]] = [
    # 0: done as asked
    (["inspect", "-q", Q], 0),
    (["inspect", "-q", Q, "--json"], 0),
    (["drain", "-q", Q, "--release-all"], 0),
    (["drain", "-q", Q, "--release-all", "--dry-run"], 0),
    (["reclaim", "--once", "--transport-config", "{cfg}"], 0),
    (["results"], 0),
    (["results", "--list", "empty"], 0),
    (["cancel", "r1"], 0),
    (["dead", "list", "-q", Q], 0),
    (["dead", "list", "-q", "empty"], 0),
    (["dead", "purge", "-q", "empty", "--all"], 0),
    (["dead", "requeue", "-q", Q, "d1"], 0),
    (["submit", "-q", Q, '{"id":"s1","deadline":4102444800}'], 0),
    (["acl", "--role", "producer", "--rule-only"], 0),
    # 1: not done, or not all of it
    (["cancel", "nobody"], 1),
    (["cancel", "r1", "nobody"], 1),
    (["dead", "requeue", "-q", Q, "nobody"], 1),
    (["dead", "purge", "-q", Q, "nobody"], 1),
    (["inspect", "-q", "other", "--transport-config", "{cfg}"], 1),
    (["reclaim", "--once"], 1),  # the configuration lists no queue
    (["results", "--list", Q], 1),  # a sorted set, not a list
    (["submit", "-q", Q, '{"id":"s2"}'], 1),  # refused: no deadline
    (["submit", "-q", Q, "not json"], 1),
    # 2: usage errors, typer's and claimkit's
    (["inspect"], 2),
    (["inspect", "-q", Q, "--no-such-option"], 2),
    (["inspect", "-q", Q, "--watch", "--json"], 2),
    (["inspect", "-q", ""], 2),
    (["drain", "-q", Q], 2),
    (["reclaim"], 2),
    (["results", "--follow", "--pop"], 2),
    (["results", "--pop", "--peek"], 2),
    (["results", "--count", "0"], 2),
    (["cancel"], 2),
    (["dead"], 2),
    (["dead", "list"], 2),
    (["dead", "requeue", "-q", Q], 2),
    (["dead", "purge", "-q", Q, "d1", "--all"], 2),
    (["submit", "-q", Q, "{}", "--file", "-"], 2),
    (["serve", "--store", "nope", "--transport-config", "{cfg}"], 2),
    (["serve", "--log-level", "LOUD", "--transport-config", "{cfg}"], 2),
    (["sim", "--rate-429", "2"], 2),
    (["acl", "--role", "consumer", "--role", "nope"], 2),
    (["inspect", "-q", Q, "--transport-config", "{cfg}", "--transport-config-file", "x"], 2),
    ([], 2),
]


@pytest.mark.parametrize(("args", "code"), CASES, ids=[" ".join(a) or "-" for a, _ in CASES])
def test_exit_status(redis_url: str, args: Sequence[str], code: int) -> None:
    seed(redis_url)
    argv = [
        config_json(redis_url, queue=Q, gateway="http://x:9") if a == "{cfg}" else a for a in args
    ]
    before = do(redis_url, ("DBSIZE",))[0] if code == 2 else None
    result = runner.invoke(app, argv, env={"REDIS_URL": redis_url, "COLUMNS": "200"})
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    if code == 1:
        assert result.stderr.splitlines()[-1].startswith("claimkit: "), result.stderr
    if code == 2:
        assert do(redis_url, ("DBSIZE",))[0] == before  # a usage error changes nothing
        assert result.stderr.strip(), "a usage error says what is wrong"


@pytest.mark.filterwarnings("ignore:Unclosed <MemoryObject:ResourceWarning")
@pytest.mark.parametrize(
    "args",
    [
        ["inspect", "-q", Q],
        ["drain", "-q", Q, "--release-all"],
        ["results"],
        ["cancel", "r1"],
        ["dead", "list", "-q", Q],
        ["dead", "requeue", "-q", Q, "--all"],
        ["dead", "purge", "-q", Q, "--all"],
        ["submit", "-q", Q, '{"id":"s1","deadline":4102444800}'],
    ],
    ids=" ".join,
)
def test_redis_unreachable_is_exit_status_1(args: list[str]) -> None:
    import gc

    url = f"redis://127.0.0.1:{closed_port()}/0"
    result = runner.invoke(app, args, env={"REDIS_URL": url, "COLUMNS": "200"})
    assert result.exit_code == 1, (result.exit_code, result.output)
    assert result.stderr.startswith(f"claimkit: Redis at {url} is unavailable")
    gc.collect()


def test_the_console_script_exits_by_the_convention(redis_url: str) -> None:
    """The installed entry point, as a shell script sees it."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    claimkit = Path(sys.executable).with_name("claimkit")
    seed(redis_url)
    env = {**os.environ, "REDIS_URL": redis_url}

    def status(*args: str) -> tuple[int, str]:
        done = subprocess.run(
            [str(claimkit), *args], capture_output=True, text=True, env=env, timeout=60
        )
        return done.returncode, done.stderr

    assert status("results")[0] == 0
    assert status("cancel", "nobody") == (1, "claimkit: no live request to cancel for 'nobody'\n")
    code, err = status("results", "--follow", "--pop")
    assert code == 2
    assert err.startswith("claimkit: --follow --pop is gone: --follow alone reads durably")
    assert status("results", "--no-such-option")[0] == 2
    assert do(redis_url, ("LLEN", "result-list"))[0] == 1  # nothing was popped


def test_an_unknown_acl_role_prints_no_rule() -> None:
    """The whole command line is checked first: no rule for the good role, then the line."""
    result = runner.invoke(app, ["acl", "--role", "consumer", "--role", "nope"])
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == (
        "claimkit: unknown --role 'nope': choose from consumer, producer, operator\n"
    )
