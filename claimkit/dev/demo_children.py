"""The demo's child processes (simulator, consumers), started and stopped by PID, and the
polling waits the demo uses to follow them (:mod:`claimkit.dev.demo`)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from pathlib import Path

__all__ = ["POLL_SECONDS", "Children", "DemoError", "exit_code", "until"]

POLL_SECONDS = 0.02  # how often the demo looks at Redis and the log files

# The children run exactly what the `claimkit` console script runs, with this interpreter,
# so they import the same claimkit as the demo whether or not a script exists next to it.
_CLAIMKIT = (
    sys.executable,
    "-c",
    "import sys; sys.argv[0] = 'claimkit'; from claimkit.cli.app import main; main()",
)


class DemoError(RuntimeError):
    """A step of the demo could not run (a child exited, a timeout); one line."""


class Children:
    """The demo's child processes: output in ``<logs>/<name>.out|.err``, each in a session
    (process group) of its own so that a signal reaches it and only it, stopped by PID."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        """Start ``claimkit <args>`` as child ``name``."""
        with (
            (self.logs / f"{name}.out").open("wb") as out,
            (self.logs / f"{name}.err").open("wb") as err,
        ):
            proc = subprocess.Popen(
                [*_CLAIMKIT, *args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,  # Ctrl-C reaches the demo, which then stops them
            )
        self.procs[name] = proc
        return proc

    def output(self, name: str, stream: str = "out") -> str:
        """What child ``name`` wrote so far on ``stream`` (``out`` or ``err``)."""
        path = self.logs / f"{name}.{stream}"
        return path.read_text(errors="replace") if path.exists() else ""

    def check_alive(self, name: str) -> None:
        """Raise :class:`DemoError` quoting its stderr if child ``name`` has exited."""
        code = self.procs[name].poll()
        if code is not None:
            tail = self.output(name, "err").strip().splitlines()[-5:]
            raise DemoError(f"{name} exited with code {code}: " + " | ".join(tail))

    def signal(self, name: str, signum: signal.Signals) -> None:
        """Send ``signum`` to child ``name``'s process group, if it was not reaped yet
        (an unreaped child's PID cannot have been reused)."""
        proc = self.procs[name]
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signum)

    def kill_all(self) -> None:
        """SIGKILL every child still running and reap it. Blocking; for the ``finally``."""
        for name, proc in self.procs.items():
            self.signal(name, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)


async def until(what: str, check: Callable[[], Awaitable[bool]], timeout: float) -> None:
    """Poll ``check`` every :data:`POLL_SECONDS` until it holds.

    Raises:
        DemoError: it did not hold within ``timeout`` seconds.
    """
    with trio.move_on_after(timeout):
        while True:  # polling another process's state: there is no event to wait on
            if await check():
                return
            await trio.sleep(POLL_SECONDS)
    raise DemoError(f"timed out after {timeout:.0f}s waiting for {what}")


async def exit_code(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    """Wait up to ``timeout`` seconds for ``proc`` to exit; its code, or ``None``."""
    with trio.move_on_after(timeout):
        while True:
            code = proc.poll()
            if code is not None:
                return code
            await trio.sleep(POLL_SECONDS)
    return None
