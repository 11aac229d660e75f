"""The pending score's enqueue order (docs/protocol.md#enqueue-order): one Python copy
(``claimkit.protocol.models.queue_score``), one Lua copy (``lua/_queue-score.lua``), and
llm-d-async's Go, all byte-equal once written ``%.17g``.

``GO_SCORES`` was printed by Go 1.19 running upstream's two formulas (``float64(deadline) +
float64(min(seq, 2^21-1))/(1<<21)``, and the ``enqueued_at_ms`` variant's int64 step) with
``fmt.Sprintf("%.17g", ...)``: deadlines from 1 to 253402300799, across the 2^32 boundary
where a double can no longer hold the whole fraction.
"""

from __future__ import annotations

import json
import random
from typing import TYPE_CHECKING

import pytest
import trio

from claimkit.protocol.models import (
    ENQUEUE_STEPS,
    ENQUEUED_AT_HORIZON_MS,
    MAX_DEADLINE,
    Envelope,
    format_score,
    parse_member,
    queue_score,
)
from claimkit.store.scripts import SHEBANG, _lua_dir, _resolve

if TYPE_CHECKING:
    from collections.abc import Sequence

    from claimkit.store import Arg, Store

H = ENQUEUED_AT_HORIZON_MS
CAP = ENQUEUE_STEPS - 1

# kind (S: enqueue_seq, A: enqueued_at_ms), deadline, value, Go's %.17g of the score
GO_SCORES = """
S 1 1 1.0000004768371582
S 1 3 1.0000014305114746
S 1 1000 1.0004768371582031
S 1 2097150 1.9999990463256836
S 1 2097151 1.9999995231628418
S 1 2097152 1.9999995231628418
A 1 -5 1
A 1 0 1
A 1 1 1.9999923706054688
A 1 -131071001 1
A 1 -131071000 1
A 1 -131070938 1
A 1 -131070937 1
A 1 -131070875 1
A 1 938 1.9999995231628418
A 1 937 1.9999990463256836
A 1 999 1.9999995231628418
A 1 1000 1.9999995231628418
A 1 100999 1.9999995231628418
A 1 4611686018427387904 1.9999995231628418
S 1900000000 1 1900000000.0000005
S 1900000000 3 1900000000.0000014
S 1900000000 1000 1900000000.0004768
S 1900000000 2097150 1900000000.999999
S 1900000000 2097151 1900000000.9999995
S 1900000000 2097152 1900000000.9999995
A 1900000000 -5 1900000000
A 1900000000 0 1900000000
A 1900000000 1 1900000000
A 1900000000 1899868927999 1900000000
A 1900000000 1899868928000 1900000000
A 1900000000 1899868928062 1900000000
A 1900000000 1899868928063 1900000000.0000005
A 1900000000 1899868928125 1900000000.000001
A 1900000000 1899999999938 1900000000.9999995
A 1900000000 1899999999937 1900000000.999999
A 1900000000 1899999999999 1900000000.9999995
A 1900000000 1900000000000 1900000000.9999995
A 1900000000 1900000099999 1900000000.9999995
A 1900000000 4611686018427387904 1900000000.9999995
S 4294967295 1 4294967295.0000005
S 4294967295 3 4294967295.0000014
S 4294967295 1000 4294967295.0004768
S 4294967295 2097150 4294967295.999999
S 4294967295 2097151 4294967295.9999995
S 4294967295 2097152 4294967295.9999995
A 4294967295 -5 4294967295
A 4294967295 0 4294967295
A 4294967295 1 4294967295
A 4294967295 4294836222999 4294967295
A 4294967295 4294836223000 4294967295
A 4294967295 4294836223062 4294967295
A 4294967295 4294836223063 4294967295.0000005
A 4294967295 4294836223125 4294967295.000001
A 4294967295 4294967294938 4294967295.9999995
A 4294967295 4294967294937 4294967295.999999
A 4294967295 4294967294999 4294967295.9999995
A 4294967295 4294967295000 4294967295.9999995
A 4294967295 4294967394999 4294967295.9999995
A 4294967295 4611686018427387904 4294967295.9999995
S 4294967296 1 4294967296
S 4294967296 3 4294967296.0000019
S 4294967296 1000 4294967296.0004768
S 4294967296 2097150 4294967296.999999
S 4294967296 2097151 4294967297
S 4294967296 2097152 4294967297
A 4294967296 -5 4294967296
A 4294967296 0 4294967296
A 4294967296 1 4294967296
A 4294967296 4294836223999 4294967296
A 4294967296 4294836224000 4294967296
A 4294967296 4294836224062 4294967296
A 4294967296 4294836224063 4294967296
A 4294967296 4294836224125 4294967296.000001
A 4294967296 4294967295938 4294967297
A 4294967296 4294967295937 4294967296.999999
A 4294967296 4294967295999 4294967297
A 4294967296 4294967296000 4294967297
A 4294967296 4294967395999 4294967297
A 4294967296 4611686018427387904 4294967297
S 8589934592 1 8589934592
S 8589934592 3 8589934592.0000019
S 8589934592 1000 8589934592.0004768
S 8589934592 2097150 8589934593
S 8589934592 2097151 8589934593
S 8589934592 2097152 8589934593
A 8589934592 -5 8589934592
A 8589934592 0 8589934592
A 8589934592 1 8589934592
A 8589934592 8589803519999 8589934592
A 8589934592 8589803520000 8589934592
A 8589934592 8589803520062 8589934592
A 8589934592 8589803520063 8589934592
A 8589934592 8589803520125 8589934592
A 8589934592 8589934591938 8589934593
A 8589934592 8589934591937 8589934593
A 8589934592 8589934591999 8589934593
A 8589934592 8589934592000 8589934593
A 8589934592 8589934691999 8589934593
A 8589934592 4611686018427387904 8589934593
S 253402300799 1 253402300799
S 253402300799 3 253402300799
S 253402300799 1000 253402300799.00049
S 253402300799 2097150 253402300800
S 253402300799 2097151 253402300800
S 253402300799 2097152 253402300800
A 253402300799 -5 253402300799
A 253402300799 0 253402300799
A 253402300799 1 253402300799
A 253402300799 253402169726999 253402300799
A 253402300799 253402169727000 253402300799
A 253402300799 253402169727062 253402300799
A 253402300799 253402169727063 253402300799
A 253402300799 253402169727125 253402300799
A 253402300799 253402300798938 253402300800
A 253402300799 253402300798937 253402300800
A 253402300799 253402300798999 253402300800
A 253402300799 253402300799000 253402300800
A 253402300799 253402300898999 253402300800
A 253402300799 4611686018427387904 253402300800
"""


def lua(body: str) -> str:
    """A script of ``body`` with ``lua/_queue-score.lua`` (and what it includes) pasted in."""
    return SHEBANG + _resolve("-- @include _queue-score\n" + body, _lua_dir(), set())


DIRECT = lua(
    """
local out = {}
for i = 1, #ARGV, 3 do
  local seq, at = nil, nil
  if ARGV[i + 1] ~= '' then seq = tonumber(ARGV[i + 1]) end
  if ARGV[i + 2] ~= '' then at = tonumber(ARGV[i + 2]) end
  out[#out + 1] = format_score(queue_score(tonumber(ARGV[i]), seq, at))
end
return out
"""
)

OF_MEMBER = lua(
    """
local out = {}
for i = 1, #ARGV do
  out[#out + 1] = member_queue_score(decode_member(ARGV[i])) or ''
end
return out
"""
)


def python(deadline: int, seq: int | None, at: int | None) -> str:
    return format_score(queue_score(deadline, seq, at))


async def lua_scores(
    store: Store, cases: Sequence[tuple[int, int | None, int | None]]
) -> list[str]:
    args: list[Arg] = []
    for deadline, seq, at in cases:
        args += [deadline, "" if seq is None else seq, "" if at is None else at]
    out: list[str] = []
    for start in range(0, len(args), 3000):  # keep one call's argument list modest
        reply = await store.command("EVAL", DIRECT, 0, *args[start : start + 3000])
        out += [r.decode() for r in reply]
    return out


def test_python_writes_what_go_writes() -> None:
    rows = [line.split() for line in GO_SCORES.strip().splitlines()]
    assert len(rows) == 120
    for kind, deadline, value, go in rows:
        d, v = int(deadline), int(value)
        got = python(d, v, None) if kind == "S" else python(d, None, v)
        assert got == go, (kind, d, v)


async def test_lua_writes_what_go_writes(store: Store) -> None:
    rows = [line.split() for line in GO_SCORES.strip().splitlines()]
    cases = [
        (int(d), int(v), None) if kind == "S" else (int(d), None, int(v)) for kind, d, v, _ in rows
    ]
    with trio.fail_after(10):
        assert await lua_scores(store, cases) == [go for *_, go in rows]


def _cases() -> list[tuple[int, int | None, int | None]]:
    deadlines = [
        -MAX_DEADLINE, -1_900_000_000, -1, 0, 1, 5, 1_900_000_000, 2**31 - 1, 2**31,
        2**32 - 1, 2**32, 2**32 + 1, 2**33 - 1, 2**33, 2**33 + 12345, 10**11, MAX_DEADLINE - 1,
        MAX_DEADLINE,
    ]  # fmt: skip
    seqs = [None, -5, -1, 0, 1, 2, 3, 1000, 2**20, CAP - 1, CAP, CAP + 1, 10**15, 2**53 + 1]
    cases: list[tuple[int, int | None, int | None]] = []
    for d in deadlines:
        base = d * 1000 - H
        ats = [None, -(2**62), -1, 0, 1, base - 1, base, base + 1, base + 62, base + 63]
        ats += [base + 125, d * 1000 - 63, d * 1000 - 62, d * 1000 - 1, d * 1000]
        ats += [d * 1000 + 1, 2**53 + 3, 10**20]
        cases += [(d, s, None) for s in seqs]
        cases += [(d, None, a) for a in ats]
        cases += [(d, s, a) for s in seqs[:6] for a in ats[:8]]  # both: a positive seq wins
    rng = random.Random(11)
    for _ in range(3000):
        d = rng.choice([rng.randrange(1, MAX_DEADLINE + 1), rng.randrange(1_700_000_000, 2**32)])
        seq = rng.choice([None, rng.randrange(-3, 2**22), rng.randrange(1, 100)])
        at = rng.choice(
            [None, d * 1000 - rng.randrange(-(10**6), 2 * H), rng.randrange(-5, 10**13)]
        )
        cases.append((d, seq, at))
    return cases


async def test_lua_and_python_agree_byte_for_byte(store: Store) -> None:
    cases = _cases()
    assert len(cases) > 4000
    with trio.fail_after(30):
        got = await lua_scores(store, cases)
    expected = [python(*case) for case in cases]
    assert [(c, g) for c, g, e in zip(cases, got, expected, strict=True) if g != e] == []


def test_the_rule() -> None:
    d = 1_900_000_000
    assert queue_score(d, None, None) == float(d)
    assert queue_score(d, 0, None) == float(d)
    assert queue_score(d, -7, None) == float(d)
    assert queue_score(d, 1, None) == d + 1 / 2**21
    assert queue_score(d, 3, 5) == d + 3 / 2**21  # both there: the count wins
    assert queue_score(d, 0, d * 1000) == d + CAP / 2**21  # ... when it is positive
    assert queue_score(d, None, d * 1000 - H) == float(d)  # the horizon's start
    assert queue_score(d, None, d * 1000 - H + 62) == float(d)  # 62.5 ms steps
    assert queue_score(d, None, d * 1000 - H + 63) == d + 1 / 2**21
    assert queue_score(d, None, d * 1000 + 5_000) == d + CAP / 2**21  # held below d + 1
    assert queue_score(d, None, 0) == float(d)
    # %.17g: Lua's tostring (14 digits) would write 1900000000 for the first two.
    assert format_score(d + 1 / 2**21) == "1900000000.0000005"
    assert format_score(d + 2 / 2**21) == "1900000000.000001"
    assert format_score(float(d)) == "1900000000"


def test_scores_keep_submission_order_up_to_the_cap() -> None:
    for d in (1, 1_900_000_000, 2**32 - 1):
        scores = [queue_score(d, seq, None) for seq in range(1, CAP + 1, 997)]
        assert scores == sorted(set(scores))  # strictly increasing
        top = queue_score(d, CAP, None)
        assert d < top < d + 1
        assert queue_score(d, CAP + 1, None) == queue_score(d, 10**12, None) == top
    # From 2^32 on a double cannot hold 21 bits of fraction: the sum rounds as Go's does.
    # Neighbouring counts may tie, the order never reverses, and the cap reaches d + 1.
    for d in (2**32, 2**33, MAX_DEADLINE):
        scores = [queue_score(d, seq, None) for seq in range(1, CAP + 1, 997)]
        assert scores == sorted(scores)
        assert queue_score(d, CAP, None) == d + 1


SPELLINGS = [
    ("3", 3),
    ("3.0", 3),
    ("3e0", 3),
    ("30e-1", 3),
    ("-0", 0),  # whole, but not positive: the bare deadline
    ("0", 0),
    ("-1", -1),
    ("2.5", None),
    ('"3"', None),
    ("true", None),
    ("null", None),
    ("[3]", None),
    ('{"n":3}', None),
    ("1e300", int(1e300)),
    ("123456789012345678901234567890", 123456789012345678901234567890),
]
"""How a JSON value of ``internal.enqueue_seq`` / ``internal.enqueued_at_ms`` is read: the
whole number it spells, or ``None`` (ignored)."""


@pytest.mark.parametrize(("text", "whole"), SPELLINGS)
def test_a_member_is_valid_whatever_its_enqueue_fields_hold(text: str, whole: int | None) -> None:
    """A value that is not a whole number is ignored, not a reason to dead-letter: the
    member keeps its bare deadline (or the other field's order)."""
    d = 1_900_000_000
    for field in ("enqueue_seq", "enqueued_at_ms"):
        raw = (
            '{"internal":{"' + field + '":' + text + '},"request_kind":"plain",'
            '"data":{"id":"a","deadline":' + str(d) + "}}"
        ).encode()
        env = parse_member(raw)
        assert isinstance(env, Envelope), (field, text)
        if field == "enqueue_seq":
            assert (env.enqueue_seq, env.enqueued_at_ms) == (whole, None)
            assert env.score == queue_score(d, whole, None)
        else:
            assert (env.enqueue_seq, env.enqueued_at_ms) == (None, whole)
            assert env.score == queue_score(d, None, whole)


async def test_lua_reads_a_members_fields_as_python_does(store: Store) -> None:
    d = 1_900_000_000
    members: list[bytes] = []
    for text, _ in SPELLINGS:
        for other in ("", ',"enqueued_at_ms":' + str(d * 1000 - 10**6)):
            for field in ("enqueue_seq", "enqueued_at_ms"):
                if field == "enqueued_at_ms" and other:
                    continue
                members.append(
                    (
                        '{"internal":{"' + field + '":' + text + other + "},"
                        '"request_kind":"plain","data":{"id":"a","deadline":' + str(d) + "}}"
                    ).encode()
                )
    members.append(b'{"request_kind":"plain","data":{"id":"a","deadline":5}}')  # no internal
    members.append(b'{"internal":[],"request_kind":"plain","data":{"id":"a","deadline":5}}')
    with trio.fail_after(10):
        got = [r.decode() for r in await store.command("EVAL", OF_MEMBER, 0, *members)]
    expected = []
    for raw in members:
        env = parse_member(raw)
        expected.append(format_score(env.score) if isinstance(env, Envelope) else "5")
    assert got == expected
    # A member without a readable deadline has no score (the retry mover dead-letters it).
    bad = [b"nope", json.dumps({"data": {"deadline": "x"}}).encode()]
    with trio.fail_after(10):
        assert await store.command("EVAL", OF_MEMBER, 0, *bad) == [b"", b""]
