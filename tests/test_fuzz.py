"""Bad input through the real pipeline: fuzzed queue members and fuzzed configs.

Members (SPEC §2.1, §3.1): hypothesis writes batches of members straight into a queue,
mixing well-formed envelopes (odd ids with ``:``, ``{``, unicode; huge payloads; odd
headers, endpoints and metadata) with broken ones (cut-off JSON, invalid UTF-8, wrong
types, missing fields, lone surrogates), and a real :class:`Consumer` serves the queue
against the in-process gateway simulator. Whatever the batch, the consumer must not crash
and every member must end in exactly one way: served with exactly one terminal record, or
dead-lettered by its exact bytes with an ``INVALID_REQUEST`` record when an id can be read
(and none when it cannot). Nothing stays pending or claimed.

Configs (SPEC §6): hypothesis builds transport JSON with wrong types, negative, huge,
NaN and infinite numbers, junk gates and queues. ``load_config`` either returns a config
whose every number is usable, or raises :class:`ConfigError` with one line; the CLI then
prints that one line and exits 1, never a traceback.

Hypothesis runs deterministically with a modest number of examples and no database.
"""

from __future__ import annotations

import json
import math
import time
from typing import TYPE_CHECKING, Any

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import make_config
from typer.testing import CliRunner

from claimkit.cli.app import app
from claimkit.config import Config, ConfigError, load_config
from claimkit.consumer.consumer import Consumer
from claimkit.dev.sim import SimConfig, serve_sim
from claimkit.protocol.models import Invalid, parse_member

if TYPE_CHECKING:
    from claimkit.store import Store

Q = "{fz}:q"
DEAD = f"{Q}:dead"
RESULTS = "result-list"

FUZZ = settings(
    max_examples=25,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)

FAR = int(time.time()) + 10**6
FOREIGN = "foreign-hash"  # a key of another type, not claimkit's: records fall back to RESULTS
OTHER = "other-list"
CLAIMKIT_KEYS = [Q, f"{Q}:claim-owners", f"{Q}:claimed", "retry-sortedset", "result-terminal:x"]
RESULT_LISTS = [RESULTS, OTHER, FOREIGN, *CLAIMKIT_KEYS]

# -- members -----------------------------------------------------------------------------------

odd_text = st.text(
    alphabet=st.one_of(
        st.sampled_from(':{}[]"\\/ \t\n%*?é漢🙂\x00\x7f'),
        st.characters(codec="utf-8"),
    ),
    max_size=12,
)
odd_ids = st.one_of(odd_text.filter(bool), st.sampled_from(["x:score", "{t}:a", "a:b:c", "ünï"]))
str_maps = st.dictionaries(odd_text, odd_text, max_size=3)
payloads = st.one_of(
    st.none(),
    st.dictionaries(st.text(max_size=5), st.one_of(st.integers(), odd_text), max_size=3),
    st.sampled_from([1_000, 200_000, 1_000_000]).map(lambda n: {"prompt": "x" * n}),
)


@st.composite
def good_docs(draw: st.DrawFn) -> dict[str, Any]:
    data: dict[str, Any] = {
        "id": draw(odd_ids),
        "deadline": draw(st.sampled_from([FAR, FAR + 17, 1, 1000, 2**31])),
    }
    for name, strategy in (
        ("payload", payloads),
        ("metadata", st.one_of(str_maps, st.fixed_dictionaries({"userid": odd_text}))),
        ("headers", str_maps),
        (
            "endpoint",
            st.one_of(
                odd_text, st.sampled_from(["/v1/chat/completions", "http://evil/x", "../../x"])
            ),
        ),
        ("created", st.integers(0, 2**40)),
        ("x-unknown", st.lists(st.integers(), max_size=2)),
    ):
        if draw(st.booleans()):
            data[name] = draw(strategy)
    internal: dict[str, Any] = {}
    if draw(st.booleans()):
        internal["request_token"] = draw(st.sampled_from(["a" * 32, "b" * 32, ""]))
    if draw(st.booleans()):
        internal["retry_count"] = draw(st.integers(0, 5))
    if draw(st.integers(0, 3)) == 0:
        internal["result_queue_name"] = draw(st.sampled_from(RESULT_LISTS))
    doc: dict[str, Any] = {
        "request_kind": draw(st.sampled_from(["plain", "redis", "pubsub"])),
        "data": data,
    }
    empty_internal = draw(st.booleans())
    if internal or empty_internal:
        doc["internal"] = internal
    return doc


JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
    st.text(max_size=4), st.lists(st.integers(), max_size=2), st.just({}),
)  # fmt: skip


DATA_BREAKS = {
    "no-id",
    "id-type",
    "empty-id",
    "no-deadline",
    "deadline",
    "huge-deadline",
    "optional",
}


def break_data(draw: st.DrawFn, data: dict[str, Any], how: str) -> bool:
    """Break the request's ``data`` object as ``how`` (one of :data:`DATA_BREAKS`) says;
    whether that is a clear violation (see :func:`broken_docs`)."""
    if how == "no-id":
        del data["id"]
    elif how == "id-type":
        data["id"] = draw(JUNK.filter(lambda v: not isinstance(v, str)))
    elif how == "empty-id":
        data["id"] = ""
    elif how == "no-deadline":
        del data["deadline"]
    elif how == "deadline":
        data["deadline"] = draw(
            st.one_of(
                st.sampled_from([0, -1, -(2**40), 1.5, "soon", True, None, "1797020181"]),
                st.floats(allow_nan=False).filter(lambda f: not f.is_integer()),
            )
        )
    elif how == "huge-deadline":
        # A JSON integer > 0, as SPEC §2.1 asks, only absurdly far away: either outcome.
        data["deadline"] = draw(st.sampled_from([2**63, 2**64, 10**30]))
        return False
    else:  # "optional"
        name = draw(st.sampled_from(["payload", "metadata", "headers", "endpoint", "created"]))
        data[name] = draw(JUNK)
        return False
    return True


@st.composite
def broken_docs(draw: st.DrawFn) -> tuple[Any, bool]:
    """A document that breaks one rule of SPEC §2.1, and whether that is a clear violation
    (must be dead-lettered) or a wrong-typed optional field (either outcome is fine, as
    long as it is exactly one)."""
    doc = draw(good_docs())
    data = doc["data"]
    how = draw(
        st.sampled_from(
            [
                "kind", "no-kind", "no-data", "data-type", "no-id", "id-type", "empty-id",
                "no-deadline", "deadline", "huge-deadline", "not-object", "optional",
                "internal", "surrogate-id",
            ]
        )
    )  # fmt: skip
    if how in DATA_BREAKS:
        return doc, break_data(draw, data, how)
    clear = True
    if how == "kind":
        doc["request_kind"] = draw(st.one_of(JUNK, st.sampled_from(["PLAIN", "other", ""])))
    elif how == "no-kind":
        del doc["request_kind"]
    elif how == "no-data":
        del doc["data"]
    elif how == "data-type":
        doc["data"] = draw(JUNK.filter(lambda v: not isinstance(v, dict)))
    elif how == "not-object":
        return draw(st.one_of(JUNK, st.lists(st.just(doc), max_size=1))), True
    elif how == "surrogate-id":
        # Broken in two ways: a bad field, and an id no one can write back (JSON text can
        # escape a lone surrogate); reading the id for the record must not crash anything.
        doc["request_kind"] = "other"
        data["id"] = "\ud800" + data["id"]
    else:
        doc["internal"] = draw(
            st.one_of(JUNK, st.fixed_dictionaries({"retry_count": JUNK}),
                      st.fixed_dictionaries({"request_token": JUNK}))
        )  # fmt: skip
        clear = False
    return doc, clear


@st.composite
def members(draw: st.DrawFn) -> tuple[bytes, str]:
    """``(member bytes, expectation)``: "good", "bad" (must be dead) or "either"."""
    kind = draw(st.sampled_from(["good", "good", "broken", "broken", "cut", "bytes", "surrogate"]))
    if kind == "good":
        doc = draw(good_docs())
        routed = doc.get("internal", {}).get("result_queue_name")
        # A record aimed at one of claimkit's own keys would break that key: dead-lettered.
        return _dumps(doc), "bad" if routed in CLAIMKIT_KEYS else "good"
    if kind == "broken":
        doc, clear = draw(broken_docs())
        return _dumps(doc), "bad" if clear else "either"
    if kind == "cut":
        raw = _dumps(draw(good_docs()))
        return raw[: draw(st.integers(0, max(len(raw) - 1, 0)))], "bad"
    if kind == "bytes":
        return draw(st.binary(max_size=40)), "bad"
    # A lone surrogate escape is valid JSON text but no valid string: the id cannot be
    # written back (UTF-8) by anyone.
    where = draw(st.sampled_from(["id", "payload"]))
    doc = draw(good_docs())
    text = _dumps(doc).decode()
    marker = json.dumps(doc["data"]["id"], ensure_ascii=False)
    if where == "id":
        text = text.replace(marker, '"\\ud800' + marker[1:], 1)
        return text.encode(), "either"
    doc["data"]["payload"] = {"s": "SURROGATE"}
    return _dumps(doc).replace(b"SURROGATE", b"\\udfff"), "either"


def _dumps(doc: Any) -> bytes:
    # A lone surrogate, which UTF-8 cannot carry, is written as its JSON escape \\uXXXX.
    text = json.dumps(doc, ensure_ascii=False, separators=(",", ":"))
    return text.encode("utf-8", errors="backslashreplace")


def readable_id(raw: bytes) -> str | None:
    """The id SPEC §3.1 can still read from a member, if any."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    data = doc.get("data") if isinstance(doc, dict) else None
    rid = data.get("id") if isinstance(data, dict) else None
    if not isinstance(rid, str) or not rid:
        return None
    try:
        rid.encode()
    except UnicodeEncodeError:
        return None  # a lone surrogate: no Redis key or record can carry it
    return rid


def unique_by_id(batch: list[tuple[bytes, str]]) -> list[tuple[bytes, str]]:
    """One member per readable id (two members of one id are one request's generations,
    whose records SPEC §3.4 dedups: not what this test is about), no repeated bytes."""
    out, ids, raws = [], set(), set()
    for raw, expect in batch:
        rid = readable_id(raw)
        if raw in raws or (rid is not None and rid in ids):
            continue
        raws.add(raw)
        if rid is not None:
            ids.add(rid)
        out.append((raw, expect))
    return out


def consumer_config(redis_url: str, gateway: str) -> Config:
    return make_config(
        redis_url,
        queue=Q,
        gateway=gateway,
        poll_interval_ms=10,
        batch_size=50,
        claim_lease_ttl_seconds=30,
        metrics_port=0,
        health_port=0,
        drain_timeout_seconds=1,
        request_timeout_seconds=5,
    )


async def serve_batch(store: Store, config: Config, batch: list[tuple[bytes, str]]) -> None:
    await store.command("FLUSHDB")
    await store.command("HSET", FOREIGN, "keep", "me")
    for i, (raw, _expect) in enumerate(batch):
        await store.command("ZADD", Q, i + 1, raw)
    consumer = Consumer(config, store)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(consumer.run)
            while True:
                left = await store.pipeline(
                    [["ZCARD", Q], ["HLEN", f"{Q}:claim-owners"], ["ZCARD", "retry-sortedset"]],
                    transaction=True,
                )
                if left == [0, 0, 0]:
                    break
                await trio.sleep(0.02)
            consumer.request_stop()


async def check_outcome(store: Store, batch: list[tuple[bytes, str]]) -> None:
    dead = set(await store.command("ZRANGE", DEAD, 0, -1))
    records: dict[str, list[dict[str, Any]]] = {}
    for raw in [
        *await store.command("LRANGE", RESULTS, 0, -1),
        *await store.command("LRANGE", OTHER, 0, -1),
    ]:
        doc = json.loads(raw)
        records.setdefault(doc["id"], []).append(doc)
    assert await store.command("ZCARD", "retry-sortedset:dead") == 0
    # No record landed on a key claimkit keeps as something else, nor on the foreign key.
    assert await store.command("HGETALL", FOREIGN) in ({b"keep": b"me"}, [b"keep", b"me"])
    for key in CLAIMKIT_KEYS:
        assert await store.command("TYPE", key) in (b"none", b"zset", b"hash", b"string"), key
    for raw, expect in batch:
        rid = readable_id(raw)
        got = records.get(rid, []) if rid is not None else []
        if raw in dead:
            assert expect != "good", f"a well-formed member was dead-lettered: {raw[:200]!r}"
            if rid is not None:
                assert [r["error_code"] for r in got] == ["INVALID_REQUEST"], (raw[:200], got)
        else:
            assert expect != "bad", f"a malformed member was not dead-lettered: {raw[:200]!r}"
            assert rid is not None
            assert len(got) == 1, (raw[:200], got)
            assert got[0].get("error_code") != "INVALID_REQUEST"
    assert len(dead) == sum(1 for raw, _ in batch if raw in dead)


@pytest.mark.slow
async def test_fuzzed_members_never_crash_and_each_ends_exactly_once(
    store: Store, redis_url: str
) -> None:
    async with trio.open_nursery() as sim:
        gateway = await sim.start(serve_sim, SimConfig(seed=4))
        config = consumer_config(redis_url, gateway)

        @FUZZ
        @given(st.lists(members(), min_size=1, max_size=12).map(unique_by_id))
        def one_batch(batch: list[tuple[bytes, str]]) -> None:
            trio.from_thread.run(serve_batch, store, config, batch)
            trio.from_thread.run(check_outcome, store, batch)

        with trio.fail_after(240):
            await trio.to_thread.run_sync(one_batch)
        sim.cancel_scope.cancel()


# -- configs ------------------------------------------------------------------------------------

NUMBERS = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, -1, 65535, 65536, 2**31, 2**53 + 1, 2**63, 10**20]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=3),
    st.lists(st.integers(), max_size=1),
)
NUMERIC_FIELDS = [
    "poll_interval_ms", "batch_size", "claim_lease_ttl_seconds", "claim_reclaim_interval_ms",
    "result_dedup_ttl_seconds", "max_deliveries", "concurrency", "request_timeout_seconds",
    "drain_timeout_seconds", "metrics_port", "health_port", "http_idle_timeout_seconds",
    "http_max_connections",
]  # fmt: skip
QUEUE_FIELDS = {
    "queue_name": st.one_of(odd_text, JUNK),
    "igw_base_url": st.one_of(
        st.sampled_from(["http://127.0.0.1:9", "https://gw", "ftp://x", "http://", "gw:80", ""]),
        JUNK,
    ),
    "id": st.one_of(odd_text, JUNK),
    "request_path_url": st.one_of(odd_text, JUNK),
    "inference_objective": st.one_of(odd_text, JUNK),
    "result_queue_name": st.one_of(odd_text, JUNK),
    "gate_type": st.one_of(
        st.sampled_from(["constant", "redis", "local-max-concurrency", "x"]), JUNK
    ),
    "gate_params": st.one_of(
        st.fixed_dictionaries({"key": st.one_of(odd_text, JUNK)}),
        st.fixed_dictionaries({"limit": st.one_of(NUMBERS, JUNK)}),
        JUNK,
    ),
    "labels": st.one_of(str_maps, JUNK, st.dictionaries(odd_text, JUNK, max_size=2)),
}


@st.composite
def config_texts(draw: st.DrawFn, url: str) -> str:
    shape = draw(st.sampled_from(["doc"] * 8 + ["not-object", "broken"]))
    if shape == "not-object":
        return json.dumps(draw(st.one_of(JUNK, st.lists(JUNK, max_size=2))))
    doc: dict[str, Any] = {"url": url}
    for name in draw(
        st.lists(st.sampled_from(NUMERIC_FIELDS), min_size=1, max_size=3, unique=True)
    ):
        doc[name] = draw(NUMBERS)
    if draw(st.integers(0, 9)) == 0:
        name = draw(st.sampled_from(["result_queue_name", "retry_queue_name", "url"]))
        doc[name] = draw(st.one_of(odd_text, JUNK))
    queue: dict[str, Any] = {"queue_name": "q", "igw_base_url": "http://127.0.0.1:9"}
    if draw(st.booleans()):
        name = draw(st.sampled_from(sorted(QUEUE_FIELDS)))
        queue[name] = draw(QUEUE_FIELDS[name])
    layout = draw(st.sampled_from(["one"] * 6 + ["two", "dup", "junk", "none"]))
    doc["queues"] = {
        "one": [queue],
        "two": [queue, {**queue, "queue_name": "q2", "id": "q2"}],
        "dup": [queue, queue],
        "junk": queue,
        "none": [],
    }[layout]
    text = json.dumps(doc)  # NaN and Infinity come out as the literals json.loads accepts
    if shape == "broken":
        text = text[: draw(st.integers(0, len(text) - 1))]
    return text


MAX_INT = 2**31 - 1


def assert_usable(config: Config) -> None:
    """An accepted config must not hold a number Redis, trio or httpx cannot take."""
    for name in NUMERIC_FIELDS:
        value = getattr(config, name)
        assert not isinstance(value, bool), name
        assert math.isfinite(value), f"{name}={value!r} accepted"
        assert 0 <= value <= MAX_INT, f"{name}={value!r} accepted"
    assert config.claim_lease_ttl_seconds > 0
    assert config.request_timeout_seconds > 0
    assert config.batch_size >= 1
    assert config.concurrency >= 1


@pytest.mark.slow
def test_fuzzed_configs_are_accepted_or_one_line_errors(redis_url: str) -> None:
    runner = CliRunner()

    @settings(FUZZ, max_examples=150)
    @given(config_texts(redis_url))
    def one(text: str) -> None:
        try:
            config = load_config(inline=text)
        except ConfigError as exc:
            message = str(exc)
            assert message, repr(message)
            assert "\n" not in message, repr(message)
            result = runner.invoke(app, ["serve", "--transport-config", text])
            assert result.exit_code == 1, result.output
            assert result.exception is None or isinstance(result.exception, SystemExit)
            assert result.stdout == ""
            assert result.stderr.splitlines() == [f"claimkit: {message}"], result.stderr
            return
        assert_usable(config)
        # Accepted: the CLI runs one reclaim with it (one line, exit 0) or refuses a gate
        # setting with one line.
        result = runner.invoke(app, ["reclaim", "--once", "--transport-config", text])
        assert result.exception is None or isinstance(result.exception, SystemExit), result.output
        assert result.exit_code in (0, 1), result.output
        out = result.stdout if result.exit_code == 0 else result.stderr
        assert len(out.splitlines()) == 1, result.output
        assert "Traceback" not in result.output, result.output

    one()


# -- the faults these fuzzers found, pinned down -------------------------------------------------


def test_an_id_no_one_can_write_is_not_salvaged() -> None:
    """``json.loads`` reads a lone surrogate escape; the record of such an id could not be
    encoded, and raising there took the whole consumer down (every consumer that peeked it)."""
    bad = parse_member(b'{"request_kind":"x","data":{"id":"\\ud800","deadline":5}}')
    assert isinstance(bad, Invalid)
    assert bad.id is None
    token = parse_member(
        b'{"request_kind":"x","data":{"id":"ok","deadline":5},'
        b'"internal":{"request_token":"\\udfff","result_queue_name":"\\ud800"}}'
    )
    assert isinstance(token, Invalid)
    assert (token.id, token.request_token, token.result_queue_name) == ("ok", "", None)


def test_a_readable_id_gets_its_record_even_when_msgspec_rejects_the_text() -> None:
    """A lone surrogate in the payload: msgspec refuses the JSON, the id is still readable,
    so the request must get its INVALID_REQUEST record (it used to get none)."""
    bad = parse_member(b'{"request_kind":"plain","data":{"id":"ok","deadline":5,"p":"\\udfff"}}')
    assert isinstance(bad, Invalid)
    assert bad.id == "ok"


async def test_poison_members_neither_crash_nor_break_the_queue(
    store: Store, redis_url: str
) -> None:
    """A member whose record would go onto the queue's own key used to turn the (momentarily
    empty) pending set into a list: every later peek, claim and submit failed with
    WRONGTYPE. A member with an unwritable id crashed the consumer."""

    def routed(rid: str, result_list: str, deadline: int = FAR) -> bytes:
        return _dumps(
            {
                "request_kind": "plain",
                "data": {"id": rid, "deadline": deadline},
                "internal": {"result_queue_name": result_list},
            }
        )

    batch = [
        (b'{"request_kind":"x","data":{"id":"\\ud800","deadline":5}}', "bad"),
        (b'{"request_kind":"plain","data":{"id":"s","deadline":5,"p":"\\udfff"}}', "bad"),
        (routed("self", Q), "bad"),
        (routed("hash", FOREIGN), "good"),
        (routed("mark", "result-terminal:mark").replace(b'"plain"', b'"?"'), "bad"),
        (_dumps({"request_kind": "plain", "data": {"id": "good", "deadline": FAR}}), "good"),
    ]
    async with trio.open_nursery() as sim:
        gateway = await sim.start(serve_sim, SimConfig(seed=5))
        await serve_batch(store, consumer_config(redis_url, gateway), batch)
        sim.cancel_scope.cancel()
    await check_outcome(store, batch)
    records = {
        json.loads(r)["id"]: json.loads(r) for r in await store.command("LRANGE", RESULTS, 0, -1)
    }
    assert set(records) == {"s", "self", "hash", "mark", "good"}
    assert records["hash"]["status_code"] == 200  # its list was a hash: the record fell back
    assert "names a key claimkit uses: '{fz}:q'" in records["self"]["error_message"]
    assert await store.command("TYPE", Q) == b"none"  # empty, not a list
    assert await store.command("GET", "result-terminal:mark") == b"1"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("claim_lease_ttl_seconds", "NaN", "must be a finite number, got nan"),
        ("drain_timeout_seconds", "Infinity", "must be a finite number, got inf"),
        ("batch_size", "2147483648", "must be at most 2147483647, got 2147483648"),
        ("result_dedup_ttl_seconds", "1e20", "must be at most 2147483647, got 1e+20"),
    ],
)
def test_unusable_numbers_are_one_line_config_errors(field: str, value: str, message: str) -> None:
    """NaN and Infinity are JSON text json.loads accepts; a NaN lease failed every claim
    script, a huge dedup TTL every ack's SET EX, a huge batch_size every peek."""
    queues = '[{"queue_name": "q", "igw_base_url": "http://gw"}]'
    text = f'{{"url": "redis://127.0.0.1:1/0", "{field}": {value}, "queues": {queues}}}'
    with pytest.raises(ConfigError) as caught:
        load_config(inline=text)
    assert str(caught.value) == f"{field} {message}"
