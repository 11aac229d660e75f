"""claimkit: a durable peek -> claim -> ack consumer for Redis sorted-set LLM inference queues.

The contract is described in docs/ (start at docs/README.md); the public names are
re-exported here explicitly.
"""

from __future__ import annotations

from claimkit.config import Config as Config
from claimkit.config import ConfigError as ConfigError
from claimkit.config import QueueConfig as QueueConfig
from claimkit.config import load_config as load_config
from claimkit.consumer.consumer import Consumer as Consumer
from claimkit.consumer.consumer import Summary as Summary
from claimkit.producer import Producer as Producer
from claimkit.producer import SubmitError as SubmitError
from claimkit.protocol.models import Envelope as Envelope
from claimkit.protocol.models import ErrorCode as ErrorCode
from claimkit.protocol.models import Invalid as Invalid
from claimkit.protocol.models import TerminalRecord as TerminalRecord
from claimkit.protocol.models import parse_member as parse_member
from claimkit.protocol.ops import QueueOps as QueueOps
from claimkit.store import Store as Store
from claimkit.store import StoreError as StoreError
from claimkit.store import StorePermissionError as StorePermissionError
from claimkit.store import StoreTlsError as StoreTlsError
from claimkit.store import StoreUnavailable as StoreUnavailable
from claimkit.store import open_store as open_store

__version__ = "0.1.0"

__all__ = [
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
