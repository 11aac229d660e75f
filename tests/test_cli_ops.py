"""The operator commands through typer's CliRunner (SPEC §8): every command, its output,
the Redis state it leaves, and every operator-mistake path (one line, exit status 1).

These tests are synchronous: each command runs its own ``trio.run``. Redis is seeded and
checked through :func:`redis`, which opens a store in a fresh trio loop.
"""

from __future__ import annotations

import gc
import io
import json
import re
from typing import TYPE_CHECKING, Any, TypeVar

import pytest
import trio
from rich.console import Console
from support import (
    closed_port,
    config_json,
    do,
    invoke,
    member,
    one_line_error,
    redis,
    server_now_sync,
)
from typer.testing import CliRunner

from claimkit.cli.app import app
from claimkit.cli.inspect_command import live_watch
from claimkit.ops.inspect import queue_key_types
from claimkit.producer import Producer
from claimkit.protocol.models import Invalid, parse_member
from claimkit.protocol.ops import QueueOps, new_token
from claimkit.store import Arg, Store, open_store

if TYPE_CHECKING:
    from collections.abc import Sequence

T = TypeVar("T")

Q = "jobs"
TOKEN_A = "a" * 32
TOKEN_B = "b" * 32
runner = CliRunner()


def claim_commands(
    queue: str, rid: str, *, token: str, expiry: float, score: int
) -> list[Sequence[Arg]]:
    raw = member(rid, score)
    return [
        ("HSET", f"{queue}:claimed", rid, raw, f"{rid}:score", score),
        ("HSET", f"{queue}:claim-owners", rid, token),
        ("ZADD", f"{queue}:claims-idx", repr(expiry), rid),
    ]


def seed(url: str) -> float:
    """Pending 3, claims 2 + a ghost (2 expired), dead 1, retry 2 (1 for jobs), results 2
    in result-list and 1 in custom-results. Returns the base server time."""
    now = server_now_sync(url)
    base = int(now)
    do(
        url,
        *[("ZADD", Q, base + i, member(f"p{i}", base + i)) for i in (300, 100, 200)],
        *claim_commands(Q, "c-old", token=TOKEN_A, expiry=now - 40.5, score=base + 10),
        *claim_commands(Q, "c-live", token=TOKEN_B, expiry=now + 250.25, score=base + 20),
        ("ZADD", f"{Q}:claims-idx", repr(now - 5), "ghost"),
        ("HSET", f"{Q}:deliveries", "c-old", 3),
        ("ZADD", f"{Q}:dead", 1234, member("d1", base + 5)),
        ("ZADD", "retry-sortedset", now + 3, member("r1", base + 9, request_queue_name=Q)),
        ("ZADD", "retry-sortedset", now + 4, member("r2", base + 9, request_queue_name="x")),
        ("LPUSH", "result-list", b'{"id":"x1"}', b'{"id":"x2"}'),
        ("LPUSH", "custom-results", b'{"id":"y1"}'),
    )
    return now


# coredis 6.9 leaves a failed connection's anyio memory streams unclosed; they warn when
# collected. Tests that connect to nothing collect them before they end, under this mark.
coredis_leaks_on_failed_connect = pytest.mark.filterwarnings(
    "ignore:Unclosed <MemoryObject:ResourceWarning"
)


# -- help --------------------------------------------------------------------------------------

COMMANDS = [
    ["inspect"],
    ["drain"],
    ["reclaim"],
    ["results"],
    ["cancel"],
    ["dead", "list"],
    ["dead", "requeue"],
    ["dead", "purge"],
]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_has_help_with_an_example(command: list[str]) -> None:
    result = invoke([*command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Example" in result.stdout
    assert f"claimkit {' '.join(command)} " in result.stdout


def test_the_dead_group_lists_its_commands() -> None:
    result = invoke(["dead", "--help"])
    assert result.exit_code == 0
    for name in ("list", "requeue", "purge"):
        assert name in result.stdout


# -- inspect -----------------------------------------------------------------------------------


def test_inspect_json_matches_the_redis_state_exactly(redis_url: str) -> None:
    now = seed(redis_url)
    base = int(now)
    transport = config_json(
        redis_url,
        queues=[
            {"queue_name": Q, "igw_base_url": "http://h:1", "result_queue_name": "custom-results"}
        ],
    )
    result = invoke(["inspect", "--queue", Q, "--json", "--transport-config", transport])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    t = doc["server_time"]
    assert t >= now
    expiries = {
        m.decode(): float(s)
        for m, s in do(redis_url, ("ZRANGE", f"{Q}:claims-idx", 0, -1, "WITHSCORES"))[0]
    }

    def row(rid: str, owner: str | None, score: float | None, deliveries: int) -> dict[str, Any]:
        left = expiries[rid] - t
        return {
            "id": rid,
            "owner": owner,
            "consumer": None,  # the seeded tokens name no consumer (bare hex, as before ids)
            "lease_expiry": expiries[rid],
            "lease_left_seconds": round(left, 6),
            "expired": left <= 0,
            "score": score,
            "deliveries": deliveries,
            "ghost": owner is None,
            "held_seconds": None,
            "held_exact": False,
        }

    assert doc == {
        "queue": Q,
        "redis_url": redis_url,
        "server_time": t,
        "paused": None,
        "counts": {
            "pending": 3,
            "claimed": 2,
            "orphans": 0,
            "expired": 2,
            "retrying": 1,
            "dead": 1,
            "results": 1,
            "redelivered": 1,
        },
        "oldest_pending_deadline": float(base + 100),
        "retry_set": {"name": "retry-sortedset", "total": 2, "for_queue": 1, "exact": True},
        "result_lists": {"custom-results": 1},
        "limit": 50,
        "claims_exact": True,
        "claims_truncated": False,
        "claims": [
            row("c-old", TOKEN_A, float(base + 10), 3),
            row("ghost", None, None, 0),
            row("c-live", TOKEN_B, float(base + 20), 0),
        ],
        "consumers": [
            {
                "consumer": None,
                "state": "unregistered",
                "alive": False,
                "expires": None,
                "expires_in_seconds": None,
                "claims": 2,
                "oldest_claim_age_seconds": None,
                "host": None,
                "pid": None,
                "started": None,
                "version": None,
            }
        ],
    }


def test_inspect_prints_counts_and_the_claim_table(redis_url: str) -> None:
    seed(redis_url)
    result = invoke(["inspect", "-q", Q], redis_url)
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert f"queue {Q}  on {redis_url}" in out
    assert (
        "pending 3  claimed 2  orphans 0  expired 2  retrying 1  dead 1  results 2  redelivered 1"
        in out
    )
    assert "oldest pending deadline " in out
    assert "claims (3 of 3, earliest lease expiry first)" in out
    lines = {line.split("│")[1].strip(): line for line in out.splitlines() if line.startswith("│")}
    # The consumers table's one row (the seeded tokens name no consumer), then the claims.
    assert set(lines) == {"unknown", "c-old", "ghost", "c-live"}
    assert "unregistered" in lines["unknown"]
    assert lines["c-old"].split("│")[2].strip() == "unknown"  # the claim's consumer
    assert "aaaaaaaa" in lines["c-old"], "owner tokens are shortened"
    assert TOKEN_A not in out, "owner tokens are shortened"
    assert "expired 40." in lines["c-old"]
    assert "(ghost)" in lines["ghost"]
    assert "4m" in lines["c-live"]


def test_inspect_limit_bounds_the_rows(redis_url: str) -> None:
    seed(redis_url)
    result = invoke(["inspect", "-q", Q, "--limit", "1", "--json"], redis_url)
    doc = json.loads(result.stdout)
    assert [c["id"] for c in doc["claims"]] == ["c-old"]
    assert doc["claims_truncated"] is True
    assert doc["counts"]["claimed"] == 2  # the ghost index entry is no claim
    text = invoke(["inspect", "-q", Q, "--limit", "1"], redis_url).stdout
    assert "claims (1 of 3" in text


def test_inspect_never_changes_state(redis_url: str) -> None:
    seed(redis_url)

    async def dump(store: Store) -> dict[bytes, bytes]:
        return {k: await store.command("DUMP", k) for k in await store.command("KEYS", "*")}

    before = redis(redis_url, dump)
    assert invoke(["inspect", "-q", Q], redis_url).exit_code == 0
    assert invoke(["inspect", "-q", Q, "--json"], redis_url).exit_code == 0
    assert redis(redis_url, dump) == before


async def test_watch_redraws_and_tracks_held_time(store: Store) -> None:
    with trio.fail_after(10):
        sec, _ = await store.command("TIME")
        for command in claim_commands(Q, "c1", token=TOKEN_A, expiry=int(sec) + 100, score=1):
            await store.command(*command)
        # A claimkit token carries its claim time: three hours ago, shown exactly.
        stamped = new_token(now=int(sec) - 3 * 3600 - 30)
        for command in claim_commands(Q, "c2", token=stamped, expiry=int(sec) + 200, score=1):
            await store.command(*command)
        out = io.StringIO()
        console = Console(file=out, width=200, force_terminal=False)
        await live_watch(
            store,
            Q,
            console=console,
            key_types=queue_key_types(Q),
            result_lists=["result-list"],
            retry_set="retry-sortedset",
            limit=10,
            interval=0.1,
            refreshes=2,
        )
        text = out.getvalue()
        assert "claims (2 of 2" in text
        # The last redraw's rows.
        c1_line = [line for line in text.splitlines() if "aaaaaaaa" in line][-1]
        c2_line = [line for line in text.splitlines() if stamped[-8:] in line][-1]
        assert re.search(r"│ +≥\d+ms │", c1_line), c1_line  # foreign token: seen, a lower bound
        assert re.search(r"│ +3h00m │", c2_line), c2_line


@coredis_leaks_on_failed_connect
async def test_watch_shows_an_unreachable_redis_and_keeps_going() -> None:
    with trio.fail_after(10):
        url = f"redis://u:s3cret@127.0.0.1:{closed_port()}/0"
        async with open_store(url) as store:
            out = io.StringIO()
            await live_watch(
                store,
                Q,
                console=Console(file=out, width=200),
                key_types=queue_key_types(Q),
                result_lists=["result-list"],
                retry_set="retry-sortedset",
                limit=10,
                interval=0.1,
                refreshes=2,
            )
        text = out.getvalue()
        assert "is unavailable" in text
        assert "retrying" in text
        assert "s3cret" not in text
    gc.collect()


async def test_watch_marks_the_view_stale_while_redis_is_frozen(redis_factory: Any) -> None:
    """A SIGSTOPped Redis keeps its connections open and answers nothing: the view on
    screen says when it was read, turns STALE (naming since when) while the read hangs,
    and is fresh again once Redis answers."""
    server = redis_factory()
    out = io.StringIO()
    console = Console(file=out, width=200, force_terminal=True, color_system=None)

    def screen() -> str:
        return out.getvalue()

    async def shown(text: str, after: int = 0) -> int:
        """Wait until ``text`` is on screen past offset ``after``; return where it starts."""
        while (at := screen().find(text, after)) < 0:
            await trio.sleep(0.02)
        return at

    with trio.fail_after(30):
        async with open_store(server.url) as store, trio.open_nursery() as nursery:
            for command in claim_commands(Q, "c1", token=TOKEN_A, expiry=2e9, score=1):
                await store.command(*command)
            nursery.start_soon(
                lambda: live_watch(
                    store,
                    Q,
                    console=console,
                    key_types=queue_key_types(Q),
                    result_lists=["result-list"],
                    retry_set="retry-sortedset",
                    limit=10,
                    interval=0.1,
                    stale_after=1.0,
                )
            )
            fresh = await shown("claims (1 of 1")
            assert re.search(r"read \d\d:\d\d:\d\dZ, \d+ms ago", screen()), screen()
            server.pause()
            try:
                # The store waits 10 s for a reply: the marker comes while the read hangs.
                with trio.fail_after(8):
                    stale = await shown(f"STALE: Redis at {store.url} not answering since ", fresh)
            finally:
                server.resume()
            line = screen()[stale:].splitlines()[0]
            assert re.fullmatch(
                rf"STALE: Redis at {re.escape(store.url)} not answering since "
                r"\d\d:\d\d:\d\dZ; retrying\. Below: the view read \d\d:\d\d:\d\dZ, "
                r"[\d.]+m?s ago *",
                line,
            ), line
            # The last view stays on screen under the marker, and Redis answers again: a
            # fresh frame, whose first line says when it was read, follows the marker.
            assert "claims (1 of 1" in screen()[stale:]
            fresh_line = re.compile(r"(?<!the view )read \d\d:\d\d:\d\dZ, [\d.]+m?s ago")
            while not fresh_line.search(screen(), stale):
                await trio.sleep(0.02)
            nursery.cancel_scope.cancel()


def test_watch_and_json_do_not_combine(redis_url: str) -> None:
    one_line_error(
        invoke(["inspect", "-q", Q, "--watch", "--json"], redis_url),
        "--watch and --json cannot be combined: --json prints one document",
        code=2,
    )


# -- operator mistakes, for every command --------------------------------------------------------

QUEUE_COMMANDS = [
    ["inspect", "-q", Q],
    ["drain", "-q", Q, "--release-all"],
    ["dead", "list", "-q", Q],
    ["dead", "requeue", "-q", Q, "--all"],
    ["dead", "purge", "-q", Q, "--all"],
]
ALL_COMMANDS = [*QUEUE_COMMANDS, ["reclaim", "--once"], ["results"], ["cancel", "r1"]]


@pytest.mark.parametrize("command", QUEUE_COMMANDS, ids=" ".join)
def test_an_unknown_queue_is_one_line(redis_url: str, command: list[str]) -> None:
    args = [*command, "--transport-config", config_json(redis_url, queue=Q)]
    args[args.index(Q)] = "nope"
    one_line_error(invoke(args), "unknown queue 'nope' (configured: jobs)")


@pytest.mark.parametrize("command", QUEUE_COMMANDS, ids=" ".join)
def test_a_pending_key_of_the_wrong_type_is_one_line(redis_url: str, command: list[str]) -> None:
    do(redis_url, ("SET", Q, "not a queue"))
    one_line_error(
        invoke(command, redis_url),
        f"key '{Q}' holds a string, not a sorted set: is the queue or list name right?",
    )


@pytest.mark.parametrize("command", QUEUE_COMMANDS, ids=" ".join)
def test_a_queue_named_like_the_result_list_is_checked_as_a_queue(
    redis_url: str, command: list[str]
) -> None:
    """`-q result-list` by mistake: the name is both the queue and (by default) the result
    list; it is checked as the queue, so the operator learns it holds a list."""
    do(redis_url, ("RPUSH", "result-list", "{}"))
    args = [*command]
    args[args.index(Q)] = "result-list"
    one_line_error(
        invoke(args, redis_url),
        "key 'result-list' holds a list, not a sorted set: is the queue or list name right?",
    )


@coredis_leaks_on_failed_connect
@pytest.mark.parametrize("command", ALL_COMMANDS, ids=" ".join)
def test_unreachable_redis_is_one_line_without_the_password(command: list[str]) -> None:
    url = f"redis://admin:s3cret@127.0.0.1:{closed_port()}/0"
    # In the environment: a password on the command line adds a warning line (test_secrets).
    no_url = config_json(queue=Q)
    line = one_line_error(invoke([*command, "--transport-config", no_url], url))
    assert line.startswith("claimkit: Redis at redis://admin:***@127.0.0.1:")
    assert "is unavailable" in line
    assert "s3cret" not in line
    gc.collect()


@pytest.mark.parametrize("command", ALL_COMMANDS, ids=" ".join)
def test_a_bad_or_missing_url_is_one_line(command: list[str]) -> None:
    line = one_line_error(invoke([*command, "--redis-url", "http://u:pw@h:1"]))
    assert "Redis URL must start with redis://" in line
    assert "pw@" not in line
    one_line_error(
        invoke(command),
        "url is required: set it in the transport config, pass --redis-url or set REDIS_URL",
    )


def test_a_bad_url_line_is_not_mangled_by_redaction() -> None:
    one_line_error(
        invoke(["inspect", "-q", Q, "--redis-url", "http://u:pw@h:1"]),
        "Redis URL must start with redis://, rediss:// or unix://, got 'http://u:***@h:1'",
    )


@pytest.mark.parametrize("command", ALL_COMMANDS, ids=" ".join)
def test_an_unreadable_config_file_is_one_line(command: list[str], tmp_path: Any) -> None:
    missing = tmp_path / "nope.json"
    line = one_line_error(invoke([*command, "--transport-config-file", str(missing)]))
    assert line.startswith(f"claimkit: cannot read {missing}")


# -- drain -------------------------------------------------------------------------------------


def test_drain_requires_release_all(redis_url: str) -> None:
    one_line_error(
        invoke(["drain", "-q", Q], redis_url),
        "drain needs --release-all (add --dry-run to preview what would be released)",
        code=2,
    )


def test_drain_dry_run_shows_and_changes_nothing(redis_url: str) -> None:
    seed(redis_url)
    before = do(redis_url, ("HGETALL", f"{Q}:claimed"), ("ZRANGE", Q, 0, -1, "WITHSCORES"))
    result = invoke(["drain", "-q", Q, "--release-all", "--dry-run"], redis_url)
    assert result.exit_code == 0, result.output
    assert "claims that would go back to pending: the first 3," in result.stdout
    assert result.stdout.splitlines()[-1] == (
        f"claimkit drain {Q}: dry run: would release 2 of 3 claims (1 ghosts skipped); "
        "nothing changed"
    )
    after = do(redis_url, ("HGETALL", f"{Q}:claimed"), ("ZRANGE", Q, 0, -1, "WITHSCORES"))
    assert after == before


def test_drain_releases_every_claim_at_its_score_and_is_idempotent(redis_url: str) -> None:
    now = seed(redis_url)
    base = int(now)
    pending_before = do(redis_url, ("ZRANGE", Q, 0, -1, "WITHSCORES"))[0]
    result = invoke(["drain", "-q", Q, "--release-all", "--batch-size", "1"], redis_url)
    assert result.exit_code == 0, result.output
    assert result.stdout == (
        f"claimkit drain {Q}: released=2 of 3 claims gone=0 renewed=0 other_owner=0 ghosts=1\n"
    )
    pending = do(redis_url, ("ZRANGE", Q, 0, -1, "WITHSCORES"))[0]
    assert sorted(pending, key=lambda p: p[1]) == sorted(
        [
            *pending_before,
            [member("c-old", base + 10), float(base + 10)],
            [member("c-live", base + 20), float(base + 20)],
        ],
        key=lambda p: p[1],
    )
    assert do(redis_url, ("HLEN", f"{Q}:claimed"), ("HLEN", f"{Q}:claim-owners")) == [0, 0]
    again = invoke(["drain", "-q", Q, "--release-all"], redis_url)
    assert again.stdout == (
        f"claimkit drain {Q}: released=0 of 1 claims gone=0 renewed=0 other_owner=0 ghosts=1\n"
    )


# -- reclaim -----------------------------------------------------------------------------------


def test_reclaim_requires_once_and_configured_queues(redis_url: str) -> None:
    one_line_error(
        invoke(["reclaim"], redis_url),
        "reclaim needs --once (serve runs the reclaimer continuously)",
        code=2,
    )
    one_line_error(
        invoke(["reclaim", "--once"], redis_url),
        "reclaim --once works on the configured queues: give a transport config "
        "(--transport-config or --transport-config-file) whose queues list them",
    )


def reclaim_scenario(url: str) -> tuple[str, int]:
    now = server_now_sync(url)
    base = int(now)
    do(
        url,
        *claim_commands(Q, "a", token=TOKEN_A, expiry=now - 1, score=base + 100),
        *claim_commands(Q, "poison", token=TOKEN_A, expiry=now - 2, score=base + 200),
        *claim_commands(Q, "live", token=TOKEN_B, expiry=now + 300, score=base + 300),
        *claim_commands("other", "b", token=TOKEN_B, expiry=now - 3, score=base + 400),
        ("ZADD", "other:claims-idx", 1, "ghost"),
        ("HSET", f"{Q}:deliveries", "poison", 2),
    )
    transport = config_json(
        url,
        max_deliveries=3,
        queues=[
            {"queue_name": Q, "igw_base_url": "http://h:1"},
            {"queue_name": "other", "igw_base_url": "http://h:1", "result_queue_name": "ores"},
        ],
    )
    return transport, base


def test_reclaim_once_redelivers_every_expired_claim(redis_url: str) -> None:
    transport, base = reclaim_scenario(redis_url)
    result = invoke(["reclaim", "--once", "--transport-config", transport])
    assert result.exit_code == 0, result.output
    assert result.stdout == (
        "claimkit reclaim: queues=2 redelivered=2 dead_lettered=1 ghosts=1 leases_restored=0 "
        "handed_on=0\n"
    )
    assert result.stderr == ""
    assert do(redis_url, ("ZRANGE", Q, 0, -1, "WITHSCORES"))[0] == [
        [member("a", base + 100), float(base + 100)]
    ]
    assert do(redis_url, ("ZRANGE", "other", 0, -1, "WITHSCORES"))[0] == [
        [member("b", base + 400), float(base + 400)]
    ]
    assert do(redis_url, ("ZRANGE", f"{Q}:claims-idx", 0, -1))[0] == [b"live"]
    assert do(redis_url, ("ZRANGE", f"{Q}:dead", 0, -1))[0] == [member("poison", base + 200)]
    assert do(redis_url, ("HGETALL", f"{Q}:deliveries"))[0] == {b"a": b"1"}
    record = json.loads(do(redis_url, ("RPOP", "result-list"))[0])
    assert record["id"] == "poison"
    assert record["error_code"] == "MAX_DELIVERIES_EXCEEDED"
    again = invoke(["reclaim", "--once", "--transport-config", transport])
    assert again.stdout == (
        "claimkit reclaim: queues=2 redelivered=0 dead_lettered=0 ghosts=0 leases_restored=0 "
        "handed_on=0\n"
    )


def test_reclaim_once_json(redis_url: str) -> None:
    transport, _ = reclaim_scenario(redis_url)
    result = invoke(["reclaim", "--once", "--json", "--transport-config", transport])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {
        "queues": {
            Q: {
                "redelivered": 1,
                "dead_lettered": 1,
                "ghosts": 0,
                "orphans": 0,
                "leases_restored": 0,
                "handed_on": 0,
            },
            "other": {
                "redelivered": 1,
                "dead_lettered": 0,
                "ghosts": 1,
                "orphans": 0,
                "leases_restored": 0,
                "handed_on": 0,
            },
        },
        "redelivered": 2,
        "dead_lettered": 1,
        "ghosts": 1,
        "orphans": 0,
        "leases_restored": 0,
        "handed_on": 0,
        "failover_skipped": {},
    }


def test_reclaim_once_reports_a_wrong_key_type(redis_url: str) -> None:
    do(redis_url, ("SET", "other:claims-idx", "x"))
    transport = config_json(
        redis_url,
        queues=[
            {"queue_name": Q, "igw_base_url": "http://h:1"},
            {"queue_name": "other", "igw_base_url": "http://h:1"},
        ],
    )
    one_line_error(
        invoke(["reclaim", "--once", "--transport-config", transport]),
        "key 'other:claims-idx' holds a string, not a sorted set: is the queue or list name right?",
    )


# -- dead --------------------------------------------------------------------------------------


def test_dead_list_text_and_json(redis_url: str) -> None:
    good = member("d1", 1_900_000_000)
    do(redis_url, ("ZADD", f"{Q}:dead", 1_700_000_000, good, 1_700_000_001, b"garbage"))
    result = invoke(["dead", "list", "-q", Q], redis_url)
    assert result.exit_code == 0, result.output
    assert f"{Q}:dead (2 of 2, oldest first; full reasons: --json)" in result.stdout
    d1_row = next(line for line in result.stdout.splitlines() if "│ d1 " in line)
    # No config given: no guessed count (the default 10 may not be the consumer's).
    assert "max deliveries: lease expired max_deliveries times without an ack" in d1_row
    unreadable = next(line for line in result.stdout.splitlines() if "? (unreadable)" in line)
    assert "invalid: request is not valid JSON: JSON is malformed: invalid" in unreadable
    doc = json.loads(invoke(["dead", "list", "-q", Q, "--json", "--limit", "1"], redis_url).stdout)
    assert doc == {
        "queue": Q,
        "total": 2,
        "dead": [
            {
                "id": "d1",
                "dead_at": 1_700_000_000.0,
                "deadline": 1_900_000_000.0,
                "cause": "max_deliveries",
                "reason": "lease expired max_deliveries times without an ack (give the "
                "consumer's config for the count)",
                "member": good.decode(),
                "cannot_requeue": None,
            },
        ],
    }
    assert invoke(["dead", "list", "-q", "empty"], redis_url).stdout == "empty:dead is empty\n"


def test_dead_list_gives_the_cause_each_dead_letter_got_its_record_for(redis_url: str) -> None:
    """Both ways into <q>:dead, taken for real: the consumer's dead-letter script for a
    member it cannot serve, and ``reclaim --once`` at max_deliveries. ``dead list`` names
    each cause, and its reason is the error_message of the record the request got."""
    transport = config_json(redis_url, queue=Q, max_deliveries=2)
    now = server_now_sync(redis_url)
    do(
        redis_url,
        *claim_commands(Q, "tired", token=TOKEN_A, expiry=now - 1, score=int(now) + 600),
        ("HSET", f"{Q}:deliveries", "tired", 1),
    )
    assert invoke(["reclaim", "--once", "--transport-config", transport]).exit_code == 0
    bad = b'{"request_kind":"plain","data":{"id":"sloppy","deadline":"soon"}}'

    async def dead_letter(store: Store) -> None:
        invalid = parse_member(bad)
        assert isinstance(invalid, Invalid)
        await QueueOps(store, Q, dedup_ttl=600).dead_letter([invalid])

    do(redis_url, ("ZADD", Q, 1, bad))
    redis(redis_url, dead_letter)
    records = {
        r["id"]: r["error_message"]
        for r in map(json.loads, do(redis_url, ("LRANGE", "result-list", 0, -1))[0])
    }
    assert set(records) == {"tired", "sloppy"}
    listed = invoke(["dead", "list", "-q", Q, "--json", "--transport-config", transport])
    assert listed.exit_code == 0, listed.output
    causes = {d["id"]: (d["cause"], d["reason"]) for d in json.loads(listed.stdout)["dead"]}
    assert causes == {
        "tired": ("max_deliveries", records["tired"]),
        "sloppy": ("invalid", records["sloppy"]),
    }
    assert records["tired"] == "lease expired 2 times without an ack (max_deliveries=2)"


def test_dead_list_fits_80_columns(redis_url: str) -> None:
    base = int(server_now_sync(redis_url))
    do(
        redis_url,
        ("ZADD", f"{Q}:dead", base - 90, member("a-rather-long-request-id-0001", base + 7200)),
        ("ZADD", f"{Q}:dead", base - 30, b'{"data":{"id":"x2","deadline":"later"}}' + b" " * 300),
    )
    result = runner.invoke(
        app, ["dead", "list", "-q", Q], env={"REDIS_URL": redis_url, "COLUMNS": "80"}
    )
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert max(map(len, lines)) <= 80, result.stdout
    x2 = [line for line in lines if "│ x2 " in line]
    assert len(x2) == 1  # one line per dead letter, the reason cut short
    assert re.search(r"│ 3\d\.\ds ago +│ unreadable +│ invalid: .*…", x2[0]), x2[0]
    first = next(i for i, line in enumerate(lines) if "a-rather-long-reques" in line)
    row = r"│ 1m3\ds ago +│ in (2h00m|1h59m) +│ max deliveries: lease expir"
    assert re.search(row, lines[first]), lines[first]
    assert "t-id-0001" in lines[first + 1]  # the id folds; the row's cells stay whole


def test_the_claim_table_fits_80_columns(redis_url: str) -> None:
    now = server_now_sync(redis_url)
    rid = "req-2f9c1e7a-4b1d-4c3e-9f00-000000000001"
    do(redis_url, *claim_commands(Q, rid, token=TOKEN_A, expiry=now - 5, score=int(now) + 600))
    result = runner.invoke(app, ["inspect", "-q", Q], env={"REDIS_URL": redis_url, "COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert max(map(len, lines)) <= 80, result.stdout
    row = next(line for line in lines if "│ req-" in line)
    # Only the id folds; the lease, deliveries and deadline cells stay whole.
    assert re.search(r"│ aaaaaaaa │ expired \d\.\ds ago │ +0 │ in 9m5\ds │$", row), row


def test_tables_show_brackets_in_names_as_written(redis_url: str) -> None:
    """Ids and queue names are data, not rich markup: "[bold]" is shown, not swallowed."""
    queue = "q[red]"
    now = server_now_sync(redis_url)
    do(
        redis_url,
        *claim_commands(queue, "a[bold]b", token=TOKEN_A, expiry=now + 60, score=int(now) + 60),
        ("ZADD", f"{queue}:dead", int(now), member("d[i]1", int(now) + 60)),
    )
    shown = invoke(["inspect", "-q", queue], redis_url)
    assert shown.exit_code == 0, shown.output
    assert "│ a[bold]b " in shown.stdout
    listed = invoke(["dead", "list", "-q", queue], redis_url)
    assert listed.exit_code == 0, listed.output
    assert listed.stdout.startswith("q[red]:dead (1 of 1, ")
    assert "│ d[i]1 " in listed.stdout


def test_dead_requeue_by_id_and_all(redis_url: str) -> None:
    a, b, c = (member(x, 1_900_000_000 + i) for i, x in enumerate("abc"))
    do(redis_url, ("ZADD", f"{Q}:dead", 1, a, 2, b, 3, c, 4, b"junk"))
    result = invoke(["dead", "requeue", "-q", Q, "a"], redis_url)
    assert result.exit_code == 0, result.output
    assert result.stdout == f"claimkit dead requeue {Q}: requeued=1 refused=0 not_found=0\n"
    assert do(redis_url, ("ZRANGE", Q, 0, -1, "WITHSCORES"))[0] == [[a, 1_900_000_000.0]]

    missing = invoke(["dead", "requeue", "-q", Q, "b", "zz"], redis_url)
    assert missing.exit_code == 1
    assert missing.stdout == f"claimkit dead requeue {Q}: requeued=1 refused=0 not_found=1\n"
    assert missing.stderr == "claimkit: no dead letter for 'zz'\n"

    everything = invoke(["dead", "requeue", "-q", Q, "--all", "--json"], redis_url)
    assert everything.exit_code == 1  # junk was refused
    assert json.loads(everything.stdout) == {
        "queue": Q,
        "requeued": ["c"],
        "refused": [
            {
                "id": None,
                "dead_at": 4.0,
                "reason": "request is not valid JSON: JSON is malformed: invalid character "
                "(byte 0)",
            }
        ],
        "not_found": [],
    }
    assert do(redis_url, ("ZRANGE", f"{Q}:dead", 0, -1))[0] == [b"junk"]


def test_dead_requeue_needs_ids_or_all(redis_url: str) -> None:
    message = "name the ids to requeue or pass --all (not both)"
    one_line_error(invoke(["dead", "requeue", "-q", Q], redis_url), message, code=2)
    one_line_error(invoke(["dead", "requeue", "-q", Q, "a", "--all"], redis_url), message, code=2)


def test_dead_purge(redis_url: str) -> None:
    now = int(server_now_sync(redis_url))
    a, b, c = (member(x, 1_900_000_000) for x in "abc")
    do(redis_url, ("ZADD", f"{Q}:dead", now - 1000, a, now - 500, b, now, c))
    message = "say what to purge: ids, --all or --older-than SECONDS (exactly one)"
    one_line_error(invoke(["dead", "purge", "-q", Q], redis_url), message, code=2)
    one_line_error(invoke(["dead", "purge", "-q", Q, "a", "--all"], redis_url), message, code=2)
    assert invoke(["dead", "purge", "-q", Q, "a"], redis_url).stdout == (
        f"claimkit dead purge {Q}: purged=1 not_found=0\n"
    )
    assert invoke(["dead", "purge", "-q", Q, "--older-than", "100"], redis_url).stdout == (
        f"claimkit dead purge {Q}: purged=1 not_found=0\n"
    )
    assert do(redis_url, ("ZRANGE", f"{Q}:dead", 0, -1))[0] == [c]
    assert invoke(["dead", "purge", "-q", Q, "--all"], redis_url).stdout == (
        f"claimkit dead purge {Q}: purged=1 not_found=0\n"
    )
    assert do(redis_url, ("EXISTS", f"{Q}:dead"))[0] == 0


# -- results and cancel ------------------------------------------------------------------------

RECORDS = [
    b'{"id":"r1","status_code":200,"payload":"{\\"text\\":\\"hi\\"}"}',
    b'{"id":"r2","payload":"{\\"error\\":\\"deadline exceeded\\"}",'
    b'"error_code":"DEADLINE_EXCEEDED","error_message":"deadline exceeded"}',
    b"not a record",
]


def push_records(url: str, name: str = "result-list") -> None:
    do(url, ("LPUSH", name, *RECORDS))  # LPUSH: r1 is the oldest, read first


def test_results_peek_reads_without_removing(redis_url: str) -> None:
    push_records(redis_url)
    result = invoke(["results", "--peek"], redis_url)
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [
        'r1  200  {"text":"hi"}',
        "r2  DEADLINE_EXCEEDED  deadline exceeded",
        "?  (not a terminal record)  not a record",
    ]
    assert do(redis_url, ("LLEN", "result-list"))[0] == 3


def test_results_reads_without_removing_by_default(redis_url: str) -> None:
    push_records(redis_url)
    result = invoke(["results", "--count", "2", "--json"], redis_url)
    assert result.exit_code == 0, result.output
    assert result.stdout.encode().splitlines() == RECORDS[:2]
    assert do(redis_url, ("LRANGE", "result-list", 0, -1))[0] == list(reversed(RECORDS))
    again = invoke(["results"], redis_url)
    assert again.stdout.splitlines() == [
        'r1  200  {"text":"hi"}',
        "r2  DEADLINE_EXCEEDED  deadline exceeded",
        "?  (not a terminal record)  not a record",
    ]
    assert do(redis_url, ("LLEN", "result-list"))[0] == 3


def test_results_pop_removes_oldest_first(redis_url: str) -> None:
    push_records(redis_url)
    result = invoke(["results", "--pop", "--count", "2", "--json"], redis_url)
    assert result.exit_code == 0, result.output
    assert result.stdout.encode().splitlines() == RECORDS[:2]
    assert do(redis_url, ("LRANGE", "result-list", 0, -1))[0] == [RECORDS[2]]
    popped = invoke(["results", "--pop"], redis_url).stdout
    assert popped == "?  (not a terminal record)  not a record\n"
    empty = invoke(["results", "--pop"], redis_url)
    assert (empty.exit_code, empty.stdout) == (0, "")
    assert empty.stderr == "claimkit results: result-list is empty\n"
    assert do(redis_url, ("EXISTS", "result-list"))[0] == 0


def test_results_follow_reads_durably_and_refuses_pop(redis_url: str) -> None:
    push_records(redis_url, "mine")
    refused = invoke(["results", "--list", "mine", "--follow", "--pop", "--count", "2"], redis_url)
    one_line_error(
        refused,
        "--follow --pop is gone: --follow alone reads durably (each record leased, acked "
        "once printed or handled; docs/results.md); --pop is a one-shot destructive read",
        code=2,
    )
    assert do(redis_url, ("LLEN", "mine"))[0] == 3
    result = invoke(["results", "--list", "mine", "--follow", "--count", "2", "--json"], redis_url)
    assert result.exit_code == 0, result.output
    assert result.stdout.encode().splitlines() == RECORDS[:2]
    assert do(redis_url, ("LRANGE", "mine", 0, -1))[0] == [RECORDS[2]]
    # Each printed record was acked: a tombstone per id, nothing leased.
    assert do(redis_url, ("ZRANGE", "mine:result-ack-tombstones", 0, -1))[0] == [b"r1", b"r2"]
    assert do(redis_url, ("EXISTS", "mine:result-claimed", "mine:result-claim-owners"))[0] == 0
    assert do(redis_url, ("EXISTS", "mine:result-claims-idx"))[0] == 0
    # Now a pop would take records from under durable readers: refused, nothing popped.
    one_line_error(
        invoke(["results", "--list", "mine", "--pop"], redis_url),
        "mine has durable readers (one of mine:result-claimed, mine:result-claim-owners, "
        "mine:result-claims-idx, mine:result-ack-tombstones exists): a pop would take "
        "records they count on; read it with --follow (durable) or without --pop "
        "(docs/results.md#never-mix-popping-and-durable-readers)",
    )
    assert do(redis_url, ("LRANGE", "mine", 0, -1))[0] == [RECORDS[2]]
    for flag in (["--exec", "cat"], ["--lease", "5"], ["--poll", "1"]):
        one_line_error(
            invoke(["results", "--list", "mine", *flag], redis_url),
            f"{flag[0]} applies to --follow only",
            code=2,
        )


def test_results_list_defaults_to_the_configured_result_queue(redis_url: str) -> None:
    push_records(redis_url, "configured")
    transport = config_json(redis_url, queue=Q, result_queue_name="configured")
    result = invoke(["results", "--peek", "--count", "1", "--transport-config", transport])
    assert result.stdout == 'r1  200  {"text":"hi"}\n'


def test_results_errors(redis_url: str) -> None:
    one_line_error(
        invoke(["results", "--pop", "--peek"], redis_url),
        "--peek and --pop cannot be combined: --peek reads without removing",
        code=2,
    )
    one_line_error(invoke(["results", "--list", ""], redis_url), "--list must not be empty", code=2)
    do(redis_url, ("SET", "result-list", "x"))
    one_line_error(
        invoke(["results"], redis_url),
        "key 'result-list' holds a string, not a list: is the queue or list name right?",
    )


def test_cancel_sets_the_marker_of_a_live_request(redis_url: str) -> None:
    deadline = int(server_now_sync(redis_url)) + 3600

    async def submit(store: Store) -> str:
        return await Producer(store, Q).submit({"id": "r1", "deadline": deadline})

    token = redis(redis_url, submit)
    result = invoke(["cancel", "r1", "ghost"], redis_url)
    assert result.exit_code == 1, result.output  # one id asked for was not found
    assert result.stdout.splitlines() == [
        "r1: cancelled",
        "ghost: not active (unknown, finished or expired); not cancelled",
    ]
    assert result.stderr == "claimkit: no live request to cancel for 'ghost'\n"
    value, ttl, ghost = do(
        redis_url,
        ("GET", "request-cancel:r1"),
        ("TTL", "request-cancel:r1"),
        ("EXISTS", "request-cancel:ghost"),
    )
    assert value == token.encode()
    assert 604700 < ttl <= 604800
    assert ghost == 0
