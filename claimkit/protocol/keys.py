"""Every Redis key name claimkit reads or writes (docs/protocol.md#keys,
docs/topology.md#cluster-key-layout).

No other module builds a key. Two layouts:

- standalone (and sentinel): the names of docs/protocol.md#keys exactly. A queue name may
  carry a Redis Cluster hash tag (``{tenant-a}:requests``); the derived per-queue keys are
  suffixes of it.
- cluster (``QueueKeys.for_queue(q, cluster=True)``): every private per-queue key is
  ``slot_key(q) + suffix`` (``{q}:claimed``; a name that already has a hash tag is not
  wrapped again), so it shares the pending key's slot; the queue has its own outbox and
  retry set there; each destination list ``L`` keeps its dedup markers in ``L``'s slot
  (:class:`ResultKeys`). Slots are computed as Redis does (:func:`key_slot`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from claimkit.store.slots import key_slot as key_slot

if TYPE_CHECKING:
    from collections.abc import Iterable

    from claimkit.store import Store

RESULT_TERMINAL_PREFIX = "result-terminal:"
REQUEST_ACTIVE_PREFIX = "request-active:"
REQUEST_CANCEL_PREFIX = "request-cancel:"
REQUEST_SEQ_PREFIX = "request-seq:"
REQUEST_PAYLOAD_PREFIX = "request-payload:"

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

RETRY_SET_TYPE = "zset"
"""The Redis ``TYPE`` of the retry set and of its dead set (:func:`retry_dead`)."""

PAUSED_TYPE = "string"
"""The Redis ``TYPE`` of a queue's pause key ``<q>:paused`` (docs/protocol.md#pause)."""

CONSUMERS_TYPE = "zset"
"""The Redis ``TYPE`` of a queue's consumer registry ``<q>:consumers``
(docs/protocol.md#consumers)."""

CONSUMER_INFO_TYPE = "hash"
"""The Redis ``TYPE`` of a queue's ``<q>:consumer-info`` (docs/protocol.md#consumers)."""


def _as_bytes(key: str | bytes) -> bytes:
    return key if isinstance(key, bytes) else key.encode()


def hash_tag(key: str | bytes) -> bytes | None:
    """The hash tag of ``key`` as Redis Cluster reads it, or ``None`` when it has none.

    The tag is what lies between the first ``{`` and the first ``}`` after it, when that is
    not empty: ``"{a}b"`` -> ``b"a"``, ``"a{b}{c}"`` -> ``b"b"``, ``"{}a"`` and ``"a{b"``
    -> ``None``, ``"{{a}}"`` -> ``b"{a"``. ``str`` keys are UTF-8.
    """
    data = _as_bytes(key)
    start = data.find(b"{")
    if start < 0:
        return None
    end = data.find(b"}", start + 1)
    if end <= start + 1:
        return None
    return data[start + 1 : end]


def cluster_layout(store: Store) -> bool:
    """Whether ``store`` talks to a Redis Cluster (``store.mode == "cluster"``), so the
    cluster key layout applies (docs/topology.md#cluster-key-layout); standalone and
    sentinel, and a store without the attribute, use the standalone names
    (docs/protocol.md#keys)."""
    return getattr(store, "mode", "standalone") == "cluster"


def slot_key(name: str) -> str:
    """``name`` itself when it already has a hash tag, else ``"{" + name + "}"``: the prefix
    of every cluster key derived from ``name``, which therefore hashes to ``name``'s slot
    (``"q"`` -> ``"{q}"``, ``"{t}:q"`` -> ``"{t}:q"``; docs/topology.md#cluster-key-layout)."""
    return name if hash_tag(name) is not None else "{" + name + "}"


def cluster_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a queue or a result list in cluster mode, else ``None``.

    Its derived keys (``slot_key(name) + suffix``) must share its slot. That fails for a
    name without a hash tag that holds a ``}`` (``"a}b"``, ``"{}:q"``): wrapped as
    ``{a}b}`` its tag would be ``a``, and no other prefix hashes like the whole name
    (docs/topology.md#cluster-key-layout).
    """
    if key_slot(slot_key(name) + ":x") == key_slot(name):
        return None
    return (
        f"{name!r} cannot be used in cluster mode: it holds a '}}' but no hash tag, so no "
        "other key can share its slot; give it a hash tag ({tenant}:...) or drop the '}' "
        "(docs/topology.md#cluster-key-layout)"
    )


def outbox_field(request_id: str, token: str) -> str:
    """The ``{q}:outbox`` field of one record on its way to its list: ``<id>\\0<token>``
    (the ownership token of the claim it finishes; docs/topology.md#cluster-key-layout)."""
    return f"{request_id}\0{token}"


@dataclass(frozen=True, slots=True)
class QueueKeys:
    """The keys of one queue ``<q>`` (docs/protocol.md#keys,
    docs/topology.md#cluster-key-layout).

    Attributes:
        pending: ZSET of envelopes scored by deadline (Unix seconds).
        claimed: HASH ``<id>`` -> claimed member bytes, ``<id>:score`` -> original score.
        owners: HASH ``<id>`` -> ownership token (hex) of the live claim.
        index: ZSET ``<id>`` scored by lease expiry (Unix seconds, Redis server clock).
        deliveries: HASH ``<id>`` -> redelivery count (docs/protocol.md#reclaim).
        dead: ZSET of dead-lettered member bytes scored by the time they died.
        paused: STRING, present while the queue is paused (``claimkit pause``): JSON
            ``{"since": <Unix seconds, server clock>, "reason": <text or null>}`` plus
            ``"until"`` when it resumes by itself (docs/protocol.md#pause). Consumers claim
            nothing new from the queue while it exists, whatever it holds.
        consumers: ZSET, the consumer registry (docs/protocol.md#consumers): member a
            consumer id, score its liveness expiry (Unix seconds, Redis server clock,
            float), renewed by its heartbeat. A consumer whose claims a reclaimer already
            handed on keeps its entry with the score negated (``-expiry``) until it is
            forgotten.
        consumer_info: HASH consumer id -> JSON ``{"host", "pid", "started" (Unix seconds,
            server clock), "version"}`` (docs/protocol.md#consumers).
        retry_set: the retry ZSET this queue parks into (docs/protocol.md#park-for-retry):
            standalone, the shared ``retry_queue_name``; cluster, the queue's own
            ``{q}:<retry_queue_name>``.
        retry_dead: where the retry mover puts members of :attr:`retry_set` it cannot
            route (``<retry set>:dead``).
        outbox: cluster only (``None`` standalone): HASH ``<id>\\0<token>`` -> a record on
            its way to a result list of another slot, as cjson
            ``{"list", "request_token", "record", "id"}``.
    """

    pending: str
    claimed: str
    owners: str
    index: str
    deliveries: str
    dead: str
    paused: str
    consumers: str
    consumer_info: str
    retry_set: str = DEFAULT_RETRY_SET
    retry_dead: str = DEFAULT_RETRY_SET + ":dead"
    outbox: str | None = None

    TYPES: ClassVar[tuple[tuple[str, str, str], ...]] = (
        ("pending", PENDING_TYPE, "queue key"),
        ("claimed", "hash", "claimed hash"),
        ("owners", "hash", "claim-owners hash"),
        ("index", "zset", "claims index"),
        ("deliveries", "hash", "deliveries hash"),
        ("dead", "zset", "dead set"),
        ("paused", PAUSED_TYPE, "pause key"),
        ("consumers", CONSUMERS_TYPE, "consumer registry"),
        ("consumer_info", CONSUMER_INFO_TYPE, "consumer-info hash"),
    )
    """The one table of what each per-queue key holds (docs/protocol.md#keys):
    ``(attribute, Redis TYPE name, what the key is in one-line errors)``, in key order."""

    CLUSTER_TYPES: ClassVar[tuple[tuple[str, str, str], ...]] = (
        ("outbox", "hash", "outbox hash"),
        ("retry_set", RETRY_SET_TYPE, "retry set"),
        ("retry_dead", RETRY_SET_TYPE, "retry dead set"),
    )
    """What the cluster layout adds to :attr:`TYPES`, per queue
    (docs/topology.md#cluster-key-layout)."""

    @property
    def cluster(self) -> bool:
        """Whether these are the cluster layout's names."""
        return self.outbox is not None

    def _table(self) -> tuple[tuple[str, str, str], ...]:
        return self.TYPES + self.CLUSTER_TYPES if self.cluster else self.TYPES

    def types(self) -> dict[str, str]:
        """The Redis ``TYPE`` of each of these keys, by key name (``{"q": "zset", ...}``):
        the nine of :attr:`TYPES`, and in the cluster layout the queue's outbox and retry
        sets too (the shared standalone retry set is not one queue's key)."""
        return {getattr(self, attr): kind for attr, kind, _what in self._table()}

    def described(self) -> list[tuple[str, str, str]]:
        """``(key name, Redis TYPE name, what it is)`` for each key of :meth:`types`, in key
        order: ``("q:claimed", "hash", "claimed hash")``."""
        return [(getattr(self, attr), kind, what) for attr, kind, what in self._table()]

    @classmethod
    def for_queue(
        cls, queue: str, *, cluster: bool = False, retry_set: str = DEFAULT_RETRY_SET
    ) -> QueueKeys:
        """The keys of ``queue``: standalone, ``<q>:claimed`` etc. and the shared
        ``retry_set``; with ``cluster``, ``slot_key(q) + suffix`` for each private key,
        the outbox ``{q}:outbox`` and the queue's own ``{q}:<retry_set>``
        (docs/topology.md#cluster-key-layout). The pending key is ``queue`` either way."""
        base = slot_key(queue) if cluster else queue
        retry = f"{base}:{retry_set}" if cluster else retry_set
        return cls(
            pending=queue,
            claimed=f"{base}:claimed",
            owners=f"{base}:claim-owners",
            index=f"{base}:claims-idx",
            deliveries=f"{base}:deliveries",
            dead=f"{base}:dead",
            paused=f"{base}:paused",
            consumers=f"{base}:consumers",
            consumer_info=f"{base}:consumer-info",
            retry_set=retry,
            retry_dead=retry_dead(retry),
            outbox=f"{base}:outbox" if cluster else None,
        )


RESULT_TERMINAL_HASH_SUFFIX = ":result-terminal"
RESULT_TERMINAL_EXPIRY_SUFFIX = ":result-terminal-expiry"


@dataclass(frozen=True, slots=True)
class ResultKeys:
    """A destination list and, in the cluster layout, its dedup markers, all in the list's
    slot (docs/topology.md#cluster-key-layout).

    Attributes:
        results: the result LIST ``L`` (its name unchanged).
        terminal: HASH ``{L}:result-terminal``: ``<id>`` -> the request's
            ``request_token``, or ``"1"`` when it has none (standalone's
            ``result-terminal:<id>`` value rule).
        expiry: ZSET ``{L}:result-terminal-expiry``: ``<id>`` scored by when its marker
            expires (Unix seconds, server clock); no entry when markers never expire
            (``result_dedup_ttl_seconds`` = 0). A marker whose expiry passed is absent.
    """

    results: str
    terminal: str
    expiry: str

    TYPES: ClassVar[tuple[tuple[str, str, str], ...]] = (
        ("results", "list", "result list"),
        ("terminal", "hash", "result-terminal hash"),
        ("expiry", "zset", "result-terminal expiry set"),
    )
    """``(attribute, Redis TYPE name, what the key is in one-line errors)``, in key order."""

    def types(self) -> dict[str, str]:
        """The Redis ``TYPE`` of each of these keys, by key name."""
        return {getattr(self, attr): kind for attr, kind, _what in self.TYPES}

    def described(self) -> list[tuple[str, str, str]]:
        """``(key name, Redis TYPE name, what it is)`` for each of these keys, in key order."""
        return [(getattr(self, attr), kind, what) for attr, kind, what in self.TYPES]

    @classmethod
    def for_list(cls, name: str) -> ResultKeys:
        """The keys of destination list ``name``: ``slot_key(name)`` + the two suffixes."""
        base = slot_key(name)
        return cls(
            results=name,
            terminal=base + RESULT_TERMINAL_HASH_SUFFIX,
            expiry=base + RESULT_TERMINAL_EXPIRY_SUFFIX,
        )


RESULT_CLAIMED_SUFFIX = ":result-claimed"
RESULT_CLAIM_OWNERS_SUFFIX = ":result-claim-owners"
RESULT_CLAIMS_INDEX_SUFFIX = ":result-claims-idx"
RESULT_ACK_TOMBSTONES_SUFFIX = ":result-ack-tombstones"

RESULT_TOMBSTONE_TTL_MS = 604_800_000
"""How long an acked result's tombstone lives, and the ``PEXPIRE`` each ack sets on the
tombstone set: 7 days, in milliseconds (docs/results.md#keys)."""


@dataclass(frozen=True, slots=True)
class ResultClaimKeys:
    """A result list and the four keys of its durable readers (docs/results.md#keys), the
    names llm-d-async's result readers use.

    Standalone (and sentinel) they are ``L:result-claimed`` etc.; in the cluster layout
    ``slot_key(L) + suffix`` (``{L}:result-claimed``; a tagged name is not wrapped again),
    so every key shares the list's slot (docs/topology.md#cluster-key-layout). The list
    keeps its name in both.

    Attributes:
        results: the result LIST ``L``: publishers ``LPUSH``, readers take the right end.
        claimed: HASH claim id -> the exact record bytes a reader holds under a lease.
        owners: HASH claim id -> the owner token of the reader that holds it.
        index: ZSET claim id scored by lease expiry (Unix milliseconds, Redis server clock).
        tombstones: ZSET claim id of an acked result scored by when its tombstone expires
            (Unix milliseconds, Redis server clock; :data:`RESULT_TOMBSTONE_TTL_MS` after
            the ack).
    """

    results: str
    claimed: str
    owners: str
    index: str
    tombstones: str

    TYPES: ClassVar[tuple[tuple[str, str, str], ...]] = (
        ("results", "list", "result list"),
        ("claimed", "hash", "result-claimed hash"),
        ("owners", "hash", "result-claim-owners hash"),
        ("index", "zset", "result claims index"),
        ("tombstones", "zset", "result ack tombstones"),
    )
    """``(attribute, Redis TYPE name, what the key is in one-line errors)``, in key order
    (the order the result scripts declare them)."""

    def types(self) -> dict[str, str]:
        """The Redis ``TYPE`` of each of these keys, by key name."""
        return {getattr(self, attr): kind for attr, kind, _what in self.TYPES}

    def described(self) -> list[tuple[str, str, str]]:
        """``(key name, Redis TYPE name, what it is)`` for each of these keys, in key order."""
        return [(getattr(self, attr), kind, what) for attr, kind, what in self.TYPES]

    def all(self) -> list[str]:
        """The five key names in key order: the list, then the four reader keys."""
        return [getattr(self, attr) for attr, _kind, _what in self.TYPES]

    def reader_state(self) -> list[str]:
        """The four keys durable readers write (every key but the list): while any exists,
        a destructive pop of the list is refused
        (docs/results.md#never-mix-popping-and-durable-readers)."""
        return self.all()[1:]

    @classmethod
    def for_list(cls, name: str, *, cluster: bool = False) -> ResultClaimKeys:
        """The keys of result list ``name``: ``name + suffix`` standalone, ``slot_key(name)
        + suffix`` with ``cluster`` (docs/topology.md#cluster-key-layout).

        Raises:
            ValueError: with ``cluster``, ``name`` is one whose derived keys cannot share
                its slot (:func:`cluster_name_problem`).
        """
        if cluster:
            problem = cluster_name_problem(name)
            if problem is not None:
                raise ValueError(f"result list {problem}")
        base = slot_key(name) if cluster else name
        return cls(
            results=name,
            claimed=base + RESULT_CLAIMED_SUFFIX,
            owners=base + RESULT_CLAIM_OWNERS_SUFFIX,
            index=base + RESULT_CLAIMS_INDEX_SUFFIX,
            tombstones=base + RESULT_ACK_TOMBSTONES_SUFFIX,
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


def request_seq(queue: str, deadline: int, *, cluster: bool = False) -> str:
    """The enqueue-order counter of ``queue``'s requests of one ``deadline`` (Unix seconds;
    docs/protocol.md#enqueue-order): ``request-seq:<q>:<deadline>``; in the cluster layout
    ``request-seq:`` + ``slot_key(q)`` + ``:<deadline>`` (``request-seq:{q}:1900000000``),
    in the queue's slot (docs/topology.md#cluster-key-layout). A STRING holding a count."""
    return f"{request_seq_prefix(queue, cluster=cluster)}{deadline}"


def request_seq_prefix(queue: str, *, cluster: bool = False) -> str:
    """What every counter of ``queue`` (:func:`request_seq`) starts with:
    ``request-seq:<q>:``, in the cluster layout ``request-seq:`` + ``slot_key(q)`` + ``:``
    (``claimkit acl`` grants ``~<prefix>*``)."""
    base = slot_key(queue) if cluster else queue
    return f"{REQUEST_SEQ_PREFIX}{base}:"


def request_payload(request_id: str, request_token: str) -> str:
    """The key holding the payload of one request generation, when its member names it in
    ``internal.payload_ref`` instead of carrying it: ``request-payload:<id>:<request_token>``
    (STRING, the payload's exact bytes, with a TTL; llm-d-async's name, the same in every
    topology: it hashes to its own slot on a cluster; docs/protocol.md#payload-references)."""
    return f"{REQUEST_PAYLOAD_PREFIX}{request_id}:{request_token}"


def claimed_score_field(request_id: str) -> str:
    """The ``<q>:claimed`` field holding a claim's original pending score."""
    return request_id + ":score"


def retry_dead(retry_set: str) -> str:
    """Where the retry mover puts a member it cannot route (claimkit addition)."""
    return retry_set + ":dead"


RESULT_LIST_TYPE = "list"
"""The Redis ``TYPE`` of a result list (docs/protocol.md#keys)."""

GATE_BUDGET_TYPE = "string"
"""The Redis ``TYPE`` of a ``redis`` gate's budget key (docs/configuration.md)."""


def reserved_keys(
    queues: Iterable[str], retry_set: str, *, cluster: bool = False
) -> frozenset[str]:
    """The keys claimkit keeps as something other than a result list, for ``queues`` and
    ``retry_set``: every per-queue key (:class:`QueueKeys`, in the cluster layout when
    ``cluster``: outbox and per-queue retry sets included) and both shared retry sets.

    A request's ``internal.result_queue_name`` must not name one of these, nor a key with
    one of the per-request prefixes (:func:`is_reserved`): while such a key is empty it does
    not exist, and the record's ``LPUSH`` would re-create it as a list, breaking it for
    every request that follows.
    """
    out = {retry_set, retry_dead(retry_set)}
    for queue in queues:
        out.update(QueueKeys.for_queue(queue, cluster=cluster, retry_set=retry_set).types())
    return frozenset(out)


_PER_LIST_SUFFIXES = (
    RESULT_TERMINAL_HASH_SUFFIX,
    RESULT_TERMINAL_EXPIRY_SUFFIX,
    RESULT_CLAIMED_SUFFIX,
    RESULT_CLAIM_OWNERS_SUFFIX,
    RESULT_CLAIMS_INDEX_SUFFIX,
    RESULT_ACK_TOMBSTONES_SUFFIX,
)
"""The suffixes of the keys kept beside a result list (its dedup markers in the cluster
layout, its durable readers' keys): a name ending in one is never itself a result list."""


def is_reserved(name: str, reserved: frozenset[str]) -> bool:
    """Whether ``name`` is a key of ``reserved``, a per-request key (``result-terminal:``,
    ``request-active:``, ``request-cancel:``, ``request-seq:``, ``request-payload:``) or a
    key kept beside a result list (a name ending ``:result-claimed``,
    ``:result-ack-tombstones``, ... docs/results.md#keys)."""
    return (
        name in reserved
        or name.startswith(
            (
                RESULT_TERMINAL_PREFIX,
                REQUEST_ACTIVE_PREFIX,
                REQUEST_CANCEL_PREFIX,
                REQUEST_SEQ_PREFIX,
                REQUEST_PAYLOAD_PREFIX,
            )
        )
        or name.endswith(_PER_LIST_SUFFIXES)
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
