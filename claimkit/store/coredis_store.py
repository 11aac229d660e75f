"""The default store: coredis on trio, through anyio (see :mod:`claimkit.store`)."""

from __future__ import annotations

import errno
from contextlib import AbstractContextManager, asynccontextmanager, contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import coredis
import coredis.exceptions as cx
from coredis.commands.constants import CommandFlag
from coredis.commands.request import CommandRequest
from coredis.globals import COMMAND_FLAGS
from coredis.response._callbacks import NoopCallback
from coredis.retry import NoRetryPolicy

from claimkit._errors import exception_chain
from claimkit.store.acl_refusals import ACL_LOG_ENTRIES, acl_user, is_acl_refusal, permission_error
from claimkit.store.interface import (
    Arg,
    ScriptCall,
    StoreError,
    StorePermissionError,
    StoreTlsError,
    StoreUnavailable,
)
from claimkit.store.redact import redact_url
from claimkit.store.script_calls import NO_WAIT, ReplicaWait, run_pipelined
from claimkit.store.tls import tls_file_error, tls_problem

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Iterator, Sequence

    from claimkit.store.scripts import Script

_NOOP = NoopCallback()  # type: ignore[var-annotated]
# Commands that block (BRPOP, ...): coredis keeps their connection to them, and drops it
# when one is cancelled.
_BLOCKING = frozenset(
    bytes(name) for name, flags in COMMAND_FLAGS.items() if CommandFlag.BLOCKING in flags
)


def _verb(name: Arg) -> bytes:
    """A command's name as coredis takes it."""
    return str(name).upper().encode()


def _message(exc: BaseException) -> str:
    """Redis's error text; coredis strips the ``NOPERM`` code (keeping it as the class
    ``AuthorizationError``): it is put back, so the line says what Redis said."""
    text = str(exc) or type(exc).__name__
    if isinstance(exc, cx.AuthorizationError) and not text.startswith("NOPERM"):
        return f"NOPERM {text}"
    return _with_cluster_code(exc, text)


def _out_of_files(exc: BaseException) -> str | None:
    """What to add to a connection error whose cause is this process (``EMFILE``) or the
    system (``ENFILE``) having no file descriptor left: a local limit, not Redis going
    away (docs/dispatch.md#out-of-open-files); ``None`` for any other cause."""
    for cur in exception_chain(exc):
        if isinstance(cur, OSError) and cur.errno == errno.EMFILE:
            return "too many open files: this process's open-file limit, not Redis"
        if isinstance(cur, OSError) and cur.errno == errno.ENFILE:
            return "too many open files in the system: the system's limit, not Redis"
    return None


def _translate(exc: BaseException, url: str = "", *, cluster: bool = False) -> BaseException:
    """A coredis error as :class:`StoreUnavailable` or :class:`StoreError`; others as is.

    ``url`` (the store's) lets a connection error name a TLS file of it that fails to load.
    With ``cluster`` (a cluster store's call), the replies of a cluster that is moving
    (``CLUSTERDOWN``, ``TRYAGAIN``, redirections left over, a layout that cannot be read)
    are :class:`StoreUnavailable`: retrying later helps. ``CROSSSLOT`` stays a
    :class:`StoreError`. A ``WAIT`` that fell short (coredis's ``ReplicationError``) is
    :class:`StoreUnavailable` in every mode (docs/topology.md#failover)."""
    if isinstance(exc, StoreError | StoreUnavailable):
        return exc  # claimkit's own (a WAIT that fell short): already one line
    if isinstance(exc, cx.ReplicationError | cx.PrimaryNotFoundError | cx.StalePrimaryError):
        # A WAIT that fell short; the sentinels naming no primary, or one that is not.
        return StoreUnavailable(str(exc))
    if cluster and isinstance(exc, _CLUSTER_MOVING) and not isinstance(exc, _CROSSSLOT):
        return StoreUnavailable(_message(exc))
    if isinstance(exc, cx.ConnectionError | cx.ReadOnlyError | TimeoutError | OSError):
        # A TLS file bad since check_url: its name, not the handshake's symptom (coredis
        # skips an ssl_certfile without ssl_keyfile; the server then drops the client).
        file_error = tls_file_error(url)
        if file_error is not None:
            return file_error
        problem = tls_problem(exc)
        if problem is not None:
            return StoreTlsError(problem)
        text = str(exc) or type(exc).__name__
        local = _out_of_files(exc)
        return StoreUnavailable(text if local is None else f"{text} ({local})")
    if isinstance(exc, cx.RedisError):
        if "LOADING" in str(exc) or "MASTERDOWN" in str(exc):
            return StoreUnavailable(str(exc))
        return StoreError(_message(exc))
    return exc


@contextmanager
def _translated(url: str = "", *, cluster: bool = False) -> Iterator[None]:
    try:
        yield
    except (cx.RedisError, TimeoutError, OSError) as exc:
        raise _translate(exc, url, cluster=cluster) from exc


# coredis strips the error code from a reply ("MOVED 838 host:port" reads "838 host:port");
# a cluster's replies need theirs to be understood (claimkit.store.server_checks refuses them).
_CLUSTER_CODES: tuple[tuple[type[Exception], str], ...] = (
    (cx.MovedError, "MOVED"),
    (cx.AskError, "ASK"),
    (cx.ClusterDownError, "CLUSTERDOWN"),
    (cx.ClusterCrossSlotError, "CROSSSLOT"),
    (cx.TryAgainError, "TRYAGAIN"),
)


_CROSSSLOT = cx.ClusterCrossSlotError
# Errors of a cluster in motion: a failover, a resharding, a layout being refreshed.
_CLUSTER_MOVING = (cx.RedisClusterError, cx.AskError, cx.TryAgainError, cx.ClusterDownError)


def _with_cluster_code(exc: BaseException, text: str) -> str:
    for kind, code in _CLUSTER_CODES:
        if isinstance(exc, kind):
            return text if text.startswith(code) else f"{code} {text}"
    return text


class CoredisStore:
    """:class:`claimkit.store.Store` on a ``coredis.Redis`` client.

    Attributes:
        mode: ``"standalone"``, or ``"sentinel"`` when the client is a sentinel-managed
            primary's (docs/topology.md).
    """

    _cluster = False

    def __init__(
        self,
        client: coredis.Redis[bytes],
        url: str,
        *,
        mode: str = "standalone",
        wait: ReplicaWait = NO_WAIT,
    ) -> None:
        self._client: Any = client
        self.url = redact_url(url)
        self.mode = mode
        self._user = acl_user(url)
        self._wait = replace(wait, url=self.url)

    def _translated(self) -> AbstractContextManager[None]:
        return _translated(self.url, cluster=self._cluster)

    def _request(self, args: Sequence[Arg]) -> CommandRequest[Any]:
        return CommandRequest(_verb(args[0]), *args[1:], callback=_NOOP, execution_parameters={})

    async def _acl_log(self) -> Any:
        return await self._client.execute_command(self._request(("ACL", "LOG", ACL_LOG_ENTRIES)))

    async def _explain(
        self, exc: StoreError, commands: Sequence[Sequence[Arg]], script: str | None = None
    ) -> StoreError:
        """``exc``, or the precise :class:`StorePermissionError` when it is an ACL refusal."""
        if isinstance(exc, StorePermissionError) or not is_acl_refusal(str(exc)):
            return exc
        return await permission_error(
            str(exc), commands, user=self._user, acl_log=self._acl_log, script_name=script
        )

    async def _execute(self, args: Sequence[Arg]) -> Any:
        """One command on a connection of the pool's, which other calls share while it
        waits for its reply (as coredis's ``execute_command`` does), without coredis's
        per-call wrappers (retry policy, telemetry span, client-side cache, callbacks): a
        store call runs on every poll and ack. The reply within the ``stream_timeout``,
        else ``TimeoutError``; an error reply is raised. A blocking command goes through
        ``execute_command``, which keeps the connection to it."""
        verb = _verb(args[0])
        if verb in _BLOCKING:
            return await self._client.execute_command(self._request(args))
        pool = self._client.connection_pool
        connection = await pool.get_connection()
        try:
            request = connection.create_request(verb, *args[1:])
        finally:
            pool.release(connection)
        return await request

    async def command(self, *args: Arg) -> Any:
        try:
            with self._translated():
                return await self._execute(args)
        except StoreError as exc:
            raise await self._explain(exc, [args]) from exc

    async def pipeline(self, commands: Sequence[Sequence[Arg]], *, transaction: bool) -> list[Any]:
        if transaction:
            return await self._transaction(commands)
        with self._translated():
            replies = await self._pipelined(commands)
        await self._raise_first_error(commands, replies)
        return replies

    async def _raise_first_error(self, commands: Sequence[Sequence[Arg]], replies: Any) -> None:
        """Raise the first reply that is an error, as :func:`_translate` makes it (an ACL
        refusal explained by :meth:`_explain`); return when every reply is a value."""
        for command, reply in zip(commands, replies, strict=True):
            if isinstance(reply, cx.RedisError):
                error = _translate(reply, cluster=self._cluster)
                if isinstance(error, StoreError):
                    raise await self._explain(error, [command]) from reply
                raise error from reply

    async def _transaction(self, commands: Sequence[Sequence[Arg]]) -> list[Any]:
        """``MULTI``, the commands, ``EXEC`` on one connection of the pool's.

        ``MULTI`` goes alone first: when Redis refuses it (an ACL without ``+multi``) the
        commands would otherwise run one by one, outside any transaction. A command refused
        while queueing aborts the transaction (``EXECABORT``): nothing runs, and its own
        error is raised. A refused ``EXEC`` leaves the connection inside ``MULTI``: it is
        dropped, never handed back to the pool, so nothing queued on it ever runs.

        Cancellation: the connection is dropped; if ``EXEC`` had been sent, the
        transaction may have run.
        """
        if not commands:
            return []
        pool = self._client.connection_pool
        with self._translated():
            connection = await self._transaction_connection(commands)
        keep = False
        try:
            with self._translated():
                try:
                    await connection.create_request(b"MULTI", decode=False)
                except cx.ResponseError as exc:
                    keep = True  # no MULTI began: the connection is as it was
                    raise await self._refused(_message(exc), [("MULTI",), *commands]) from exc
                queued = [
                    connection.create_request(
                        str(c[0]).upper().encode(), *c[1:], decode=False, raise_exceptions=False
                    )
                    for c in commands
                ]
                done = connection.create_request(b"EXEC", decode=False, raise_exceptions=False)
                refusals = [
                    (c, r)
                    for c, r in zip(commands, [await q for q in queued], strict=True)
                    if isinstance(r, BaseException)
                ]
                replies = await done
                if isinstance(replies, BaseException):
                    if refusals:  # EXECABORT: the transaction was discarded, nothing ran
                        keep = True
                        command, error = refusals[0]
                        raise await self._refused(_message(error), [command, *commands])
                    raise await self._refused(_message(replies), [("EXEC",), *commands])
                keep = True
            await self._raise_first_error(commands, replies)
            return list(replies)
        finally:
            if keep:
                pool.release(connection)
            else:
                connection.invalidate("transaction state unknown")

    async def _transaction_connection(self, commands: Sequence[Sequence[Arg]]) -> Any:
        """A connection of the pool's for a transaction of ``commands``."""
        return await self._client.connection_pool.get_connection()

    async def _refused(
        self, message: str, commands: Sequence[Sequence[Arg]]
    ) -> StoreError | StoreUnavailable:
        """The error for a transaction Redis refused before running any of it."""
        if is_acl_refusal(message):
            return await permission_error(
                message, commands, user=self._user, acl_log=self._acl_log, written=False
            )
        return StoreError(f"{message} (the transaction was refused; nothing was written)")

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[Arg]) -> Any:
        script.check_key_count(keys)
        if self._wait.applies(script):
            # The script and its WAIT on one connection: one pipeline.
            return (await self.run_many(script, [(keys, args)]))[0]
        call = ("EVALSHA", script.sha1, len(keys), *keys, *args)
        try:
            with self._translated():
                try:
                    return await self._execute(call)
                except cx.NoScriptError:
                    return await self._execute(("EVAL", script.source, len(keys), *keys, *args))
        except StoreError as exc:
            raise await self._explain(exc, [call], script.name) from exc

    async def run_many(self, script: Script, calls: Sequence[ScriptCall]) -> list[Any]:
        for keys, _ in calls:
            script.check_key_count(keys)
        try:
            with self._translated():
                return await self._run_pipelined(script, calls)
        except StoreError as exc:
            sent = [("EVALSHA", script.sha1, len(k), *k, *a) for k, a in calls]
            raise await self._explain(exc, sent, script.name) from exc

    async def _run_pipelined(self, script: Script, calls: Sequence[ScriptCall]) -> list[Any]:
        return await run_pipelined(
            script, calls, self._pipelined, cx.NoScriptError, wait=self._wait
        )

    async def _pipelined(self, commands: Sequence[Sequence[Arg]]) -> list[Any]:
        """Send ``commands`` in one pipeline (no transaction); a command Redis refused gives
        its exception, with Redis's message only, as its reply. (coredis's ``raise_on_error``
        would copy every argument of the refused command into the message: payloads and
        tokens in the logs.) A broken connection or a refused handshake (wrong password)
        raises."""
        if not commands:
            return []
        pool = self._client.connection_pool
        # As coredis's pipeline does, without its per-command wrappers: the connection is
        # this call's until the replies are in, all of which must come within the
        # ``stream_timeout``; a cancelled call drops the connection.
        connection = await pool.get_connection()
        try:
            batch = connection.create_request_batch(
                [CommandRequest(_verb(c[0]), *c[1:], execution_parameters={}) for c in commands]
            )
            replies = list(await batch)
        finally:
            pool.release(connection)
        for reply in replies:
            if isinstance(reply, BaseException) and not isinstance(reply, cx.ResponseError):
                raise reply  # a timeout or a lost connection: the call failed
        return replies


async def _replies(pending: Sequence[Awaitable[Any]]) -> list[Any]:
    """The reply of each request of a pipeline that ran, in order: an error reply as its
    ``ResponseError`` (for the caller to translate), not raised."""
    replies: list[Any] = []
    for p in pending:
        try:
            replies.append(await p)
        except cx.ResponseError as exc:
            replies.append(exc)
    return replies


@asynccontextmanager
async def open_coredis_store(
    url: str, *, timeout: float, shown: str | None = None, wait: ReplicaWait = NO_WAIT
) -> AsyncIterator[CoredisStore]:
    try:
        # coredis builds its TLS context here, from the URL's files.
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
    except OSError as exc:
        # A TLS file that changed since check_url: still one line.
        error = tls_file_error(url)
        if error is None:
            raise
        raise error from exc
    # Entering the client starts its pool's background task group; a Redis that is down at
    # start-up is not an error here: the first command reports it.
    async with client:
        yield CoredisStore(client, shown or url, wait=wait)
