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

import logging
import os
import re
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias
from urllib.parse import parse_qs, unquote, urlsplit

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
    if parts.scheme == "rediss":
        problem = tls_file_problem(url)
        if problem is not None:
            raise ValueError(problem)


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


# -- TLS -------------------------------------------------------------------------------

# OpenSSL's verify codes (X509_V_ERR_*) for a server certificate the client refused.
_UNTRUSTED = {2, 18, 19, 20, 21, 27}
_CA_HINT = "pass the CA that signed it with ?ssl_ca_certs=<ca.pem>"
_CLIENT_CERT_HINT = "pass one with ?ssl_certfile=<cert.pem>&ssl_keyfile=<key.pem>"
# OpenSSL's reasons for a handshake the server ended with an alert.
_CERT_REQUIRED = f"the server requires a client certificate: {_CLIENT_CERT_HINT}"
_ALERTS = {
    "TLSV13_ALERT_CERTIFICATE_REQUIRED": _CERT_REQUIRED,
    "PEER_DID_NOT_RETURN_A_CERTIFICATE": _CERT_REQUIRED,
    "SSLV3_ALERT_BAD_CERTIFICATE": "the server refused this client's certificate (bad certificate)",
    "TLSV1_ALERT_UNKNOWN_CA": "the server does not trust the CA of this client's certificate",
    "SSLV3_ALERT_CERTIFICATE_EXPIRED": "the server refused this client's certificate: expired",
    "WRONG_VERSION_NUMBER": "the server does not speak TLS on this port (plain: use redis://)",
}
CLIENT_CERT_HINT = (
    "a rediss:// server that requires client certificates (tls-auth-clients yes) drops a "
    f"client without one like this: {_CLIENT_CERT_HINT}"
)
"""Said with a lost connection to a ``rediss://`` URL that names no client certificate:
under TLS 1.3 the server's alert may be lost in the reset that follows it."""
_log = logging.getLogger("claimkit")
_WARNED: set[str] = set()


def tls_settings(url: str) -> str:
    """``url`` with claimkit's TLS defaults made explicit, warning once per URL (one
    ``WARNING`` log line) when it turns verification off.

    For ``rediss://`` both clients then verify the server's certificate and host name:
    ``ssl_cert_reqs=required`` and ``ssl_check_hostname=true`` unless the URL says
    otherwise (coredis's own defaults verify neither the host name nor a missing
    certificate). Other URLs are returned as they are.
    """
    parts = urlsplit(url)
    if parts.scheme != "rediss":
        return url
    query = {k.lower(): v[-1].lower() for k, v in parse_qs(parts.query).items()}
    reqs = query.get("ssl_cert_reqs")
    off = []
    if reqs in ("none", "cert_none", "optional", "cert_optional"):
        off.append(f"ssl_cert_reqs={reqs} turns certificate verification off")
    if query.get("ssl_check_hostname") in ("false", "0", "no", "n", "off"):
        off.append("ssl_check_hostname=false turns the host-name check off")
    if off and url not in _WARNED:
        _WARNED.add(url)
        _log.warning(
            "claimkit: warning: %s for %s: anyone on the network path can pose as this "
            "Redis; pass the server's CA with ?ssl_ca_certs=<ca.pem> instead (docs/security.md)",
            " and ".join(off),
            redact_url(url),
        )
    extra = []
    if reqs is None:
        extra.append("ssl_cert_reqs=required")
        reqs = "required"
    if "ssl_check_hostname" not in query and reqs in ("required", "cert_required"):
        extra.append("ssl_check_hostname=true")
    if not extra:
        return url
    joined = "&".join(extra)
    return parts._replace(query=f"{parts.query}&{joined}" if parts.query else joined).geturl()


def _tls_files(url: str) -> dict[str, str]:
    """The TLS file parameters of ``url`` (lower-case name -> path), the last of each."""
    query = {k.lower(): v[-1] for k, v in parse_qs(urlsplit(url).query).items()}
    return {name: query[name] for name in _TLS_FILES if query.get(name)}


_TLS_FILES = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")


def _unreadable(name: str, path: str) -> str | None:
    """Why the file parameter ``name`` cannot be read, or ``None`` when it can."""
    try:
        if os.path.isdir(path):
            if name != "ssl_ca_certs":
                return f"{name} {path} is a directory, not a file"
            os.listdir(path)
        else:
            with open(path, "rb"):
                pass
    except FileNotFoundError:
        return f"{name} {path}: no such file"
    except PermissionError:
        return f"{name} {path} cannot be read: permission denied"
    except OSError as exc:
        return f"{name} {path} cannot be read: {exc.strerror or exc}"
    return None


def _holds_key(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return b"PRIVATE KEY-----" in f.read()
    except OSError:
        return False


def _no_certificate(name: str, path: str) -> str:
    hint = " (is it the key?)" if _holds_key(path) else ""
    return f"{name} {path} holds no certificate{hint}"


def tls_file_problem(url: str) -> str | None:
    """One line naming what is wrong with a TLS file the ``rediss://`` ``url`` names, or
    ``None`` when every one loads.

    Each of ``ssl_ca_certs`` (a PEM file or a directory of them), ``ssl_certfile`` and
    ``ssl_keyfile`` must exist and be readable, and an :class:`ssl.SSLContext` must accept
    them: the CA as verify locations, the client certificate and its key as one chain.
    Only files are read: nothing connects.
    """
    files = _tls_files(url)
    for name, path in files.items():
        problem = _unreadable(name, path)
        if problem is not None:
            return problem
    ca = files.get("ssl_ca_certs")
    if ca is not None:
        try:
            where = "capath" if os.path.isdir(ca) else "cafile"
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(**{where: ca})
        except (ssl.SSLError, OSError):
            return _no_certificate("ssl_ca_certs", ca)
    cert, key = files.get("ssl_certfile"), files.get("ssl_keyfile")
    if cert is None:
        if key is not None:
            return f"ssl_keyfile {key} needs its certificate: pass ssl_certfile"
        return None
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=cert)
    except (ssl.SSLError, OSError):
        return _no_certificate("ssl_certfile", cert)
    try:
        # A callable password: an encrypted key fails here instead of prompting on a tty.
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(cert, key, password=lambda: b"")
    except (ssl.SSLError, OSError):
        if key is None:
            return f"ssl_certfile {cert} holds no private key: pass ssl_keyfile"
        return f"ssl_certfile {cert} and ssl_keyfile {key} do not form a certificate and its key"
    if key is None:
        # coredis sends no certificate without ssl_keyfile, even from a file holding both.
        return f"ssl_certfile {cert} needs ssl_keyfile too: pass ssl_keyfile={cert}"
    return None


def tls_file_error(url: str) -> StoreTlsError | None:
    """A :class:`StoreTlsError` naming a TLS file of ``url`` that fails to load now, or
    ``None`` when every one loads (or ``url`` names none).

    For a failed connection: the clients load the files when they build their TLS context,
    and a file may have changed since :func:`check_url`. A bad file does not always show as
    a TLS error (coredis skips an ``ssl_certfile`` without ``ssl_keyfile``, and under TLS 1.3
    the server's alert may be lost in the reset after it), so the files are read again on
    any connection error of a ``rediss://`` URL that names one.
    """
    if urlsplit(url).scheme != "rediss" or not _tls_files(url):
        return None
    problem = tls_file_problem(url)
    return None if problem is None else StoreTlsError(problem)


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and everything it was raised from, inside exception groups too."""
    todo: list[BaseException | None] = [exc]
    seen: set[int] = set()
    while todo:
        current = todo.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        todo += [current.__cause__, current.__context__]
        if isinstance(current, BaseExceptionGroup):
            todo += list(current.exceptions)


def tls_problem(exc: BaseException) -> str | None:
    """One line naming the certificate (or TLS) problem behind a failed connection, or
    ``None`` when ``exc`` was not caused by one."""
    for cause in _causes(exc):
        if isinstance(cause, ssl.SSLCertVerificationError):
            code, text = cause.verify_code, cause.verify_message
            if code in _UNTRUSTED:
                return (
                    "TLS certificate problem: the server's certificate is not signed by a CA "
                    f"this client trusts ({text}): {_CA_HINT}"
                )
            if code == 62 or "Hostname mismatch" in str(text) or "IP address mismatch" in str(text):
                return (
                    "TLS certificate problem: the server's certificate is not valid for the "
                    f"URL's host ({text}): connect by a name the certificate holds"
                )
            if code == 10:
                return f"TLS certificate problem: the server's certificate has expired ({text})"
            if code == 9:
                return (
                    f"TLS certificate problem: the server's certificate is not yet valid ({text})"
                )
            return f"TLS certificate problem: the server's certificate was refused ({text})"
        if isinstance(cause, ssl.SSLError):
            reason = str(cause.reason or "")
            explained = _ALERTS.get(reason)
            if explained is not None:
                return f"TLS problem: {explained} ({reason})"
            return f"TLS handshake failed: {cause}"
    return None


# -- ACL refusals ------------------------------------------------------------------------

# Redis 7.0 says "NOPERM this user has no permissions to run the 'x' command" / "... to
# access one of the keys used as arguments"; 7.2+ "NOPERM User u has no permissions to run
# the 'x' command" / "NOPERM No permissions to access a key". Inside a script 7.0 says
# "ERR The user executing the script can't run this command ..." and 7.2+ "ERR ACL failure
# in script: ...".
_ACL_MARKS = (
    "NOPERM",
    "The user executing the script can't",
    "ACL failure in script",
)
_REFUSED_COMMAND = re.compile(r"permissions to run the '([^']+)' command")
_IN_SCRIPT = ("The user executing the script can't", "ACL failure in script")
_SCRIPT_COMMAND = ("can't run this command", "permissions to run")
_SCRIPT_LINE = re.compile(r"@user_script:(\d+)")
_NO_KEYS = frozenset(
    {"TIME", "MULTI", "EXEC", "DISCARD", "PING", "INFO", "ACL", "SCRIPT", "CLIENT", "CONFIG"}
)
_ALL_KEYS = frozenset({"DEL", "UNLINK", "EXISTS", "MGET", "TOUCH", "WATCH"})
_TWO_KEYS = frozenset({"BLMOVE", "LMOVE", "RPOPLPUSH", "BRPOPLPUSH", "SMOVE", "RENAME"})
ACL_LOG_ENTRIES = 32
"""How many of Redis's newest ``ACL LOG`` entries a refusal is looked up in."""


def is_acl_refusal(message: str) -> bool:
    """Whether a Redis error text is an ACL refusal (a command, a key or a channel)."""
    return any(mark in message for mark in _ACL_MARKS)


def command_keys(args: Sequence[Arg]) -> list[str]:
    """The key arguments of a command claimkit sends (``EVALSHA sha 2 k1 k2 ...`` ->
    ``[k1, k2]``; ``ZADD q ...`` -> ``[q]``; ``TIME`` -> ``[]``)."""
    if not args:
        return []
    name = str(args[0]).upper()
    rest = [a.decode(errors="replace") if isinstance(a, bytes) else str(a) for a in args[1:]]
    if name in ("EVAL", "EVALSHA", "EVAL_RO", "EVALSHA_RO"):
        try:
            return rest[2 : 2 + int(rest[1])]
        except (IndexError, ValueError):
            return []
    if name in _NO_KEYS:
        return []
    if name in _ALL_KEYS:
        return rest
    if name in _TWO_KEYS:
        return rest[:2]
    return rest[:1]


def acl_user(url: str) -> str:
    """The ACL user a Redis URL authenticates as (``"default"`` when it names none)."""
    try:
        return unquote(urlsplit(url).username or "") or "default"
    except ValueError:
        return "default"


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _entries(reply: Any) -> list[dict[str, str]]:
    """``ACL LOG`` entries as ``{field: text}`` (RESP3 maps or RESP2 flat lists)."""
    out: list[dict[str, str]] = []
    for entry in reply if isinstance(reply, list) else ():
        if isinstance(entry, dict):
            pairs = list(entry.items())
        elif isinstance(entry, list):
            pairs = list(zip(entry[::2], entry[1::2], strict=False))
        else:
            continue
        out.append({_text(k): _text(v) for k, v in pairs})
    return out


async def permission_error(
    message: str,
    commands: Sequence[Sequence[Arg]],
    *,
    user: str,
    acl_log: Callable[[], Awaitable[Any]],
    written: bool = True,
    script_name: str | None = None,
) -> StorePermissionError:
    """Turn Redis's ACL refusal ``message`` of one of ``commands`` into one precise line.

    A refused command is named by Redis itself. A refused key is not: it is looked up in
    ``ACL LOG`` (``acl_log`` runs ``ACL LOG <n>``): the newest entry of ``user`` whose key
    is one of the keys ``commands`` sent. When that lookup is refused too (a narrow user
    seldom may run ``ACL LOG``) the line names the command and the keys it sent.

    Args:
        message: Redis's error text.
        commands: what was sent (each ``(name, *args)``); the refused one first, when known.
        user: the connection's ACL user.
        acl_log: runs ``ACL LOG``; any error it raises is taken as "cannot look it up".
        written: whether the call may have written anything.
        script_name: the claimkit script the commands ran, for the line.
    """
    first = str(commands[0][0]).upper() if commands else "?"
    in_script = any(mark in message for mark in _IN_SCRIPT)
    where = _script_place(message, script_name) if in_script else ""
    command, key = first, None
    refused = _REFUSED_COMMAND.search(message)
    keys = list(dict.fromkeys(k for c in commands for k in command_keys(c)))
    if refused is not None:
        command = refused.group(1).upper()
        via = f" (sent as {first}{where})" if command != first else where
        line = f"user {user!r} may not run {command}{via}: grant +{refused.group(1).lower()}"
    else:
        entry = await _log_entry(acl_log, user, keys, in_script)
        if entry is not None and entry.get("reason") == "command":
            command = entry.get("object", "?").upper()
            line = (
                f"user {user!r} may not run {command}{where or ' in a script'}: "
                f"grant +{command.lower()}"
            )
        elif in_script and any(mark in message for mark in _SCRIPT_COMMAND):
            line = (
                f"user {user!r} may not run a command{where or ' in a script'} (ACL LOG, "
                "which names it, is refused too): grant it"
            )
        elif entry is not None or len(keys) == 1:
            key = entry["object"] if entry is not None else keys[0]
            line = f"user {user!r} may not access key {key!r} with {first}{where}"
            line += ": grant a ~pattern matching it"
        else:
            shown = ", ".join(map(repr, keys)) or "none"
            line = (
                f"user {user!r} may not access one of the keys of {first}{where} ({shown}; "
                "ACL LOG, which names it, is refused too): grant ~patterns matching them"
            )
    line += f" (Redis: {message.strip()})"
    if not written:
        line += "; nothing was written"
    line += "; `claimkit acl` prints the rule claimkit needs (docs/security.md)"
    return StorePermissionError(line, user=user, command=command, key=key, written=written)


def _script_place(message: str, script_name: str | None) -> str:
    """`` in script 'claim' (line 54: redis.call(...))`` from a script error's line number."""
    if not script_name:
        return ""
    place = f" in script {script_name!r}"
    found = _SCRIPT_LINE.search(message)
    if found is None:
        return place
    from claimkit.store.scripts import script

    try:
        lines = script(script_name).source.splitlines()
        text = lines[int(found.group(1)) - 1].strip()
    except (KeyError, IndexError, ValueError):
        return place
    return f"{place} (line {found.group(1)}: {text})"


async def _log_entry(
    acl_log: Callable[[], Awaitable[Any]], user: str, keys: list[str], in_script: bool
) -> dict[str, str] | None:
    """The newest ``ACL LOG`` entry of ``user`` that names one of ``keys`` (or, for a
    refusal inside a script, a command refused there); ``None`` when there is none or the
    log cannot be read (a narrow user seldom may run ``ACL LOG``)."""
    try:
        log = _entries(await acl_log())
    except Exception:
        return None
    for entry in log:
        if entry.get("username") != user:
            continue
        if entry.get("reason") == "key" and entry.get("object") in keys:
            return entry
        if in_script and entry.get("reason") == "command" and entry.get("context") == "lua":
            return entry
    return None


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
    raises :class:`~claimkit.store.server_checks.ClusterUnsupported` (one line) before anything
    is sent (docs/operations.md, "Redis Cluster").

    Raises:
        ValueError: a malformed URL or an unknown backend, before anything connects.
    """
    from claimkit.store.server_checks import StandaloneOnly

    check_url(url)
    shown, url = url, tls_settings(url)
    if backend == "coredis":
        from claimkit.store.coredis_store import open_coredis_store

        # coredis runs its pool in a task group, which wraps anything raised in the block
        # in an ExceptionGroup. That group is an implementation detail: unwrap a lone error.
        try:
            async with open_coredis_store(url, timeout=timeout, shown=shown) as store:
                yield StandaloneOnly(store)
        except BaseExceptionGroup as group:
            if len(group.exceptions) == 1 and not isinstance(
                group.exceptions[0], BaseExceptionGroup
            ):
                raise group.exceptions[0] from None
            raise
    elif backend == "redispy":
        from claimkit.store.redispy_store import open_redispy_store

        async with open_redispy_store(url, timeout=timeout, shown=shown) as store:
            yield StandaloneOnly(store)
    else:
        raise ValueError(f"unknown store backend {backend!r}: use 'coredis' or 'redispy'")
