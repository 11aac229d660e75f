"""Shared fixtures: private Redis servers and a store on them.

Every Redis here is a ``redis-server`` process that this test run started itself, on a free
port in a temporary directory, stopped by PID (:mod:`claimkit.dev.redis_server`). The machine's
shared Redis (127.0.0.1:6379) is never touched.

- ``redis_server``: one server for the whole session, AOF off.
- ``redis_url``: its URL for one test, after ``FLUSHALL`` on it, so every test starts with
  an empty keyspace. The server is ours, so flushing it harms no one; it is cheaper than a
  process per test. Loaded Lua scripts and ``CONFIG SET`` changes do survive between tests:
  a test that needs a pristine process (or AOF, or a kill) uses ``redis_factory``.
- ``redis_factory``: ``redis_factory(aof="always")`` starts an extra server (same keyword
  arguments as :class:`RedisServer`, plus ``start=False`` to get it unstarted); all are
  closed (stopped, temp dirs removed) at the end of the test.
- ``store``: ``open_store(redis_url)`` for async (trio) tests.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from claimkit.dev.redis_server import RedisServer
from claimkit.store import Store, open_store

RedisFactory = Callable[..., RedisServer]

# A run started in the background of a non-interactive shell (`nox -s tests &`, nohup, some
# CI launchers) inherits SIGINT ignored, and so would every child it starts: the tests that
# stop a `claimkit` child with SIGINT (Ctrl-C) would wait for nothing. A handler of ours is
# reset to the default action in each child at exec.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """The session's private Redis server (AOF off)."""
    with RedisServer(aof="off") as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session server's URL, with an empty keyspace for this test."""
    # A test that froze or crashed the shared session server must not break the next one.
    if redis_server.paused:
        redis_server.resume()
    if not redis_server.running:
        redis_server.restart()
    redis_server.flushall()
    return redis_server.url


@pytest.fixture
def redis_factory() -> Iterator[RedisFactory]:
    """Start extra private servers for one test; all are closed at teardown."""
    with contextlib.ExitStack() as servers:

        def make(*, start: bool = True, **kwargs: Any) -> RedisServer:
            server = RedisServer(**kwargs)
            servers.callback(server.close)
            if start:
                server.start()
            return server

        yield make


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[Store]:
    """A store on the session server's clean keyspace."""
    async with open_store(redis_url) as opened:
        yield opened
