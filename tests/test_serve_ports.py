"""`claimkit serve`'s metrics and health ports against hostile clients, and its port clashes.

Every test runs a real `claimkit serve` process against the test's Redis and talks to its
ports over real sockets (docs/operations.md, "Ports and probes").
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
import pytest
import trio

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

pytestmark = pytest.mark.slow

CLAIMKIT = str(Path(sys.executable).with_name("claimkit"))
HOST = "127.0.0.1"
CONFIG = json.dumps({"queues": [{"queue_name": "requests", "igw_base_url": "http://127.0.0.1:9"}]})
SERVE = (CLAIMKIT, "serve", "--transport-config", CONFIG)
HALF_SENT = b"GET /healthz HTTP/1.1\r\nHost: claimkit\r\nX-Slow: "
TIMEOUT = 60
T = TypeVar("T")


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a thread, given up on (and the test failed) at the ``fail_after``."""
    return await trio.to_thread.run_sync(partial(fn, *args), abandon_on_cancel=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def at_least_fds(n: int) -> None:
    """Raise this process's soft descriptor limit to ``n`` (the serve child inherits it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < n:
        if hard != resource.RLIM_INFINITY and hard < n:
            pytest.skip(f"needs {n} file descriptors, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))


class Serve:
    def __init__(self, proc: subprocess.Popen[bytes], log: Path, metrics: int, health: int):
        self.proc, self.log, self.metrics, self.health = proc, log, metrics, health

    def get(self, port: int, path: str) -> httpx.Response:
        with httpx.Client(timeout=10) as http:
            return http.get(f"http://{HOST}:{port}{path}")


@contextmanager
def serving(redis_url: str, tmp_path: Path, *flags: str, one_port: bool = False) -> Iterator[Serve]:
    """`claimkit serve` on two free ports of 127.0.0.1 (one for both servers if
    ``one_port``), once /readyz says 200."""
    metrics = free_port()
    health = metrics if one_port else free_port()
    log = tmp_path / "serve.log"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [
                CLAIMKIT,
                "serve",
                "--transport-config",
                CONFIG,
                "--http-host",
                HOST,
                "--metrics-port",
                str(metrics),
                "--health-port",
                str(health),
                *flags,
            ],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env={**os.environ, "REDIS_URL": redis_url},
        )
    try:
        server = Serve(proc, log, metrics, health)
        end = time.monotonic() + TIMEOUT
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if server.get(health, "/readyz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < end, log.read_text()
            time.sleep(0.05)
        yield server
    finally:
        proc.kill()
        proc.wait(10)


def connect(port: int, first: bytes = b"") -> socket.socket:
    sock = socket.create_connection((HOST, port), timeout=10)
    if first:
        sock.sendall(first)
    return sock


def reply_to(port: int, data: bytes) -> bytes:
    """Everything the server sends back on one connection to ``data`` until it closes."""
    with connect(port) as sock:
        try:
            sock.sendall(data)
        except OSError:
            pass  # the server answered and closed before taking it all: read what it said
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except ConnectionResetError:
            pass
        return out


def answered_once(
    sock: socket.socket,
    expected: bytes,
    request: bytes = b"GET /healthz HTTP/1.1\r\nHost: claimkit\r\n\r\n",
) -> bool:
    """Whether one kept-alive request on ``sock`` is answered with a reply that starts
    (a scrape) or ends (a probe) with ``expected``: the server accepted it and holds a slot
    for it. No, when the server closed it at once because a probe's connection still held
    the slot (the close may come as a reset)."""
    # The answer may come in several reads (hypercorn writes the head and the body apart;
    # on a loaded machine the client can wake between them): read until it is complete.
    answer = b""
    try:
        sock.sendall(request)
        while not (answer.startswith(expected) or answer.endswith(expected)):
            chunk = sock.recv(65536)
            if not chunk:
                return False  # closed at once: the slot was still taken
            answer += chunk
            if len(answer) > 1 << 20:
                return False
    except OSError:
        return False
    return True


def status_line(reply: bytes) -> bytes:
    return reply.split(b"\r\n", 1)[0]


def still_open(sock: socket.socket) -> bool:
    """Whether the server has neither closed nor answered this connection."""
    sock.setblocking(False)
    try:
        sock.recv(1)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        sock.setblocking(True)
    return False


def probes_answer(server: Serve) -> None:
    healthz = server.get(server.health, "/healthz")
    assert (healthz.status_code, healthz.text) == (200, "ok\n")
    readyz = server.get(server.health, "/readyz")
    assert (readyz.status_code, readyz.text) == (200, "ok\n")
    scrape = server.get(server.metrics, "/metrics")
    assert scrape.status_code == 200
    assert 'llm_d_async_async_claim_depth{pool_name="",queue_id="requests"' in scrape.text


async def test_probes_and_scrape_answer_past_400_idle_and_half_sent_connections(
    redis_url: str, tmp_path: Path
) -> None:
    at_least_fds(2048)
    # A long idle timeout: every hostile connection stays open until the probes are done.
    with trio.fail_after(TIMEOUT), ExitStack() as stack:
        server = stack.enter_context(serving(redis_url, tmp_path, "--http-idle-timeout", "300"))

        def open_hostile() -> list[socket.socket]:
            socks = []
            for port in (server.health, server.metrics):
                for _ in range(100):
                    socks.append(stack.enter_context(connect(port)))
                    socks.append(stack.enter_context(connect(port, HALF_SENT)))
            return socks

        hostile = await in_thread(open_hostile)
        assert len(hostile) == 400
        await in_thread(probes_answer, server)

        too_large = b"GET /healthz HTTP/1.1\r\nHost: claimkit\r\nX-Big: " + b"a" * 65536
        for port in (server.health, server.metrics):
            # One head over 16 KiB whole, one sent on and on: 431, then closed.
            for head in (too_large + b"\r\n\r\n", too_large * 16):
                reply = await in_thread(reply_to, port, head)
                assert status_line(reply) == b"HTTP/1.1 431 "
            for garbage in (b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03\r\n\r\n", b"\0" * 8):
                reply = await in_thread(reply_to, port, garbage + b"\r\n\r\n")
                assert status_line(reply) == b"HTTP/1.1 400 "
        await in_thread(probes_answer, server)
        assert [s for s in hostile if not still_open(s)] == []
        # A stop is not held up by them either.
        server.proc.send_signal(signal.SIGTERM)
        assert await in_thread(server.proc.wait, TIMEOUT) == 0
    assert "Traceback" not in server.log.read_text()


async def test_idle_and_slow_connections_are_closed_after_the_idle_timeout(
    redis_url: str, tmp_path: Path
) -> None:
    with (
        trio.fail_after(TIMEOUT),
        serving(redis_url, tmp_path, "--http-idle-timeout", "0.5") as server,
    ):

        def sees_eof(sock: socket.socket, dribble: bool = False) -> bytes:
            """What the server sent before closing: the socket must see EOF."""
            sock.settimeout(0.2 if dribble else 30)
            out = b""
            while True:
                try:
                    chunk = sock.recv(65536)
                except TimeoutError:
                    try:
                        sock.sendall(b"a")  # a slowloris: a byte at a time, never a whole head
                    except (BrokenPipeError, ConnectionResetError):
                        return out
                    continue
                except ConnectionResetError:
                    return out
                if not chunk:
                    return out
                out += chunk

        with connect(server.health) as idle:
            assert await in_thread(sees_eof, idle) == b""
        with connect(server.metrics, HALF_SENT) as half:
            assert await in_thread(sees_eof, half) == b""
        with connect(server.health, HALF_SENT) as slow:
            assert await in_thread(sees_eof, slow, True) == b""
        # A kept-alive connection is answered, then closed once idle.
        with connect(server.health, b"GET /healthz HTTP/1.1\r\nHost: claimkit\r\n\r\n") as kept:
            reply = await in_thread(sees_eof, kept)
            assert status_line(reply) == b"HTTP/1.1 200 "
            assert reply.endswith(b"\r\n\r\nok\n")
        await in_thread(probes_answer, server)


def sees_eof(sock: socket.socket) -> bool:
    """Whether the server closes ``sock`` (within 30 s) without sending anything more."""
    sock.settimeout(30)
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


async def test_past_the_bound_the_oldest_connection_is_closed_and_the_new_one_answered(
    redis_url: str, tmp_path: Path
) -> None:
    with (
        trio.fail_after(TIMEOUT),
        serving(
            redis_url, tmp_path, "--http-max-connections", "3", "--http-idle-timeout", "300"
        ) as server,
        ExitStack() as stack,
    ):

        def hold() -> socket.socket:
            """A kept-alive connection the server has answered, so surely holds a slot (a
            probe's connection still holding one is the oldest, so the third evicts it)."""
            sock = stack.enter_context(connect(server.health))
            assert answered_once(sock, b"\r\n\r\nok\n")
            return sock

        held = [await in_thread(hold) for _ in range(3)]
        # The fourth, on either server, is answered; the oldest held connection is closed.
        fourth = stack.enter_context(connect(server.metrics))
        scrape = b"GET /metrics HTTP/1.1\r\nHost: claimkit\r\n\r\n"
        assert await in_thread(answered_once, fourth, b"HTTP/1.1 200 ", scrape)
        assert await in_thread(sees_eof, held[0])
        assert [still_open(sock) for sock in held[1:]] == [True, True]
        for sock in held[1:]:
            assert await in_thread(answered_once, sock, b"\r\n\r\nok\n")
    # Once a minute: the first eviction's line, the fourth's (on the metrics server) or the
    # readiness probe's connection's, if it still held a slot when the third was admitted.
    said = "has 3 connections open, its bound (--http-max-connections); closed the oldest to "
    said += "admit a new one"
    lines = [line for line in server.log.read_text().splitlines() if "connections open" in line]
    assert [line.split("claimkit: ", 1)[1] for line in lines] in (
        [f"the /metrics server on {HOST}:{server.metrics} {said}"],
        [f"the /healthz and /readyz server on {HOST}:{server.health} {said}"],
    )


async def test_past_the_bound_a_silent_connection_is_closed_before_an_older_busy_one(
    redis_url: str, tmp_path: Path
) -> None:
    """Bound 3: one answered keep-alive connection (the oldest), then two that send nothing.
    A fourth is admitted by closing the older SILENT one, not the oldest: a probe that has
    sent its request is never pushed out by idle sockets opened after it. All on one port,
    so one accept loop admits them in the order they connected."""
    with (
        trio.fail_after(TIMEOUT),
        serving(
            redis_url, tmp_path, "--http-max-connections", "3", "--http-idle-timeout", "300"
        ) as server,
        ExitStack() as stack,
    ):
        busy = stack.enter_context(connect(server.health))
        assert await in_thread(answered_once, busy, b"\r\n\r\nok\n")
        silent = [stack.enter_context(connect(server.health)) for _ in range(2)]
        fourth = stack.enter_context(connect(server.health))
        assert await in_thread(answered_once, fourth, b"\r\n\r\nok\n")
        assert await in_thread(sees_eof, silent[0])
        # The busy one stays, though it is the oldest. (silent[1] stays too, unless the
        # readiness probe's closed connection still held a slot: then it went as well.)
        assert still_open(busy)
        assert await in_thread(answered_once, busy, b"\r\n\r\nok\n")


# 80 idle connections to a port, each re-opened as soon as the server closes it, until
# stdin closes (or 40 s); prints "opened" once all are open, then how many it re-opened.
FLOOD = r"""
import selectors, socket, sys, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sel = selectors.DefaultSelector()
for _ in range(n):
    sel.register(socket.create_connection((host, port)), selectors.EVENT_READ)
sel.register(sys.stdin, selectors.EVENT_READ)
print("opened", flush=True)
reopened, end = 0, time.monotonic() + 40
while time.monotonic() < end:
    events = sel.select(timeout=0.01)
    if any(key.fileobj is sys.stdin for key, _ in events):
        break
    for key, _ in events:
        sel.unregister(key.fileobj)
        key.fileobj.close()
        sel.register(socket.create_connection((host, port)), selectors.EVENT_READ)
        reopened += 1
print(reopened, flush=True)
"""


async def test_the_liveness_probe_holds_while_the_metrics_port_is_flooded(
    redis_url: str, tmp_path: Path
) -> None:
    at_least_fds(1024)
    with (
        trio.fail_after(TIMEOUT),
        serving(redis_url, tmp_path, "--http-max-connections", "50") as server,
    ):

        def probe_all() -> list[tuple[str, int, str]]:
            answers = []
            for _ in range(20):
                for path in ("/healthz", "/readyz"):
                    try:
                        reply = server.get(server.health, path)
                        answers.append((path, reply.status_code, reply.text))
                    except httpx.TransportError as exc:
                        answers.append((path, 0, repr(exc)))
            return answers

        # The flood is a process of its own, as a real one is: in this process it would
        # share the GIL with the probes and stall them between connect and send.
        with subprocess.Popen(
            [sys.executable, "-c", FLOOD, HOST, str(server.metrics), "80"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        ) as flooder:  # closes the pipes and waits for it
            try:
                assert flooder.stdout is not None
                assert flooder.stdin is not None
                assert await in_thread(flooder.stdout.readline) == "opened\n"
                answers = await in_thread(probe_all)
                flooder.stdin.close()  # the flood's signal to stop and say its count
                evictions = int(await in_thread(flooder.stdout.readline))
                assert await in_thread(flooder.wait, TIMEOUT) == 0
            finally:
                if flooder.poll() is None:
                    flooder.kill()
    # What a kubelet acts on: it restarts the pod after failureThreshold (default 3) failed
    # probes in a row. Every answer that came is the right one; at most 2 of the 40 probes
    # were cut (the full suite on a loaded 2-core machine saw one, never two in a row),
    # and never two in a row of one path, so no kubelet would ever restart the consumer.
    assert all(a == (a[0], 200, "ok\n") for a in answers if a[1] != 0), answers
    assert [a[0] for a in answers] == [p for _ in range(20) for p in ("/healthz", "/readyz")]
    cut = [i for i, a in enumerate(answers) if a[1] == 0]
    assert len(cut) <= 2, answers
    assert all(j - i != 2 for i in cut for j in cut), answers  # two in a row of one path
    assert evictions >= 30  # the flood was on: 30 of the 80 were closed at least once


def request(method: str, path: str) -> bytes:
    return f"{method} {path} HTTP/1.1\r\nHost: claimkit\r\nConnection: close\r\n\r\n".encode()


async def test_only_get_and_head_on_a_served_path_are_answered(
    redis_url: str, tmp_path: Path
) -> None:
    not_found = b"HTTP/1.1 404 "
    not_allowed = b"HTTP/1.1 405 "
    for one_port in (False, True):
        with (
            trio.fail_after(TIMEOUT),
            serving(redis_url, tmp_path, one_port=one_port) as server,
        ):
            metrics_cases = [("GET", "/nope"), ("GET", "/"), ("GET", "/metrics/")]
            health_cases = [("GET", "/"), ("GET", "/healthz/x"), ("POST", "/nope")]
            if not one_port:
                metrics_cases += [("GET", "/healthz"), ("GET", "/readyz")]
                health_cases += [("GET", "/metrics")]
            for port, cases in ((server.metrics, metrics_cases), (server.health, health_cases)):
                for method, path in cases:
                    reply = await in_thread(reply_to, port, request(method, path))
                    assert (method, path, status_line(reply)) == (method, path, not_found)
                    assert reply.endswith(b"\r\n\r\nnot found\n")
            for port, path in (
                (server.metrics, "/metrics"),
                (server.health, "/healthz"),
                (server.health, "/readyz"),
            ):
                for method in ("DELETE", "POST", "PUT", "OPTIONS"):
                    reply = await in_thread(reply_to, port, request(method, path))
                    assert (method, path, status_line(reply)) == (method, path, not_allowed)
                    assert b"\r\nallow: GET, HEAD\r\n" in reply
                    assert reply.endswith(b"\r\n\r\nmethod not allowed\n")
                head = await in_thread(reply_to, port, request("HEAD", path))
                assert (path, status_line(head)) == (path, b"HTTP/1.1 200 ")
                assert head.endswith(b"\r\n\r\n")  # the head only
                got = await in_thread(reply_to, port, request("GET", path))
                assert (path, status_line(got)) == (path, b"HTTP/1.1 200 ")
            await in_thread(probes_answer, server)


async def test_a_client_that_never_reads_its_answers_is_closed(
    redis_url: str, tmp_path: Path
) -> None:
    with (
        trio.fail_after(TIMEOUT),
        serving(
            redis_url, tmp_path, "--http-max-connections", "1", "--http-idle-timeout", "0.5"
        ) as server,
    ):

        def stall() -> socket.socket:
            """A connection holding the only slot (answered once), then sending requests for
            /metrics on and on and reading none of the answers."""
            scrape = b"GET /metrics HTTP/1.1\r\nHost: claimkit\r\n\r\n"
            while True:
                sock = socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.settimeout(10)
                sock.connect((HOST, server.metrics))
                if answered_once(sock, b"HTTP/1.1 200 ", scrape):
                    break
                sock.close()  # a probe's connection still held the slot: again
                time.sleep(0.05)
            try:
                sock.sendall(scrape * 5000)  # far more answers than the socket buffers hold
            except OSError:
                pass  # the server gave up on it already
            return sock

        def answered() -> None:
            while True:
                try:
                    probes_answer(server)
                    return
                except httpx.TransportError:
                    time.sleep(0.05)  # until the server has given up on the stalled one

        with await in_thread(stall):
            await in_thread(answered)


@pytest.mark.parametrize(
    ("taken", "paths", "flag"),
    [
        ("metrics", "/metrics", "--metrics-port (config metrics_port)"),
        ("health", "/healthz and /readyz", "--health-port (config health_port)"),
    ],
)
def test_a_port_clash_names_the_address_port_and_flag(
    redis_url: str, taken: str, paths: str, flag: str
) -> None:
    with socket.socket() as holder:
        holder.bind((HOST, 0))
        holder.listen()
        port = holder.getsockname()[1]
        ports = {"metrics": free_port(), "health": free_port(), taken: port}
        done = subprocess.run(
            [
                CLAIMKIT,
                "serve",
                "--transport-config",
                CONFIG,
                "--http-host",
                HOST,
                "--metrics-port",
                str(ports["metrics"]),
                "--health-port",
                str(ports["health"]),
            ],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            env={**os.environ, "REDIS_URL": redis_url},
        )
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        f"claimkit: cannot listen on {HOST}:{port} for {paths}: address already in use; "
        f"set {flag} to a free port, or 0 to turn that server off"
    ]


def test_one_port_for_both_servers_names_both_flags(redis_url: str) -> None:
    with socket.socket() as holder:
        holder.bind((HOST, 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = subprocess.run(
            [*SERVE, "--http-host", HOST, "--metrics-port", str(port), "--health-port", str(port)],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            env={**os.environ, "REDIS_URL": redis_url},
        )
    assert (done.returncode, done.stderr.splitlines()) == (
        1,
        [
            f"claimkit: cannot listen on {HOST}:{port} for /metrics, /healthz and /readyz: "
            "address already in use; set --metrics-port and --health-port (config metrics_port,"
            " health_port) to a free port, or 0 to turn that server off"
        ],
    )


@pytest.mark.parametrize(
    ("host", "line"),
    [
        (
            "localhost",
            "claimkit: http_host must be an IP address such as 0.0.0.0, 127.0.0.1 or ::, "
            'got "localhost"',
        ),
        (
            # TEST-NET-1 (RFC 5737): an address no host here owns.
            "192.0.2.1",
            "claimkit: cannot listen on 192.0.2.1:{port} for /healthz and /readyz: cannot "
            "assign requested address; set --http-host (config http_host) to an address of "
            "this host",
        ),
    ],
)
def test_a_bind_address_that_cannot_be_bound_is_one_line(
    redis_url: str, host: str, line: str
) -> None:
    port = free_port()
    done = subprocess.run(
        [*SERVE, "--http-host", host, "--metrics-port", "0", "--health-port", str(port)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env={**os.environ, "REDIS_URL": redis_url},
    )
    assert (done.returncode, done.stderr.splitlines()) == (1, [line.format(port=port)])


def test_http_fields_in_the_config_and_their_defaults() -> None:
    from claimkit.config import ConfigError, load_config

    url = {"url": "redis://127.0.0.1:1/0"}
    plain = load_config(inline=CONFIG, flags=url)
    assert (plain.http_host, plain.http_idle_timeout_seconds, plain.http_max_connections) == (
        "0.0.0.0",
        5.0,
        512,
    )
    doc = {**json.loads(CONFIG), "http_host": "::", "http_idle_timeout_seconds": 0.25}
    set_ = load_config(inline=json.dumps(doc), flags={**url, "http_max_connections": 7})
    assert (set_.http_host, set_.http_idle_timeout_seconds, set_.http_max_connections) == (
        "::",
        0.25,
        7,
    )
    assert set_.unknown_fields == ()
    for bad in ("localhost", "", 5, "0.0.0.0:80"):
        doc = {**json.loads(CONFIG), "http_host": bad}
        with pytest.raises(ConfigError) as refused:
            load_config(inline=json.dumps(doc), flags=url)
        assert str(refused.value) == (
            "http_host must be an IP address such as 0.0.0.0, 127.0.0.1 or ::,"
            f" got {json.dumps(bad)}"
        )


def test_a_sim_port_clash_names_the_flag() -> None:
    with socket.socket() as holder:
        holder.bind((HOST, 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = subprocess.run(
            [CLAIMKIT, "sim", "--port", str(port)], capture_output=True, text=True, timeout=TIMEOUT
        )
    assert (done.returncode, done.stdout, done.stderr.splitlines()) == (
        1,
        "",
        [
            f"claimkit: cannot listen on {HOST}:{port}: address already in use; "
            "pass another --port, or 0 for a free one"
        ],
    )
