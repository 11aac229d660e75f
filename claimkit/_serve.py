"""Process wiring of ``claimkit serve``: store, consumer, signals, HTTP servers (SPEC §5)."""

from __future__ import annotations

import logging
import signal

import trio

from ._config import Config, ConfigError
from ._consumer import Consumer, Summary
from ._health import serve_http
from ._store import Store, StoreUnavailable, open_store

__all__ = ["serve_forever"]

log = logging.getLogger("claimkit")


async def _signals(consumer: Consumer, *, task_status: trio.TaskStatus[None]) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
        task_status.started()
        async for signum in received:
            log.info("claimkit: %s received", signal.Signals(signum).name)
            consumer.request_stop()


async def _preflight(store: Store, config: Config) -> None:
    """Refuse to start on a mistake that retrying cannot mend: a wrong password (StoreError)
    or a queue key of another type. Redis merely unreachable is not one of them: the
    consumer starts and retries until it answers (SPEC §5)."""
    try:
        kinds = await store.pipeline(
            [["PING"], *(["TYPE", q.queue_name] for q in config.queues)], transaction=False
        )
    except StoreUnavailable as exc:
        log.warning("claimkit: Redis is unavailable at start (%s); retrying until it answers", exc)
        return
    for q, kind in zip(config.queues, kinds[1:], strict=True):
        kind = kind.decode() if isinstance(kind, bytes) else str(kind)
        if kind not in ("zset", "none"):
            raise ConfigError(f"queue key {q.queue_name!r} holds a {kind}, not a sorted set")


async def serve_forever(config: Config, *, backend: str = "coredis") -> Summary:
    """Run the consumer until SIGTERM/SIGINT and return its summary.

    Raises:
        ConfigError: a port is taken or a gate is misconfigured (one line).
    """
    async with open_store(config.url, backend=backend) as store:
        await _preflight(store, config)
        try:
            consumer = Consumer(config, store)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        try:
            servers = serve_http(
                metrics_port=config.metrics_port,
                health_port=config.health_port,
                registry=consumer.metrics.registry,
                ready=consumer.ready,
            )
            bound = servers.__enter__()
        except OSError as exc:
            raise ConfigError(
                f"cannot serve HTTP on the metrics/health port: {exc.strerror or exc}"
            ) from exc
        try:
            log.info(
                "claimkit: serving %s on %s (metrics %s, health %s)",
                ", ".join(q.queue_name for q in config.queues),
                store.url,
                bound.get("metrics", "off"),
                bound.get("health", "off"),
            )
            async with trio.open_nursery() as nursery:
                await nursery.start(_signals, consumer)
                summary = await consumer.run()
                nursery.cancel_scope.cancel()
            return summary
        finally:
            servers.__exit__(None, None, None)
