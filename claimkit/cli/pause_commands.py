"""``claimkit pause`` and ``claimkit resume`` (docs/cli.md): stop and restart claiming from
a queue, without stopping the consumers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from claimkit.cli.common import (
    Queue,
    RedisUrl,
    TransportConfig,
    TransportConfigFile,
)
from claimkit.cli.runner import resolve_queue, with_store

if TYPE_CHECKING:
    from claimkit.ops.pause import PauseResult
    from claimkit.protocol.pause import PauseMark
    from claimkit.store import Store

__all__ = ["pause", "pause_line", "resume", "resume_line"]


def pause_line(queue: str, result: PauseResult) -> str:
    """The one line ``claimkit pause`` prints (docs/cli.md)."""
    from claimkit.cli.console import pause_text

    if result.changed:
        return f"claimkit pause {queue}: paused {pause_text(result.mark)}"
    return f"claimkit pause {queue}: already paused {pause_text(result.mark)}; nothing changed"


def resume_line(queue: str, mark: PauseMark | None) -> str:
    """The one line ``claimkit resume`` prints (docs/cli.md)."""
    from claimkit.cli.console import pause_text

    if mark is None:
        return f"claimkit resume {queue}: not paused; nothing changed"
    return f"claimkit resume {queue}: resumed; it was paused {pause_text(mark)}"


def pause(
    queue: Queue,
    reason: Annotated[
        str | None,
        typer.Option(help="Why: shown by inspect and in the consumers' logs.", show_default=False),
    ] = None,
    for_seconds: Annotated[
        int | None,
        typer.Option(
            "--for",
            min=1,
            help="Resume by itself after this many seconds (default: stay paused).",
            show_default=False,
        ),
    ] = None,
    transport_config: TransportConfig = None,
    transport_config_file: TransportConfigFile = None,
    redis_url: RedisUrl = None,
) -> None:
    """Pause a queue: consumers claim nothing new from it until resume.

    Writes the key <queue>:paused ({queue}:paused on a Redis Cluster) with the Redis
    server time and --reason. Every running consumer reads it with each poll, so within
    one poll_interval_ms it stops claiming from the queue; the work it already holds goes
    on to its record, and heartbeats, the reclaimer and the retry mover carry on. With the
    queue paused, drain --release-all hands every claim back for good. A queue already
    paused is left as it is (its time and reason stay). Prints one line; exit status 0
    either way. The key: docs/protocol.md#pause.

    Example:

        claimkit pause --redis-url redis://127.0.0.1:6379/0 -q requests \\
          --reason "redis move"
    """
    target = resolve_queue(queue, transport_config, transport_config_file, redis_url)
    from claimkit.ops.pause import pause_queue

    async def go(store: Store) -> PauseResult:
        return await pause_queue(store, queue, reason=reason, for_seconds=for_seconds)

    result = with_store(target.config, go, key_types=target.key_types)
    typer.echo(pause_line(queue, result))


def resume(
    queue: Queue,
    transport_config: TransportConfig = None,
    transport_config_file: TransportConfigFile = None,
    redis_url: RedisUrl = None,
) -> None:
    """Resume a paused queue: consumers claim from it again at their next poll.

    Deletes the key <queue>:paused and says what it held. A queue that is not paused is
    left as it is. Prints one line; exit status 0 either way. The key:
    docs/protocol.md#pause.

    Example:

        claimkit resume --redis-url redis://127.0.0.1:6379/0 -q requests
    """
    target = resolve_queue(queue, transport_config, transport_config_file, redis_url)
    from claimkit.ops.pause import resume_queue

    async def go(store: Store) -> PauseMark | None:
        return await resume_queue(store, queue)

    mark = with_store(target.config, go, key_types=target.key_types)
    typer.echo(resume_line(queue, mark))
