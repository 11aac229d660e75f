"""The narrowest Redis ACL rule a configuration needs, per role (``claimkit acl``).

Three roles, each the commands and keys of the claimkit commands it runs:

- ``consumer``: ``claimkit serve``.
- ``producer``: ``claimkit submit``, ``cancel`` and ``results`` (``Producer``).
- ``operator``: ``inspect``, ``drain``, ``reclaim``, ``dead``, ``results``, ``cancel``,
  ``pause``, ``resume``.

Every key pattern comes from the key builder (:mod:`claimkit.protocol.keys`) and the gate
parameters (:func:`claimkit.config.gate_params.budget_key`), and the commands a role's Lua
scripts call are read from the scripts themselves, so the rule follows the code. A record a
request routes to a list of its own (``internal.result_queue_name``) needs that list granted
too (``extra_lists``). See ``docs/security.md``.

The key layout is the configuration's ``mode``: on a Redis Cluster (``mode: cluster``) the
per-queue keys are ``{q}:claimed``... with the queue's outbox and own retry sets, each result
list's dedup markers are ``{L}:result-terminal`` and ``{L}:result-terminal-expiry`` (no
``result-terminal:*``), and a list's durable-reader keys are ``{L}:result-claimed`` etc.
(docs/topology.md#cluster-key-layout). An ACL is per node: the rule goes to every node.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from claimkit.config.gate_params import budget_key
from claimkit.protocol import keys as _keys
from claimkit.protocol.operator import script_source

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from claimkit.config import Config

__all__ = ["ROLES", "AclRule", "acl_rule"]

ROLES = ("consumer", "producer", "operator")

# Commands claimkit sends itself, by role (the Lua scripts' own commands are added from
# their sources). EVAL goes with EVALSHA: a script Redis does not hold (after a restart or
# SCRIPT FLUSH) is sent again whole, which also loads it. MULTI/EXEC wrap the atomic reads
# and writes; claimkit never sends them when a role has no transaction.
_COMMANDS: dict[str, tuple[str, ...]] = {
    # serve: key-type preflight, peek (with GET of the pause key), backlog gauge, the redis
    # gate's budget, payload fetch (MGET of request-payload:* keys), scripts.
    "consumer": tuple("INFO EVALSHA EVAL TYPE ZRANGE ZCARD GET MGET".split()),
    # submit (TIME, TYPE, then its script; on a cluster DEL and SET, then the script),
    # cancel (TYPE, GET in MULTI/EXEC, SET), results (LRANGE; --pop and --follow: the
    # result scripts).
    "producer": tuple("INFO EVALSHA EVAL TIME TYPE MULTI EXEC DEL SET GET LRANGE".split()),
    # inspect, drain, reclaim, dead list/requeue/purge, results, cancel, pause (TIME, SET,
    # GET), resume (GETDEL).
    "operator": tuple(
        "INFO EVALSHA EVAL TIME TYPE MULTI EXEC ZCARD ZRANGE LLEN HMGET HKEYS ZMSCORE ZREM "
        "ZREMRANGEBYSCORE DEL SET GET GETDEL LRANGE".split()
    ),
}
# The Lua scripts each role runs; the commands they call are read from their sources.
# `results --pop` and `--follow` (durable reading, docs/results.md) run the result scripts.
_RESULT_SCRIPTS = ("result-receive", "result-renew", "result-ack", "result-pop")
_SCRIPTS: dict[str, tuple[str, ...]] = {
    "consumer": tuple(
        "claim ack renew release reclaim park move-retries dead-letter register "
        "expire-owners forget-consumers queue-stats".split()
    ),
    "producer": ("submit", *_RESULT_SCRIPTS),
    "operator": (
        "inspect",
        "release",
        "reclaim",
        "expire-owners",
        "consumers",
        "forget-consumers",
        "queue-stats",
        "requeue-dead",
        "result-inspect",
        *_RESULT_SCRIPTS,
    ),
}
# On a Redis Cluster (docs/topology.md#cluster-key-layout) every client reads the
# cluster's slot map (CLUSTER SLOTS) and follows an ASK redirect (ASKING) while a slot
# migrates; the consumer and the reclaim run finish outbox entries (HSCAN a page, HDEL the
# pushed), and the consumer deletes the payload keys of the requests an ack ended (DEL:
# they live in other slots, docs/topology.md#payload-keys); inspect reads the outbox's
# size (HLEN); cancel reads the record's marker in its list's marker hash (HGET) and its
# expiry (ZSCORE). The scripts are the cluster variants: acks in one slot or through the
# outbox, per-list markers, per-queue retry sets; dead requeue deletes markers in each
# list's slot.
_CLUSTER_CLIENT = ("CLUSTER|SLOTS", "ASKING")
_CLUSTER_COMMANDS: dict[str, tuple[str, ...]] = {
    "consumer": (*_CLUSTER_CLIENT, "HSCAN", "HDEL", "DEL"),
    "producer": (*_CLUSTER_CLIENT, "HGET", "ZSCORE"),
    "operator": (*_CLUSTER_CLIENT, "HLEN", "HSCAN", "HDEL", "HGET", "ZSCORE"),
}
_CLUSTER_SCRIPTS: dict[str, tuple[str, ...]] = {
    "consumer": tuple(
        "claim renew ack-local ack-outbox push-result outbox-aim park release "
        "reclaim-cluster move-retries-queue dead-letter-outbox register expire-owners "
        "forget-consumers queue-stats".split()
    ),
    "producer": ("enqueue", *_RESULT_SCRIPTS),
    "operator": (
        *"inspect release reclaim-cluster push-result outbox-aim requeue-dead drop-markers".split(),
        *"expire-owners consumers forget-consumers queue-stats".split(),
        "result-inspect",
        *_RESULT_SCRIPTS,
    ),
}
# With wait_replicas set, every call of a writing script is followed by WAIT
# (docs/topology.md#failover): the consumer's, submit's, drain's and reclaim's, and the
# durable result reader's (results --follow, --pop).
_WAITS = ("consumer", "producer", "operator")
# A command a script calls: named in the call, or in a table of commands (the key guard's
# ``{ zset = 'ZCARD', ... }``).
_LUA_CALL = re.compile(r"(?:redis\.p?call\(\s*|=\s*)['\"]([A-Z][A-Za-z]+)['\"]")
_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")
_GLOB_SPECIAL_BRACES = re.compile(r"([*?\[\]\\{}])")


@dataclass(frozen=True, slots=True)
class AclRule:
    """One role's rule.

    Attributes:
        role: ``consumer``, ``producer`` or ``operator``.
        commands: lower-case command names, sorted.
        keys: key patterns without the ``~``, in the order claimkit names them.
    """

    role: str
    commands: tuple[str, ...]
    keys: tuple[str, ...]

    def rule(self) -> str:
        """The ACL rule string: ``resetkeys resetchannels -@all +cmd ... ~key ...``."""
        parts = ["resetkeys", "resetchannels", "-@all"]
        parts += [f"+{c}" for c in self.commands]
        parts += [f"~{k}" for k in self.keys]
        return " ".join(parts)

    def setuser(self, user: str) -> str:
        """``ACL SETUSER <user> on <rule>`` (the password is set apart: ``>password``)."""
        return f"ACL SETUSER {user} on {self.rule()}"


def _glob(name: str, *, braces: bool = False) -> str:
    """``name`` as an ACL key pattern matching only itself, but for white space: Redis
    refuses a pattern with a space ("Syntax error"), so each white-space character becomes
    ``?`` (any one character), the narrowest pattern Redis takes for such a name. With
    ``braces`` (the cluster layout, whose names carry hash tags) ``{`` and ``}`` are
    escaped too: ``\\{q\\}:claimed`` reads as the exact name it is."""
    special = _GLOB_SPECIAL_BRACES if braces else _GLOB_SPECIAL
    escaped = special.sub(r"\\\1", name)
    return "".join("?" if c.isspace() else c for c in escaped)


def _lua_commands(names: Iterable[str]) -> set[str]:
    return {m.upper() for name in names for m in _LUA_CALL.findall(script_source(name))}


def _reader_keys(role: str, lists: Sequence[str], *, cluster: bool) -> list[str]:
    """The durable-reader keys of ``lists`` (docs/results.md#keys), for the roles that read
    results (every role but the consumer): ``L:result-claimed`` etc., ``{L}:...`` on a
    cluster."""
    if role == "consumer":
        return []
    return [
        key
        for name in lists
        for key in _keys.ResultClaimKeys.for_list(name, cluster=cluster).reader_state()
    ]


def _request_prefixes(role: str) -> list[str]:
    """The per-request key prefixes ``role`` touches besides the dedup markers: the
    producer's active and cancel markers, and the payload keys: the consumer reads and
    deletes them, the producer writes them with ``submit --payload-ref``
    (docs/protocol.md#payload-references)."""
    prefixes = [_keys.REQUEST_ACTIVE_PREFIX, _keys.REQUEST_CANCEL_PREFIX]
    if role in ("consumer", "producer"):
        prefixes.append(_keys.REQUEST_PAYLOAD_PREFIX)
    return prefixes


def _queue_keys(
    queue: str, *, cluster: bool, retry_set: str, pending_only: bool = False
) -> list[str]:
    """The keys of ``queue`` a role touches, in key order: every per-queue key of the
    layout (standalone: the nine, the pause key and the consumer registry included;
    cluster: also the outbox and the queue's retry sets), or only the pending set."""
    keys = _keys.QueueKeys.for_queue(queue, cluster=cluster, retry_set=retry_set)
    if pending_only:
        return [keys.pending]
    return list(keys.types())


def _role_queue_keys(name: str, role: str, *, cluster: bool, retry_set: str) -> list[str]:
    """The patterns of queue ``name``'s keys ``role`` touches: the producer the pending set
    and its enqueue-order counters (``request-seq:<q>:*``, one per deadline), the others
    every per-queue key of the layout."""
    producer = role == "producer"
    keys = _queue_keys(name, cluster=cluster, retry_set=retry_set, pending_only=producer)
    patterns = [_glob(k, braces=cluster) for k in keys]
    if producer:
        patterns.append(
            _glob(_keys.request_seq_prefix(name, cluster=cluster), braces=cluster) + "*"
        )
    return patterns


def cluster_config(config: Config) -> bool:
    """Whether ``config`` names a Redis Cluster (``mode: cluster``), so its rules use the
    cluster key layout (docs/topology.md#cluster-key-layout)."""
    return config.mode == "cluster"


def acl_rule(
    config: Config,
    role: str,
    *,
    queues: Sequence[str] = (),
    extra_lists: Sequence[str] = (),
) -> AclRule:
    """The narrowest rule ``role`` needs for ``config``.

    Args:
        config: the transport config (queues, result lists, retry set, gates).
        role: one of :data:`ROLES`.
        queues: more queue names (``submit -q`` may name one the config does not list).
        extra_lists: more result lists (those requests route to themselves).

    Raises:
        ValueError: an unknown role, or a gate's parameters are invalid.
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    names = list(dict.fromkeys([*(q.queue_name for q in config.queues), *queues]))
    lists = [config.result_queue_name]
    lists += [q.result_queue_name for q in config.queues if q.result_queue_name]
    lists = list(dict.fromkeys([*lists, *extra_lists]))
    cluster = cluster_config(config)
    retry = config.retry_queue_name

    def glob(name: str) -> str:
        return _glob(name, braces=cluster)

    keys: list[str] = []
    for name in names:
        keys += _role_queue_keys(name, role, cluster=cluster, retry_set=retry)
    if role != "producer" and not cluster:  # a cluster has a retry set per queue (above)
        keys += [glob(retry), glob(_keys.retry_dead(retry))]
    keys += map(glob, lists)
    keys += map(glob, _reader_keys(role, lists, cluster=cluster))
    prefixes = _request_prefixes(role)
    if cluster:  # the dedup markers are per list, in its slot: exact names
        for name in lists:
            markers = _keys.ResultKeys.for_list(name)
            keys += [glob(markers.terminal), glob(markers.expiry)]
    else:
        prefixes.insert(0, _keys.RESULT_TERMINAL_PREFIX)
    keys += [glob(prefix) + "*" for prefix in prefixes]
    if role == "consumer":
        for q in config.queues:
            key = budget_key(q)
            if key is not None:
                keys.append(glob(key))
    if cluster:
        commands = {*_COMMANDS[role], *_CLUSTER_COMMANDS[role]}
        commands |= _lua_commands(_CLUSTER_SCRIPTS[role])
    else:
        commands = {*_COMMANDS[role], *_lua_commands(_SCRIPTS[role])}
    if config.wait_replicas > 0 and role in _WAITS:
        commands.add("WAIT")
    return AclRule(
        role=role,
        commands=tuple(sorted(c.lower() for c in commands)),
        keys=tuple(dict.fromkeys(keys)),
    )
