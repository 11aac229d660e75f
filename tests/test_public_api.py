"""The names ``claimkit`` exports (STYLE: the exported list is checked)."""

from __future__ import annotations

import claimkit
import claimkit.consumer.consumer
import claimkit.consumer.dispatch
import claimkit.consumer.poll


def test_exported_names() -> None:
    assert sorted(claimkit.__all__) == [
        "AckItem",
        "ClaimCode",
        "Config",
        "ConfigError",
        "Consumer",
        "Done",
        "Envelope",
        "ErrorCode",
        "Handler",
        "HttpClient",
        "Invalid",
        "Metrics",
        "OpsFactory",
        "Outcome",
        "ParkCode",
        "Producer",
        "QueueConfig",
        "QueueOps",
        "QueueProtocol",
        "QueueRuntime",
        "QueueStats",
        "ReclaimCounts",
        "ReleaseCode",
        "RenewCode",
        "ResultAckCode",
        "ResultDelivery",
        "ResultDeliveryError",
        "ResultOwnershipLost",
        "ResultPopRefused",
        "ResultReader",
        "ResultRouting",
        "Retry",
        "Store",
        "StoreError",
        "StorePermissionError",
        "StoreTlsError",
        "StoreUnavailable",
        "Summary",
        "TerminalRecord",
        "Unsent",
        "WrongKeyType",
        "load_config",
        "open_store",
        "parse_member",
    ]
    # Type aliases have no module of their own: each must be the alias its layer defines.
    aliases = {
        "Handler": claimkit.consumer.poll.Handler,
        "OpsFactory": claimkit.consumer.consumer.OpsFactory,
        "Outcome": claimkit.consumer.dispatch.Outcome,
    }
    for name in claimkit.__all__:
        obj = getattr(claimkit, name)
        if name in aliases:
            assert obj is aliases[name], name
        else:
            assert getattr(obj, "__module__", "").startswith("claimkit"), name
