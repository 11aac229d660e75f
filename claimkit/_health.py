"""The metrics and health HTTP servers of ``claimkit serve`` (SPEC §5, §7).

Both run in threads with the standard library's WSGI server, so a busy event loop never
delays a scrape or a probe. ``/metrics`` is prometheus-client's WSGI app; ``/healthz`` is 200
while the process runs; ``/readyz`` is 200 while the consumer reaches Redis and is not
shutting down, else 503. A port of 0 turns that server off (SPEC §6).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

__all__ = ["serve_http"]

_StartResponse = Callable[..., Any]
_App = Callable[[dict[str, Any], _StartResponse], Iterable[bytes]]


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # probes every few seconds would flood the log


def _health_app(ready: Callable[[], tuple[bool, str]]) -> _App:
    def app(environ: dict[str, Any], start_response: _StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/healthz":
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [b"ok\n"]
        if path == "/readyz":
            ok, why = ready()
            start_response(
                "200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")]
            )
            return [(why + "\n").encode()]
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found\n"]

    return app


@contextmanager
def _serving(host: str, port: int, app: _App) -> Iterator[WSGIServer]:
    server = make_server(host, port, app, handler_class=_Quiet)
    thread = threading.Thread(target=server.serve_forever, name=f"http-{port}", daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@contextmanager
def serve_http(
    *,
    metrics_port: int,
    health_port: int,
    registry: CollectorRegistry,
    ready: Callable[[], tuple[bool, str]],
    host: str = "0.0.0.0",
) -> Iterator[dict[str, int]]:
    """Serve ``/metrics`` on ``metrics_port`` and ``/healthz`` + ``/readyz`` on
    ``health_port`` while the ``with`` block runs. When both ports are equal one server
    answers all three paths.

    Args:
        ready: called per ``/readyz`` probe; returns ``(ready, reason)``.

    Yields:
        ``{"metrics": port, "health": port}`` of the servers actually started (bound ports).

    Raises:
        OSError: a port is taken (the caller reports it as one line).
    """
    metrics_app = make_wsgi_app(registry)
    health_app = _health_app(ready)

    def both(environ: dict[str, Any], start_response: _StartResponse) -> Iterable[bytes]:
        if environ.get("PATH_INFO") in ("/healthz", "/readyz"):
            return health_app(environ, start_response)
        return metrics_app(environ, start_response)  # type: ignore[no-any-return]

    bound: dict[str, int] = {}
    with ExitStack() as stack:
        if metrics_port and metrics_port == health_port:
            server = stack.enter_context(_serving(host, metrics_port, both))
            bound["metrics"] = bound["health"] = server.server_port
        else:
            if metrics_port:
                server = stack.enter_context(_serving(host, metrics_port, metrics_app))
                bound["metrics"] = server.server_port
            if health_port:
                server = stack.enter_context(_serving(host, health_port, health_app))
                bound["health"] = server.server_port
        yield bound
