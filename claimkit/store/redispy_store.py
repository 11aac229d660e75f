"""The optional store: redis-py's asyncio client on trio, through trio-asyncio.

``open_store(url, backend="redispy")`` lands here. It is the user's first design, kept as
an alternative to the default coredis store (:mod:`claimkit.store.coredis_store`); see
``docs/store-backends.md`` for the measurements behind that choice. It needs the extra
``pip install 'claimkit[redispy]'`` and Python <= 3.13: trio-asyncio does not import on
Python 3.14 (trio-asyncio issue #160).

Replies are the same raw values the coredis store returns (see :mod:`claimkit.store`):
the client speaks RESP3, like coredis, and every redis-py response callback is removed, so
``HGETALL`` is a ``dict`` of bytes, ``ZRANGE ... WITHSCORES`` a list of ``[member, score]``
pairs with float scores, ``SET`` is ``b"OK"``, script replies are untouched.
``tests/test_store_backends.py`` runs one command list through both stores and compares.

redis-py and trio-asyncio are imported when a store is opened, never when this module is,
so that ``open_store`` can refuse with one clear line when they are missing. They are
untyped here (``Any``) for the same reason: the type checker may run where the extra is
not installed.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import trio

from claimkit._errors import ConfigError
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
    from collections.abc import AsyncIterator, Iterator, Sequence

    from claimkit.store.scripts import Script

__all__ = ["RedispyStore", "open_redispy_store"]

_CLOSE_TIMEOUT = 5.0  # seconds allowed for closing the client's connections on exit

_NOT_INSTALLED = (
    "the redispy store backend is not installed ({missing}): "
    "pip install 'claimkit[redispy]', or use the default coredis backend"
)
_PYTHON_314 = (
    "the redispy store backend needs Python <= 3.13: trio-asyncio does not import on "
    "Python {version} (trio-asyncio issue #160); use the default coredis backend"
)


@dataclass(frozen=True, slots=True)
class _Modules:
    """The modules of the extra, imported on first use."""

    redis_asyncio: Any
    exceptions: Any
    retry: Any
    backoff: Any
    trio_asyncio: Any


def load_backend(version: tuple[int, int] = (sys.version_info[0], sys.version_info[1])) -> _Modules:
    """Import redis-py and trio-asyncio, or say in one line why they cannot be used.

    Args:
        version: the Python ``(major, minor)`` to judge; this interpreter's by default.

    Raises:
        ConfigError: Python is 3.14 or newer, or the ``redispy`` extra is not installed.
            (A ``ValueError``: choosing this backend there is a configuration mistake.)
    """
    if version >= (3, 14):
        raise ConfigError(_PYTHON_314.format(version=f"{version[0]}.{version[1]}"))
    try:
        return _Modules(
            redis_asyncio=importlib.import_module("redis.asyncio"),
            exceptions=importlib.import_module("redis.exceptions"),
            retry=importlib.import_module("redis.asyncio.retry"),
            backoff=importlib.import_module("redis.backoff"),
            trio_asyncio=importlib.import_module("trio_asyncio"),
        )
    except ImportError as exc:
        raise ConfigError(_NOT_INSTALLED.format(missing=f"no module {exc.name!r}")) from exc


class RedispyStore:
    """:class:`claimkit.store.Store` on a ``redis.asyncio.Redis`` client.

    Every call is one asyncio task on the store's trio-asyncio loop, awaited from the
    calling trio task; the loop is passed explicitly, so any task of the trio run may use
    the store, not only those started inside the ``async with``.

    Cancellation: cancelling the trio task cancels the asyncio task; redis-py then drops the
    connection it was using (a reply may be half read), so the next call gets a fresh one.
    Whether Redis ran the command is unknown, as with any store
    (docs/protocol.md#claim-protocol).
    """

    mode = "standalone"

    def __init__(
        self, client: Any, loop: Any, modules: _Modules, url: str, wait: ReplicaWait = NO_WAIT
    ) -> None:
        self._client = client
        self._loop = loop
        self._m = modules
        self._x = modules.exceptions
        self.url = redact_url(url)
        self._user = acl_user(url)
        self._wait = replace(wait, url=self.url)

    @contextmanager
    def _translated(self) -> Iterator[None]:
        x = self._x
        try:
            yield
        except _Refused as exc:
            raise exc.error from None
        except StoreUnavailable:
            raise  # claimkit's own (a WAIT that fell short): already one line
        except (x.AuthenticationError, x.AuthorizationError) as exc:
            # Subclasses of redis-py's ConnectionError, but a retry will not fix a password.
            raise StoreError(_message(exc)) from exc
        except (x.ConnectionError, x.TimeoutError, x.ReadOnlyError, TimeoutError, OSError) as exc:
            # redis-py loads the URL's TLS files at each connect: one may have changed.
            file_error = tls_file_error(self.url)
            if file_error is not None:
                raise file_error from exc
            problem = tls_problem(exc)
            if problem is not None:
                raise StoreTlsError(problem) from exc
            # BusyLoadingError (LOADING) is a ConnectionError; READONLY means we reached a
            # replica during a failover: both pass with time.
            raise StoreUnavailable(_message(exc)) from exc
        except x.RedisError as exc:
            if "MASTERDOWN" in _message(exc):
                raise StoreUnavailable(_message(exc)) from exc
            raise StoreError(_message(exc)) from exc

    async def _call(self, fn: Any, *args: Any) -> Any:
        with self._translated():
            return await self._m.trio_asyncio.aio_as_trio(fn, loop=self._loop)(*args)

    async def _explained(
        self, fn: Any, commands: Sequence[Sequence[Arg]], *args: Any, script: str | None = None
    ) -> Any:
        """:meth:`_call`, with an ACL refusal made precise (:func:`permission_error`)."""
        try:
            return await self._call(fn, *args)
        except StoreError as exc:
            if isinstance(exc, StorePermissionError) or not is_acl_refusal(str(exc)):
                raise
            explained = await self._call(self._explain, str(exc), commands, script)
            raise explained from exc

    async def _explain(
        self, message: str, commands: Sequence[Sequence[Arg]], script: str | None
    ) -> StoreError:
        # Runs on the asyncio loop.
        return await permission_error(
            message, commands, user=self._user, acl_log=self._acl_log, script_name=script
        )

    async def _acl_log(self) -> Any:
        # Runs on the asyncio loop.
        return await self._client.execute_command("ACL", "LOG", ACL_LOG_ENTRIES)

    async def command(self, *args: Arg) -> Any:
        """Run one command; the raw reply (see :class:`claimkit.store.Store`)."""
        return await self._explained(self._client.execute_command, [args], *args)

    async def pipeline(self, commands: Sequence[Sequence[Arg]], *, transaction: bool) -> list[Any]:
        """Send ``commands`` in one round trip, in MULTI/EXEC when ``transaction``.

        Raises :class:`StoreError` for the first command Redis refused; in a transaction
        the others ran (Redis has no rollback), as with the coredis store.
        """
        if transaction:
            done: list[Any] = await self._call(self._transaction, commands)
            return done
        reply: list[Any] = await self._call(self._pipeline, commands)
        return reply

    async def _pipeline(self, commands: Sequence[Sequence[Arg]]) -> list[Any]:
        # Runs on the asyncio loop.
        replies = await self._pipelined(commands)
        for command, reply in zip(commands, replies, strict=True):
            if isinstance(reply, Exception):
                if is_acl_refusal(_message(reply)):
                    raise _Refused(await self._explain(_message(reply), [command], None))
                raise reply
        return replies

    async def _transaction(self, commands: Sequence[Sequence[Arg]]) -> list[Any]:
        """``MULTI``, the commands, ``EXEC`` on one connection (see the coredis store's
        ``_transaction``: ``MULTI`` goes alone first, so a refused one writes nothing; a
        command refused while queueing aborts it all; a refused ``EXEC`` drops the
        connection). Runs on the asyncio loop."""
        if not commands:
            return []
        x = self._x
        pool = self._client.connection_pool
        connection = await pool.get_connection()
        keep = False
        try:
            await connection.send_command("MULTI")
            try:
                await connection.read_response()
            except x.ResponseError as exc:
                keep = True
                raise _Refused(await self._refused(_message(exc), [("MULTI",), *commands])) from exc
            await connection.send_packed_command(connection.pack_commands([*commands, ("EXEC",)]))
            refusals = []
            for command in commands:
                try:
                    await connection.read_response()
                except x.ResponseError as exc:
                    refusals.append((command, exc))
            try:
                replies = await connection.read_response()
            except x.ResponseError as exc:
                if refusals:  # EXECABORT: discarded, nothing ran
                    keep = True
                    command, error = refusals[0]
                    message = _message(error)
                    raise _Refused(await self._refused(message, [command, *commands])) from exc
                raise _Refused(await self._refused(_message(exc), [("EXEC",), *commands])) from exc
            keep = True
        finally:
            if not keep:
                await connection.disconnect()
            await pool.release(connection)
        for command, reply in zip(commands, replies, strict=True):
            if isinstance(reply, Exception):
                if is_acl_refusal(_message(reply)):
                    raise _Refused(await self._explain(_message(reply), [command], None))
                raise reply
        return list(replies)

    async def _refused(self, message: str, commands: Sequence[Sequence[Arg]]) -> StoreError:
        # Runs on the asyncio loop.
        if is_acl_refusal(message):
            return await permission_error(
                message, commands, user=self._user, acl_log=self._acl_log, written=False
            )
        return StoreError(f"{message} (the transaction was refused; nothing was written)")

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[Arg]) -> Any:
        """Run ``script`` by EVALSHA, falling back to EVAL (which also caches it) on NOSCRIPT.

        Raises:
            ValueError: ``len(keys) != script.numkeys``.
        """
        script.check_key_count(keys)
        if self._wait.applies(script):
            # The script and its WAIT on one connection: one pipeline.
            return (await self.run_many(script, [(keys, args)]))[0]
        call = ("EVALSHA", script.sha1, len(keys), *keys, *args)
        return await self._explained(self._run, [call], script, keys, args, script=script.name)

    async def _run(self, script: Script, keys: Sequence[str], args: Sequence[Arg]) -> Any:
        # Runs on the asyncio loop: both attempts cost one hop between the loops.
        execute = self._client.execute_command
        try:
            return await execute("EVALSHA", script.sha1, len(keys), *keys, *args)
        except self._x.NoScriptError:
            return await execute("EVAL", script.source, len(keys), *keys, *args)

    async def run_many(self, script: Script, calls: Sequence[ScriptCall]) -> list[Any]:
        """Run ``script`` once per ``(keys, args)`` call in one round trip (see
        :meth:`claimkit.store.Store.run_many`).

        Raises:
            ValueError: a call's ``len(keys) != script.numkeys``; nothing is sent.
        """
        for keys, _ in calls:
            script.check_key_count(keys)
        sent = [("EVALSHA", script.sha1, len(k), *k, *a) for k, a in calls]
        replies: list[Any] = await self._explained(
            self._run_many, sent, script, calls, script=script.name
        )
        return replies

    async def _run_many(self, script: Script, calls: Sequence[ScriptCall]) -> list[Any]:
        # Runs on the asyncio loop.
        return await run_pipelined(
            script, calls, self._pipelined, self._x.NoScriptError, wait=self._wait
        )

    async def _pipelined(self, commands: Sequence[Sequence[Arg]]) -> list[Any]:
        # Runs on the asyncio loop. A refused command gives its exception, with Redis's
        # message only, as its reply (raise_on_error=True would copy every argument of the
        # refused command into the message: payloads and tokens in the logs).
        async with self._client.pipeline(transaction=False) as pipe:
            for args in commands:
                pipe.execute_command(*args)
            replies: list[Any] = await pipe.execute(raise_on_error=False)
            return replies


class _Refused(Exception):
    """Carries a finished :class:`StoreError` out of the asyncio loop untranslated."""

    def __init__(self, error: StoreError) -> None:
        super().__init__(str(error))
        self.error = error


def _message(exc: BaseException) -> str:
    # redis-py strips a known error code from the message ("LOADING ...", "NOSCRIPT ...")
    # and keeps it as ``status_code`` (redis >= 6); put it back so the line says what
    # Redis said.
    text = str(exc) or type(exc).__name__
    code = getattr(exc, "status_code", None)
    if isinstance(code, str) and code and not text.startswith(code):
        return f"{code} {text}"
    return text


@asynccontextmanager
async def open_redispy_store(
    url: str,
    *,
    timeout: float,
    shown: str | None = None,
    wait: ReplicaWait = NO_WAIT,
) -> AsyncIterator[RedispyStore]:
    """Open a redis-py store on ``url``, inside a trio-asyncio loop of its own.

    A Redis that is down at start-up is not an error here: the first command reports it.

    Args:
        url: a Redis URL, already checked by :func:`claimkit.store.check_url`.
        shown: the URL as the user gave it (``url`` with claimkit's TLS defaults added
            is what connects), for :attr:`RedispyStore.url`.
        timeout: seconds allowed for connecting and for each reply (a blocking command's
            own timeout must stay under it). No retries: a failed call raises at once.

    Raises:
        ConfigError: the extra is not installed, or Python is 3.14+ (see :func:`load_backend`),
            before anything connects.

    Cancellation: on exit the client's connections are closed under a shield, within
    5 seconds, then the loop is shut down.
    """
    modules = load_backend()
    async with modules.trio_asyncio.open_loop() as loop:

        async def make_client() -> Any:
            # Built on the asyncio loop, where redis-py expects to be.
            client = modules.redis_asyncio.Redis.from_url(
                url,
                decode_responses=False,
                protocol=3,
                socket_timeout=timeout,
                socket_connect_timeout=timeout,
                retry=modules.retry.Retry(modules.backoff.NoBackoff(), 0),
                retry_on_timeout=False,
            )
            # Raw replies, as coredis gives them: no per-command parsing into Python types.
            client.response_callbacks = {}
            return client

        client = await modules.trio_asyncio.aio_as_trio(make_client, loop=loop)()
        try:
            yield RedispyStore(client, loop, modules, shown or url, wait)
        finally:
            # A connection that broke already may fail to close: nothing is left to free.
            with (
                trio.move_on_after(_CLOSE_TIMEOUT, shield=True),
                contextlib.suppress(OSError, modules.exceptions.RedisError),
            ):
                await modules.trio_asyncio.aio_as_trio(client.aclose, loop=loop)()
