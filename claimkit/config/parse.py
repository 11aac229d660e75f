"""Reading the configuration: the llm-d-async ``redis-sortedset`` transport JSON plus flags.

Every field and flag: docs/configuration.md.

The JSON comes inline (``--transport-config``) or from a file (``--transport-config-file``);
a flag applies only where the JSON does not set the field. The Redis URL is the JSON's
``url`` (or the file its ``url_file`` names), else ``--redis-url``, else ``$REDIS_URL``, else
the file ``$REDIS_URL_FILE`` names; a URL without a password takes the one in the file
``$REDIS_PASSWORD_FILE`` names, or ``$REDIS_PASSWORD`` (docs/security.md). Every mistake is
reported as one :class:`ConfigError` line naming the field.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, quote, urlsplit, urlunsplit

from claimkit._errors import ConfigError
from claimkit.config.gate_params import GATE_TYPES, check_gate_address, check_gate_params
from claimkit.config.model import DEFAULT_MAX_DELIVERIES, MAX_NUMBER, Config, QueueConfig
from claimkit.protocol import keys as _keys
from claimkit.protocol.consumers import default_consumer_id
from claimkit.protocol.tokens import consumer_id_problem
from claimkit.store.topology import Topology
from claimkit.store.urls import check_url

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["has_password", "load_config"]


# Numeric fields: (type, default). 0 means the default (docs/configuration.md), except
# max_deliveries.
_NUMERIC: dict[str, tuple[type, float]] = {
    "poll_interval_ms": (int, 1000),
    "batch_size": (int, 10),
    "claim_lease_ttl_seconds": (float, 300.0),
    "claim_reclaim_interval_ms": (int, 15000),
    "result_dedup_ttl_seconds": (int, _keys.DEFAULT_DEDUP_TTL_SECONDS),
    "max_deliveries": (int, DEFAULT_MAX_DELIVERIES),
    "concurrency": (int, 64),
    "request_timeout_seconds": (float, 300.0),
    "drain_timeout_seconds": (float, 10.0),
    "metrics_port": (int, 9090),
    "health_port": (int, 8081),
    "http_idle_timeout_seconds": (float, 5.0),
    "http_max_connections": (int, 512),
    "wait_replicas": (int, 0),
    "wait_timeout_ms": (int, 1000),
    "consumer_liveness_ttl_seconds": (float, 10.0),
}
# docs/configuration.md says 0 means the default, but some fields give 0 a meaning of its
# own: unlimited deliveries (docs/protocol.md#reclaim), a dedup marker with no TTL
# (docs/protocol.md#keys), a server turned off (docs/configuration.md), no consumer
# registry (docs/protocol.md#consumers).
_ZERO_IS_ZERO = {
    "max_deliveries",
    "result_dedup_ttl_seconds",
    "metrics_port",
    "health_port",
    "consumer_liveness_ttl_seconds",
}
_PORTS = {"metrics_port", "health_port"}
# consumer_liveness_ttl_seconds, when on: at least 3 s, so an entry outlives two missed
# heartbeat ticks (one each ttl/3) plus a second of slow round trips; a shorter one shows a
# live process dead under load, and reclaimers hand its claims on. At most a day: a crashed
# consumer's entry shows it alive that long. (Above the claim lease it is harmless, only
# slower than the lease; the default 10 s stays valid with short leases.)
LIVENESS_TTL_MIN_SECONDS = 3.0
LIVENESS_TTL_MAX_SECONDS = 86400.0


_TOP_LEVEL = {
    "url",
    "url_file",
    "result_queue_name",
    "retry_queue_name",
    "queues",
    "http_host",
    "mode",
    "addrs",
    "master_name",
    *_NUMERIC,
}
_QUEUE_FIELDS = {
    "queue_name",
    "id",
    "igw_base_url",
    "request_path_url",
    "inference_objective",
    "result_queue_name",
    "gate_type",
    "gate_params",
    "labels",
}


def _number(name: str, value: Any) -> float | int:
    kind, default = _NUMERIC[name]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{name} must be a number, got {json.dumps(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        # JSON text may say NaN or Infinity (json.loads takes both): a NaN lease would fail
        # every claim script, an infinite one every renewal.
        raise ConfigError(f"{name} must be a finite number, got {value}")
    if value > MAX_NUMBER:
        # Beyond what Redis takes as a count or an expiry (a huge dedup TTL fails every
        # ack's SET EX, a huge batch_size every peek's LIMIT): refuse it here, in one line.
        raise ConfigError(f"{name} must be at most {MAX_NUMBER}, got {value}")
    if kind is int and isinstance(value, float):
        if not value.is_integer():
            raise ConfigError(f"{name} must be a whole number, got {value}")
        value = int(value)
    if value < 0:
        raise ConfigError(f"{name} must be non-negative")
    if name in _PORTS and value > 65535:
        raise ConfigError(f"{name} must be a port number (0 turns the server off), got {value}")
    if (
        name == "consumer_liveness_ttl_seconds"
        and value
        and not (LIVENESS_TTL_MIN_SECONDS <= value <= LIVENESS_TTL_MAX_SECONDS)
    ):
        raise ConfigError(
            f"{name} must be 0 (no consumer registry) or from {LIVENESS_TTL_MIN_SECONDS:g}"
            f" to {LIVENESS_TTL_MAX_SECONDS:g} seconds, got {value}"
        )
    if value == 0 and name not in _ZERO_IS_ZERO:
        return kind(default)  # type: ignore[no-any-return]
    return kind(value)  # type: ignore[no-any-return]


def _ip_address(name: str, value: Any) -> str:
    """An IP address to bind: ``0.0.0.0``, ``127.0.0.1``, ``::``, an interface's own address."""
    try:
        return str(ipaddress.ip_address(value if isinstance(value, str) else ""))
    except ValueError:
        raise ConfigError(
            f"{name} must be an IP address such as 0.0.0.0, 127.0.0.1 or ::,"
            f" got {json.dumps(value)}"
        ) from None


def _string(where: str, value: Any, *, required: bool = False) -> str | None:
    if value is None:
        if required:
            raise ConfigError(f"{where} is required")
        return None
    if not isinstance(value, str) or (required and not value):
        raise ConfigError(f"{where} must be a non-empty string")
    return value


def _str_map(where: str, value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ConfigError(f"{where} must be an object of strings")
    return dict(value)


def _queue(i: int, raw: Any) -> QueueConfig:
    where = f"queues[{i}]"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be an object")
    name = _string(f"{where}.queue_name", raw.get("queue_name"), required=True)
    base = _string(f"{where}.igw_base_url", raw.get("igw_base_url"), required=True)
    assert name is not None and base is not None
    try:
        parts = urlsplit(base)
        port = parts.port
    except ValueError:
        parts, port = None, 0
    if parts is None or port == 0 or parts.scheme not in {"http", "https"} or not parts.hostname:
        raise ConfigError(
            f"{where}.igw_base_url must be an http:// or https:// URL with a valid host and port,"
            f" got {base!r}"
        )
    gate = _string(f"{where}.gate_type", raw.get("gate_type")) or "constant"
    if gate not in GATE_TYPES:
        raise ConfigError(f"{where}.gate_type must be one of {', '.join(GATE_TYPES)}, got {gate!r}")
    params = raw.get("gate_params") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{where}.gate_params must be an object")
    try:
        check_gate_params(gate, params, f"{where}.gate_params")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return QueueConfig(
        queue_name=name,
        igw_base_url=base,
        id=_string(f"{where}.id", raw.get("id")) or name,
        request_path_url=_string(f"{where}.request_path_url", raw.get("request_path_url"))
        or "/v1/completions",
        inference_objective=_string(f"{where}.inference_objective", raw.get("inference_objective")),
        result_queue_name=_string(f"{where}.result_queue_name", raw.get("result_queue_name")),
        gate_type=gate,
        gate_params=dict(params),
        labels=_str_map(f"{where}.labels", raw.get("labels")),
    )


def _unknown_gate_params(i: int, raw: dict[str, Any]) -> list[str]:
    """``queues[i].gate_params.<name>`` for each parameter its gate type does not read
    (llm-d-async has gates claimkit lacks; a typo would silently change nothing)."""
    gate, params = raw.get("gate_type") or "constant", raw.get("gate_params")
    if not isinstance(params, dict) or not isinstance(gate, str) or gate not in GATE_TYPES:
        return []
    try:
        names = check_gate_params(gate, params, f"queues[{i}].gate_params")
    except ValueError:
        return []  # _queue reports it
    return [f"queues[{i}].gate_params.{k}" for k in names]


def _read_text(path: str | Path, named: str) -> str:
    """The UTF-8 text of the file ``path``; ``named`` is how an error line names it."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read {named}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError:
        raise ConfigError(f"{named} is not UTF-8 text") from None


def _secret_file(where: str, path: Any) -> str:
    """The first line of the file ``path`` (a secret: a URL or a password), stripped."""
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{where} must be a non-empty file path")
    lines = _read_text(path, f"{where} {path}").splitlines()
    secret = lines[0].strip() if lines else ""
    if not secret:
        raise ConfigError(f"{where} {path} is empty")
    return secret


def _with_password(url: str, env: Mapping[str, str]) -> str:
    """``url`` with the password of ``$REDIS_PASSWORD_FILE`` or ``$REDIS_PASSWORD`` put in,
    when it has none of its own (the URL's own password wins; its user name is kept)."""
    parts = urlsplit(url)
    if parts.scheme == "unix" or has_password(url):
        return url  # the file is not even read: a command that needs no password must not fail
    if env.get("REDIS_PASSWORD_FILE"):
        password = _secret_file("$REDIS_PASSWORD_FILE", env["REDIS_PASSWORD_FILE"])
    else:
        password = env.get("REDIS_PASSWORD") or ""
    if not password:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    netloc = f"{user}:{quote(password, safe='')}@{host}"
    return urlunsplit(parts._replace(netloc=netloc))


def has_password(url: str) -> bool:
    """Whether the Redis URL ``url`` carries a password (``user:pw@`` or ``?password=``)."""
    try:
        parts = urlsplit(url)
        inline = parts.password
    except ValueError:
        return False
    query = {k.lower() for k in parse_qs(parts.query)}
    return bool(inline) or bool(query & {"password", "pass", "pwd"})


def load_config(
    *,
    inline: str | None = None,
    path: str | Path | None = None,
    flags: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
    require_queues: bool = True,
) -> Config:
    """Build a :class:`Config` from the transport JSON and flags (docs/configuration.md).

    Args:
        inline: the ``--transport-config`` JSON text.
        path: the ``--transport-config-file`` path. Mutually exclusive with ``inline``.
        flags: flag values by config field name (``claim_lease_ttl_seconds``, ``concurrency``,
            ``url``, ...); ``None`` values are ignored. A flag applies only where the JSON
            does not set the field.
        environ: where ``REDIS_URL``, ``REDIS_URL_FILE``, ``REDIS_PASSWORD``,
            ``REDIS_PASSWORD_FILE``, and for the consumer id ``CLAIMKIT_CONSUMER_ID`` and
            ``POD_NAME``, are looked up (default ``os.environ``). The consumer id is the
            ``consumer_id`` flag, else those, else ``<host>-<pid>``.
        require_queues: ``False`` for commands that work without queues (``results``).

    Raises:
        ConfigError: one line naming the bad field or file.
    """
    raw = _read_json(inline, path)
    unknown = _unknown_fields(raw)
    merged: dict[str, Any] = {k: v for k, v in (flags or {}).items() if v is not None}
    merged.update({k: v for k, v in raw.items() if v is not None})
    env = os.environ if environ is None else environ
    url = _redis_url(raw, merged, env)
    values = _values(merged)
    values.update(_topology(merged, url))
    queues = _queues(merged, url, require_queues=require_queues)
    if values.get("mode") == "cluster":
        _check_cluster_names(queues, values)
    values["consumer_id"] = _consumer_id((flags or {}).get("consumer_id"), env)
    return Config(url=url, queues=queues, unknown_fields=tuple(unknown), **values)


def _consumer_id(flag: Any, env: Mapping[str, str]) -> str:
    """The checked consumer id: the flag, else :func:`default_consumer_id` of ``env``."""
    consumer_id = flag if flag is not None else default_consumer_id(env)
    if not isinstance(consumer_id, str):
        raise ConfigError(f"consumer id must be a string, got {json.dumps(consumer_id)}")
    problem = consumer_id_problem(consumer_id)
    if problem is not None:
        raise ConfigError(problem)
    return consumer_id


def _read_json(inline: str | None, path: str | Path | None) -> dict[str, Any]:
    """The transport JSON object, from ``inline`` text or the file ``path`` (``{}`` when
    neither is given or the text is blank)."""
    if inline is not None and path is not None:
        raise ConfigError("--transport-config and --transport-config-file are mutually exclusive")
    text, source = inline, "--transport-config"
    if path is not None:
        source = str(path)
        text = _read_text(path, str(path))
    raw: Any = {}
    if text is not None and text.strip():
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{source} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
            ) from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{source} must hold a JSON object")
    return raw


def _unknown_fields(raw: dict[str, Any]) -> list[str]:
    """The fields of the JSON claimkit does not read (top level, per queue, per gate)."""
    unknown = [k for k in raw if k not in _TOP_LEVEL]
    for i, q in enumerate(raw.get("queues") or []):
        if isinstance(q, dict):
            unknown += [f"queues[{i}].{k}" for k in q if k not in _QUEUE_FIELDS]
            unknown += _unknown_gate_params(i, q)
    return unknown


def _redis_url(raw: dict[str, Any], merged: dict[str, Any], env: Mapping[str, str]) -> str:
    """The checked Redis URL, with the password of the environment put in (module docstring
    for where it comes from)."""
    if raw.get("url") is not None and raw.get("url_file") is not None:
        raise ConfigError("url and url_file are mutually exclusive: give one")
    url = raw.get("url")
    if url is None and raw.get("url_file") is not None:
        url = _secret_file("url_file", raw["url_file"])
    url = url or merged.get("url") or env.get("REDIS_URL")
    if not url and env.get("REDIS_URL_FILE"):
        url = _secret_file("$REDIS_URL_FILE", env["REDIS_URL_FILE"])
    if not url:
        raise ConfigError(
            "url is required: set it in the transport config, pass --redis-url or set REDIS_URL"
        )
    if not isinstance(url, str):
        raise ConfigError("url must be a string")
    try:
        check_url(url)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    return _with_password(url, env)


def _values(merged: dict[str, Any]) -> dict[str, Any]:
    """The numeric, list-name and ``http_host`` fields that are set, checked."""
    values: dict[str, Any] = {}
    for name in _NUMERIC:
        if name in merged:
            values[name] = _number(name, merged[name])
    for name in ("result_queue_name", "retry_queue_name"):
        if name in merged:
            values[name] = _string(name, merged[name], required=True)
    if "http_host" in merged:
        values["http_host"] = _ip_address("http_host", merged["http_host"])
    return values


def _topology(merged: dict[str, Any], url: str) -> dict[str, Any]:
    """``mode``, ``addrs`` and ``master_name``, each checked, then checked together and
    against ``url``'s database, in llm-d-async's words (docs/topology.md#configuration)."""
    mode = merged.get("mode", "standalone")
    if not isinstance(mode, str):
        raise ConfigError(f"mode must be a string, got {json.dumps(mode)}")
    mode = mode or "standalone"
    addrs = merged.get("addrs", [])
    if not isinstance(addrs, list) or not all(isinstance(a, str) for a in addrs):
        raise ConfigError('addrs must be a list of "host:port" strings')
    master_name = _string("master_name", merged.get("master_name")) or None
    topology = Topology(mode, tuple(addrs), master_name)
    topology.validate(url)
    return {"mode": mode, "addrs": tuple(addrs), "master_name": master_name}


def _check_cluster_names(queues: tuple[QueueConfig, ...], values: dict[str, Any]) -> None:
    """In cluster mode, every queue and configured result list must be a name whose derived
    keys can share its slot (:func:`~claimkit.protocol.keys.cluster_name_problem`)."""
    names = [("queue_name", q.queue_name) for q in queues]
    names += [("result_queue_name", q.result_queue_name) for q in queues if q.result_queue_name]
    names.append(("result_queue_name", values.get("result_queue_name", _keys.DEFAULT_RESULT_LIST)))
    for field, name in names:
        problem = _keys.cluster_name_problem(name)
        if problem is not None:
            raise ConfigError(f"{field} {problem}")


def _queues(merged: dict[str, Any], url: str, *, require_queues: bool) -> tuple[QueueConfig, ...]:
    """The checked ``queues[]``: each one's fields, its gate's ``address`` against ``url``,
    and no name or id listed twice."""
    queues_raw = merged.get("queues", [])
    if not isinstance(queues_raw, list):
        raise ConfigError("queues must be a list")
    queues = tuple(_queue(i, q) for i, q in enumerate(queues_raw))
    if require_queues and not queues:
        raise ConfigError("queues must list at least one queue")
    for i, q in enumerate(queues):
        try:
            check_gate_address(q.gate_params, f"queues[{i}].gate_params", url)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    seen_names: set[str] = set()
    seen_ids: set[str] = set()
    for q in queues:
        if q.queue_name in seen_names:
            raise ConfigError(f"queue_name {q.queue_name!r} is listed twice")
        if q.queue_id in seen_ids:
            raise ConfigError(f"queue id {q.queue_id!r} is listed twice")
        seen_names.add(q.queue_name)
        seen_ids.add(q.queue_id)
    return queues
