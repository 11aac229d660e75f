"""Test support: a real Sentinel group of private server processes.

``sentinel_group`` is a module-scoped pytest fixture: a primary, one replica and three
sentinels (:class:`claimkit.dev.sentinel.SentinelGroup`, ``master_name="claimkit"``), each
on a free port in a temporary directory of its own, stopped by PID at the end of the
module. Import it into a test module (``from sentinel import sentinel_group``) to use it.
What tests use of it: ``primary``, ``replicas``, ``sentinel_addrs``, ``sentinel_url``,
``master_name``, ``primary_address()``, ``kill_primary()``, ``wait_promoted(timeout)``.

A test that kills the primary changes the group for the rest of its module: such a test
starts a group of its own (``with SentinelGroup() as group:``) or runs last.

The tests that use it are skipped, not failed, only where no server binary is found. The
machine's shared Redis is never touched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from claimkit.dev.redis_server import find_server_binary
from claimkit.dev.sentinel import SentinelGroup

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["sentinel_available", "sentinel_group"]


def sentinel_available() -> str | None:
    """Why a sentinel group cannot be started here (no server binary), or ``None``."""
    try:
        find_server_binary()
    except RuntimeError as exc:
        return str(exc)
    return None


@pytest.fixture(scope="module")
def sentinel_group() -> Iterator[SentinelGroup]:
    """A primary, one replica and three sentinels for the test module; stopped by PID."""
    why = sentinel_available()
    if why is not None:
        pytest.skip(f"no Sentinel group here: {why}")
    with SentinelGroup(replicas=1, sentinels=3, master_name="claimkit") as group:
        yield group
