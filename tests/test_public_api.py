"""The names ``claimkit`` exports (STYLE: the exported list is checked)."""

from __future__ import annotations

import claimkit


def test_exported_names() -> None:
    assert sorted(claimkit.__all__) == [
        "Config",
        "ConfigError",
        "Consumer",
        "Envelope",
        "ErrorCode",
        "Invalid",
        "Producer",
        "QueueConfig",
        "QueueOps",
        "Store",
        "StoreError",
        "StorePermissionError",
        "StoreTlsError",
        "StoreUnavailable",
        "Summary",
        "TerminalRecord",
        "load_config",
        "open_store",
        "parse_member",
    ]
    for name in claimkit.__all__:
        obj = getattr(claimkit, name)
        assert getattr(obj, "__module__", "claimkit").startswith("claimkit"), name
