"""The producer refuses what the consumer would not serve (SPEC §2.1, §2.2), before it writes
anything, with one precise line on the command line; cancel leaves finished requests and
foreign keys alone.

CLI tests are synchronous (each command runs its own ``trio.run``); Redis is seeded and read
through :func:`redis`, which opens a store in a fresh trio loop.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any, TypeVar

import pytest
import trio
from support import do, invoke, make_config, one_line_error, redis

from claimkit.consumer.consumer import Consumer
from claimkit.dev.sim import SimConfig, serve_sim
from claimkit.producer import Producer, SubmitError
from claimkit.protocol.models import (
    DEADLINE_INVALID_MESSAGE,
    DEADLINE_RANGE_MESSAGE,
    MAX_DEADLINE,
    Envelope,
    Invalid,
    parse_member,
)

if TYPE_CHECKING:
    from pathlib import Path

    from claimkit.store import Store

T = TypeVar("T")
Q = "sq"


def keys(url: str) -> list[bytes]:
    return sorted(do(url, ("KEYS", "*"))[0])


def future(seconds: int = 3600) -> int:
    return int(time.time()) + seconds


def wire(data: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {"request_kind": "plain", "data": data, **top}


# -- 1. the deadline bound, shared by producer and consumer -----------------------------------


@pytest.mark.parametrize("deadline", ["253402300800", "99999999999999999999999", "1" + "0" * 400])
def test_a_deadline_past_year_9999_is_invalid_with_a_precise_reason(deadline: str) -> None:
    raw = ('{"request_kind":"plain","data":{"id":"x","deadline":' + deadline + "}}").encode()
    parsed = parse_member(raw)
    assert parsed == Invalid(raw, DEADLINE_RANGE_MESSAGE, "x")
    assert DEADLINE_RANGE_MESSAGE != DEADLINE_INVALID_MESSAGE
    assert str(MAX_DEADLINE) in DEADLINE_RANGE_MESSAGE


def test_the_last_second_of_year_9999_is_a_valid_deadline() -> None:
    assert MAX_DEADLINE == 253402300799
    raw = json.dumps(wire({"id": "x", "deadline": MAX_DEADLINE})).encode()
    parsed = parse_member(raw)
    assert isinstance(parsed, Envelope)
    assert parsed.deadline == MAX_DEADLINE


async def test_the_consumer_dead_letters_a_queued_out_of_range_deadline(
    store: Store, redis_url: str
) -> None:
    huge = [
        b'{"request_kind":"plain","data":{"id":"h1","deadline":99999999999999999999999}}',
        ('{"request_kind":"plain","data":{"id":"h2","deadline":1' + "0" * 400 + "}}").encode(),
    ]
    with trio.fail_after(20):
        for i, raw in enumerate(huge):
            await store.command("ZADD", Q, i + 1, raw)
        await Producer(store, Q).submit({"id": "good", "deadline": future()})
        async with trio.open_nursery() as sim:
            gateway = await sim.start(serve_sim, SimConfig())
            config = make_config(
                redis_url,
                queue=Q,
                gateway=gateway,
                poll_interval_ms=20,
                metrics_port=0,
                health_port=0,
            )
            consumer = Consumer(config, store)
            async with trio.open_nursery() as nursery:
                await nursery.start(consumer.run)
                while await store.command("LLEN", "result-list") < 3:
                    await trio.sleep(0.02)
                consumer.request_stop()
            sim.cancel_scope.cancel()
        records = {
            r["id"]: r
            for r in (json.loads(x) for x in await store.command("LRANGE", "result-list", 0, -1))
        }
        assert set(records) == {"h1", "h2", "good"}
        assert records["good"]["status_code"] == 200
        for rid in ("h1", "h2"):
            assert records[rid]["error_code"] == "INVALID_REQUEST"
            assert records[rid]["error_message"] == DEADLINE_RANGE_MESSAGE
        assert sorted(await store.command("ZRANGE", f"{Q}:dead", 0, -1)) == sorted(huge)
        assert await store.command("ZCARD", Q) == 0


def test_submit_refuses_an_out_of_range_deadline_and_writes_nothing(redis_url: str) -> None:
    result = invoke(["submit", "-q", Q, '{"id":"x","deadline":99999999999999999999999}'], redis_url)
    one_line_error(
        result,
        "deadline is out of range: at most 253402300799 Unix seconds "
        "(9999-12-31T23:59:59Z), got 99999999999999999999999",
    )
    assert keys(redis_url) == []


# -- 2. input that is not an object where one is needed ---------------------------------------


@pytest.mark.parametrize(
    ("request_text", "message"),
    [
        ("[1]", "a request must be a JSON object (a data object or an envelope), got an array"),
        ('"x"', "a request must be a JSON object (a data object or an envelope), got a string"),
        ("null", "a request must be a JSON object (a data object or an envelope), got null"),
        (
            json.dumps(wire({"id": "e5", "deadline": "D"}, internal="notobj")),
            "invalid request: Expected `object`, got `str` - at `$.internal`",
        ),
        (
            json.dumps(wire({"id": "e5", "deadline": "D"}, internal=[1])),
            "invalid request: Expected `object`, got `array` - at `$.internal`",
        ),
        (
            json.dumps({"request_kind": "plain", "data": [1]}),
            "invalid request: Expected `object`, got `array` - at `$.data`",
        ),
    ],
)
def test_non_objects_are_one_line_and_write_nothing(
    redis_url: str, request_text: str, message: str
) -> None:
    request_text = request_text.replace('"D"', str(future()))
    one_line_error(invoke(["submit", "-q", Q, request_text], redis_url), message)
    assert keys(redis_url) == []


# -- 3. the producer validates the exact member bytes with the consumer's parser --------------


BAD_FIELDS = [
    ({"headers": {"a": 1}}, "Expected `str`, got `int` - at `$.data.headers[...]`"),
    ({"metadata": {"userid": 5}}, "Expected `str`, got `int` - at `$.data.metadata[...]`"),
    ({"endpoint": 3}, "Expected `str | null`, got `int` - at `$.data.endpoint`"),
    ({"created": "now"}, "Expected `int | null`, got `str` - at `$.data.created`"),
]


@pytest.mark.parametrize("payload", ['"str"', "[1]", "3", "true"])
@pytest.mark.parametrize("refs", [[], ["--payload-ref"]])
def test_submit_refuses_a_payload_that_is_not_an_object_in_upstreams_words(
    redis_url: str, payload: str, refs: list[str]
) -> None:
    request = '{"id":"a","deadline":' + str(future()) + ',"payload":' + payload + "}"
    one_line_error(
        invoke(["submit", "-q", Q, *refs, request], redis_url),
        "invalid payload: must be a JSON object or null",
    )
    assert keys(redis_url) == []


@pytest.mark.parametrize(("extra", "expected"), BAD_FIELDS)
def test_submit_refuses_fields_the_consumer_would_dead_letter(
    redis_url: str, extra: dict[str, Any], expected: str
) -> None:
    request = json.dumps({"id": "a", "deadline": future(), **extra})
    one_line_error(invoke(["submit", "-q", Q, request], redis_url), f"invalid request: {expected}")
    assert keys(redis_url) == []


def test_submit_refuses_an_unknown_request_kind(redis_url: str) -> None:
    request = json.dumps({"request_kind": "weird", "data": {"id": "a", "deadline": future()}})
    one_line_error(
        invoke(["submit", "-q", Q, request], redis_url),
        "invalid request: Invalid enum value 'weird' - at `$.request_kind`",
    )
    assert keys(redis_url) == []


def test_submit_refuses_an_internal_field_of_the_wrong_type(redis_url: str) -> None:
    request = json.dumps(wire({"id": "a", "deadline": future()}, internal={"retry_count": "x"}))
    one_line_error(
        invoke(["submit", "-q", Q, request], redis_url),
        "invalid request: Expected `int`, got `str` - at `$.internal.retry_count`",
    )
    assert keys(redis_url) == []


async def test_the_producer_api_refuses_with_the_parsers_message(store: Store) -> None:
    with trio.fail_after(10):
        good = {"id": "ok", "deadline": future()}
        bad = {"id": "b", "deadline": future(), "metadata": {"userid": 5}}
        with pytest.raises(SubmitError) as info:
            await Producer(store, Q).submit_many([good, good | {"id": "ok2"}, bad])
        assert str(info.value) == (
            "invalid request: Expected `str`, got `int` - at `$.data.metadata[...]`"
        )
        assert info.value.index == 2
        assert await store.command("KEYS", "*") == []


def test_a_bad_line_is_named_by_its_line_number_and_nothing_is_written(
    redis_url: str, tmp_path: Path
) -> None:
    d = future()
    lines = [
        json.dumps({"id": "a", "deadline": d}),
        "",
        "   ",
        json.dumps({"id": "b", "deadline": d}),
        json.dumps({"id": "c", "deadline": d, "headers": {"a": 1}}),
        json.dumps({"id": "d", "deadline": d}),
    ]
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n")
    expected = "line 5: invalid request: Expected `str`, got `int` - at `$.data.headers[...]`"
    one_line_error(invoke(["submit", "-q", Q, "--file", str(path)], redis_url), expected)
    assert keys(redis_url) == []
    # The same from stdin.
    one_line_error(
        invoke(["submit", "-q", Q, "--file", "-"], redis_url, stdin=path.read_text()), expected
    )
    assert keys(redis_url) == []


def test_a_line_that_is_not_json_is_named_by_its_line_number(
    redis_url: str, tmp_path: Path
) -> None:
    path = tmp_path / "requests.jsonl"
    path.write_text(json.dumps({"id": "a", "deadline": future()}) + "\n\n{nope\n")
    one_line_error(
        invoke(["submit", "-q", Q, "--file", str(path)], redis_url),
        "line 3: not valid JSON: Expecting property name enclosed in double quotes at column 2",
    )
    assert keys(redis_url) == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"id":"a","deadline":D,"payload":{"t":NaN}}', "NaN is not a JSON value"),
        ('{"id":"a","deadline":Infinity}', "Infinity is not a JSON value"),
        ("[" * 100_000, "nested too deeply"),
    ],
)
def test_what_json_loads_accepts_but_json_does_not_is_one_line(
    redis_url: str, text: str, message: str
) -> None:
    text = text.replace("D", str(future()))
    one_line_error(
        invoke(["submit", "-q", Q, text], redis_url), f"the request is not valid JSON: {message}"
    )
    assert keys(redis_url) == []


def test_a_good_file_is_submitted_whole(redis_url: str, tmp_path: Path) -> None:
    d = future()
    path = tmp_path / "requests.jsonl"
    path.write_text(
        "\n".join(
            json.dumps({"id": rid, "deadline": d, "metadata": {"userid": "u"}}) for rid in "abc"
        )
    )
    result = invoke(["submit", "-q", Q, "--file", str(path)], redis_url)
    assert result.exit_code == 0, result.output
    assert len(result.stdout.split()) == 3
    assert do(redis_url, ("ZCARD", Q)) == [3]
    for raw in do(redis_url, ("ZRANGE", Q, 0, -1))[0]:
        assert isinstance(parse_member(raw), Envelope)


# -- 4. deadline messages say what is wrong ---------------------------------------------------


@pytest.mark.parametrize(
    ("deadline", "message"),
    [
        ("1900000000.0", "a number with a fraction or exponent"),
        ("1.5", "a number with a fraction or exponent"),
        ("1e400", "a number with a fraction or exponent"),
        ('"1900000000"', "a string"),
        ("true", "a boolean"),
        ("[1]", "an array"),
    ],
)
def test_a_deadline_of_the_wrong_type_says_so(redis_url: str, deadline: str, message: str) -> None:
    result = invoke(["submit", "-q", Q, '{"id":"a","deadline":' + deadline + "}"], redis_url)
    one_line_error(result, f"deadline must be an integer number of Unix seconds, got {message}")
    assert keys(redis_url) == []


@pytest.mark.parametrize(
    ("deadline", "message"),
    [
        (None, "deadline is required"),
        ("null", "deadline is required"),
        ("0", "deadline is required"),
        ("-5", "deadline is required"),
        ("1000", "deadline has already expired"),
    ],
)
def test_the_spec_deadline_messages_stay(
    redis_url: str, deadline: str | None, message: str
) -> None:
    request = '{"id":"a"}' if deadline is None else '{"id":"a","deadline":' + deadline + "}"
    one_line_error(invoke(["submit", "-q", Q, request], redis_url), message)
    assert keys(redis_url) == []


# -- 5. cancel --------------------------------------------------------------------------------


async def _submit(store: Store, rid: str) -> str:
    return await Producer(store, Q).submit({"id": rid, "deadline": future()})


async def test_cancel_leaves_a_finished_request_alone(store: Store) -> None:
    with trio.fail_after(10):
        token = await _submit(store, "f")
        # Its terminal record was pushed: the dedup marker holds its token (SPEC §1, §3.4).
        await store.command("SET", "result-terminal:f", token)
        assert await Producer(store, Q).cancel("f") is False
        assert await store.command("EXISTS", "request-cancel:f") == 0

        # A newer generation of the id is live: the old generation's marker does not stop it.
        token2 = await _submit(store, "f")
        assert await Producer(store, Q).cancel("f") is True
        assert await store.command("GET", "request-cancel:f") == token2.encode()

        # A marker of a request that had no token ("1") is not this generation's either.
        await _submit(store, "g")
        await store.command("SET", "result-terminal:g", "1")
        assert await Producer(store, Q).cancel("g") is True


def test_cli_cancel_of_a_finished_request_is_reported_not_cancelled(redis_url: str) -> None:
    token = redis(redis_url, lambda s: _submit(s, "done"))
    live = redis(redis_url, lambda s: _submit(s, "live"))
    do(redis_url, ("SET", "result-terminal:done", token))
    result = invoke(["cancel", "done", "live"], redis_url)
    assert result.exit_code == 1, result.output  # "done" has no live request to cancel
    assert result.stdout.splitlines() == [
        "done: not active (unknown, finished or expired); not cancelled",
        "live: cancelled",
    ]
    assert result.stderr == "claimkit: no live request to cancel for 'done'\n"
    assert do(redis_url, ("EXISTS", "request-cancel:done"), ("GET", "request-cancel:live")) == [
        0,
        live.encode(),
    ]


@pytest.mark.parametrize(
    ("key", "commands", "held"),
    [
        ("request-cancel:r", [("RPUSH", "request-cancel:r", "x")], "a list"),
        (
            "request-active:r",
            [("DEL", "request-active:r"), ("SADD", "request-active:r", "x")],
            "a set",
        ),
        ("result-terminal:r", [("HSET", "result-terminal:r", "f", "v")], "a hash"),
    ],
)
def test_cancel_refuses_a_key_of_another_type(
    redis_url: str, key: str, commands: list[tuple[str, ...]], held: str
) -> None:
    redis(redis_url, lambda s: _submit(s, "r"))
    do(redis_url, *commands)
    before = {k: do(redis_url, ("DUMP", k))[0] for k in keys(redis_url)}
    one_line_error(
        invoke(["cancel", "r"], redis_url),
        f"key {key!r} holds {held}, not a string: 'r' was not cancelled",
    )
    assert {k: do(redis_url, ("DUMP", k))[0] for k in keys(redis_url)} == before


def test_cancel_reports_the_ids_done_before_a_refusal(redis_url: str) -> None:
    live = redis(redis_url, lambda s: _submit(s, "a"))
    redis(redis_url, lambda s: _submit(s, "b"))
    do(redis_url, ("RPUSH", "request-cancel:b", "x"))
    result = invoke(["cancel", "a", "b", "c"], redis_url)
    assert result.exit_code == 1, result.output
    assert result.stdout.splitlines() == ["a: cancelled"]
    assert result.stderr.splitlines() == [
        "claimkit: key 'request-cancel:b' holds a list, not a string: 'b' was not cancelled"
    ]
    assert do(redis_url, ("GET", "request-cancel:a")) == [live.encode()]


# -- 6. an empty input ------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "\n  \n\n"])
def test_an_empty_input_says_nothing_was_submitted(
    redis_url: str, tmp_path: Path, text: str
) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text(text)
    for args, stdin in (([str(path)], None), (["-"], text)):
        result = invoke(["submit", "-q", Q, "--file", *args], redis_url, stdin=stdin)
        assert result.exit_code == 0, result.output
        assert result.stdout == ""
        assert result.stderr.splitlines() == [
            "claimkit: nothing submitted: the input holds no requests"
        ]
    assert keys(redis_url) == []
