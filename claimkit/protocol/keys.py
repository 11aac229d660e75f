"""Every Redis key name claimkit reads or writes (docs/protocol.md#keys).

No other module builds a key. A queue name may carry a Redis Cluster hash tag
(``{tenant-a}:requests``); the derived per-queue keys below are suffixes of it, so they hash
to the same slot.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from collections.abc import Iterable

RESULT_TERMINAL_PREFIX = "result-terminal:"
REQUEST_ACTIVE_PREFIX = "request-active:"
REQUEST_CANCEL_PREFIX = "request-cancel:"

DEFAULT_RESULT_LIST = "result-list"
"""The default global ``result_queue_name`` (docs/configuration.md)."""
DEFAULT_RETRY_SET = "retry-sortedset"
"""The default ``retry_queue_name``, the retry set every queue shares (docs/configuration.md)."""
DEFAULT_DEDUP_TTL_SECONDS = 21600
"""The default ``result_dedup_ttl_seconds``: 6 hours (docs/protocol.md#ack)."""
DEFAULT_LEASE_TTL_SECONDS = 300.0
"""The default ``claim_lease_ttl_seconds`` (docs/protocol.md#claim)."""

PENDING_TYPE = "zset"
"""The Redis ``TYPE`` of a queue key ``<q>``, the pending set (docs/protocol.md#keys)."""


@dataclass(frozen=True, slots=True)
class QueueKeys:
    """The keys of one queue ``<q>`` (docs/protocol.md#keys).

    Attributes:
        pending: ZSET of envelopes scored by deadline (Unix seconds).
        claimed: HASH ``<id>`` -> claimed member bytes, ``<id>:score`` -> original score.
        owners: HASH ``<id>`` -> ownership token (hex) of the live claim.
        index: ZSET ``<id>`` scored by lease expiry (Unix seconds, Redis server clock).
        deliveries: HASH ``<id>`` -> redelivery count (docs/protocol.md#reclaim).
        dead: ZSET of dead-lettered member bytes scored by the time they died.
    """

    pending: str
    claimed: str
    owners: str
    index: str
    deliveries: str
    dead: str

    TYPES: ClassVar[tuple[tuple[str, str, str], ...]] = (
        ("pending", PENDING_TYPE, "queue key"),
        ("claimed", "hash", "claimed hash"),
        ("owners", "hash", "claim-owners hash"),
        ("index", "zset", "claims index"),
        ("deliveries", "hash", "deliveries hash"),
        ("dead", "zset", "dead set"),
    )
    """The one table of what each per-queue key holds (docs/protocol.md#keys):
    ``(attribute, Redis TYPE name, what the key is in one-line errors)``, in key order."""

    def types(self) -> dict[str, str]:
        """The Redis ``TYPE`` of each of these keys, by key name (``{"q": "zset", ...}``)."""
        return {getattr(self, attr): kind for attr, kind, _what in self.TYPES}

    def described(self) -> list[tuple[str, str, str]]:
        """``(key name, Redis TYPE name, what it is)`` for each of these keys, in key order:
        ``("q:claimed", "hash", "claimed hash")``."""
        return [(getattr(self, attr), kind, what) for attr, kind, what in self.TYPES]

    @classmethod
    def for_queue(cls, queue: str) -> QueueKeys:
        return cls(
            pending=queue,
            claimed=f"{queue}:claimed",
            owners=f"{queue}:claim-owners",
            index=f"{queue}:claims-idx",
            deliveries=f"{queue}:deliveries",
            dead=f"{queue}:dead",
        )


def result_terminal(request_id: str) -> str:
    """Dedup marker of a request's terminal record (docs/protocol.md#keys, docs/protocol.md#ack)."""
    return RESULT_TERMINAL_PREFIX + request_id


def request_active(request_id: str) -> str:
    """The producer's live-generation marker (docs/protocol.md#producer)."""
    return REQUEST_ACTIVE_PREFIX + request_id


def request_cancel(request_id: str) -> str:
    """The cancel marker; a request is cancelled iff it holds its ``request_token``
    (docs/protocol.md#keys)."""
    return REQUEST_CANCEL_PREFIX + request_id


def claimed_score_field(request_id: str) -> str:
    """The ``<q>:claimed`` field holding a claim's original pending score."""
    return request_id + ":score"


def results_holding_list(result_list: str) -> str:
    """A fresh name for the one-record holding list of a ``claimkit results --follow``
    reader of ``result_list``: ``<list>:following:<16 hex>`` (claimkit addition). A suffix
    of the list's name, so a hash tag in it keeps both in one slot."""
    return results_holding_prefix(result_list) + secrets.token_hex(8)


def results_holding_prefix(result_list: str) -> str:
    """What every holding list of ``result_list`` starts with (:func:`results_holding_list`;
    ``claimkit acl`` grants ``~<prefix>*``)."""
    return f"{result_list}:following:"


def retry_dead(retry_set: str) -> str:
    """Where the retry mover puts a member it cannot route (claimkit addition)."""
    return retry_set + ":dead"


RETRY_SET_TYPE = "zset"
"""The Redis ``TYPE`` of the retry set and of its dead set (:func:`retry_dead`)."""

RESULT_LIST_TYPE = "list"
"""The Redis ``TYPE`` of a result list (docs/protocol.md#keys)."""

GATE_BUDGET_TYPE = "string"
"""The Redis ``TYPE`` of a ``redis`` gate's budget key (docs/configuration.md)."""


def reserved_keys(queues: Iterable[str], retry_set: str) -> frozenset[str]:
    """The keys claimkit keeps as something other than a result list, for ``queues`` and
    ``retry_set``: every per-queue key (:class:`QueueKeys`) and both retry sets.

    A request's ``internal.result_queue_name`` must not name one of these, nor a key with
    one of the per-request prefixes (:func:`is_reserved`): while such a key is empty it does
    not exist, and the record's ``LPUSH`` would re-create it as a list, breaking it for
    every request that follows.
    """
    out = {retry_set, retry_dead(retry_set)}
    for queue in queues:
        out.update(QueueKeys.for_queue(queue).types())
    return frozenset(out)


def is_reserved(name: str, reserved: frozenset[str]) -> bool:
    """Whether ``name`` is a key of ``reserved`` or a per-request key (``result-terminal:``,
    ``request-active:``, ``request-cancel:``)."""
    return name in reserved or name.startswith(
        (RESULT_TERMINAL_PREFIX, REQUEST_ACTIVE_PREFIX, REQUEST_CANCEL_PREFIX)
    )


_TYPE_NAMES = {
    "zset": "a sorted set",
    "hash": "a hash",
    "list": "a list",
    "string": "a string",
    "set": "a set",
    "stream": "a stream",
}


def type_name(kind: str) -> str:
    """A Redis ``TYPE`` reply as words for one-line errors: ``"zset"`` -> ``"a sorted set"``."""
    return _TYPE_NAMES.get(kind, f"a {kind}")
