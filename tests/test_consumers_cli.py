"""``claimkit consumers`` and ``serve --consumer-id`` on the command line (docs/cli.md,
docs/operations.md#consumers): the table and the JSON document of a queue with a live, a
dead, a handed-on and an unregistered consumer, ``--forget-dead``, and bad ids as one
line with exit status 2."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

import pytest
from support import config_json, invoke, member, one_line_error, redis, server_now

from claimkit.protocol.consumers import ConsumerIdentity
from claimkit.protocol.models import Envelope, parse_member
from claimkit.protocol.ops import QueueOps
from claimkit.protocol.tokens import new_token

if TYPE_CHECKING:
    from claimkit.store import Store

Q = "requests"
FAR = 4_000_000_000


async def seed(store: Store) -> float:
    """``live`` (2 claims, one 42 s old), ``dead`` (lapsed 5 s ago, 1 claim), ``gone``
    (handed on: score negated), ``ghost-7`` (a claim, no entry) and one bare-hex claim."""
    now = await server_now(store)
    plain = QueueOps(store, Q)
    for cid, ttl in (("live", 60.0), ("dead", 10.0), ("gone", 10.0)):
        await QueueOps(
            store, Q, consumer=ConsumerIdentity(cid, ttl, "node-1", 7, "0.1.0")
        ).register()
    await store.command(
        "ZADD", plain.keys.consumers, "XX", f"{now - 5:.6f}", "dead", f"{-(now - 50):.6f}", "gone"
    )
    owners = {
        "l1": new_token("live", now=now - 42),
        "l2": new_token("live", now=now - 1),
        "d1": new_token("dead", now=now - 20),
        "g1": new_token("ghost-7", now=now - 3),
        "o1": new_token(now=now - 9),
    }
    for rid, token in owners.items():
        env = parse_member(member(rid, FAR))
        assert isinstance(env, Envelope)
        await store.command("ZADD", Q, FAR, env.raw)
        _, codes = await plain.claim([(env, token)], 300)
        assert codes == [1]
    return now


def rows_of(stdout: str) -> dict[str, str]:
    return {
        line.split("│")[1].strip(): line for line in stdout.splitlines() if line.startswith("│")
    }


def test_consumers_lists_each_consumer_with_its_state_and_claims(redis_url: str) -> None:
    now = redis(redis_url, seed)
    result = invoke(["consumers", "-q", Q, "--json"], redis_url)
    assert result.exit_code == 0, result.output
    (view,) = json.loads(result.stdout)["queues"]
    assert view["queue"] == Q
    assert view["exact"] is True
    t = view["server_time"]
    got = {row["consumer"]: row for row in view["consumers"]}
    assert list(got) == ["gone", "dead", "live", "ghost-7", None]  # by expiry, then the rest
    summary = {
        cid: (row["state"], row["alive"], row["claims"], row["host"], row["pid"])
        for cid, row in got.items()
    }
    assert summary == {
        "gone": ("dead, claims handed on", False, 0, "node-1", 7),
        "dead": ("dead", False, 1, "node-1", 7),
        "live": ("alive", True, 2, "node-1", 7),
        "ghost-7": ("unregistered", False, 1, None, None),
        None: ("unregistered", False, 1, None, None),
    }
    assert got["dead"]["expires"] == pytest.approx(now - 5, abs=1e-3)
    assert got["dead"]["expires_in_seconds"] == pytest.approx(now - 5 - t, abs=1e-3)
    assert got["gone"]["expires"] == pytest.approx(now - 50, abs=1e-3)
    assert got["live"]["oldest_claim_age_seconds"] == pytest.approx(t - (now - 42), abs=0.01)
    assert got[None]["oldest_claim_age_seconds"] == pytest.approx(t - (now - 9), abs=0.01)
    assert got["live"]["version"] == "0.1.0"
    assert got["ghost-7"]["expires"] is None

    text = invoke(["consumers", "-q", Q], redis_url)
    assert text.exit_code == 0, text.output
    assert f"queue {Q}" in text.stdout
    assert "alive 1  dead 2" in text.stdout
    rows = rows_of(text.stdout)
    assert set(rows) == {"gone", "dead", "live", "ghost-7", "unknown"}
    assert "dead, claims handed on" in rows["gone"]
    assert " ago " in rows["dead"]
    assert "alive" in rows["live"]
    expires_in = re.search(r"in (\d+\.\d)s", rows["live"])
    assert expires_in is not None, rows["live"]
    assert 50 < float(expires_in[1]) <= 60.0  # its 60 s entry, registered just now
    assert re.search(r"│ +4\d\.\ds │", rows["live"])  # its oldest claim is 42 s old
    assert "unregistered" in rows["ghost-7"]


def test_forget_dead_removes_the_dead_entries_only(redis_url: str) -> None:
    redis(redis_url, seed)
    result = invoke(["consumers", "-q", Q, "--forget-dead", "--json"], redis_url)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert {q: sorted(ids) for q, ids in doc["forgotten"].items()} == {Q: ["dead", "gone"]}
    got = {row["consumer"]: row["state"] for row in doc["queues"][0]["consumers"]}
    # "dead" still holds a claim, so it stays listed, now without an entry.
    assert got == {
        "live": "alive",
        "dead": "unregistered",
        "ghost-7": "unregistered",
        None: "unregistered",
    }

    async def entries(store: Store) -> tuple[Any, Any]:
        return (
            await store.command("ZRANGE", f"{Q}:consumers", 0, -1),
            await store.command("HKEYS", f"{Q}:consumer-info"),
        )

    assert redis(redis_url, entries) == ([b"live"], [b"live"])
    text = invoke(["consumers", "-q", Q, "--forget-dead"], redis_url)
    assert "forgot 0 dead consumers" in text.stdout


def test_consumers_reads_every_configured_queue(redis_url: str) -> None:
    redis(redis_url, seed)
    transport = config_json(
        redis_url,
        queues=[
            {"queue_name": Q, "igw_base_url": "http://h:1"},
            {"queue_name": "other", "igw_base_url": "http://h:1"},
        ],
    )
    result = invoke(["consumers", "--json", "--transport-config", transport])
    assert result.exit_code == 0, result.output
    views = json.loads(result.stdout)["queues"]
    assert [v["queue"] for v in views] == [Q, "other"]
    assert views[1]["consumers"] == []
    text = invoke(["consumers", "--transport-config", transport])
    assert "queue other" in text.stdout
    assert "no consumers" in text.stdout


def test_consumers_without_a_queue_or_a_config_is_a_usage_error(redis_url: str) -> None:
    one_line_error(
        invoke(["consumers"], redis_url),
        "--queue is required when the configuration lists no queues",
        code=2,
    )


def test_consumers_refuses_a_registry_key_of_another_type(redis_url: str) -> None:
    redis(redis_url, lambda s: s.command("SET", f"{Q}:consumers", "x"))
    line = one_line_error(invoke(["consumers", "-q", Q], redis_url))
    assert f"key '{Q}:consumers' holds a string, not a sorted set" in line


@pytest.mark.parametrize("bad", ["a/b", "-pod", "x" * 128, "pöd"])
def test_a_bad_consumer_id_is_one_line_and_exit_status_2(redis_url: str, bad: str) -> None:
    transport = config_json(redis_url)
    problem = (
        f"consumer id {bad!r} must be 1 to 127 letters, digits, '.', '_' or '-', "
        "starting with a letter or a digit"
    )
    one_line_error(
        invoke(["serve", "--consumer-id", bad, "--transport-config", transport]),
        f"--consumer-id: {problem}",
        code=2,
    )


def test_the_consumer_id_variable_is_checked_as_the_flag_is(redis_url: str) -> None:
    from support import runner

    from claimkit.cli.app import app

    result = runner.invoke(
        app,
        ["serve", "--transport-config", config_json(redis_url)],
        env={"CLAIMKIT_CONSUMER_ID": "pod a", "COLUMNS": "200"},
    )
    one_line_error(result, code=2)
    assert "consumer id 'pod a'" in result.stderr


@pytest.mark.parametrize(
    ("env", "source"),
    [
        ({"POD_NAME": "pod/a"}, "$POD_NAME"),
        ({"CLAIMKIT_CONSUMER_ID": "pod/a", "POD_NAME": "fine"}, "$CLAIMKIT_CONSUMER_ID"),
    ],
)
def test_a_bad_consumer_id_names_the_variable_it_came_from(
    redis_url: str, env: dict[str, str], source: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from support import runner

    from claimkit.cli.app import app

    for name, value in env.items():  # default_consumer_id reads os.environ
        monkeypatch.setenv(name, value)
    result = runner.invoke(
        app,
        ["serve", "--transport-config", config_json(redis_url)],
        env={**env, "COLUMNS": "200"},
    )
    one_line_error(
        result,
        f"{source}: consumer id 'pod/a' must be 1 to 127 letters, digits, '.', '_' or '-', "
        "starting with a letter or a digit",
        code=2,
    )


POD = "claimkit-7d9f8b6c4-x2k9p"
HOST = "ip-10-0-12-34.eu-west-1.compute.internal"


async def seed_pods(store: Store) -> float:
    """Three pod-style consumers, alive, dead and handed on, on a long host name; the
    alive and the dead one hold a claim each."""
    now = await server_now(store)
    plain = QueueOps(store, Q)
    ids = {"alive": POD, "dead": POD[:-5] + "dead1", "gone": POD[:-5] + "gone1"}
    for cid in ids.values():
        identity = ConsumerIdentity(cid, 60.0, HOST, 4194304, "0.1.0")
        await QueueOps(store, Q, consumer=identity).register()
    await store.command(
        "ZADD",
        plain.keys.consumers,
        "XX",
        f"{now - 5:.6f}",
        ids["dead"],
        f"{-(now - 50):.6f}",
        ids["gone"],
    )
    for i, cid in enumerate([ids["alive"], ids["dead"]]):
        env = parse_member(member(f"req-2f9c1e7a-4b1d-{i}", FAR))
        assert isinstance(env, Envelope)
        await store.command("ZADD", Q, FAR, env.raw)
        _, codes = await plain.claim([(env, new_token(cid, now=now - 3))], 300)
        assert codes == [1]
    return now


def narrow(args: list[str], url: str, columns: int) -> list[str]:
    from support import runner

    from claimkit.cli.app import app

    result = runner.invoke(app, args, env={"REDIS_URL": url, "COLUMNS": str(columns)})
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert max(map(len, lines)) <= columns, result.stdout
    return lines


def cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.split("│")[1:-1]]


def test_the_consumer_id_stays_whole_on_80_columns(redis_url: str) -> None:
    redis(redis_url, seed_pods)
    lines = narrow(["consumers", "-q", Q], redis_url, 80)
    rows = [cells(line) for line in lines if line.startswith("│ claimkit-")]
    # One line per consumer id, whole; state wraps onto a second line; host is cut short.
    assert [row[:2] for row in rows] == [
        [POD[:-5] + "gone1", "dead, claims"],
        [POD[:-5] + "dead1", "dead"],
        [POD, "alive"],
    ]
    assert [(row[3], row[5]) for row in rows] == [("0", "ip-…"), ("1", "ip-…"), ("1", "ip-…")]
    assert rows[0][4] == "-"
    assert all(re.fullmatch(r"\d\.\ds", row[4]) for row in rows[1:]), rows  # 3 s old claims
    second = lines[lines.index(next(line for line in lines if "gone1" in line)) + 1]
    assert cells(second)[:2] == ["", "handed on"]
    assert lines[-1] == "(no room for pid: see --json)"

    shown = narrow(["inspect", "-q", Q], redis_url, 80)
    table = [cells(line) for line in shown if line.startswith("│ claimkit-")]
    assert [row[:2] for row in table] == [row[:2] for row in rows]
    claims = [cells(line) for line in shown if line.startswith("│ req-")]
    assert [row[1] for row in claims] == [POD, POD[:-5] + "dead1"]
    assert shown.count("(no room for pid: see --json)") == 1
    assert "(no room for held, owner: see --json)" in shown


def test_the_consumer_id_stays_whole_on_60_columns(redis_url: str) -> None:
    redis(redis_url, seed_pods)
    lines = narrow(["consumers", "-q", Q], redis_url, 60)
    rows = [cells(line) for line in lines if line.startswith("│ claimkit-")]
    assert [row[:2] for row in rows] == [
        [POD[:-5] + "gone1", "dead, claims"],
        [POD[:-5] + "dead1", "dead"],
        [POD, "alive"],
    ]
    assert [row[2][-4:] for row in rows] == [" ago", " ago", rows[2][2][-4:]]
    assert rows[2][2].startswith("in ")
    assert lines[-1] == "(no room for pid, host, oldest claim, claims: see --json)"
    shown = narrow(["inspect", "-q", Q], redis_url, 60)
    claims = [cells(line) for line in shown if line.startswith("│ req-")]
    assert [row[1] for row in claims] == [POD, POD[:-5] + "dead1"]
    assert "(no room for held, owner, deliveries: see --json)" in shown


def registry(url: str) -> tuple[Any, Any]:
    async def read(store: Store) -> tuple[Any, Any]:
        return (
            await store.command("ZRANGE", f"{Q}:consumers", 0, -1),
            await store.command("HKEYS", f"{Q}:consumer-info"),
        )

    return redis(url, read)


def test_forget_dead_names_what_it_forgot_in_json_and_text(redis_url: str) -> None:
    redis(redis_url, seed)
    result = invoke(["consumers", "-q", Q, "--forget-dead", "--json"], redis_url)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert sorted(doc["queues"][0]["forgotten"]) == ["dead", "gone"]
    redis(redis_url, lambda s: s.command("ZADD", f"{Q}:consumers", 1, "zombie"))
    text = invoke(["consumers", "-q", Q, "--forget-dead"], redis_url)
    assert text.stdout.splitlines()[0] == f"queue {Q}: forgot 1 dead consumer: zombie"


def test_forget_removes_named_entries_and_refuses_a_live_one(redis_url: str) -> None:
    redis(redis_url, seed)
    line = one_line_error(
        invoke(["consumers", "-q", Q, "--forget", "dead", "--forget", "live"], redis_url)
    )
    assert (
        line == f"claimkit: consumer 'live' of queue {Q} is alive; --force removes its entry anyway"
    )
    assert sorted(registry(redis_url)[0]) == [b"dead", b"gone", b"live"]  # nothing removed
    one_line_error(
        invoke(["consumers", "-q", Q, "--forget", "dead", "--forget", "nope"], redis_url),
        f"no consumer entry 'nope' in queue {Q}",
    )
    one_line_error(
        invoke(["consumers", "-q", Q, "--force"], redis_url), "--force needs --forget ID", code=2
    )

    result = invoke(["consumers", "-q", Q, "--forget", "dead", "--forget", "gone"], redis_url)
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0] == f"queue {Q}: forgot 2 consumers: dead, gone"
    assert registry(redis_url) == ([b"live"], [b"live"])
    forced = invoke(["consumers", "-q", Q, "--forget", "live", "--force", "--json"], redis_url)
    assert forced.exit_code == 0, forced.output
    doc = json.loads(forced.stdout)
    assert doc["forgotten"] == {Q: ["live"]}
    assert doc["queues"][0]["forgotten"] == ["live"]
    assert registry(redis_url) == ([], [])


async def odd_scores(store: Store) -> None:
    await store.command("ZADD", f"{Q}:consumers", "1e300", "far", "inf", "infy", "-inf", "neg")
    await store.command(
        "HSET", f"{Q}:consumer-info", "far", "not json", "infy", '{"host":5,"pid":"x"}'
    )


def test_odd_scores_and_unreadable_info_are_shown_as_such(redis_url: str) -> None:
    redis(redis_url, odd_scores)
    result = invoke(["consumers", "-q", Q], redis_url)
    assert result.exit_code == 0, result.output
    rows = {
        row[0]: row
        for row in (cells(line) for line in result.stdout.splitlines() if line.startswith("│ "))
    }
    assert rows["neg"] == ["neg", "dead, claims handed on", "unknown", "0", "-", "-", "-"]
    assert rows["far"][:3] == ["far", "alive (expiry too far ahead)", "in 1.16e+295d"]
    assert rows["far"][5:] == ["(unreadable info)", "-"]
    assert rows["infy"] == [
        "infy",
        "alive (expiry too far ahead)",
        "unknown",
        "0",
        "-",
        "(unreadable info)",
        "-",
    ]
    doc = json.loads(invoke(["consumers", "-q", Q, "--json"], redis_url).stdout)
    got = {row["consumer"]: row for row in doc["queues"][0]["consumers"]}
    assert got["far"]["info_error"] == "not JSON"
    assert got["infy"]["info_error"] == "host is not a string; pid is not a number"
    assert "info_error" not in got["neg"]
    assert (got["infy"]["state"], got["infy"]["alive"]) == ("alive (expiry too far ahead)", True)
    assert got["neg"]["state"] == "dead, claims handed on"
    inspected = json.loads(invoke(["inspect", "-q", Q, "--json"], redis_url).stdout)
    errors = {row["consumer"]: row.get("info_error") for row in inspected["consumers"]}
    assert errors == {
        "neg": None,
        "far": "not JSON",
        "infy": "host is not a string; pid is not a number",
    }
    # Too-far-ahead entries never lapse: --forget removes them without --force.
    gone = invoke(
        ["consumers", "-q", Q, "--forget", "far", "--forget", "infy", "--forget", "neg"], redis_url
    )
    assert gone.exit_code == 0, gone.output
    assert gone.stdout.splitlines()[0] == f"queue {Q}: forgot 3 consumers: neg, far, infy"
    assert registry(redis_url) == ([], [])
