"""SPEC §3.8 at the protocol level: every exit path ends in exactly one claim outcome.

One test per row of the table. Requests are submitted with the real :class:`Producer`
(so they carry a generation token), driven through :class:`QueueOps` the way the consumer
drives them, and each test ends by comparing the whole keyspace with what the row promises:
which keys hold the id, the score it went back at, the record that was pushed.

``tests/test_exit_paths_cluster.py`` runs every test here again on a real Redis Cluster
(docs/topology.md#cluster-key-layout); the dedup markers and the retry set are named by
``support.markers`` and ``support.retry_keys`` for the layout at hand, and "another
instance" is a second store on the same Redis (``support.reopen``).
"""

from __future__ import annotations

import json
import random
from typing import TYPE_CHECKING, Any

import pytest
import support
import trio
from support import Between, markers, reopen, retry_keys, server_now

from claimkit.config import QueueConfig
from claimkit.consumer.gates import GateError, make_gate
from claimkit.producer import Producer
from claimkit.protocol.keys import QueueKeys
from claimkit.protocol.models import (
    DEADLINE_INVALID_MESSAGE,
    Envelope,
    ErrorCode,
    Invalid,
    TerminalRecord,
    parse_member,
    retry_member,
)
from claimkit.protocol.ops import AckItem, ClaimCode, QueueOps, new_token

if TYPE_CHECKING:
    from claimkit.store import Store

if TYPE_CHECKING:
    from collections.abc import Sequence

Q = "{tenant-b}:jobs"
K = QueueKeys.for_queue(Q)
RESULTS = "result-list"
DEDUP = 3600
LEASE = 60.0

approx = pytest.approx


async def snapshot(store: Store, *, with_active: bool = False) -> dict[str, Any]:
    """The whole keyspace (``support.snapshot``). The producer's ``request-active:<id>``
    keys are left out (no exit path touches them) unless asked for, and then only their
    values are compared (their TTL ticks on); so are its enqueue-order counters
    (``request-seq:``)."""
    out = await support.snapshot(store, skip_prefix=("request-active:", "request-seq:"))
    if with_active:
        for key in await store.command("KEYS", "request-active:*"):
            out[key.decode()] = await store.command("GET", key)
    return out


async def submit(store: Store, *requests: dict[str, Any]) -> list[Envelope]:
    """Submit through the real producer; return the pending envelopes, earliest first."""
    await Producer(store, Q).submit_many(requests)
    members = await QueueOps(store, Q).peek(len(requests) + 10)
    envs = [e for m in members if isinstance(e := parse_member(m), Envelope)]
    assert len(envs) == len(members) == len(requests)
    return envs


async def claim(
    ops: QueueOps, envs: Sequence[Envelope]
) -> tuple[float, list[ClaimCode], list[str]]:
    tokens = [new_token() for _ in envs]
    now, codes = await ops.claim(list(zip(envs, tokens, strict=True)), LEASE)
    return now, codes, tokens


def ack_item(ops: QueueOps, env: Envelope, token: str, record: TerminalRecord) -> AckItem:
    return AckItem(
        env.id,
        token,
        env.request_token,
        ops.result_list_for(env.result_queue_name),
        record.to_json(),
        env.raw,
    )


class ScoreText:
    """Equal to a score as Redis writes it (``b"1900000000.0000005"``) when it reads back as
    ``score``: Redis versions spell a double with 17 digits or with the fewest that give it
    back."""

    def __init__(self, score: float) -> None:
        self.score = score

    def __eq__(self, other: object) -> bool:
        return isinstance(other, bytes) and float(other) == self.score

    def __repr__(self) -> str:
        return f"ScoreText({self.score!r})"


def claim_entries(envs: Sequence[Envelope], tokens: Sequence[str], now: float) -> dict[str, Any]:
    claimed: dict[bytes, bytes | ScoreText] = {}
    for e in envs:
        claimed[e.id.encode()] = e.raw
        claimed[f"{e.id}:score".encode()] = ScoreText(e.score)
    return {
        K.claimed: claimed,
        K.owners: {e.id.encode(): t.encode() for e, t in zip(envs, tokens, strict=True)},
        K.index: [
            (rid, approx(expiry, abs=1e-5))
            for expiry, rid in sorted(
                (min(now + LEASE, e.deadline + 30), e.id.encode()) for e in envs
            )
        ],
    }


# -- row 1: terminal record produced -> acked after the record is pushed ---------------------


def outcome(kind: str, rid: str) -> TerminalRecord:
    if kind == "success":
        return TerminalRecord.http(rid, 200, '{"choices":[{"text":"ünï"}]}')
    if kind == "http-error":
        return TerminalRecord.http(rid, 400, '{"error":"bad prompt"}')
    if kind == "cancelled":
        return TerminalRecord.error(rid, ErrorCode.CANCELLED, "cancelled")
    if kind == "deadline":
        return TerminalRecord.error(rid, ErrorCode.DEADLINE_EXCEEDED, "deadline exceeded")
    if kind == "drop":
        return TerminalRecord.error(rid, ErrorCode.GATE_DROPPED, "Pool gating dropped request")
    assert kind == "inference-error"
    return TerminalRecord.error(
        rid, ErrorCode.INFERENCE_ERROR, "Failed to send request to inference: connection refused"
    )


@pytest.mark.parametrize(
    "kind", ["success", "http-error", "cancelled", "deadline", "drop", "inference-error"]
)
async def test_terminal_record_is_acked(store: Store, kind: str) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, Q, dedup_ttl=DEDUP)
        now = await server_now(store)
        rid = f"job:{kind}"
        if kind == "deadline":
            # Its deadline passed while it waited: the producer accepted it long ago.
            raw = json.dumps(
                {
                    "internal": {"request_token": "d" * 32},
                    "request_kind": "plain",
                    "data": {"id": rid, "deadline": int(now) - 5},
                },
                separators=(",", ":"),
            ).encode()
            await store.command("ZADD", Q, int(now) - 5, raw)
            env = parse_member(raw)
            assert isinstance(env, Envelope)
        else:
            (env,) = await submit(
                store, {"id": rid, "deadline": int(now) + 600, "payload": {"p": 1}}
            )
        if kind == "cancelled":
            assert await Producer(store, Q).cancel(rid)

        _, codes, (token,) = await claim(ops, [env])
        assert codes == [ClaimCode.CANCELLED if kind == "cancelled" else ClaimCode.CLAIMED]
        record = outcome(kind, rid)
        assert await ops.ack([ack_item(ops, env, token, record)]) == [(True, True)]

        expected: dict[str, Any] = {
            RESULTS: [record.to_json()],
            **markers(store, (rid, env.request_token, DEDUP)),
        }
        if kind == "cancelled":
            expected[f"request-cancel:{rid}"] = (env.request_token.encode(), 604800)
        assert await snapshot(store) == expected
        (doc,) = [json.loads(r) for r in expected[RESULTS]]
        order = (
            ["id", "status_code", "payload"]
            if record.status_code
            else ["id", "payload", "error_code", "error_message"]
        )
        assert list(doc) == order


async def test_invalid_request_is_dead_lettered_with_one_record(store: Store) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, Q, dedup_ttl=DEDUP)
        raw = json.dumps(
            {
                "internal": {"request_token": "c" * 32},
                "request_kind": "plain",
                "data": {"id": "bad", "deadline": -1},
            }
        ).encode()
        await store.command("ZADD", Q, 1, raw)
        (member,) = await ops.peek(10)
        invalid = parse_member(member)
        assert isinstance(invalid, Invalid)
        t0 = await server_now(store)
        assert await ops.dead_letter([invalid]) == (1, 1)
        t1 = await server_now(store)
        record = TerminalRecord.error(
            "bad", ErrorCode.INVALID_REQUEST, DEADLINE_INVALID_MESSAGE, "c" * 32
        )
        assert await snapshot(store) == {
            K.dead: [(raw, Between(t0, t1))],
            RESULTS: [record.to_json()],
            **markers(store, ("bad", "c" * 32, DEDUP)),
        }


# -- row 2: retryable failure -> parked in the retry set ---------------------------------------


async def test_retryable_failure_is_parked_then_moved_back(store: Store) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, Q, dedup_ttl=DEDUP)
        now = await server_now(store)
        deadline = int(now) + 600
        (env,) = await submit(store, {"id": "r:1", "deadline": deadline})
        _, _, (token,) = await claim(ops, [env])

        retry = retry_member(env.raw, Q)
        server, codes = await ops.park([("r:1", token, 2.5, retry)])
        assert codes == [1]
        # The retry set is its only home: no claim, nothing pending.
        retry_set = retry_keys(store, Q)[0]
        assert await snapshot(store) == {retry_set: [(retry, approx(server + 2.5, abs=1e-5))]}
        # An owner dying now changes nothing: there is no claim to reclaim.
        assert (await ops.reclaim(max_deliveries=10)).redelivered == 0

        await store.command("ZADD", retry_set, "XX", 1, retry)  # its backoff is over
        assert await ops.move_retries() == (1, 0)
        assert await snapshot(store) == {Q: [(retry, env.score)]}
        retried = parse_member(retry)
        assert isinstance(retried, Envelope)
        assert (retried.retry_count, retried.request_token) == (1, env.request_token)


# -- row 3: hand-off cancelled -> released at the original score -------------------------------


async def test_cancelled_hand_off_is_released_at_the_original_score(store: Store) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, Q)
        now = int(await server_now(store))
        envs = await submit(
            store, {"id": "h:1", "deadline": now + 100}, {"id": "h:2", "deadline": now + 200}
        )
        before = await snapshot(store)
        server, _, tokens = await claim(ops, envs)
        assert await ops.release([("h:2", tokens[1], None)]) == [1]
        assert await snapshot(store) == {
            Q: [(envs[1].raw, envs[1].score)],
            **claim_entries(envs[:1], tokens[:1], server),
        }
        assert await ops.release([("h:1", tokens[0], None)]) == [1]
        assert await snapshot(store) == before


# -- row 4: graceful shutdown -> every held claim swept ----------------------------------------


async def test_graceful_shutdown_sweeps_every_held_claim(store: Store) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, Q, dedup_ttl=DEDUP)
        now = int(await server_now(store))
        envs = await submit(store, *({"id": f"s:{i}", "deadline": now + 100 + i} for i in range(4)))
        pending_before = (await snapshot(store))[Q]
        _, _, tokens = await claim(ops, envs)
        # One finished before the sweep and was acked.
        done = TerminalRecord.http("s:0", 200, "ok")
        assert await ops.ack([ack_item(ops, envs[0], tokens[0], done)]) == [(True, True)]

        # The sweep hands back everything still held (s:3's task ignores cancellation).
        held = [(e.id, t, None) for e, t in zip(envs[1:], tokens[1:], strict=True)]
        assert await ops.release(held) == [1, 1, 1]
        assert await snapshot(store) == {
            Q: pending_before[1:],
            RESULTS: [done.to_json()],
            **markers(store, ("s:0", envs[0].request_token, DEDUP)),
        }

        # s:3's task finishes after the sweep: its record is pushed once and the copy the
        # sweep returned is withdrawn, so it is not run again.
        late = TerminalRecord.http("s:3", 200, "late")
        assert await ops.ack([ack_item(ops, envs[3], tokens[3], late)]) == [(True, False)]
        assert await snapshot(store) == {
            Q: pending_before[1:3],
            RESULTS: [late.to_json(), done.to_json()],
            **markers(
                store,
                ("s:0", envs[0].request_token, DEDUP),
                ("s:3", envs[3].request_token, DEDUP),
            ),
        }


async def test_late_ack_after_another_instance_finished_is_suppressed(store: Store) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, Q, dedup_ttl=DEDUP)
        (env,) = await submit(store, {"id": "s", "deadline": int(await server_now(store)) + 100})
        _, _, (token,) = await claim(ops, [env])
        assert await ops.release([("s", token, None)]) == [1]  # the shutdown sweep
        async with reopen(store) as other_store:
            other = QueueOps(other_store, Q, dedup_ttl=DEDUP)
            _, codes, (token_b,) = await claim(other, [env])
            assert codes == [ClaimCode.CLAIMED]
            first = TerminalRecord.http("s", 200, "B")
            assert await other.ack([ack_item(other, env, token_b, first)]) == [(True, True)]
        late = TerminalRecord.http("s", 200, "A")
        assert await ops.ack([ack_item(ops, env, token, late)]) == [(False, False)]
        assert await snapshot(store) == {
            RESULTS: [first.to_json()],
            **markers(store, ("s", env.request_token, DEDUP)),
        }


# -- row 5: owner dies -> lease lapses, any instance's reclaimer redelivers --------------------


async def test_dead_owner_is_reclaimed_by_another_instance(store: Store) -> None:
    with trio.fail_after(10):
        now = int(await server_now(store))
        envs = await submit(
            store, {"id": "o:1", "deadline": now + 100}, {"id": "o:2", "deadline": now + 200}
        )
        pending_before = (await snapshot(store))[Q]

        async with reopen(store) as store_a:  # instance A claims, then dies
            a = QueueOps(store_a, Q, dedup_ttl=DEDUP)
            server_a, _, tokens_a = await claim(a, envs)
        assert await snapshot(store) == claim_entries(envs, tokens_a, server_a)

        async with reopen(store) as store_b:
            b = QueueOps(store_b, Q, dedup_ttl=DEDUP)
            assert (await b.reclaim(max_deliveries=10)).redelivered == 0  # leases still live
            await store.command("ZADD", K.index, "XX", 1, "o:1", 1, "o:2")  # ... until they lapse
            counts = await b.reclaim(max_deliveries=10)
            assert (counts.redelivered, counts.dead, counts.ghosts) == (2, 0, 0)
            assert await snapshot(store) == {
                Q: pending_before,
                K.deliveries: {b"o:1": b"1", b"o:2": b"1"},
            }

            server_b, codes, tokens_b = await claim(b, envs)
            assert codes == [1, 1]
            # A's heartbeat, had it survived, would now find its claims taken.
            _, renewed = await QueueOps(store, Q).renew(
                [(e.id, t, e.deadline) for e, t in zip(envs, tokens_a, strict=True)], LEASE
            )
            assert renewed == [-1, -1]
            records = [TerminalRecord.http(e.id, 200, "done") for e in envs]
            items = [ack_item(b, e, t, r) for e, t, r in zip(envs, tokens_b, records, strict=True)]
            assert await b.ack(items) == [(True, True), (True, True)]
        assert await snapshot(store) == {
            RESULTS: [records[1].to_json(), records[0].to_json()],
            **markers(
                store,
                ("o:1", envs[0].request_token, DEDUP),
                ("o:2", envs[1].request_token, DEDUP),
            ),
        }
        del server_b


async def test_lease_lapses_by_the_server_clock(store: Store) -> None:
    with trio.fail_after(10):
        (env,) = await submit(store, {"id": "t", "deadline": int(await server_now(store)) + 100})
        a = QueueOps(store, Q)
        _, codes = await a.claim([(env, new_token())], 0.05)
        assert codes == [1]
        expiry = float(await store.command("ZSCORE", K.index, "t"))
        # Wait out the lease as Redis's clock counts it (the clocks run at the same rate).
        await trio.sleep(max(0.0, expiry - await server_now(store)) + 0.01)
        assert await server_now(store) > expiry
        async with reopen(store) as store_b:
            counts = await QueueOps(store_b, Q).reclaim(max_deliveries=10)
        assert counts.redelivered == 1
        assert await snapshot(store) == {Q: [(env.raw, env.score)], K.deliveries: {b"t": b"1"}}


# -- row 6: gate refuses / gate error -> never claimed, bytes unchanged ------------------------


async def poll_once(ops: QueueOps, gate: Any, inflight: int) -> list[ClaimCode]:
    """The consumer's peek -> check -> gate -> claim round, at the protocol level."""
    members = await ops.peek(10)
    envs = [e for m in members if isinstance(e := parse_member(m), Envelope)]
    try:
        admitted = await gate.admit(len(envs), inflight)
    except GateError:
        admitted = 0
    if not admitted:
        return []
    _, codes = await ops.claim([(e, new_token()) for e in envs[:admitted]], LEASE)
    return codes


def queue_config(gate_type: str, **params: Any) -> QueueConfig:
    return QueueConfig(
        queue_name=Q, igw_base_url="http://gateway.invalid", gate_type=gate_type, gate_params=params
    )


@pytest.mark.parametrize(
    ("gate_type", "params", "budget", "inflight"),
    [
        ("redis", {"key": "budget"}, b"0", 0),
        ("redis", {}, b"0", 0),  # the default key, dispatch-gate-budget
        ("redis", {"key": "budget"}, b"lots", 0),  # a gate error
        ("redis", {"key": "budget"}, b"1.5", 0),  # a gate error
        ("local-max-concurrency", {"limit": 2}, None, 2),
        ("local-max-concurrency", {"limit": 2}, None, 5),
    ],
)
async def test_gate_refusal_leaves_requests_pending_unchanged(
    store: Store, gate_type: str, params: dict[str, Any], budget: bytes | None, inflight: int
) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, Q)
        if budget is not None:
            await store.command("SET", params.get("key", "dispatch-gate-budget"), budget)
        now = int(await server_now(store))
        await submit(
            store, {"id": "g:1", "deadline": now + 100}, {"id": "g:2", "deadline": now + 200}
        )
        before = await snapshot(store, with_active=True)
        gate = make_gate(queue_config(gate_type, **params), store, random.Random(7))
        assert await poll_once(ops, gate, inflight) == []
        assert await snapshot(store, with_active=True) == before


async def test_a_partly_open_gate_claims_only_what_it_admits(store: Store) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, Q)
        now = int(await server_now(store))
        envs = await submit(store, *({"id": f"p:{i}", "deadline": now + 100 + i} for i in range(3)))
        gate = make_gate(queue_config("local-max-concurrency", limit=3), store)
        assert await poll_once(ops, gate, inflight=1) == [1, 1]  # room for two
        state = await snapshot(store)
        assert state[Q] == [(envs[2].raw, envs[2].score)]  # the latest deadline waits, unchanged
        assert set(state[K.owners]) == {b"p:0", b"p:1"}
