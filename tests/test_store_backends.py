"""Both store backends (claimkit.store.coredis_store, claimkit.store.redispy_store) on a
private Redis.

Every test that takes ``backend`` runs once per backend; the redis-py one is skipped, with
the reason, where the ``redispy`` extra cannot be used (not installed, or Python >= 3.14).
``test_replies_match`` runs one command list through both and compares the replies value
for value and type for type: that is what "same raw-reply semantics" means.
"""

from __future__ import annotations

import gc
import hashlib
import json
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from functools import partial
from typing import Any

import pytest
import trio
from support import closed_port, command_calls

from claimkit.config import ConfigError
from claimkit.dev.redis_server import RedisServer
from claimkit.protocol import keys as _keys
from claimkit.protocol.models import Envelope, TerminalRecord, parse_member
from claimkit.protocol.ops import AckItem, ClaimCode, QueueOps
from claimkit.store import Arg, ScriptCall, Store, StoreError, StoreUnavailable, open_store
from claimkit.store.redispy_store import load_backend
from claimkit.store.scripts import Script

RedisFactory = Callable[..., RedisServer]

DEADLINE = 20.0  # seconds: an absolute bound for every test here


def _redispy_unusable() -> str | None:
    try:
        load_backend()
    except ConfigError as exc:
        return str(exc)
    return None


REDISPY_UNUSABLE = _redispy_unusable()
needs_redispy = [
    pytest.mark.redispy,
    pytest.mark.skipif(REDISPY_UNUSABLE is not None, reason=str(REDISPY_UNUSABLE)),
]
BACKENDS = ["coredis", pytest.param("redispy", marks=needs_redispy)]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture
async def bstore(redis_url: str, backend: str) -> AsyncIterator[Store]:
    """A store of the parametrised backend on the session server's clean keyspace."""
    async with open_store(redis_url, backend=backend) as opened:
        yield opened


# coredis 6.9 does not close a connection's anyio memory streams when the connection fails
# to connect or to complete its handshake; they warn (ResourceWarning) when collected.
coredis_leaks_on_failed_connect = pytest.mark.filterwarnings(
    "ignore:Unclosed <MemoryObject:ResourceWarning"
)


def make_script(source: str, numkeys: int, name: str = "test") -> Script:
    return Script(name, numkeys, source, hashlib.sha1(source.encode()).hexdigest())


def typed(value: Any) -> Any:
    """``value`` with every leaf tagged by its type: ``b"1" != 1`` and ``1 != 1.0`` here."""
    if isinstance(value, list):
        return ["list", [typed(v) for v in value]]
    if isinstance(value, dict):
        return ["dict", sorted((typed(k), typed(v)) for k, v in value.items())]
    return [type(value).__name__, value]


# -- the same commands through both backends -------------------------------------------------

ECHO_SCRIPT = make_script(
    "return {KEYS[1], ARGV[1], tonumber(ARGV[2]), 3.7, {1, 'x', false}, "
    "redis.status_reply('OK'), redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')}",
    1,
    "echo",
)


def command_list(p: str) -> list[tuple[Arg, ...]]:
    """Every command shape claimkit sends, on keys under the prefix ``p``."""
    return [
        ("SET", f"{p}s", "v"),
        ("SET", f"{p}s", "w", "NX"),
        ("SET", f"{p}e", b"\x00\xff", "EX", 100),
        ("GET", f"{p}s"),
        ("GET", f"{p}e"),
        ("GET", f"{p}missing"),
        ("MGET", f"{p}s", f"{p}missing", f"{p}e"),
        ("ZADD", f"{p}z", 1.5, "a", 2, "b", 1e9, "c"),
        ("ZRANGE", f"{p}z", 0, -1),
        ("ZRANGE", f"{p}z", 0, -1, "WITHSCORES"),
        ("ZRANGE", f"{p}z", "-inf", "+inf", "BYSCORE", "LIMIT", 0, 2),
        ("ZRANGE", f"{p}missing", 0, -1, "WITHSCORES"),
        ("ZSCORE", f"{p}z", "a"),
        ("ZCARD", f"{p}z"),
        ("HSET", f"{p}h", "f", "1", "g", b"\x01"),
        ("HGETALL", f"{p}h"),
        ("HGETALL", f"{p}missing"),
        ("HMGET", f"{p}h", "f", "nope"),
        ("HLEN", f"{p}h"),
        ("RPUSH", f"{p}l", "a", "b", "c", "d"),
        ("LRANGE", f"{p}l", -2, -1),
        ("LLEN", f"{p}l"),
        ("RPOP", f"{p}l"),
        ("RPOP", f"{p}l", 2),
        ("RPOP", f"{p}missing", 2),
        ("BRPOP", f"{p}l", 1),
        ("BRPOP", f"{p}l", 0.05),
        ("INCRBYFLOAT", f"{p}f", 1.5),
        ("EXISTS", f"{p}s", f"{p}h"),
        ("TTL", f"{p}s"),
        ("DEL", f"{p}s", f"{p}z", f"{p}missing"),
        ("PING",),
    ]


def unprefixed(value: Any, p: str) -> Any:
    """``value`` with the key prefix ``p`` taken off key names in it (BRPOP names its key)."""
    if isinstance(value, list):
        return [unprefixed(v, p) for v in value]
    if isinstance(value, bytes) and value.startswith(p.encode()):
        return b"<p>" + value[len(p) :]
    return value


async def replies(store: Store, p: str) -> list[Any]:
    out: list[Any] = [await store.command(*c) for c in command_list(p)]
    time = await store.command("TIME")
    out.append([type(time).__name__, [type(t).__name__ for t in time], len(time)])
    out.append(await store.run(ECHO_SCRIPT, [f"{p}zz"], ["arg", "42"]))
    await store.command("ZADD", f"{p}zz", 3, "m")
    out.append(await store.run(ECHO_SCRIPT, [f"{p}zz"], ["arg", "42"]))
    out.append(
        await store.pipeline(
            [("SET", f"{p}t", "1"), ("GET", f"{p}t"), ("ZRANGE", f"{p}zz", 0, -1, "WITHSCORES")],
            transaction=False,
        )
    )
    out.append(
        await store.pipeline(
            [("INCR", f"{p}t"), ("HGETALL", f"{p}h"), ("GET", f"{p}missing")], transaction=True
        )
    )
    out.append(await store.pipeline([], transaction=True))
    stripped: list[Any] = unprefixed(out, p)
    return stripped


@pytest.mark.redispy
@pytest.mark.skipif(REDISPY_UNUSABLE is not None, reason=str(REDISPY_UNUSABLE))
async def test_replies_match(redis_url: str) -> None:
    with trio.fail_after(DEADLINE):
        async with open_store(redis_url, backend="coredis") as store:
            expected = await replies(store, "co:")
        async with open_store(redis_url, backend="redispy") as store:
            got = await replies(store, "rp:")
    assert len(got) == len(expected)
    for i, (want, have) in enumerate(zip(expected, got, strict=True)):
        assert typed(have) == typed(want), f"reply {i}: {have!r} != {want!r}"
    # Spot checks that the comparison compared the right things.
    assert expected[9] == [[b"a", 1.5], [b"b", 2.0], [b"c", 1e9]]
    assert expected[15] == {b"f": b"1", b"g": b"\x01"}
    assert expected[1] is None


# -- one backend at a time -------------------------------------------------------------------


async def test_command(bstore: Store) -> None:
    with trio.fail_after(DEADLINE):
        assert await bstore.command("SET", "k", b"v\x00") == b"OK"
        assert await bstore.command("get", "k") == b"v\x00"
        assert await bstore.command("ZADD", "q", 5, "m") == 1
        assert await bstore.command("ZRANGE", "q", 0, -1, "WITHSCORES") == [[b"m", 5.0]]
        assert await bstore.command("DEL", "k", "q") == 2
        assert await bstore.command("KEYS", "*") == []


async def test_pipeline(bstore: Store) -> None:
    with trio.fail_after(DEADLINE):
        assert await bstore.pipeline(
            [("RPUSH", "l", "a", "b"), ("LRANGE", "l", 0, -1), ("LLEN", "l")], transaction=False
        ) == [2, [b"a", b"b"], 2]
        assert await bstore.pipeline(
            [("HSET", "h", "f", "1"), ("HINCRBY", "h", "f", 2), ("HGETALL", "h")], transaction=True
        ) == [1, 3, {b"f": b"3"}]


@pytest.mark.parametrize("transaction", [False, True])
async def test_pipeline_error(bstore: Store, transaction: bool) -> None:
    """The first refused command raises StoreError; the others ran (no rollback in Redis)."""
    with trio.fail_after(DEADLINE):
        await bstore.command("SET", "s", "1")
        with pytest.raises(StoreError, match="wrong kind of value") as info:
            await bstore.pipeline(
                [("SET", "a", "1"), ("HSET", "s", "f", "payload-1"), ("SET", "b", "2")],
                transaction=transaction,
            )
        assert "payload-1" not in str(info.value)
        assert await bstore.command("MGET", "a", "s", "b") == [b"1", b"1", b"2"]


async def test_transaction_refused_when_queued(bstore: Store) -> None:
    """A command Redis refuses to queue aborts the whole MULTI: nothing ran."""
    with trio.fail_after(DEADLINE):
        with pytest.raises(StoreError, match="NOSUCHCOMMAND"):
            await bstore.pipeline([("SET", "a", "1"), ("NOSUCHCOMMAND",)], transaction=True)
        assert await bstore.command("EXISTS", "a") == 0


async def test_run_and_noscript_fallback(bstore: Store) -> None:
    script = make_script("redis.call('INCR', KEYS[1]); return {KEYS[1], ARGV[1], 7}", 1)
    with trio.fail_after(DEADLINE):
        await bstore.command("SCRIPT", "FLUSH")
        # Not cached yet: EVALSHA gets NOSCRIPT and the store falls back to EVAL.
        assert await bstore.run(script, ["n"], ["x"]) == [b"n", b"x", 7]
        assert await bstore.command("SCRIPT", "EXISTS", script.sha1) == [1]
        assert await bstore.run(script, ["n"], [b"y"]) == [b"n", b"y", 7]
        await bstore.command("SCRIPT", "FLUSH")
        assert await bstore.run(script, ["n"], [3]) == [b"n", b"3", 7]
        assert await bstore.command("GET", "n") == b"3"
        with pytest.raises(ValueError, match="takes 1 keys, got 2"):
            await bstore.run(script, ["a", "b"], [])


async def test_run_many_in_order_with_noscript_fallback(bstore: Store) -> None:
    script = make_script("return {KEYS[1], ARGV[1], redis.call('INCR', KEYS[1])}", 1)
    calls: list[ScriptCall] = [(["a"], ["x"]), (["b"], [b"y"]), (["a"], [3])]
    with trio.fail_after(DEADLINE):
        await bstore.command("SCRIPT", "FLUSH")
        await bstore.command("CONFIG", "RESETSTAT")
        # Not cached: every EVALSHA gets NOSCRIPT, each call is sent again by EVAL, once.
        assert await bstore.run_many(script, calls) == [
            [b"a", b"x", 1],
            [b"b", b"y", 1],
            [b"a", b"3", 2],
        ]
        stats = await command_calls(bstore)
        assert (stats["evalsha"], stats["eval"]) == (3, 3)
        # Cached now: EVALSHA only.
        assert await bstore.run_many(script, calls[:1]) == [[b"a", b"x", 3]]
        assert (await command_calls(bstore))["evalsha"] == 4
        assert await bstore.run_many(script, []) == []
        with pytest.raises(ValueError, match="takes 1 keys, got 0"):
            await bstore.run_many(script, [(["a"], []), ([], [])])
        assert await bstore.command("MGET", "a", "b") == [b"3", b"1"]  # nothing was sent


async def test_run_many_refused_call_is_store_error_and_the_others_ran(bstore: Store) -> None:
    script = make_script(
        "if ARGV[1] == 'bad' then error('boom') end; return redis.call('INCR', KEYS[1])", 1
    )
    with trio.fail_after(DEADLINE):
        with pytest.raises(StoreError, match="boom") as info:
            await bstore.run_many(
                script, [(["n"], ["ok"]), (["n"], ["bad", "token-1"]), (["n"], ["ok"])]
            )
        assert await bstore.command("GET", "n") == b"2"
        # Redis's message only: the call's arguments (tokens, payloads) stay out of logs.
        assert "token-1" not in str(info.value)
        assert len(str(info.value)) < 300
        assert await bstore.command("PING") == b"PONG"


async def test_script_error_is_store_error(bstore: Store) -> None:
    with trio.fail_after(DEADLINE):
        with pytest.raises(StoreError, match="boom"):
            await bstore.run(make_script("error('boom')", 0), [], [])


async def test_wrongtype_is_store_error(bstore: Store) -> None:
    with trio.fail_after(DEADLINE):
        await bstore.command("SET", "s", "1")
        with pytest.raises(StoreError, match="wrong kind of value"):
            await bstore.command("ZCARD", "s")
        # The connection is still good afterwards.
        assert await bstore.command("GET", "s") == b"1"


async def blocked_clients_is_zero(store: Store) -> bool:
    info: bytes = await store.command("INFO", "clients")
    return b"blocked_clients:0" in info.split(b"\r\n")


async def test_cancelled_call_leaves_nothing_behind(bstore: Store) -> None:
    """A BRPOP cancelled mid-wait drops its connection: it cannot pop a later push, and the
    next calls get whole replies (no half-read reply left in a pooled connection)."""
    with trio.fail_after(DEADLINE):
        with trio.move_on_after(0.2) as scope:
            await bstore.command("BRPOP", "l", 0)  # would block for ever
        assert scope.cancelled_caught
        # Redis notices the closed socket a moment later; if the connection were kept,
        # this would wait until fail_after.
        with trio.fail_after(5):
            while not await blocked_clients_is_zero(bstore):
                await trio.sleep(0.01)
        await bstore.command("RPUSH", "l", "x")
        assert await bstore.command("LRANGE", "l", 0, -1) == [b"x"]
        assert await bstore.command("PING") == b"PONG"


@coredis_leaks_on_failed_connect
async def test_closed_port_is_unavailable(backend: str) -> None:
    with trio.fail_after(DEADLINE):
        async with open_store(f"redis://127.0.0.1:{closed_port()}/0", backend=backend) as store:
            with pytest.raises(StoreUnavailable):
                await store.command("PING")
            with pytest.raises(StoreUnavailable):
                await store.run(make_script("return 1", 0), [], [])
            with pytest.raises(StoreUnavailable):
                await store.pipeline([("PING",)], transaction=True)
            with pytest.raises(StoreUnavailable):
                await store.run_many(make_script("return 1", 0), [([], [])])
    gc.collect()  # the leaked streams warn now, under this test's filter


async def test_unresponsive_redis_is_unavailable(backend: str, redis_factory: RedisFactory) -> None:
    """A frozen Redis (SIGSTOP) surfaces as StoreUnavailable after ``timeout`` seconds."""
    server = await trio.to_thread.run_sync(redis_factory)
    with trio.fail_after(DEADLINE):
        async with open_store(server.url, backend=backend, timeout=0.5) as store:
            assert await store.command("PING") == b"PONG"
            server.pause()
            try:
                start = trio.current_time()
                with pytest.raises(StoreUnavailable):
                    await store.command("PING")
                assert trio.current_time() - start < 5
            finally:
                server.resume()


async def _answer_loading(stream: trio.SocketStream) -> None:
    loading = b"-LOADING Redis is loading the dataset in memory\r\n"
    try:
        while await stream.receive_some(65536):
            await stream.send_all(loading)
    except trio.BrokenResourceError:
        pass


@coredis_leaks_on_failed_connect
async def test_loading_is_unavailable(backend: str) -> None:
    """A Redis replaying its AOF answers LOADING to everything: retry later, not an error."""
    with trio.fail_after(DEADLINE):
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(
                partial(trio.serve_tcp, _answer_loading, 0, host="127.0.0.1")
            )
            port = listeners[0].socket.getsockname()[1]
            async with open_store(f"redis://127.0.0.1:{port}/0", backend=backend) as store:
                with pytest.raises(StoreUnavailable, match="loading"):
                    await store.command("GET", "k")
            nursery.cancel_scope.cancel()
    gc.collect()


async def test_wrong_password_is_store_error(backend: str, redis_factory: RedisFactory) -> None:
    server = await trio.to_thread.run_sync(redis_factory)
    with trio.fail_after(DEADLINE):
        async with open_store(server.url) as admin:
            await admin.command("CONFIG", "SET", "requirepass", "s3cret")
        url = f"redis://default:nope@127.0.0.1:{server.port}/0"
        async with open_store(url, backend=backend) as store:
            assert "nope" not in store.url
            assert store.url == f"redis://default:***@127.0.0.1:{server.port}/0"
            with pytest.raises(StoreError):
                await store.command("PING")
            with pytest.raises(StoreError):
                await store.pipeline([("PING",)], transaction=False)
            with pytest.raises(StoreError):
                await store.run_many(make_script("return 1", 0), [([], [])])
        good = f"redis://default:s3cret@127.0.0.1:{server.port}/0"
        async with open_store(good, backend=backend) as store:
            assert await store.command("PING") == b"PONG"


async def test_usable_from_tasks_started_before_it(redis_url: str, backend: str) -> None:
    """A store handed to a task that already ran (the consumer's workers) works there too."""
    send_store, receive_store = trio.open_memory_channel[Store](1)
    send_reply, receive_reply = trio.open_memory_channel[Any](1)

    async def worker(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        store = await receive_store.receive()
        await send_reply.send(await store.command("PING"))

    with trio.fail_after(DEADLINE):
        async with trio.open_nursery() as nursery:
            await nursery.start(worker)
            async with open_store(redis_url, backend=backend) as store:
                await send_store.send(store)
                assert await receive_reply.receive() == b"PONG"


# -- the claim protocol end to end -----------------------------------------------------------


def member(rid: str, deadline: int, token: str) -> bytes:
    doc = {
        "request_kind": "plain",
        "data": {"id": rid, "deadline": deadline, "payload": {"prompt": "hi"}},
        "internal": {"request_token": token},
    }
    return json.dumps(doc, separators=(",", ":")).encode()


async def all_keys(store: Store) -> set[bytes]:
    keys: Sequence[bytes] = await store.command("KEYS", "*")
    return set(keys)


async def test_claim_then_ack(bstore: Store) -> None:
    """One request through peek, claim and ack: the exact Redis state after each step."""
    ops = QueueOps(bstore, "q", default_result_list="results", dedup_ttl=600)
    k = ops.keys
    with trio.fail_after(DEADLINE):
        seconds, _micros = await bstore.command("TIME")
        deadline = int(seconds) + 600
        raw = member("r1", deadline, "gen-1")
        await bstore.command("ZADD", "q", deadline, raw)

        assert await ops.peek(10) == [raw]
        env = parse_member(raw)
        assert isinstance(env, Envelope)

        now, codes = await ops.claim([(env, "tok-1")], lease_ttl=30)
        assert codes == [ClaimCode.CLAIMED]
        assert await all_keys(bstore) == {b"q:claimed", b"q:claim-owners", b"q:claims-idx"}
        assert await bstore.command("HGETALL", k.claimed) == {
            b"r1": raw,
            b"r1:score": str(deadline).encode(),
        }
        assert await bstore.command("HGETALL", k.owners) == {b"r1": b"tok-1"}
        [[idx_member, expiry]] = await bstore.command("ZRANGE", k.index, 0, -1, "WITHSCORES")
        assert idx_member == b"r1"
        assert expiry == pytest.approx(now + 30, abs=1e-3)

        record = TerminalRecord.http("r1", 200, '{"ok":true}').to_json()
        item = AckItem("r1", "tok-1", "gen-1", "results", record, raw)
        assert await ops.ack([item]) == [(True, True)]
        terminal = _keys.result_terminal("r1")
        assert await all_keys(bstore) == {b"results", terminal.encode()}
        assert await bstore.command("LRANGE", "results", 0, -1) == [record]
        assert await bstore.command("GET", terminal) == b"gen-1"
        assert 0 < await bstore.command("TTL", terminal) <= 600

        # The same ack again: a suppressed duplicate, and the claim is no longer ours.
        assert await ops.ack([item]) == [(False, False)]
        assert await bstore.command("LLEN", "results") == 1


# -- when the redis-py backend cannot be used ------------------------------------------------


def test_python_314_refused_in_one_line() -> None:
    with pytest.raises(ConfigError) as caught:
        load_backend((3, 14))
    message = str(caught.value)
    assert "\n" not in message
    assert "Python 3.14" in message
    assert "trio-asyncio issue #160" in message


async def test_missing_extra_refused_in_one_line(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A None entry in sys.modules makes the import fail as if the package were absent.
    monkeypatch.setitem(sys.modules, "trio_asyncio", None)
    with pytest.raises(ConfigError) as caught:
        async with open_store(redis_url, backend="redispy"):
            pass  # pragma: no cover
    message = str(caught.value)
    assert "\n" not in message
    assert "pip install 'claimkit[redispy]'" in message
    assert "trio_asyncio" in message


@pytest.mark.skipif(sys.version_info < (3, 14), reason="checks the refusal on Python 3.14+")
async def test_open_store_refuses_on_this_python(redis_url: str) -> None:
    with pytest.raises(ConfigError, match="trio-asyncio issue #160"):
        async with open_store(redis_url, backend="redispy"):
            pass  # pragma: no cover
