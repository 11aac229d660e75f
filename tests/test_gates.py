"""Dispatch gates with their ``gate_params`` as llm-d-async writes them (docs/configuration.md).

llm-d-async's ``gate_params`` is a string map: ``{"limit": "1"}``, ``budget_key``,
``address``. Configs below are copied in that shape; each is loaded, made into a gate and
asked against a real Redis.
"""

from __future__ import annotations

import json
import random
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import pytest
import trio
from typer.testing import CliRunner

from claimkit.cli.app import app
from claimkit.config import ConfigError, load_config
from claimkit.consumer.consumer import key_roles
from claimkit.consumer.gates import LocalMaxConcurrencyGate, RedisBudgetGate, make_gate

if TYPE_CHECKING:
    from claimkit.store import Store

GW = "http://127.0.0.1:9"


def upstream_config(redis_url: str, gate: str) -> str:
    """A transport config as llm-d-async's docs write one, with ``gate`` spliced in."""
    queue = f'"queue_name": "requests", "igw_base_url": "{GW}", {gate}'
    return f'{{"url": "{redis_url}", "queues": [{{{queue}}}]}}'


def host_port(redis_url: str) -> str:
    parts = urlsplit(redis_url)
    return f"{parts.hostname}:{parts.port}"


async def test_redis_gate_reads_upstream_budget_key_and_address(
    store: Store, redis_url: str
) -> None:
    """Copied from llm-d-async: the gate reads ``budget_key`` (it used to read only ``key``,
    so this config admitted everything at budget 0)."""
    text = upstream_config(
        redis_url,
        '"gate_type": "redis", "gate_params": '
        f'{{"address": "{host_port(redis_url)}", "budget_key": "pool-a-budget"}}',
    )
    config = load_config(inline=text)
    assert config.unknown_fields == ()
    gate = make_gate(config.queues[0], store, random.Random(3))
    assert isinstance(gate, RedisBudgetGate)
    assert gate.key == "pool-a-budget"
    assert key_roles(config)["pool-a-budget"].what == "gate budget key {} of queue 'requests'"
    with trio.fail_after(10):
        await store.command("SET", "dispatch-gate-budget", "1")  # not the configured key
        await store.command("SET", "pool-a-budget", "0")
        assert await gate.admit(5, 0) == 0
        await store.command("SET", "pool-a-budget", "1")
        assert await gate.admit(5, 0) == 5


async def test_redis_gate_address_may_name_the_queue_redis_by_a_loopback_alias(
    store: Store, redis_url: str
) -> None:
    port = urlsplit(redis_url).port
    assert urlsplit(redis_url).hostname == "127.0.0.1"
    text = upstream_config(
        redis_url, f'"gate_type": "redis", "gate_params": {{"address": "localhost:{port}"}}'
    )
    gate = make_gate(load_config(inline=text).queues[0], store)
    assert isinstance(gate, RedisBudgetGate)
    assert gate.key == "dispatch-gate-budget"


async def test_redis_gate_key_is_still_read_as_the_older_name(store: Store, redis_url: str) -> None:
    text = upstream_config(redis_url, '"gate_type": "redis", "gate_params": {"key": "b"}')
    gate = make_gate(load_config(inline=text).queues[0], store)
    assert isinstance(gate, RedisBudgetGate)
    assert gate.key == "b"


def test_redis_gate_address_of_another_redis_is_refused(redis_url: str) -> None:
    text = upstream_config(
        redis_url,
        '"gate_type": "redis", "gate_params": {"address": "redis-gate:6380", "budget_key": "b"}',
    )
    with pytest.raises(ConfigError) as info:
        load_config(inline=text)
    assert str(info.value) == (
        "queues[0].gate_params.address 'redis-gate:6380' names another Redis than the queue's"
        f" ({host_port(redis_url)}); claimkit reads the budget key on the queue's own Redis:"
        f" remove address or set it to {host_port(redis_url)!r}"
    )


async def test_local_max_concurrency_takes_upstream_string_limit(
    store: Store, redis_url: str
) -> None:
    text = upstream_config(
        redis_url, '"gate_type": "local-max-concurrency", "gate_params": {"limit": "1"}'
    )
    config = load_config(inline=text)
    assert config.unknown_fields == ()
    gate = make_gate(config.queues[0], store)
    assert gate == LocalMaxConcurrencyGate(1)
    assert await gate.admit(3, 0) == 1
    assert await gate.admit(3, 1) == 0


@pytest.mark.parametrize(
    ("params", "limit"),
    [
        ({"limit": "4", "gating_mode": "blocking"}, 4),
        ({"limit": "4", "gating_mode": "classifying"}, 4),
        ({"limit": 4}, 4),
        ({"limit": 4.0}, 4),
        ({"limit": " 2 "}, 2),
        ({"max_concurrency": "3"}, 3),  # an earlier llm-d-async name
        ({"limit": "3", "max_concurrency": 3}, 3),  # both, saying the same
    ],
)
async def test_local_max_concurrency_accepted_shapes(
    store: Store, redis_url: str, params: dict[str, Any], limit: int
) -> None:
    gate_json = '"gate_type": "local-max-concurrency", "gate_params": ' + json.dumps(params)
    config = load_config(inline=upstream_config(redis_url, gate_json))
    assert make_gate(config.queues[0], store) == LocalMaxConcurrencyGate(limit)


@pytest.mark.parametrize(
    ("gate", "line"),
    [
        (
            '"gate_type": "local-max-concurrency", "gate_params": {"limit": "x"}',
            "queues[0].gate_params.limit must be a whole number from 1 to 2147483647"
            ' (a JSON number or a string such as "4"), got "x"',
        ),
        (
            '"gate_type": "local-max-concurrency", "gate_params": {"limit": "0"}',
            "queues[0].gate_params.limit must be a whole number from 1 to 2147483647"
            ' (a JSON number or a string such as "4"), got "0"',
        ),
        (
            '"gate_type": "local-max-concurrency", "gate_params": {"limit": "1.5"}',
            "queues[0].gate_params.limit must be a whole number from 1 to 2147483647"
            ' (a JSON number or a string such as "4"), got "1.5"',
        ),
        (
            '"gate_type": "local-max-concurrency", "gate_params": {"limit": true}',
            "queues[0].gate_params.limit must be a whole number from 1 to 2147483647"
            ' (a JSON number or a string such as "4"), got true',
        ),
        (
            '"gate_type": "local-max-concurrency", "gate_params": {}',
            "queues[0].gate_params.limit is required"
            ' (requests of this queue in flight here, such as "4")',
        ),
        (
            '"gate_type": "local-max-concurrency", "gate_params": {"limit": "2",'
            ' "max_concurrency": "3"}',
            "queues[0].gate_params.limit and queues[0].gate_params.max_concurrency name one"
            " parameter: give one",
        ),
        (
            '"gate_type": "local-max-concurrency", "gate_params": {"limit": "2",'
            ' "gating_mode": "eager"}',
            'queues[0].gate_params.gating_mode must be "blocking" or "classifying", got "eager"',
        ),
        (
            '"gate_type": "redis", "gate_params": {"budget_key": 5}',
            "queues[0].gate_params.budget_key must be a string (a Redis key), got 5",
        ),
        (
            '"gate_type": "redis", "gate_params": {"budget_key": "a", "key": "b"}',
            "queues[0].gate_params.budget_key and queues[0].gate_params.key name one"
            " parameter: give one",
        ),
        (
            '"gate_type": "redis", "gate_params": {"address": "redis://gate:6379"}',
            'queues[0].gate_params.address must be host:port, got "redis://gate:6379"',
        ),
    ],
)
def test_bad_gate_values_are_one_line(redis_url: str, gate: str, line: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(inline=upstream_config(redis_url, gate))
    assert str(info.value) == line


def test_unknown_gate_parameters_are_warned_once_each(redis_url: str) -> None:
    text = upstream_config(
        redis_url,
        '"gate_type": "local-max-concurrency",'
        ' "gate_params": {"limit": "2", "window": "1m", "burst": "3"}',
    )
    assert load_config(inline=text).unknown_fields == (
        "queues[0].gate_params.burst",
        "queues[0].gate_params.window",
    )
    result = CliRunner().invoke(app, ["reclaim", "--once", "--transport-config", text])
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if "warning" in line]
    assert warnings == [
        "claimkit: warning: unknown config field 'queues[0].gate_params.burst' is ignored",
        "claimkit: warning: unknown config field 'queues[0].gate_params.window' is ignored",
    ]


def test_constant_gate_takes_no_parameters(redis_url: str) -> None:
    text = upstream_config(redis_url, '"gate_type": "constant", "gate_params": {"limit": "1"}')
    assert load_config(inline=text).unknown_fields == ("queues[0].gate_params.limit",)
