"""``serve`` checks Redis's ``maxmemory-policy`` (issue 8, defect 13; docs/operations.md).

claimkit's guarantees assume ``noeviction``. An ``allkeys-*`` policy can evict pending and
claimed requests: serve refuses (``--allow-eviction`` overrides, with a warning). A
``volatile-*`` policy evicts only keys with a TTL (dedup and cancel markers): a warning. A
policy that cannot be read is said in one line and serve carries on.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio
from support import config_json, mask_noperm
from typer.testing import CliRunner

from claimkit.cli.app import app
from claimkit.consumer.serve import _check_eviction
from claimkit.store import open_store

if TYPE_CHECKING:
    import pytest
    from conftest import RedisFactory


def test_serve_refuses_an_allkeys_policy_in_one_line(redis_factory: RedisFactory) -> None:
    server = redis_factory(extra_args=["--maxmemory-policy", "allkeys-lru"])
    args = ["serve", "--metrics-port", "0", "--health-port", "0"]
    result = CliRunner().invoke(
        app, [*args, "--transport-config", config_json(server.url, queue="q")]
    )
    assert result.exit_code == 1, result.output
    assert result.stderr == (
        f"claimkit: Redis at {server.url} has maxmemory-policy allkeys-lru, which can evict "
        "queued and claimed requests: set maxmemory-policy noeviction (docs/operations.md, "
        '"Eviction"), or pass --allow-eviction to serve anyway\n'
    )
    assert result.stdout == ""


async def check(url: str, *, allow: bool = False) -> None:
    with trio.fail_after(10):
        async with open_store(url) as store:
            await _check_eviction(store, allow_eviction=allow)


def messages(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "claimkit"]


async def test_allow_eviction_serves_with_a_loud_warning(
    redis_factory: RedisFactory, caplog: pytest.LogCaptureFixture
) -> None:
    server = redis_factory(extra_args=["--maxmemory-policy", "allkeys-lfu"])
    with caplog.at_level(logging.WARNING, logger="claimkit"):
        await check(server.url, allow=True)
    assert messages(caplog) == [
        (
            logging.WARNING,
            f"claimkit: WARNING: Redis at {server.url} has maxmemory-policy allkeys-lfu, "
            "which can evict queued and claimed requests; serving anyway (--allow-eviction)",
        )
    ]


async def test_a_volatile_policy_is_a_warning(
    redis_factory: RedisFactory, caplog: pytest.LogCaptureFixture
) -> None:
    server = redis_factory(extra_args=["--maxmemory-policy", "volatile-lru"])
    with caplog.at_level(logging.WARNING, logger="claimkit"):
        await check(server.url)
    assert messages(caplog) == [
        (
            logging.WARNING,
            f"claimkit: warning: Redis at {server.url} has maxmemory-policy volatile-lru: "
            "under memory pressure it evicts keys with a TTL, claimkit's dedup and cancel "
            "markers (a record pushed twice, a cancel lost); set noeviction (docs/operations.md, "
            '"Eviction")',
        )
    ]


async def test_noeviction_says_nothing(redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="claimkit"):
        await check(redis_url)
    assert messages(caplog) == []


async def test_an_unreadable_policy_is_one_line_and_serve_carries_on(
    redis_factory: RedisFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A user without +info and +config (a managed Redis, a narrow ACL)."""
    server = redis_factory()
    async with open_store(server.url) as admin:
        rule = ["on", ">pw", "~*", "&*", "+@all", "-info", "-config"]
        assert await admin.command("ACL", "SETUSER", "narrow", *rule) == b"OK"
    url = server.url.replace("redis://", "redis://narrow:pw@")
    shown = server.url.replace("redis://", "redis://narrow:***@")
    with caplog.at_level(logging.WARNING, logger="claimkit"):
        await check(url)
    acl = "`claimkit acl` prints the rule claimkit needs (docs/security.md)"
    said = [(level, mask_noperm(text)) for level, text in messages(caplog)]
    assert said == [
        (
            logging.WARNING,
            f"claimkit: warning: cannot tell whether Redis at {shown} is a cluster: INFO was "
            "refused (user 'narrow' may not run INFO: grant +info (Redis: NOPERM <server's "
            f"words>); {acl}); claimkit needs a standalone Redis",
        ),
        (
            logging.WARNING,
            "claimkit: warning: cannot read Redis's maxmemory-policy (CONFIG GET "
            "maxmemory-policy was refused: user 'narrow' may not run CONFIG|GET (sent as "
            "CONFIG): grant +config|get (Redis: NOPERM <server's words>); "
            f"{acl}); claimkit needs noeviction "
            '(docs/operations.md, "Eviction")',
        ),
    ]
