"""What every command shares: the config options (docs/configuration.md) and one-line errors.

Commands parse their options, then call :func:`run` with an async function. Operator
mistakes (bad config, unknown queue, Redis unreachable, wrong key type) end as one line on
stderr and exit status 1, never a traceback. Passwords in Redis URLs are never printed.
"""

from __future__ import annotations

import enum
import inspect
import json
import sys
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar, cast

import trio
import typer

from claimkit.config import Config, ConfigError, has_password, load_config
from claimkit.producer import SubmitError
from claimkit.store import (
    CLIENT_CERT_HINT,
    StoreError,
    StorePermissionError,
    StoreTlsError,
    StoreUnavailable,
    redact_url,
)
from claimkit.store.server_checks import ClusterUnsupported, NotACluster, SentinelMismatch

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

T = TypeVar("T")

TransportConfig = Annotated[
    str | None,
    typer.Option(
        "--transport-config",
        metavar="JSON",
        help="The transport JSON inline (docs/configuration.md).",
        show_default=False,
    ),
]
TransportConfigFile = Annotated[
    str | None,
    typer.Option(
        "--transport-config-file",
        metavar="FILE",
        help="A file holding the transport JSON.",
        show_default=False,
    ),
]
RedisUrl = Annotated[
    str | None,
    typer.Option(
        "--redis-url",
        metavar="URL",
        help="Redis URL when the JSON has no `url` (else $REDIS_URL or $REDIS_URL_FILE). "
        "A password here shows in ps: use $REDIS_PASSWORD_FILE (docs/security.md).",
        show_default=False,
    ),
]
QueueName = Annotated[str, typer.Option("--queue", "-q", help="The queue (pending ZSET) name.")]
Queue = Annotated[
    str,
    typer.Option("--queue", "-q", help="The queue (pending ZSET) name.", show_default=False),
]
"""``--queue`` of the operator commands: required, so no default is shown."""
JsonOut = Annotated[bool, typer.Option("--json", help="Print JSON for scripts instead of text.")]


EXIT_OK = 0
"""Done as asked (also when there was nothing to do: an empty list, no expired claim)."""
EXIT_FAILED = 1
"""Not done, or not all of it: Redis unreachable or refusing, a key of the wrong type, the
configuration refused, a named request not found, a member refused (docs/cli.md)."""
EXIT_USAGE = 2
"""The command line is wrong: typer's own parse errors and the checks of option values and
combinations made before any configuration or Redis is read. Nothing was done."""
EXIT_INTERRUPTED = 130
"""Ctrl-C (SIGINT) stopped a command that changes state; finished batches stay done."""


def fail(message: str, code: int = EXIT_FAILED) -> NoReturn:
    """Print ``claimkit: <message>`` on stderr and exit with ``code``."""
    sys.stderr.write(f"claimkit: {redact_url(message)}\n")
    sys.stderr.flush()
    raise typer.Exit(code)


def usage_error(message: str) -> NoReturn:
    """:func:`fail` with :data:`EXIT_USAGE`: the command line itself is wrong."""
    fail(message, EXIT_USAGE)


def config_from(
    transport_config: str | None,
    transport_config_file: str | None,
    redis_url: str | None,
    *,
    require_queues: bool = True,
    **flags: Any,
) -> Config:
    """Load the config or exit with one line."""
    if transport_config is not None and transport_config_file is not None:
        usage_error("--transport-config and --transport-config-file are mutually exclusive")
    try:
        config = load_config(
            inline=transport_config,
            path=transport_config_file,
            flags={"url": redis_url, **flags},
            require_queues=require_queues,
        )
    except ConfigError as exc:
        fail(str(exc))
    for name in config.unknown_fields:
        # llm-d's JSON may carry fields for other transports: say so, but go on.
        sys.stderr.write(f"claimkit: warning: unknown config field {name!r} is ignored\n")
    for flag in _secrets_in_argv(transport_config, redis_url):
        sys.stderr.write(
            f"claimkit: warning: {flag} holds a Redis password, which every user of this "
            "machine can read (ps, /proc); pass the URL in $REDIS_URL or a file "
            "($REDIS_URL_FILE, url_file) or the password in $REDIS_PASSWORD_FILE instead "
            "(docs/security.md)\n"
        )
    return config


def _secrets_in_argv(transport_config: str | None, redis_url: str | None) -> list[str]:
    """The command-line options that carry a Redis password."""
    found = []
    if transport_config is not None:
        try:
            url = json.loads(transport_config).get("url")
        except (ValueError, AttributeError):
            url = None
        if isinstance(url, str) and has_password(url):
            found.append("--transport-config")
    if redis_url is not None and has_password(redis_url):
        found.append("--redis-url")
    return found


_OPERATOR_ERRORS = (StoreUnavailable, StoreError, ConfigError, SubmitError)


def _operator_error(exc: BaseException) -> BaseException | None:
    """The first operator-facing error in ``exc``, looking inside exception groups."""
    if isinstance(exc, _OPERATOR_ERRORS):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _operator_error(inner)
            if found is not None:
                return found
    return None


class Interrupt(enum.Enum):
    """What Ctrl-C (``KeyboardInterrupt``, also inside an exception group) means to :func:`run`."""

    RAISE = "raise"
    """Not handled here: it propagates to click (``Aborted!``, exit status 1). ``serve``
    handles SIGINT itself (a drain); ``submit`` writes in one atomic script call."""
    STOP = "stop"
    """The normal way to stop (``--watch``, ``--follow``): the command ends quietly, 0."""
    FAIL = "fail"
    """The command stops undone: one line and :data:`EXIT_INTERRUPTED`. Every change is
    made by atomic scripts in batches, so the batches finished stay done and the rest
    untouched; running it again finishes."""


_INTERRUPTED = "interrupted; batches already done stay done, run it again to finish"


def run(
    fn: Callable[[], Awaitable[T]], *, url: str, interrupt: Interrupt = Interrupt.RAISE
) -> T | None:
    """``trio.run(fn)``, turning Redis and input errors into one line and exit status 1,
    and Ctrl-C as ``interrupt`` says. Returns ``fn``'s result; ``None`` only when
    ``interrupt`` is :attr:`Interrupt.STOP` and Ctrl-C stopped it.

    Raises:
        typer.Exit: after the one line, with :data:`EXIT_FAILED` or :data:`EXIT_INTERRUPTED`.
    """
    try:
        return _run_reporting_errors(fn, url=url)
    except KeyboardInterrupt:
        if interrupt is Interrupt.RAISE:
            raise
    except BaseExceptionGroup as group:
        _, rest = group.split(KeyboardInterrupt)
        if rest is not None or interrupt is Interrupt.RAISE:
            raise
    if interrupt is Interrupt.FAIL:
        fail(_INTERRUPTED, EXIT_INTERRUPTED)
    return None


def run_to_end(
    fn: Callable[[], Awaitable[T]], *, url: str, interrupt: Interrupt = Interrupt.RAISE
) -> T:
    """:func:`run` for a command whose result is always there (``interrupt`` is not
    :attr:`Interrupt.STOP`)."""
    assert interrupt is not Interrupt.STOP
    return cast("T", run(fn, url=url, interrupt=interrupt))


def _run_reporting_errors(fn: Callable[[], Awaitable[T]], *, url: str) -> T:
    """``trio.run(fn)``, turning Redis and input errors into one line and exit status 1."""
    try:
        return trio.run(fn)
    except Exception as exc:
        found = _operator_error(exc)
        if found is None:
            raise
        fail(_operator_message(found, url))


def _operator_message(found: BaseException, url: str) -> str:
    """The one line that says what an operator-facing error means."""
    if isinstance(found, StoreUnavailable):
        hint = ""
        if url.startswith("rediss://") and "ssl_certfile=" not in url:
            hint = f" ({CLIENT_CERT_HINT})"
        return f"Redis at {redact_url(url)} is unavailable: {found}{hint}"
    if isinstance(found, StoreTlsError):
        return f"Redis at {redact_url(url)}: {found} (docs/security.md)"
    if isinstance(found, StorePermissionError):
        return f"Redis at {redact_url(url)} refused a command under its ACL: {found}"
    if isinstance(found, ClusterUnsupported | NotACluster | SentinelMismatch):
        return str(found)  # one line that names the URL already
    if isinstance(found, StoreError):
        return f"Redis at {redact_url(url)} {_auth_hint(str(found))}: {found}"
    return str(found)


def _auth_hint(message: str) -> str:
    """What a Redis error means for the operator, when it is about the password."""
    if "NOAUTH" in message or "must be called with the client already authenticated" in message:
        return "needs a password (the URL has none)"
    if "WRONGPASS" in message or "invalid username-password pair" in message:
        return "refused the URL's user name or password"
    return "answered with an error"


def _verbatim_blocks(text: str) -> str:
    """``text`` with each paragraph that holds an indented line (an example) marked with
    click's ``\\b``, so it is printed as written while prose paragraphs flow."""
    paragraphs = inspect.cleandoc(text).split("\n\n")
    marked = [
        f"\b\n{p}" if any(line.startswith("    ") for line in p.splitlines()) else p
        for p in paragraphs
    ]
    return "\n\n".join(marked)


def flow_help(app: typer.Typer) -> None:
    """Prepare the help of every command of ``app`` and of its sub-apps: docstrings are
    wrapped at 88-100 columns in the source, and click re-flows their prose paragraphs to
    the terminal; an example (an indented block) is kept verbatim, so it can be pasted.
    Call once, after every command is registered."""
    for info in app.registered_commands:
        doc = info.help or (info.callback.__doc__ if info.callback else None)
        if doc:
            info.help = _verbatim_blocks(doc)
        if info.cls in (None, typer.core.TyperCommand):
            info.cls = _NamedMetavars
    for group in app.registered_groups:
        if group.typer_instance is not None:
            flow_help(group.typer_instance)


# What an option's value is, by its long name; typer would show its type (``<float>``).
_METAVARS = {
    "SECONDS": (
        "--claim-lease-ttl", "--request-timeout", "--drain-timeout", "--http-idle-timeout",
        "--result-dedup-ttl", "--older-than", "--interval", "--latency",
    ),
    "MS": ("--claim-reclaim-interval",),
    "PORT": ("--port", "--metrics-port", "--health-port"),
    "ADDRESS": ("--http-host", "--host"),
    "N": (
        "--limit", "--requests", "--concurrency", "--batch-size", "--http-max-connections",
        "--seed", "--count",
    ),
    "NAME": ("--queue",),
    "FILE": ("--file",),
    "BACKEND": ("--store",),
    "LEVEL": ("--log-level",),
    "FRACTION": ("--rate-hang", "--rate-429", "--rate-5xx"),
    "SECONDS|DATE": ("--retry-after",),
}  # fmt: skip
_METAVAR_OF = {name: metavar for metavar, names in _METAVARS.items() for name in names}


class _NamedMetavars(typer.core.TyperCommand):
    """A command whose options show what their value is (:data:`_METAVARS`, else
    ``VALUE``) instead of typer's ``<float>``; flags keep none."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            if param.param_type_name != "option" or getattr(param, "is_flag", True):
                continue
            if param.metavar is None:
                long = next((o for o in param.opts if o.startswith("--")), "")
                param.metavar = _METAVAR_OF.get(long, "VALUE")
