"""claimkit: a durable peek -> claim -> ack consumer for Redis sorted-set LLM inference queues.

The contract is described in docs/ (start at docs/README.md); the public names are
re-exported here explicitly, and every other module is internal.
"""

# The layers, top to bottom (docs/architecture.md). A layer imports only the layers below
# it, never one above, not even lazily or under TYPE_CHECKING; `nox -s lint` checks this
# with import-linter (pyproject.toml, [tool.importlinter]).
#
#   cli/        the `claimkit` command: thin typer commands over the layers below, one
#               skeleton (cli/runner.py), and the only rich rendering (cli/console.py).
#   dev/        the demo, the gateway simulator and private Redis servers (`dev` extra).
#   consumer/   `claimkit serve`: Consumer wires the poll, settle and upkeep loops around one
#     ops/      owner of claim state (HeldClaims). ops/ holds the operator tools (inspect,
#     producer  drain, reclaim, dead letters, results, ACL rules), producer.py submits and
#               reads results. These three never import one another.
#   result_reader.py  the durable result reader (leases renewed in the background), shared
#               by the producer and ops.
#   config/     the configuration file: model, parsing, gate parameters.
#   protocol/   key names and types, members and records, result routing, the queue-wide
#               figures (stats.py) and QueueOps: with OperatorScripts the only caller of
#               the Lua scripts in lua/.
#   store/      one Redis connection behind the Store protocol (coredis or redis-py), URL,
#               TLS and ACL diagnosis, the script loader.
#   _errors.py  ConfigError, below everything.

from __future__ import annotations

from claimkit.config import Config as Config
from claimkit.config import ConfigError as ConfigError
from claimkit.config import QueueConfig as QueueConfig
from claimkit.config import WrongKeyType as WrongKeyType
from claimkit.config import load_config as load_config
from claimkit.consumer.claims import Summary as Summary
from claimkit.consumer.consumer import Consumer as Consumer
from claimkit.consumer.consumer import OpsFactory as OpsFactory
from claimkit.consumer.dispatch import Done as Done
from claimkit.consumer.dispatch import Outcome as Outcome
from claimkit.consumer.dispatch import Retry as Retry
from claimkit.consumer.dispatch import Unsent as Unsent
from claimkit.consumer.http import HttpClient as HttpClient
from claimkit.consumer.metrics import Metrics as Metrics
from claimkit.consumer.poll import Handler as Handler
from claimkit.consumer.runtime import QueueRuntime as QueueRuntime
from claimkit.producer import Producer as Producer
from claimkit.producer import SubmitError as SubmitError
from claimkit.protocol.models import Envelope as Envelope
from claimkit.protocol.models import ErrorCode as ErrorCode
from claimkit.protocol.models import Invalid as Invalid
from claimkit.protocol.models import TerminalRecord as TerminalRecord
from claimkit.protocol.models import parse_member as parse_member
from claimkit.protocol.ops import AckItem as AckItem
from claimkit.protocol.ops import QueueOps as QueueOps
from claimkit.protocol.ops import QueueProtocol as QueueProtocol
from claimkit.protocol.replies import ClaimCode as ClaimCode
from claimkit.protocol.replies import ParkCode as ParkCode
from claimkit.protocol.replies import ReclaimCounts as ReclaimCounts
from claimkit.protocol.replies import ReleaseCode as ReleaseCode
from claimkit.protocol.replies import RenewCode as RenewCode
from claimkit.protocol.result_delivery import ResultAckCode as ResultAckCode
from claimkit.protocol.result_delivery import ResultDelivery as ResultDelivery
from claimkit.protocol.result_delivery import ResultDeliveryError as ResultDeliveryError
from claimkit.protocol.result_delivery import ResultOwnershipLost as ResultOwnershipLost
from claimkit.protocol.result_delivery import ResultPopRefused as ResultPopRefused
from claimkit.protocol.routing import ResultRouting as ResultRouting
from claimkit.protocol.stats import QueueStats as QueueStats
from claimkit.result_reader import ResultReader as ResultReader
from claimkit.store import Store as Store
from claimkit.store import StoreError as StoreError
from claimkit.store import StorePermissionError as StorePermissionError
from claimkit.store import StoreTlsError as StoreTlsError
from claimkit.store import StoreUnavailable as StoreUnavailable
from claimkit.store import open_store as open_store

__version__ = "0.1.0"

__all__ = [
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
