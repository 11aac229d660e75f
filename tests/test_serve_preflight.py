"""`claimkit serve` and keys of the wrong Redis type (SPEC §1, §5), and the exit summary's
``left_to_lapse`` (claims given up without being released).

- At start: every key serve uses whose type the config tells is checked; one of another
  type ends serve with one line and exit status 1, before anything is claimed.
- While running: a key that turns into another type stops the consumer with the same line
  (the claims it holds are swept back), instead of running the same requests again every
  lease for ever.
- A claim dropped after Redis refused its ack counts in ``left_to_lapse``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import support
import trio
from support import command_calls, deadline

from claimkit.config import Config, ConfigError
from claimkit.consumer.consumer import Consumer, QueueRuntime, key_roles
from claimkit.consumer.dispatch import Done, Outcome
from claimkit.consumer.serve import _preflight
from claimkit.ops.inspect import WrongKeyType
from claimkit.producer import Producer
from claimkit.protocol.models import Envelope, TerminalRecord
from claimkit.store import Store, open_store

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

CLAIMKIT = str(Path(sys.executable).with_name("claimkit"))
Q = "wq"
RL = "wq-results"


FIELDS: dict[str, Any] = {
    "poll_interval_ms": 20,
    "claim_lease_ttl_seconds": 3,
    "claim_reclaim_interval_ms": 100,
    "metrics_port": 0,
    "health_port": 0,
    "drain_timeout_seconds": 1,
}


def config_doc(**overrides: Any) -> dict[str, Any]:
    """This file's consumer settings, without a URL (serve reads ``REDIS_URL``)."""
    return support.config_doc(queue=Q, **FIELDS | overrides)


def make_config(redis_url: str, **overrides: Any) -> Config:
    return support.make_config(redis_url, queue=Q, **FIELDS | overrides)


def with_result_list(**overrides: Any) -> dict[str, Any]:
    return {
        "queues": [
            {"queue_name": Q, "igw_base_url": "http://127.0.0.1:9", "result_queue_name": RL}
        ],
        **overrides,
    }


def run_serve(redis_url: str, doc: dict[str, Any]) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [CLAIMKIT, "serve", "--transport-config", json.dumps(doc)],
        capture_output=True,
        env={**os.environ, "REDIS_URL": redis_url},
        timeout=30,
    )


async def redis_state(store: Store) -> dict[str, Any]:
    return {
        "pending": await store.command("ZRANGE", Q, 0, -1, "WITHSCORES"),
        "claimed": await store.command("HLEN", f"{Q}:claimed"),
        "owners": await store.command("HLEN", f"{Q}:claim-owners"),
        "index": await store.command("ZCARD", f"{Q}:claims-idx"),
        "deliveries": await store.command("HLEN", f"{Q}:deliveries"),
    }


# -- at start ------------------------------------------------------------------------------


async def test_serve_refuses_a_result_list_holding_a_string(store: Store, redis_url: str) -> None:
    """The new-user trial: the queue's result list is a string. serve used to start, run the
    request, fail its ack, and run it again every lease."""
    await Producer(store, Q).submit({"id": "a", "deadline": deadline()})
    await store.command("SET", RL, "oops")
    before = await redis_state(store)
    proc = await trio.to_thread.run_sync(run_serve, redis_url, config_doc(**with_result_list()))
    assert proc.returncode == 1
    assert proc.stderr.decode() == (
        f"claimkit: result list '{RL}' of queue '{Q}' holds a string, not a list\n"
    )
    assert proc.stdout == b""
    assert await redis_state(store) == before  # nothing claimed, nothing run
    assert await store.command("GET", RL) == b"oops"


async def test_serve_refuses_a_claims_index_holding_a_string(store: Store, redis_url: str) -> None:
    """Like `claimkit reclaim --once`, serve refuses at once rather than logging reclaim
    errors in a loop."""
    await store.command("SET", f"{Q}:claims-idx", "oops")
    proc = await trio.to_thread.run_sync(run_serve, redis_url, config_doc())
    assert proc.returncode == 1
    assert proc.stderr.decode() == (
        f"claimkit: claims index '{Q}:claims-idx' of queue '{Q}' holds a string, not a sorted set\n"
    )
    assert await store.command("GET", f"{Q}:claims-idx") == b"oops"


@pytest.mark.parametrize(
    ("key", "setup", "line"),
    [
        (Q, ("SET", Q, "x"), f"queue key '{Q}' holds a string, not a sorted set"),
        (
            f"{Q}:claimed",
            ("SET", f"{Q}:claimed", "x"),
            f"claimed hash '{Q}:claimed' of queue '{Q}' holds a string, not a hash",
        ),
        (
            f"{Q}:claim-owners",
            ("LPUSH", f"{Q}:claim-owners", "x"),
            f"claim-owners hash '{Q}:claim-owners' of queue '{Q}' holds a list, not a hash",
        ),
        (
            f"{Q}:deliveries",
            ("ZADD", f"{Q}:deliveries", 1, "x"),
            f"deliveries hash '{Q}:deliveries' of queue '{Q}' holds a sorted set, not a hash",
        ),
        (
            f"{Q}:dead",
            ("HSET", f"{Q}:dead", "f", "x"),
            f"dead set '{Q}:dead' of queue '{Q}' holds a hash, not a sorted set",
        ),
        (
            "retry-sortedset",
            ("SADD", "retry-sortedset", "x"),
            "retry set 'retry-sortedset' holds a set, not a sorted set",
        ),
        (
            "retry-sortedset:dead",
            ("SET", "retry-sortedset:dead", "x"),
            "retry dead set 'retry-sortedset:dead' holds a string, not a sorted set",
        ),
        (
            "result-list",
            ("SET", "result-list", "x"),
            "global result list 'result-list' holds a string, not a list",
        ),
    ],
)
async def test_preflight_names_the_key_its_type_and_the_expected_type(
    store: Store, redis_url: str, key: str, setup: tuple[Any, ...], line: str
) -> None:
    await store.command(*setup)
    with pytest.raises(WrongKeyType) as info:
        await _preflight(store, make_config(redis_url))
    assert str(info.value) == line


async def test_preflight_checks_a_redis_gate_budget_key(store: Store, redis_url: str) -> None:
    await store.command("LPUSH", "budget", "x")
    queues = [
        {
            "queue_name": Q,
            "igw_base_url": "http://127.0.0.1:9",
            "gate_type": "redis",
            "gate_params": {"key": "budget"},
        }
    ]
    with pytest.raises(WrongKeyType) as info:
        await _preflight(store, make_config(redis_url, queues=queues))
    assert str(info.value) == "gate budget key 'budget' of queue 'wq' holds a list, not a string"


async def test_preflight_accepts_missing_keys_and_right_types(store: Store, redis_url: str) -> None:
    config = make_config(redis_url, **with_result_list())
    await _preflight(store, config)  # nothing exists: fine
    await Producer(store, Q).submit({"id": "a", "deadline": deadline()})
    await store.command("LPUSH", RL, "r")
    await store.command("LPUSH", "result-list", "r")
    await store.command("ZADD", "retry-sortedset", 1, "m")
    await store.command("HSET", f"{Q}:deliveries", "a", 1)
    await _preflight(store, config)


async def test_preflight_refuses_one_key_in_two_roles(store: Store, redis_url: str) -> None:
    """A result list named like a queue's dead set would turn that set into a list."""
    config = make_config(
        redis_url,
        queues=[{"queue_name": Q, "igw_base_url": "http://x", "result_queue_name": f"{Q}:dead"}],
    )
    with pytest.raises(ConfigError) as info:
        await _preflight(store, config)
    assert str(info.value) == (
        f"result list '{Q}:dead' of queue '{Q}' is also the dead set '{Q}:dead' of queue "
        f"'{Q}': one key cannot be both a sorted set and a list"
    )


# -- while running -------------------------------------------------------------------------


async def test_a_result_list_turned_string_while_running_stops_the_consumer(
    store: Store, redis_url: str
) -> None:
    """The list is fine at start and becomes a string while a request runs: its ack fails.
    The consumer stops with the one line and sweeps the claim back, once, rather than
    letting it lapse and running the request again every lease."""
    runs: list[str] = []

    async def handler(q: QueueRuntime, env: Envelope, now: float) -> Outcome:
        runs.append(env.id)
        await store.command("SET", RL, "oops")
        return Done(TerminalRecord.http(env.id, 200, "{}"))

    await Producer(store, Q).submit({"id": "a", "deadline": deadline()})
    before = await store.command("ZRANGE", Q, 0, -1, "WITHSCORES")
    consumer = Consumer(make_config(redis_url, **with_result_list()), store, handler=handler)
    with trio.fail_after(20), pytest.raises(WrongKeyType) as info:
        await consumer.run()
    assert str(info.value) == f"result list '{RL}' of queue '{Q}' holds a string, not a list"
    assert runs == ["a"]
    assert await redis_state(store) == {
        "pending": before,  # same bytes, same score
        "claimed": 0,
        "owners": 0,
        "index": 0,
        "deliveries": 0,
    }
    assert await store.command("GET", RL) == b"oops"
    assert await store.command("EXISTS", "result-terminal:a") == 0
    s = consumer.summary
    assert (s.claimed, s.acked, s.released, s.left_to_lapse) == (1, 0, 1, 0)


def run_catching(
    consumer: Consumer, caught: list[WrongKeyType]
) -> Callable[[trio.TaskStatus[None]], Awaitable[None]]:
    """``consumer.run`` for ``nursery.start``, the :class:`WrongKeyType` that stops it
    appended to ``caught`` instead of raised."""

    async def run(task_status: trio.TaskStatus[None]) -> None:
        try:
            await consumer.run(task_status=task_status)
        except WrongKeyType as exc:
            caught.append(exc)

    return run


async def test_a_claims_index_turned_string_while_running_stops_the_consumer(
    store: Store, redis_url: str
) -> None:
    """The reclaimer meets it: the consumer stops, instead of logging reclaim errors for ever."""
    consumer = Consumer(make_config(redis_url), store)
    caught: list[WrongKeyType] = []
    run = run_catching(consumer, caught)

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(run)
            await store.command("SET", f"{Q}:claims-idx", "oops")
    assert [str(exc) for exc in caught] == [
        f"claims index '{Q}:claims-idx' of queue '{Q}' holds a string, not a sorted set"
    ]
    assert await store.command("GET", f"{Q}:claims-idx") == b"oops"


async def test_a_consumer_info_hash_turned_list_is_worded_in_the_forget_warning(
    store: Store, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The heartbeat meets it and the consumer stops; the shutdown's forget fails on the
    same key, and its warning names the key and its type, not Redis's script error."""
    consumer = Consumer(make_config(redis_url), store)
    caught: list[WrongKeyType] = []
    run = run_catching(consumer, caught)

    wrong = f"consumer-info hash '{Q}:consumer-info' of queue '{Q}' holds a list, not a hash"
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(run)
            info = f"{Q}:consumer-info"
            await store.pipeline([("DEL", info), ("RPUSH", info, "junk")], transaction=True)
    assert [str(exc) for exc in caught] == [wrong]
    forgets = [r for r in caplog.records if r.getMessage().startswith("forget ")]
    assert [(r.levelname, r.getMessage()) for r in forgets] == [
        ("WARNING", f"forget {Q}: {wrong}; the consumer's entry will lapse")
    ]


def test_serve_process_exits_1_when_a_key_turns_wrong_while_running(
    redis_url: str, tmp_path: Path
) -> None:
    """The trial's case through the command, with the list turned into a string after
    serve started: exit status 1, the one line last on stderr, the request back in pending
    at its score (run once, not once per lease)."""

    async def hang_up(stream: trio.SocketStream) -> None:
        """A gateway that reads the request and closes the connection: INFERENCE_ERROR (a
        gateway that refuses connections would get no record at all)."""
        async with stream:
            received = b""
            while b"\r\n\r\n" not in received and (chunk := await stream.receive_some()):
                received += chunk

    async def main() -> None:
        from claimkit.store import open_store

        async with open_store(redis_url) as store, trio.open_nursery() as gateway:
            listeners = await gateway.start(partial(trio.serve_tcp, hang_up, 0, host="127.0.0.1"))
            url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
            log = tmp_path / "serve.log"
            doc = config_doc(**with_result_list())
            doc["queues"][0]["igw_base_url"] = url
            with log.open("w") as err:
                proc = subprocess.Popen(
                    [CLAIMKIT, "serve", "--transport-config", json.dumps(doc)],
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    env={**os.environ, "REDIS_URL": redis_url},
                )
            try:
                with trio.fail_after(20):
                    while "claimkit: serving " not in log.read_text():
                        assert proc.poll() is None, log.read_text()
                        await trio.sleep(0.05)
                    await store.command("SET", RL, "oops")
                    await Producer(store, Q).submit({"id": "a", "deadline": due})
                    while proc.poll() is None:
                        await trio.sleep(0.05)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(10)
            text = log.read_text()
            assert proc.returncode == 1, text
            assert text.splitlines()[-1] == (
                f"claimkit: result list '{RL}' of queue '{Q}' holds a string, not a list"
            )
            assert text.count("ends INFERENCE_ERROR") == 1  # run once
            assert "sweep wq: released 1 of 1 claims" in text
            state = await redis_state(store)
            [(member, score)] = state.pop("pending")
            assert json.loads(member)["data"]["id"] == "a"
            assert score == due + 1 / 2**21  # back at its original score (its enqueue order)
            assert state == {"claimed": 0, "owners": 0, "index": 0, "deliveries": 0}
            assert await store.command("GET", RL) == b"oops"
            gateway.cancel_scope.cancel()

    due = deadline()
    trio.run(main)


# -- left_to_lapse -------------------------------------------------------------------------


async def test_a_refused_ack_counts_in_left_to_lapse(redis_factory: Any) -> None:
    """Redis refuses the ack (out of memory, a real fault on a private server): the claim is
    given up to lapse, and the summary says so, as the log did."""
    server = await trio.to_thread.run_sync(redis_factory)
    done = trio.Event()

    async with open_store(server.url) as store:

        async def handler(q: QueueRuntime, env: Envelope, now: float) -> Outcome:
            await store.command("CONFIG", "SET", "maxmemory", "1")  # every write refused
            await store.command("CONFIG", "RESETSTAT")
            done.set()
            return Done(TerminalRecord.http(env.id, 200, "{}"))

        await Producer(store, Q).submit({"id": "a", "deadline": deadline()})
        config = make_config(server.url, claim_lease_ttl_seconds=30)
        consumer = Consumer(config, store, handler=handler)
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                await nursery.start(consumer.run)
                await done.wait()
                while consumer.held_count():
                    await trio.sleep(0.02)
                await store.command("CONFIG", "SET", "maxmemory", "0")
                consumer.request_stop()
        s = consumer.summary
        assert (s.claimed, s.acked, s.released, s.left_to_lapse) == (1, 0, 0, 1)
        # No key-type check after the refusal (out of memory says nothing about key
        # types, and a pipeline of TYPE calls would only load Redis). That check sends one
        # TYPE per key role; the ack script's own TYPE calls are fewer (none: Redis refuses
        # a shebang script that may write before it runs, while over maxmemory).
        assert (await command_calls(store)).get("type", 0) < len(key_roles(config))
        # The claim is still in Redis under its lease, for a reclaimer to redeliver.
        state = await redis_state(store)
        assert (state["pending"], state["claimed"], state["owners"], state["index"]) == (
            [],
            2,
            1,
            1,
        )
        assert await store.command("LLEN", "result-list") == 0
