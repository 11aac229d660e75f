"""The consumer registry of a queue (docs/protocol.md#consumers): who consumes it, whether
each consumer is alive, and the fast failover that hands a dead consumer's claims on
(docs/protocol.md#fast-failover).

Each ``claimkit serve`` has a consumer id (:func:`default_consumer_id`). Per queue it
registers in ``<q>:consumers`` (ZSET, score = liveness expiry, Unix seconds on the Redis
server clock) and ``<q>:consumer-info`` (HASH, id -> JSON), and its heartbeat renews the
entry with the claims (``lua/renew-4.lua``). Every ownership token it writes starts with its
id (docs/protocol.md#ownership-tokens), so each claim names its consumer.

The scripts: ``lua/register-2.lua``, ``lua/renew-4.lua`` (through
:meth:`claimkit.protocol.ops.QueueOps.renew`), ``lua/expire-owners-3.lua``,
``lua/forget-consumers-2.lua`` and the read-only ``lua/consumers-3.lua``. Every key is the
queue's, so on a Redis Cluster each script touches one slot
(docs/topology.md#cluster-key-layout).
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from claimkit.protocol.store_calls import as_int
from claimkit.protocol.tokens import consumer_id_problem, token_time
from claimkit.store import reply_text
from claimkit.store.scripts import script

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from claimkit.protocol.keys import QueueKeys
    from claimkit.store import Arg, Store

__all__ = [
    "DEFAULT_LIVENESS_TTL_SECONDS",
    "EXPIRE_OWNERS_COUNT",
    "ConsumerEntry",
    "ConsumerIdentity",
    "RegistryView",
    "default_consumer_id",
    "expire_owners",
    "forget_consumers",
    "lapsed_consumers",
    "read_registry",
    "register",
]

DEFAULT_LIVENESS_TTL_SECONDS = 10.0
"""The default ``consumer_liveness_ttl_seconds`` (docs/configuration.md)."""

EXPIRE_OWNERS_COUNT = 500
"""``HSCAN ... COUNT`` of one ``lua/expire-owners-3.lua`` call: a page of the owners hash."""


def default_consumer_id(environ: Mapping[str, str] | None = None) -> str:
    """The consumer id when ``--consumer-id`` is not given (docs/cli.md#claimkit-serve):
    ``$CLAIMKIT_CONSUMER_ID``, else ``$POD_NAME``, else ``<host name>-<pid>``. Only the
    host name's characters a consumer id may hold are kept (``.``, ``_``, ``-``, letters,
    digits), and it is cut so the whole id fits 127 characters. The result is not
    checked; :func:`~claimkit.protocol.tokens.consumer_id_problem` does that."""
    env = os.environ if environ is None else environ
    for name in ("CLAIMKIT_CONSUMER_ID", "POD_NAME"):
        if env.get(name):
            return env[name]
    pid = str(os.getpid())
    host = "".join(c for c in socket.gethostname() if c.isascii() and (c.isalnum() or c in "._-"))
    host = host.lstrip("._-")[: 126 - len(pid)] or "claimkit"
    return f"{host}-{pid}"


@dataclass(frozen=True, slots=True)
class ConsumerIdentity:
    """Who a ``claimkit serve`` is, as its registry entry says (docs/protocol.md#consumers).

    Attributes:
        id: the consumer id (checked by :func:`consumer_id_problem`).
        liveness_ttl: ``consumer_liveness_ttl_seconds``, seconds, > 0: how far ahead of the
            server clock each renewal puts the liveness expiry.
        host: the host name.
        pid: the process id.
        version: claimkit's version.
    """

    id: str
    liveness_ttl: float
    host: str
    pid: int
    version: str

    def __post_init__(self) -> None:
        problem = consumer_id_problem(self.id)
        if problem is not None:
            raise ValueError(problem)
        if not self.liveness_ttl > 0:
            raise ValueError(f"liveness_ttl must be > 0 seconds, got {self.liveness_ttl}")

    @classmethod
    def here(cls, consumer_id: str, liveness_ttl: float, version: str) -> ConsumerIdentity:
        """This process: its host name and pid."""
        return cls(consumer_id, liveness_ttl, socket.gethostname(), os.getpid(), version)

    def args(self) -> list[Arg]:
        """The five script arguments ``lua/_liveness.lua`` reads: id, liveness ttl, host,
        pid, version."""
        return [self.id, repr(float(self.liveness_ttl)), self.host, self.pid, self.version]


async def register(
    store: Store, keys: QueueKeys, identity: ConsumerIdentity
) -> tuple[float, dict[str, Any] | None]:
    """Enter ``identity`` in the queue's registry (``lua/register-2.lua``): its liveness
    expiry becomes server_now + ``liveness_ttl`` and its info is replaced. Returns the
    server time (Unix seconds) and, when the entry was still alive and its info named
    another host or pid, that info (``host``, ``pid``, ``started``, ``version``): another
    live process under the same consumer id (docs/operations.md#consumers); else ``None``.

    Raises:
        StoreUnavailable, StoreError: from the store; safe to call again.
    """
    reply = await store.run(
        script("register"), [keys.consumers, keys.consumer_info], identity.args()
    )
    other = reply_text(reply[1])
    return float(reply_text(reply[0])), (_info(other)[0] or None) if other else None


async def expire_owners(
    store: Store,
    keys: QueueKeys,
    *,
    count: int = EXPIRE_OWNERS_COUNT,
    require_alive: bool = False,
) -> tuple[float, int | None]:
    """Fast failover on one queue (docs/protocol.md#fast-failover): cut to the server clock
    the leases of every claim whose consumer's liveness entry lapsed, so the reclaim run
    that follows redelivers them (a delivery, counted in ``<q>:deliveries`` like a lease
    expiry), and mark those consumers dead (score negated). One
    ``lua/expire-owners-3.lua`` cycle: a call that finds no lapsed consumer ends it at once;
    otherwise one call per ``count`` fields of ``<q>:claim-owners``. Returns
    ``(server_now, cut)``: the server time of the last call (Unix seconds) and how many
    leases were cut.

    With ``require_alive``, nothing is handed on when no consumer of the queue is alive
    (every entry lapsed: the signature of a Redis outage or failover, not of one dead
    consumer); ``cut`` is then ``None`` and the claims wait for their leases.

    The caller must know Redis has been answering for one liveness TTL (after an outage,
    live consumers could not renew either; docs/protocol.md#fast-failover).

    Raises:
        ValueError: ``count`` is below 1.
        StoreUnavailable, StoreError: from the store; the calls made stay applied and the
            next cycle finishes the work.

    Cancellation: each call is atomic; a cancelled cycle leaves the lapsed consumers
    unmarked, and the next cycle walks the hash again.
    """
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    cursor: Arg = "0"
    lapsed: list[Arg] = []
    cut = 0
    now = 0.0
    while True:
        reply = await store.run(
            script("expire-owners"),
            [keys.owners, keys.index, keys.consumers],
            [cursor, count, "if-alive" if require_alive else "any", *lapsed],
        )
        cut += as_int(reply[0])
        now = float(reply_text(reply[3]))
        if as_int(reply[4]):  # held back: no consumer is alive
            return now, None
        lapsed = [reply_text(v) for v in reply[5:]]
        cursor = reply_text(reply[1])
        if not lapsed or cursor == "0":
            return now, cut


async def lapsed_consumers(store: Store, keys: QueueKeys) -> int:
    """How many consumers of the queue a fast failover would hand on now (their liveness
    lapsed, not yet handled), writing nothing (``lua/expire-owners-3.lua``, "count"): what a
    reclaimer that skips the failover reports.

    Raises:
        StoreUnavailable, StoreError: from the store.
    """
    reply = await store.run(
        script("expire-owners"), [keys.owners, keys.index, keys.consumers], ["0", 1, "count"]
    )
    return as_int(reply[4])


async def forget_consumers(
    store: Store, keys: QueueKeys, ids: Sequence[str] = (), *, dead_only: bool = True
) -> list[str]:
    """Remove registry entries and their info (``lua/forget-consumers-2.lua``): with
    ``dead_only`` only those of ``ids`` whose liveness lapsed (all lapsed ones when ``ids``
    is empty), else every one of ``ids``. Returns the ids whose entries were removed.

    A dead consumer forgotten before a reclaimer handed its claims on keeps them until their
    leases lapse (docs/operations.md#consumers).

    Raises:
        StoreUnavailable, StoreError: from the store.
    """
    reply = await store.run(
        script("forget-consumers"),
        [keys.consumers, keys.consumer_info],
        ["dead" if dead_only else "any", *ids],
    )
    return [reply_text(v) for v in reply[1:]]


@dataclass(frozen=True, slots=True)
class ConsumerEntry:
    """One consumer as :func:`read_registry` saw it. Times are Unix seconds, server clock.

    Attributes:
        id: the consumer id.
        expires: its liveness expiry, or ``None`` when it has no registry entry (forgotten,
            or the registry was off) but holds claims.
        marked_dead: a reclaimer handed its claims on (its score was negated).
        info: its ``<q>:consumer-info`` JSON (``host``, ``pid``, ``started``,
            ``version``), ``{}`` when missing or unreadable.
        info_error: why its info could not be read (not JSON, not an object, a field of
            the wrong type), ``None`` when it is missing or fine.
        claims: the claims whose token names it.
        oldest_claim: the claim time of its oldest claim, from the token, or ``None``.
    """

    id: str
    expires: float | None
    marked_dead: bool
    info: dict[str, Any]
    claims: int
    oldest_claim: float | None
    info_error: str | None = None

    def alive(self, now: float) -> bool:
        """Its liveness entry is ahead of ``now`` (Unix seconds, server clock)."""
        return self.expires is not None and not self.marked_dead and self.expires > now


@dataclass(frozen=True, slots=True)
class RegistryView:
    """``lua/consumers-3.lua``'s read of one queue: its registry and who holds its claims.

    Attributes:
        server_now: the instant of the read, Unix seconds.
        consumers: registry entries first (earliest expiry first), then consumers holding
            claims with no entry, by id.
        unknown_claims: claims whose token names no consumer (from before consumer ids,
            or another program's).
        unknown_oldest: the claim time of the oldest of those, where its token tells.
        exact: ``False`` when the owners hash was larger than the scan bound (the claim
            counts are then lower bounds).
    """

    server_now: float
    consumers: tuple[ConsumerEntry, ...]
    unknown_claims: int
    unknown_oldest: float | None
    exact: bool


_INFO_TYPES: dict[str, tuple[type, ...]] = {
    "host": (str,),
    "pid": (int,),
    "started": (int, float),
    "version": (str,),
}


def _info(raw: Any) -> tuple[dict[str, Any], str | None]:
    """A consumer's info JSON and, when it is unreadable, why: ``({}, "not JSON")``,
    ``({}, "not a JSON object")``, or the readable fields and ``"host is not a string"``
    style problems for fields of the wrong type (those are left out)."""
    if raw is None:
        return {}, None
    try:
        doc = json.loads(reply_text(raw))
    except (ValueError, RecursionError):
        return {}, "not JSON"
    if not isinstance(doc, dict):
        return {}, "not a JSON object"
    problems = []
    for name, types in _INFO_TYPES.items():
        value = doc.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, types)):
            problems.append(f"{name} is not {'a string' if types == (str,) else 'a number'}")
            del doc[name]
    return doc, "; ".join(problems) or None


async def read_registry(store: Store, keys: QueueKeys, *, scan_max: int = 0) -> RegistryView:
    """Read the queue's registry and its claims' consumers, writing nothing
    (``lua/consumers-3.lua``, one instant of the server clock).

    Args:
        store: an open store.
        keys: the queue's keys, in the store's layout.
        scan_max: at most this many owner entries are read; 0 = every one.

    Raises:
        StoreUnavailable, StoreError: from the store.

    Cancellation: nothing is written, so a cancelled call leaves no trace.
    """
    reply = await store.run(
        script("consumers"), [keys.consumers, keys.consumer_info, keys.owners], [scan_max]
    )
    now = float(reply_text(reply[0]))
    unknown_oldest = None if reply[3] is None else token_time(reply_text(reply[3]))
    entries: list[ConsumerEntry] = []
    rest = reply[4:]
    for i in range(0, len(rest), 5):
        rid, score, info, claims, oldest = rest[i : i + 5]
        value = None if score is None else float(reply_text(score))
        doc, info_error = _info(info)
        entries.append(
            ConsumerEntry(
                id=reply_text(rid),
                expires=None if value is None else abs(value),
                marked_dead=value is not None and value < 0,
                info=doc,
                claims=as_int(claims),
                oldest_claim=None if oldest is None else token_time(reply_text(oldest)),
                info_error=info_error,
            )
        )
    return RegistryView(
        server_now=now,
        consumers=tuple(entries),
        unknown_claims=as_int(reply[2]),
        unknown_oldest=unknown_oldest,
        exact=bool(as_int(reply[1])),
    )
