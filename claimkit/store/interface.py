"""The store's interface: the :class:`Store` protocol, its argument types and its errors.

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

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

if TYPE_CHECKING:
    from claimkit.store.scripts import Script

__all__ = [
    "Arg",
    "ScriptCall",
    "Store",
    "StoreError",
    "StorePermissionError",
    "StoreTlsError",
    "StoreUnavailable",
    "reply_text",
]

Arg: TypeAlias = bytes | str | int | float


ScriptCall: TypeAlias = tuple[Sequence[str], Sequence[Arg]]
"""One call of a script: ``(keys, args)``."""


def reply_text(value: Any) -> str:
    """A Redis reply (or argument) as text: bytes decoded as UTF-8, undecodable bytes as
    U+FFFD; anything else through ``str``. Never raises."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class StoreUnavailable(ConnectionError):
    """Redis is unreachable, the connection broke, or Redis is still loading. Retry later."""


class StoreError(RuntimeError):
    """Redis answered with an error; retrying the same call will not help."""


class StoreTlsError(StoreError):
    """The TLS handshake with Redis failed over a certificate (or TLS itself): retrying
    will not help. ``str(err)`` says which problem and what to pass (docs/security.md)."""


class StorePermissionError(StoreError):
    """Redis refused a command under the connection's ACL user (``NOPERM``).

    ``str(err)`` is one line naming the user, the command and, where Redis's ``ACL LOG``
    could be read (or the command has one key), the key; it ends with Redis's own text.

    Attributes:
        user: the ACL user of the connection (``"default"`` when the URL names none).
        command: the refused command, upper case (``"MULTI"``, ``"EVALSHA"``, ``"SET"``).
        key: the refused key when known, else ``None`` (a command refusal has none).
        written: whether the call may have written anything (``False`` for a refused
            transaction: claimkit sends ``MULTI`` alone first and stops when it is refused).
    """

    def __init__(
        self,
        message: str,
        *,
        user: str,
        command: str,
        key: str | None = None,
        written: bool = True,
    ) -> None:
        super().__init__(message)
        self.user = user
        self.command = command
        self.key = key
        self.written = written


class Store(Protocol):
    """A connection pool to one Redis, as claimkit needs it.

    Every method may raise :class:`StoreUnavailable` or :class:`StoreError`.

    Cancellation: a call cancelled mid-flight may or may not have reached Redis. Scripts are
    written so that running one again, or not at all, loses nothing
    (docs/protocol.md#claim-protocol).
    """

    url: str
    """The Redis URL with any password replaced by ``***``: safe to print."""

    mode: str
    """The topology the store talks to: ``"standalone"``, ``"cluster"`` or ``"sentinel"``
    (docs/topology.md). Callers choose the key layout by it (``"cluster"``: the
    cluster layout; the other two: the standalone names)."""

    async def command(self, *args: Arg) -> Any:
        """Run one command, e.g. ``await store.command("ZCARD", "q")``; the raw reply.

        An ACL refusal raises :class:`StorePermissionError` naming the user, the command
        and (from ``ACL LOG`` when the user may read it) the key; a failed TLS handshake
        raises :class:`StoreTlsError` naming the certificate problem."""
        ...

    async def pipeline(self, commands: Sequence[Sequence[Arg]], *, transaction: bool) -> list[Any]:
        """Send several commands in one round trip; ``transaction=True`` wraps them in
        MULTI/EXEC. Returns one raw reply per command, in order.

        A transaction costs two round trips on one connection: ``MULTI`` goes alone first,
        so that a refused ``MULTI`` (an ACL without ``+multi``) cannot make the commands run
        one by one outside it. A refused ``MULTI``, a command refused while queueing
        (``EXECABORT``) and a refused ``EXEC`` all run nothing: they raise
        :class:`StorePermissionError` (``written=False``) or :class:`StoreError` saying
        "nothing was written". A command that fails once ``EXEC`` ran (``WRONGTYPE``)
        raises too, and the others ran: Redis has no rollback.

        Raises:
            StorePermissionError: the ACL refused a command (named, with its key if known).
            StoreError, StoreUnavailable: as for :meth:`command`.
        """
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
