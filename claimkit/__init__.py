"""claimkit: a durable peek -> claim -> ack consumer for Redis sorted-set LLM inference queues.

The contract is described in docs/ (start at docs/README.md); the public names are
re-exported here explicitly.
"""

from __future__ import annotations

from ._config import Config as Config
from ._config import ConfigError as ConfigError
from ._config import QueueConfig as QueueConfig
from ._config import load_config as load_config
from ._consumer import Consumer as Consumer
from ._consumer import Summary as Summary
from ._models import Envelope as Envelope
from ._models import ErrorCode as ErrorCode
from ._models import Invalid as Invalid
from ._models import TerminalRecord as TerminalRecord
from ._models import parse_member as parse_member
from ._producer import Producer as Producer
from ._producer import SubmitError as SubmitError
from ._protocol import QueueOps as QueueOps
from ._store import Store as Store
from ._store import StoreError as StoreError
from ._store import StorePermissionError as StorePermissionError
from ._store import StoreTlsError as StoreTlsError
from ._store import StoreUnavailable as StoreUnavailable
from ._store import open_store as open_store

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
