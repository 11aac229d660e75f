"""What both store backends do alike when they run scripts: check the key count, and
resend by EVAL the calls of a pipeline that Redis refused with NOSCRIPT."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from claimkit.store.interface import Arg, ScriptCall

if TYPE_CHECKING:
    from claimkit.store.scripts import Script

__all__ = ["check_keys", "run_pipelined"]


async def run_pipelined(
    script: Script,
    calls: Sequence[ScriptCall],
    pipelined: Callable[[list[tuple[Arg, ...]]], Awaitable[list[Any]]],
    noscript: type[Exception],
) -> list[Any]:
    """The body of :meth:`Store.run_many` for a backend's ``pipelined`` function, which
    sends commands in one non-transactional pipeline and returns, per command, its reply or
    the exception Redis's refusal became. Calls refused as ``noscript`` are resent by EVAL;
    the first other refusal is raised (a backend exception, for the backend to translate)."""
    replies = await pipelined(
        [("EVALSHA", script.sha1, len(keys), *keys, *args) for keys, args in calls]
    )
    refused = [i for i, reply in enumerate(replies) if isinstance(reply, noscript)]
    if refused:
        resend = [calls[i] for i in refused]
        again = await pipelined(
            [("EVAL", script.source, len(keys), *keys, *args) for keys, args in resend]
        )
        for i, reply in zip(refused, again, strict=True):
            replies[i] = reply
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies


def check_keys(script: Script, keys: Sequence[str]) -> None:
    """Raise ``ValueError`` (one line) unless ``len(keys)`` is ``script.numkeys``."""
    if len(keys) != script.numkeys:
        raise ValueError(f"{script.name} takes {script.numkeys} keys, got {len(keys)}")
