"""Payload references against inline payloads: memory of the pending set, and the cost of
a peek + claim (+ the payload fetch) and of the ack, per batch of 10.

A private ``redis-server`` (never the shared one on 6379), AOF off. For each layout the
queue is filled with ``--requests`` members whose payload is ``--payload-kb`` KiB of
prompt text:

- ``inline``: the payload in the member's ``data.payload``, as claimkit's producer writes it;
- ``ref``: upstream's ``WithPayloadKeys`` layout, written directly here: the member with
  ``"payload":null`` and ``internal.payload_ref``, the payload in its
  ``request-payload:<id>:<token>`` key (one pipeline of ``SET ... PX`` + ``ZADD``).

Then the consumer's protocol calls drain it in batches of 10 (``QueueOps``, the calls a
consumer makes, no HTTP): peek, parse, claim, fetch the payloads (ref only), ack. Reported:
``MEMORY USAGE`` of the pending set (``SAMPLES 0``: exact) and the server's
``used_memory`` with the queue full; per batch, the median wall time of peek+claim(+fetch)
and of the ack; and the bytes sent to or read from Redis per request by those calls
(member bytes in the peek reply, the claim's and the ack's ARGV, the fetched payload).
Figures are medians over ``--runs`` runs (the machine is shared: say so when quoting them).

    python bench/payload_refs.py [--requests 1000] [--payload-kb 100] [--runs 3] \
        [--json bench/results/payload_refs.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import redis  # noqa: E402  (sync client for set-up and INFO; the protocol uses coredis)
import trio  # noqa: E402
from _benchutil import machine  # noqa: E402

from claimkit.dev.redis_server import RedisServer  # noqa: E402
from claimkit.protocol.keys import request_payload  # noqa: E402
from claimkit.protocol.models import Envelope, TerminalRecord, parse_member  # noqa: E402
from claimkit.protocol.ops import AckItem, QueueOps, new_token  # noqa: E402
from claimkit.store import open_store  # noqa: E402

Q = "bench"
RESULTS = "bench-results"
BATCH = 10


def payload(i: int, kib: int) -> bytes:
    text = ("lorem ipsum " * (kib * 1024 // 12 + 1))[: kib * 1024]
    return json.dumps({"model": "m", "prompt": f"{i} {text}"}, separators=(",", ":")).encode()


def fill(client: redis.Redis, layout: str, n: int, kib: int, deadline: int) -> int:
    """Fill the queue; returns the payload bytes written (inline or in keys)."""
    pipe = client.pipeline(transaction=False)
    written = 0
    for i in range(n):
        rid, token = f"req-{i:06d}", f"{i:032x}"
        body = payload(i, kib)
        written += len(body)
        internal: dict[str, Any] = {"request_token": token, "result_queue_name": RESULTS}
        data: dict[str, Any] = {"id": rid, "created": deadline - 60, "deadline": deadline}
        if layout == "ref":
            internal["payload_ref"] = request_payload(rid, token)
            data["payload"] = None
            pipe.set(internal["payload_ref"], body, px=3_600_000)
            member = json.dumps(
                {"internal": internal, "request_kind": "plain", "data": data},
                separators=(",", ":"),
            ).encode()
        else:
            member = (
                json.dumps(
                    {"internal": internal, "request_kind": "plain", "data": data},
                    separators=(",", ":"),
                )[:-2].encode()
                + b',"payload":'
                + body
                + b"}}"
            )
        pipe.zadd(Q, {member: deadline})
        if i % 100 == 99:
            pipe.execute()
    pipe.execute()
    return written


async def drain(url: str, layout: str) -> dict[str, Any]:
    """Peek, claim (+ fetch), ack in batches of 10 until the queue is empty."""
    claim_s: list[float] = []
    ack_s: list[float] = []
    moved = 0  # bytes to or from Redis in those calls
    requests = 0
    async with open_store(url) as store:
        ops = QueueOps(store, Q, dedup_ttl=600)
        while True:
            t0 = time.perf_counter()
            members = await ops.peek(BATCH)
            if not members:
                break
            envs = [e for e in map(parse_member, members) if isinstance(e, Envelope)]
            pairs = [(env, new_token()) for env in envs]
            await ops.claim(pairs, 300)
            bodies: list[bytes | None] = []
            if layout == "ref":
                bodies = await ops.fetch_payloads([env.payload_ref or "" for env in envs])
            claim_s.append(time.perf_counter() - t0)
            moved += sum(len(m) for m in members) * 2  # read by the peek, sent by the claim
            moved += sum(len(b or b"") for b in bodies)
            items = [
                AckItem(
                    env.id,
                    token,
                    env.request_token,
                    RESULTS,
                    TerminalRecord.http(env.id, 200, "{}", env.request_token).to_json(),
                    env.raw,
                    env.payload_ref or "",
                )
                for env, token in pairs
            ]
            t1 = time.perf_counter()
            await ops.ack(items)
            ack_s.append(time.perf_counter() - t1)
            moved += sum(len(it.member) + len(it.record) for it in items)
            requests += len(envs)
    return {
        "requests": requests,
        "peek_claim_fetch_ms_per_batch": statistics.median(claim_s) * 1000,
        "ack_ms_per_batch": statistics.median(ack_s) * 1000,
        "kib_moved_per_request": moved / requests / 1024,
    }


def measure(server: RedisServer, layout: str, n: int, kib: int) -> dict[str, Any]:
    client = redis.Redis.from_url(server.url)
    client.flushall()
    base = int(client.info("memory")["used_memory"])
    deadline = int(client.time()[0]) + 3600
    fill(client, layout, n, kib, deadline)
    out: dict[str, Any] = {
        "pending_set_mib": int(client.memory_usage(Q, samples=0) or 0) / 2**20,
        "used_memory_mib": (int(client.info("memory")["used_memory"]) - base) / 2**20,
    }
    out |= trio.run(drain, server.url, layout)
    leftover = len(client.keys("request-payload:*"))
    assert leftover == 0, f"{leftover} payload keys left after the acks"
    assert client.zcard(Q) == 0
    client.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--payload-kb", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results: dict[str, dict[str, Any]] = {}
    with RedisServer(aof="off") as server:
        for layout in ("inline", "ref"):
            runs = [
                measure(server, layout, args.requests, args.payload_kb) for _ in range(args.runs)
            ]
            results[layout] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(
        f"payload refs: {args.requests} requests of {args.payload_kb} KiB, batches of {BATCH}, "
        f"median of {args.runs} runs"
    )
    header = (
        f"{'layout':8} {'pending set MiB':>16} {'used_memory MiB':>16} "
        f"{'peek+claim(+fetch) ms':>22} {'ack ms':>8} {'KiB moved/request':>18}"
    )
    print(header)
    for layout, r in results.items():
        print(
            f"{layout:8} {r['pending_set_mib']:16.2f} {r['used_memory_mib']:16.1f} "
            f"{r['peek_claim_fetch_ms_per_batch']:22.2f} {r['ack_ms_per_batch']:8.2f} "
            f"{r['kib_moved_per_request']:18.1f}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {"machine": machine(), "args": vars(args) | {"json": str(args.json)}}
        args.json.write_text(json.dumps(doc | {"results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
