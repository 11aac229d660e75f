"""Dispatch: one HTTP attempt of a claimed request against the inference gateway.

claimkit retries a request by *parking* it in the retry set (docs/protocol.md#park-for-retry),
never by looping here, so :func:`dispatch` makes exactly one attempt and returns what should
happen next:

- :class:`Done` — a terminal record is ready; the caller acks it (docs/protocol.md#ack).
- :class:`Retry` — park the request for ``delay`` seconds (docs/protocol.md#park-for-retry).
- :class:`Unsent` — the gateway was not reached, nothing was sent: hand the claim back to
  pending (docs/dispatch.md#the-gateway-is-unreachable).

The rules, all from docs/dispatch.md:

- ``POST`` the request's body (``Envelope.body_bytes``: the payload fetched through its
  payload key as stored, else ``data.payload`` as JSON) to the gateway base URL joined with the
  request's ``endpoint`` or the queue's ``request_path_url``. Redirects are not followed
  (a ``POST`` must not turn into a ``GET``): a 3xx response is the record.
- Timeout per attempt: ``min(request_timeout, seconds to deadline)``. When that is not
  positive the request is not sent: the record is ``DEADLINE_EXCEEDED``.
- Not sent (DNS failure, connection refused, connect timeout, TLS handshake failure: no
  byte of the request can have reached the gateway) → :class:`Unsent`, no record.
- No response after sending (``request_timeout`` passed, the connection closed or reset,
  malformed HTTP) → ``INFERENCE_ERROR``, not retried; a request once written is never sent
  again (see :mod:`.http`). 429, 5xx, or a body that fails to read → retry. Anything else (other
  4xx, 2xx, 3xx) → a record with that status and the exact body text.
- An attempt cut short by the deadline (its timeout was the time to the deadline, not
  ``request_timeout``) is the deadline ending the request, not a gateway fault: the record
  is the last HTTP response the request had, else ``DEADLINE_EXCEEDED``.
- Backoff for attempt ``n = retry_count + 1``: see :func:`backoff_delay`. There is no attempt
  limit, the deadline ends it: when the backoff would leave less than
  :data:`DEADLINE_MARGIN` seconds before the deadline, past the deadline the last HTTP
  response becomes the record (``DEADLINE_EXCEEDED`` when there was none), so the request
  is finished now instead of being parked only to expire.
- "The last HTTP response" spans attempts: a parked request carries its last response
  (status and body, bounded) in its retry member (``Envelope.last_response``, see
  :data:`claimkit.protocol.models.LAST_RESPONSE_FIELD`), so after the deadline the record is the
  429 it kept getting, whichever process made the last attempt.
"""

from __future__ import annotations

import email.utils
import errno
import logging
import os
import random
import re
import resource
from dataclasses import dataclass
from datetime import UTC
from typing import TYPE_CHECKING, TypeAlias

import trio

from claimkit._errors import exception_chain
from claimkit.consumer import http as _http
from claimkit.protocol.models import ErrorCode, TerminalRecord, deadline_passed, deadline_record

if TYPE_CHECKING:
    from claimkit.protocol.models import Envelope

__all__ = [
    "DEADLINE_MARGIN",
    "DEFAULT_REQUEST_PATH",
    "FAIRNESS_HEADER",
    "OBJECTIVE_HEADER",
    "Done",
    "Outcome",
    "Retry",
    "Target",
    "Unsent",
    "backoff_delay",
    "build_headers",
    "build_url",
    "dispatch",
    "open_http_client",
]

DEFAULT_REQUEST_PATH = "/v1/completions"
OBJECTIVE_HEADER = "x-gateway-inference-objective"
FAIRNESS_HEADER = "x-llm-d-inference-fairness-id"

DEADLINE_MARGIN = 0.5
"""Seconds a parked retry must leave before the deadline; a longer backoff ends the request."""

_MAX_BACKOFF = 60.0
_BACKSTOP_SECONDS = 1.0
_INFERENCE_ERROR_PREFIX = "Failed to send request to inference: "
_TIMEOUTS = (_http.ConnectTimeout, _http.PoolTimeout, _http.WriteTimeout, _http.ReadTimeout)
# Failures before any byte of the request was written: the gateway was not reached.
_UNSENT = (_http.ConnectError, _http.ConnectTimeout)
# No file descriptor left to open a socket with: this process's limit, or the system's.
_OUT_OF_FILES = frozenset({errno.EMFILE, errno.ENFILE})
_RETRY_AFTER_SECONDS = re.compile(r"\d+(?:\.\d+)?")
_default_rng = random.Random()
_log = logging.getLogger("claimkit.dispatch")


@dataclass(frozen=True, slots=True)
class Target:
    """Where one queue's requests go (from its config entry, docs/configuration.md).

    Attributes:
        base_url: the gateway base URL (``igw_base_url``); may carry a path prefix.
        request_path: the default path (``request_path_url``); a request's ``endpoint``
            overrides it.
        inference_objective: sent as ``x-gateway-inference-objective`` when set.
    """

    base_url: str
    request_path: str = DEFAULT_REQUEST_PATH
    inference_objective: str | None = None


@dataclass(frozen=True, slots=True)
class Done:
    """Terminal: ack ``record`` (docs/protocol.md).

    Attributes:
        record: the terminal record.
        unanswered: the request was written and the gateway gave no response (it closed or
            reset the connection, or ``request_timeout`` passed): an ``INFERENCE_ERROR`` the
            gateway may still be running, never re-sent. Counted in
            ``async_gateway_no_response_total``.
    """

    record: TerminalRecord
    unanswered: bool = False


@dataclass(frozen=True, slots=True)
class Retry:
    """Retryable: park the request for ``delay`` seconds (docs/protocol.md#park-for-retry).

    Attributes:
        delay: backoff in seconds, > 0.
        last: the record the last HTTP response would make (status and body), or ``None``
            when the attempt got no readable response (the body failed to read). The
            parked member carries it (:func:`claimkit.protocol.models.retry_member`).
    """

    delay: float
    last: TerminalRecord | None


@dataclass(frozen=True, slots=True)
class Unsent:
    """Not sent: the attempt failed before any byte of the request could reach the gateway
    (DNS failure, connection refused, connect timeout, TLS handshake failure), with time
    left before the deadline. No record: the caller hands the claim back to pending at its
    own score, which is not a delivery nor a retry, and counts the failure towards the
    queue's gateway breaker (docs/dispatch.md#the-gateway-is-unreachable).

    Attributes:
        reason: why the connection failed, e.g. ``all attempts to connect to
            127.0.0.1:8000 failed (Connection refused)``; names the host and port, never
            the URL's user info.
        out_of_files: the connection could not be opened because this process (``EMFILE``)
            or the system (``ENFILE``) has no file descriptor left: a local limit, not the
            gateway failing, so it does not count towards the breaker; the breaker says
            it in its own line instead (docs/dispatch.md#out-of-open-files).
    """

    reason: str
    out_of_files: bool = False


Outcome: TypeAlias = Done | Retry | Unsent


def build_url(base_url: str, path: str) -> str:
    """Join the gateway base URL and a request path with exactly one ``/`` between them.

    The base URL's own path is kept as a prefix (``http://gw/prefix/`` + ``/v1/completions``
    → ``http://gw/prefix/v1/completions``). ``path`` is always treated as a path, even when
    it looks like a URL, so a request cannot point claimkit at another host. An empty
    ``path`` gives the base URL unchanged.
    """
    if not path:
        return base_url
    return base_url.rstrip("/") + "/" + path.lstrip("/")


def _put(headers: dict[str, str], name: str, value: str) -> None:
    """Set a header so that it replaces every case variant of ``name`` already present."""
    lowered = name.lower()
    for key in [k for k in headers if k.lower() == lowered]:
        del headers[key]
    headers[name] = value


def build_headers(env: Envelope, target: Target) -> dict[str, str]:
    """The HTTP headers of one attempt (docs/dispatch.md), later sources winning.

    In order: ``Content-Type: application/json``; ``x-gateway-inference-objective`` when the
    queue sets an objective; the request's own ``headers``; ``x-llm-d-inference-fairness-id``
    = ``metadata["userid"]`` when that is present and non-empty. Header names compare
    case-insensitively, so a later header replaces any case variant of an earlier one
    instead of being sent twice.
    """
    headers: dict[str, str] = {}
    _put(headers, "Content-Type", "application/json")
    if target.inference_objective:
        _put(headers, OBJECTIVE_HEADER, target.inference_objective)
    for name, value in env.headers.items():
        _put(headers, name, value)
    userid = env.metadata.get("userid")
    if userid:
        _put(headers, FAIRNESS_HEADER, userid)
    return headers


def _retry_after_seconds(value: str | None, now: float) -> float | None:
    """Seconds from ``now`` that a ``Retry-After`` value asks for, or ``None`` if unusable.

    Accepts delay-seconds (``"120"``, also a decimal ``"1.5"``) and an HTTP-date
    (``"Wed, 21 Oct 2015 07:28:00 GMT"``; one without a zone is read as UTC).
    """
    if value is None:
        return None
    text = value.strip()
    if _RETRY_AFTER_SECONDS.fullmatch(text):
        return float(text)
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp() - now


def backoff_delay(
    attempt: int,
    seconds_left: float,
    retry_after: str | None,
    *,
    now: float,
    rng: random.Random,
) -> float:
    """The backoff in seconds before attempt ``attempt + 1`` (docs/dispatch.md).

    With ``s = seconds_left`` and ``t = min(60, s, 2 · 2^attempt)``, the delay is uniform in
    ``[t/2, t)``. A ``Retry-After`` asking for more than that is honoured, capped at ``s/2``
    so one more attempt still fits before the deadline, plus up to 25 % jitter
    (``min(retry_after, s/2) · (1 + U[0, 0.25))``); the delay is never shorter than the
    computed backoff, so a cap below it leaves the backoff as it was. A ``Retry-After`` that
    cannot be parsed is ignored.

    Args:
        attempt: the attempt that just failed, ``n = retry_count + 1``; values below 1 are
            treated as 1.
        seconds_left: seconds until the request's deadline.
        retry_after: the response's ``Retry-After`` header (seconds or HTTP-date), if any.
        now: the current Unix time in seconds; an HTTP-date is measured from it.
        rng: the random source, so tests can seed it. The backoff draw comes first; the
            jitter draw is taken only when ``Retry-After`` is honoured.

    Returns:
        The delay in seconds; ``0.0`` when ``seconds_left`` is not positive.
    """
    if seconds_left <= 0:
        return 0.0
    exponent = min(max(attempt, 1), 16)  # 2·2^16 is far above the 60 s cap already
    t = min(_MAX_BACKOFF, seconds_left, 2.0 * 2.0**exponent)
    delay = t / 2 + rng.random() * (t / 2)
    wanted = _retry_after_seconds(retry_after, now)
    if wanted is not None and wanted > delay:
        honoured = min(wanted, seconds_left / 2) * (1.0 + 0.25 * rng.random())
        delay = max(delay, honoured)
    return delay


def _format_seconds(seconds: float) -> str:
    return f"{seconds:.3f}".rstrip("0").rstrip(".") + " s"


def _os_reason(exc: BaseException) -> str | None:
    """The ``strerror`` of the innermost OS error behind ``exc`` (e.g. ``Connection refused``)."""
    found: str | None = None
    for cur in exception_chain(exc):
        if isinstance(cur, OSError) and cur.strerror:
            # trio folds the address into strerror; the errno's own text is the short part.
            found = os.strerror(cur.errno) if cur.errno and cur.errno > 0 else cur.strerror
    return found


def _errnos(exc: BaseException) -> set[int]:
    """The errnos of every OS error behind ``exc`` (causes, contexts, exception groups)."""
    return {cur.errno for cur in exception_chain(exc) if isinstance(cur, OSError) and cur.errno}


def _out_of_files_reason(errnos: set[int]) -> str:
    if errno.EMFILE in errnos:
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        limit = "unlimited" if soft == resource.RLIM_INFINITY else str(soft)
        return f"cannot open a connection: too many open files (limit {limit})"
    return "cannot open a connection: too many open files in the system"


def _describe(exc: Exception) -> str:
    """A short, never empty, human reason for a failed send (the ``<reason>`` of an
    ``INFERENCE_ERROR`` record, docs/protocol.md#terminal-record). Timeouts already say which
    phase ran out and after how long (see :mod:`._http`)."""
    text = str(exc).strip()
    errno_text = _os_reason(exc)
    if errno_text and errno_text not in text:
        text = f"{text} ({errno_text})" if text else errno_text
    return text or type(exc).__name__


def _inference_error(env: Envelope, reason: str, *, unanswered: bool = False) -> Done:
    return Done(
        TerminalRecord.error(env.id, ErrorCode.INFERENCE_ERROR, _INFERENCE_ERROR_PREFIX + reason),
        unanswered=unanswered,
    )


def _deadline_ends(env: Envelope, last: TerminalRecord | None) -> Done:
    """The deadline ended the request: its last HTTP response (this attempt's, else the one
    its member carries from an earlier attempt), or ``DEADLINE_EXCEEDED``."""
    return Done(deadline_record(env, last))


def _no_response(
    env: Envelope, error: _http.HttpError | None, timeout: float, *, deadline_cuts: bool
) -> Outcome:
    """The outcome of an attempt that got no response head: ``error`` is the client's, or
    ``None`` when the backstop ran out (the request went out, no answer came)."""
    if deadline_cuts and (error is None or isinstance(error, _TIMEOUTS)):
        return _deadline_ends(env, None)
    if error is None:
        return _inference_error(
            env, f"no response within {_format_seconds(timeout)}", unanswered=True
        )
    if isinstance(error, _UNSENT):
        out_of_files = _errnos(error) & _OUT_OF_FILES
        if out_of_files:
            return Unsent(_out_of_files_reason(out_of_files), out_of_files=True)
        return Unsent(_describe(error))
    return _inference_error(env, _describe(error), unanswered=isinstance(error, _http.NoResponse))


async def dispatch(
    client: _http.HttpClient,
    env: Envelope,
    target: Target,
    *,
    request_timeout: float,
    now: float,
    rng: random.Random | None = None,
) -> Outcome:
    """Send one request to the gateway once and decide what happens next (docs/dispatch.md).

    Args:
        client: a client from :func:`open_http_client` (it must not follow redirects).
        env: the claimed request.
        target: the queue's gateway.
        request_timeout: the per-attempt limit in seconds (``--request-timeout``, 300 s).
        now: the current Unix time in seconds, from the same clock as ``env.deadline``.
            Time spent inside this call is measured with trio's monotonic clock and added.
        rng: random source of the backoff jitter; a module-level one when ``None``.

    Returns:
        :class:`Done` with the terminal record: the HTTP status and exact body text of a
        final response; ``DEADLINE_EXCEEDED`` if no time was left to send (nothing is
        sent then); ``INFERENCE_ERROR`` with message ``Failed to send request to
        inference: <reason>`` when the request was sent and no response was had
        (``request_timeout`` passed, transport error), or the client refuses to build it.
        :class:`Unsent` when the connection could not be opened (DNS, refused, connect
        timeout, TLS handshake) and the deadline did not cut the attempt short. When the
        deadline, not ``request_timeout``, cut the attempt short, the deadline ended it:
        the record is the last HTTP response (this attempt's or ``env.last_response``),
        else ``DEADLINE_EXCEEDED``. Or :class:`Retry` for 429, 5xx and unreadable bodies —
        unless its backoff would leave less than :data:`DEADLINE_MARGIN` seconds before
        the deadline: past the deadline the last HTTP response becomes the record, or
        ``DEADLINE_EXCEEDED`` when there was none.

    Raises:
        Nothing for HTTP or network failures; they become outcomes.

    Cancellation:
        Safe at any point: the request may or may not have reached the gateway, the
        response (if any) is closed and its connection released, and nothing else is
        changed. The caller still owns the claim and decides what becomes of it.
    """
    if deadline_passed(env.deadline, now):
        return _deadline_ends(env, None)
    seconds_left = env.deadline - now
    timeout = min(request_timeout, seconds_left)
    # When the time to the deadline is the attempt's limit, running out of it is the
    # deadline ending the request, not the gateway failing to answer.
    deadline_cuts = seconds_left <= request_timeout

    started = trio.current_time()
    url = build_url(target.base_url, env.endpoint or target.request_path)
    # As bytes, UTF-8: a non-ASCII header value is sent as is (as Go's net/http does).
    headers = [(k.encode(), v.encode()) for k, v in build_headers(env, target).items()]
    body_out = env.body_bytes()  # a fetched payload as stored, else data.payload as JSON

    status: int | None = None
    body: str | None = None
    retry_after: str | None = None
    failure = ""
    error: _http.HttpError | None = None  # stays None when the backstop below ran out
    # The client bounds every phase, a body trickling in forever included, by one deadline
    # and says which phase ran out; this scope is only a backstop a little later.
    with trio.move_on_after(timeout + _BACKSTOP_SECONDS):
        try:
            response = await client.post(url, body_out, headers, timeout=timeout)
        except _http.InvalidURL as exc:
            return _inference_error(env, str(exc))
        except _http.BodyError as exc:
            status = exc.status
            retry_after = _http._header(exc.headers, "retry-after")
            failure = _describe(exc)
        except _http.HttpError as exc:
            error = exc
        else:
            status = response.status
            retry_after = response.header("retry-after")
            body = response.text

    if status is None:
        return _no_response(env, error, timeout, deadline_cuts=deadline_cuts)

    last: TerminalRecord | None = None
    if body is not None:
        last = TerminalRecord.http(env.id, status, body)
        if status != 429 and not 500 <= status <= 599:
            return Done(last)

    # Retryable: 429, 5xx, or the body failed to read (status known, body is None).
    if body is None:
        _log.debug(
            "request %s: the body of a %d response failed to read: %s",
            env.id,
            status,
            failure or f"not complete within {_format_seconds(timeout)}",
        )
    now_after = now + (trio.current_time() - started)
    left = env.deadline - now_after
    delay = backoff_delay(
        env.retry_count + 1, left, retry_after, now=now_after, rng=rng or _default_rng
    )
    if delay >= left - DEADLINE_MARGIN:
        return _deadline_ends(env, last)
    return Retry(delay, last)


def open_http_client(concurrency: int) -> _http.HttpClient:
    """A gateway client for up to ``concurrency`` requests in flight at once.

    It is claimkit's own HTTP/1.1 client (:class:`claimkit.consumer.http.HttpClient`, the
    httptools parser over trio streams): redirects are never followed (docs/dispatch.md), up
    to ``concurrency`` connections are open at once, so a full worker pool never waits for a
    connection, and idle ones are kept for reuse for
    :data:`claimkit.consumer.http.KEEPALIVE_EXPIRY_SECONDS` (1.5 s, below common gateway
    keep-alive timeouts: a request written on a connection the server is closing is never
    re-sent, so that race must stay rare), or 1 s less than a gateway's own ``Keep-Alive:
    timeout=N`` says (at most :data:`claimkit.consumer.http.KEEPALIVE_MAX_SECONDS`).
    :func:`dispatch` sets the timeout of every attempt.
    Use it as ``async with open_http_client(n) as client:`` so its connections are closed.
    See ``docs/performance.md`` for why not httpx (about 10x the CPU per request).

    Raises:
        ValueError: ``concurrency`` is below 1.
    """
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    return _http.HttpClient(max_connections=concurrency)
