"""Checking a Redis URL before anything connects: one ``ValueError`` line per mistake."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

from claimkit.store.redact import redact_url
from claimkit.store.tls import tls_file_problem

__all__ = ["check_url"]


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
