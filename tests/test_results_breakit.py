"""``claimkit results`` and the durable reader at the edges a new user hit (issue 11's
break-it trial; docs/cli.md, docs/results.md):

- contradictory flags (``--follow --peek``, ``--exec --json``, ...) are refused in one line,
  exit status 2, and nothing is read or removed;
- ``--lease``/``--poll`` out of range (``inf``, ``nan``, 0, negatives, a lease over 7 days)
  are refused in one line (exit 2), and ``ValueError`` in the Python API, before anything
  is sent;
- ``--json`` writes each record's exact bytes, a record that is not UTF-8 included;
- a record that is not UTF-8 is unparsable for listing and ``--follow`` alike: ``--follow``
  reports it once and leaves it leased;
- Ctrl-C (or SIGTERM) during ``--follow --exec`` stops the command's whole process group
  and leaves the record leased.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import trio
from support import do, invoke, one_line_error, wait_until

from claimkit import Producer
from claimkit.protocol.keys import ResultClaimKeys
from claimkit.result_reader import open_result_reader

if TYPE_CHECKING:
    from claimkit.store import Store

CLAIMKIT = Path(sys.executable).with_name("claimkit")
L = "res"
K = ResultClaimKeys.for_list(L)
R1 = b'{"id":"r1","status_code":200,"payload":"one"}'
R2 = b'{"id":"r2","status_code":200,"payload":"two"}'
NOT_UTF8 = b'{"id":"u1","status_code":200,"payload":"\xff\xfe bytes"}'


def push(url: str, *records: bytes) -> None:
    do(url, ("LPUSH", L, *records))  # LPUSH in order: the first is the oldest


def untouched(url: str, *records: bytes) -> None:
    """The list still holds ``records`` and nobody read it durably."""
    assert do(url, ("LRANGE", L, 0, -1))[0] == list(reversed(records))
    assert do(url, ("EXISTS", *K.reader_state()))[0] == 0


# -- 1. contradictory flags -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--follow", "--peek", "--count", "1"],
            "--follow and --peek cannot be combined: --follow acks each record it prints "
            "(it leaves the list); --peek reads without removing",
        ),
        (
            ["--follow", "--exec", "cat", "--json", "--count", "1"],
            "--exec and --json cannot be combined: with --exec nothing is printed, CMD gets "
            "each record's exact JSON on its stdin",
        ),
        (["--peek", "--pop"], "--peek and --pop cannot be combined: --peek reads without removing"),
        (["--pop", "--exec", "cat"], "--exec applies to --follow only"),
        (["--peek", "--lease", "5"], "--lease applies to --follow only"),
        (["--poll", "1"], "--poll applies to --follow only"),
    ],
)
def test_contradictory_flags_are_refused_and_nothing_is_read(
    redis_url: str, flags: list[str], message: str
) -> None:
    push(redis_url, R1, R2)
    one_line_error(invoke(["results", "--list", L, *flags], redis_url), message, code=2)
    untouched(redis_url, R1, R2)


# -- 2, 3. --lease and --poll ranges ----------------------------------------------------------

LEASE_RANGE = "--lease must be a number of seconds from 0.001 to 604800 (7 days), got {}"
POLL_RANGE = "--poll must be a number of seconds above 0 and at most 3600 (an hour), got {}"


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        *(
            ("--lease", v, LEASE_RANGE)
            for v in ("inf", "-inf", "nan", "0", "-1", "0.0009", "604800.5", "1e15", "1e400")
        ),
        *(("--poll", v, POLL_RANGE) for v in ("inf", "nan", "0", "-0.5", "3600.5")),
    ],
)
def test_lease_and_poll_out_of_range_are_one_line_usage_errors(
    redis_url: str, flag: str, value: str, message: str
) -> None:
    push(redis_url, R1)
    result = invoke(["results", "--list", L, "--follow", "--count", "1", flag, value], redis_url)
    one_line_error(result, message.format(repr(float(value))), code=2)
    untouched(redis_url, R1)


def test_the_longest_lease_is_accepted(redis_url: str) -> None:
    push(redis_url, R1)
    result = invoke(
        ["results", "--list", L, "--follow", "--count", "1", "--json", "--lease", "604800"],
        redis_url,
    )
    assert (result.exit_code, result.stdout_bytes) == (0, R1 + b"\n"), result.output
    assert do(redis_url, ("ZCARD", K.tombstones), ("EXISTS", L)) == [1, 0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lease_seconds": math.inf}, "lease_seconds must be a number of seconds from 0.001"),
        ({"lease_seconds": math.nan}, "lease_seconds must be a number of seconds from 0.001"),
        ({"lease_seconds": 0}, "lease_seconds must be a number of seconds from 0.001"),
        ({"lease_seconds": -1.0}, "lease_seconds must be a number of seconds from 0.001"),
        ({"lease_seconds": 1e15}, "lease_seconds must be a number of seconds from 0.001"),
        ({"poll_seconds": math.inf}, "poll_seconds must be a number of seconds above 0"),
        ({"poll_seconds": math.nan}, "poll_seconds must be a number of seconds above 0"),
        ({"poll_seconds": 0}, "poll_seconds must be a number of seconds above 0"),
        ({"poll_seconds": -1}, "poll_seconds must be a number of seconds above 0"),
    ],
)
async def test_the_reader_refuses_a_lease_or_poll_out_of_range(
    store: Store, kwargs: dict[str, Any], message: str
) -> None:
    with trio.fail_after(10):
        await store.command("LPUSH", L, R1)
        with pytest.raises(ValueError, match=message):
            async with Producer(store, "q", result_list=L).result_reader(**kwargs):
                pass
        with pytest.raises(ValueError, match=message):
            async with open_result_reader(store, L, **kwargs):
                pass
        assert await store.command("LRANGE", L, 0, -1) == [R1]
        assert await store.command("EXISTS", *K.reader_state()) == 0


@pytest.mark.parametrize(
    ("lease_ms", "message"),
    [
        (
            10**15,
            "lease_ms must be from 1 to 604800000 milliseconds (7 days), got 1000000000000000",
        ),
        (604_800_001, "lease_ms must be from 1 to 604800000 milliseconds (7 days), got 604800001"),
        (0, "lease_ms must be from 1 to 604800000 milliseconds (7 days), got 0"),
        (-5, "lease_ms must be from 1 to 604800000 milliseconds (7 days), got -5"),
        (math.inf, "lease_ms must be a whole number of milliseconds, got inf"),
        (1.5, "lease_ms must be a whole number of milliseconds, got 1.5"),
    ],
)
async def test_receive_and_renew_refuse_a_lease_ms_out_of_range(
    store: Store, lease_ms: int, message: str
) -> None:
    with trio.fail_after(10):
        producer = Producer(store, "q", result_list=L)
        await store.command("LPUSH", L, R1)
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            await producer.receive_results(1, lease_ms=lease_ms)
        assert await store.command("LRANGE", L, 0, -1) == [R1]
        assert await store.command("EXISTS", *K.reader_state()) == 0
        (delivery,) = await producer.receive_results(1, lease_ms=60_000)
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            await producer.renew_result(delivery, lease_ms=lease_ms)
        assert await producer.receive_results(1, lease_ms=604_800_000) == []


# -- 4. --json: exact bytes -------------------------------------------------------------------


def test_json_writes_each_record_byte_for_byte(redis_url: str) -> None:
    push(redis_url, R1, NOT_UTF8, R2)
    result = invoke(["results", "--list", L, "--json"], redis_url)
    assert result.exit_code == 0, result.output
    assert result.stdout_bytes == R1 + b"\n" + NOT_UTF8 + b"\n" + R2 + b"\n"
    assert result.stdout_bytes.split(b"\n")[:3] == [R1, NOT_UTF8, R2]
    popped = invoke(["results", "--list", L, "--json", "--pop", "--count", "2"], redis_url)
    assert popped.exit_code == 0, popped.output
    assert popped.stdout_bytes == R1 + b"\n" + NOT_UTF8 + b"\n"
    assert do(redis_url, ("LRANGE", L, 0, -1))[0] == [R2]


# -- 5. one classification: a record that is not UTF-8 is unparsable -------------------------


def test_follow_leaves_a_record_that_is_not_utf8_leased_and_reports_it_once(
    redis_url: str,
) -> None:
    push(redis_url, R1, NOT_UTF8, R2)
    listed = invoke(["results", "--list", L], redis_url)
    assert listed.stdout.splitlines() == [
        "r1  200  one",
        '?  (not a terminal record)  {"id":"u1","status_code":200,"payload":"\ufffd\ufffd bytes"}',
        "r2  200  two",
    ]
    result = invoke(["results", "--list", L, "--follow", "--json", "--count", "2"], redis_url)
    assert result.exit_code == 0, result.output
    assert result.stdout_bytes == R1 + b"\n" + R2 + b"\n"
    assert result.stderr.splitlines() == [
        f"claimkit results: {L}: unparsable record of {len(NOT_UTF8)} bytes (not UTF-8 "
        "text), left leased as claim 'u1': not acked, not deleted "
        "(docs/results.md#unparsable-records)"
    ]
    # Leased under the id Redis's decoder read, not acked: no tombstone for it.
    claimed, index, tombstones, left = do(
        redis_url,
        ("HGETALL", K.claimed),
        ("ZRANGE", K.index, 0, -1),
        ("ZRANGE", K.tombstones, 0, -1),
        ("EXISTS", L),
    )
    assert claimed == {b"u1": NOT_UTF8}
    assert index == [b"u1"]
    assert sorted(tombstones) == [b"r1", b"r2"]
    assert left == 0


async def test_the_reader_delivers_a_record_that_is_not_utf8_as_unparsable(store: Store) -> None:
    with trio.fail_after(10):
        await store.command("LPUSH", L, NOT_UTF8)
        async with open_result_reader(store, L, lease_seconds=60, poll_seconds=0.01) as reader:
            delivery = await reader.receive()
            assert (delivery.raw, delivery.record, delivery.claim_id) == (NOT_UTF8, None, "u1")
            assert delivery.unparsable == "not UTF-8 text"
            assert delivery.dedup_key is None
            assert reader.held == [delivery]


# -- 7. Ctrl-C and SIGTERM during --exec ------------------------------------------------------


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie no one reaped counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_stopping_follow_exec_stops_the_commands_group_and_leaves_the_record_leased(
    redis_url: str, tmp_path: Path, how: str
) -> None:
    push(redis_url, R1)
    pid_file = tmp_path / "pid"
    # A background job of the shell: it ignores SIGINT (as sh makes it), outlives the shell
    # unless its process group is stopped.
    command = f"sleep 1000 & echo $! > {pid_file}.tmp; mv {pid_file}.tmp {pid_file}; wait"
    err_path = tmp_path / "err"
    with err_path.open("wb") as err:
        proc = subprocess.Popen(
            [
                *(str(CLAIMKIT), "results", "--follow", "--list", L, "--redis-url", redis_url),
                *("--lease", "60", "--poll", "0.05", "--exec", command),
            ],
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,  # its own group: the "terminal's" foreground group
        )
    grandchild: int | None = None
    try:

        def started() -> bool:
            assert proc.poll() is None, err_path.read_text()
            return pid_file.exists()

        wait_until("the --exec command's background job", started, 60)
        grandchild = int(pid_file.read_text())
        assert _running(grandchild)
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)  # what a Ctrl-C at the terminal sends
        else:
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, err_path.read_text()
        wait_until("the background job to be stopped", lambda: not _running(grandchild), 30)
        # Not acked: leased, no tombstone; it comes back after the lease.
        assert do(redis_url, ("HGETALL", K.claimed), ("EXISTS", K.tombstones, L)) == [
            {b"r1": R1},
            0,
        ]
        assert do(redis_url, ("ZCARD", K.index))[0] == 1
        assert err_path.read_text() == ""
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        if grandchild is not None and _running(grandchild):
            os.kill(grandchild, signal.SIGKILL)


# -- 9. docs/cli.md shows inspect's result-list line as inspect prints it ----------------------


def test_cli_docs_show_inspects_result_list_line(redis_url: str) -> None:
    from support import config_json

    do(
        redis_url,
        ("LPUSH", "result-list", R1, R2),
        ("HSET", "result-list:result-claim-owners", "a", "o", "b", "o"),
        ("ZADD", "result-list:result-claims-idx", 1, "a", 9_999_999_999_999, "b"),
        ("ZADD", "result-list:result-ack-tombstones", 9_999_999_999_999, "t1"),
    )
    shown = invoke(["inspect", "-q", "q", "--transport-config", config_json(redis_url, queue="q")])
    assert shown.exit_code == 0, shown.output
    line = shown.stdout.splitlines()[-1]
    assert line == "result list result-list: pending 2, leased 2 (1 past their lease), tombstones 1"
    docs = (Path(__file__).resolve().parent.parent / "docs" / "cli.md").read_text()
    assert f"```\n{line}\n```" in docs
