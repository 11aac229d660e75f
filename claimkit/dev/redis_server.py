"""A private Redis server process: for the tests, ``claimkit demo`` and the chaos harness.

:class:`RedisServer` runs one ``redis-server`` (or ``valkey-server``) child process bound to
127.0.0.1 on a free port, in a directory of its own, and controls it by PID: start, clean
stop (SIGTERM), crash (SIGKILL), restart on the same port and directory (the AOF is
replayed), pause (SIGSTOP) and resume (SIGCONT). It never touches a server it did not start,
and never picks the conventional port 6379, where a shared Redis may live.

The API is synchronous. From trio, call it through ``trio.to_thread.run_sync``. One
instance is meant to be driven from one thread at a time.

Which binary runs is decided by :func:`find_server_binary` (see ``docs/redis-server.md``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from claimkit.dev.resp_client import HOST as _HOST
from claimkit.dev.resp_client import call as _call
from claimkit.dev.server_binary import (
    BINARY_ENV,
    FALLBACK_REQUIREMENT,
    find_server_binary,
    not_found_message,
)

if TYPE_CHECKING:
    from collections.abc import Sequence
    from types import TracebackType

__all__ = [
    "BINARY_ENV",
    "FALLBACK_REQUIREMENT",
    "AofMode",
    "RedisServer",
    "RedisServerError",
    "find_server_binary",
    "not_found_message",
]

AofMode = Literal["off", "everysec", "always"]

LOG_NAME = "redis-server.log"
"""The file, inside the server's directory, that receives the server's stdout and stderr."""

_PORT_ATTEMPTS = 5  # fresh ports tried when the one picked is taken before the server binds
_POLL_INTERVAL = 0.02  # seconds between readiness probes
_PROBE_TIMEOUT = 1.0  # seconds allowed for one readiness probe's connect and replies
_TAIL_BYTES = 4000  # how much of the log an error message quotes
_SHARED_PORT = 6379  # the machine's shared Redis may listen here: never ours


def _pick_free_port() -> int:
    """A port that nothing on 127.0.0.1 was bound to a moment ago (never 6379)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((_HOST, 0))
            port: int = sock.getsockname()[1]
        if port != _SHARED_PORT:
            return port


class RedisServerError(RuntimeError):
    """The server could not be started or stopped; the message quotes its log."""


class _PortTaken(Exception):
    pass


# Servers still running when the interpreter exits are killed (and their temporary
# directories removed), so an aborted test run or a forgotten stop() leaves no orphan
# redis-server behind. Holding them here also keeps a running server's object alive (so
# never garbage-collected with its process still up) until it is stopped.
_RUNNING: set[RedisServer] = set()


@atexit.register
def _kill_leftovers() -> None:
    for server in list(_RUNNING):
        with contextlib.suppress(Exception):
            server.kill()
            server.close()


class RedisServer:
    """One private Redis server process, controlled by PID.

    The server binds 127.0.0.1 only, never saves RDB snapshots (``--save ""``), and keeps
    an append-only file when ``aof`` is ``"everysec"`` or ``"always"`` (``appendfsync``
    set to match). Its stdout and stderr go to ``<directory>/redis-server.log``; a start
    that fails quotes the end of that log.

    ``port`` and ``directory`` are fixed by the first :meth:`start` when not given: a free
    port (never 6379; retried when another process takes it first) and a fresh temporary
    directory, which :meth:`close` (and leaving the ``with`` block) deletes. A directory
    passed in is never deleted. Later starts reuse both, so the URL stays valid across
    :meth:`restart`.

    Used as a context manager it is started on entry and closed on exit.

    Args:
        port: TCP port; ``None`` picks a free one.
        directory: working directory (AOF, log); ``None`` makes a temporary one.
        aof: ``"off"``, or the ``appendfsync`` policy of an enabled AOF.
        binary: server executable; ``None`` means :func:`find_server_binary`.
        extra_args: more ``--name value`` arguments, applied after claimkit's own (so they
            override them).
        config_file: a configuration file, passed as the first argument (before claimkit's
            settings, which override it). The server may rewrite it (``CONFIG REWRITE``):
            ``--sentinel`` refuses to start without one. ``None`` (default): no file.
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        directory: Path | None = None,
        aof: AofMode = "off",
        binary: str | None = None,
        extra_args: Sequence[str] = (),
        config_file: Path | None = None,
    ) -> None:
        if aof not in ("off", "everysec", "always"):
            raise ValueError(f"aof must be 'off', 'everysec' or 'always', got {aof!r}")
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"port out of range: {port}")
        self.aof: AofMode = aof
        self.extra_args: tuple[str, ...] = tuple(extra_args)
        self.config_file = Path(config_file) if config_file is not None else None
        self._port = port
        self._directory = Path(directory) if directory is not None else None
        self._owns_directory = False
        self._binary = binary
        self._process: subprocess.Popen[bytes] | None = None
        self._paused = False

    def __repr__(self) -> str:
        state = "paused" if self._paused else "running" if self._process else "stopped"
        return f"<RedisServer {state} port={self._port} aof={self.aof}>"

    # -- state ---------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The TCP port. Raises ``RuntimeError`` before the first start picked one."""
        if self._port is None:
            raise RuntimeError("the server has no port yet: start() picks one")
        return self._port

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``."""
        return f"redis://{_HOST}:{self.port}/0"

    @property
    def directory(self) -> Path:
        """The working directory. Raises ``RuntimeError`` before the first start made one."""
        if self._directory is None:
            raise RuntimeError("the server has no directory yet: start() makes one")
        return self._directory

    @property
    def log_path(self) -> Path:
        """The file receiving the server's output (appended to by every start)."""
        return self.directory / LOG_NAME

    @property
    def binary(self) -> str:
        """The executable that runs (resolved on first use)."""
        if self._binary is None:
            self._binary = find_server_binary()
        return self._binary

    @property
    def pid(self) -> int | None:
        """The server's PID while started (also while paused, or crashed but not yet
        stopped); ``None`` when stopped."""
        return self._process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        """Whether the process is alive (a paused process is alive)."""
        return self._process is not None and self._process.poll() is None

    @property
    def paused(self) -> bool:
        """Whether :meth:`pause` stopped the process and :meth:`resume` has not yet run."""
        return self._paused

    # -- lifecycle -----------------------------------------------------------------------

    def start(self, timeout: float = 10.0) -> None:
        """Start the server and wait until it serves commands.

        Ready means: our own process (``INFO`` reports our PID, not some other server's
        on the same port) has finished loading its AOF and answers ``PING``.

        Args:
            timeout: seconds allowed in all, port retries included.

        Raises:
            RuntimeError: already started, or no server binary (:func:`find_server_binary`).
            RedisServerError: the process exited or was not ready in time; the message
                quotes the end of its log. The process is gone by then, and so is the
                temporary directory a first start made (a directory passed in is kept).

        Cancellation: interrupted (``KeyboardInterrupt``), the half-started process is
        killed and reaped before the exception propagates.
        """
        if self._process is not None:
            raise RuntimeError(f"{self!r} is already started")
        binary = self.binary
        made_directory = self._directory is None
        if self._directory is None:
            self._directory = Path(tempfile.mkdtemp(prefix="claimkit-redis-"))
            self._owns_directory = True
        try:
            self._directory.mkdir(parents=True, exist_ok=True)
            self._start_on_a_port(binary, time.monotonic() + timeout)
        except BaseException:
            # A first start that failed leaves nothing behind: the temporary directory it
            # made (holding only the log just quoted in the error) goes too.
            if made_directory:
                self._remove_directory()
            raise

    def _start_on_a_port(self, binary: str, deadline: float) -> None:
        fixed_port = self._port
        for attempt in range(1, _PORT_ATTEMPTS + 1):
            port = fixed_port if fixed_port is not None else _pick_free_port()
            try:
                self._spawn(binary, port, deadline)
            except _PortTaken as exc:
                if fixed_port is not None or attempt == _PORT_ATTEMPTS:
                    raise RedisServerError(str(exc)) from None
                continue
            self._port = port
            return

    def _spawn(self, binary: str, port: int, deadline: float) -> None:
        directory = self.directory
        args = _server_args(binary, port, directory, self.aof, self.extra_args, self.config_file)
        log_path = directory / LOG_NAME
        with log_path.open("ab") as log:
            log_offset = log.tell()
            # A session of its own: a Ctrl-C at the terminal reaches claimkit, which then
            # stops the server in order, rather than killing Redis under it.
            process = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=directory,
                start_new_session=True,
            )
        self._process = process
        self._paused = False
        _RUNNING.add(self)
        try:
            where = f"{self._binary} on {_HOST}:{port}"
            _wait_ready(where, process, port, deadline, (log_path, log_offset))
        except BaseException:
            self._reap(signal.SIGKILL, timeout=10.0)
            raise

    def stop(self, timeout: float = 10.0) -> None:
        """Shut the server down cleanly (SIGTERM) and wait for it to exit.

        A paused server is resumed so that it can act on the signal. Does nothing when
        not started. The directory and its AOF are kept.

        Args:
            timeout: seconds to wait for the exit; after that the process is killed.

        Raises:
            RedisServerError: the process survived SIGKILL too (never seen in practice).

        Cancellation: interrupted while waiting, the process may still be exiting and
        stays tracked; call :meth:`stop` or :meth:`kill` again.
        """
        self._reap(signal.SIGTERM, timeout)

    def kill(self, timeout: float = 10.0) -> None:
        """Crash the server: SIGKILL, then wait for the exit (the process is reaped).

        Unsynced writes are lost as in a real crash; the directory and AOF are kept. Does
        nothing when not started.

        Raises:
            RedisServerError: the process did not exit within ``timeout`` seconds.
        """
        self._reap(signal.SIGKILL, timeout)

    def restart(self, timeout: float = 10.0) -> None:
        """Start again on the same port and directory, stopping first if still running.

        With an AOF, the data written before :meth:`kill` or :meth:`stop` is replayed
        before this returns.
        """
        self.stop()
        self.start(timeout)

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections stay open, nothing is answered."""
        self._signal(signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        """Let a paused server run again (SIGCONT)."""
        self._signal(signal.SIGCONT)
        self._paused = False

    def flushall(self, timeout: float = 10.0) -> None:
        """Delete every key of this private server (for the test fixtures).

        Raises:
            RuntimeError: not running.
            RedisServerError: Redis answered with an error.
        """
        if not self.running:
            raise RuntimeError(f"{self!r} is not running")
        (reply,) = _call(self.port, [["FLUSHALL"]], timeout)
        if reply != b"OK":
            raise RedisServerError(f"FLUSHALL on {self.url} failed: {reply}")

    def close(self) -> None:
        """Stop the server and delete the directory if it was a temporary one we made."""
        try:
            self.stop()
        finally:
            self._remove_directory()

    def _remove_directory(self) -> None:
        if self._owns_directory and self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None
            self._owns_directory = False

    def __enter__(self) -> RedisServer:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- signals -------------------------------------------------------------------------

    def _signal(self, signum: signal.Signals) -> None:
        if self._process is None or self._process.poll() is not None:
            raise RuntimeError(f"{self!r} is not running")
        self._process.send_signal(signum)

    def _reap(self, signum: signal.Signals, timeout: float) -> None:
        process = self._process
        if process is None:
            return
        # Popen.send_signal does nothing once the child has exited, and an exited child is
        # only reaped by our wait(), so its PID cannot have been reused by then.
        process.send_signal(signum)
        if self._paused and signum != signal.SIGKILL:
            process.send_signal(signal.SIGCONT)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                raise RedisServerError(
                    f"{self.binary} (pid {process.pid}) did not exit after SIGKILL"
                ) from None
        self._process = None
        self._paused = False
        _RUNNING.discard(self)


def _server_args(
    binary: str,
    port: int,
    directory: Path,
    aof: AofMode,
    extra_args: Sequence[str],
    config_file: Path | None = None,
) -> list[str]:
    """The command line of a private server (its config file, claimkit's settings, then
    ``extra_args``)."""
    args = [
        binary,
        *([str(config_file)] if config_file is not None else []),
        "--port", str(port),
        "--bind", _HOST,
        "--dir", str(directory),
        "--daemonize", "no",
        "--save", "",
        "--appendonly", "no" if aof == "off" else "yes",
    ]  # fmt: skip
    if aof != "off":
        args += ["--appendfsync", aof]
    return args + list(extra_args)


def _wait_ready(
    where: str,
    process: subprocess.Popen[bytes],
    port: int,
    deadline: float,
    log: tuple[Path, int],
) -> None:
    """Wait until ``process`` serves commands on ``port`` (see :meth:`RedisServer.start`).

    Raises:
        _PortTaken: it exited because another process holds the port.
        RedisServerError: it exited otherwise, or was not ready by ``deadline``
            (``time.monotonic()`` seconds); the message quotes the log from ``log``'s offset.
    """
    log_path, log_offset = log
    while True:
        code = process.poll()
        if code is not None:
            tail = _log_tail(log_path, log_offset)
            message = f"{where} exited with code {code} while starting; {tail}"
            if "Address already in use" in tail:
                raise _PortTaken(message)
            raise RedisServerError(message)
        if _answers(process.pid, port, deadline):
            return
        if time.monotonic() >= deadline:
            raise RedisServerError(
                f"{where} was not ready within the timeout; {_log_tail(log_path, log_offset)}"
            )
        time.sleep(_POLL_INTERVAL)


def _answers(pid: int, port: int, deadline: float) -> bool:
    """Whether the server of ``pid`` on ``port`` has loaded its data and answers ``PING``."""
    timeout = min(_PROBE_TIMEOUT, max(deadline - time.monotonic(), 0.05))
    try:
        info, pong = _call(port, [["INFO"], ["PING"]], timeout)
    except OSError:
        return False
    if not isinstance(info, bytes):
        return False
    fields = dict(line.split(":", 1) for line in info.decode().splitlines() if ":" in line)
    # Another process may already listen on the port we picked: only our PID counts.
    # PING answers -LOADING until the AOF has been replayed. A sentinel has no data set:
    # its INFO has no "loading" field.
    # (Redis says redis_mode:sentinel, Valkey server_mode:sentinel.)
    sentinel = "sentinel" in (fields.get("redis_mode"), fields.get("server_mode"))
    loaded = fields.get("loading") == "0" or (sentinel and "loading" not in fields)
    return fields.get("process_id") == str(pid) and loaded and pong == b"PONG"


def _log_tail(path: Path, offset: int) -> str:
    """The end of what this start wrote to the log, for error messages."""
    try:
        with path.open("rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(offset, log.tell() - _TAIL_BYTES))
            text = log.read().decode(errors="replace").strip()
    except OSError as exc:
        return f"its log {path} could not be read: {exc}"
    return f"last lines of {path}:\n{text}" if text else f"its log {path} is empty"


def main() -> int:
    """``python -m claimkit.dev.redis_server``: print the binary the tests and the demo run.

    Exit status 0 with its path on stdout, or 1 with :func:`not_found_message` on stderr
    (``nox -s tests`` and ``nox -s demo`` call it before they start).
    """
    try:
        print(f"claimkit: Redis server binary: {find_server_binary()}")
    except RuntimeError as exc:
        print(f"claimkit: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
