"""claimkit as a runner of the peers harness (``../shared/peers`` beside the checkout), in-process.

Speaks the harness's runner protocol (``runners/common.py``):

    peers_runner.py enqueue|work --redis URL --n N --workload noop|http --gateway URL \
        --concurrency C --queue NAME

- ``enqueue`` submits N requests with claimkit's own :class:`claimkit.Producer` (the real
  envelope, a deadline one hour ahead, ``request-active`` keys; 1000 per MULTI/EXEC), the
  peers' ~200 B payload as each request's ``payload``.
- ``work`` runs a :class:`claimkit.Consumer` with its full durable path (peek -> claim ->
  dispatch -> ack, heartbeat, reclaimer, retry mover) and counts each request when its ack
  script has run (``on_settled``), so a job counts only once its record is durable in Redis.
  ``http`` dispatches through claimkit's own dispatch (SPEC §4) to the harness gateway;
  ``noop`` acks a 200 record at once.

Knobs (the harness passes fixed arguments, so these are environment variables):

- ``CLAIMKIT_BACKEND``: ``coredis`` (default) or ``redispy``;
- ``CLAIMKIT_BATCH``: ``batch_size`` (default 10);
- ``CLAIMKIT_POLL_MS``: ``poll_interval_ms`` (default 50: an empty queue is polled 20x/s);
- ``CLAIMKIT_PEERS_RUNNERS``: where ``common.py`` is (default
  ``../shared/peers/runners``);
- ``CLAIMKIT_PROFILE``: ``cprofile`` or ``pyinstrument`` profiles the work window and writes
  it to ``CLAIMKIT_PROFILE_OUT`` before the runner leaves (``bench/profile_peers.py``).

``--concurrency`` is claimkit's ``concurrency`` (requests in flight in this process, each on
its own gateway connection); ``work`` raises the soft open-file limit as ``claimkit serve``
does (:func:`claimkit.consumer.serve.raise_open_file_limit`), so ``--concurrency 10000
--gateway-latency-ms 10000`` runs on a soft limit of 1024 (the hard limit must allow it).

Add it to a harness run with::

    bash ../shared/peers/run.sh --add claimkit="$PWD/.venv/bin/python $PWD/bench/peers_runner.py"
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(
    0,
    os.environ.get(
        "CLAIMKIT_PEERS_RUNNERS",
        str(Path(__file__).resolve().parent.parent.parent / "shared" / "peers" / "runners"),
    ),
)

import common
import trio

from claimkit import Config, Consumer, Producer, QueueConfig, open_store
from claimkit.consumer.dispatch import Done
from claimkit.consumer.serve import raise_open_file_limit
from claimkit.protocol.models import TerminalRecord

BACKEND = os.environ.get("CLAIMKIT_BACKEND", "coredis")
BATCH = int(os.environ.get("CLAIMKIT_BATCH", "10"))
POLL_MS = int(os.environ.get("CLAIMKIT_POLL_MS", "50"))


async def enqueue(args) -> None:  # type: ignore[no-untyped-def]
    deadline = int(time.time()) + 3600
    async with open_store(args.redis, backend=BACKEND) as store:
        producer = Producer(store, args.queue)
        t0 = time.perf_counter()
        for k in range(0, args.n, 1000):
            await producer.submit_many(
                {"id": f"req-{i:06d}", "deadline": deadline, "payload": common.payload(i)}
                for i in range(k, min(args.n, k + 1000))
            )
        common.enqueued(args.n, time.perf_counter() - t0)


def config_for(args) -> Config:  # type: ignore[no-untyped-def]
    parts = urlsplit(args.gateway or "http://127.0.0.1:1/v1/completions")
    return Config(
        url=args.redis,
        queues=(
            QueueConfig(
                queue_name=args.queue,
                igw_base_url=f"{parts.scheme}://{parts.netloc}",
                request_path_url=parts.path or "/v1/completions",
            ),
        ),
        batch_size=BATCH,
        poll_interval_ms=POLL_MS,
        concurrency=args.concurrency,
        metrics_port=0,
        health_port=0,
    )


async def work(args) -> None:  # type: ignore[no-untyped-def]
    meter = common.Meter(args.n)
    calls = [0]
    wall_start = time.time()
    meter.extra = lambda: {
        "backend": BACKEND,
        "batch_size": BATCH,
        "round_trips": calls[0],  # store calls (commands, scripts, pipelines), when counted
        "wall_start": wall_start,
        "wall_end": time.time(),
    }

    def settled(env, record):  # type: ignore[no-untyped-def]
        ok = record is not None and record.status_code == 200
        meter.finished(ok=ok)

    handler = None
    if args.workload == "noop":

        async def handler(q, env, now):  # type: ignore[no-untyped-def]
            return Done(TerminalRecord.http(env.id, 200, "{}"))

    config = config_for(args)
    # As `claimkit serve` does: --concurrency 10000 needs more than the usual soft limit of
    # 1024 open files (one gateway connection per request in flight).
    raise_open_file_limit(config)
    async with open_store(args.redis, backend=BACKEND) as store:
        if os.environ.get("CLAIMKIT_COUNT_CALLS"):
            count_calls(store, calls)
        consumer = Consumer(config, store, handler=handler, on_settled=settled)
        wall_start = time.time()
        profile(meter)
        meter.start()
        await consumer.run()


def profile(meter) -> None:  # type: ignore[no-untyped-def]
    """Profile from now until the runner leaves, when ``CLAIMKIT_PROFILE`` asks for it."""
    kind = os.environ.get("CLAIMKIT_PROFILE", "none")
    out = os.environ.get("CLAIMKIT_PROFILE_OUT", "/tmp/claimkit-peers.prof")
    report = meter.report
    if kind == "cprofile":
        import cProfile

        prof = cProfile.Profile()

        def stop() -> None:
            prof.disable()
            prof.dump_stats(out)

        prof.enable()
    elif kind == "pyinstrument":
        import pyinstrument

        prof = pyinstrument.Profiler(async_mode="disabled")

        def stop() -> None:
            prof.stop()
            Path(out).write_text(prof.output_text(unicode=False, show_all=False))

        prof.start()
    else:
        return

    def report_after(**extra):  # type: ignore[no-untyped-def]
        stop()
        report(**extra)

    meter.report = report_after


def count_calls(store, calls: list[int]) -> None:  # type: ignore[no-untyped-def]
    """Count every round trip the consumer makes (one per command, script or pipeline)."""
    for name in ("command", "run", "run_many", "pipeline"):
        orig = getattr(store, name)

        async def counted(*a, _orig=orig, **k):  # type: ignore[no-untyped-def]
            calls[0] += 1
            return await _orig(*a, **k)

        setattr(store, name, counted)


def main() -> None:
    args = common.parse_args()
    trio.run(enqueue if args.mode == "enqueue" else work, args)


if __name__ == "__main__":
    main()
