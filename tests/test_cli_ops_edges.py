"""Operator commands at the edges a new user hit (SPEC §8, docs/operations.md):

- odd floats (``inf``, ``nan``, ``1e23``, ``1e400``, negative) in scores and deadlines are
  shown, never a traceback, and every ``--json`` output stays strict JSON;
- ``dead list --json`` gives each member exactly (``member_base64`` when not UTF-8);
- ``dead requeue`` refuses what the consumer would dead-letter again, with the reason;
- ``dead purge`` reports named ids it did not find, like requeue;
- ``results --follow`` rides out a Redis restart and never loses a record it received;
- ``drain --dry-run`` shows its table and its count from one read;
- the runbook's ``inspect --json`` field list matches the code.
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pytest
import trio
from support import StoreWrapper, do, invoke, wait_until

from claimkit.cli.console import format_duration, format_time
from claimkit.ops.results import follow_results
from claimkit.store import Arg, Store, StoreUnavailable

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from typer.testing import Result

    from claimkit.dev.redis_server import RedisServer
    from claimkit.protocol.result_delivery import ResultDelivery
    from claimkit.store.scripts import Script

T = TypeVar("T")
ROOT = Path(__file__).resolve().parent.parent
CLAIMKIT = Path(sys.executable).with_name("claimkit")
TOKEN = "ab" * 16


def no_traceback(result: Result, code: int = 0) -> None:
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def strict_json(text: str) -> Any:
    """Parse ``text`` as JSON the way jq, Go or JavaScript would: no Infinity, no NaN."""

    def refuse(name: str) -> Any:
        raise AssertionError(f"not valid JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def envelope(rid: str, deadline: str, *, kind: bool = True) -> bytes:
    """A member whose ``data.deadline`` is the raw JSON text ``deadline``."""
    head = '"request_kind":"plain",' if kind else ""
    return (
        f'{{"internal":{{"request_token":"{TOKEN}"}},{head}'
        f'"data":{{"id":"{rid}","deadline":{deadline}}}}}'
    ).encode()


# -- 1. time formatting survives any float -------------------------------------------------


@pytest.mark.parametrize(
    ("ts", "shown"),
    [
        (math.inf, "∞"),
        (-math.inf, "-∞"),
        (math.nan, "?"),
        (1e23, "unix 1e+23 (out of range)"),
        (-1e23, "unix -1e+23 (out of range)"),
        (253_402_300_800.0, "unix 2.53402e+11 (out of range)"),  # year 10000
        (-5.0, "1969-12-31T23:59:55Z"),
        (1_700_000_000.0, "2023-11-14T22:13:20Z"),
        (None, "-"),
    ],
)
def test_format_time_shows_any_float(ts: float | None, shown: str) -> None:
    assert format_time(ts) == shown


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (math.inf, "∞"),
        (-math.inf, "∞"),
        (math.nan, "?"),
        (1e23, "1.16e+18d"),
        (-1e23 + 1.7e9, "1.16e+18d"),
        (90_000.0, "1d01h"),
        (-0.25, "250ms"),
    ],
)
def test_format_duration_shows_any_float(seconds: float, shown: str) -> None:
    assert format_duration(seconds) == shown


def test_dead_list_survives_odd_deadlines_and_scores(redis_url: str) -> None:
    do(
        redis_url,
        ("ZADD", "badq:dead", 1_700_000_000, envelope("huge", "1e400")),
        ("ZADD", "badq:dead", 1_700_000_001, envelope("big", "1e23")),
        ("ZADD", "badq:dead", "+inf", envelope("late", "1900000000")),
    )
    result = invoke(["dead", "list", "-q", "badq"], redis_url)
    no_traceback(result)
    out = result.stdout
    assert "huge" in out
    assert "in ∞" in out
    assert "in 1.16e+18d" in out  # a deadline of 1e23, shown relative to the server clock
    assert "late" in out
    assert "invalid: deadline is missing or invalid" in out


def test_inspect_survives_a_huge_or_infinite_pending_score(redis_url: str) -> None:
    do(redis_url, ("ZADD", "hq", "1e23", envelope("a", "1900000000")))
    result = invoke(["inspect", "-q", "hq"], redis_url)
    no_traceback(result)
    assert "oldest pending deadline unix 1e+23 (out of range) (in 1.16e+18d)" in result.stdout

    do(
        redis_url,
        ("ZADD", "hq", "-inf", envelope("b", "1")),
        # A claim written by someone else with odd numbers everywhere.
        ("ZADD", "hq:claims-idx", "+inf", "c1"),
        ("HSET", "hq:claim-owners", "c1", TOKEN),
        ("HSET", "hq:claimed", "c1", b"x", "c1:score", "not a number"),
        ("HSET", "hq:deliveries", "c1", "many"),
    )
    result = invoke(["inspect", "-q", "hq"], redis_url)
    no_traceback(result)
    assert "oldest pending deadline -∞ (∞ ago)" in result.stdout
    assert "c1" in result.stdout

    shown = invoke(["inspect", "-q", "hq", "--json"], redis_url)
    no_traceback(shown)
    doc = strict_json(shown.stdout)
    assert doc["oldest_pending_deadline"] == "-inf"
    assert doc["claims"][0]["lease_expiry"] == "inf"
    assert doc["claims"][0]["lease_left_seconds"] == "inf"
    assert doc["claims"][0]["score"] is None
    assert doc["claims"][0]["deliveries"] == 0


# -- 2. dead list --json: strict and exact -------------------------------------------------


def test_dead_list_json_is_strict_and_every_member_exact(redis_url: str) -> None:
    binary = b"\xff\xfe bin"
    accented = envelope("café", "1900000000")
    surrogate = b'{"request_kind":"plain","data":{"id":"\\ud800","deadline":1900000000}}'
    do(
        redis_url,
        ("ZADD", "badq:dead", 1, envelope("inf", "1e400")),
        ("ZADD", "badq:dead", 2, binary),
        ("ZADD", "badq:dead", 3, accented),
        ("ZADD", "badq:dead", "+inf", surrogate),
    )
    result = invoke(["dead", "list", "-q", "badq", "--json"], redis_url)
    no_traceback(result)
    assert "Infinity" not in result.stdout
    doc = strict_json(result.stdout)
    first, second, third, fourth = doc["dead"]
    assert first["deadline"] == "inf"
    assert first["member"] == envelope("inf", "1e400").decode()
    assert first["cannot_requeue"] == "deadline is missing or invalid (Unix seconds)."
    assert second["member"] is None
    assert base64.b64decode(second["member_base64"]) == binary
    assert second["cannot_requeue"].startswith("request is not valid JSON")
    assert third["member"].encode() == accented
    assert "member_base64" not in third
    assert third["cannot_requeue"] is None
    assert fourth["dead_at"] == "inf"
    assert fourth["id"] is None  # a lone surrogate cannot be printed as UTF-8
    assert fourth["member"].encode() == surrogate

    table = invoke(["dead", "list", "-q", "badq"], redis_url)
    no_traceback(table)
    assert "café" in table.stdout
    assert "? (unreadable)" in table.stdout


# -- 3. requeue only what the consumer accepts ---------------------------------------------


def test_requeue_refuses_what_the_consumer_would_dead_letter_again(redis_url: str) -> None:
    good = envelope("good", "1900000000")
    bad = {
        "huge": envelope("huge", "1e400"),
        "nokind": envelope("nokind", "1900000000", kind=False),
        "strdl": envelope("strdl", '"soon"'),
    }
    junk = b"\xff\xfe bin"
    do(
        redis_url,
        ("ZADD", "badq:dead", 1, good, 2, bad["huge"], 3, bad["nokind"], 4, bad["strdl"]),
        ("ZADD", "badq:dead", 5, junk),
    )
    named = invoke(["dead", "requeue", "-q", "badq", "huge", "nokind"], redis_url)
    no_traceback(named, 1)
    assert named.stdout.splitlines() == [
        "claimkit dead requeue badq: requeued=0 refused=2 not_found=0",
        "  refused huge: deadline is missing or invalid (Unix seconds).",
        "  refused nokind: invalid request: Object missing required field `request_kind`",
    ]
    assert named.stderr.count("\n") == 1
    assert named.stderr.startswith("claimkit: 2 refused and left dead")

    everything = invoke(["dead", "requeue", "-q", "badq", "--all", "--json"], redis_url)
    no_traceback(everything, 1)
    doc = strict_json(everything.stdout)
    assert doc["requeued"] == ["good"]
    assert [r["id"] for r in doc["refused"]] == ["huge", "nokind", "strdl", None]
    assert doc["refused"][3]["reason"].startswith("request is not valid JSON")
    # Only the good one moved; nothing went back at a score of inf.
    pending = do(redis_url, ("ZRANGE", "badq", 0, -1, "WITHSCORES"))[0]
    assert pending == [[good, 1_900_000_000.0]]
    left = do(redis_url, ("ZRANGE", "badq:dead", 0, -1))[0]
    assert left == [bad["huge"], bad["nokind"], bad["strdl"], junk]


# -- 4. purge reports what it did not find -------------------------------------------------


def test_purge_reports_named_ids_it_did_not_find(redis_url: str) -> None:
    do(redis_url, ("ZADD", "badq:dead", 1, envelope("strdl", '"soon"')))
    result = invoke(["dead", "purge", "-q", "badq", "strdl", "nosuch"], redis_url)
    no_traceback(result, 1)
    assert result.stdout == "claimkit dead purge badq: purged=1 not_found=1\n"
    assert result.stderr == "claimkit: no dead letter for 'nosuch'\n"
    assert do(redis_url, ("EXISTS", "badq:dead"))[0] == 0

    do(redis_url, ("ZADD", "badq:dead", 1, envelope("a", "1900000000")))
    shown = invoke(["dead", "purge", "-q", "badq", "a", "--json"], redis_url)
    no_traceback(shown)
    assert strict_json(shown.stdout) == {"queue": "badq", "purged": 1, "not_found": []}


# -- 5. results --follow: a Redis restart, a lost reply --------------------------------------


class LosesReplies(StoreWrapper):
    """A store whose first ``lose`` replies of the receive script are lost after Redis ran
    it (the connection dies on the way back), as a Redis restart can do."""

    def __init__(self, inner: Store, lose: int) -> None:
        super().__init__(inner)
        self.lose = lose

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[Arg]) -> Any:
        reply = await self.inner.run(script, keys, args)
        if script.name == "result-receive" and reply and self.lose > 0:
            self.lose -= 1
            raise StoreUnavailable("Connection lost while receiving response")
        return reply


async def test_follow_never_loses_a_record_whose_reply_was_lost(store: Store) -> None:
    """A receive whose reply was lost left its record leased under a token never learned:
    it comes back after the (short) lease and is printed then; each record is acked once."""
    records = [b'{"id":"r1"}', b'{"id":"r2"}', b'{"id":"r3"}']
    await store.command("LPUSH", "res", *records)
    emitted: list[bytes] = []
    notes: list[str] = []

    async def handle(delivery: ResultDelivery) -> bool:
        emitted.append(delivery.raw)
        return True

    with trio.fail_after(20):
        acked = await follow_results(
            LosesReplies(store, lose=2),
            "res",
            handle=handle,
            notify=notes.append,
            count=3,
            lease_seconds=0.3,
            poll_seconds=0.02,
            retry_first=0.01,
        )
    assert acked == 3
    assert sorted(emitted) == records
    assert "unavailable" in notes[0]
    assert "is back" in notes[1]
    assert await store.command("EXISTS", "res", "res:result-claimed", "res:result-claims-idx") == 0
    assert sorted(await store.command("ZRANGE", "res:result-ack-tombstones", 0, -1)) == [
        b"r1",
        b"r2",
        b"r3",
    ]


async def test_cancelled_follow_leaves_the_record_leased(store: Store) -> None:
    handling = trio.Event()

    async def hang(delivery: ResultDelivery) -> bool:
        handling.set()
        await trio.sleep_forever()  # Ctrl-C while the record is being handled
        return True

    await store.command("LPUSH", "res", b'{"id":"old"}', b'{"id":"new"}')
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:

            async def follow() -> None:
                await follow_results(store, "res", handle=hang, notify=lambda _line: None)

            nursery.start_soon(follow)
            await handling.wait()
            nursery.cancel_scope.cancel()
    assert await store.command("LRANGE", "res", 0, -1) == [b'{"id":"new"}']
    assert await store.command("HGETALL", "res:result-claimed") in (
        {b"old": b'{"id":"old"}'},
        [b"old", b'{"id":"old"}'],
    )
    assert await store.command("ZCARD", "res:result-claims-idx") == 1


@pytest.mark.slow
def test_follow_rides_out_a_redis_restart(
    redis_factory: Callable[..., RedisServer], tmp_path: Path
) -> None:
    server = redis_factory(aof="always")
    url = server.url
    out_path, err_path = tmp_path / "follow.out", tmp_path / "follow.err"
    with out_path.open("wb") as out, err_path.open("wb") as err:
        proc = subprocess.Popen(
            [
                *(str(CLAIMKIT), "results", "--follow", "--json", "--poll", "0.1"),
                *("--list", "res", "--redis-url", url),
            ],
            stdout=out,
            stderr=err,
            env={**os.environ, "COLUMNS": "200"},
        )
    try:

        def lines() -> list[str]:
            assert proc.poll() is None, err_path.read_text()
            return out_path.read_text().splitlines()

        do(url, ("LPUSH", "res", b'{"id":"before"}'))
        wait_until("the first record", lambda: lines() == ['{"id":"before"}'])
        server.kill()
        wait_until("the outage line", lambda: "is unavailable" in err_path.read_text())
        server.restart()
        do(url, ("LPUSH", "res", b'{"id":"after1"}', b'{"id":"after2"}'))
        wait_until("the records after the restart", lambda: len(lines()) == 3)
        assert lines() == ['{"id":"before"}', '{"id":"after1"}', '{"id":"after2"}']
        assert "is back" in err_path.read_text()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    err_text = err_path.read_text()
    assert "Traceback" not in err_text
    assert err_text.count("is unavailable") == 1, err_text
    # Nothing left behind but the three records' tombstones.
    assert do(url, ("KEYS", "res*"))[0] == [b"res:result-ack-tombstones"]
    assert do(url, ("ZCARD", "res:result-ack-tombstones"))[0] == 3


# -- 6. drain --dry-run: one read ------------------------------------------------------------


def _claims(queue: str, ids: Sequence[str], *, owner: bool = True) -> list[Sequence[Arg]]:
    out: list[Sequence[Arg]] = []
    for rid in ids:
        out += [
            ("HSET", f"{queue}:claimed", rid, envelope(rid, "1900000000"), f"{rid}:score", 1),
            ("ZADD", f"{queue}:claims-idx", 1_900_000_000, rid),
        ]
        if owner:
            out.append(("HSET", f"{queue}:claim-owners", rid, TOKEN))
    return out


def test_drain_dry_run_table_states_no_total_that_could_disagree(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The table (one bounded read) and the count (batched reads, like a real drain's) are
    two reads; the table states no total of its own, so a consumer claiming between them
    cannot make the output contradict itself."""
    import claimkit.ops.inspect as inspect_module

    do(redis_url, *_claims("dq", ["a", "b", "c"]), *_claims("dq", ["g"], owner=False))
    real = inspect_module.snapshot

    async def snapshot_then_a_consumer_claims(store: Store, *args: Any, **kwargs: Any) -> Any:
        snap = await real(store, *args, **kwargs)
        await store.pipeline(_claims("dq", ["late1", "late2"]), transaction=True)
        return snap

    monkeypatch.setattr(inspect_module, "snapshot", snapshot_then_a_consumer_claims)
    result = invoke(["drain", "-q", "dq", "--release-all", "--dry-run", "--limit", "2"], redis_url)
    no_traceback(result)
    title = (
        "claims that would go back to pending: the first 2, earliest lease expiry first "
        "(the count below is the total)"
    )
    assert title in " ".join(result.stdout.split())
    assert result.stdout.splitlines()[-1] == (
        "claimkit drain dq: dry run: would release 5 of 6 claims (1 ghosts skipped); "
        "nothing changed"
    )


# -- 7. the runbook's inspect --json field list ----------------------------------------------


def test_the_runbook_lists_exactly_the_inspect_json_fields(redis_url: str) -> None:
    do(redis_url, *_claims("dq", ["a"]))
    assert invoke(["pause", "-q", "dq", "--reason", "r", "--for", "60"], redis_url).exit_code == 0
    doc = strict_json(invoke(["inspect", "-q", "dq", "--json"], redis_url).stdout)
    text = (ROOT / "docs" / "operations.md").read_text()
    start = r"^- `--json` prints one document for scripts"
    bullet = re.search(start + r".*?(?=^- |\n\n)", text, re.S | re.M)
    assert bullet is not None
    named = re.findall(r"`([a-z_]+)(?:\[\])?`", bullet.group(0))
    top = list(dict.fromkeys(n for n in named if n in doc))  # "claims" is also a row field
    assert top == list(doc), "top-level fields, in order"
    for nested in ("paused", "counts", "retry_set"):
        assert set(doc[nested]) <= set(named), nested
    assert set(doc["claims"][0]) <= set(named)
    documented_only = set(named) - set(doc) - set(doc["counts"]) - set(doc["retry_set"])
    documented_only -= set(doc["paused"])
    assert set(doc["consumers"][0]) <= set(named)
    documented_only -= set(doc["consumers"][0])
    assert documented_only - set(doc["claims"][0]) == {"null"}  # "(`null` when ...)"
