"""A gateway outage, end to end: `claimkit serve` with its gateway port closed, then opened.

A private Redis server, ``--requests`` requests submitted, one ``claimkit serve`` whose
``igw_base_url`` names a free local port nothing listens on. Once its ``/readyz`` says the
breaker opened, the outage lasts ``--outage`` seconds more (30 by default); then
``claimkit sim`` starts on that port. The script prints one JSON object:

- ``records_during_outage``: the most terminal records the result list held at any sample
  during the outage (sampled every 0.1 s; 0 is the point);
- ``readyz_during_outage``: the distinct ``/readyz`` answers seen during the outage;
- ``warnings``: the WARNING lines serve logged over the whole run;
- ``unsent``: attempts handed back (``async_gateway_unsent_total``);
- ``seconds_to_first_record`` / ``seconds_to_all_records``: from the sim's start to the
  first record and to the last one (claiming resumes at the next probe, at most 5 s
  after the gateway is back);
- ``records``, ``status_codes``: the records at the end (one 200 per request expected).

Usage: ``python bench/gateway_outage.py [--requests 200] [--outage 30]``.
Figures: docs/dispatch.md, "The gateway is unreachable".
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import trio
from _benchutil import free_port

from claimkit.dev.redis_server import RedisServer
from claimkit.producer import Producer
from claimkit.store import open_store

CLAIMKIT = str(Path(sys.executable).with_name("claimkit"))
Q = "requests"


def metric(text: str, name: str) -> float:
    found = re.findall(rf"^llm_d_async_{name}{{[^}}]*}} (\S+)$", text, re.MULTILINE)
    return float(found[0]) if found else float("nan")


async def ready(http: httpx.AsyncClient, url: str) -> tuple[int, str]:
    try:
        resp = await http.get(url)
    except httpx.TransportError:
        return 0, "not listening"
    return resp.status_code, resp.text.strip()


async def run(requests: int, outage: float, workdir: Path) -> dict[str, Any]:
    gport, mport, hport = free_port(), free_port(), free_port()
    config = {
        "poll_interval_ms": 50,
        "metrics_port": mport,
        "health_port": hport,
        "queues": [{"queue_name": Q, "igw_base_url": f"http://127.0.0.1:{gport}"}],
    }
    log = workdir / "serve.log"
    with RedisServer() as redis:
        env = {**os.environ, "REDIS_URL": redis.url}
        async with open_store(redis.url) as store, httpx.AsyncClient() as http:
            sec = int((await store.command("TIME"))[0])
            await Producer(store, Q).submit_many(
                [
                    {"id": f"r{i:05d}", "deadline": sec + 3600, "payload": {"id": f"r{i:05d}"}}
                    for i in range(requests)
                ]
            )
            with log.open("w") as err:
                serve = await trio.lowlevel.open_process(
                    [CLAIMKIT, "serve", "--transport-config", json.dumps(config)],
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    env=env,
                )
            sim: trio.Process | None = None
            try:
                readyz = f"http://127.0.0.1:{hport}/readyz"
                opened = (503, f"gateway unreachable: {Q}")
                with trio.fail_after(60):
                    # Another process's endpoint: there is nothing to wait on but polling.
                    while await ready(http, readyz) != opened:  # noqa: ASYNC110
                        await trio.sleep(0.05)
                seen: set[tuple[int, str]] = set()
                most = 0
                end = trio.current_time() + outage
                while trio.current_time() < end:
                    most = max(most, int(await store.command("LLEN", "result-list")))
                    seen.add(await ready(http, readyz))
                    await trio.sleep(0.1)
                with (workdir / "sim.log").open("w") as out:
                    sim = await trio.lowlevel.open_process(
                        [CLAIMKIT, "sim", "--port", str(gport)],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    )
                started = trio.current_time()
                first = None
                with trio.fail_after(120):
                    while (n := int(await store.command("LLEN", "result-list"))) < requests:
                        if n and first is None:
                            first = trio.current_time() - started
                        await trio.sleep(0.02)
                done = trio.current_time() - started
                metrics = (await http.get(f"http://127.0.0.1:{mport}/metrics")).text
                records = [
                    json.loads(r) for r in await store.command("LRANGE", "result-list", 0, -1)
                ]
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(30):
                    for proc in (serve, sim):
                        if proc is not None:
                            proc.terminate()
                            await proc.wait()
    lines = log.read_text().splitlines()
    return {
        "requests": requests,
        "outage_seconds": outage,
        "records_during_outage": most,
        "readyz_during_outage": sorted(f"{code} {body}" for code, body in seen),
        "warnings": [line.split(" ", 2)[2] for line in lines if " WARNING " in line],
        "breaker_lines": [line.split(" ", 2)[2] for line in lines if "gateway for" in line],
        "unsent": metric(metrics, "async_gateway_unsent_total"),
        "breaker_open_after": metric(metrics, "async_gateway_breaker_open"),
        "seconds_to_first_record": round(first if first is not None else done, 2),
        "seconds_to_all_records": round(done, 2),
        "records": len(records),
        "distinct_ids": len({r["id"] for r in records}),
        "status_codes": dict(Counter(str(r.get("status_code")) for r in records)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--outage", type=float, default=30.0, help="seconds after the opening")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = trio.run(run, args.requests, args.outage, Path(tmp))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
