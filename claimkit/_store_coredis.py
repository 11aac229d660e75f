"""The default store: coredis on trio, through anyio (see :mod:`claimkit._store`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any

import coredis
import coredis.exceptions as cx
from coredis.commands.request import CommandRequest
from coredis.response._callbacks import NoopCallback
from coredis.retry import NoRetryPolicy

from ._store import (
    Arg,
    ScriptCall,
    StoreError,
    StoreUnavailable,
    check_keys,
    redact_url,
    run_pipelined,
)

if TYPE_CHECKING:
    from ._scripts import Script

_NOOP = NoopCallback()  # type: ignore[var-annotated]


@contextmanager
def _translated() -> Iterator[None]:
    try:
        yield
    except (cx.ConnectionError, cx.ReadOnlyError, TimeoutError, OSError) as exc:
        raise StoreUnavailable(str(exc) or type(exc).__name__) from exc
    except cx.RedisError as exc:
        if "LOADING" in str(exc) or "MASTERDOWN" in str(exc):
            raise StoreUnavailable(str(exc)) from exc
        raise StoreError(_with_cluster_code(exc)) from exc


# coredis strips the error code from a reply ("MOVED 838 host:port" reads "838 host:port");
# a cluster's replies need theirs to be understood (claimkit._server_checks refuses them).
_CLUSTER_CODES: tuple[tuple[type[Exception], str], ...] = (
    (cx.MovedError, "MOVED"),
    (cx.AskError, "ASK"),
    (cx.ClusterDownError, "CLUSTERDOWN"),
    (cx.ClusterCrossSlotError, "CROSSSLOT"),
    (cx.TryAgainError, "TRYAGAIN"),
)


def _with_cluster_code(exc: Exception) -> str:
    text = str(exc)
    for kind, code in _CLUSTER_CODES:
        if isinstance(exc, kind):
            return text if text.startswith(code) else f"{code} {text}"
    return text


class CoredisStore:
    """:class:`claimkit._store.Store` on a ``coredis.Redis`` client."""

    def __init__(self, client: coredis.Redis[bytes], url: str) -> None:
        self._client = client
        self.url = redact_url(url)

    def _request(self, args: Sequence[Arg]) -> CommandRequest[Any]:
        name = str(args[0]).upper().encode()
        return CommandRequest(name, *args[1:], callback=_NOOP, execution_parameters={})

    async def command(self, *args: Arg) -> Any:
        with _translated():
            return await self._client.execute_command(self._request(args))

    async def pipeline(self, commands: Sequence[Sequence[Arg]], *, transaction: bool) -> list[Any]:
        with _translated():
            replies = await self._pipelined(commands, transaction=transaction)
            for reply in replies:
                if isinstance(reply, cx.RedisError):
                    raise reply
            return replies

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[Arg]) -> Any:
        check_keys(script, keys)
        with _translated():
            try:
                return await self._client.execute_command(
                    self._request(("EVALSHA", script.sha1, len(keys), *keys, *args))
                )
            except cx.NoScriptError:
                return await self._client.execute_command(
                    self._request(("EVAL", script.source, len(keys), *keys, *args))
                )

    async def run_many(self, script: Script, calls: Sequence[ScriptCall]) -> list[Any]:
        for keys, _ in calls:
            check_keys(script, keys)
        with _translated():
            return await run_pipelined(script, calls, self._pipelined, cx.NoScriptError)

    async def _pipelined(
        self, commands: Sequence[Sequence[Arg]], *, transaction: bool = False
    ) -> list[Any]:
        """Send ``commands`` in one pipeline; a command Redis refused gives its exception,
        with Redis's message only, as its reply. (coredis's ``raise_on_error`` would copy
        every argument of the refused command into the message: payloads and tokens in the
        logs.) A broken connection or a refused handshake (wrong password) raises."""
        async with self._client.pipeline(transaction=transaction, raise_on_error=False) as pipe:
            pending = [
                pipe.create_request(str(c[0]).upper().encode(), *c[1:], callback=_NOOP)
                for c in commands
            ]
        replies: list[Any] = []
        for p in pending:
            try:
                replies.append(await p)
            except cx.ResponseError as exc:
                replies.append(exc)
        return replies


@asynccontextmanager
async def open_coredis_store(url: str, *, timeout: float) -> AsyncIterator[CoredisStore]:
    client: coredis.Redis[bytes] = coredis.Redis.from_url(
        url,
        decode_responses=False,
        # Percent-decode the user name and password (``%40`` for ``@``), as redis-py does.
        decode_components=True,
        connect_timeout=timeout,
        stream_timeout=timeout,
        retry_policy=NoRetryPolicy(),
        verify_version=False,
    )
    # Entering the client starts its pool's background task group; a Redis that is down at
    # start-up is not an error here: the first command reports it.
    async with client:
        yield CoredisStore(client, url)
