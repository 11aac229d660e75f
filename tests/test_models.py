"""Wire models (SPEC §2.1, §2.3) and the producer (SPEC §2.2)."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from support import StoreWrapper, server_now, zrange

from claimkit.producer import CANCEL_TTL_SECONDS, Producer, SubmitError
from claimkit.protocol.models import (
    DEADLINE_EXCEEDED_MESSAGE,
    DEADLINE_INVALID_MESSAGE,
    PAYLOAD_MISSING_MESSAGE,
    Envelope,
    ErrorCode,
    Invalid,
    TerminalRecord,
    deadline_passed,
    deadline_record,
    parse_member,
    retry_member,
    retry_queue_name,
)
from claimkit.protocol.ops import ClaimCode, QueueOps, new_token
from claimkit.protocol.routing import ResultRouting

if TYPE_CHECKING:
    from collections.abc import Sequence

    from claimkit.store import Arg, Store
    from claimkit.store.scripts import Script

Q = "requests"
TOKEN = "0123456789abcdef" * 2


def dumps(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()


# -- parse_member: valid -------------------------------------------------------------------------


def test_parse_a_full_envelope() -> None:
    raw = dumps(
        {
            "internal": {
                "retry_count": 2,
                "queue_id": "qid",
                "request_token": TOKEN,
                "request_queue_name": Q,
                "result_queue_name": "mine",
                "transport_correlation_id": "corr",
                "labels": {"team": "a"},
                "x-future": {"nested": [1]},
            },
            "request_kind": "redis",
            "data": {
                "id": "a:b{c}ü",
                "deadline": 1_900_000_000,
                "created": 1_800_000_000,
                "payload": {"model": "m", "prompt": "hi"},
                "metadata": {"userid": "u1"},
                "headers": {"X-Trace": "t"},
                "endpoint": "/v1/chat/completions",
                "request_queue_name": "rq",
                "result_queue_name": "data-list",
                "x-unknown": True,
            },
            "zz": None,
        }
    )
    assert parse_member(raw) == Envelope(
        raw=raw,
        id="a:b{c}ü",
        deadline=1_900_000_000,
        request_kind="redis",
        payload={"model": "m", "prompt": "hi"},
        metadata={"userid": "u1"},
        headers={"X-Trace": "t"},
        endpoint="/v1/chat/completions",
        request_token=TOKEN,
        retry_count=2,
        result_queue_name="mine",  # internal.result_queue_name wins
    )


def test_parse_a_minimal_envelope() -> None:
    raw = b'{"request_kind":"plain","data":{"id":"a","deadline":5}}'
    assert parse_member(raw) == Envelope(
        raw=raw,
        id="a",
        deadline=5,
        request_kind="plain",
        payload=None,
        metadata={},
        headers={},
        endpoint=None,
        request_token="",
        retry_count=0,
        result_queue_name=None,
    )


@pytest.mark.parametrize("kind", ["plain", "redis", "pubsub"])
def test_every_request_kind_and_a_null_payload_parse(kind: str) -> None:
    raw = dumps({"request_kind": kind, "data": {"id": "a", "deadline": 5, "payload": None}})
    parsed = parse_member(raw)
    assert isinstance(parsed, Envelope)
    assert (parsed.request_kind, parsed.payload, parsed.raw) == (kind, None, raw)


def test_result_list_comes_from_internal_only() -> None:
    """SPEC §2.3: the member's ``internal.result_queue_name`` routes its record; the Lua
    reclaim script follows the same rule, so ``data.result_queue_name`` is not used."""
    raw = dumps(
        {
            "internal": {"result_queue_name": "i"},
            "request_kind": "redis",
            "data": {"id": "a", "deadline": 5, "result_queue_name": "r"},
        }
    )
    parsed = parse_member(raw)
    assert isinstance(parsed, Envelope)
    assert parsed.result_queue_name == "i"
    only_data = dumps(
        {"request_kind": "redis", "data": {"id": "a", "deadline": 5, "result_queue_name": "r"}}
    )
    parsed = parse_member(only_data)
    assert isinstance(parsed, Envelope)
    assert parsed.result_queue_name is None


# -- parse_member: invalid -------------------------------------------------------------------


def envelope(data: dict[str, Any], **top: Any) -> bytes:
    return dumps({"request_kind": "plain", "data": data, **top})


@pytest.mark.parametrize(
    ("raw", "names", "rid"),
    [
        (b"{not json", "not valid JSON", None),
        (b"\xff\xfe", "not valid JSON", None),
        (b"[1, 2]", "Expected `object`, got `array`", None),
        (b'"a string"', "Expected `object`, got `str`", None),
        (dumps({"data": {"id": "a", "deadline": 5}}), "`request_kind`", "a"),
        (
            dumps({"request_kind": "grpc", "data": {"id": "a", "deadline": 5}}),
            "$.request_kind",
            "a",
        ),
        (dumps({"request_kind": "plain"}), "`data`", None),
        (envelope({"deadline": 5}), "`id`", None),
        (envelope({"id": "", "deadline": 5}), "$.data.id", None),
        (envelope({"id": 7, "deadline": 5}), "$.data.id", None),
        (envelope({"id": "a", "deadline": 5, "payload": [1]}), "$.data.payload", "a"),
        (envelope({"id": "a", "deadline": 5, "metadata": {"k": 1}}), "$.data.metadata", "a"),
        (envelope({"id": "a", "deadline": 5, "headers": "h"}), "$.data.headers", "a"),
        (envelope({"id": "a", "deadline": 5, "endpoint": 3}), "$.data.endpoint", "a"),
        (
            envelope({"id": "a", "deadline": 5}, internal={"retry_count": "x"}),
            "$.internal.retry_count",
            "a",
        ),
    ],
)
def test_invalid_members_name_the_field(raw: bytes, names: str, rid: str | None) -> None:
    parsed = parse_member(raw)
    assert isinstance(parsed, Invalid)
    assert (parsed.raw, parsed.id) == (raw, rid)
    assert parsed.reason.startswith("Failed: ")
    assert names in parsed.reason
    assert parsed.reason != DEADLINE_INVALID_MESSAGE


@pytest.mark.parametrize(
    "deadline",
    [None, 0, -1, "1900000000", 1.5, 1_900_000_000.0, True, [1], {"s": 1}],
)
def test_deadline_problems_have_the_spec_message(deadline: Any) -> None:
    data: dict[str, Any] = {"id": "d"}
    if deadline is not None:
        data["deadline"] = deadline
    raw = envelope(data, internal={"request_token": TOKEN, "result_queue_name": "mine"})
    parsed = parse_member(raw)
    assert parsed == Invalid(raw, DEADLINE_INVALID_MESSAGE, "d", TOKEN, "mine")
    assert DEADLINE_INVALID_MESSAGE == "Failed: deadline is missing or invalid (Unix seconds)."


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=64),
        st.recursive(
            st.none()
            | st.booleans()
            | st.integers()
            | st.floats(allow_nan=False)
            | st.text(max_size=5),
            lambda inner: (
                st.lists(inner, max_size=3)
                | st.dictionaries(
                    st.sampled_from(["id", "data", "deadline", "request_kind", "internal", "x"]),
                    inner,
                    max_size=4,
                )
            ),
            max_leaves=12,
        ).map(lambda doc: json.dumps(doc).encode()),
    )
)
def test_parse_member_never_raises(raw: bytes) -> None:
    parsed = parse_member(raw)
    assert isinstance(parsed, Envelope | Invalid)
    assert parsed.raw == raw
    if isinstance(parsed, Invalid):
        assert parsed.id is None or (isinstance(parsed.id, str) and parsed.id)


# -- retry_member ----------------------------------------------------------------------------


def test_retry_member_keeps_unknown_fields_and_their_order() -> None:
    raw = (
        (
            '{"zz": {"b": 1, "a": [1, 2.5]}, "data": {"id": "é/1", "deadline": 1900000000, '
            '"payload": {"k": "v"}, "x-new": null}, "internal": {"labels": {"l": "v"}, '
            '"retry_count": 2, "request_token": "TOKEN", "x-int": 1}, "request_kind": "plain"}'
        )
        .replace("TOKEN", TOKEN)
        .encode()
    )
    out = retry_member(raw, Q)
    doc = json.loads(out)
    original = json.loads(raw)
    assert list(doc) == ["zz", "data", "internal", "request_kind"]
    assert list(doc["internal"]) == [
        "labels",
        "retry_count",
        "request_token",
        "x-int",
        "request_queue_name",
    ]
    assert doc == original | {
        "internal": original["internal"] | {"retry_count": 3, "request_queue_name": Q}
    }
    assert "é/1".encode() in out  # not \\u-escaped
    parsed = parse_member(out)
    assert isinstance(parsed, Envelope)
    assert (parsed.id, parsed.retry_count, parsed.request_token) == ("é/1", 3, TOKEN)


@pytest.mark.parametrize(
    ("internal", "expected"),
    [
        (None, {"retry_count": 1, "request_queue_name": Q}),
        ({}, {"retry_count": 1, "request_queue_name": Q}),
        ({"retry_count": "x"}, {"retry_count": 1, "request_queue_name": Q}),
        (
            {"request_queue_name": "old", "retry_count": 0},
            {"request_queue_name": Q, "retry_count": 1},
        ),
    ],
)
def test_retry_member_counts_and_routes(
    internal: dict[str, Any] | None, expected: dict[str, Any]
) -> None:
    doc: dict[str, Any] = {"request_kind": "plain", "data": {"id": "a", "deadline": 5}}
    if internal is not None:
        doc["internal"] = internal
    out = json.loads(retry_member(dumps(doc), Q))
    assert out["internal"] == expected
    assert list(out["internal"]) == list(expected)
    assert {k: v for k, v in out.items() if k != "internal"} == {
        k: v for k, v in doc.items() if k != "internal"
    }


# -- TerminalRecord (SPEC §2.3) ----------------------------------------------------------------


def test_http_record_field_order_and_omissions() -> None:
    record = TerminalRecord.http("a", 200, '{"ok":true}')
    assert record.to_json() == b'{"id":"a","status_code":200,"payload":"{\\"ok\\":true}"}'
    assert TerminalRecord.from_json(record.to_json()) == record


def test_http_error_record_keeps_status_and_body() -> None:
    record = TerminalRecord.http("a", 404, "not found ü")
    assert record.to_json() == '{"id":"a","status_code":404,"payload":"not found ü"}'.encode()


SPEC_ERRORS = [
    (ErrorCode.DEADLINE_EXCEEDED, "deadline exceeded"),
    (ErrorCode.CANCELLED, "cancelled"),
    (ErrorCode.GATE_DROPPED, "Pool gating dropped request"),
    (ErrorCode.GATE_ERROR, "Pool gating error: budget unreadable"),
    (ErrorCode.INFERENCE_ERROR, "Failed to send request to inference: connection refused"),
    (ErrorCode.INVALID_REQUEST, DEADLINE_INVALID_MESSAGE),
    (
        ErrorCode.MAX_DELIVERIES_EXCEEDED,
        "lease expired 10 times without an ack (max_deliveries=10)",
    ),
    (ErrorCode.PAYLOAD_UNAVAILABLE, PAYLOAD_MISSING_MESSAGE),
]


@pytest.mark.parametrize(("code", "message"), SPEC_ERRORS)
def test_error_record_field_order_and_payload(code: str, message: str) -> None:
    raw = TerminalRecord.error("id/1", code, message).to_json()
    payload = json.dumps(json.dumps({"error": message}, separators=(",", ":")))
    expected = (
        f'{{"id":"id/1","payload":{payload},"error_code":"{code}",'
        f'"error_message":{json.dumps(message)}}}'
    ).encode()
    assert raw == expected
    doc = json.loads(raw)
    assert list(doc) == ["id", "payload", "error_code", "error_message"]
    assert json.loads(doc["payload"]) == {"error": message}
    assert "status_code" not in doc


def test_error_codes_are_the_spec_table() -> None:
    names = {k for k in vars(ErrorCode) if not k.startswith("_")}
    assert names == {code for code, _ in SPEC_ERRORS}
    assert all(getattr(ErrorCode, n) == n for n in names)


def test_record_from_json() -> None:
    record = TerminalRecord.error("a", ErrorCode.CANCELLED, "cancelled")
    assert TerminalRecord.from_json(record.to_json().decode()) == record
    for bad in (b"[]", b'{"payload":"x"}', b'{"id":3}'):
        with pytest.raises(ValueError, match="not a terminal record"):
            TerminalRecord.from_json(bad)
    with pytest.raises(ValueError):  # noqa: PT011 - any ValueError: bad JSON has no own message
        TerminalRecord.from_json(b"{nope")


# -- records as llm-d-async's Go writes them (encoding/json) ------------------------------------

TOKEN = "0123456789abcdef0123456789abcdef"


def test_records_are_upstreams_bytes() -> None:
    """The literal bytes llm-d-async's dispatcher writes (``json.Marshal`` of its
    ``InternalResult``: the result's fields, then ``request_token`` last)."""
    ok = TerminalRecord.http("p1", 200, '{"result":"ok"}', TOKEN)
    assert ok.to_json() == (
        b'{"id":"p1","status_code":200,"payload":"{\\"result\\":\\"ok\\"}",'
        b'"request_token":"0123456789abcdef0123456789abcdef"}'
    )
    missing = TerminalRecord.error(
        "p1", ErrorCode.PAYLOAD_UNAVAILABLE, PAYLOAD_MISSING_MESSAGE, TOKEN
    )
    assert missing.to_json() == (
        b'{"id":"p1","payload":"{\\"error\\":\\"request payload is missing\\"}",'
        b'"error_code":"PAYLOAD_UNAVAILABLE","error_message":"request payload is missing",'
        b'"request_token":"0123456789abcdef0123456789abcdef"}'
    )
    html = TerminalRecord.http("p1", 200, "<b>&</b>", TOKEN)
    assert html.to_json() == (
        b'{"id":"p1","status_code":200,"payload":"\\u003cb\\u003e\\u0026\\u003c/b\\u003e",'
        b'"request_token":"0123456789abcdef0123456789abcdef"}'
    )
    # A record without a token (a request that had none) has no request_token key.
    assert TerminalRecord.http("p1", 200, "x").to_json() == (
        b'{"id":"p1","status_code":200,"payload":"x"}'
    )
    for record in (ok, missing, html):
        assert TerminalRecord.from_json(record.to_json()) == record


def test_go_escaping_of_every_odd_character() -> None:
    """Go escapes <, >, &, U+2028, U+2029 and control characters (\\b and \\f in their
    short forms since Go 1.22), writes DEL and other UTF-8 as is, and a byte that is not
    UTF-8 (here: a lone surrogate) as \\ufffd."""
    body = 'a<b>&c\u2028d\u2029e\b\f\n\r\t\x00\x01\x1f\x7f"\\/é😀\ud800'
    got = TerminalRecord.http("i<d>", 200, body).to_json()
    assert (
        got
        == (
            '{"id":"i\\u003cd\\u003e","status_code":200,'
            '"payload":"a\\u003cb\\u003e\\u0026c\\u2028d\\u2029e\\b\\f\\n\\r\\t'
            '\\u0000\\u0001\\u001f\x7f\\"\\\\/é😀\\ufffd"}'
        ).encode()
    )
    # The error payload is Go's map encoding too, then escaped again as a string.
    err = TerminalRecord.error("a", ErrorCode.INVALID_REQUEST, "x <= 5 & y", TOKEN).to_json()
    assert err == (
        b'{"id":"a","payload":"{\\"error\\":\\"x \\\\u003c= 5 \\\\u0026 y\\"}",'
        b'"error_code":"INVALID_REQUEST","error_message":"x \\u003c= 5 \\u0026 y",'
        b'"request_token":"0123456789abcdef0123456789abcdef"}'
    )
    assert json.loads(json.loads(err)["payload"]) == {"error": "x <= 5 & y"}


def test_record_for_generation_and_token_reading() -> None:
    record = TerminalRecord.error("a", ErrorCode.CANCELLED, "cancelled")
    assert record.request_token is None
    tokened = record.for_generation(TOKEN)
    assert tokened.request_token == TOKEN
    assert tokened.for_generation(TOKEN) is tokened
    assert record.for_generation("") is record
    assert json.loads(tokened.to_json())["request_token"] == TOKEN
    assert list(json.loads(tokened.to_json()))[-1] == "request_token"
    for raw in (b'{"id":"a","payload":"","request_token":3}', b'{"id":"a","request_token":""}'):
        assert TerminalRecord.from_json(raw).request_token is None


# -- Producer (SPEC §2.2) ------------------------------------------------------------------------


class RecordingStore(StoreWrapper):
    """Records the script calls and the pipelines that write, and delegates to a real store."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.runs: list[tuple[str, list[str], list[Arg]]] = []
        self.writes: list[list[list[Arg]]] = []

    async def pipeline(self, commands: Sequence[Sequence[Arg]], *, transaction: bool) -> list[Any]:
        # The producer's read-only check (TIME, TYPE) is not a write.
        if any(str(c[0]).upper() not in ("TIME", "TYPE") for c in commands):
            self.writes.append([list(c) for c in commands])
        return await self.inner.pipeline(commands, transaction=transaction)

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[Arg]) -> Any:
        self.runs.append((script.name, list(keys), list(args)))
        return await self.inner.run(script, keys, args)


async def test_submit_many_writes_one_script_call(store: Store) -> None:
    with trio.fail_after(10):
        rec = RecordingStore(store)
        producer = Producer(rec, Q)
        now = await server_now(store)
        d1, d2 = int(now) + 30, int(now) + 3600
        await store.command("SET", "request-cancel:a", "old", "EX", 100)
        tokens = await producer.submit_many(
            [
                {"id": "a", "deadline": d1, "payload": {"prompt": "ü"}},
                {"request_kind": "redis", "data": {"id": "b", "deadline": d2}, "zz": [1]},
            ]
        )
        assert len(tokens) == 2
        assert tokens[0] != tokens[1]
        assert all(re.fullmatch(r"[0-9a-f]{32}", t) for t in tokens)

        m1 = dumps(
            {
                "internal": {"request_token": tokens[0], "enqueue_seq": 1},
                "request_kind": "plain",
                "data": {"id": "a", "deadline": d1, "payload": {"prompt": "ü"}},
            }
        )
        m2 = dumps(
            {
                "internal": {"request_token": tokens[1], "enqueue_seq": 1},
                "request_kind": "redis",
                "data": {"id": "b", "deadline": d2},
                "zz": [1],
            }
        )
        # One atomic call, no pipeline of writes: all or none.
        assert rec.writes == []
        cut1, cut2 = (m.index(b'"enqueue_seq":') + len(b'"enqueue_seq":') for m in (m1, m2))
        assert rec.runs == [
            (
                "submit",
                [Q],
                [
                    f"request-seq:{Q}:{d1}",
                    d1 + 3600,
                    "request-cancel:a",
                    "request-active:a",
                    tokens[0],
                    d1 * 1000,
                    "",
                    b"",
                    "",
                    m1[:cut1],
                    m1[cut1 + 1 :],
                    d1,
                    f"request-seq:{Q}:{d2}",
                    d2 + 3600,
                    "request-cancel:b",
                    "request-active:b",
                    tokens[1],
                    d2 * 1000,
                    "",
                    b"",
                    "",
                    m2[:cut2],
                    m2[cut2 + 1 :],
                    d2,
                ],
            )
        ]

        assert sorted(await store.command("KEYS", "*")) == [
            b"request-active:a",
            b"request-active:b",
            f"request-seq:{Q}:{d1}".encode(),
            f"request-seq:{Q}:{d2}".encode(),
            Q.encode(),
        ]
        assert await zrange(store, Q) == [(m1, d1 + 1 / 2**21), (m2, d2 + 1 / 2**21)]
        for rid, token, d in (("a", tokens[0], d1), ("b", tokens[1], d2)):
            assert await store.command("GET", f"request-active:{rid}") == token.encode()
            assert await store.command("PEXPIRETIME", f"request-active:{rid}") == d * 1000
            assert await store.command("GET", f"request-seq:{Q}:{d}") == b"1"
            assert await store.command("EXPIRETIME", f"request-seq:{Q}:{d}") == d + 3600


async def test_submit_a_whole_envelope_with_internal_fields(store: Store) -> None:
    with trio.fail_after(10):
        d = int(await server_now(store)) + 600
        (token,) = await Producer(store, Q).submit_many(
            [
                {
                    # A given enqueue_seq is replaced; enqueued_at_ms is kept (seq wins).
                    "internal": {"queue_id": "x", "enqueue_seq": 99, "enqueued_at_ms": 5},
                    "request_kind": "plain",
                    "data": {"id": "e", "deadline": d},
                }
            ]
        )
        ((raw, score),) = await zrange(store, Q)
        assert json.loads(raw)["internal"] == {
            "queue_id": "x",
            "enqueued_at_ms": 5,
            "request_token": token,
            "enqueue_seq": 1,
        }
        assert score == d + 1 / 2**21
        assert await store.command("GET", "request-active:e") == token.encode()


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"deadline": "FUTURE"}, "request ID is required"),
        ({"id": "", "deadline": "FUTURE"}, "request ID is required"),
        ({"id": 5, "deadline": "FUTURE"}, "request ID is required"),
        ({"id": "a"}, "deadline is required"),
        ({"id": "a", "deadline": 0}, "deadline is required"),
        ({"id": "a", "deadline": -10}, "deadline is required"),
        (
            {"id": "a", "deadline": "1900000000"},
            "deadline must be an integer number of Unix seconds, got a string",
        ),
        (
            {"id": "a", "deadline": True},
            "deadline must be an integer number of Unix seconds, got a boolean",
        ),
        (
            {"id": "a", "deadline": 1_900_000_000.0},
            "deadline must be an integer number of Unix seconds, got a number with a fraction "
            "or exponent",
        ),
        ({"id": "a", "deadline": "PAST"}, "deadline has already expired"),
        ({"id": "a", "deadline": "NOW"}, "deadline has already expired"),
    ],
)
async def test_submit_errors_write_nothing(store: Store, bad: dict[str, Any], message: str) -> None:
    with trio.fail_after(10):
        rec = RecordingStore(store)
        now = int(await server_now(store))
        replace = {"FUTURE": now + 600, "PAST": now - 1, "NOW": now}
        request = {k: replace.get(v, v) if isinstance(v, str) else v for k, v in bad.items()}
        good = {"id": "ok", "deadline": now + 600}
        for batch in ([request], [good, request]):  # all or none
            with pytest.raises(SubmitError) as info:
                await Producer(rec, Q).submit_many(batch)
            assert str(info.value) == message
        assert (rec.writes, rec.runs) == ([], [])
        assert await store.command("KEYS", "*") == []


async def test_submit_of_nothing_writes_nothing(store: Store) -> None:
    with trio.fail_after(10):
        rec = RecordingStore(store)
        assert await Producer(rec, Q).submit_many([]) == []
        assert (rec.writes, rec.runs) == ([], [])


async def test_cancel_copies_the_live_token(store: Store) -> None:
    with trio.fail_after(10):
        producer = Producer(store, Q)
        d = int(await server_now(store)) + 600
        token = await producer.submit({"id": "c", "deadline": d})
        assert await producer.cancel("c") is True
        assert await store.command("GET", "request-cancel:c") == token.encode()
        assert await store.command("TTL", "request-cancel:c") == CANCEL_TTL_SECONDS == 604800
        assert await store.command("GET", "request-active:c") == token.encode()

        # The consumer then finds it cancelled (SPEC §1: the marker equals its token).
        (raw,) = await QueueOps(store, Q).peek(1)
        env = parse_member(raw)
        assert isinstance(env, Envelope)
        _, codes = await QueueOps(store, Q).claim([(env, new_token())], 60)
        assert codes == [ClaimCode.CANCELLED]

        # A resubmission is a new generation: its submit clears the old cancel marker.
        await producer.submit({"id": "c2", "deadline": d})
        await store.command("SET", "request-cancel:c2", "stale")
        token2 = await producer.submit({"id": "c2", "deadline": d})
        assert await store.command("EXISTS", "request-cancel:c2") == 0
        assert await store.command("GET", "request-active:c2") == token2.encode()


async def test_cancel_of_an_unknown_request_is_a_no_op(store: Store) -> None:
    with trio.fail_after(10):
        assert await Producer(store, Q).cancel("nobody") is False
        assert await store.command("KEYS", "*") == []


async def test_results_read_oldest_first(store: Store) -> None:
    with trio.fail_after(10):
        producer = Producer(store, Q, result_list="out")
        records = [TerminalRecord.http(f"r{i}", 200, str(i)) for i in range(3)]
        for r in records:
            await store.command("LPUSH", "out", r.to_json())
        assert await producer.results(2) == records[:2]
        assert await store.command("LLEN", "out") == 3
        assert await producer.results(10, pop=True) == records
        assert await producer.results(10, pop=True) == []


async def test_submit_to_a_key_of_another_type_writes_nothing(store: Store) -> None:
    with trio.fail_after(10):
        await store.command("SET", "not-a-queue", "x")
        with pytest.raises(SubmitError) as info:
            await Producer(store, "not-a-queue").submit({"id": "a", "deadline": 1893456000})
        assert str(info.value) == "queue key 'not-a-queue' holds a string, not a sorted set"
        assert await store.command("KEYS", "*") == [b"not-a-queue"]


# -- one deadline rule, one routing rule ---------------------------------------------------------


def test_a_deadline_has_passed_at_and_after_it() -> None:
    assert deadline_passed(100, 99.999) is False
    assert deadline_passed(100, 100.0) is True
    assert deadline_passed(100, 100.5) is True


def test_the_deadline_record_is_the_last_response_else_deadline_exceeded() -> None:
    raw = dumps({"request_kind": "plain", "data": {"id": "d", "deadline": 5}})
    env = parse_member(raw)
    assert isinstance(env, Envelope)
    assert DEADLINE_EXCEEDED_MESSAGE == "deadline exceeded"
    assert deadline_record(env).to_json() == (
        b'{"id":"d","payload":"{\\"error\\":\\"deadline exceeded\\"}",'
        b'"error_code":"DEADLINE_EXCEEDED","error_message":"deadline exceeded"}'
    )
    last = TerminalRecord.http("d", 503, "busy")
    assert deadline_record(env, last) == last
    carried = parse_member(retry_member(raw, Q, TerminalRecord.http("d", 429, "slow")))
    assert isinstance(carried, Envelope)
    assert deadline_record(carried) == TerminalRecord.http("d", 429, "slow")
    assert deadline_record(carried, last) == last


def test_retry_queue_name_reads_what_retry_member_writes() -> None:
    raw = dumps({"request_kind": "plain", "data": {"id": "r", "deadline": 5}})
    assert retry_queue_name(retry_member(raw, "{t}:q")) == "{t}:q"
    assert retry_queue_name(raw) is None
    assert retry_queue_name(b"not json") is None
    assert retry_queue_name(b"[1]") is None
    assert retry_queue_name(dumps({"internal": {"request_queue_name": 7}})) is None


@pytest.mark.parametrize(
    ("queue_list", "member_list", "to", "decides", "fallback"),
    [
        ("per-queue", "own", "per-queue", None, "per-queue"),
        ("per-queue", None, "per-queue", None, "per-queue"),
        (None, "own", "own", "own", "global"),
        (None, "", "global", None, "global"),
        (None, None, "global", None, "global"),
        ("", "own", "own", "own", "global"),  # an empty queue list is no queue list
    ],
)
def test_result_routing(
    queue_list: str | None, member_list: str | None, to: str, decides: str | None, fallback: str
) -> None:
    routing = ResultRouting(queue_list, "global")
    assert routing.list_for(member_list) == to
    assert routing.member_list(member_list) == decides
    assert routing.fallback == fallback
    assert routing.lua_args() == (queue_list or "", "global")
    ops = QueueOps(None, Q, result_list=queue_list, default_result_list="global")  # type: ignore[arg-type]
    assert ops.result_list_for(member_list) == to
    assert ops.fallback_result_list == fallback
