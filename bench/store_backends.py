"""Script calls per second through each store backend (docs/store-backends.md).

Starts a private ``redis-server`` (never the shared one on 6379), then for each backend runs
``--tasks`` concurrent trio tasks, each calling a trivial Lua script (EVALSHA through
``Store.run``) in a loop for ``--seconds``, and prints the rate. Rounds alternate between
the backends so a noisy neighbour hurts both alike.

    python bench/store_backends.py --seconds 10 --tasks 50 --rounds 3

The redis-py backend is skipped, with the reason, where the ``redispy`` extra cannot be used.
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import statistics
import sys

import trio

from claimkit.config import ConfigError
from claimkit.dev.redis_server import RedisServer
from claimkit.store import open_store
from claimkit.store.redispy_store import load_backend
from claimkit.store.scripts import Script

SOURCE = "return 1"
TRIVIAL = Script("bench", 1, SOURCE, hashlib.sha1(SOURCE.encode()).hexdigest())
WARMUP = 1.0  # seconds of calls before counting starts (connections, script load)


async def measure(url: str, backend: str, tasks: int, seconds: float) -> float:
    """Script calls per second of ``tasks`` concurrent callers over ``seconds``."""
    calls = 0
    counting = False
    async with open_store(url, backend=backend, timeout=10.0) as store:
        await store.run(TRIVIAL, ["k"], [])  # loads the script once

        async def caller() -> None:
            nonlocal calls
            while True:
                await store.run(TRIVIAL, ["k"], [])
                if counting:
                    calls += 1

        async with trio.open_nursery() as nursery:
            for _ in range(tasks):
                nursery.start_soon(caller)
            await trio.sleep(WARMUP)
            counting = True
            start = trio.current_time()
            await trio.sleep(seconds)
            counting = False
            elapsed = trio.current_time() - start
            nursery.cancel_scope.cancel()
    return calls / elapsed


async def main(args: argparse.Namespace) -> None:
    backends = ["coredis", "redispy"]
    try:
        load_backend()
    except ConfigError as exc:
        print(f"redispy: skipped: {exc}")
        backends.remove("redispy")
    server = RedisServer(aof="off")
    await trio.to_thread.run_sync(server.start)
    try:
        print(
            f"Python {platform.python_version()}, trio {trio.__version__}, "
            f"{args.tasks} tasks, {args.seconds:g} s per round, {args.rounds} rounds"
        )
        rates: dict[str, list[float]] = {name: [] for name in backends}
        for round_no in range(1, args.rounds + 1):
            for name in backends:
                rate = await measure(server.url, name, args.tasks, args.seconds)
                rates[name].append(rate)
                print(f"  round {round_no} {name:8} {rate:10,.0f} calls/s", flush=True)
        for name, values in rates.items():
            print(f"{name:8} median {statistics.median(values):10,.0f} script calls/s")
    finally:
        await trio.to_thread.run_sync(server.close)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per round")
    parser.add_argument("--tasks", type=int, default=50, help="concurrent trio tasks")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per backend")
    return parser.parse_args(argv)


if __name__ == "__main__":
    trio.run(main, parse(sys.argv[1:]))
