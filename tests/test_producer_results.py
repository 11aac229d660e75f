"""``Producer.results`` never loses an element it popped (issue 8, defect 16)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio
from support import do
from typer.testing import CliRunner

from claimkit import Producer
from claimkit.cli.app import app
from claimkit.protocol.models import TerminalRecord

if TYPE_CHECKING:
    from claimkit.store import Store

DEEP = b"[" * 100_000  # json.loads raises RecursionError, not ValueError


async def test_results_returns_every_popped_element_unreadable_ones_as_bytes(
    store: Store,
) -> None:
    with trio.fail_after(10):
        producer = Producer(store, "q", result_list="out")
        good = [TerminalRecord.http(f"r{i}", 200, str(i)) for i in range(3)]
        elements = [
            good[0].to_json(),
            b"not json",
            good[1].to_json(),
            b'{"no":"id"}',
            b"\xff\xfe",
            DEEP,
            good[2].to_json(),
        ]
        for raw in elements:
            await store.command("LPUSH", "out", raw)
        expected = [good[0], b"not json", good[1], b'{"no":"id"}', b"\xff\xfe", DEEP, good[2]]

        assert await producer.results(10) == expected
        assert await store.command("LLEN", "out") == len(elements)
        assert await producer.results(10, pop=True) == expected
        assert await store.command("EXISTS", "out") == 0
        assert await producer.results(10, pop=True) == []


def test_cli_results_prints_an_element_nested_too_deeply(redis_url: str) -> None:
    good = TerminalRecord.http("r1", 200, "ok").to_json()
    do(redis_url, ["LPUSH", "out", good], ["LPUSH", "out", DEEP])
    result = CliRunner().invoke(
        app, ["results", "--redis-url", redis_url, "--list", "out", "--peek"]
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == ["r1  200  ok", "?  (not a terminal record)  " + "[" * 160]
