"""The store: claimkit's one door to Redis (scripts, commands, pipelines).

Everything claimkit does to Redis goes through :class:`Store`. Its default implementation
runs coredis natively on trio (through anyio); an optional second one uses redis-py's
asyncio client through trio-asyncio (``claimkit[redispy]``, Python <= 3.13; see
``docs/store-backends.md`` for why coredis is the default).

Replies are raw RESP3 values: ``bytes``, ``int``, ``None``, lists, and where RESP3 says so
``float`` (``ZSCORE``, ``WITHSCORES``) and ``dict`` (``HGETALL``). Errors are two
kinds only, so callers can decide without knowing the client library:

- :class:`StoreUnavailable`: Redis could not be reached, the connection broke, or Redis is
  loading its data set. Worth retrying with backoff; no reply was had.
- :class:`StoreError`: Redis answered with an error (``WRONGTYPE``, a script error, an
  authentication failure). Retrying will not help.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias
from urllib.parse import parse_qs, urlsplit

if TYPE_CHECKING:
    from ._scripts import Script

__all__ = [
    "Arg",
    "ScriptCall",
    "Store",
    "StoreError",
    "StoreUnavailable",
    "open_store",
    "redact_url",
]

Arg: TypeAlias = bytes | str | int | float


ScriptCall: TypeAlias = tuple[Sequence[str], Sequence[Arg]]
"""One call of a script: ``(keys, args)``."""


class StoreUnavailable(ConnectionError):
    """Redis is unreachable, the connection broke, or Redis is still loading. Retry later."""


class StoreError(RuntimeError):
    """Redis answered with an error; retrying the same call will not help."""


class Store(Protocol):
    """A connection pool to one Redis, as claimkit needs it.

    Every method may raise :class:`StoreUnavailable` or :class:`StoreError`.

    Cancellation: a call cancelled mid-flight may or may not have reached Redis. Scripts are
    written so that running one again, or not at all, loses nothing (SPEC §3).
    """

    url: str
    """The Redis URL with any password replaced by ``***``: safe to print."""

    async def command(self, *args: Arg) -> Any:
        """Run one command, e.g. ``await store.command("ZCARD", "q")``; the raw reply."""
        ...

    async def pipeline(self, commands: Sequence[Sequence[Arg]], *, transaction: bool) -> list[Any]:
        """Send several commands in one round trip; ``transaction=True`` wraps them in
        MULTI/EXEC. Returns one raw reply per command, in order."""
        ...

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[Arg]) -> Any:
        """Run a Lua script by EVALSHA, loading it on NOSCRIPT. ``len(keys)`` must equal
        ``script.numkeys`` (``ValueError`` otherwise)."""
        ...

    async def run_many(self, script: Script, calls: Sequence[ScriptCall]) -> list[Any]:
        """Run ``script`` once per ``(keys, args)`` call, all in one round trip.

        The calls go as one pipeline of EVALSHA, not a transaction: each call is atomic on
        its own and other clients' commands may run between two calls, so a long batch split
        into calls never holds Redis for longer than its slowest call. Calls refused with
        NOSCRIPT are sent again by EVAL (a second round trip, which also loads the script).

        Returns one raw reply per call, in order.

        Raises:
            ValueError: a call's ``len(keys)`` is not ``script.numkeys`` (nothing is sent).
            StoreError: Redis refused a call for another reason; the other calls ran.
            StoreUnavailable: as for :meth:`command`; any of the calls may have run.
        """
        ...


# In a message, outside quotes: scheme://user:password@ where the password runs to the
# last '@' before a space, a quote or a '/' (so "redis://host:6379/0 ... user@x" keeps its
# port and its text). A URL in quotes (``{url!r}``) is masked as a whole URL.
_PASSWORD = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://[^:/@\s'\"]*:)([^\s'\"/]*)(@)")
_QUOTED_URL = re.compile(r"""(['"])([a-zA-Z][a-zA-Z0-9+.-]*://[^\n]*?)\1""")
# ?password=... (or &password=...), which redis URLs accept as well.
_QUERY_PASSWORD = re.compile(r"([?&](?:password|pass|pwd)=)([^&#\s'\"]*)", re.IGNORECASE)
_WHOLE_QUERY_PASSWORD = re.compile(r"([?&](?:password|pass|pwd)=)([^&#]*)", re.IGNORECASE)
_SCHEME = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://")


def redact_url(text: str) -> str:
    """Mask every password of a Redis URL in ``text``: ``redis://user:secret@host`` ->
    ``redis://user:***@host`` and ``?password=secret`` -> ``?password=***``.

    ``text`` is either one URL (it starts with ``scheme://``; then a password may hold any
    character, spaces included) or a message with URLs in it. In a message a quoted URL is
    masked as a whole URL; elsewhere a password ends at the last ``@`` before a space, a
    quote or a ``/``. claimkit quotes the URLs it puts in messages, or masks them first.
    """
    if _SCHEME.match(text) and "\n" not in text:
        return _redact_whole(text)
    text = _QUOTED_URL.sub(lambda m: m.group(1) + _redact_whole(m.group(2)) + m.group(1), text)
    return _QUERY_PASSWORD.sub(r"\1***", _PASSWORD.sub(r"\1***\3", text))


def _redact_whole(url: str) -> str:
    return _WHOLE_QUERY_PASSWORD.sub(r"\1***", _mask_userinfo(url))


def _mask_userinfo(url: str) -> str:
    scheme, _, rest = url.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.partition(":")[0]
    return f"{scheme}://{user}:***@{host}"


def check_url(url: str) -> None:
    """Raise ``ValueError`` with one line when ``url`` is not a usable Redis URL."""
    parts = urlsplit(url)
    shown = redact_url(url)
    if parts.scheme not in {"redis", "rediss", "unix"}:
        raise ValueError(f"Redis URL must start with redis://, rediss:// or unix://, got {shown!r}")
    if parts.scheme == "unix":
        return
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        raise ValueError(f"Redis URL has a bad port: {shown!r}") from None
    if not host:
        raise ValueError(f"Redis URL has no host: {shown!r}")
    if port == 0:
        raise ValueError(f"Redis URL has a bad port: {shown!r}")
    db = parts.path.strip("/")
    if db and not db.isdigit():
        raise ValueError(f"Redis URL database must be a number, got {db!r} in {shown!r}")
    for name, values in parse_qs(parts.query).items():
        parse = _NUMERIC_QUERY.get(name.lower())
        for value in values if parse is not None else ():
            try:
                parse(value)  # type: ignore[misc]
            except ValueError:
                raise ValueError(
                    f"Redis URL parameter {name} must be a number, got {value!r} in {shown!r}"
                ) from None


# Query parameters the Redis clients read as numbers (coredis and redis-py): a bad one would
# otherwise fail inside the client with a bare "invalid literal for int()".
_NUMERIC_QUERY: dict[str, type[int] | type[float]] = {
    "db": int,
    "max_connections": int,
    "timeout": int,
    "max_idle_time": int,
    "health_check_interval": int,
    "stream_timeout": float,
    "connect_timeout": float,
    "socket_timeout": float,
    "socket_connect_timeout": float,
}


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
    if len(keys) != script.numkeys:
        raise ValueError(f"{script.name} takes {script.numkeys} keys, got {len(keys)}")


@asynccontextmanager
async def open_store(
    url: str, *, backend: str = "coredis", timeout: float = 10.0
) -> AsyncIterator[Store]:
    """Open a store on ``url`` for the duration of the ``async with`` block.

    Args:
        url: ``redis://[user:password@]host:port/db`` (or ``rediss://``, ``unix://``).
        backend: ``"coredis"`` (default) or ``"redispy"`` (the optional extra).
        timeout: seconds allowed for connecting and for each reply; a hung Redis then
            surfaces as :class:`StoreUnavailable` instead of a stuck task.

    The store refuses a Redis Cluster node: its first call checks ``INFO`` first and
    raises :class:`~claimkit._server_checks.ClusterUnsupported` (one line) before anything
    is sent (docs/operations.md, "Redis Cluster").

    Raises:
        ValueError: a malformed URL or an unknown backend, before anything connects.
    """
    from ._server_checks import StandaloneOnly

    check_url(url)
    if backend == "coredis":
        from ._store_coredis import open_coredis_store

        # coredis runs its pool in a task group, which wraps anything raised in the block
        # in an ExceptionGroup. That group is an implementation detail: unwrap a lone error.
        try:
            async with open_coredis_store(url, timeout=timeout) as store:
                yield StandaloneOnly(store)
        except BaseExceptionGroup as group:
            if len(group.exceptions) == 1 and not isinstance(
                group.exceptions[0], BaseExceptionGroup
            ):
                raise group.exceptions[0] from None
            raise
    elif backend == "redispy":
        from ._store_redispy import open_redispy_store

        async with open_redispy_store(url, timeout=timeout) as redispy_store:
            yield StandaloneOnly(redispy_store)
    else:
        raise ValueError(f"unknown store backend {backend!r}: use 'coredis' or 'redispy'")
