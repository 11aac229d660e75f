"""Test support shared by the test files: one copy of each builder and helper.

``pythonpath = ["tests"]`` in the pytest config makes it importable as ``support``.

- Redis state in a comparable shape: :func:`snapshot`, :func:`pairs`, :class:`Ttl`,
  :class:`Between`, :func:`server_now`, :func:`command_calls`. Replies may be RESP2 or RESP3
  shaped.
- Synchronous access for CLI tests: :func:`redis`, :func:`do`; the CLI in-process:
  :func:`invoke`, :func:`one_line_error`.
- Builders: :func:`member` (a queue member's bytes), :func:`deadline`, :func:`config_doc`,
  :func:`config_json`, :func:`make_config` (a transport config).
- :class:`StoreWrapper`: a :class:`Store` delegating to a real one, for fakes that record or
  meddle with a few calls.
- Waiting: :func:`wait_for` (async, on Redis state), :func:`wait_until` (sync, with a
  timeout), :func:`wait_port`; ports: :func:`free_port`, :func:`closed_port`.
- Both key layouts (docs/topology.md#cluster-key-layout) for tests that run on a standalone
  Redis and on a cluster (``tests/test_protocol_cluster.py``): :func:`is_cluster`,
  :func:`markers` (the expected dedup markers), :func:`set_marker`, :func:`retry_keys`,
  :func:`reopen` (a second store on the same Redis), :func:`store_tests` (a module's tests
  that take ``store``, for another module to run them on a cluster).
"""

from __future__ import annotations

import inspect
import json
import re
import socket
import time
from typing import TYPE_CHECKING, Any, TypeVar

import trio
from typer.testing import CliRunner

from claimkit.cli.app import app
from claimkit.config import load_config
from claimkit.protocol.keys import (
    DEFAULT_RESULT_LIST,
    DEFAULT_RETRY_SET,
    RESULT_TERMINAL_PREFIX,
    QueueKeys,
    ResultKeys,
)
from claimkit.store import open_store

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence
    from contextlib import AbstractAsyncContextManager

    from typer.testing import Result

    from claimkit.config import Config
    from claimkit.store import Arg, ScriptCall, Store
    from claimkit.store.scripts import Script

T = TypeVar("T")


class Ttl(int):
    """A ``TTL`` reply in seconds. It ticks on while a test runs, so a positive one equals
    any positive TTL it could have come from within two seconds; -1 and -2 are exact."""

    def __eq__(self, other: object) -> bool:
        if isinstance(other, int) and not isinstance(other, bool) and other > 0 < self:
            return other - 2 <= int(self) <= other
        return int(self) == other

    __hash__ = int.__hash__


class Between:
    """Equal to any number in ``[lo, hi]`` (a score set from the server clock)."""

    def __init__(self, lo: float, hi: float) -> None:
        self.lo, self.hi = lo, hi

    def __eq__(self, other: object) -> bool:
        return isinstance(other, int | float) and self.lo <= other <= self.hi

    def __repr__(self) -> str:
        return f"Between({self.lo:.6f}, {self.hi:.6f})"


def pairs(reply: Any) -> list[tuple[Any, Any]]:
    """A RESP2 flat list, a RESP3 list of pairs or a RESP3 map, as ``[(a, b)]``."""
    if isinstance(reply, dict):
        return list(reply.items())
    if reply and isinstance(reply[0], list):
        return [(a, b) for a, b in reply]
    return list(zip(reply[0::2], reply[1::2], strict=True))


async def server_now(store: Store) -> float:
    """The Redis server clock, Unix seconds."""
    sec, usec = await store.command("TIME")
    return int(sec) + int(usec) / 1_000_000


async def zrange(store: Store, key: str) -> list[tuple[bytes, float]]:
    """The sorted set ``key``, lowest score first: ``[(member, score)]``."""
    return [
        (m, float(s)) for m, s in pairs(await store.command("ZRANGE", key, 0, -1, "WITHSCORES"))
    ]


async def snapshot(
    store: Store, *, skip_prefix: str | tuple[str, ...] | None = None
) -> dict[str, Any]:
    """The whole keyspace: zset -> [(member, score)] in order, hash -> {field: value},
    list -> [elements] (LRANGE order: newest first), string -> (value, TTL seconds).
    Keys starting with ``skip_prefix`` (one prefix or several) are left out."""
    out: dict[str, Any] = {}
    for key in sorted(await store.command("KEYS", "*")):
        name = key.decode()
        if skip_prefix is not None and name.startswith(skip_prefix):
            continue
        kind = await store.command("TYPE", key)
        if kind == b"zset":
            out[name] = [
                (m, float(s))
                for m, s in pairs(await store.command("ZRANGE", key, 0, -1, "WITHSCORES"))
            ]
        elif kind == b"hash":
            out[name] = dict(pairs(await store.command("HGETALL", key)))
        elif kind == b"list":
            out[name] = await store.command("LRANGE", key, 0, -1)
        elif kind == b"string":
            out[name] = (await store.command("GET", key), Ttl(await store.command("TTL", key)))
        else:  # pragma: no cover - the protocol writes no other type
            out[name] = kind
    return out


def redis(url: str, fn: Callable[[Store], Awaitable[T]], *, timeout: float = 30.0) -> T:
    """From synchronous test code (CLI tests): run ``fn(store)`` on a store opened on
    ``url`` in a fresh trio loop, within ``timeout`` seconds."""

    async def main() -> T:
        with trio.fail_after(timeout):
            async with open_store(url) as store:
                return await fn(store)

    return trio.run(main)


def do(url: str, *commands: Sequence[Arg]) -> list[Any]:
    """Run raw commands in one MULTI/EXEC from synchronous test code; their replies."""
    return redis(url, lambda s: s.pipeline(commands, transaction=True))


async def command_calls(store: Store) -> dict[str, int]:
    """``calls=`` per command from ``INFO commandstats`` (commands run inside scripts
    included), lower-case names."""
    info: bytes = await store.command("INFO", "commandstats")
    out: dict[str, int] = {}
    for line in info.decode().splitlines():
        if line.startswith("cmdstat_"):
            name, fields = line[len("cmdstat_") :].split(":", 1)
            out[name] = int(dict(f.split("=") for f in fields.split(","))["calls"])
    return out


def mask_noperm(text: str) -> str:
    """``text`` with Redis's own wording of a refusal replaced by ``<server's words>``:
    Redis 7 ("this user has no permissions to run the 'multi' command") and Valkey 8 ("User
    p has no permissions ...") word it differently. claimkit's own part of the line stays
    and is asserted exactly."""
    return re.sub(r"\(Redis: NOPERM [^)]*\)", "(Redis: NOPERM <server's words>)", text)


def free_port() -> int:
    """A TCP port of 127.0.0.1 free a moment ago (for a child process to bind)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 10.0) -> None:
    """Return once something listens on 127.0.0.1:``port``; TimeoutError after ``timeout`` s."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.02)
    raise TimeoutError(f"nothing listens on {port}")


def closed_port() -> int:
    """A port nothing listens on: bound a moment ago, then released (never 6379)."""
    while True:
        port = free_port()
        if port != 6379:
            return port


def wait_until(what: str, check: Callable[[], bool], timeout: float = 20.0) -> None:
    """Poll ``check`` every 50 ms until it holds; AssertionError naming ``what`` after
    ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while not check():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


async def wait_for(predicate: Callable[[], Awaitable[bool]], what: str) -> None:
    """Poll Redis state every 20 ms until ``predicate`` holds (the test's ``fail_after``
    bounds it; ``what`` names the wait for the reader)."""
    while not await predicate():
        await trio.sleep(0.02)
    del what


# -- builders ---------------------------------------------------------------------------------


def member(rid: str, deadline: int, **internal: Any) -> bytes:
    """A plain queue member, compact JSON: ``{"internal": internal, "request_kind": "plain",
    "data": {"id": rid, "deadline": deadline}}``."""
    doc = {"internal": internal, "request_kind": "plain", "data": {"id": rid, "deadline": deadline}}
    return json.dumps(doc, separators=(",", ":")).encode()


def deadline(seconds: int = 600) -> int:
    """A request deadline ``seconds`` from now (local clock), Unix seconds."""
    return int(time.time()) + seconds


NOWHERE = "http://127.0.0.1:9"
"""A gateway URL for configs whose gateway is never called (port 9: discard)."""


def config_doc(
    url: str | None = None, *, queue: str = "requests", gateway: str = NOWHERE, **fields: Any
) -> dict[str, Any]:
    """A transport config document: ``url`` (left out when ``None``), one queue ``queue``
    served by ``gateway``, then ``fields`` (which replace any of these, ``queues`` too)."""
    doc: dict[str, Any] = {} if url is None else {"url": url}
    doc["queues"] = [{"queue_name": queue, "igw_base_url": gateway}]
    doc.update(fields)
    return doc


def config_json(url: str | None = None, **kwargs: Any) -> str:
    """:func:`config_doc` as JSON text (a ``--transport-config`` argument)."""
    return json.dumps(config_doc(url, **kwargs))


def make_config(url: str | None = None, **kwargs: Any) -> Config:
    """:func:`config_doc` loaded by :func:`claimkit.config.load_config`."""
    return load_config(inline=config_json(url, **kwargs))


# -- fakes --------------------------------------------------------------------------------------


class StoreWrapper:
    """A :class:`Store` that delegates every call to ``inner``; subclasses override the calls
    they record or meddle with. Its ``mode`` is ``inner``'s."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.url = inner.url
        self.mode = inner.mode

    async def command(self, *args: Arg) -> Any:
        return await self.inner.command(*args)

    async def pipeline(self, commands: Sequence[Sequence[Arg]], *, transaction: bool) -> list[Any]:
        return await self.inner.pipeline(commands, transaction=transaction)

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[Arg]) -> Any:
        return await self.inner.run(script, keys, args)

    async def run_many(self, script: Script, calls: Sequence[ScriptCall]) -> list[Any]:
        return await self.inner.run_many(script, calls)


def server_now_sync(url: str) -> float:
    """:func:`server_now` from synchronous test code, on a store opened on ``url``."""
    return redis(url, server_now)


# -- the CLI in-process -------------------------------------------------------------------------

runner = CliRunner()


def invoke(args: Sequence[str], url: str | None = None, stdin: str | None = None) -> Result:
    """Run ``claimkit ARGS`` (typer's CliRunner) with ``REDIS_URL`` set to ``url`` (unset when
    ``None``), ``stdin`` as its input and a 200-column terminal."""
    return runner.invoke(app, list(args), input=stdin, env={"REDIS_URL": url, "COLUMNS": "200"})


def one_line_error(result: Result, text: str | None = None, code: int = 1) -> str:
    """Assert ``result`` failed with exit status ``code`` (1: not done; 2: a usage error),
    exactly one ``claimkit: ...`` line (``claimkit: <text>`` when ``text`` is given) on
    stderr, nothing on stdout and no traceback. Returns that line."""
    assert result.exit_code == code, (result.exit_code, result.output)
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("claimkit: ")
    assert "Traceback" not in result.output
    if text is not None:
        assert lines[0] == f"claimkit: {text}"
    return lines[0]


# -- both key layouts ---------------------------------------------------------------------------


def is_cluster(store: Store) -> bool:
    """Whether ``store`` is on a Redis Cluster (its ``mode``): the cluster key layout."""
    return getattr(store, "mode", "standalone") == "cluster"


def markers(
    store: Store,
    *entries: tuple[str, str | bytes, int],
    result_list: str = DEFAULT_RESULT_LIST,
) -> dict[str, Any]:
    """The keys the dedup markers ``(id, value, ttl seconds)`` of ``result_list`` are, as
    :func:`snapshot` shows them, in ``store``'s layout: standalone one
    ``result-terminal:<id>`` string each (``(value, ttl)``, -1 without a TTL); cluster the
    list's marker hash and, for markers with a TTL, its expiry set (a score within 5 s of
    now + ttl; give same-call markers in id order, later calls after earlier ones)."""
    out: dict[str, Any] = {}
    if not is_cluster(store):
        for rid, value, ttl in entries:
            raw = value if isinstance(value, bytes) else value.encode()
            out[RESULT_TERMINAL_PREFIX + rid] = (raw, ttl if ttl > 0 else -1)
        return out
    keys = ResultKeys.for_list(result_list)
    now = time.time()
    hashed: dict[bytes, bytes] = {}
    expiry: list[tuple[bytes, Between]] = []
    for rid, value, ttl in entries:
        hashed[rid.encode()] = value if isinstance(value, bytes) else value.encode()
        if ttl > 0:
            expiry.append((rid.encode(), Between(now + ttl - 5, now + ttl + 5)))
    out[keys.terminal] = hashed
    if expiry:
        out[keys.expiry] = expiry
    return out


async def set_marker(
    store: Store, rid: str, value: str, ttl: int = 0, *, result_list: str = DEFAULT_RESULT_LIST
) -> None:
    """Write a dedup marker as claimkit would, in ``store``'s layout (``ttl`` seconds, 0 =
    none)."""
    if not is_cluster(store):
        extra: list[Arg] = ["EX", ttl] if ttl > 0 else []
        await store.command("SET", RESULT_TERMINAL_PREFIX + rid, value, *extra)
        return
    keys = ResultKeys.for_list(result_list)
    await store.command("HSET", keys.terminal, rid, value)
    if ttl > 0:
        await store.command("ZADD", keys.expiry, repr(await server_now(store) + ttl), rid)


def retry_keys(store: Store, queue: str, retry_set: str = DEFAULT_RETRY_SET) -> tuple[str, str]:
    """``(retry set, retry dead set)`` that ``queue`` parks into, in ``store``'s layout."""
    k = QueueKeys.for_queue(queue, cluster=is_cluster(store), retry_set=retry_set)
    return k.retry_set, k.retry_dead


def reopen(store: Store) -> AbstractAsyncContextManager[Store]:
    """A second store on the Redis (or cluster) ``store`` is on: another instance."""
    again = getattr(store, "reopen", None)  # a cluster store of tests/cluster_store.py
    if again is not None:
        result: AbstractAsyncContextManager[Store] = again()
        return result
    return open_store(store.url)


def store_tests(module: Any) -> dict[str, Any]:
    """The test functions of ``module`` that take the ``store`` fixture and no fixture that
    names a standalone server (``redis_url``, ``redis_factory``, ``redis_server``): what a
    cluster module runs again with its own ``store`` (marks and parameters kept)."""
    standalone_only = {"redis_url", "redis_factory", "redis_server"}
    out: dict[str, Any] = {}
    for name, fn in vars(module).items():
        if not name.startswith("test_") or not callable(fn):
            continue
        params = set(inspect.signature(fn).parameters)
        if "store" in params and not params & standalone_only:
            out[name] = fn
    return out
