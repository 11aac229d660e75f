"""The ``gate_params`` of each gate type, checked (docs/configuration.md).

The parameters are llm-d-async's (a string map there, so ``"limit": "4"``; JSON numbers
are taken too); what each gate does with them is :mod:`claimkit.consumer.gates`. This is
the config layer's half: which parameters a gate type reads, whether their values are
usable, and which Redis an ``address`` names. Every mistake is one ``ValueError`` line
naming the field; :func:`claimkit.config.load_config` turns it into a ``ConfigError``.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from collections.abc import Mapping

    from claimkit.config.model import QueueConfig

__all__ = [
    "DEFAULT_BUDGET_KEY",
    "GATE_PARAMS",
    "GATE_TYPES",
    "MAX_LIMIT",
    "budget_key",
    "check_gate_address",
    "check_gate_params",
    "gate_limit",
    "gate_where",
]

GATE_TYPES = ("constant", "redis", "local-max-concurrency")
DEFAULT_BUDGET_KEY = "dispatch-gate-budget"
MAX_LIMIT = 2**31 - 1

GATE_PARAMS: dict[str, frozenset[str]] = {
    "constant": frozenset(),
    "redis": frozenset({"budget_key", "key", "address"}),
    "local-max-concurrency": frozenset({"limit", "max_concurrency", "gating_mode"}),
}
"""The ``gate_params`` each gate type reads; anything else is unknown (warned about)."""

_GATING_MODES = ("blocking", "classifying")
_WHOLE = re.compile(r"[+-]?[0-9]+")
_LOOPBACK = {"localhost", "127.0.0.1", "::1"}
_DEFAULT_REDIS_PORT = 6379


def _show(value: object) -> str:
    """``value`` as the operator wrote it (JSON), cut short for a one-line message."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _given(params: Mapping[str, Any], names: tuple[str, ...], where: str) -> tuple[str, Any]:
    """The first of ``names`` (aliases of one parameter) that is set, and its value; an
    absent, ``null`` or ``""`` value counts as not set (llm-d-async reads ``""`` as not
    given). ``(names[0], None)`` when none is. Two aliases set to different values are an
    error: which one was meant cannot be told."""
    found = [(n, params[n]) for n in names if params.get(n) not in (None, "")]
    if len({v.strip() if isinstance(v, str) else _show(v) for _, v in found}) > 1:
        raise ValueError(
            f"{where}.{found[0][0]} and {where}.{found[1][0]} name one parameter: give one"
        )
    return found[0] if found else (names[0], None)


def gate_where(queue: QueueConfig) -> str:
    """How a message names the ``gate_params`` of ``queue``: ``queue 'q': gate_params``."""
    return f"queue {queue.queue_name!r}: gate_params"


def budget_key(queue: QueueConfig, where: str | None = None) -> str | None:
    """The budget key a ``redis`` gate reads (``budget_key``, or its older name ``key``;
    default :data:`DEFAULT_BUDGET_KEY`), or ``None`` for other gate types.

    Raises:
        ValueError: the key is not a string, or both names are given with different values.
    """
    if queue.gate_type != "redis":
        return None
    where = where or gate_where(queue)
    name, value = _given(queue.gate_params, ("budget_key", "key"), where)
    if value is None:
        return DEFAULT_BUDGET_KEY
    if not isinstance(value, str):
        raise ValueError(f"{where}.{name} must be a string (a Redis key), got {_show(value)}")
    return value


def gate_limit(params: Mapping[str, Any], where: str) -> int:
    """The ``limit`` (or ``max_concurrency``) of a ``local-max-concurrency`` gate: requests
    of one queue in flight in one process, from 1 to :data:`MAX_LIMIT`.

    Raises:
        ValueError: it is missing, or not a whole number in that range (one line).
    """
    name, value = _given(params, ("limit", "max_concurrency"), where)
    if value is None:
        raise ValueError(
            f'{where}.limit is required (requests of this queue in flight here, such as "4")'
        )
    n: int | None = None
    if isinstance(value, bool):
        n = None
    elif isinstance(value, int):
        n = value
    elif isinstance(value, float) and value.is_integer():
        n = int(value)
    elif isinstance(value, str) and _WHOLE.fullmatch(value.strip()):
        n = int(value.strip())
    if n is None or not 1 <= n <= MAX_LIMIT:
        raise ValueError(
            f"{where}.{name} must be a whole number from 1 to {MAX_LIMIT}"
            f' (a JSON number or a string such as "4"), got {_show(value)}'
        )
    return n


def check_gate_params(gate_type: str, params: Mapping[str, Any], where: str) -> list[str]:
    """Check the ``gate_params`` of a gate of type ``gate_type``.

    Args:
        gate_type: one of :data:`GATE_PARAMS`.
        params: the ``gate_params`` object as read from the JSON.
        where: how messages name the object, e.g. ``"queues[0].gate_params"``.

    Returns:
        The names of parameters this gate type does not read, sorted (ignored; the caller
        warns about each).

    Raises:
        ValueError: one line naming the bad parameter and its value (``limit: "x"``, a
            ``gating_mode`` other than ``blocking`` / ``classifying``, a non-string
            ``budget_key`` or ``address``).
    """
    known = GATE_PARAMS.get(gate_type, frozenset())
    unknown = sorted(k for k in params if k not in known)
    if gate_type == "redis":
        name, value = _given(params, ("budget_key", "key"), where)
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{where}.{name} must be a string (a Redis key), got {_show(value)}")
        address = params.get("address")
        if address not in (None, "") and (
            not isinstance(address, str) or _host_port(address) is None
        ):
            raise ValueError(f"{where}.address must be host:port, got {_show(address)}")
    elif gate_type == "local-max-concurrency":
        gate_limit(params, where)
        mode = params.get("gating_mode")
        if mode not in (None, "", *_GATING_MODES):
            raise ValueError(
                f'{where}.gating_mode must be "blocking" or "classifying", got {_show(mode)}'
            )
    return unknown


def _host_port(address: str) -> tuple[str, int] | None:
    """``host:port`` (``[v6]:port``; port 6379 when left out) as ``(host, port)``."""
    try:
        parts = urlsplit("//" + address.strip())
        port = parts.port or _DEFAULT_REDIS_PORT
    except ValueError:
        return None
    if not parts.hostname or parts.path or parts.query or parts.username is not None:
        return None
    return parts.hostname.lower(), port


def _same_host(a: str, b: str) -> bool:
    return a == b or (a in _LOOPBACK and b in _LOOPBACK)


def check_gate_address(params: Mapping[str, Any], where: str, redis_url: str) -> None:
    """Refuse an ``address`` that names another Redis than ``redis_url``'s.

    llm-d-async's ``redis`` gate opens its own connection to ``address`` (``host:port``, no
    password or TLS) to read the budget key. claimkit reads the budget key on the queue's
    own Redis, with that Redis's credentials and TLS, so an ``address`` naming that Redis
    (same host, loopback names alike, same port) is accepted and another one is refused:
    ignoring it would read the key from the wrong Redis and lose the throttle.

    Raises:
        ValueError: one line saying which Redis the URL names and what to write instead.
    """
    address = params.get("address")
    if not isinstance(address, str) or not address:
        return
    got = _host_port(address)
    parts = urlsplit(redis_url)
    try:
        want = (
            (parts.hostname.lower(), parts.port or _DEFAULT_REDIS_PORT) if parts.hostname else None
        )
    except ValueError:
        want = None
    if got is not None and want is not None and _same_host(got[0], want[0]) and got[1] == want[1]:
        return
    if want is None:
        fix, on = "remove address", "a Unix socket"
    else:
        host = f"[{want[0]}]" if ":" in want[0] else want[0]
        on = f"{host}:{want[1]}"
        fix = f"remove address or set it to {on!r}"
    raise ValueError(
        f"{where}.address {address!r} names another Redis than the queue's ({on}); claimkit"
        f" reads the budget key on the queue's own Redis: {fix}"
    )
