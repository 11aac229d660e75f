"""No Lua script can fail after its first write (issue 8, defect 14, as a class).

Redis keeps the writes a script made before it failed, so a script that fails half-way can
drop a claim without putting its request anywhere. Every script is run here, against a
real Redis, in a state where its first item writes, with each key it touches (declared in
KEYS or built from ARGV: dedup markers, cancel markers, result lists, a retry member's
queue) holding each other Redis type in turn, with bad numbers in its ARGV, and with hash
fields a hand edit could break. Each run either fails with the keyspace exactly as before,
or succeeds without touching a key of a foreign type that it does not own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pytest
import trio

from claimkit.protocol.keys import QueueKeys, ResultClaimKeys, ResultKeys
from claimkit.store import Arg, Store, StoreError, open_store
from claimkit.store.scripts import all_scripts

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from conftest import RedisFactory

Q = "q"
K = QueueKeys.for_queue(Q)
CK = QueueKeys.for_queue(Q, cluster=True)  # the cluster layout's names
assert CK.outbox is not None
OUTBOX: str = CK.outbox
RL = ResultKeys.for_list("rl-b")
D = 4102444800  # 2100-01-01: a deadline far ahead
TYPES = ("string", "list", "hash", "set", "zset")
MAKE: dict[str, Callable[[str], list[Arg]]] = {
    "string": lambda k: ["SET", k, "foreign"],
    "list": lambda k: ["RPUSH", k, "foreign"],
    "hash": lambda k: ["HSET", k, "foreign", "1"],
    "set": lambda k: ["SADD", k, "foreign"],
    "zset": lambda k: ["ZADD", k, 1, "foreign"],
}


def member(rid: str, *, token: str = "", result_list: str = "", queue: str = "") -> bytes:
    internal: dict[str, Any] = {}
    if token:
        internal["request_token"] = token
    if result_list:
        internal["result_queue_name"] = result_list
    if queue:
        internal["request_queue_name"] = queue
    doc = {"data": {"id": rid, "deadline": D}, "request_kind": "plain", "internal": internal}
    return json.dumps(doc, separators=(",", ":")).encode()


MA, MB = member("a", token="ga"), member("b", token="gb", result_list="rl-b")
RECORD = b'{"id":"x","payload":"{}"}'


def claims(*pairs: tuple[str, bytes, str], keys: QueueKeys = K) -> list[list[Arg]]:
    """Seed commands for claims ``(id, member, token)`` whose leases have lapsed."""
    out: list[list[Arg]] = []
    for rid, raw, token in pairs:
        out += [
            ["HSET", keys.claimed, rid, raw, f"{rid}:score", D],
            ["HSET", keys.owners, rid, token],
            ["ZADD", keys.index, 1, rid],
        ]
    return out


@dataclass
class Case:
    """One script call whose first item writes and whose second touches ``touched``."""

    script: str
    keys: list[str]
    argv: list[Arg]
    seed: list[list[Arg]]
    # key -> the types it may hold; "any": the script must also cope with every other type
    touched: dict[str, tuple[str, ...]]
    # ARGV position (1-based) -> bad values to try there
    bad_argv: dict[int, tuple[Arg, ...]] = field(default_factory=dict)
    # seed commands that break one hash field, each tried alone
    bad_fields: tuple[list[Arg], ...] = ()
    # keys the script may overwrite whatever they hold (claimkit's own string markers)
    markers: tuple[str, ...] = ()


QUEUE_TYPES = {
    K.pending: ("zset",),
    K.claimed: ("hash",),
    K.owners: ("hash",),
    K.index: ("zset",),
    K.deliveries: ("hash",),
    K.dead: ("zset",),
    CK.claimed: ("hash",),
    CK.owners: ("hash",),
    CK.index: ("zset",),
    CK.deliveries: ("hash",),
    CK.dead: ("zset",),
    OUTBOX: ("hash",),
    K.consumers: ("zset",),
    K.consumer_info: ("hash",),
}


def declared(*keys: str) -> dict[str, tuple[str, ...]]:
    return {k: QUEUE_TYPES[k] for k in keys}


ACK_ITEM_A: list[Arg] = ["a", "ta", "ga", "result-terminal:a", "rl-a", RECORD, MA, ""]
ACK_ITEM_B: list[Arg] = [
    "b",
    "tb",
    "gb",
    "result-terminal:b",
    "rl-b",
    RECORD,
    MB,
    "request-payload:b:gb",
]
DL_A: list[Arg] = [MA, "ga", "result-terminal:a", "rl-a", RECORD]
DL_B: list[Arg] = [MB, "gb", "result-terminal:b", "rl-b", RECORD]
ACK_KEYS = [K.pending, K.claimed, K.owners, K.index, K.deliveries]
RECLAIM_KEYS = [K.pending, K.claimed, K.owners, K.index, K.deliveries, K.dead]
STATS_KEYS = [K.pending, K.owners, K.index, K.dead, K.retry_set, K.retry_dead, K.consumers]
RECLAIM_ARGV: list[Arg] = [100, 10, "", "result-list", "result-terminal:", 100, 2, "0", 100, 30]
NUMBERS: tuple[Arg, ...] = ("x", "nan", "")
# The consumer a renew or a register names (lua/_liveness.lua): id, liveness ttl, host, pid,
# version; and ids a consumer cannot have.
CONSUMER_ARGS: list[Arg] = ["pod-a", 10, "host", 7, "0.1.0"]
BAD_IDS: tuple[Arg, ...] = ("-a", "a/b", "a b", "x" * 128)
REGISTRY_RENEW_KEYS = [K.owners, K.index, K.consumers, K.consumer_info]
# The cluster scripts (docs/topology.md#cluster-key-layout)
CACK_KEYS = [CK.pending, CK.claimed, CK.owners, CK.index, CK.deliveries, OUTBOX]
CRECLAIM_KEYS = [CK.pending, CK.claimed, CK.owners, CK.index, CK.deliveries, CK.dead, OUTBOX]
LOCAL_KEYS = [*CACK_KEYS, RL.results, RL.terminal, RL.expiry]
LOCAL_A: list[Arg] = ["a", "ta", "ga", RECORD, MA, "a\x00ta"]
LOCAL_B: list[Arg] = ["b", "tb", "gb", RECORD, MB, "b\x00tb"]
MOVE_A: list[Arg] = ["a", "ta", "ga", "rl-a", RECORD, MA, "a\x00ta"]
MOVE_B: list[Arg] = ["b", "tb", "gb", "rl-b", RECORD, MB, "b\x00tb"]
CDL_A: list[Arg] = [MA, "ga", "a", "a\x00x", "rl-a", RECORD]
CDL_B: list[Arg] = [MB, "gb", "b", "b\x00x", "rl-b", RECORD]
RL_TYPES: dict[str, tuple[str, ...]] = {
    RL.results: ("list", "any"),
    RL.terminal: ("hash", "any"),
    RL.expiry: ("zset", "any"),
}
RL_STRICT: dict[str, tuple[str, ...]] = {
    RL.results: ("list",),
    RL.terminal: ("hash",),
    RL.expiry: ("zset",),
}
PUSH_ARGV: list[Arg] = [100, "0", "a", "ga", RECORD, "b", "gb", RECORD]
# Durable result delivery (docs/results.md): a lease that ran out, a live one, a tombstone
# that expired, so each script's first step writes.
RC = ResultClaimKeys.for_list("rl")
RC_STRICT: dict[str, tuple[str, ...]] = {key: (kind,) for key, kind in RC.types().items()}
RC_SEED: list[list[Arg]] = [
    ["HSET", RC.claimed, "x", RECORD, "y", RECORD],
    ["HSET", RC.owners, "x", "o", "y", "o"],
    ["ZADD", RC.index, 1, "x", 9_999_999_999_999, "y"],
    ["ZADD", RC.tombstones, 1, "old"],
    ["LPUSH", RC.results, b'{"id":"z"}', b"not json"],
]

# The submit scripts (claimkit.protocol.submit): a member cut where internal.enqueue_seq goes
SEQ = f"request-seq:{Q}:{D}"
CSEQ = f"request-seq:{{{Q}}}:{D}"
BEFORE = b'{"internal":{"enqueue_seq":'


def after(rid: str) -> bytes:
    return b'},"request_kind":"plain","data":{"id":"' + rid.encode() + b'","deadline":%d}}' % D


SUBMIT_A: list[Arg] = [SEQ, D + 3600, "request-cancel:a", "request-active:a", "ga", D * 1000]
SUBMIT_A += ["", "", "", BEFORE, after("a"), D]
SUBMIT_B: list[Arg] = [SEQ, D + 3600, "request-cancel:b", "request-active:b", "gb", D * 1000]
SUBMIT_B += ["request-payload:b:gb", "{}", D * 1000 + 600000, BEFORE, after("b"), D]
SUBMIT_MARKERS = ("request-cancel:b", "request-active:b", "request-payload:b:gb")
WHOLE: tuple[Arg, ...] = ("x", "nan", "", "1.5", "-1")

CASES: dict[str, Case] = {
    "claim": Case(
        "claim",
        [K.pending, K.claimed, K.owners, K.index],
        [60, "request-cancel:", MA, "a", "ta", D, "ga", MB, "b", "tb", D, "gb"],
        [["ZADD", K.pending, D, MA, D, MB]],
        {
            **declared(K.pending, K.claimed, K.owners, K.index),
            "request-cancel:b": ("string", "any"),
        },
        bad_argv={1: NUMBERS, 6: NUMBERS, 11: NUMBERS},
    ),
    "ack": Case(
        "ack",
        ACK_KEYS,
        [100, "fallback", *ACK_ITEM_A, *ACK_ITEM_B],
        claims(("a", MA, "ta"), ("b", MB, "tb")),
        {
            **declared(*ACK_KEYS),
            "result-terminal:b": ("string", "any"),
            "rl-b": ("list", "any"),
            # the request's payload key: deleted whatever it holds (DEL cannot fail)
            "request-payload:b:gb": ("string", "any"),
        },
        bad_argv={1: WHOLE},
        markers=("result-terminal:b", "request-payload:b:gb"),
    ),
    "ack-fallback": Case(
        "ack",
        ACK_KEYS,
        [100, "fallback", *ACK_ITEM_A, *ACK_ITEM_B],
        [*claims(("a", MA, "ta"), ("b", MB, "tb")), ["SADD", "rl-b", "foreign"]],
        {"fallback": ("list",)},
    ),
    "dead-letter": Case(
        "dead-letter",
        [K.pending, K.dead],
        [100, "fallback", *DL_A, *DL_B],
        [["ZADD", K.pending, D, MA, D, MB]],
        {
            **declared(K.pending, K.dead),
            "result-terminal:b": ("string", "any"),
            "rl-b": ("list", "any"),
        },
        bad_argv={1: WHOLE},
        markers=("result-terminal:b",),
    ),
    "dead-letter-fallback": Case(
        "dead-letter",
        [K.pending, K.dead],
        [100, "fallback", *DL_A, *DL_B],
        [["ZADD", K.pending, D, MA, D, MB], ["SADD", "rl-b", "foreign"]],
        {"fallback": ("list",)},
    ),
    "move-retries": Case(
        "move-retries",
        ["retry", "retry:dead"],
        [100],
        [["ZADD", "retry", 0, member("a", queue="qa"), 1, member("b", queue="qb")]],
        {"retry": ("zset",), "retry:dead": ("zset",), "qb": ("zset", "any")},
        bad_argv={1: WHOLE},
    ),
    "park": Case(
        "park",
        [K.claimed, K.owners, K.index, "retry"],
        ["a", "ta", 1, MA, "b", "tb", 2, MB],
        claims(("a", MA, "ta"), ("b", MB, "tb")),
        {**declared(K.claimed, K.owners, K.index), "retry": ("zset",)},
        bad_argv={3: NUMBERS, 7: NUMBERS},
    ),
    "reclaim": Case(
        "reclaim",
        RECLAIM_KEYS,
        RECLAIM_ARGV,
        [*claims(("a", MA, "ta"), ("b", MB, "tb")), ["HSET", K.deliveries, "b", 9]],
        {
            **declared(*RECLAIM_KEYS),
            "result-terminal:b": ("string", "any"),
            "rl-b": ("list", "any"),
        },
        bad_argv={
            1: WHOLE,
            2: WHOLE,
            6: WHOLE,
            7: ("1", "x"),
            8: ("bad", "-1"),
            9: WHOLE,
            10: (*NUMBERS, "0", "-1"),
        },
        bad_fields=(
            ["HSET", K.deliveries, "a", "many"],
            ["HSET", K.deliveries, "a", "99999999999999999999999"],
            ["HSET", K.claimed, "a:score", "soon"],
            ["HSET", K.claimed, "b:score", "nan"],
            ["HDEL", K.claimed, "b:score"],
        ),
        markers=("result-terminal:b",),
    ),
    "reclaim-fallback": Case(
        "reclaim",
        RECLAIM_KEYS,
        RECLAIM_ARGV,
        [
            *claims(("a", MA, "ta"), ("b", MB, "tb")),
            ["HSET", K.deliveries, "b", 9],
            ["SADD", "rl-b", "foreign"],
        ],
        {"result-list": ("list",)},
    ),
    "reclaim-orphans": Case(
        "reclaim",
        RECLAIM_KEYS,
        RECLAIM_ARGV,
        [
            *claims(("a", MA, "ta"), ("b", MB, "tb")),
            ["ZREM", K.index, "a", "b"],
            ["HSET", K.deliveries, "b", 9],
        ],
        declared(*RECLAIM_KEYS),
        bad_argv={8: ("bad",)},
        bad_fields=(["HSET", K.claimed, "b:score", "soon"], ["HSET", K.deliveries, "a", "x"]),
    ),
    "release": Case(
        "release",
        [K.pending, K.claimed, K.owners, K.index],
        ["a", "ta", "", "b", "tb", ""],
        claims(("a", MA, "ta"), ("b", MB, "tb")),
        declared(K.pending, K.claimed, K.owners, K.index),
        bad_argv={3: ("x", "nan"), 6: ("x", "nan")},
        bad_fields=(["HSET", K.claimed, "b:score", "soon"], ["HDEL", K.claimed, "b:score"]),
    ),
    "renew": Case(
        "renew",
        REGISTRY_RENEW_KEYS,
        [60, *CONSUMER_ARGS, "a", "ta", D, "b", "tb", D],
        claims(("a", MA, "ta"), ("b", MB, "tb")),
        declared(*REGISTRY_RENEW_KEYS),
        bad_argv={1: NUMBERS, 2: BAD_IDS, 3: (*NUMBERS, "0", "-1"), 5: WHOLE, 9: NUMBERS},
    ),
    # The consumer registry (docs/protocol.md#consumers): a lapsed consumer "c" whose claim
    # "a" has its lease ahead, so the expire-owners call writes.
    "register": Case(
        "register",
        [K.consumers, K.consumer_info],
        CONSUMER_ARGS,
        [],
        declared(K.consumers, K.consumer_info),
        bad_argv={1: BAD_IDS, 2: (*NUMBERS, "0", "-1"), 4: WHOLE},
    ),
    "expire-owners": Case(
        "expire-owners",
        [K.owners, K.index, K.consumers],
        ["0", 100, "if-alive"],
        [
            *claims(("a", MA, "c/" + "0" * 32), ("b", MB, "live/" + "0" * 32)),
            ["ZADD", K.index, "XX", D, "a", D, "b"],
            ["ZADD", K.consumers, 1000, "c", D, "live"],
        ],
        declared(K.owners, K.index, K.consumers),
        bad_argv={1: ("x", "-1"), 2: WHOLE, 3: ("x", "")},
    ),
    "forget-consumers": Case(
        "forget-consumers",
        [K.consumers, K.consumer_info],
        ["dead"],
        [
            ["ZADD", K.consumers, 1000, "c", -900, "d", D, "live"],
            ["HSET", K.consumer_info, "c", "{}", "d", "{}", "live", "{}"],
        ],
        declared(K.consumers, K.consumer_info),
        bad_argv={1: ("x", "")},
    ),
    "consumers": Case(
        "consumers",
        [K.consumers, K.consumer_info, K.owners],
        [0],
        [
            *claims(("a", MA, "c/" + "0" * 32)),
            ["ZADD", K.consumers, 1000, "c"],
            ["HSET", K.consumer_info, "c", "{}"],
        ],
        declared(K.consumers, K.consumer_info, K.owners),
        bad_argv={1: ("x", "-1")},
    ),
    "requeue-dead": Case(
        "requeue-dead",
        [K.dead, K.pending, K.deliveries],
        ["result-terminal:", "0", MA, MB],
        [
            ["ZADD", K.dead, 1, MA, 2, MB],
            ["SET", "result-terminal:a", "ga"],
            ["HSET", K.deliveries, "a", 3, "b", 3],
        ],
        {**declared(K.dead, K.pending, K.deliveries), "result-terminal:b": ("string", "any")},
    ),
    "drop-markers": Case(
        "drop-markers",
        ["{rl}:result-terminal", "{rl}:result-terminal-expiry"],
        ["a", "ga", "b", "gb"],
        [
            ["HSET", "{rl}:result-terminal", "a", "ga", "b", "gb"],
            ["ZADD", "{rl}:result-terminal-expiry", D, "a", D, "b"],
        ],
        {"{rl}:result-terminal": ("hash",), "{rl}:result-terminal-expiry": ("zset",)},
    ),
    "ack-local": Case(
        "ack-local",
        LOCAL_KEYS,
        [100, "0", "fallback", *LOCAL_A, *LOCAL_B],
        claims(("a", MA, "ta"), ("b", MB, "tb"), keys=CK),
        # A list or marker key of another type: the records go to the outbox instead.
        {**declared(*CACK_KEYS), **RL_TYPES},
        bad_argv={1: WHOLE},
    ),
    "ack-local-final": Case(
        "ack-local",
        LOCAL_KEYS,
        [100, "1", "rl-b", *LOCAL_A, *LOCAL_B],
        claims(("a", MA, "ta"), ("b", MB, "tb"), keys=CK),
        RL_STRICT,
    ),
    "ack-outbox": Case(
        "ack-outbox",
        CACK_KEYS,
        [*MOVE_A, *MOVE_B],
        claims(("a", MA, "ta"), ("b", MB, "tb"), keys=CK),
        declared(*CACK_KEYS),
    ),
    "push-result": Case(
        "push-result",
        [RL.results, RL.terminal, RL.expiry],
        PUSH_ARGV,
        [["HSET", RL.terminal, "a", "1"], ["ZADD", RL.expiry, 1, "a"]],  # an expired marker
        RL_TYPES,
        bad_argv={1: WHOLE},
    ),
    "push-result-final": Case(
        "push-result",
        [RL.results, RL.terminal, RL.expiry],
        [100, "1", *PUSH_ARGV[2:]],
        [],
        RL_STRICT,
    ),
    "outbox-aim": Case(
        "outbox-aim",
        [OUTBOX],
        ["a\x00ta", "{}", "b\x00tb", "{}"],
        [["HSET", OUTBOX, "a\x00ta", "old", "b\x00tb", "old"]],
        declared(OUTBOX),
    ),
    "dead-letter-outbox": Case(
        "dead-letter-outbox",
        [CK.pending, CK.dead, OUTBOX],
        [*CDL_A, *CDL_B],
        [["ZADD", CK.pending, D, MA, D, MB]],
        declared(CK.pending, CK.dead, OUTBOX),
    ),
    "move-retries-queue": Case(
        "move-retries-queue",
        ["{qa}:retry", "{qa}:retry:dead", "qa"],
        [100],
        [["ZADD", "{qa}:retry", 0, member("a", queue="qa"), 1, member("b", queue="qb")]],
        {"{qa}:retry": ("zset",), "{qa}:retry:dead": ("zset",), "qa": ("zset",)},
        bad_argv={1: WHOLE},
    ),
    "reclaim-cluster": Case(
        "reclaim-cluster",
        CRECLAIM_KEYS,
        RECLAIM_ARGV,
        [*claims(("a", MA, "ta"), ("b", MB, "tb"), keys=CK), ["HSET", CK.deliveries, "b", 9]],
        declared(*CRECLAIM_KEYS),
        bad_argv={
            1: WHOLE,
            2: WHOLE,
            6: WHOLE,
            7: ("1", "x"),
            8: ("bad", "-1"),
            9: WHOLE,
            10: (*NUMBERS, "0", "-1"),
        },
    ),
    "result-receive": Case(
        "result-receive",
        RC.all(),
        ["o2", 1000, 100, 100, 100, 3],
        RC_SEED,
        RC_STRICT,
        bad_argv={1: ("",), 2: (*WHOLE, "0"), 3: WHOLE, 4: WHOLE, 5: WHOLE, 6: (*WHOLE, "0")},
    ),
    "result-renew": Case(
        "result-renew",
        [RC.owners, RC.index],
        ["y", "o", 1000],
        RC_SEED,
        {RC.owners: ("hash",), RC.index: ("zset",)},
        bad_argv={2: ("",), 3: (*WHOLE, "0")},
    ),
    "result-ack": Case(
        "result-ack",
        RC.all()[1:],
        ["y", "o", 604800000, 100],
        RC_SEED,
        {k: v for k, v in RC_STRICT.items() if k != RC.results},
        bad_argv={2: ("",), 3: (*WHOLE, "0"), 4: (*WHOLE, "0")},
    ),
    "result-pop": Case(
        "result-pop",
        RC.all(),
        [10],
        [["LPUSH", RC.results, RECORD]],
        RC_STRICT,
        bad_argv={1: (*WHOLE, "0")},
    ),
    "result-inspect": Case(
        "result-inspect",
        [RC.results, RC.index, RC.tombstones],
        [],
        RC_SEED,
        {RC.results: ("list",), RC.index: ("zset",), RC.tombstones: ("zset",)},
    ),
    "submit": Case(
        "submit",
        [K.pending],
        [*SUBMIT_A, *SUBMIT_B],
        [],
        {
            **declared(K.pending),
            # A counter of another type is refused before any write (the reply names it).
            SEQ: ("string", "any"),
            **{marker: ("string", "any") for marker in SUBMIT_MARKERS},
        },
        bad_argv={2: WHOLE, 6: WHOLE, 12: WHOLE, 21: WHOLE, 24: WHOLE},
        markers=SUBMIT_MARKERS,
    ),
    "enqueue": Case(
        "enqueue",
        [CK.pending, CSEQ],
        [D + 3600, D, BEFORE, after("a"), BEFORE, after("b")],
        [],
        {CK.pending: ("zset",), CSEQ: ("string", "any")},
        bad_argv={1: WHOLE, 2: WHOLE},
    ),
    "queue-stats": Case(
        "queue-stats",
        STATS_KEYS,
        [16],
        [*claims(("a", MA, "ta")), ["ZADD", K.pending, D, MB], ["ZADD", K.consumers, D, "c1"]],
        {
            **declared(K.pending, K.owners, K.index, K.dead),
            K.retry_set: ("zset",),
            K.retry_dead: ("zset",),
            K.consumers: ("zset",),
        },
        bad_argv={1: ("x", "0", "-1", "1.5")},
    ),
    "inspect": Case(
        "inspect",
        RECLAIM_KEYS,
        [0, 100],
        claims(("a", MA, "ta")),
        declared(*RECLAIM_KEYS),
        bad_argv={1: ("x", "-1"), 2: ("x",)},
    ),
}


def test_every_script_is_audited() -> None:
    assert {c.script for c in CASES.values()} == set(all_scripts())


async def dump(store: Store) -> dict[bytes, tuple[bytes, bytes]]:
    out: dict[bytes, tuple[bytes, bytes]] = {}
    for key in sorted(await store.command("KEYS", "*")):
        out[key] = (await store.command("TYPE", key), await store.command("DUMP", key))
    return out


async def run_case(
    store: Store, case: Case, *, argv: list[Arg] | None = None, extra: Sequence[Sequence[Arg]] = ()
) -> tuple[bool, dict[bytes, tuple[bytes, bytes]], dict[bytes, tuple[bytes, bytes]]]:
    """Seed, run; ``(succeeded, before, after)``."""
    await store.command("FLUSHDB")
    if case.seed:
        await store.pipeline(case.seed, transaction=True)
    for command in extra:
        await store.command(*command)
    before = await dump(store)
    s = all_scripts()[case.script]
    try:
        await store.run(s, case.keys, case.argv if argv is None else argv)
        ok = True
    except StoreError:
        ok = False
    return ok, before, await dump(store)


def _wrong_type_params() -> list[tuple[str, str, str]]:
    out = []
    for name, case in CASES.items():
        for key, allowed in case.touched.items():
            for kind in TYPES:
                if kind not in allowed:
                    out.append((name, key, kind))
    return out


@pytest.mark.parametrize(("name", "key", "kind"), _wrong_type_params())
async def test_a_key_of_any_other_type_never_fails_a_script_half_way(
    store: Store, name: str, key: str, kind: str
) -> None:
    case = CASES[name]
    with trio.fail_after(10):
        ok, before, after = await run_case(store, case, extra=[["DEL", key], MAKE[kind](key)])
        if not ok:
            assert after == before, "failed after writing"
        else:
            assert "any" in case.touched[key], "a key of the wrong type went unnoticed"
            if key not in case.markers:
                assert after.get(key.encode()) == before[key.encode()], "a foreign key changed"


def _bad_argv_params() -> list[tuple[str, int, Arg]]:
    return [
        (name, i, value)
        for name, case in CASES.items()
        for i, values in case.bad_argv.items()
        for value in values
    ]


@pytest.mark.parametrize(("name", "position", "value"), _bad_argv_params())
async def test_a_bad_argument_fails_a_script_before_its_first_write(
    store: Store, name: str, position: int, value: Arg
) -> None:
    case = CASES[name]
    argv = list(case.argv)
    argv[position - 1] = value
    with trio.fail_after(10):
        ok, before, after = await run_case(store, case, argv=argv)
        if not ok:
            assert after == before, "failed after writing"


def _bad_field_params() -> list[tuple[str, int]]:
    return [(name, i) for name, case in CASES.items() for i in range(len(case.bad_fields))]


@pytest.mark.parametrize(("name", "index"), _bad_field_params())
async def test_a_broken_hash_field_never_fails_a_script_or_drops_a_payload(
    store: Store, name: str, index: int
) -> None:
    case = CASES[name]
    with trio.fail_after(10):
        ok, _, _ = await run_case(store, case, extra=[case.bad_fields[index]])
        assert ok, "a hand-edited field failed the script"
        # Both requests still live somewhere: pending, dead (with a record) or claimed.
        pending = await store.command("ZRANGE", K.pending, 0, -1)
        dead = await store.command("ZRANGE", K.dead, 0, -1)
        held = await store.command("HMGET", K.claimed, "a", "b")
        assert sorted([*pending, *dead, *(h for h in held if h)]) == sorted([MA, MB])


async def test_out_of_memory_never_fails_a_script_half_way(redis_factory: RedisFactory) -> None:
    """Redis out of memory (noeviction): a script is refused only at its first write that
    needs memory, before anything is written; once it has written it runs to the end."""
    server = redis_factory(extra_args=["--maxmemory-policy", "noeviction"])
    with trio.fail_after(60):
        refused: set[str] = set()
        async with open_store(server.url) as store:
            for name, case in CASES.items():
                await store.command("CONFIG", "SET", "maxmemory", "0")
                await store.command("FLUSHDB")
                if case.seed:
                    await store.pipeline(case.seed, transaction=True)
                await fill_memory(store)
                before = await dump(store)
                try:
                    await store.run(all_scripts()[case.script], case.keys, case.argv)
                except StoreError as exc:
                    # Either outcome is allowed, so no pytest.raises: a refusal must be OOM.
                    assert "OOM" in str(exc), (name, exc)  # noqa: PT017
                    assert await dump(store) == before, name
                    refused.add(name)
        # Those whose first write needs memory are refused; the others run to the end.
        assert {"ack", "renew"} <= refused


async def fill_memory(store: Store) -> None:
    """Put Redis over its memory limit: 2 MB of data, then ``maxmemory`` 1 MB."""
    await store.command("SET", "filler", "x" * 2_000_000)
    await store.command("CONFIG", "SET", "maxmemory", "1mb")
    with pytest.raises(StoreError, match="OOM"):
        await store.command("LPUSH", "probe", "x")
