"""The one skeleton of every operator command (docs/cli.md): resolve the queue, open the
store, run, print.

A command parses its options, resolves ``--queue`` with :func:`resolve_queue`, then calls
:func:`with_store` with an async function of the open store; that opens the store on the
config's URL, checks the key types the command reads, runs it under
:func:`claimkit.cli.common.run` (errors: one line, exit status 1; Ctrl-C as the command
says) and returns its result. :func:`show` prints the result as strict JSON (``--json``)
or as text.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import trio
import typer

from claimkit.cli.common import (
    Interrupt,
    config_from,
    fail,
    run,
    run_to_end,
    usage_error,
)
from claimkit.config import ConfigError
from claimkit.store import open_store

if TYPE_CHECKING:
    from claimkit.cli.console import Console, RenderableType
    from claimkit.config import Config
    from claimkit.ops.queues import OperatorQueue
    from claimkit.store import Store

__all__ = [
    "console",
    "print_json",
    "resolve_queue",
    "show",
    "until_sigint",
    "with_store",
    "with_store_until_stopped",
]

T = TypeVar("T")

KeyTypes = Mapping[str, str] | Callable[["Store"], Mapping[str, str]]
"""What :func:`with_store` checks before the command runs: key name -> Redis type, or a
function of the open store giving them (the key names follow the store's mode: standalone,
or a Redis Cluster's layout, docs/topology.md#cluster-key-layout)."""


def resolve_queue(
    queue: str,
    transport_config: str | None,
    transport_config_file: str | None,
    redis_url: str | None,
) -> OperatorQueue:
    """Load the config and resolve ``--queue`` against it, or exit with one line.

    An empty name is a usage error (exit status 2); a name the config does not list, when
    it lists queues, exit status 1. With no queues configured any name is accepted.
    """
    from claimkit.ops.queues import OperatorQueue

    if not queue:
        usage_error("--queue must not be empty")
    config = config_from(transport_config, transport_config_file, redis_url, require_queues=False)
    if not config.queues:
        return OperatorQueue(config, queue, None)
    try:
        return OperatorQueue(config, queue, config.queue(queue))
    except ConfigError as exc:
        fail(str(exc))


def _in_store(
    config: Config, fn: Callable[[Store], Awaitable[T]], key_types: KeyTypes | None
) -> Callable[[], Awaitable[T]]:
    async def go() -> T:
        async with open_store(
            config.url,
            topology=config.topology,
            wait_replicas=config.wait_replicas,
            wait_timeout_ms=config.wait_timeout_ms,
        ) as store:
            if key_types is not None:
                from claimkit.ops.inspect import check_key_types

                expected = key_types(store) if callable(key_types) else key_types
                await check_key_types(store, expected)
            return await fn(store)

    return go


def with_store(
    config: Config,
    fn: Callable[[Store], Awaitable[T]],
    *,
    key_types: KeyTypes | None = None,
    interrupt: Interrupt = Interrupt.FAIL,
) -> T:
    """Open the store on ``config.url``, check ``key_types`` (key name -> Redis type, or a
    function of the store giving them, :data:`KeyTypes`; ``None``: no check), and return
    ``await fn(store)``.

    Every operator error ends the command with one line and exit status 1; Ctrl-C, by
    default, with one line and exit status 130 (``interrupt``, :class:`Interrupt`).
    """
    return run_to_end(_in_store(config, fn, key_types), url=config.url, interrupt=interrupt)


def with_store_until_stopped(
    config: Config,
    fn: Callable[[Store], Awaitable[T]],
    *,
    key_types: KeyTypes | None = None,
) -> T | None:
    """:func:`with_store` for a command that runs until Ctrl-C (``--watch``, ``--follow``):
    Ctrl-C ends it quietly (exit status 0) and gives ``None``."""
    return run(_in_store(config, fn, key_types), url=config.url, interrupt=Interrupt.STOP)


async def until_sigint(
    fn: Callable[[], Awaitable[T]], *, also: Sequence[signal.Signals] = ()
) -> T | None:
    """Run ``fn`` until it returns or Ctrl-C (SIGINT, or one of the signals ``also``), which
    cancels it: its cleanup then runs as for any cancellation, instead of a
    ``KeyboardInterrupt`` at any line (or, for SIGTERM, the process dying on the spot)."""
    result: list[T] = []
    with trio.open_signal_receiver(signal.SIGINT, *also) as signals:
        async with trio.open_nursery() as nursery:

            async def stop_on_sigint() -> None:
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    return

            async def main() -> None:
                result.append(await fn())
                nursery.cancel_scope.cancel()

            nursery.start_soon(stop_on_sigint)
            nursery.start_soon(main)
    return result[0] if result else None


def console() -> Console:
    """A rich console on stdout (:func:`claimkit.cli.console.make_console`)."""
    from claimkit.cli.console import make_console

    return make_console()


def print_json(doc: Any) -> None:
    """Print ``doc`` as strict JSON: a non-finite float becomes ``"inf"``, ``"-inf"`` or
    ``"nan"`` (:func:`claimkit.ops.inspect.json_safe`), never the invalid ``Infinity``."""
    from claimkit.ops.inspect import json_safe

    typer.echo(json.dumps(json_safe(doc), indent=2, ensure_ascii=False, allow_nan=False))


def show(
    json_out: bool,
    *,
    doc: Callable[[], Any],
    text: Callable[[], str | Sequence[str] | RenderableType],
) -> None:
    """Print a command's result: ``doc()`` as strict JSON with ``--json``, else ``text()``.

    Text that is a string is one line (a list: one line each), echoed as written; any
    other renderable (a table) is drawn by rich on stdout.
    """
    if json_out:
        print_json(doc())
        return
    out = text()
    if isinstance(out, str):
        typer.echo(out)
    elif isinstance(out, Sequence):
        for line in out:
            typer.echo(line)
    else:
        console().print(out)
