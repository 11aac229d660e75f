"""What both store backends do alike when they run scripts: check the key count, and
resend by EVAL the calls of a pipeline that Redis refused with NOSCRIPT."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from claimkit.store.interface import Arg, ScriptCall
    from claimkit.store.scripts import Script

__all__ = ["run_pipelined"]


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
