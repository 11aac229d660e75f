"""Which HTTP path should dispatch use? CPU per request of each candidate client, no Redis.

Each candidate POSTs the peers harness's ~200 B JSON body to the peers gateway (``gateway.js``,
Node, answers at once) from ``--concurrency`` trio tasks that post back to back (the
consumer's worker pattern), ``--n`` requests per run, ``--runs`` runs interleaved round-robin.
The client runs on core 0 and the gateway on core 1 (``taskset``), as in the peers harness.

    python bench/dispatch_paths.py [--n 5000] [--concurrency 50] [--runs 5] [--json out.json]

Prints a table (median requests/s and CPU ms per request over the runs, min-max) and writes
JSON. Candidates:

- ``httpx-default``: ``httpx.AsyncClient(timeout=10)`` (20 idle kept) — what the peers use;
- ``httpx-claimkit-0.1``: claimkit's old client, pool = keep-alive = concurrency;
- ``httpx-keepalive-10``: httpx with at most 10 idle connections kept;
- ``httpcore``: ``httpcore.AsyncConnectionPool`` directly, without httpx's layers;
- ``claimkit-http``: :class:`claimkit.consumer.http.HttpClient` (httptools parser, own pool;
  ``claimkit-h11`` before issue 13 replaced h11);
- ``claimkit-http-handwritten``: the same client with ``bench/_http_handwritten.py``'s pure
  Python response parser in place of the httptools one (the measured alternative);
- ``claimkit-dispatch``: the whole :func:`claimkit.consumer.dispatch.dispatch` on that client
  (headers, URL, §4 decision, terminal record);
- ``raw-floor``: a hand-written HTTP/1.1 exchange on kept-open trio streams (Content-Length
  only, no validation): the floor for any Python client on trio, not a candidate.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _benchutil import PEERS_DIR, free_port, machine, pin_self  # noqa: E402

BODY = json.dumps(
    {
        "id": "req-000000",
        "model": "bench-model",
        "prompt": "The quick brown fox jumps over the lazy dog. " * 3,
        "max_tokens": 16,
    }
).encode()


def cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def run_candidate(name: str, url: str, n: int, conc: int) -> dict[str, float]:
    """Run in a fresh interpreter so one client's garbage does not tax the next."""
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--one",
            name,
            "--url",
            url,
            "--n",
            str(n),
            "--concurrency",
            str(conc),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


Client = tuple[Callable[[], Awaitable[int]], Callable[[], Awaitable[None]]]
"""A candidate's ``post()`` (returns the HTTP status) and ``close()``."""


async def _httpx(name: str, url: str, conc: int) -> Client:
    import httpx

    if name == "httpx-default":
        client = httpx.AsyncClient(timeout=10)
    elif name == "httpx-claimkit-0.1":
        client = httpx.AsyncClient(
            follow_redirects=False,
            limits=httpx.Limits(
                max_connections=conc, max_keepalive_connections=conc, keepalive_expiry=30.0
            ),
            timeout=httpx.Timeout(300.0),
        )
    else:
        client = httpx.AsyncClient(
            timeout=10, limits=httpx.Limits(max_connections=conc, max_keepalive_connections=10)
        )
    headers = {"Content-Type": "application/json"}

    async def post() -> int:
        r = await client.post(url, content=BODY, headers=headers)
        return r.status_code

    async def close() -> None:
        await client.aclose()

    return post, close


async def _httpcore(name: str, url: str, conc: int) -> Client:
    import httpcore

    pool = httpcore.AsyncConnectionPool(max_connections=conc, max_keepalive_connections=conc)
    hdrs = [(b"Content-Type", b"application/json"), (b"Host", url.split("/")[2].encode())]

    async def post() -> int:
        r = await pool.request(
            "POST",
            url,
            headers=hdrs,
            content=BODY,
            extensions={"timeout": {"connect": 10, "read": 10, "write": 10, "pool": 10}},
        )
        return r.status

    async def close() -> None:
        await pool.aclose()

    return post, close


async def _claimkit_http(name: str, url: str, conc: int) -> Client:
    from claimkit.consumer.http import HttpClient

    hc = HttpClient(max_connections=conc)
    hdrs = [(b"Content-Type", b"application/json")]

    async def post() -> int:
        return (await hc.post(url, BODY, hdrs, timeout=10)).status

    async def close() -> None:
        await hc.aclose()

    return post, close


async def _claimkit_http_handwritten(name: str, url: str, conc: int) -> Client:
    import _http_handwritten

    from claimkit.consumer import http

    http.ResponseParser = _http_handwritten.ResponseParser  # type: ignore[misc]
    return await _claimkit_http(name, url, conc)


async def _claimkit_dispatch(name: str, url: str, conc: int) -> Client:
    import random

    from claimkit.consumer.dispatch import Done, Target, dispatch, open_http_client
    from claimkit.protocol.models import Envelope, parse_member

    dc = open_http_client(conc)
    base, _, path = url.partition("/v1/")
    target = Target(base, "/v1/" + path)
    payload = json.loads(BODY)
    member = json.dumps(
        {
            "internal": {},
            "request_kind": "plain",
            "data": {"id": "r", "deadline": int(time.time()) + 3600, "payload": payload},
        }
    ).encode()
    env = parse_member(member)
    assert isinstance(env, Envelope)
    rng = random.Random(1)

    async def post() -> int:
        out = await dispatch(dc, env, target, request_timeout=300, now=time.time(), rng=rng)
        assert isinstance(out, Done)
        return out.record.status_code or 0

    async def close() -> None:
        await dc.aclose()

    return post, close


async def _raw_floor(name: str, url: str, conc: int) -> Client:
    import trio

    host, port = url.split("/")[2].split(":")
    path = "/" + url.split("/", 3)[3]
    request = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(BODY)}\r\n\r\n"
    ).encode() + BODY
    idle: list[trio.SocketStream] = []

    async def post() -> int:
        stream = idle.pop() if idle else await trio.open_tcp_stream(host, int(port))
        await stream.send_all(request)
        buf = b""
        while b"\r\n\r\n" not in buf:
            buf += await stream.receive_some(65536)
        head, _, rest = buf.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            k, _, v = line.partition(b":")
            if k.strip().lower() == b"content-length":
                length = int(v)
        while len(rest) < length:
            rest += await stream.receive_some(65536)
        idle.append(stream)
        return int(head.split(b" ", 2)[1])

    async def close() -> None:
        for s in idle:
            await s.aclose()

    return post, close


_CLIENTS: dict[str, Callable[[str, str, int], Awaitable[Client]]] = {
    "httpx": _httpx,
    "httpcore": _httpcore,
    "claimkit-http": _claimkit_http,
    "claimkit-http-handwritten": _claimkit_http_handwritten,
    "claimkit-dispatch": _claimkit_dispatch,
    "raw-floor": _raw_floor,
}


async def one(name: str, url: str, n: int, conc: int) -> dict[str, float]:
    import trio

    left = [n]
    statuses: dict[int, int] = {}
    family = "httpx" if name.startswith("httpx") else name
    if family not in _CLIENTS:
        raise SystemExit(f"unknown candidate {name}")
    post, close = await _CLIENTS[family](name, url, conc)

    async def loop() -> None:
        while left[0] > 0:
            left[0] -= 1
            status = await post()
            statuses[status] = statuses.get(status, 0) + 1

    # Warm up: open the connections once so connect cost stays out of the window.
    left[0] = conc
    async with trio.open_nursery() as nursery:
        for _ in range(conc):
            nursery.start_soon(loop)
    statuses.clear()
    left[0] = n
    t0, c0 = time.perf_counter(), cpu()
    async with trio.open_nursery() as nursery:
        for _ in range(conc):
            nursery.start_soon(loop)
    dt, used = time.perf_counter() - t0, cpu() - c0
    await close()
    return {
        "name": name,
        "n": n,
        "concurrency": conc,
        "rps": n / dt,
        "cpu_ms_per_req": used / n * 1000,
        "statuses": {str(k): v for k, v in statuses.items()},
    }


CANDIDATES = [
    "httpx-default",
    "httpx-claimkit-0.1",
    "httpx-keepalive-10",
    "httpcore",
    "claimkit-http",
    "claimkit-http-handwritten",
    "claimkit-dispatch",
    "raw-floor",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--concurrency", type=int, default=50)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--candidates", default=",".join(CANDIDATES))
    ap.add_argument("--json", default="bench/results/dispatch_paths.json")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.one:
        import trio

        pin_self(0)
        print(json.dumps(trio.run(one, args.one, args.url, args.n, args.concurrency)))
        return

    port = free_port()
    gw = subprocess.Popen(
        ["taskset", "-c", "1", "node", str(PEERS_DIR / "gateway.js"), str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert gw.stdout is not None and "listening" in gw.stdout.readline()
        url = f"http://127.0.0.1:{port}/v1/completions"
        names = args.candidates.split(",")
        results: dict[str, list[dict[str, float]]] = {k: [] for k in names}
        for rep in range(args.runs):
            for name in names:
                r = run_candidate(name, url, args.n, args.concurrency)
                results[name].append(r)
                print(
                    f"  run {rep + 1} {name:20s} {r['rps']:8.0f} req/s "
                    f"{r['cpu_ms_per_req']:.3f} ms CPU/req",
                    file=sys.stderr,
                )
    finally:
        gw.terminate()
        gw.wait()

    rows = []
    print(f"\n{args.runs} runs each, n={args.n}, concurrency={args.concurrency}; medians (min-max)")
    print("| client | requests/s | CPU ms/request |\n|---|---:|---:|")
    for name in names:
        rs = [r["rps"] for r in results[name]]
        cs = [r["cpu_ms_per_req"] for r in results[name]]
        row = {
            "client": name,
            "rps_median": statistics.median(rs),
            "rps_min": min(rs),
            "rps_max": max(rs),
            "cpu_ms_median": statistics.median(cs),
            "cpu_ms_min": min(cs),
            "cpu_ms_max": max(cs),
        }
        rows.append(row)
        print(
            f"| {name} | {row['rps_median']:,.0f} ({min(rs):,.0f}-{max(rs):,.0f}) | "
            f"{row['cpu_ms_median']:.3f} ({min(cs):.3f}-{max(cs):.3f}) |"
        )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(
        json.dumps(
            {
                "machine": machine(),
                "n": args.n,
                "concurrency": args.concurrency,
                "runs": results,
                "summary": rows,
            },
            indent=1,
        )
    )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
