"""Test support: read a private Redis's whole state in a comparable shape.

Shared by the protocol, exit-path and model tests (``pythonpath = ["tests"]`` in the pytest
config makes it importable as ``redis_state``). Replies may be RESP2 or RESP3 shaped.
"""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import trio

from claimkit.store.api import Arg, Store, open_store

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


async def snapshot(store: Store, *, skip_prefix: str | None = None) -> dict[str, Any]:
    """The whole keyspace: zset -> [(member, score)] in order, hash -> {field: value},
    list -> [elements] (LRANGE order: newest first), string -> (value, TTL seconds).
    Keys starting with ``skip_prefix`` are left out."""
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
