"""The gateway simulator behind ``claimkit sim``: a fake OpenAI-compatible inference gateway.

A development and test tool, not a model. It answers ``POST /v1/completions`` and
``POST /v1/chat/completions`` with a small OpenAI-shaped JSON body after a configurable
latency, and injects faults at configurable rates: 429 (optionally with ``Retry-After``),
503, or a hang that never answers (until the client gives up and disconnects). It counts
what it saw, so a test or the chaos harness can check how often each request ran:

- ``GET /stats`` → ``{"requests": n, "by_status": {"200": n, ...}, "hangs": n,
  "calls_by_id": {"<id>": n, ...}}``. ``calls_by_id`` counts the requests whose JSON body
  has a string ``id`` (the demo puts the request id in the payload); a request is counted
  when it arrives, whatever the answer.
- ``POST /stats/reset`` → zeroes every counter and answers ``{"reset": true}``.

It is a plain ASGI app served by hypercorn on trio (:func:`serve_sim`).
"""

from __future__ import annotations

import json
import logging
import random
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

if TYPE_CHECKING:
    from collections.abc import Iterator

    from hypercorn.typing import (
        ASGIReceiveCallable,
        ASGISendCallable,
        HTTPScope,
        LifespanScope,
        Scope,
    )

__all__ = [
    "COMPLETIONS_PATHS",
    "SimApp",
    "SimConfig",
    "parse_latency",
    "run_sim_forever",
    "serve_sim",
]

COMPLETIONS_PATHS = ("/v1/completions", "/v1/chat/completions")
_MAX_BODY = 16 * 1024 * 1024
_log = logging.getLogger("claimkit.sim")


def parse_latency(text: str) -> tuple[float, float]:
    """Parse a ``--latency`` flag: ``"0.05"`` (fixed seconds) or ``"0.01,0.05"`` (uniform range).

    Raises:
        ValueError: not one or two non-negative numbers, or ``min > max``.
    """
    parts = [p.strip() for p in text.split(",")]
    if len(parts) not in (1, 2) or not all(parts):
        raise ValueError(f"latency must be SECONDS or MIN,MAX, got {text!r}")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"latency must be SECONDS or MIN,MAX, got {text!r}") from None
    low, high = values[0], values[-1]
    _check_latency((low, high))
    return (low, high)


def _check_latency(latency: tuple[float, float]) -> None:
    low, high = latency
    if not (0.0 <= low <= high < float("inf")):
        raise ValueError(f"latency must satisfy 0 <= min <= max, got {low},{high}")


@dataclass
class SimConfig:
    """What the simulator listens on and how it misbehaves.

    Attributes:
        host: interface to bind.
        port: TCP port; 0 picks a free one (:func:`serve_sim` reports the real URL).
        latency: ``(min, max)`` seconds slept before each completion answer, uniform;
            ``(x, x)`` is a fixed latency. :func:`parse_latency` reads the flag form.
        rate_429: fraction of completion requests answered 429.
        rate_5xx: fraction answered 503.
        rate_hang: fraction never answered (held open until the client disconnects).
        retry_after: ``Retry-After`` value sent with every 429 (seconds or an HTTP-date),
            or ``None`` for none.
        seed: seed of the fault and latency draws, for reproducible runs.

    Raises:
        ValueError: a rate outside ``[0, 1]``, rates summing to more than 1, or a bad
            latency range; the message names the field.
    """

    host: str = "127.0.0.1"
    port: int = 0
    latency: tuple[float, float] = (0.0, 0.0)
    rate_429: float = 0.0
    rate_5xx: float = 0.0
    rate_hang: float = 0.0
    retry_after: str | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("rate_429", "rate_5xx", "rate_hang"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be between 0 and 1, got {value}")
        if self.rate_429 + self.rate_5xx + self.rate_hang > 1.0 + 1e-9:
            raise ValueError("rate_429 + rate_5xx + rate_hang must not exceed 1")
        _check_latency(self.latency)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be between 0 and 65535, got {self.port}")


@dataclass
class _Stats:
    requests: int = 0
    hangs: int = 0
    by_status: Counter[str] = field(default_factory=Counter)
    calls_by_id: Counter[str] = field(default_factory=Counter)

    def as_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "by_status": dict(self.by_status),
            "hangs": self.hangs,
            "calls_by_id": dict(self.calls_by_id),
        }


def _json_bytes(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()


def _error_doc(message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


class SimApp:
    """The simulator's ASGI application (one instance per server; state is in memory).

    Args:
        config: the behaviour.
        keep_bodies: keep the exact body of the last completion request per string ``id``
            of its JSON in :attr:`bodies` (in-process only, for tests: not in ``/stats``).

    Attributes:
        config: the behaviour it was built with.
        bodies: with ``keep_bodies``, ``id -> the last request body`` (exact bytes).
    """

    def __init__(self, config: SimConfig, *, keep_bodies: bool = False) -> None:
        self.config = config
        self._rng = random.Random(config.seed)
        self._stats = _Stats()
        self._serial = 0
        self._keep_bodies = keep_bodies
        self.bodies: dict[str, bytes] = {}

    def stats(self) -> dict[str, Any]:
        """The counters, in the shape ``GET /stats`` returns."""
        return self._stats.as_json()

    def reset(self) -> None:
        """Zero every counter (``POST /stats/reset``)."""
        self._stats = _Stats()

    async def __call__(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
        elif scope["type"] == "http":
            await self._http(scope, receive, send)
        # websocket: not served; returning closes it.

    async def _lifespan(
        self, scope: LifespanScope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        while True:
            event = await receive()
            if event["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif event["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(
        self, scope: HTTPScope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        path, method = scope["path"], scope["method"]
        body, disconnected = await _read_body(receive)
        if disconnected:
            return
        if path in COMPLETIONS_PATHS:
            if method != "POST":
                await _respond(send, 405, _error_doc("use POST", "invalid_request_error"))
                return
            await self._completion(path, body, receive, send)
        elif path == "/stats" and method == "GET":
            await _respond(send, 200, self.stats())
        elif path == "/stats/reset" and method == "POST":
            self.reset()
            await _respond(send, 200, {"reset": True})
        else:
            await _respond(send, 404, _error_doc(f"no route {method} {path}", "not_found"))

    async def _completion(
        self, path: str, body: bytes, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        cfg = self.config
        stats = self._stats
        stats.requests += 1
        try:
            doc = json.loads(body) if body else None
        except ValueError:
            await self._answer(send, 400, _error_doc("body is not JSON", "invalid_request_error"))
            return
        request_id = doc.get("id") if isinstance(doc, dict) else None
        if isinstance(request_id, str):
            stats.calls_by_id[request_id] += 1
            if self._keep_bodies:
                self.bodies[request_id] = body
        model = doc.get("model") if isinstance(doc, dict) else None

        # Draw the fault and the latency up front, in a fixed order, so a seed reproduces a run.
        draw = self._rng.random()
        low, high = cfg.latency
        latency = low if low == high else self._rng.uniform(low, high)

        if draw < cfg.rate_hang:
            stats.hangs += 1
            await _wait_for_disconnect(receive)
            return
        if latency > 0:
            await trio.sleep(latency)
        if draw < cfg.rate_hang + cfg.rate_429:
            headers = [(b"retry-after", cfg.retry_after.encode())] if cfg.retry_after else []
            doc429 = _error_doc("simulated rate limit", "rate_limit_exceeded")
            await self._answer(send, 429, doc429, headers)
        elif draw < cfg.rate_hang + cfg.rate_429 + cfg.rate_5xx:
            await self._answer(send, 503, _error_doc("simulated overload", "server_error"))
        else:
            await self._answer(send, 200, self._completion_doc(path, request_id, model, len(body)))

    def _completion_doc(
        self, path: str, request_id: object, model: object, prompt_bytes: int
    ) -> dict[str, Any]:
        self._serial += 1
        rid = request_id if isinstance(request_id, str) else f"cmpl-sim-{self._serial}"
        name = model if isinstance(model, str) else "sim"
        usage = {"prompt_tokens": prompt_bytes // 4, "completion_tokens": 2}
        usage["total_tokens"] = usage["prompt_tokens"] + 2
        if path == "/v1/chat/completions":
            return {
                "id": rid,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": name,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "ok ok"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": usage,
            }
        return {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": name,
            "choices": [{"index": 0, "text": "ok ok", "logprobs": None, "finish_reason": "stop"}],
            "usage": usage,
        }

    async def _answer(
        self,
        send: ASGISendCallable,
        status: int,
        doc: Any,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        self._stats.by_status[str(status)] += 1
        await _respond(send, status, doc, headers)


async def _read_body(receive: ASGIReceiveCallable) -> tuple[bytes, bool]:
    """The whole request body, and whether the client disconnected first."""
    chunks: list[bytes] = []
    size = 0
    while True:
        event = await receive()
        if event["type"] == "http.disconnect":
            return b"", True
        if event["type"] != "http.request":
            continue
        chunk = event.get("body", b"")
        size += len(chunk)
        if size <= _MAX_BODY:
            chunks.append(chunk)
        if not event.get("more_body", False):
            return b"".join(chunks), False


async def _wait_for_disconnect(receive: ASGIReceiveCallable) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _respond(
    send: ASGISendCallable,
    status: int,
    doc: Any,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    payload = _json_bytes(doc)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload, "more_body": False})


def _listen_socket(config: SimConfig) -> socket.socket:
    """Bind the listening socket here, not in hypercorn, so a bind error is a plain
    ``OSError`` and a failed bind leaves no socket behind."""
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((config.host, config.port))
    except BaseException:
        sock.close()
        raise
    return sock


def _hypercorn_config(fd: int) -> HypercornConfig:
    hc = HypercornConfig()
    hc.bind = [f"fd://{fd}"]  # hypercorn adopts the descriptor and closes it when done
    # A logger object (not "-") keeps hypercorn from installing its own stderr handler.
    hc.errorlog = _log
    hc.accesslog = None
    hc.graceful_timeout = 1.0
    return hc


async def serve_sim(
    config: SimConfig,
    *,
    app: SimApp | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the simulator until cancelled.

    Args:
        config: where to listen and how to behave.
        app: the application to serve, to read its counters in-process; a new
            :class:`SimApp` for ``config`` when ``None``.
        task_status: receives the base URL (``"http://127.0.0.1:PORT"``, the real port when
            ``config.port`` is 0) once the socket is listening; use ``nursery.start``.

    Raises:
        OSError: the address cannot be bound.

    Cancellation:
        The normal way to stop it: open connections are dropped and the socket closed.
    """
    sim_app = app if app is not None else SimApp(config)
    hc = _hypercorn_config(_listen_socket(config).detach())
    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(partial(serve, sim_app, hc, mode="asgi"))
        task_status.started(binds[0])


def run_sim_forever(config: SimConfig) -> None:
    """Run the simulator in this thread until interrupted (for ``claimkit sim``).

    Prints one line, ``claimkit sim listening on http://HOST:PORT``, to stdout (flushed)
    once it listens, so a parent process can read the port. Returns quietly on Ctrl-C.

    Raises:
        OSError: the address cannot be bound (the bare error, not an exception group).
    """

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(serve_sim, config)
            print(f"claimkit sim listening on {url}", flush=True)

    try:
        trio.run(main)
    except KeyboardInterrupt:
        pass
    except BaseExceptionGroup as group:
        _, rest = group.split(KeyboardInterrupt)
        if rest is None:
            return
        leaves = list(_leaves(rest))
        if len(leaves) == 1 and isinstance(leaves[0], Exception):
            raise leaves[0] from None  # one failure (a bind error): show it, not the group
        raise


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc
