"""Test support: a gateway that holds every completion until the test lets it answer.

A test that must act while consumers hold claims (run ``claimkit drain``, SIGKILL a
consumer) cannot count on a latency to keep the work going: starting a subprocess can take
longer than the work, and then the claims are gone before the act (the flake of issue 8).
:class:`HeldGateway` answers no completion until :meth:`HeldGateway.release`, so every
claim a consumer sent on is held, by construction, for as long as the test needs.

It is the standard library's threading HTTP server (one thread per connection, HTTP/1.1
keep-alive), in the test process; the consumers under test reach it over loopback.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterator

HOLD_LIMIT = 120.0
"""Seconds a held request waits at most (a test that forgot to release still ends)."""


class HeldGateway:
    """An OpenAI-shaped completions endpoint whose answers wait for :meth:`release`.

    Every ``POST`` is counted on arrival by the string ``id`` of its JSON body (the tests
    put the request id there), then held; once released, it and every later request is
    answered ``200`` with a small completion document at once.
    """

    def __init__(self) -> None:
        self._released = threading.Event()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._calls: Counter[str] = Counter()
        gateway = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as a real gateway

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                rid = gateway._arrived(body)
                gateway._released.wait(HOLD_LIMIT)
                doc = {
                    "id": rid,
                    "object": "text_completion",
                    "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
                }
                payload = json.dumps(doc).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # no access log on the test's stderr

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            # A consumer opens its connections together (a poll round wakes a worker per
            # request): socketserver's listen backlog of 5 would drop SYNs and delay some
            # connects by seconds of SYN retries. Gateways listen with 511 (Node) to 2048.
            request_queue_size = 512

            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # a consumer SIGKILLed while held: its answer meets a closed socket

        self._server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _arrived(self, body: bytes) -> str:
        try:
            doc = json.loads(body)
        except ValueError:
            doc = None
        rid = doc.get("id") if isinstance(doc, dict) else None
        rid = rid if isinstance(rid, str) else ""
        with self._changed:
            self._calls[rid] += 1
            self._changed.notify_all()
        return rid

    def calls(self) -> Counter[str]:
        """Requests received so far, by request id (whether answered yet or not)."""
        with self._lock:
            return Counter(self._calls)

    def wait_arrivals(self, count: int, timeout: float) -> Counter[str]:
        """Wait until ``count`` requests have arrived; return :meth:`calls`.

        Raises:
            AssertionError: fewer arrived within ``timeout`` seconds, or more than ``count``
                (a test's exact expectation broken).
        """
        deadline = time.monotonic() + timeout
        with self._changed:
            while sum(self._calls.values()) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    got = sum(self._calls.values())
                    raise AssertionError(f"{got} of {count} requests reached the gateway")
                self._changed.wait(left)
            calls = Counter(self._calls)
        assert sum(calls.values()) == count, calls
        return calls

    def release(self) -> None:
        """Answer every held request, and every later one at once."""
        self._released.set()

    def close(self) -> None:
        """Release what is held and stop serving (idempotent)."""
        self._released.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)


@contextmanager
def held_gateway() -> Iterator[HeldGateway]:
    """A :class:`HeldGateway`, closed on exit."""
    gateway = HeldGateway()
    try:
        yield gateway
    finally:
        gateway.close()
