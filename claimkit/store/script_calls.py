"""What both store backends do alike when they run scripts: check the key count, resend by
EVAL the calls of a pipeline that Redis refused with NOSCRIPT, and follow writing calls by
``WAIT`` when the store waits for replicas (docs/topology.md#failover)."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Collection, Sequence

    from claimkit.store.interface import Arg, ScriptCall
    from claimkit.store.scripts import Script

__all__ = ["NO_WAIT", "SHORT_WARNING_SECONDS", "ReplicaWait", "run_pipelined"]

log = logging.getLogger("claimkit")


@dataclass(frozen=True, slots=True)
class ReplicaWait:
    """The ``wait_replicas`` knob (docs/topology.md#failover): a writing script call is
    followed, on the same connection, by ``WAIT replicas timeout_ms``.

    Attributes:
        replicas: how many replicas must confirm (0: the knob is off).
        timeout_ms: how long ``WAIT`` may block, in milliseconds.
        url: the store's URL (password masked), for the error line.
    """

    replicas: int = 0
    timeout_ms: int = 1000
    url: str = ""

    def applies(self, script: Script) -> bool:
        """Whether calls of ``script`` are followed by ``WAIT``: a writing script while the
        knob is on."""
        return self.replicas > 0 and script.writes

    def command(self) -> tuple[Arg, ...]:
        """``("WAIT", replicas, timeout_ms)``: the command sent after a writing call."""
        return ("WAIT", self.replicas, self.timeout_ms)

    def check(self, script: Script | str, reply: Any) -> None:
        """Warn (one line, at most every :data:`SHORT_WARNING_SECONDS` per store) when
        ``WAIT`` answered fewer replicas than asked; an error reply is raised as it is (for
        the backend to translate). ``script`` is the script called, or the name of what
        was written (``"submit"``).

        A short answer does not undo the call: the script ran on the primary, so the call
        counts as done, as it would without the knob; only a failover before the replicas
        catch up can lose it. Failing the call instead would make the caller redo or drop
        work that Redis holds (a claim it never dispatches lapses and counts a delivery),
        and a primary without replicas would turn its queue into dead letters
        (docs/topology.md#failover)."""
        if isinstance(reply, BaseException):
            raise reply
        reached = int(reply)
        if reached < self.replicas:
            name = script if isinstance(script, str) else script.name
            _warn_short(self.url, name, reached, self.replicas, self.timeout_ms)


SHORT_WARNING_SECONDS = 10.0
"""At most one "fewer replicas than wait_replicas" warning per store URL this often."""

_short_since: dict[str, tuple[float, int]] = {}


def _warn_short(url: str, name: str, reached: int, wanted: int, timeout_ms: int) -> None:
    now = time.monotonic()
    last, unsaid = _short_since.get(url, (-math.inf, 0))
    if now - last < SHORT_WARNING_SECONDS:
        _short_since[url] = (last, unsaid + 1)
        return
    _short_since[url] = (now, 0)
    more = f" ({unsaid} more calls since the last warning)" if unsaid else ""
    log.warning(
        "claimkit: warning: Redis at %s: a %s call reached %d of %d replicas within %d ms "
        "(wait_replicas)%s; it is done on the primary, but a failover before the replicas "
        "catch up may lose it (docs/topology.md#failover)",
        url,
        name,
        reached,
        wanted,
        timeout_ms,
        more,
    )


NO_WAIT = ReplicaWait()


def _last_only(calls: Sequence[ScriptCall]) -> Collection[int]:
    return {len(calls) - 1} if calls else set()


async def run_pipelined(
    script: Script,
    calls: Sequence[ScriptCall],
    pipelined: Callable[[list[tuple[Arg, ...]]], Awaitable[list[Any]]],
    noscript: type[Exception],
    *,
    wait: ReplicaWait = NO_WAIT,
    wait_after: Callable[[Sequence[ScriptCall]], Collection[int]] = _last_only,
) -> list[Any]:
    """The body of :meth:`Store.run_many` for a backend's ``pipelined`` function, which
    sends commands in one non-transactional pipeline and returns, per command, its reply or
    the exception Redis's refusal became. Calls refused as ``noscript`` are resent by EVAL;
    the first other refusal is raised (a backend exception, for the backend to translate).

    When ``wait`` applies to ``script``, a ``WAIT`` goes after each call whose index
    ``wait_after(calls)`` gives (by default the last one: one connection carries the whole
    pipeline, and ``WAIT`` covers every write before it on its connection); a cluster store
    gives the last call of each node. Fewer replicas than asked give a warning
    (:meth:`ReplicaWait.check`), once the replies of every call are in (the calls ran).
    """
    waiting = wait.applies(script)

    async def send(verb: str, ref: str, batch: Sequence[ScriptCall]) -> list[Any]:
        after = wait_after(batch) if waiting else ()
        commands: list[tuple[Arg, ...]] = []
        where: list[int] = []
        for i, (keys, args) in enumerate(batch):
            where.append(len(commands))
            commands.append((verb, ref, len(keys), *keys, *args))
            if i in after:
                commands.append(wait.command())
        replies = await pipelined(commands)
        positions = set(where)
        waits.extend(reply for i, reply in enumerate(replies) if i not in positions)
        return [replies[i] for i in where]

    waits: list[Any] = []
    replies = await send("EVALSHA", script.sha1, calls)
    refused = [i for i, reply in enumerate(replies) if isinstance(reply, noscript)]
    if refused:
        again = await send("EVAL", script.source, [calls[i] for i in refused])
        for i, reply in zip(refused, again, strict=True):
            replies[i] = reply
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    for reply in waits:
        wait.check(script, reply)
    return replies
